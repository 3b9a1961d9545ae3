"""GPU readiness check: a two-layer Llama-3-8B-shaped stage, measured next to the plan.

One command, a few minutes on one accelerator::

    python bench/gpu_check.py                 # CUDA when present, else a small CPU shape
    python bench/gpu_check.py --device cpu    # force the CPU (small shape, seconds)

For fp32 and bf16 and each recompute mode (``api.spec.RECOMPUTE_MODES``) it plans the stage with
the real planner (one device of the catalog type that matches, tp = pp = dp = 1, microbatch 1)
and runs it as a rank does (``runtime.model.StageModel`` with the plan's recompute, the
``runtime.optim.StageOptimizer`` with the plan's precision: fp32 master, fp32 main grads, AdamW):
``--repeats`` optimizer steps of forward + backward + step. It prints, per case, the measured
peak bytes (CUDA: ``torch.cuda.max_memory_allocated``; CPU: :func:`runtime.memory.measure_stage`,
which counts parameters, grads, optimizer state and peak saved tensors) next to the plan's
per-device memory minus its fixed framework overhead, and the median step time next to the
plan's forward+backward time of the stage plus its optimizer step (``plan.predicted.
optimizer_s``). Ratios are measured / predicted. Then one context-parallel rank's attention
core with the runtime's lower-right causal bias against the same masks as boolean tensors, next
to the cost model's ratio of the two (below 1 where the kernels skip masked tiles). Last, the
last stage's final norm, LM head and loss of one long sequence (llama3-8b's 4096 × 128256 head,
16k tokens, bf16; the small shape on the CPU) with the whole-sequence loss and the chunked one
(``bench/chunked_loss.py``): measured seconds and peak bytes next to the cost model's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from hettrain.api.spec import RECOMPUTE_MODES, parse_job_spec
from hettrain.planning import context, cost
from hettrain.planning.catalog import CATALOG
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import plan_job
from hettrain.runtime.memory import measure_stage, predicted_stage_bytes
from hettrain.runtime.model import AttentionKernelRuns, StageModel, lm_loss
from hettrain.runtime.optim import StageOptimizer

GIB = 2**30
# the CPU stand-in: Llama-3 proportions (GQA 4:1, SwiGLU 3.5x) at a size a laptop trains
SMALL_MODEL = {"layers": 2, "hidden": 512, "heads": 8, "kvHeads": 2, "ffnHidden": 1792,
               "seqLen": 256, "vocab": 8192, "gatedMlp": True}


def catalog_device(device: torch.device) -> str:
    """The catalog device the plan is made for: the local GPU's type, or CPU."""
    if device.type != "cuda":
        return "CPU"
    name = torch.cuda.get_device_name(device)
    for key, dev in (("H200", "H200"), ("H100", "H100-SXM"), ("A100", "A100-80GB")):
        if key in name:
            return dev
    return "H100-SXM"


def make_plan(model: dict, precision: str, recompute: str, device_name: str):
    """The planner's plan for one stage holding the whole two-layer model on one device."""
    spec = parse_job_spec({
        "model": model,
        "training": {"globalBatch": 1, "steps": 1, "microBatch": 1, "precision": precision,
                     "recompute": recompute, "optimizerSharding": False},
        "parallelism": {"tp": 1, "pp": 1, "dp": 1, "schedule": "1f1b"},
        "data": {"synthetic": True},
    })
    cluster = load_cluster({
        "apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "one"},
        "datacenters": [{"name": "dc"}],
        "pools": [{"name": "p", "datacenter": "dc", "device": device_name, "nodes": 1,
                   "gpusPerNode": 1, "nicGbps": 100}],
    })
    return plan_job("gpu-check", spec, cluster)


def run_case(plan, device: torch.device, repeats: int) -> tuple[float, float, float]:
    """(peak bytes, median step seconds, attention kernel runs per layer of one more
    forward + backward) of ``repeats`` optimizer steps of the stage."""
    st = plan.stages[0]
    model = StageModel(plan.model, st.layer_start, st.layer_end, has_embedding=True,
                       has_head=True, seed=plan.training.seed,
                       recompute=plan.training.recompute).to(device)
    opt = StageOptimizer(model, plan.training)
    gen = torch.Generator().manual_seed(0)
    shape = (plan.micro_batch, plan.model.seq_len)
    x = torch.randint(0, plan.model.vocab, shape, generator=gen).to(device)
    y = torch.randint(0, plan.model.vocab, shape, generator=gen).to(device)
    cuda = device.type == "cuda"
    times = []
    for step in range(repeats + 1):  # the first step warms up (allocator, kernels)
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        opt.zero_grad()
        (lm_loss(model(x), y) * opt.loss_scale).backward()
        opt.step(step)
        if cuda:
            torch.cuda.synchronize(device)
        if step:
            times.append(time.perf_counter() - t0)
    if cuda:
        peak = float(torch.cuda.max_memory_allocated(device))
    else:
        peak = float(measure_stage(plan, 0).total)
    with AttentionKernelRuns() as runs:  # 1 per layer unless the mode re-runs attention
        lm_loss(model(x), y).backward()
    del model, opt
    return peak, statistics.median(times), runs.count / st.layers


