"""The chunked LM head and loss (``plan.training.loss_chunk_tokens``) against the whole-sequence
head on this machine's CPU: time of the head + loss forward and backward, and the process's
peak resident memory, each variant in a fresh process (``ru_maxrss``), beside the cost model's
bytes for what the loss holds (``cost.stage_memory``'s last-stage loss terms: the saved
log-softmax or log-sum-exp and the loss's transient buffers) and its head time ratio
(``cost.head_time_s``: one more forward GEMM, 4/3). The model's bytes here are the last
stage's fixed bytes without the framework overhead and the head's parameter state, plus the
head weight's ``.grad`` (this process has no optimizer to fold it into).

``--plans`` instead plans llama3-8b (1M tokens per step, bf16, ZeRO-1) at 32k–128k tokens on
single-pool clusters twice, side by side: with the whole-sequence loss only (the planner
before the chunked loss) and as ``plan_job`` plans it (the faster of whole and chunked), and
prints tokens/s and the layouts.

Usage: python bench/chunked_loss.py [--seq 8192] [--hidden 256] [--vocab 32000]
                                    [--chunk 2048] [--repeats 3] [--precision fp32|bf16]
       python bench/chunked_loss.py --plans
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def head_model(seq: int, hidden: int, vocab: int):
    """A one-layer model of these sizes (only its final norm and LM head are run)."""
    from hettrain.api.spec import ModelSpec

    return ModelSpec(layers=1, hidden=hidden, heads=8, seq_len=seq, vocab=vocab,
                     ffn_hidden=4 * hidden, kv_heads=8)


def run_head_loss(device, seq: int, hidden: int, vocab: int, chunk: int, precision: str,
                  repeats: int) -> tuple[float, int | None]:
    """The final norm, LM head and loss of one ``seq``-token sequence, forward + backward, as
    the last stage runs them (``chunk`` 0: the whole-sequence loss): the median seconds of
    ``repeats`` (after one warm-up on CUDA) and, on CUDA, the peak bytes allocated beyond the
    weights (None elsewhere)."""
    import torch

    from hettrain.runtime.model import StageModel

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    cuda = torch.device(device).type == "cuda"
    net = StageModel(head_model(seq, hidden, vocab), 0, 1, has_embedding=False, has_head=True,
                     seed=1, loss_chunk_tokens=chunk).to(device, dtype)
    gen = torch.Generator().manual_seed(0)
    y = torch.randint(0, vocab, (1, seq), generator=gen).to(device)
    base = 0
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = []
    for step in range(repeats + int(cuda)):
        h = torch.randn(1, seq, hidden, generator=gen).to(device, dtype).requires_grad_()
        t0 = time.perf_counter()
        net.loss(net.head_output(net.model.norm(h)), y).backward()
        if cuda:
            torch.cuda.synchronize(device)
        if step or not cuda:
            times.append(time.perf_counter() - t0)
        net.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
    return statistics.median(times), peak


def predicted_loss_bytes(seq: int, hidden: int, vocab: int, precision: str, chunk: int) -> float:
    """The cost model's bytes of the final norm, head and loss of one sequence on the last
    stage (saved + transient: ``cost.stage_memory``'s fixed bytes without the framework
    overhead and the head's parameter state), plus the head weight's ``.grad`` (no optimizer
    here folds it into a main grad)."""
    from hettrain.api.spec import TrainingSpec
    from hettrain.planning import cost

    model = head_model(seq, hidden, vocab)
    training = replace(TrainingSpec(global_batch=1, steps=1, precision=precision,
                                    optimizer_sharding=False, recompute="none"),
                       loss_chunk_tokens=chunk)
    mem = cost.stage_memory(model, training, tp=1, dp=1, micro_batch=1, first=False, last=True,
                            **cost.schedule_memory_args(0, 1, 1, "1f1b"))
    head = cost.embedding_params(model) + model.hidden
    grad = cost.embedding_params(model) * cost.precision_bytes(training)
    return (mem.fixed - cost.FRAMEWORK_OVERHEAD_BYTES
            - head * cost.state_bytes_per_param(training, 1) + grad)


def head_time_ratio(seq: int, hidden: int, vocab: int, chunk: int, device: str) -> float:
    """The cost model's chunked over whole head time on catalog ``device`` (bf16)."""
    from hettrain.planning import cost
    from hettrain.planning.catalog import CATALOG

    model, dev = head_model(seq, hidden, vocab), CATALOG[device]
    return cost.head_time_s(model, 1, 1, dev, 2, chunk) / cost.head_time_s(model, 1, 1, dev, 2)


def _child(args: argparse.Namespace) -> None:
    """One variant on the CPU in this fresh process: time and peak resident memory."""
    import torch

    torch.set_num_threads(2)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds, _ = run_head_loss("cpu", args.seq, args.hidden, args.vocab,
                               args.chunk if args.variant == "chunked" else 0, args.precision,
                               args.repeats)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "peak_over_base": peak - base}))


