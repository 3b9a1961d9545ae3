"""Every process the demo starts, and their shutdown (Ctrl-C, SIGTERM, errors, normal end)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType


@dataclass
class Children:
    """Processes to stop and cleanup callbacks to run, newest first, exactly once."""

    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    cleanups: list[tuple[str, Callable[[], None]]] = field(default_factory=list)
    log: Callable[[str], None] = print

    def add(self, name: str, proc: subprocess.Popen) -> subprocess.Popen:
        """Track a child process."""
        self.procs.append((name, proc))
        return proc

    def on_cleanup(self, name: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` at shutdown (after the processes started later are stopped)."""
        self.cleanups.append((name, fn))

    def stop(self, procs: list[subprocess.Popen], grace: float = 5.0) -> None:
        """TERM the processes (their process group when they lead one), KILL after ``grace``."""
        for p in procs:
            if p.poll() is None:
                _signal(p, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.05, deadline - time.monotonic()))
        for p in procs:
            if p.poll() is None:
                _signal(p, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)
        alive = {id(p) for p in procs}
        self.procs = [(n, p) for n, p in self.procs if id(p) not in alive]

    def shutdown(self) -> None:
        """Stop every tracked process, then run the cleanups (newest first)."""
        self.stop([p for _, p in reversed(self.procs)])
        while self.cleanups:
            name, fn = self.cleanups.pop()
            try:
                fn()
            except Exception as exc:  # keep cleaning up the rest
                self.log(f"cleanup {name} failed: {exc}")


def _signal(p: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if _leads_group(p):
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)


def _leads_group(p: subprocess.Popen) -> bool:
    try:
        return os.getpgid(p.pid) == p.pid
    except ProcessLookupError:
        return False


@contextmanager
def interrupts_as_keyboard_interrupt() -> Iterator[None]:
    """SIGTERM/SIGHUP raise KeyboardInterrupt like Ctrl-C, so ``finally`` blocks clean up."""

    def raise_interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    old = {s: signal.signal(s, raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextmanager
def no_interrupts() -> Iterator[None]:
    """Ignore Ctrl-C/SIGTERM while shutting down, so a second Ctrl-C cannot cut cleanup short."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
