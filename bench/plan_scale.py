"""Planning time and plan quality vs cluster size (4 device types, 3 datacenters).

For each size: median wall time (and process CPU time, which other load on the machine inflates
less) of ``plan_job`` and of a re-plan after one node fails (medians of ``--repeats`` runs, side
by side in one process; targets are judged on wall time), and three quality ratios of predicted
step times (> 1 means the heterogeneous plan is faster):

- ``vs homog``: the best plan on the largest single pool alone / the heterogeneous plan
  (``no fit``: the model does not fit on that pool alone);
- ``vs uniform``: the same layout with a uniform layer split (Megatron's default) / the planner's
  non-uniform split (``OOM`` when the uniform split does not fit in memory);
- ``vs exh``: exhaustive / fast, on the tiny instance (8 GPUs, 6 layers) where brute force is
  feasible (1.000 = same optimum).

Usage: python bench/plan_scale.py [--sizes 64,1024,10240,102400] [--repeats 3]
       python bench/plan_scale.py --sizes 1024 --replica-groups   # spec.parallelism.replicaGroups
       python bench/plan_scale.py --heuristics 64,1024   # each heuristic vs the search without it
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from hettrain.api.spec import JobSpec, parse_job_spec
from hettrain.planning import planner
from hettrain.planning.errors import PlanningError
from hettrain.planning.inventory import ClusterInventory, load_cluster
from hettrain.planning.plan import Plan
from hettrain.planning.planner import plan_job, step_time_for_split

DEVICES = [("H100-SXM", "dc-a"), ("MI300X", "dc-b"), ("Gaudi3", "dc-c"), ("A100-80GB", "dc-a")]
PLAN_TARGET_S = {1024: 1.0, 10240: 10.0, 102400: 60.0}
REPLAN_TARGET_S = {1024: 1.0}
TINY_GPUS = 8


def cluster(gpus: int, gpus_per_node: int = 8) -> dict:
    """Four device types over three DCs, ``gpus`` in total."""
    nodes = max(1, gpus // gpus_per_node // len(DEVICES))
    pools = [{"name": f"{d.lower()}-{dc}", "datacenter": dc, "device": d, "nodes": nodes,
              "gpusPerNode": gpus_per_node, "nicGbps": 3200} for d, dc in DEVICES]
    dcs = sorted({p["datacenter"] for p in pools})
    links = [{"between": [a, b], "bandwidthGbps": 400, "latencyMs": 30}
             for i, a in enumerate(dcs) for b in dcs[i + 1:]]
    return {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "b"},
            "datacenters": [{"name": d} for d in dcs], "links": links, "pools": pools}


def timed(fn, repeats: int) -> tuple[float, float, object]:
    """Median wall time and median process CPU time of ``fn``, and its last result."""
    walls, cpus, out = [], [], None
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus), out


def largest_pool(inv: ClusterInventory) -> ClusterInventory:
    """The inventory reduced to its largest pool (ties: the fastest device)."""
    pool = max(inv.pools, key=lambda p: (p.gpus, p.device.effective_flops, p.name))
    return replace(inv, pools=(pool,))


def uniform_ratio(spec: JobSpec, inv: ClusterInventory, plan: Plan) -> str:
    """Step time of the plan's layout with a uniform layer split / the plan's step time."""
    per, extra = divmod(spec.model.layers, plan.pp)
    split = [per + (i < extra) for i in range(plan.pp)]
    t = step_time_for_split(spec, inv, plan, split)
    return "OOM" if t is None else f"{t / plan.predicted.step_time_s:.3f}"


def verdict(gpus: int, t_plan: float, t_re: float) -> str:
    """Which of the issue's targets apply at this size and whether they are met."""
    out = []
    if gpus in PLAN_TARGET_S:
        out.append(f"plan<={PLAN_TARGET_S[gpus]:g}s " +
                   ("yes" if t_plan <= PLAN_TARGET_S[gpus] else "NO"))
    if gpus in REPLAN_TARGET_S:
        out.append(f"replan<={REPLAN_TARGET_S[gpus]:g}s " +
                   ("yes" if t_re <= REPLAN_TARGET_S[gpus] else "NO"))
    return ", ".join(out) or "-"


