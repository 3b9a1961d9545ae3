"""The chunked MLP (``plan.training.mlp_chunk_tokens``) against the whole MLP, with a layer
re-run in the backward (full or attention-free recompute).

Default: on this machine's CPU, a stack of Llama-shaped layers (SwiGLU, ffn 3.5x hidden,
grouped-query attention) over one long sequence, forward and backward as a stage runs them
with full recompute, both variants alternated in one process: the median seconds of
``--repeats`` and the peak of the bytes the step allocates (``runtime.live_bytes.LiveBytes``:
the layers' saved inputs, the re-run layer, its MLP's backward, the weights' ``.grad``; this
process has no optimizer to fold them into), beside the cost model's count of the same
(``--layers`` layer inputs, ``cost.recompute_working_set_bytes`` without the RoPE tables, the
weight gradients) and its GEMM FLOPs ratio (the re-run skips the chunked MLP; the backward
recomputes its gate and up projections: ``cost.modelled_layer_s``'s GEMM term).

``--plans`` plans llama3-8b (1M tokens per step, bf16, ZeRO-1) at 16k-128k tokens with full and
attention-free recompute on single-pool clusters twice, side by side: with the whole MLP only
(``planner.mlp_as_given``: the planner before the chunked MLP) and as ``plan_job`` plans it
(the faster of whole and chunked), and prints tokens/s, the chunk, the largest stage's
planned GiB and the layouts.

Usage: python bench/chunked_mlp.py [--seq 8192] [--hidden 256] [--layers 4] [--chunk 1024]
                                   [--repeats 5] [--precision fp32|bf16]
       python bench/chunked_mlp.py --plans
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PLAN_CLUSTERS = (("H100-SXM", 1), ("H100-SXM", 2), ("A100-80GB", 2), ("MI300X", 1),
                 ("L40S", 2))


def layer_model(seq: int, hidden: int, layers: int):
    """A Llama-shaped model of these sizes: 8 heads, 2 key/value heads, ffn 3.5x hidden."""
    from hettrain.api.spec import ModelSpec

    return ModelSpec(layers=layers, hidden=hidden, heads=8, kv_heads=2, seq_len=seq,
                     vocab=256, ffn_hidden=7 * hidden // 2, gated_mlp=True)


def run_layers(seq: int, hidden: int, layers: int, chunk: int, precision: str,
               repeats: int) -> list[tuple[str, float, int]]:
    """Both variants' forward + backward of ``layers`` layers over one ``seq``-token sequence
    with full recompute, alternated ``repeats`` times: ``(variant, median seconds, peak
    bytes)`` for ``whole`` and ``chunked``."""
    import torch

    from hettrain.runtime.live_bytes import LiveBytes
    from hettrain.runtime.model import StageModel

    torch.set_num_threads(2)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    spec = layer_model(seq, hidden, layers)
    nets = {name: StageModel(spec, 0, layers, has_embedding=False, has_head=False, seed=1,
                             recompute="full", mlp_chunk_tokens=c).to(dtype)
            for name, c in (("whole", 0), ("chunked", chunk))}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((1, seq, hidden), generator=gen).to(dtype)
    grad = torch.randn((1, seq, hidden), generator=gen).to(dtype)
    times: dict[str, list[float]] = {name: [] for name in nets}
    peaks: dict[str, int] = {}
    for _ in range(repeats):
        for name, net in nets.items():
            net.zero_grad(set_to_none=True)
            inp = x.clone().requires_grad_()
            live = LiveBytes()
            t0 = time.perf_counter()
            with live:
                net(inp).backward(grad)
            times[name].append(time.perf_counter() - t0)
            peaks[name] = live.peak
    return [(name, statistics.median(times[name]), peaks[name]) for name in nets]


def predicted_bytes(seq: int, hidden: int, layers: int, chunk: int, precision: str) -> float:
    """The cost model's count of what :func:`run_layers` allocates: each layer's output (the
    next one's saved input, or the stage output: full recompute), the re-run layer with its
    MLP's backward (``cost.recompute_working_set_bytes`` without the RoPE tables, which this
    process keeps outside the step) and every weight's gradient in the plan precision."""
    from hettrain.planning import cost

    model = layer_model(seq, hidden, layers)
    eb = 4 if precision == "fp32" else 2
    working = (cost.recompute_working_set_bytes(model, 1, 1, "full", eb, chunk)
               - cost.recompute_rope_table_bytes(model, "full"))
    kept = layers * cost.activation_bytes_per_layer(model, 1, 1, "full", eb)
    grads = layers * (cost.layer_matmul_params(model) + 2 * hidden) * eb
    return kept + working + grads


