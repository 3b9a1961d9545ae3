"""Runtime overhead: tokens/s of ``python -m hettrain.runtime`` vs a plain single-process torch
loop of the same model, optimizer and global batch, measured side by side.

Two baselines per layout:

* ``plain 1 batch``: the whole global batch in one forward/backward per step;
* ``plain same mb``: the same microbatches as the plan (``micro_batch`` sequences each,
  ``dp * num_microbatches`` of them, gradient accumulation) -- the same arithmetic the runtime
  does, so ``rt/same`` is the runtime's own overhead (or pipeline speed-up).

On a tiny model a microbatch of 2 sequences is dominated by per-op Python/dispatch cost, so
``rt/1b`` is mostly the price of the plan's microbatching, not of the runtime.

CPU columns: process CPU seconds per step (all threads; the runtime's summed over its ranks)
vs the plain loop with the same microbatches. They measure the runtime's extra WORK
(communication, bookkeeping) and stay meaningful on a loaded machine, where wall-clock
ratios mostly measure the scheduler.

Layouts: 1 rank (pp=1, dp=1); 2 stages (pp=2, dp=1, 3+1 split: fits the 2 cores); 2 pools x 2
stages (pp=2, dp=2, 3+1). Each runtime step time is the median over steps after warm-up; each
configuration is repeated (interleaved with its baselines) and the median of the repeats
reported. The 4-rank layout oversubscribes 2 cores, so its ratio includes contention.

With ``--zb``: 1F1B vs ZB-H1 on the same pp=2 layouts (runs alternated, median of repeats),
and the plain loop with the runtime's deferrable ``Linear`` vs torch's ``nn.Linear`` (the cost
of the custom autograd function every schedule now pays).

With ``--schedule``: 1F1B vs interleaved 1F1B (virtual stages v) vs ZB-H1 on pp=2 layouts
(runs alternated, median of repeats), ms/step and the ratio to 1F1B.

With ``--p2p``: pipeline bytes per stage and step, measured (the ranks' summaries: what each
stage sent across its boundaries, and its TP all-gathers on receipt) next to what the plan
charges (``planning.cost.activation_bytes`` per boundary tensor sent), for fp32/bf16 plans and
TP-sharded boundaries. Bytes are deterministic: one run per layout.

    .venv/bin/python bench/runtime.py [--repeats 3] [--steps 12] [--ab-recv-ahead] [--zb]
                                      [--schedule] [--p2p]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT)]

import torch  # noqa: E402
from tests.runtime.training.plans import TINY, tiny_plan  # noqa: E402

from hettrain.planning import cost  # noqa: E402
from hettrain.runtime.collectives.p2p import plan_streams  # noqa: E402
from hettrain.runtime.data import microbatches  # noqa: E402
from hettrain.runtime.launch import launch_local, wait_all  # noqa: E402
from hettrain.runtime.model import Linear, lm_loss, whole_model  # noqa: E402
from hettrain.runtime.trainer import make_optimizer  # noqa: E402

WARMUP = 3


def _torch_linears(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every deferrable ``Linear`` swapped for a plain ``nn.Linear``."""
    for name, mod in list(model.named_modules()):
        if isinstance(mod, Linear):
            plain = torch.nn.Linear(mod.in_features, mod.out_features, bias=False)
            plain.weight = mod.weight
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, plain)
    return model


def plain_loop(plan, steps: int, micro_batch: int | None = None,
               torch_linear: bool = False) -> tuple[float, float]:
    """Median (wall, CPU) seconds per step of a bare torch loop over the same global batches,
    in microbatches of ``micro_batch`` sequences (default: the whole global batch at once)."""
    torch.set_num_threads(1)
    t = plan.training
    model = whole_model(plan.model, t.seed)
    if torch_linear:
        model = _torch_linears(model)
    opt = make_optimizer(model, t.learning_rate)
    mb = micro_batch or plan.global_batch
    m = plan.global_batch // mb
    walls, cpus = [], []
    for step in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        for x, y in microbatches(t.seed, step, dp=1, dp_index=0, micro_batch=mb,
                                 num_microbatches=m, seq_len=plan.model.seq_len,
                                 vocab=plan.model.vocab):
            (lm_loss(model(x), y) / m).backward()
        opt.step()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls[WARMUP:]), statistics.median(cpus[WARMUP:])