def cp_attention_check(device: torch.device, seq: int, cp: int, repeats: int
                       ) -> tuple[float, float, float]:
    """One CP rank's attention core, forward + backward (llama3-8b heads: 32 query, 8 KV, 128
    wide; bf16 on a GPU, fp32 on the CPU; rank 1 of ``cp`` on ``seq`` tokens, one of the ranks
    with the most pairs: :class:`runtime.context_parallel.StandInContextParallel`), with the
    runtime's lower-right causal bias and with the same masks materialised as boolean tensors:
    ``(bias s, boolean s, difference)``, medians of ``repeats``. Where the kernel skips masked
    tiles the first is about ``context.attention_share`` with the skip over it without of the
    second. ``difference``: the largest gap between the two runs' outputs and input gradients,
    over the largest value (the kernels differ, the masks are the same: rounding only)."""
    from hettrain.runtime.context_parallel import StandInContextParallel

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    rank = StandInContextParallel(cp, 1, seq)
    local = 2 * rank.chunk
    q = torch.randn(1, 32, local, 128, generator=gen).to(device, dtype).requires_grad_()
    k = torch.randn(1, 8, seq, 128, generator=gen).to(device, dtype).requires_grad_()
    v = torch.randn(1, 8, seq, 128, generator=gen).to(device, dtype).requires_grad_()
    upstream = torch.randn(1, 32, local, 128, generator=gen).to(device, dtype)
    biases = dict(rank._causal)
    seconds, results = [], []
    for masks in (biases, {j: b._materialize(device) for j, b in biases.items()}):
        rank._causal = masks
        times = []
        for step in range(repeats + 1):  # the first warms up
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            out = rank._core(q, k, v, tuple(masks[j] for j in rank._mine))
            grads = torch.autograd.grad(out, (q, k, v), upstream)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step:
                times.append(time.perf_counter() - t0)
        seconds.append(statistics.median(times))
        results.append([t.float() for t in (out.detach(), *grads)])
    diff = max(((x - y).abs().max() / y.abs().max()).item()
               for x, y in zip(*results, strict=True))
    return seconds[0], seconds[1], diff


