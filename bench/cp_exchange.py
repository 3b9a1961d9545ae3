"""The CP backward's K/V gradient exchange: reduce-scatter against all-reduce, side by side.

A context-parallel rank's attention gathers every rank's keys and values, so its backward holds
a gradient for the whole sequence's K (and V) and needs the sum over the CP group of its own
rows only. ``ContextParallel.reduce_rows`` gets them either with one reduce-scatter of the rows
laid out rank-major (``scatter_rows``: ``(n−1)/n`` of the buffer per rank, what the runtime does
on nccl/hccl) or with an all-reduce of the whole buffer, keeping its rows (``2·(n−1)/n``, what it
does on gloo). Both are timed here on real gloo processes over loopback, interleaved (A, B,
A, B, ...) so host noise hits both alike, at one layer's K and V gradient of llama3-8b shapes
(8 KV heads of 128 each, side by side as the runtime exchanges them, bf16) for a few sequence
lengths, and the two results compared (bf16 sums in another order: equal at cp 2, within bf16
rounding beyond). Printed: medians of the repeats and their ratio (reduce-scatter /
all-reduce; the byte ratio is 0.5). On this 2-core host gloo's reduce-scatter takes longer
than its all-reduce, which is why the
runtime all-reduces on gloo (``context.scatters_rows``).

Usage: python bench/cp_exchange.py [--cp 2] [--repeats 15] [--tokens 8192,32768,131072]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))

KV_HEADS, HEAD_DIM = 8, 128  # llama3-8b: the runtime exchanges K and V side by side


def _worker(rank: int, world: int, port: int, tokens: list[int], repeats: int, out: str
            ) -> None:
    import torch
    import torch.distributed as dist

    from hettrain.runtime.context_parallel import ContextParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    try:
        for seq in tokens:
            ways = {"all-reduce": ContextParallel(world, rank, seq, group=None),
                    "reduce-scatter": ContextParallel(world, rank, seq, group=None,
                                                      scatter_rows=True)}
            gen = torch.Generator().manual_seed(rank)
            grad = torch.randn(1, 2 * KV_HEADS, seq, HEAD_DIM, generator=gen).bfloat16()
            a = ways["all-reduce"].reduce_rows(grad).float()
            b = ways["reduce-scatter"].reduce_rows(grad).float()
            diff = ((a - b).abs().max() / a.abs().max()).item()  # bf16 sums, other order
            times: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(repeats):
                for name, cp in ways.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    cp.reduce_rows(grad)
                    times[name].append(time.perf_counter() - t0)
            rows.append((seq, grad.numel() * grad.element_size(), diff,
                         statistics.median(times["all-reduce"]),
                         statistics.median(times["reduce-scatter"])))
        if rank == 0:
            torch.save(rows, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Run the side-by-side timing and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp", type=int, default=2, help="CP ranks (local processes)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--tokens", default="8192,32768,131072",
                    help="sequence lengths (each a multiple of 2·cp)")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    bad = [t for t in tokens if t % (2 * args.cp)]
    if args.cp < 2 or bad:
        print(f"error: --cp must be >= 2 and every --tokens value a multiple of 2·cp "
              f"(got cp={args.cp}, tokens {bad})", file=sys.stderr)
        return 2
    import torch
    import torch.multiprocessing as mp

    from hettrain.runtime.launch import free_port
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.pt")
        mp.spawn(_worker, args=(args.cp, free_port(), tokens, args.repeats, out),
                 nprocs=args.cp)
        rows = torch.load(out)
    print(f"K/V gradient exchange of one layer, cp={args.cp}, gloo on loopback, "
          f"median of {args.repeats}")
    print(f"{'seq':>7} {'MB':>7} {'all-reduce ms':>14} {'reduce-scatter ms':>18} "
          f"{'ratio':>6}  max |diff| / max |rows|")
    for seq, nbytes, diff, ar, rs in rows:
        print(f"{seq:7d} {nbytes / 2**20:7.1f} {ar * 1e3:14.2f} {rs * 1e3:18.2f} "
              f"{rs / ar:6.2f}  {diff:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
