"""A real Prometheus stack shared by the monitoring tests of one module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from promserver import Prometheus, running_stack


@pytest.fixture(scope="session")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """Prometheus scraping the operator and two runtime ranks (real hettrain metric modules)."""
    tmp: Path = tmp_path_factory.mktemp("prometheus")
    with running_stack(tmp) as prom:
        yield prom