def runtime(plan, steps: int, env: dict[str, str] | None = None) -> tuple[float, float]:
    """Median wall seconds per step (rank 0) and the sum over ranks of each rank's median CPU
    seconds per step, of the real runtime."""
    with tempfile.TemporaryDirectory() as d:
        log, summ = Path(d) / "loss.jsonl", Path(d) / "summary"
        codes = wait_all(launch_local(plan, Path(d), {"HETTRAIN_LOSS_LOG": str(log),
                                                      "HETTRAIN_METRICS_PORT": "0",
                                                      "HETTRAIN_SUMMARY_DIR": str(summ),
                                                      **(env or {})}), 600)
        if any(codes):
            raise SystemExit(f"runtime failed: exit codes {codes}")
        secs = [json.loads(line)["seconds"] for line in log.read_text().splitlines()]
        cpu = sum(statistics.median(json.loads(f.read_text())["step_cpu_seconds"][WARMUP:])
                  for f in summ.glob("rank-*.json"))
    return statistics.median(secs[WARMUP:]), cpu


def main() -> None:
    """Print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--zb", action="store_true",
                    help="only the 1F1B vs ZB-H1 and Linear vs nn.Linear comparisons")
    ap.add_argument("--ab-recv-ahead", action="store_true",
                    help="also run the pp2 layouts with HETTRAIN_RECV_AHEAD=0")
    ap.add_argument("--schedule", action="store_true",
                    help="only the 1F1B vs interleaved vs ZB-H1 comparison (pp=2)")
    ap.add_argument("--p2p", action="store_true",
                    help="only the measured vs planned pipeline bytes per stage")
    a = ap.parse_args()
    model = TINY
    if a.p2p:
        p2p_bytes(a.steps)
        return
    if a.schedule:
        schedules_compare(a.repeats, a.steps)
        return
    if a.zb:
        zb_vs_1f1b(a.repeats, a.steps)
        return
    layouts = {
        "1 rank (pp1 dp1)": tiny_plan([(0, 4, "pool-a")], dp=1, steps=a.steps,
                                      num_microbatches=8, model=model),
        "2 stages (pp2 dp1, 3+1)": tiny_plan([(0, 3, "pool-a"), (3, 4, "pool-b")], dp=1,
                                             steps=a.steps, num_microbatches=8, model=model),
        "2 pools x 2 stages (pp2 dp2, 3+1)": tiny_plan(
            [(0, 3, "pool-a"), (3, 4, "pool-b")], dp=2, steps=a.steps, model=model),
    }
    variants: dict[str, dict[str, str]] = {name: {} for name in layouts}
    if a.ab_recv_ahead:  # A/B of posting pipeline receives ahead (default 1) vs on demand
        for name in [n for n in layouts if "pp2" in n]:
            layouts[f"{name} ahead0"] = layouts[name]
            variants[f"{name} ahead0"] = {"HETTRAIN_RECV_AHEAD": "0"}
    tokens = next(iter(layouts.values())).global_batch * model.seq_len
    print(f"model {model.layers}L h{model.hidden} seq{model.seq_len}; global batch "
          f"{tokens // model.seq_len} seqs = {tokens} tokens/step; median of {a.repeats}")
    print(f"{'':40} {'tokens/s (wall)':^45} | {'CPU ms/step':^26}")
    print(f"{'layout':40} {'plain 1b':>9} {'plain mb':>9} {'runtime':>8} {'rt/mb':>7} "
          f"{'rt/1b':>7} | {'plain mb':>8} {'runtime':>8} {'rt/mb':>7}")
    for name, plan in layouts.items():
        base, same, rt = [], [], []
        for _ in range(a.repeats):  # interleaved so drift hits all alike
            base.append(plain_loop(plan, a.steps))
            same.append(plain_loop(plan, a.steps, plan.micro_batch))
            rt.append(runtime(plan, a.steps, variants[name]))
        b, m, r = (tokens / statistics.median(w for w, _ in x) for x in (base, same, rt))
        cm, cr = (1e3 * statistics.median(c for _, c in x) for x in (same, rt))
        print(f"{name:40} {b:9.0f} {m:9.0f} {r:8.0f} {r / m:7.2f} {r / b:7.2f} | "
              f"{cm:8.1f} {cr:8.1f} {cr / cm:7.2f}")


def zb_vs_1f1b(repeats: int, steps: int) -> None:
    """Print 1F1B vs ZB-H1 (same layout, runs alternated) and Linear vs nn.Linear."""
    splits = {"pp2 dp1, 2+2": [(0, 2, "pool-a"), (2, 4, "pool-b")],
              "pp2 dp1, 3+1": [(0, 3, "pool-a"), (3, 4, "pool-b")]}
    tokens = 16 * TINY.seq_len
    print(f"median of {repeats}; {steps} steps; 8 microbatches of 2; ms/step (wall, rank 0) "
          "and CPU ms/step (summed over ranks)")
    print(f"{'layout':20} {'1f1b ms':>8} {'zb-h1 ms':>9} {'zb/1f1b':>8} | "
          f"{'1f1b CPU':>9} {'zb CPU':>8} {'zb/1f1b':>8}")
    for name, split in splits.items():
        res: dict[str, list[tuple[float, float]]] = {"1f1b": [], "zb-h1": []}
        for _ in range(repeats):
            for sched in res:
                res[sched].append(runtime(tiny_plan(split, dp=1, steps=steps,
                                                    num_microbatches=8, schedule=sched),
                                          steps))
        w1, wz = (1e3 * statistics.median(w for w, _ in res[k]) for k in res)
        c1, cz = (1e3 * statistics.median(c for _, c in res[k]) for k in res)
        print(f"{name:20} {w1:8.1f} {wz:9.1f} {wz / w1:8.2f} | {c1:9.1f} {cz:8.1f} "
              f"{cz / c1:8.2f}")
    plan = tiny_plan([(0, 4, "pool-a")], dp=1, steps=steps, num_microbatches=8)
    ours, theirs = [], []
    for _ in range(repeats):
        ours.append(plain_loop(plan, steps, plan.micro_batch))
        theirs.append(plain_loop(plan, steps, plan.micro_batch, torch_linear=True))
    o, t = (1e3 * statistics.median(w for w, _ in x) for x in (ours, theirs))
    oc, tc = (1e3 * statistics.median(c for _, c in x) for x in (ours, theirs))
    print(f"plain loop, 8 mb: hettrain Linear {o:.1f} ms ({oc:.1f} CPU) vs nn.Linear "
          f"{t:.1f} ms ({tc:.1f} CPU): {o / t:.2f}x wall, {oc / tc:.2f}x CPU; "
          f"{tokens} tokens/step")


def schedules_compare(repeats: int, steps: int) -> None:
    """Print 1F1B vs interleaved (v chunks) vs ZB-H1 step times on pp=2, dp=1 (runs alternated,
    medians of repeats; ratios to 1F1B)."""
    eight = dataclasses.replace(TINY, layers=8, name="gpt-tiny-8")
    layouts = {"4L 2+2, v=2": (TINY, [(0, 2, "pool-a"), (2, 4, "pool-b")], 2),
               "8L 4+4, v=2": (eight, [(0, 4, "pool-a"), (4, 8, "pool-b")], 2),
               "8L 4+4, v=4": (eight, [(0, 4, "pool-a"), (4, 8, "pool-b")], 4)}
    scheds = ("1f1b", "interleaved", "zb-h1")
    print(f"median of {repeats}; {steps} steps; 8 microbatches of 2; pp2 dp1; ms/step (wall, "
          "rank 0) and CPU ms/step (summed over ranks)")
    print(f"{'layout':14} {'1f1b':>7} {'inter':>7} {'zb-h1':>7} {'int/1f1b':>9} {'zb/1f1b':>8} |"
          f" {'1f1b CPU':>8} {'int CPU':>8} {'zb CPU':>8} {'int/1f1b':>9}")
    for name, (model, split, v) in layouts.items():
        res: dict[str, list[tuple[float, float]]] = {k: [] for k in scheds}
        for _ in range(repeats):
            for sched in scheds:
                plan = tiny_plan(split, dp=1, steps=steps, num_microbatches=8, schedule=sched,
                                 model=model)
                if sched == "interleaved":
                    plan = dataclasses.replace(plan, virtual_stages=v)
                res[sched].append(runtime(plan, steps))
        w = {k: 1e3 * statistics.median(x for x, _ in res[k]) for k in scheds}
        c = {k: 1e3 * statistics.median(y for _, y in res[k]) for k in scheds}
        print(f"{name:14} {w['1f1b']:7.1f} {w['interleaved']:7.1f} {w['zb-h1']:7.1f} "
              f"{w['interleaved'] / w['1f1b']:9.2f} {w['zb-h1'] / w['1f1b']:8.2f} | "
              f"{c['1f1b']:8.1f} {c['interleaved']:8.1f} {c['zb-h1']:8.1f} "
              f"{c['interleaved'] / c['1f1b']:9.2f}")



def planned_p2p_per_stage(plan) -> dict[int, float]:
    """Bytes per step each stage sends across its boundaries, as the plan charges them: one
    ``cost.activation_bytes`` tensor per microbatch, stream and replica."""
    act = cost.activation_bytes(plan.model, plan.micro_batch, cost.precision_bytes(plan.training))
    out = dict.fromkeys(range(plan.pp), 0.0)
    for st in plan_streams(plan):  # every replica's streams
        out[st.from_stage] += act * plan.num_microbatches
    return out


def measured_p2p_per_stage(plan, steps: int) -> tuple[dict[int, float], dict[int, float]]:
    """(sent, all-gathered) bytes per step per stage, from a real run's rank summaries."""
    sent = dict.fromkeys(range(plan.pp), 0.0)
    gathered = dict.fromkeys(range(plan.pp), 0.0)
    with tempfile.TemporaryDirectory() as d:
        summ = Path(d) / "summary"
        codes = wait_all(launch_local(plan, Path(d), {"HETTRAIN_METRICS_PORT": "0",
                                                      "HETTRAIN_SUMMARY_DIR": str(summ)}), 600)
        if any(codes):
            raise SystemExit(f"runtime failed: exit codes {codes}")
        for f in summ.glob("rank-*.json"):
            rec = json.loads(f.read_text())
            sent[rec["stage"]] += sum(r["bytes"] for r in rec["p2p"]) / steps
            gathered[rec["stage"]] += sum(r["gather_bytes"] for r in rec["p2p"]) / steps
    return sent, gathered


