"""Planning time vs cluster size, heterogeneous-vs-homogeneous quality, re-plan time.

Prints medians of repeats measured side by side in one run. Usage: python bench/plan_scale.py
[--sizes 64,1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from hettrain.api.spec import parse_job_spec
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import plan_job

DEVICES = [("H100-SXM", "dc-a"), ("MI300X", "dc-b"), ("Gaudi3", "dc-c"), ("A100-80GB", "dc-a")]


def cluster(gpus: int, only: int | None = None) -> dict:
    """Four device types over three DCs, ``gpus`` in total (8 per node)."""
    nodes = max(1, gpus // 8 // len(DEVICES))
    pools = [{"name": f"{d.lower()}-{dc}", "datacenter": dc, "device": d, "nodes": nodes,
              "gpusPerNode": 8, "nicGbps": 3200} for d, dc in DEVICES]
    if only is not None:
        pools = [pools[only]]
    dcs = sorted({p["datacenter"] for p in pools})
    links = [{"between": [a, b], "bandwidthGbps": 400, "latencyMs": 30}
             for i, a in enumerate(dcs) for b in dcs[i + 1:]]
    return {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "b"},
            "datacenters": [{"name": d} for d in dcs], "links": links, "pools": pools}


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median wall time of ``fn`` and its last result."""
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,1024")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    spec = parse_job_spec({"model": {"preset": "llama3-70b"},
                           "training": {"globalBatch": 512, "steps": 1}})
    print(f"{'GPUs':>7} {'plan s':>8} {'step s':>8} {'homog step s':>13} {'het speedup':>12} "
          f"{'replan s':>9}")
    for gpus in (int(x) for x in args.sizes.split(",")):
        inv = load_cluster(cluster(gpus))
        t_plan, plan = timed(lambda inv=inv: plan_job("b", spec, inv), args.repeats)
        homog = plan_job("b", spec, load_cluster(cluster(gpus, only=1)))
        failed = plan.ranks[-1].node
        smaller = inv.without_nodes([failed])
        t_re, _ = timed(lambda s=smaller, p=plan: plan_job("b", spec, s, previous=p),
                        args.repeats)
        print(f"{inv.gpus:>7} {t_plan:>8.2f} {plan.predicted.step_time_s:>8.2f} "
              f"{homog.predicted.step_time_s:>13.2f} "
              f"{homog.predicted.step_time_s / plan.predicted.step_time_s:>12.2f} {t_re:>9.2f}")


if __name__ == "__main__":
    main()
