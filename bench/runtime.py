"""Runtime overhead: tokens/s of ``python -m hettrain.runtime`` vs a plain single-process torch
loop of the same model, optimizer and global batch, measured side by side.

Default table (``overhead``): the runtime vs a plain torch loop over the SAME microbatches
(``micro_batch`` sequences, ``dp * num_microbatches`` of them, gradient accumulation) of the
same Llama model (``BENCH_LLAMA``: SwiGLU, GQA, Llama-3.1 RoPE, ~0.9 M parameters), same
precision and same optimizer settings: the plain loop is torch's own ``nn.Linear`` model,
``torch.optim.AdamW`` with the plan's betas/eps/decay groups, ``clip_grad_norm_`` and the LR
schedule; a bf16 plan runs it under ``torch.autocast`` (fp32 parameters and optimizer, bf16
compute), the runtime as planned (bf16 parameters, fp32 main grads and master). Recompute is
off in the plans (the plain loop recomputes nothing). Layouts: pp=1 dp=1 fp32 and bf16 (one
process vs the plain loop on one thread); pp=2 dp=1 (2+2 layers) and pp=1 dp=2 ZeRO-1, two
processes of one thread each vs the plain loop on 1 and on 2 intra-op threads (``rt/best``:
against the faster of the two).

CPU columns: process CPU seconds per step (all threads; the runtime's summed over its ranks)
vs the plain loop on one thread. They measure the runtime's extra WORK (communication,
bookkeeping) and stay meaningful on a loaded machine, where wall-clock ratios mostly measure
the scheduler. Each runtime step time is the median over steps after warm-up; each
configuration is repeated (interleaved with its baselines) and the median of the repeats
reported.

With ``--zb``: 1F1B vs ZB-H1 on the same pp=2 layouts (runs alternated, median of repeats),
and the plain loop with the runtime's deferrable ``Linear`` vs torch's ``nn.Linear`` (the cost
of the custom autograd function every schedule now pays).

With ``--schedule``: 1F1B vs interleaved 1F1B (virtual stages v) vs ZB-H1 vs interleaved-zb
(v chunks with ZB-H1's split) on pp=2 layouts (runs alternated, median of repeats), ms/step
and the ratio to 1F1B.

With ``--helix``: 1F1B vs ZB-H1 vs interleaved with one layer per chunk vs helix (the same
round-robin placement, each layer in three parts, attention cores on idle stages) in its
capped order and in its first-in-last-out one (``plan.helix_filo``) on pp=2 layouts with few
microbatches (m = pp, 2·pp and 4·pp; runs alternated, median of repeats), ms/step, the ratio
to 1F1B, and what the planner's replays predict for helix/1F1B (each order with the model's
part costs vs 1F1B's ``(m + pp − 1)/m``, compute only).

With ``--overlap``: the DP gradient sync overlapped with the backward (bucketed async
all-reduces, ``spec.training.overlapGradReduce`` true, the default) vs synced after it (false),
on dp=2 layouts (runs alternated, median of repeats): ms/step (wall, rank 0), CPU ms/step
(summed over ranks) and the seconds per step the ranks spent in DP communication outside the
backward (mean over ranks of the intra-pool comm seconds: the whole all-reduce when synced
after the backward, the wait after it when overlapped; the loss all-reduce and, under ZeRO-1,
the parameter all-gather are in both). ``--bucket-mb`` sets ``HETTRAIN_DP_BUCKET_MB``.

With ``--p2p``: pipeline bytes per stage and step, measured (the ranks' summaries: what each
stage sent across its boundaries, and its TP all-gathers on receipt) next to what the plan
charges (``planning.cost.activation_bytes`` per boundary tensor sent), for fp32/bf16 plans and
TP-sharded boundaries. Bytes are deterministic: one run per layout.

    .venv/bin/python bench/runtime.py [--repeats 3] [--steps 12] [--ab-recv-ahead] [--zb]
                                      [--schedule] [--helix] [--p2p]
                                      [--overlap [--bucket-mb MB]]
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

from hettrain.api.spec import MODEL_PRESETS, ModelSpec  # noqa: E402
from hettrain.planning import cost  # noqa: E402
from hettrain.runtime.collectives.p2p import plan_streams  # noqa: E402
from hettrain.runtime.data import microbatches  # noqa: E402
from hettrain.runtime.launch import launch_local, wait_all  # noqa: E402
from hettrain.runtime.lr_schedule import lr_at  # noqa: E402
from hettrain.runtime.model import Linear, lm_loss, whole_model  # noqa: E402
from hettrain.runtime.optim import decays, param_kinds  # noqa: E402

WARMUP = 3
# the overhead table's model: Llama-shaped (SwiGLU, GQA, Llama-3.1 RoPE), big enough that a
# microbatch of 2 sequences is matmul time rather than per-op dispatch on one CPU core
BENCH_LLAMA = ModelSpec(**{**MODEL_PRESETS["llama-tiny"], "hidden": 128, "ffn_hidden": 384,
                           "heads": 4, "kv_heads": 2, "vocab": 512, "seq_len": 64,
                           "name": "llama-bench"})


def _torch_linears(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every deferrable ``Linear`` swapped for a plain ``nn.Linear``."""
    for name, mod in list(model.named_modules()):
        if isinstance(mod, Linear):
            plain = torch.nn.Linear(mod.in_features, mod.out_features, bias=False)
            plain.weight = mod.weight
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, plain)
    return model