PLAN_CLUSTERS = (("H100-SXM", 1), ("H100-SXM", 2), ("A100-80GB", 1), ("MI300X", 1),
                 ("L40S", 2))


def _plans() -> None:
    """The ``--plans`` table (module docstring)."""
    from hettrain.api.spec import parse_job_spec
    from hettrain.planning import planner
    from variants import layout, plan_both, row, single_pool

    def show(p) -> str:
        return layout(p, p.training.recompute)

    print("llama3-8b, 1M tokens per step, bf16, ZeRO-1: tokens/s with the whole-sequence loss "
          "only -> as planned (whole or chunked)")
    for device, nodes in PLAN_CLUSTERS:
        inv = single_pool(device, nodes)
        for seq in (32768, 65536, 131072):
            for recompute in ("selective", "auto"):
                spec = parse_job_spec({"model": {"preset": "llama3-8b", "seqLen": seq},
                                       "training": {"globalBatch": max(1, 2**20 // seq),
                                                    "steps": 1, "recompute": recompute}})
                before, after = plan_both(spec, inv, planner.loss_as_given)
                print(row(f"{nodes}x8 {device:<10} {seq // 1024:>4}k {recompute:<9}", before,
                          after, lambda p: f"chunk {p.training.loss_chunk_tokens:>4}", show))


def main(argv: list[str] | None = None) -> int:
    """Run both variants side by side and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--plans", action="store_true",
                    help="plan long-sequence jobs with the whole loss only and as planned")
    ap.add_argument("--variant", choices=("whole", "chunked"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.plans:
        _plans()
        return 0
    if min(args.seq, args.hidden, args.vocab, args.chunk, args.repeats) < 1:
        ap.error("--seq, --hidden, --vocab, --chunk and --repeats must be >= 1")
    if args.variant:
        _child(args)
        return 0
    rows = {}
    for variant in ("whole", "chunked"):
        cmd = [sys.executable, __file__, "--variant", variant, "--seq", str(args.seq),
               "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--chunk",
               str(args.chunk), "--repeats", str(args.repeats), "--precision", args.precision]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"head + loss, 1 × {args.seq} tokens, hidden {args.hidden}, vocab {args.vocab}, "
          f"{args.precision}, chunk {args.chunk}, median of {args.repeats} (CPU)")
    print(f"{'variant':>8} {'seconds':>9} {'peak RSS over base MB':>22} {'model loss MB':>14}")
    for variant, chunk in (("whole", 0), ("chunked", args.chunk)):
        r = rows[variant]
        model_mb = predicted_loss_bytes(args.seq, args.hidden, args.vocab, args.precision,
                                        chunk) / 1e6
        print(f"{variant:>8} {r['seconds']:9.3f} {r['peak_over_base'] / 1e6:22.1f} "
              f"{model_mb:14.1f}")
    ratio = head_time_ratio(args.seq, args.hidden, args.vocab, args.chunk, "H100-SXM")
    measured = rows["chunked"]["seconds"] / rows["whole"]["seconds"]
    print(f"time chunked / whole: measured {measured:.2f}, cost model (H100 catalog) "
          f"{ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
