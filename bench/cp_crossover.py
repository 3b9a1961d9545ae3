"""Where context parallelism starts to win: the planner's best plan with ``cp`` searched against
its best plan with ``cp: 1`` pinned, over sequence lengths, for one model on one cluster.

Both columns are the planner's own predictions (``planning/cost.py``, ``planning/context.py``),
planned side by side with the same spec (bf16, ZeRO-1, ``recompute: auto``, about
``--tokens`` tokens per step: global batch ``tokens / seq``). ``gain`` is the cp = 1 plan's step
time over the searched plan's (1.00: CP not chosen; ``inf``: no cp = 1 layout fits). The
crossover is the shortest sequence whose searched plan uses cp > 1.

Usage: python bench/cp_crossover.py [--device H100-SXM] [--nodes 4] [--gpus-per-node 8]
       [--preset llama3-8b] [--tokens 1048576] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from hettrain.api.spec import parse_job_spec
from hettrain.planning.errors import PlanningError
from hettrain.planning.inventory import load_cluster
from hettrain.planning.plan import Plan
from hettrain.planning.planner import plan_job

SEQS = (4096, 8192, 16384, 32768, 65536, 131072)


def cluster(device: str, nodes: int, gpus: int, nic_gbps: float = 400) -> dict:
    """One pool of ``nodes`` × ``gpus`` ``device`` in one datacenter."""
    return {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "x"},
            "datacenters": [{"name": "a"}],
            "pools": [{"name": "p", "datacenter": "a", "device": device, "nodes": nodes,
                       "gpusPerNode": gpus, "nicGbps": nic_gbps}]}


def _plan(preset: str, seq: int, tokens: int, inv, cp: int | None) -> Plan | None:
    job = {"model": {"preset": preset, "seqLen": seq},
           "training": {"globalBatch": max(1, tokens // seq), "steps": 1, "recompute": "auto",
                        "optimizerSharding": True}}
    if cp is not None:
        job["parallelism"] = {"cp": cp}
    try:
        return plan_job("x", parse_job_spec(job), inv)
    except PlanningError:
        return None


def fmt(x: float | None) -> str:
    """Seconds, or a dash for no plan."""
    return f"{x:9.3f}" if x is not None else f"{'-':>9}"


def _layout(p: Plan | None) -> str:
    if p is None:
        return "no plan"
    tps = "/".join(str(s.tp) for s in p.stages)
    return (f"dp={p.dp} pp={p.pp} tp={tps} cp={p.stages[0].cp} mb={p.micro_batch} "
            f"{p.schedule} {p.training.recompute}")


def rows(device: str, nodes: int, gpus: int, preset: str, tokens: int) -> list[dict]:
    """One row per sequence length: both plans' step times, layouts and the gain."""
    inv = load_cluster(cluster(device, nodes, gpus))
    out = []
    for seq in SEQS:
        auto, plain = _plan(preset, seq, tokens, inv, None), _plan(preset, seq, tokens, inv, 1)
        t_auto = auto.predicted.step_time_s if auto else None
        t_plain = plain.predicted.step_time_s if plain else None
        gain = (t_plain / t_auto if t_plain else float("inf")) if t_auto else None
        out.append({"seq": seq, "global_batch": max(1, tokens // seq), "step_s": t_auto,
                    "step_s_cp1": t_plain, "gain": gain,
                    "cp": auto.stages[0].cp if auto else None,
                    "layout": _layout(auto), "layout_cp1": _layout(plain)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="H100-SXM")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--tokens", type=int, default=2**20, help="tokens per step (default 1M)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    table = rows(a.device, a.nodes, a.gpus_per_node, a.preset, a.tokens)
    if a.json:
        print(json.dumps(table, indent=1))
        return
    print(f"{a.preset} on {a.nodes}x{a.gpus_per_node} {a.device}, ~{a.tokens} tokens/step")
    print(f"{'seq':>7} {'gb':>4} {'step s':>9} {'cp=1 s':>9} {'gain':>6}  "
          "searched plan | cp=1 plan")
    for r in table:
        gain = f"{r['gain']:6.3f}" if r["gain"] is not None else f"{'-':>6}"
        print(f"{r['seq']:>7} {r['global_batch']:>4} {fmt(r['step_s'])} {fmt(r['step_s_cp1'])} "
              f"{gain}  {r['layout']} | {r['layout_cp1']}")
    cross = next((r["seq"] for r in table if r["cp"] and r["cp"] > 1), None)
    print(f"crossover: {cross if cross else 'none'} tokens (shortest sequence planned with cp > 1)")


if __name__ == "__main__":
    main()