def torch_adamw(model: torch.nn.Module, t) -> torch.optim.Optimizer:
    """torch's own AdamW with the plan's hyper-parameters and decay groups (what a plain loop
    would use for the runtime's flat AdamW)."""
    kinds = param_kinds(model)
    groups: dict[bool, list[torch.nn.Parameter]] = {True: [], False: []}
    for name, p in model.named_parameters():
        groups[decays(kinds[name], t)].append(p)
    return torch.optim.AdamW(
        [{"params": groups[True], "weight_decay": t.weight_decay},
         {"params": groups[False], "weight_decay": 0.0}],
        lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)


def plain_loop(plan, steps: int, micro_batch: int | None = None,
               torch_linear: bool = False, threads: int = 1) -> tuple[float, float]:
    """Median (wall, CPU) seconds per step of a bare torch loop over the same global batches,
    in microbatches of ``micro_batch`` sequences (default: the whole global batch at once),
    with torch's AdamW (the plan's hyper-parameters and decay groups), gradient clipping and
    LR schedule; a bf16/fp16 plan runs the forward/backward under ``torch.autocast`` (fp32
    parameters, grads and optimizer state: the usual torch mixed precision), on ``threads``
    intra-op threads."""
    torch.set_num_threads(threads)
    t = plan.training
    model = whole_model(plan.model, t.seed)
    if torch_linear:
        model = _torch_linears(model)
    opt = torch_adamw(model, t)
    params = list(model.parameters())
    mb = micro_batch or plan.global_batch
    m = plan.global_batch // mb
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
    walls, cpus = [], []
    for step in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        for g in opt.param_groups:
            g["lr"] = lr_at(t, step)
        opt.zero_grad(set_to_none=True)
        for x, y in microbatches(t.seed, step, dp=1, dp_index=0, micro_batch=mb,
                                 num_microbatches=m, seq_len=plan.model.seq_len,
                                 vocab=plan.model.vocab):
            with torch.autocast("cpu", dtype=low, enabled=low is not None):
                loss = lm_loss(model(x), y)
            (loss / m).backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    torch.set_num_threads(1)
    return statistics.median(walls[WARMUP:]), statistics.median(cpus[WARMUP:])


