"""Benchmark of ``hettrain simulate``: speed at 16k and 100k GPUs, and ETTR/goodput per policy.

Runs the Llama 3 405B job (sequence 8,192, global batch = GPUs / 8 sequences, so DP grows with
the cluster) for 54 simulated days with the default failure model (Llama 3 rates) at 1k, 16k and
100k H100, in two settings: ``spares`` (2 % hot spare nodes per pool, lognormal 4 h repairs)
and ``no spares`` (failed nodes come back only after their repair). Every policy replays the
same timeline per seed (common random numbers).

Speed: the wall time of one full ``run_scenario`` (timeline sampling, planning every survivor
state with the real planner, all three policies) per (scale, setting), median of ``--repeats``
runs, printed next to the issue's targets (16k × 54 days ≤ 30 s, 100k ≤ 300 s) as a ratio.

    .venv/bin/python bench/simulate.py [--seeds 3] [--repeats 3] [--scales 1024,16384,100000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

from hettrain.sim.cluster import generate_cluster
from hettrain.sim.model import FailureModel, RecoveryModel
from hettrain.sim.run import SimReport, run_scenario
from hettrain.sim.scenarios import Scenario, llama3_job

TARGETS_S = {16384: 30.0, 100000: 300.0}


def scenario(gpus: int, spares: bool) -> Scenario:
    """Llama 3 405B on ``gpus`` H100 for 54 days; 2 % spare nodes when ``spares``."""
    name, spec = llama3_job(global_batch=max(64, gpus // 8))
    spare_nodes = max(1, round(gpus / 8 * 0.02)) if spares else 0
    inv = generate_cluster(f"{gpus}:H100-SXM", spare_nodes=spare_nodes)
    label = f"{gpus // 1024}k" if gpus < 100000 else f"{gpus // 1000}k"
    return Scenario(f"{label}-{'spares' if spares else 'nospares'}", name, spec, inv,
                    FailureModel(), RecoveryModel(), 54.0, spare_nodes)


def timed(sc: Scenario, seeds: tuple[int, ...], repeats: int
          ) -> tuple[SimReport, float, float]:
    """The last run's report, and the medians over ``repeats`` runs of the wall time and of
    the seconds spent inside ``plan_job``."""
    times, plan = [], []
    report = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        report = run_scenario(sc, seeds=seeds)
        times.append(time.perf_counter() - t0)
        plan.append(report.plan_seconds)
    assert report is not None
    return report, statistics.median(times), statistics.median(plan)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the tables."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row (median)")
    ap.add_argument("--scales", default="1024,16384,100000")
    args = ap.parse_args(argv)
    scales = [int(s) for s in args.scales.split(",")]
    seeds = tuple(range(args.seeds))
    rows = []
    speed = []
    for gpus in scales:
        for spares in (True, False):
            sc = scenario(gpus, spares)
            # speed: one seed, 54 days, all policies (what the targets are about)
            one, wall, plan_s = timed(sc, (0,), args.repeats)
            speed.append((sc.name, one.gpus, wall, one.plan_calls, plan_s))
            rep = run_scenario(replace(sc), seeds=seeds)
            for pol in rep.policies:
                rows.append((sc.name, rep.full_layout, pol, rep.mean(pol, "ettr"),
                             rep.stdev(pol, "ettr"), rep.mean(pol, "goodput_ratio"),
                             rep.mean(pol, "goodput_tokens_per_s") / 1e6,
                             rep.mean(pol, "total_interruptions"), rep.mean(pol, "replans"),
                             rep.mean(pol, "grow_backs")))
            print(f"... {sc.name} done", file=sys.stderr, flush=True)
    print(f"ETTR / goodput per policy, 54 days, mean of {len(seeds)} seeds "
          "(Llama 3 405B, default failure model)")
    print(f"{'setting':<14} {'full plan':<11} {'policy':<12} {'ETTR':>7} {'sd':>6} "
          f"{'goodput':>8} {'Mtok/s':>8} {'interrupts':>10} {'replans':>8} {'growbacks':>9}")
    for r in rows:
        print(f"{r[0]:<14} {r[1]:<11} {r[2]:<12} {r[3]:>7.4f} {r[4]:>6.4f} {r[5]:>8.4f} "
              f"{r[6]:>8.3f} {r[7]:>10.1f} {r[8]:>8.1f} {r[9]:>9.1f}")
    print()
    print(f"speed: one seed x 54 days x 3 policies, median of {args.repeats} runs")
    print(f"{'setting':<14} {'GPUs':>7} {'wall s':>8} {'target s':>9} {'wall/target':>11} "
          f"{'plan calls':>10} {'plan s':>7}  (plan s: median time inside plan_job)")
    for name, gpus, wall, calls, psec in speed:
        base = 16384 if gpus < 100000 else 100000
        target = TARGETS_S.get(base) if gpus >= 16384 else None
        ratio = f"{wall / target:>11.3f}" if target else f"{'-':>11}"
        print(f"{name:<14} {gpus:>7} {wall:>8.2f} {target or '-':>9} {ratio} {calls:>10} "
              f"{psec:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