def p2p_bytes(steps: int) -> None:
    """Print measured vs planned pipeline bytes per stage and step."""
    steps = min(steps, 4)

    def bf16(plan):
        return dataclasses.replace(plan, training=dataclasses.replace(plan.training,
                                                                      precision="bf16"))

    two = [(0, 2, "pool-a"), (2, 4, "pool-b")]
    layouts = {
        "pp2 tp1 fp32": tiny_plan(two, dp=1, steps=steps),
        "pp2 tp1 bf16": bf16(tiny_plan(two, dp=1, steps=steps)),
        "pp2 tp2->2 bf16": bf16(tiny_plan(two, dp=1, steps=steps, tp=2)),
        "pp2 tp2->1 fp32": tiny_plan(two, dp=1, steps=steps, tp=(2, 1)),
        "pp2 v2 interleaved fp32": dataclasses.replace(
            tiny_plan(two, dp=1, steps=steps, schedule="interleaved"), virtual_stages=2),
    }
    print(f"pipeline bytes per step, {steps} steps; TINY model, microbatch 2 x 4")
    print(f"{'layout':26} {'stage':>5} {'measured':>10} {'planned':>10} {'meas/plan':>9} "
          f"{'TP gather':>10}")
    for name, plan in layouts.items():
        want = planned_p2p_per_stage(plan)
        got, gath = measured_p2p_per_stage(plan, steps)
        for s in range(plan.pp):
            print(f"{name:26} {s:5d} {got[s]:10.0f} {want[s]:10.0f} {got[s] / want[s]:9.3f} "
                  f"{gath[s]:10.0f}")


if __name__ == "__main__":
    main()