def runtime(plan, steps: int, env: dict[str, str] | None = None) -> tuple[float, float]:
    """Median wall seconds per step (rank 0) and the sum over ranks of each rank's median CPU
    seconds per step, of the real runtime."""
    secs, recs = _launch(plan, env or {})
    cpu = sum(statistics.median(r["step_cpu_seconds"][WARMUP:]) for r in recs)
    return statistics.median(secs[WARMUP:]), cpu


def _launch(plan, env: dict[str, str]) -> tuple[list[float], list[dict]]:
    """Run the plan's ranks as local processes: rank 0's seconds per step and every rank's
    summary record."""
    with tempfile.TemporaryDirectory() as d:
        log, summ = Path(d) / "loss.jsonl", Path(d) / "summary"
        codes = wait_all(launch_local(plan, Path(d), {"HETTRAIN_LOSS_LOG": str(log),
                                                      "HETTRAIN_METRICS_PORT": "0",
                                                      "HETTRAIN_SUMMARY_DIR": str(summ),
                                                      **env}), 600)
        if any(codes):
            raise SystemExit(f"runtime failed: exit codes {codes}")
        secs = [json.loads(line)["seconds"] for line in log.read_text().splitlines()]
        return secs, [json.loads(f.read_text()) for f in summ.glob("rank-*.json")]


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
                    help="only the 1F1B vs interleaved vs ZB-H1 vs interleaved-zb comparison "
                         "(pp=2)")
    ap.add_argument("--helix", action="store_true",
                    help="only the 1F1B vs ZB-H1 vs interleaved vs helix comparison (pp=2, "
                         "few microbatches)")
    ap.add_argument("--p2p", action="store_true",
                    help="only the measured vs planned pipeline bytes per stage")
    ap.add_argument("--overlap", action="store_true",
                    help="only the DP sync overlapped vs after the backward (dp=2)")
    ap.add_argument("--bucket-mb", type=float, default=0.5,
                    help="--overlap: the gradient bucket in MiB (HETTRAIN_DP_BUCKET_MB)")
    a = ap.parse_args()
    if a.overlap:
        overlap_compare(a.repeats, a.steps, a.bucket_mb)
        return
    if a.p2p:
        p2p_bytes(a.steps)
        return
    if a.schedule:
        schedules_compare(a.repeats, a.steps)
        return
    if a.helix:
        helix_compare(a.repeats, a.steps)
        return
    if a.zb:
        zb_vs_1f1b(a.repeats, a.steps)
        return
    overhead(a.repeats, a.steps, a.ab_recv_ahead)


