"""A real Prometheus stack shared by the monitoring tests of one module."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from promserver import Prometheus, running_stack

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session", autouse=True)
def monitoring_tools() -> None:
    """promtool, prometheus and chromium (Debian), installed once by tools/install-lint-tools."""
    out = subprocess.run([str(ROOT / "tools" / "install-lint-tools")], capture_output=True,
                         text=True, timeout=900)
    if out.returncode != 0:
        pytest.fail(f"tools/install-lint-tools failed:\n{out.stderr[-3000:]}", pytrace=False)


@pytest.fixture(scope="session")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """Prometheus scraping the operator and two runtime ranks (real hettrain metric modules)."""
    tmp: Path = tmp_path_factory.mktemp("prometheus")
    with running_stack(tmp) as prom:
        yield prom
