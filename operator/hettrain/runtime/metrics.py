"""Runtime Prometheus metrics (names and labels from docs/contracts.md §5)."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from hettrain.runtime.collectives import CommStats

LABELS = ("job", "rank", "stage", "pool")
DEFAULT_PORT = 9400
ENV_METRICS_ADDR = "HETTRAIN_METRICS_ADDR"  # bind address of the endpoint (default all)


class RuntimeMetrics:
    """One rank's metrics on its own registry; ``port`` 0 disables the HTTP endpoint, which
    listens on ``$HETTRAIN_METRICS_ADDR`` (default ``0.0.0.0``)."""

    def __init__(self, job: str, rank: int, stage: int, pool: str, port: int) -> None:
        self.registry = CollectorRegistry()
        lab = dict(job=job, rank=str(rank), stage=str(stage), pool=pool)
        r = self.registry
        self.step = Gauge("hettrain_runtime_step", "Last completed optimizer step",
                          LABELS, registry=r).labels(**lab)
        self.loss = Gauge("hettrain_runtime_loss", "Global-batch mean loss of the last step",
                          LABELS, registry=r).labels(**lab)
        self.step_seconds = Histogram(
            "hettrain_runtime_step_seconds", "Optimizer step wall time", LABELS, registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        ).labels(**lab)
        self.tokens = Gauge("hettrain_runtime_tokens_per_second", "Global tokens per second",
                            LABELS, registry=r).labels(**lab)
        self.mfu = Gauge("hettrain_runtime_mfu", "Achieved model FLOPs utilisation",
                         LABELS, registry=r).labels(**lab)
        self._bytes = Counter("hettrain_runtime_collective_bytes", "Collective bytes sent",
                              (*LABELS, "tier"), registry=r)
        self._secs = Counter("hettrain_runtime_collective_seconds", "Collective seconds",
                             (*LABELS, "tier"), registry=r)
        self.last_ckpt = Gauge("hettrain_runtime_last_checkpoint_step",
                               "Step of the last complete checkpoint", LABELS, registry=r
                               ).labels(**lab)
        self._schedule = Gauge("hettrain_runtime_schedule_info",
                               "1 for the pipeline schedule this rank executes (schedule) and "
                               "the one the plan asked for (planned)",
                               (*LABELS, "schedule", "planned"), registry=r)
        self.stage_compute = Gauge(
            "hettrain_runtime_stage_compute_seconds", "Median forward+backward compute seconds "
            "of one microbatch on this rank's stage (receives/sends excluded)", LABELS,
            registry=r).labels(**lab)
        self.stage_layers = Gauge(
            "hettrain_runtime_stage_layers_seconds", "Median forward+backward seconds of this "
            "rank's decoder layers for one microbatch", LABELS, registry=r).labels(**lab)
        self.stage_comm = Gauge("hettrain_runtime_stage_comm_seconds",
                                "Median communication seconds per step on this rank", LABELS,
                                registry=r).labels(**lab)
        self.stage_steps = Gauge("hettrain_runtime_stage_measured_steps",
                                 "Steps the stage time medians cover", LABELS,
                                 registry=r).labels(**lab)
        self._lab = lab
        self._seen: dict[str, tuple[int, float]] = {}
        self.port = port
        if port:
            start_http_server(port, addr=os.environ.get(ENV_METRICS_ADDR) or "0.0.0.0",
                              registry=r)

    def set_schedule(self, executed: str, planned: str) -> None:
        """Export which schedule runs (it differs from the plan's for interleaved / zb-h1)."""
        self._schedule.labels(**self._lab, schedule=executed, planned=planned).set(1)

    def observe_step(self, step: int, loss: float, seconds: float, tokens: int,
                     flops: float, peak_flops: float) -> None:
        """Record one finished optimizer step."""
        self.step.set(step)
        self.loss.set(loss)
        self.step_seconds.observe(seconds)
        self.tokens.set(tokens / seconds if seconds > 0 else 0.0)
        self.mfu.set(flops / seconds / peak_flops if seconds > 0 and peak_flops > 0 else 0.0)

    def observe_stage(self, compute_s: float, comm_s: float, steps: int,
                      layers_s: float = 0.0) -> None:
        """Export the measured stage times (runtime/stage_timing.py) for calibration."""
        self.stage_compute.set(compute_s)
        self.stage_layers.set(layers_s)
        self.stage_comm.set(comm_s)
        self.stage_steps.set(steps)

    def observe_comm(self, stats: CommStats) -> None:
        """Advance the per-tier counters to the communicator's running totals."""
        for tier, s in stats.items():
            b0, t0 = self._seen.get(tier.value, (0, 0.0))
            if s.bytes > b0:
                self._bytes.labels(**self._lab, tier=tier.value).inc(s.bytes - b0)
            if s.seconds > t0:
                self._secs.labels(**self._lab, tier=tier.value).inc(s.seconds - t0)
            self._seen[tier.value] = (max(s.bytes, b0), max(s.seconds, t0))
