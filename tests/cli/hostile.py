"""The real ``hettrain`` command line as a new process, and what a clean refusal of bad input
looks like: shared by the hostile-input tests (cli, profiles, data, simulator)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120  # generous: the 2 shared cores may be loaded; a hang is what this catches


def run_hettrain(argv: Sequence[str], cwd: Path, *, env: dict[str, str] | None = None,
                 path_first: Sequence[str] = (), **run: Any) -> subprocess.CompletedProcess[str]:
    """``hettrain ARGV`` as a new process in ``cwd``, this tree's code first on the path (after
    ``path_first``), ``env`` added to the environment; ``run`` goes to ``subprocess.run``
    (``input=``, ``stdout=``): stdout and stderr are captured unless ``stdout`` is given."""
    path = os.pathsep.join(p for p in (*path_first, str(ROOT / "operator"),
                                       os.environ.get("PYTHONPATH")) if p)
    pipes = {"stderr": subprocess.PIPE} if "stdout" in run else {"capture_output": True}
    return subprocess.run([sys.executable, "-m", "hettrain.cli", *map(str, argv)], text=True,
                          timeout=TIMEOUT_S, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": path, **(env or {})}, **pipes, **run)


def assert_clean_refusal(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 2, one short line on stderr starting ``error: ``, no traceback, every needle in
    it."""
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    assert err.startswith("error: ") and err.count("\n") == 1, err[-2000:]
    assert len(err) < 500, err
    for needle in needles:
        assert needle in err, (needle, err)
