"""Run a scenario: one timeline per seed (or the trace), replayed for every policy.

The throughput oracle (memoised plans) is shared by all policies and seeds of one run, so a
state planned once is never planned again; each policy's ``plan_calls`` / ``plan_seconds``
count only the plans it was first to need, and :attr:`SimReport.plan_seconds` is the total.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hettrain.sim.capacity import CapacityOracle, checkpoint_bytes
from hettrain.sim.engine import BUCKETS, POLICIES, PolicyResult, simulate
from hettrain.sim.model import SimInputError, check_checkpoint_interval
from hettrain.sim.scenarios import Scenario, checkpoint_interval, expected_interruption_rate
from hettrain.sim.timeline import DOWN, SOFTWARE, Timeline, load_trace, sample_timeline


@dataclass(slots=True)
class SimReport:
    """All results of one ``hettrain simulate`` run."""

    scenario: str
    gpus: int
    nodes: int
    days: float
    seeds: tuple[int, ...]
    policies: tuple[str, ...]
    throughput_mode: str
    full_layout: str
    full_world_size: int
    full_tokens_per_s: float
    checkpoint_bytes: float
    checkpoint_s: float
    interval_s: float
    interval_source: str
    expected_interruptions: float
    cluster_failures: list[int] = field(default_factory=list)  # DOWN+SOFTWARE events per seed
    results: dict[str, list[PolicyResult]] = field(default_factory=dict)
    plan_calls: int = 0
    plan_seconds: float = 0.0
    distinct_states: int = 0
    elapsed_s: float = 0.0
    trace: str | None = None

    def mean(self, policy: str, metric: str) -> float:
        """Mean over seeds of a :class:`PolicyResult` attribute or ``time_s`` bucket."""
        return statistics.fmean(_metric(r, metric) for r in self.results[policy])

    def stdev(self, policy: str, metric: str) -> float:
        """Sample standard deviation over seeds (0 for one seed)."""
        values = [_metric(r, metric) for r in self.results[policy]]
        return statistics.stdev(values) if len(values) > 1 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary: run metadata, per-policy means and per-seed values."""
        per_policy = {}
        for pol, runs in self.results.items():
            per_policy[pol] = {
                "ettr": self.mean(pol, "ettr"),
                "ettr_stdev": self.stdev(pol, "ettr"),
                "goodput_tokens_per_s": self.mean(pol, "goodput_tokens_per_s"),
                "goodput_ratio": self.mean(pol, "goodput_ratio"),
                "interruptions": self.mean(pol, "total_interruptions"),
                "replans": self.mean(pol, "replans"),
                "grow_backs": self.mean(pol, "grow_backs"),
                "restarts": self.mean(pol, "restarts"),
                "checkpoints": self.mean(pol, "checkpoints"),
                "planner_calls": sum(r.plan_calls for r in runs),
                "planner_seconds": sum(r.plan_seconds for r in runs),
                "hours": {b: self.mean(pol, b) / 3600 for b in BUCKETS},
                "degraded_hours": self.mean(pol, "degraded_s") / 3600,
                "per_seed": [
                    {"seed": r.seed, "ettr": r.ettr, "goodput_ratio": r.goodput_ratio,
                     "goodput_tokens_per_s": r.goodput_tokens_per_s,
                     "interruptions": dict(sorted(r.interruptions.items())),
                     "replans": r.replans, "grow_backs": r.grow_backs,
                     "seconds": dict(r.time_s), "degraded_s": r.degraded_s}
                    for r in runs
                ],
            }
        return {
            "scenario": self.scenario, "gpus": self.gpus, "nodes": self.nodes, "days": self.days,
            "seeds": list(self.seeds), "trace": self.trace,
            "throughput_model": self.throughput_mode,
            "full_plan": {"layout": self.full_layout, "world_size": self.full_world_size,
                          "tokens_per_s": self.full_tokens_per_s},
            "checkpoint": {"bytes": self.checkpoint_bytes, "write_s": self.checkpoint_s,
                           "interval_s": self.interval_s, "interval": self.interval_source},
            "expected_interruptions_if_always_running": self.expected_interruptions,
            "cluster_failure_events": self.cluster_failures,
            "planner": {"calls": self.plan_calls, "seconds": self.plan_seconds,
                        "distinct_states": self.distinct_states},
            "elapsed_s": self.elapsed_s,
            "policies": per_policy,
        }


def _metric(r: PolicyResult, metric: str) -> float:
    if metric in r.time_s:
        return r.time_s[metric]
    return float(getattr(r, metric))


