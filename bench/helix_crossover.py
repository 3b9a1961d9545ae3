"""Where the helix schedule (HelixPipe's attention-parallel partition) would win: the planner's
best plan under ``schedule: auto`` against its best plan with ``schedule: helix`` pinned, over
sequence lengths, on a few single-pool clusters; beside it the helix plan with the capped
orders only (``planner.helix_capped_only``: before the first-in-last-out order), same run.

Both columns are the planner's own predictions (``planning/cost.py``, ``planning/helix.py``),
planned side by side with the same spec (bf16, ZeRO-1, ``recompute: auto``, about ``--tokens``
tokens per step: global batch ``tokens / seq``). ``gain`` is the auto plan's step time over
the helix plan's (> 1: helix is faster; ``-``: no helix layout fits); ``capped s`` the helix
plan's step with the capped orders only. The crossover is the shortest sequence where helix
wins. ``plan s`` is the helix plan's planning time; ``-filo`` marks a first-in-last-out plan.

Usage: python bench/helix_crossover.py [--preset llama3-8b] [--tokens 1048576]
       [--clusters h100,l40s,a100] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cp_crossover import cluster, fmt
from hettrain.api.spec import parse_job_spec
from hettrain.planning.errors import PlanningError
from hettrain.planning.inventory import load_cluster
from hettrain.planning.plan import Plan
from hettrain.planning.planner import helix_capped_only, plan_job

SEQS = (4096, 8192, 16384, 32768, 65536, 131072)
# name -> (device, nodes, GPUs per node, NIC Gbps)
CLUSTERS = {"h100": ("H100-SXM", 4, 8, 400), "l40s": ("L40S", 8, 8, 100),
            "a100": ("A100-80GB", 4, 8, 200), "mi300": ("MI300X", 2, 8, 400)}


def _plan(preset: str, seq: int, tokens: int, inv, schedule: str) -> tuple[Plan | None, float]:
    job = {"model": {"preset": preset, "seqLen": seq},
           "training": {"globalBatch": max(1, tokens // seq), "steps": 1, "recompute": "auto",
                        "optimizerSharding": True},
           "parallelism": {"schedule": schedule}}
    t0 = time.perf_counter()
    try:
        return plan_job("x", parse_job_spec(job), inv), time.perf_counter() - t0
    except PlanningError:
        return None, time.perf_counter() - t0


def _layout(p: Plan | None) -> str:
    if p is None:
        return "no plan"
    tps = "/".join(sorted({str(s.tp) for s in p.stages}))
    order = "-filo" if p.helix_filo else ""
    return (f"dp={p.dp} pp={p.pp} tp={tps} cp={p.stages[0].cp} mb={p.micro_batch} "
            f"m={p.num_microbatches} {p.schedule}{order} {p.training.recompute}")


def rows(name: str, preset: str, tokens: int) -> list[dict]:
    """One row per sequence length: both plans' step times, layouts and the gain."""
    device, nodes, gpus, nic = CLUSTERS[name]
    inv = load_cluster(cluster(device, nodes, gpus, nic))
    out = []
    for seq in SEQS:
        (auto, _), (hx, plan_s) = (_plan(preset, seq, tokens, inv, "auto"),
                                   _plan(preset, seq, tokens, inv, "helix"))
        with helix_capped_only():
            capped, _ = _plan(preset, seq, tokens, inv, "helix")
        t_auto = auto.predicted.step_time_s if auto else None
        t_hx = hx.predicted.step_time_s if hx else None
        out.append({"cluster": name, "seq": seq, "global_batch": max(1, tokens // seq),
                    "step_s": t_auto, "step_s_helix": t_hx,
                    "step_s_helix_capped": capped.predicted.step_time_s if capped else None,
                    "gain": t_auto / t_hx if t_auto and t_hx else None,
                    "helix_plan_s": plan_s, "layout": _layout(auto), "layout_helix": _layout(hx)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--tokens", type=int, default=2**20, help="tokens per step (default 1M)")
    ap.add_argument("--clusters", default=",".join(CLUSTERS),
                    help=f"comma-separated of {', '.join(CLUSTERS)}")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    names = [c for c in a.clusters.split(",") if c]
    unknown = [c for c in names if c not in CLUSTERS]
    if unknown:
        ap.error(f"--clusters: unknown {unknown}; pick from {', '.join(CLUSTERS)}")
    table = [r for name in names for r in rows(name, a.preset, a.tokens)]
    if a.json:
        print(json.dumps(table, indent=1))
        return
    for name in names:
        device, nodes, gpus, nic = CLUSTERS[name]
        print(f"{a.preset} on {nodes}x{gpus} {device} ({nic} Gbps NIC), ~{a.tokens} tokens/step")
        print(f"{'seq':>7} {'gb':>4} {'auto s':>9} {'capped s':>9} {'helix s':>9} {'gain':>6} "
              f"{'plan s':>6}  auto plan | helix plan")
        mine = [r for r in table if r["cluster"] == name]
        for r in mine:
            gain = f"{r['gain']:6.3f}" if r["gain"] is not None else f"{'-':>6}"
            print(f"{r['seq']:>7} {r['global_batch']:>4} {fmt(r['step_s'])} "
                  f"{fmt(r['step_s_helix_capped'])} {fmt(r['step_s_helix'])} {gain} "
                  f"{r['helix_plan_s']:6.2f}  {r['layout']} | {r['layout_helix']}")
        cross = next((r["seq"] for r in mine if r["gain"] and r["gain"] > 1), None)
        print(f"crossover: {cross if cross else 'none'} (shortest sequence where helix wins)\n")


if __name__ == "__main__":
    main()