def row(label: str, spec: JobSpec, inv: ClusterInventory, repeats: int, exhaustive: bool) -> str:
    """One table row."""
    t_plan, c_plan, plan = timed(lambda: plan_job("b", spec, inv), repeats)
    assert isinstance(plan, Plan)
    step = plan.predicted.step_time_s
    try:
        homog = f"{plan_job('b', spec, largest_pool(inv)).predicted.step_time_s / step:>9.3f}"
    except PlanningError:  # the model does not fit on the largest pool alone
        homog = f"{'no fit':>9}"
    smaller = inv.without_nodes([plan.ranks[-1].node])
    t_re, c_re, _ = timed(lambda: plan_job("b", spec, smaller, previous=plan), repeats)
    exh = "-"
    if exhaustive:
        full = plan_job("b", spec, inv, exhaustive=True)
        exh = f"{full.predicted.step_time_s / plan.predicted.step_time_s:.3f}"
    return (f"{label:>9} {inv.gpus:>7} {t_plan:>8.3f} {c_plan:>7.3f} {t_re:>9.3f} {c_re:>7.3f} "
            f"{step:>9.3f} {homog} "
            f"{uniform_ratio(spec, inv, plan):>10} {exh:>7}  "
            f"dp={plan.dp} pp={plan.pp} mb={plan.micro_batch} {plan.schedule}  "
            f"{verdict(inv.gpus, t_plan, t_re)}")


def heuristics(spec: JobSpec, sizes: list[int]) -> None:
    """Each large-instance heuristic vs the same search with it switched off."""
    print(f"{'GPUs':>7} {'heuristic':>12} {'step on':>9} {'step off':>9} {'on/off':>7} "
          f"{'plan s on':>9} {'plan s off':>10}")
    switches = {"k window": ("EXACT_LEAF_BUDGET", float("inf")),
                "fixed order": ("MAX_PERMUTED_UNITS", 3)}  # 3: force it on the 4 bench units
    for gpus in sizes:
        inv = load_cluster(cluster(gpus))
        for label, (name, value) in switches.items():
            default = getattr(planner, name)
            runs = []
            for setting in ((value, default) if label == "fixed order" else (default, value)):
                setattr(planner, name, setting)
                t = time.perf_counter()
                runs.append((plan_job("b", spec, inv).predicted.step_time_s,
                             time.perf_counter() - t))
            setattr(planner, name, default)
            (on, t_on), (off, t_off) = runs
            print(f"{inv.gpus:>7} {label:>12} {on:>9.4f} {off:>9.4f} {on / off:>7.4f} "
                  f"{t_on:>9.2f} {t_off:>10.2f}", flush=True)


def main() -> None:
    """Print the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,1024,10240,102400")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--heuristics", default="",
                    help="sizes (e.g. 64,1024) at which to compare each heuristic with the "
                         "search without it, instead of the main table")
    ap.add_argument("--replica-groups", action="store_true",
                    help="plan llama-70b with spec.parallelism.replicaGroups: true")
    args = ap.parse_args()
    big = parse_job_spec({"model": {"preset": "llama3-70b"},
                          "training": {"globalBatch": 512, "steps": 1},
                          "parallelism": {"replicaGroups": args.replica_groups}})
    tiny = parse_job_spec({"model": {"layers": 6, "hidden": 8192, "heads": 64, "seqLen": 2048,
                                     "vocab": 32000},
                           "training": {"globalBatch": 8, "steps": 1}})
    if args.heuristics:
        heuristics(big, [int(x) for x in args.heuristics.split(",")])
        return
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"median of {args.repeats}; ratios are step-time ratios (>1: the planner's plan is "
          f"faster); load average at start {load} on {os.cpu_count()} CPUs")
    print(f"{'model':>9} {'GPUs':>7} {'plan s':>8} {'cpu s':>7} {'replan s':>9} {'cpu s':>7} "
          f"{'step s':>9} "
          f"{'vs homog':>9} {'vs uniform':>10} {'vs exh':>7}  layout  targets")
    print(row("tiny-6L", tiny, load_cluster(cluster(TINY_GPUS, gpus_per_node=2)), args.repeats,
              exhaustive=True))
    for gpus in (int(x) for x in args.sizes.split(",")):
        print(row("llama-70b", big, load_cluster(cluster(gpus)), args.repeats, exhaustive=False),
              flush=True)


if __name__ == "__main__":
    main()
