"""Run a plan with real local processes and read its loss log (the multi-process tests)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from hettrain.runtime.launch import launch_local, wait_all
from hettrain.runtime.trainer import reference_losses


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


@dataclass
class SgdRun:
    """A plan trained with SGD by real processes (``got``: losses by step, checkpoints under
    ``ckpt``, summaries under ``workdir/summary``) and its single-process reference
    (``ref``: losses, ``final``: parameters by global name, ``validation``: losses by step)."""

    got: dict[int, float]
    ref: list[float]
    final: dict[str, torch.Tensor]
    validation: dict[int, float]
    ckpt: Path


def sgd_run_and_reference(plan, workdir: Path, timeout: float = 240,
                          env: dict[str, str] | None = None) -> SgdRun:
    """Train ``plan`` with SGD, one checkpoint at the end, loss log and per-rank summaries
    (every rank must exit 0; ``env``: more runtime settings), and run the single-process
    reference of the same steps."""
    ckpt = workdir / "ckpt"
    env = {"HETTRAIN_METRICS_PORT": "0", "HETTRAIN_SUMMARY_DIR": str(workdir / "summary"),
           "HETTRAIN_CHECKPOINT_URI": f"file://{ckpt}", "HETTRAIN_CHECKPOINT_INTERVAL": "100",
           "HETTRAIN_OPTIMIZER": "sgd", **(env or {})}
    got = run_losses(plan, workdir, env, workdir / "loss.jsonl", timeout)
    final: dict[str, torch.Tensor] = {}
    validation: dict[int, float] = {}
    ref = reference_losses(plan, plan.training.steps, optimizer="sgd", final=final,
                           validation=validation)
    return SgdRun(got, ref, final, validation, ckpt)
