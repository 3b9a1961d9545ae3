"""Run a plan with real local processes and read its loss log (the multi-process tests)."""

from __future__ import annotations

import json
from pathlib import Path

from hettrain.runtime.launch import launch_local, wait_all


def losses_of(path: Path) -> dict[int, float]:
    """``{step: loss}`` of a ``HETTRAIN_LOSS_LOG`` file."""
    return {d["step"]: d["loss"] for d in map(json.loads, path.read_text().splitlines())}


def rank_logs(workdir: Path, tail: int = 3000) -> str:
    """The end of every rank's log (for a failed run's assertion message)."""
    return "\n".join(p.read_text()[-tail:] for p in sorted(workdir.glob("rank-*.log")))


def run_losses(plan, workdir: Path, env: dict[str, str], log: Path,
               timeout: float = 300) -> dict[int, float]:
    """Train ``plan`` (every rank must exit 0) and return its losses by step."""
    codes = wait_all(launch_local(plan, workdir, {**env, "HETTRAIN_LOSS_LOG": str(log)}),
                     timeout)
    assert codes == [0] * plan.world_size, rank_logs(workdir)
    return losses_of(log)
