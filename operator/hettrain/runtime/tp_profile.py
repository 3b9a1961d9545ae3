"""``hettrain profile``'s tensor-parallel side: the runtime's block sharded over two local ranks.

:func:`measure_tp_layer` starts :data:`~hettrain.runtime.comm_profile.RANKS` local processes (one
per device: CUDA with NCCL, else CPU processes with gloo, one thread each as ``launch_local``
runs every rank), as ``runtime/comm_profile.py`` does for the transfers. Each builds the same
seeded stage of :func:`~hettrain.runtime.profile.chain_length` blocks
(:class:`~hettrain.runtime.model.StageModel`, no embedding or head), shards it the way the
runtime does (:func:`~hettrain.runtime.tensor_parallel.shard_stage_`: column/row-parallel
projections, replicated norms, the TP all-reduces in the forward and backward) and times
forward and backward of the same input on every rank in the job's precision, per microbatch
size, per block (medians; at least ``repeats`` runs and until the runs add up as
``profile.enough`` wants on every rank: the ranks agree on when to stop). Before timing, each
rank checks its sharded stage against the unsharded one on one input (``maxAbsDiff``: what is
timed computes the same layer; beyond ``CHECK_TOLERANCE`` the measurement fails). Rank 0's
rows are reported: the profile's ``tp`` section (``planning/profiles.py``), which the planner
takes for that TP degree's layer time (compute and TP all-reduces as measured) where it
matches.

Skipped (``None``) on a node with fewer devices than ranks, or where the model's heads, kv
heads or FFN width do not divide by the TP degree.

Usage (one rank; ``measure_tp_layer`` starts them): python -m hettrain.runtime.tp_profile
    --rank R --store FILE --model JSON --micro-batches 1,2 --repeats 5 --precision fp32 --out F
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hettrain.api.spec import ModelSpec
from hettrain.runtime.comm_profile import (
    RANKS,
    _devices_available,
    _release_device_memory,
    join_ranks,
    run_local_ranks,
)

CHECK_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 1e-2}  # sharded vs unsharded output


def shardable(model: ModelSpec, tp: int = RANKS) -> bool:
    """Whether the runtime can split ``model``'s block ``tp`` ways (``check_tp``'s rule)."""
    return all(n % tp == 0 for n in (model.heads, model.kv_heads, model.ffn_hidden))


def measure_tp_layer(model: ModelSpec, micro_batches: Sequence[int], repeats: int,
                     precision: str = "fp32") -> dict | None:
    """The profile's ``tp`` entry: ``{tp, backend, maxAbsDiff, layer: [(microBatch,
    forwardS, backwardS)]}`` of the block sharded over :data:`RANKS` local ranks (rank 0's
    medians per block); None where the node lacks the devices or the model does not shard."""
    if _devices_available() < RANKS or not shardable(model):
        return None
    _release_device_memory()
    doc = run_local_ranks("hettrain.runtime.tp_profile",
                          ["--model", json.dumps(dataclasses.asdict(model)),
                           "--micro-batches", ",".join(map(str, micro_batches)),
                           "--repeats", str(repeats), "--precision", precision],
                          "the tensor-parallel layer measurement")
    if not doc["maxAbsDiff"] <= CHECK_TOLERANCE[precision]:
        raise RuntimeError("the tensor-parallel layer measurement failed: the sharded block's "
                           f"output differs from the unsharded one by {doc['maxAbsDiff']:.3g}")
    return {"tp": RANKS, "backend": doc["backend"], "maxAbsDiff": doc["maxAbsDiff"],
            "layer": [tuple(r) for r in doc["layer"]]}


def run_rank(rank: int, store: str, model: ModelSpec, micro_batches: Sequence[int],
             repeats: int, precision: str) -> dict:
    """One rank: check the sharded stage against the unsharded one, then time it."""
    import torch
    import torch.distributed as dist

    from hettrain.runtime.model import StageModel
    from hettrain.runtime.optim import DTYPES
    from hettrain.runtime.profile import WARMUP, chain_length, enough
    from hettrain.runtime.tensor_parallel import shard_stage_

    device, backend, sync = join_ranks(rank, store)

    dtype = DTYPES[precision]
    k = chain_length(model, device)
    full = StageModel(model, 0, k, has_embedding=False, has_head=False, seed=0)
    stage = StageModel(model, 0, k, has_embedding=False, has_head=False, seed=0)
    shard_stage_(stage, model, RANKS, rank, dist.group.WORLD, list(range(RANKS)))
    full.to(device=device, dtype=dtype)
    stage.to(device=device, dtype=dtype)
    torch.manual_seed(1)  # the same input on every rank (TP replicates it)
    probe = torch.randn(1, model.seq_len, model.hidden, device=device, dtype=dtype)
    with torch.no_grad():
        diff = float((stage(probe) - full(probe)).abs().max())
    del full
    out: dict = {"backend": backend, "maxAbsDiff": diff, "layer": []}
    for b in micro_batches:
        torch.manual_seed(0)
        x = torch.randn(b, model.seq_len, model.hidden, device=device, dtype=dtype,
                        requires_grad=True)
        fwd, bwd, total = [], [], []
        i = 0
        while True:
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            y = stage(x)
            sync()
            t1 = time.perf_counter()
            y.sum().backward()
            sync()
            t2 = time.perf_counter()
            if i >= WARMUP:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
                total.append(t2 - t0)
            i += 1
            x.grad = None
            stage.zero_grad(set_to_none=True)
            done = torch.tensor([1 if enough(total, repeats) else 0], dtype=torch.int32,
                                device=device)
            dist.all_reduce(done, op=dist.ReduceOp.MIN)  # stop together: collectives pair up
            if done.item():
                break
        out["layer"].append((b, statistics.median(fwd) / k, statistics.median(bwd) / k))
    dist.barrier()  # rank 0 serves the store: nobody tears down while a peer still uses it
    dist.destroy_process_group()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """One rank of :func:`measure_tp_layer`."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--model", required=True, help="the ModelSpec's fields as JSON")
    ap.add_argument("--micro-batches", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    model = ModelSpec(**json.loads(args.model))
    doc = run_rank(args.rank, args.store, model, [int(b) for b in args.micro_batches.split(",")],
                   args.repeats, args.precision)
    Path(args.out).write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