def overhead_layouts(steps: int) -> dict[str, tuple[object, int]]:
    """``{name: (plan, threads of the plain loop)}``: every layout has the same global batch
    (16 sequences in microbatches of 2) and, per process, the compute of one core; the plain
    loop gets as many intra-op threads as the runtime has processes."""
    m = BENCH_LLAMA
    kw = {"model": m, "steps": steps, "recompute": "none"}  # the plain loop recomputes nothing
    one, two = [(0, m.layers, "pool-a")], [(0, m.layers // 2, "pool-a"),
                                           (m.layers // 2, m.layers, "pool-b")]
    return {
        "pp1 dp1 fp32 | plain 1 thread": (
            tiny_plan(one, dp=1, num_microbatches=8, **kw), 1),
        "pp1 dp1 bf16 | plain 1 thread": (
            tiny_plan(one, dp=1, num_microbatches=8, precision="bf16", **kw), 1),
        "pp2 dp1 fp32 2+2 | plain 2 threads": (
            tiny_plan(two, dp=1, num_microbatches=8, **kw), 2),
        "pp1 dp2 fp32 ZeRO-1 | plain 2 threads": (
            tiny_plan(one, dp=2, num_microbatches=4, **kw), 2),
    }


def overhead(repeats: int, steps: int, ab_recv_ahead: bool = False) -> None:
    """Print tokens/s (wall) and CPU per step of the runtime vs the plain loop over the same
    microbatches, per layout. A layout of ``n`` processes is compared with the plain loop on
    1 thread and on ``n`` threads (the better one counts): intra-op threads on a loaded host
    can cost more than they give."""
    layouts = overhead_layouts(steps)
    variants: dict[str, dict[str, str]] = {name: {} for name in layouts}
    if ab_recv_ahead:  # A/B of posting pipeline receives ahead (default 1) vs on demand
        for name in [n for n in layouts if "pp2" in n]:
            layouts[f"{name} ahead0"] = layouts[name]
            variants[f"{name} ahead0"] = {"HETTRAIN_RECV_AHEAD": "0"}
    model = BENCH_LLAMA
    tokens = next(iter(layouts.values()))[0].global_batch * model.seq_len
    print(f"Llama {model.layers}L h{model.hidden} ffn{model.ffn_hidden} GQA {model.heads}/"
          f"{model.kv_heads} seq{model.seq_len} vocab{model.vocab} ({model.parameters()} "
          f"params); global batch {tokens // model.seq_len} seqs = {tokens} tokens/step in "
          f"microbatches of 2; {steps} steps ({WARMUP} warm-up); median of {repeats}")
    print(f"{'':40} {'tokens/s (wall)':^38} | {'CPU ms/step (all threads/ranks)':^31}")
    print(f"{'layout | plain loop threads':40} {'plain 1t':>9} {'plain nt':>9} {'runtime':>8} "
          f"{'rt/best':>8} | {'plain 1t':>9} {'runtime':>9} {'rt/plain':>9}")
    for name, (plan, threads) in layouts.items():
        one, many, rt = [], [], []
        for _ in range(repeats):  # interleaved so drift hits all alike
            one.append(plain_loop(plan, steps, plan.micro_batch, torch_linear=True))
            if threads > 1:
                many.append(plain_loop(plan, steps, plan.micro_batch, torch_linear=True,
                                       threads=threads))
            rt.append(runtime(plan, steps, variants[name]))
        p1, r = (tokens / statistics.median(w for w, _ in x) for x in (one, rt))
        pn = tokens / statistics.median(w for w, _ in many) if many else float("nan")
        best = max(p1, pn) if many else p1
        c1, cr = (1e3 * statistics.median(c for _, c in x) for x in (one, rt))
        print(f"{name:40} {p1:9.0f} {pn:9.0f} {r:8.0f} {r / best:8.2f} | "
              f"{c1:9.1f} {cr:9.1f} {cr / c1:9.2f}", flush=True)


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
    """Print 1F1B vs interleaved (v chunks) vs ZB-H1 vs interleaved-zb (v chunks) step times on
    pp=2, dp=1 (runs alternated, medians of repeats; ratios to 1F1B)."""
    eight = dataclasses.replace(TINY, layers=8, name="gpt-tiny-8")
    # wider layers: compute, not the per-action overhead of a hidden-32 toy, sets the step
    wide = dataclasses.replace(TINY, layers=8, hidden=256, ffn_hidden=768, heads=8, kv_heads=4,
                               seq_len=128, name="gpt-wide-8")
    layouts = {"4L 2+2, v=2": (TINY, [(0, 2, "pool-a"), (2, 4, "pool-b")], 2),
               "8L 4+4, v=2": (eight, [(0, 4, "pool-a"), (4, 8, "pool-b")], 2),
               "8L 4+4, v=4": (eight, [(0, 4, "pool-a"), (4, 8, "pool-b")], 4),
               "8L h256, v=2": (wide, [(0, 4, "pool-a"), (4, 8, "pool-b")], 2)}
    scheds = ("1f1b", "interleaved", "zb-h1", "interleaved-zb")
    print(f"median of {repeats}; {steps} steps; 8 microbatches of 2; pp2 dp1; ms/step (wall, "
          "rank 0) and CPU ms/step (summed over ranks)")
    print(f"{'layout':14} {'1f1b':>7} {'inter':>7} {'zb-h1':>7} {'int-zb':>7} {'int/1f1b':>9} "
          f"{'zb/1f1b':>8} {'izb/1f1b':>9} | {'1f1b CPU':>8} {'int CPU':>8} {'zb CPU':>8} "
          f"{'izb CPU':>8} {'izb/zb CPU':>10}")
    for name, (model, split, v) in layouts.items():
        res: dict[str, list[tuple[float, float]]] = {k: [] for k in scheds}
        for _ in range(repeats):
            for sched in scheds:
                plan = tiny_plan(split, dp=1, steps=steps, num_microbatches=8, schedule=sched,
                                 model=model)
                if sched in ("interleaved", "interleaved-zb"):
                    plan = dataclasses.replace(plan, virtual_stages=v)
                res[sched].append(runtime(plan, steps))
        w = {k: 1e3 * statistics.median(x for x, _ in res[k]) for k in scheds}
        c = {k: 1e3 * statistics.median(y for _, y in res[k]) for k in scheds}
        print(f"{name:14} {w['1f1b']:7.1f} {w['interleaved']:7.1f} {w['zb-h1']:7.1f} "
              f"{w['interleaved-zb']:7.1f} {w['interleaved'] / w['1f1b']:9.2f} "
              f"{w['zb-h1'] / w['1f1b']:8.2f} {w['interleaved-zb'] / w['1f1b']:9.2f} | "
              f"{c['1f1b']:8.1f} {c['interleaved']:8.1f} {c['zb-h1']:8.1f} "
              f"{c['interleaved-zb']:8.1f} {c['interleaved-zb'] / c['zb-h1']:10.2f}")



def helix_compare(repeats: int, steps: int) -> None:
    """Print 1F1B vs ZB-H1 vs interleaved (one layer per chunk) vs helix (capped and
    first-in-last-out orders) step times on pp=2, dp=1 with m = pp, 2·pp and 4·pp
    microbatches (runs alternated, medians of repeats; ratios to 1F1B), and the replayed
    helix/1F1B ratios the planner would price."""
    from hettrain.planning import helix

    # the attention core is about a third of a layer at 512 tokens (helix.part_costs)
    model = dataclasses.replace(TINY, layers=8, hidden=128, ffn_hidden=256, heads=4,
                                kv_heads=2, seq_len=512, name="gpt-helix-8")
    split = [(0, 4, "pool-a"), (4, 8, "pool-b")]
    scheds = ("1f1b", "zb-h1", "interleaved", "helix", "helix-filo")
    costs = helix.costs_for(model)
    print(f"median of {repeats}; {steps} steps; microbatches of 1 x {model.seq_len} tokens; "
          f"pp2 dp1, 8 layers (core {costs['Fa']:.0%} of a layer's forward); ms/step (wall, "
          "rank 0); replay: the order's makespan over 1F1B's, compute only")
    print(f"{'m':>3} {'1f1b':>7} {'zb-h1':>7} {'inter':>7} {'helix':>7} {'filo':>7} "
          f"{'zb/1f1b':>8} {'int/1f1b':>9} {'hx/1f1b':>8} {'filo/1f1b':>10} {'replay hx':>10} "
          f"{'replay filo':>12}")
    for m in (2, 4, 8):
        res: dict[str, list[tuple[float, float]]] = {k: [] for k in scheds}
        for _ in range(repeats):
            for sched in scheds:
                plan = tiny_plan(split, dp=1, steps=steps, num_microbatches=m, micro_batch=1,
                                 schedule=sched.removesuffix("-filo"), model=model)
                if sched in ("interleaved", "helix", "helix-filo"):
                    plan = dataclasses.replace(plan, virtual_stages=4,
                                               helix_filo=sched == "helix-filo")
                res[sched].append(runtime(plan, steps))
        w = {k: 1e3 * statistics.median(x for x, _ in res[k]) for k in scheds}
        one = (m + 1) * 4 * sum(costs.values())
        replay = {filo: helix.makespan(helix.helix_orders(2, 8, m, costs, filo=filo), 8,
                                       [costs] * 2) / one for filo in (False, True)}
        print(f"{m:3d} {w['1f1b']:7.1f} {w['zb-h1']:7.1f} {w['interleaved']:7.1f} "
              f"{w['helix']:7.1f} {w['helix-filo']:7.1f} {w['zb-h1'] / w['1f1b']:8.2f} "
              f"{w['interleaved'] / w['1f1b']:9.2f} {w['helix'] / w['1f1b']:8.2f} "
              f"{w['helix-filo'] / w['1f1b']:10.2f} {replay[False]:10.2f} "
              f"{replay[True]:12.2f}")


def _dp_run(plan, steps: int, env: dict[str, str]) -> tuple[float, float, float]:
    """Median wall s/step (rank 0), summed median CPU s/step, and mean over ranks of the
    intra-pool comm seconds per step (after warm-up excluded: total / steps)."""
    secs, recs = _launch(plan, env)
    cpu = sum(statistics.median(r["step_cpu_seconds"][WARMUP:]) for r in recs)
    comm = statistics.mean(r["seconds"].get("intra_pool", 0.0) / r["steps"] for r in recs)
    return statistics.median(secs[WARMUP:]), cpu, comm


def overlap_compare(repeats: int, steps: int, bucket_mb: float) -> None:
    """Print DP sync overlapped with the backward vs after it, on dp=2 (runs alternated,
    medians of repeats)."""
    wide = dataclasses.replace(BENCH_LLAMA, hidden=256, ffn_hidden=768, name="llama-bench-256")
    kw = {"steps": steps, "recompute": "none", "num_microbatches": 4}
    layouts = {
        "dp2 h128 fp32": tiny_plan([(0, 4, "pool-a")], dp=2, model=BENCH_LLAMA,
                                   optimizer_sharding=False, **kw),
        "dp2 h256 fp32": tiny_plan([(0, 4, "pool-a")], dp=2, model=wide,
                                   optimizer_sharding=False, **kw),
        "dp2 h256 ZeRO-1": tiny_plan([(0, 4, "pool-a")], dp=2, model=wide, **kw),
    }
    env = {"HETTRAIN_DP_BUCKET_MB": str(bucket_mb)}
    print(f"median of {repeats}; {steps} steps ({WARMUP} warm-up); 4 microbatches of 2 per "
          f"replica; buckets of {bucket_mb} MiB; ms/step (wall, rank 0), CPU ms/step (summed "
          "over ranks), DP comm ms/step outside the backward (mean over ranks)")
    print(f"{'layout':16} {'grads MB':>8} {'after':>7} {'overlap':>8} {'ov/after':>8} | "
          f"{'CPU aft':>8} {'CPU ov':>7} {'ov/aft':>7} | {'comm aft':>8} {'comm ov':>8}")
    for name, plan in layouts.items():
        off = dataclasses.replace(plan, training=dataclasses.replace(
            plan.training, overlap_grad_reduce=False))
        res: dict[str, list[tuple[float, float, float]]] = {"after": [], "overlap": []}
        for _ in range(repeats):  # alternated so drift hits both alike
            res["after"].append(_dp_run(off, steps, env))
            res["overlap"].append(_dp_run(plan, steps, env))
        w, c, m = ({k: 1e3 * statistics.median(x[i] for x in res[k]) for k in res}
                   for i in range(3))
        mb = plan.model.parameters() * 4 / 2**20
        print(f"{name:16} {mb:8.1f} {w['after']:7.1f} {w['overlap']:8.1f} "
              f"{w['overlap'] / w['after']:8.2f} | {c['after']:8.1f} {c['overlap']:7.1f} "
              f"{c['overlap'] / c['after']:7.2f} | {m['after']:8.1f} {m['overlap']:8.1f}",
              flush=True)


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
