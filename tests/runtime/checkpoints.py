"""Checkpoint helpers shared by the runtime tests."""

from __future__ import annotations

import shutil
from pathlib import Path


def rewind(root: Path, step: int) -> None:
    """As if the run had died right after checkpoint ``step``: delete every newer one.

    (The ``latest`` file is only a hint; readers take the newest committed checkpoint.)
    """
    assert (root / f"step-{step}" / "COMMITTED").exists(), sorted(p.name for p in root.iterdir())
    for p in root.glob("step-*"):
        if int(p.name.removeprefix("step-").removesuffix(".tmp")) > step:
            shutil.rmtree(p)
