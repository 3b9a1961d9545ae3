"""The planned ranks as local CPU processes (gloo), with their losses streamed as they come."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hettrain.demo.children import Children
from hettrain.demo.cluster import DemoError, http_get
from hettrain.planning.plan import Plan
from hettrain.runtime.launch import free_port_block, launch_local

ENV_LOSS_LOG = "HETTRAIN_LOSS_LOG"
ENV_METRICS_PORT = "HETTRAIN_METRICS_PORT"


@dataclass
class Run:
    """One attempt's local processes, its loss log and what was seen of it."""

    plan: Plan
    workdir: Path
    procs: list[Any]
    loss_log: Path
    metrics_port: int
    losses: dict[int, float] = field(default_factory=dict)
    offset: int = 0
    runtime_metrics: str | None = None

    def poll_losses(self) -> list[dict[str, Any]]:
        """New ``{"step","loss","seconds"}`` records since the last call."""
        if not self.loss_log.exists():
            return []
        with open(self.loss_log) as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self.offset += len(complete.encode())
        recs = [json.loads(line) for line in complete.splitlines() if line.strip()]
        for r in recs:
            self.losses[int(r["step"])] = float(r["loss"])
        return recs

    def exit_codes(self) -> list[int | None]:
        """Return codes (None while running)."""
        return [p.poll() for p in self.procs]

    def scrape(self) -> str | None:
        """rank 0's /metrics (runtime metrics, docs/contracts.md §5), remembered."""
        text = http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")
        if text:
            self.runtime_metrics = text
        return text


def start(plan: Plan, workdir: Path, children: Children, pod_env: Mapping[str, str], *,
          step_sleep: float) -> Run:
    """``launch_local`` the plan's ranks with the env the operator gave the attempt's pods
    (checkpoint URI and interval, resume flag, S3 endpoint and the Secret's credentials)."""
    loss_log = workdir / "losses.jsonl"
    port = free_port_block(plan.world_size)  # rank r serves metrics on port + r
    env: dict[str, str] = {
        **pod_env,
        ENV_LOSS_LOG: str(loss_log),
        ENV_METRICS_PORT: str(port),
        "HETTRAIN_STEP_SLEEP": str(step_sleep),
    }
    procs = launch_local(plan, workdir, env)
    for r, p in enumerate(procs):
        children.add(f"rank {r}", p)
    return Run(plan, workdir, procs, loss_log, port)


def stream(run: Run, show: Callable[[dict[str, Any]], None], *, until_step: int | None,
           timeout: float) -> bool:
    """Show losses until step ``until_step`` (0-based) is logged (True) or every rank exits
    (True if all exited 0). Scrapes rank 0's metrics along the way. A failed rank raises."""
    deadline = time.monotonic() + timeout
    while True:
        recs = run.poll_losses()
        for rec in recs:
            show(rec)
        if recs:
            run.scrape()
            if until_step is not None and recs[-1]["step"] >= until_step:
                return True
        codes = run.exit_codes()
        bad = [(r, code) for r, code in enumerate(codes) if code not in (None, 0)]
        if bad:
            r, code = bad[0]
            tail = (run.workdir / f"rank-{r}.log").read_text()[-2000:]
            raise DemoError(f"rank {r} exited with {code}; log {run.workdir}/rank-{r}.log:\n"
                            f"{tail}")
        if all(code == 0 for code in codes):
            for rec in run.poll_losses():
                show(rec)
            return True
        if time.monotonic() > deadline:
            raise DemoError(f"training did not progress within {timeout:.0f} s; logs in "
                            f"{run.workdir}")
        time.sleep(0.1)
