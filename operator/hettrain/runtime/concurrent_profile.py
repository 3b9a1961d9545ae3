"""``hettrain profile``'s concurrency side: the layer timed while every device of a CPU node runs.

A CPU node's "devices" are processes on one host: they share its cores' caches, its memory
bandwidth and (on a virtual machine) its hypervisor's time. :func:`measure_concurrent` starts
``ranks`` local processes (one thread each, as ``launch_local`` runs every rank), lines them up at
a barrier, and has each time the runtime's block exactly as the single-rank profile does
(:func:`hettrain.runtime.profile.measure_layer`: forward and backward, medians of ``repeats``
after warm-up) for every microbatch size. A rank that finishes first keeps running the block
untimed until every rank is done, so no size is timed with a peer idle. The rows are the mean
over the ranks of their medians; they go into the profile's ``concurrent`` section, which the
planner (``planning/profiles.py``) compares with the single-rank layer to price a plan that
keeps several ranks of one such node busy at once.

A GPU node's devices do not share their compute that way (and a profiling pod holds one), so
``runtime/profile.py`` measures this on the CPU only.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
from collections.abc import Sequence

from hettrain.api.spec import ModelSpec

TIMEOUT_S = 600


def _rank(model: ModelSpec, micro_batches: Sequence[int], repeats: int, barrier, done,
          ranks: int, out, precision: str) -> None:
    """One rank: time every size after the common start, then keep the load until all are done."""
    import torch

    from hettrain.runtime.model import LlamaDecoderLayer, rope_cos_sin
    from hettrain.runtime.optim import DTYPES
    from hettrain.runtime.profile import measure_layer

    cpu = torch.device("cpu")
    barrier.wait()
    rows = [(b, *measure_layer(model, b, repeats, cpu, precision)) for b in micro_batches]
    with done.get_lock():
        done.value += 1
    dtype = DTYPES[precision]
    block = LlamaDecoderLayer(model).to(dtype)  # the load a peer still measuring sees
    cos, sin = rope_cos_sin(model, model.seq_len, cpu)
    x = torch.randn(max(micro_batches), model.seq_len, model.hidden, dtype=dtype,
                    requires_grad=True)
    while done.value < ranks:
        block(x, cos, sin).sum().backward()
    out.put(rows)


def measure_concurrent(model: ModelSpec, micro_batches: Sequence[int], repeats: int,
                       ranks: int = 2, precision: str = "fp32"
                       ) -> list[tuple[int, float, float]]:
    """``(microBatch, forwardS, backwardS)`` of the block in ``precision`` with ``ranks``
    processes timing it at once (means over the ranks of their medians)."""
    ctx = multiprocessing.get_context("spawn")
    barrier, done, out = ctx.Barrier(ranks), ctx.Value("i", 0), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(model, list(micro_batches), repeats, barrier, done,
                                             ranks, out, precision), daemon=True)
             for _ in range(ranks)]
    for p in procs:
        p.start()
    results: list = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len(results) < ranks:
            try:
                results.append(out.get(timeout=0.5))
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError("the concurrent layer measurement failed: a rank "
                                       f"exited with code {failed[0]}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError("the concurrent layer measurement took over "
                                       f"{TIMEOUT_S} s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    rows = []
    for i, b in enumerate(micro_batches):
        fwd = sum(r[i][1] for r in results) / ranks
        bwd = sum(r[i][2] for r in results) / ranks
        rows.append((b, fwd, bwd))
    return rows