def run_scenario(scenario: Scenario, *, policies: tuple[str, ...] = POLICIES,
                 seeds: tuple[int, ...] = (0,), trace: str | Path | None = None,
                 quantum: int = 1, scale: int = 1, plan_timeout_s: float = 0.0) -> SimReport:
    """Simulate every policy on every seed's timeline (the same timeline for all policies).
    ``plan_timeout_s``: the wall-time limit of each plan (0: none); one over it raises
    :class:`~hettrain.sim.model.SimInputError` naming ``--timeout-s``."""
    for p in policies:
        if p not in POLICIES:
            raise SimInputError("--policies", f"unknown policy {p!r}; choose from "
                                              f"{', '.join(POLICIES)}")
    if not policies:
        raise SimInputError("--policies", "give at least one policy")
    t0 = time.perf_counter()
    topo = scenario.topology()
    oracle = CapacityOracle(scenario.job_name, scenario.spec, topo, quantum=quantum, scale=scale,
                            plan_timeout_s=plan_timeout_s)
    full = oracle.capacity(topo.pool_nodes)
    if full is None:
        raise SimInputError("job", "no plan fits the healthy cluster; check the job and cluster "
                                   "with 'hettrain plan'")
    nbytes = checkpoint_bytes(scenario.spec)
    ckpt_s = nbytes / (scenario.recovery.storage_gbps * 1e9)
    rate = expected_interruption_rate(topo, scenario.failures, full.nodes_used, full.world_size)
    interval, source = checkpoint_interval(scenario.recovery, ckpt_s, rate, scenario.horizon_s)
    if source == "configured":
        check_checkpoint_interval(scenario.recovery, interval, scenario.horizon_s)
    report = SimReport(
        scenario=scenario.name, gpus=topo.gpus, nodes=topo.nodes, days=scenario.days,
        seeds=seeds, policies=policies, throughput_mode=oracle.mode, full_layout=full.layout,
        full_world_size=full.world_size, full_tokens_per_s=full.tokens_per_s,
        checkpoint_bytes=nbytes, checkpoint_s=ckpt_s, interval_s=interval,
        interval_source=source, expected_interruptions=rate * scenario.horizon_s,
        trace=None if trace is None else str(trace),
    )
    report.results = {p: [] for p in policies}
    for seed in seeds:
        timeline: Timeline = (load_trace(trace, topo, scenario.horizon_s, seed) if trace
                              else sample_timeline(topo, scenario.failures, scenario.horizon_s,
                                                   seed))
        report.cluster_failures.append(timeline.count(DOWN) + timeline.count(SOFTWARE))
        for pol in policies:
            report.results[pol].append(simulate(timeline, oracle, pol, scenario.recovery,
                                                checkpoint_s=ckpt_s, interval_s=interval))
    report.plan_calls, report.plan_seconds = oracle.plan_calls, oracle.plan_seconds
    report.distinct_states = len(oracle.memo)
    report.elapsed_s = time.perf_counter() - t0
    return report


def format_report(report: SimReport) -> str:
    """The human-readable summary: one row per policy, then hours lost by cause."""
    lines = [
        f"scenario {report.scenario}: {report.gpus} GPUs on {report.nodes} nodes, "
        f"{report.days:g} days, seeds {','.join(map(str, report.seeds))}"
        + (f", trace {report.trace}" if report.trace else ""),
        f"full plan DPxPPxTP {report.full_layout} on {report.full_world_size} GPUs, "
        f"{report.full_tokens_per_s / 1e6:.3f} M tokens/s (throughput model: "
        f"{report.throughput_mode})",
        f"checkpoint {report.checkpoint_bytes / 1e12:.2f} TB, write {report.checkpoint_s:.1f} s,"
        f" every {report.interval_s:.0f} s ({report.interval_source}); expected interruptions "
        f"if always running {report.expected_interruptions:.0f}; cluster failure events "
        f"{statistics.fmean(report.cluster_failures):.0f} per seed",
        "",
        f"{'policy':<12} {'ETTR':>7} {'goodput':>8} {'Mtok/s':>8} {'interrupts':>10} "
        f"{'replans':>8} {'growback':>8} {'plan s':>7}",
    ]
    for pol in report.policies:
        sd = report.stdev(pol, "ettr")
        ettr = f"{report.mean(pol, 'ettr'):.4f}"
        lines.append(
            f"{pol:<12} {ettr:>7} {report.mean(pol, 'goodput_ratio'):>8.4f} "
            f"{report.mean(pol, 'goodput_tokens_per_s') / 1e6:>8.3f} "
            f"{report.mean(pol, 'total_interruptions'):>10.1f} {report.mean(pol, 'replans'):>8.1f}"
            f" {report.mean(pol, 'grow_backs'):>8.1f} "
            f"{sum(r.plan_seconds for r in report.results[pol]):>7.2f}"
            + (f"  (ETTR sd {sd:.4f})" if sd else "")
        )
    lines += ["", "hours by cause (mean over seeds; degraded = productive hours lost to "
                  "running below the full plan)"]
    causes = [b for b in BUCKETS if b != "productive"]
    lines.append(f"{'policy':<12} {'productive':>10} " + " ".join(f"{c:>10}" for c in causes)
                 + f" {'degraded':>9}")
    for pol in report.policies:
        lines.append(f"{pol:<12} {report.mean(pol, 'productive') / 3600:>10.1f} "
                     + " ".join(f"{report.mean(pol, c) / 3600:>10.1f}" for c in causes)
                     + f" {report.mean(pol, 'degraded_s') / 3600:>9.1f}")
    lines += ["", f"planner: {report.plan_calls} plan_job calls for {report.distinct_states} "
                  f"distinct survivor states, {report.plan_seconds:.2f} s; simulation took "
                  f"{report.elapsed_s:.2f} s"]
    return "\n".join(lines)