def gemm_ratio(seq: int, hidden: int, chunk: int) -> float:
    """Chunked / whole GEMM FLOPs of a layer with full recompute (``cost.modelled_layer_s``'s
    GEMM term)."""
    from hettrain.planning import cost

    model = layer_model(seq, hidden, 1)
    p = cost.layer_matmul_params(model)
    passes = cost.compute_passes("full")
    mlp = cost.mlp_input_params(model) + model.hidden * model.ffn_hidden
    return (passes * p + (3 - passes) * mlp + cost.mlp_input_params(model)) / (passes * p)


def _plans() -> None:
    """The ``--plans`` table (module docstring)."""
    from hettrain.api.spec import parse_job_spec
    from hettrain.planning import planner
    from variants import layout, plan_both, row, single_pool

    def show(p) -> str:
        return layout(p, f"mb={p.micro_batch}", p.schedule)

    print("llama3-8b, 1M tokens per step, bf16, ZeRO-1: tokens/s with the whole MLP only -> "
          "as planned (whole or chunked); the largest stage's planned GiB")
    for device, nodes in PLAN_CLUSTERS:
        inv = single_pool(device, nodes)
        for seq in (16384, 32768, 65536, 131072):
            for recompute in ("full", "attention-free"):
                spec = parse_job_spec({"model": {"preset": "llama3-8b", "seqLen": seq},
                                       "training": {"globalBatch": max(1, 2**20 // seq),
                                                    "steps": 1, "recompute": recompute}})
                before, after = plan_both(spec, inv, planner.mlp_as_given)

                def detail(p, before=before) -> str:
                    gib = max(s.memory_gib for s in p.stages)
                    was = (f" (was {max(s.memory_gib for s in before.stages):5.1f})"
                           if before is not None else "")
                    return f"chunk {p.training.mlp_chunk_tokens:>4}  {gib:5.1f} GiB{was}"
                print(row(f"{nodes}x8 {device:<10} {seq // 1024:>4}k {recompute:<14}",
                          before, after, detail, show))


def main(argv: list[str] | None = None) -> int:
    """Run both variants side by side and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--plans", action="store_true",
                    help="plan long-sequence jobs with the whole MLP only and as planned")
    args = ap.parse_args(argv)
    if args.plans:
        _plans()
        return 0
    if min(args.seq, args.hidden, args.layers, args.chunk, args.repeats) < 1:
        ap.error("--seq, --hidden, --layers, --chunk and --repeats must be >= 1")
    if args.hidden % 8:
        ap.error("--hidden must be a multiple of 8 (8 attention heads)")
    rows = run_layers(args.seq, args.hidden, args.layers, args.chunk, args.precision,
                      args.repeats)
    print(f"{args.layers} layers, full recompute, 1 x {args.seq} tokens, hidden {args.hidden}, "
          f"ffn {7 * args.hidden // 2}, {args.precision}, chunk {args.chunk}, median of "
          f"{args.repeats}, alternated (CPU)")
    print(f"{'variant':>8} {'seconds':>9} {'peak MB':>9} {'model MB':>9}")
    for name, seconds, peak in rows:
        chunk = args.chunk if name == "chunked" else 0
        model = predicted_bytes(args.seq, args.hidden, args.layers, chunk, args.precision)
        print(f"{name:>8} {seconds:9.3f} {peak / 1e6:9.1f} {model / 1e6:9.1f}")
    (_, t_whole, p_whole), (_, t_chunk, p_chunk) = rows
    print(f"chunked / whole: time {t_chunk / t_whole:.2f} (GEMM FLOPs, cost model: "
          f"{gemm_ratio(args.seq, args.hidden, args.chunk):.2f}), peak bytes "
          f"{p_chunk / p_whole:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
