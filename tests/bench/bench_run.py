"""Running a bench script as the user does (its own process, the source roots on the path) and
reading the whole / chunked table that bench/chunked_loss.py and bench/chunked_mlp.py print."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'operator'}{os.pathsep}{ROOT}"}


def run_bench(script: str, *args: str, timeout: int = 300) -> str:
    """``python bench/<script> args...``'s stdout; a non-zero exit fails the test."""
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args],
                          capture_output=True, text=True, env=ENV, timeout=timeout,
                          check=True).stdout


def variant_rows(out: str) -> dict[str, tuple[float, float, float]]:
    """``{"whole" | "chunked": (its three numbers)}`` from the table's variant rows."""
    return {m[1]: (float(m[2]), float(m[3]), float(m[4])) for m in re.finditer(
        r"^\s*(whole|chunked)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)}
