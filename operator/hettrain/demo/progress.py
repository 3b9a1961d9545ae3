"""Numbered demo steps with elapsed times: ``[1/9] control plane up ... ok 4.1 s``."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any


class Progress:
    """Prints one header per step, indented detail lines, and the step's outcome and time.

    Uses rich (colours on a terminal) when it is installed, plain text otherwise.
    """

    def __init__(self, total: int, out: IO[str] | None = None) -> None:
        self.total = total
        self.index = 0
        self.out = out or sys.stdout
        self.t0 = time.monotonic()
        self.console: Any = None
        try:
            from rich.console import Console

            tty = hasattr(self.out, "isatty") and self.out.isatty()
            self.console = Console(file=self.out, highlight=False, soft_wrap=True,
                                   width=None if tty else 120)
        except ImportError:  # pragma: no cover - rich ships with the viz/operator extras
            self.console = None

    def _print(self, text: str, style: str | None = None) -> None:
        if self.console is not None:
            self.console.print(text, style=style, markup=False)
        else:
            print(text, file=self.out)
        self.out.flush()

    def info(self, text: str) -> None:
        """One indented detail line under the current step."""
        for line in str(text).splitlines() or [""]:
            self._print(f"      {line}")

    def raw(self, renderable: Any) -> None:
        """Print a rich renderable (a table) or text as is."""
        if self.console is not None and not isinstance(renderable, str):
            self.console.print(renderable)
        else:
            print(renderable, file=self.out)
        self.out.flush()

    @contextmanager
    def step(self, title: str) -> Iterator[None]:
        """``with progress.step("..."):`` numbered header, then ``ok`` / ``FAILED`` + seconds."""
        self.index += 1
        t0 = time.monotonic()
        self._print(f"[{self.index}/{self.total}] {title} ...", style="bold cyan")
        try:
            yield
        except BaseException as exc:
            what = "interrupted" if isinstance(exc, KeyboardInterrupt) else "FAILED"
            self._print(f"[{self.index}/{self.total}] {title}: {what} after "
                        f"{time.monotonic() - t0:.1f} s", style="bold red")
            raise
        self._print(f"[{self.index}/{self.total}] {title}: ok {time.monotonic() - t0:.1f} s "
                    f"(total {time.monotonic() - self.t0:.1f} s)", style="green")