def main(argv: list[str] | None = None) -> int:
    """Print the measured-vs-planned table; exit 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--seq-len", type=int, default=0,
                    help="tokens per sequence (default: 4096 on a GPU, the small shape's 256 "
                         "on the CPU)")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per case (median)")
    args = ap.parse_args(argv)
    if args.seq_len and args.seq_len % 16:
        print(f"error: --seq-len {args.seq_len}: must be a multiple of 16 (two chunks per rank "
              "at cp 8)", file=sys.stderr)
        return 2
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device here", file=sys.stderr)
        return 2
    device = torch.device("cuda:0" if use_cuda else "cpu")
    model = ({"preset": "llama3-8b", "layers": 2, "seqLen": args.seq_len or 4096}
             if use_cuda else dict(SMALL_MODEL, **({"seqLen": args.seq_len}
                                                   if args.seq_len else {})))
    dev_name = catalog_device(device)
    print(f"device {device} ({torch.cuda.get_device_name(device) if use_cuda else 'CPU'}); "
          f"plan device {dev_name}; model {model}")
    print(f"{'precision':>9} {'recompute':>14} | {'measured GiB':>12} {'planned GiB':>11} "
          f"{'ratio':>6} | {'step ms':>9} {'planned ms':>10} {'ratio':>6} {'fwd+bwd ms':>10} "
          f"{'attn/layer':>10}")
    for precision in ("fp32", "bf16"):
        for recompute in RECOMPUTE_MODES:
            plan = make_plan(model, precision, recompute, dev_name)
            planned = predicted_stage_bytes(plan, 0)
            if use_cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            peak, seconds, attn = run_case(plan, device, args.repeats)
            fwd_bwd_ms = plan.stages[0].time_ms
            planned_ms = fwd_bwd_ms + plan.predicted.optimizer_s * 1e3
            print(f"{precision:>9} {recompute:>14} | {peak / GIB:12.3f} {planned / GIB:11.3f} "
                  f"{peak / planned:6.3f} | {seconds * 1e3:9.1f} {planned_ms:10.1f} "
                  f"{seconds * 1e3 / planned_ms:6.3f} {fwd_bwd_ms:10.1f} {attn:10.1f}")
    print(f"planned GiB = the plan's stage memory minus its fixed "
          f"{cost.FRAMEWORK_OVERHEAD_BYTES / GIB:.0f} GiB framework overhead; planned ms = the "
          "stage's forward+backward of one microbatch plus the plan's optimizer step "
          "(fwd+bwd ms: the first alone); attn/layer = attention kernel runs per layer of one "
          "forward + backward (2 where the mode re-runs attention, else 1)")
    cp_seq = args.seq_len or (32768 if use_cuda else 2048)
    dev = CATALOG[dev_name]
    print(f"CP attention core of rank 1, {cp_seq} tokens, fwd+bwd, median of {args.repeats}: "
          "lower-right causal bias vs the same masks as boolean tensors")
    print(f"{'cp':>3} {'bias ms':>9} {'boolean ms':>10} {'ratio':>6} {'planned ratio':>13} "
          f"{'difference':>10}")
    for cp in (2, 4, 8):
        planned = (context.attention_share(cp, skips_masked=cost.skips_masked_tiles(dev))
                   / context.attention_share(cp, skips_masked=False))
        try:
            bias_s, bool_s, diff = cp_attention_check(device, cp_seq, cp, args.repeats)
        except torch.OutOfMemoryError:  # the boolean masks' path may materialise the scores
            print(f"{cp:3d} out of memory (planned ratio {planned:.3f})")
            torch.cuda.empty_cache()
            continue
        print(f"{cp:3d} {bias_s * 1e3:9.1f} {bool_s * 1e3:10.1f} {bias_s / bool_s:6.3f} "
              f"{planned:13.3f} {diff:10.1e}")
    print("planned ratio = the cost model's attention pairs with the bias over those with every "
          "masked pair computed (below 1 where the device's kernels skip masked tiles); a boolean "
          "mask also keeps SDPA off the flash kernel, so on a GPU the measured ratio may be lower; "
          "difference = largest gap between the two runs' outputs and gradients over the "
          "largest value (rounding only: about 1e-2 in bf16, 1e-6 in fp32)")
    chunked_loss_check(device, dev_name, args.repeats)
    return 0


def chunked_loss_check(device: torch.device, dev_name: str, repeats: int) -> None:
    """Print the whole-sequence and the chunked loss of one long sequence side by side
    (module docstring): seconds, peak bytes (CUDA; '-' on the CPU, see
    ``bench/chunked_loss.py`` for its resident memory), the cost model's bytes and head time."""
    import chunked_loss as cl

    cuda = device.type == "cuda"
    seq, hidden, vocab = (16384, 4096, 128256) if cuda else (2048, 512, 8192)
    precision = "bf16" if cuda else "fp32"
    print(f"final norm + LM head + loss, 1 × {seq} tokens, hidden {hidden}, vocab {vocab}, "
          f"{precision}, fwd+bwd, median of {repeats}: whole vs {cost.LOSS_CHUNK_TOKENS}-token "
          "chunks")
    print(f"{'variant':>8} {'ms':>9} {'peak GiB':>9} {'planned GiB':>11}")
    seconds = {}
    for variant, chunk in (("whole", 0), ("chunked", cost.LOSS_CHUNK_TOKENS)):
        try:
            seconds[variant], peak = cl.run_head_loss(device, seq, hidden, vocab, chunk,
                                                      precision, repeats)
        except torch.OutOfMemoryError:
            print(f"{variant:>8} out of memory")
            torch.cuda.empty_cache()
            continue
        planned = cl.predicted_loss_bytes(seq, hidden, vocab, precision, chunk)
        shown = f"{peak / GIB:9.3f}" if peak is not None else f"{'-':>9}"
        print(f"{variant:>8} {seconds[variant] * 1e3:9.1f} {shown} {planned / GIB:11.3f}")
        if cuda:
            torch.cuda.empty_cache()
    if len(seconds) == 2:
        planned_ratio = cl.head_time_ratio(seq, hidden, vocab, cost.LOSS_CHUNK_TOKENS, dev_name
                                           if dev_name != "CPU" else "H100-SXM")
        print(f"chunked / whole seconds: measured {seconds['chunked'] / seconds['whole']:.3f}, "
              f"planned {planned_ratio:.3f} (the head's time; the final norm is in both)")


if __name__ == "__main__":
    sys.exit(main())
