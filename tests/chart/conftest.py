"""Fixtures for the chart checks: the pinned helm and the isolated lint-tool venv."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "hettrain-operator"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))


def _script_last_line(name: str) -> Path:
    out = subprocess.run([str(ROOT / "tools" / name)], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        pytest.fail(f"tools/{name} failed:\n{out.stderr[-3000:]}", pytrace=False)
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def helm() -> Path:
    """Path of the pinned helm v4 binary (installed by e2e/cluster/build on first use)."""
    return _script_last_line("ensure-helm")


@pytest.fixture(scope="session")
def lint_bin() -> Path:
    """bin/ of the isolated lint venv (kubernetes-validate, checkov, yamllint, hadolint)."""
    return _script_last_line("install-lint-tools")
