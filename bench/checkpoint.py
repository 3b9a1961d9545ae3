"""Checkpoint save stall and throughput, sync vs async, and restore onto another layout (CPU).

    .venv/bin/python bench/checkpoint.py [--hidden 256] [--layers 8] [--repeats 5] [--uri DIR|s3://..]

The state is a Llama-style model (``hettrain.runtime.model``) with its AdamW state (fp32:
params + 2 moments), saved by one rank through :class:`hettrain.runtime.checkpoint.Checkpointer`.

- **stall**: seconds the training thread is blocked by ``save()``. Sync: the whole write.
  Async: only the device->host snapshot (into host buffers kept between saves); a background
  thread writes while the "training" thread keeps running (here: a matmul loop standing in
  for the next steps).
- **throughput**: bytes written / seconds the writer took (snapshot excluded).
- **restore**: the checkpoint of the whole model (pp=1, tp=1) loaded into pipeline stage 0 of
  a pp=2 layout with TP=2 (TP rank 0's shards: half the heads/FFN of the first half of the
  layers), versus loading the same layout it was saved in; every loaded tensor is checked
  against the saved model's slice.
- **restore onto another layout**: the model saved by a pp=2/dp=1 job (two stage ranks, each
  writing its own file, rank 0 publishing) and restored by every rank of a new layout, one
  after the other: pp=2/dp=1 (as saved), pp=1/dp=2 (each replica reads both stages' files) and
  pp=2/dp=1/tp=2 (four TP shards). Seconds for all ranks of the layout, bytes/s of the state
  they filled, and the ratio to the as-saved layout.

Prints one JSON object; every number is the median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator")]

import torch  # noqa: E402

from hettrain.api.spec import ModelSpec  # noqa: E402
from hettrain.runtime import checkpoint as ckpt  # noqa: E402
from hettrain.runtime.model import StageModel  # noqa: E402
from hettrain.runtime.tensor_parallel import shard_stage_  # noqa: E402

AS_SAVED = "pp2 dp1 (as saved)"
LAYOUTS = {AS_SAVED: (2, 1, 1), "pp1 dp2": (1, 2, 1), "pp2 dp1 tp2": (2, 1, 2)}


def build(spec: ModelSpec, start: int, end: int, tp: int = 1, head: bool = True):
    """A stage model (seeded: equal weights in every layout) with materialised AdamW state."""
    model = StageModel(spec, start, end, has_embedding=start == 0, has_head=head, seed=7)
    shards = shard_stage_(model, spec, tp, 0, None, tuple(range(tp)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(p),
                        "exp_avg_sq": torch.rand_like(p)}
    return model, opt, shards


def _busy(stop: threading.Event, steps: list[int]) -> None:
    a = torch.randn(256, 256)
    while not stop.is_set():
        a = torch.tanh(a @ a)
        steps[0] += 1


def save_once(saver: ckpt.Checkpointer, step: int, state) -> dict[str, float]:
    """One save (and the overlapped "training" until the write is done)."""
    t0 = time.perf_counter()
    rec = saver.save(step, state, {"model": {}})
    stall = time.perf_counter() - t0
    stop, steps = threading.Event(), [0]
    worker = threading.Thread(target=_busy, args=(stop, steps))
    worker.start()  # the training thread's next steps, overlapped with the write
    saver.wait()
    stop.set()
    worker.join()
    total = time.perf_counter() - t0
    return {"stall_s": stall, "write_s": rec.write_s, "total_s": total, "bytes": rec.bytes,
            "overlapped_steps": steps[0]}


def restore_once(uri: str, step: int, spec: ModelSpec, ref_state: dict[str, torch.Tensor],
                 layers: int, tp: int, start: int = 0, tp_rank: int = 0) -> tuple[float, int]:
    """Seconds to load ``step`` into stage [start, layers) as TP rank ``tp_rank`` of ``tp``
    (checked against the saved model), and the bytes of state filled."""
    model = StageModel(spec, start, layers, has_embedding=start == 0,
                       has_head=layers == spec.layers, seed=7)
    shards = shard_stage_(model, spec, tp, tp_rank, None, tuple(range(tp)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p)}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    targets = ckpt.job_state(model, opt, tp=shards, for_save=False)
    t0 = time.perf_counter()
    ckpt.load(ckpt.CheckpointStore.open(uri), step, targets, model=None)
    seconds = time.perf_counter() - t0
    for name, p in model.state_dict().items():
        want = ref_state[name]
        if shards.param_of(name):
            want = shards.local(name, want)
        if not torch.equal(p, want):
            raise AssertionError(f"restored {name} differs from the saved model")
    return seconds, ckpt.bytes_of(targets)


def stage_bounds(layers: int, pp: int) -> list[tuple[int, int]]:
    """An even split of ``layers`` into ``pp`` stages."""
    cuts = [layers * s // pp for s in range(pp + 1)]
    return list(itertools.pairwise(cuts))


def save_stages(uri: str, step: int, spec: ModelSpec, pp: int) -> dict[str, float]:
    """Save the model as a pp=``pp``/dp=1 job does: one rank per stage writes its own file
    (sync; the last rank first, so rank 0 publishes at once). Seconds and bytes written."""
    store = ckpt.CheckpointStore.open(uri)
    states = []
    for a, b in stage_bounds(spec.layers, pp):
        model, opt, _ = build(spec, a, b, head=b == spec.layers)
        states.append(ckpt.job_state(model, opt))
    t0 = time.perf_counter()
    written = 0
    for rank in reversed(range(pp)):
        saver = ckpt.Checkpointer(store, rank, pp, keep=1, async_save=False)
        written += saver.save(step, states[rank], {"model": {}}).bytes
    return {"seconds": time.perf_counter() - t0, "bytes": written}


def restore_layout(uri: str, step: int, spec: ModelSpec, ref: dict[str, torch.Tensor],
                   pp: int, dp: int, tp: int) -> tuple[float, int]:
    """Every rank of a pp/dp/tp layout restores ``step``, one after the other (checked):
    total seconds and bytes filled."""
    seconds, filled = 0.0, 0
    for a, b in stage_bounds(spec.layers, pp):
        for _ in range(dp):
            for t in range(tp):
                s, n = restore_once(uri, step, spec, ref, b, tp, start=a, tp_rank=t)
                seconds, filled = seconds + s, filled + n
    return seconds, filled


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; prints and returns the JSON summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--uri", default="", help="storage (default: a fresh temp directory)")
    args = ap.parse_args(argv)
    spec = ModelSpec(layers=args.layers, hidden=args.hidden, heads=8, seq_len=128, vocab=4096,
                     ffn_hidden=4 * args.hidden, kv_heads=4, name="bench")
    tmp = None if args.uri else tempfile.mkdtemp(prefix="hettrain-ckpt-bench-")
    uri = args.uri or tmp
    try:
        model, opt, _ = build(spec, 0, spec.layers)
        state = ckpt.job_state(model, opt)
        ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
        runs: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
        # one saver per mode, as in a training run (the async one reuses its host buffers)
        savers = {m: ckpt.Checkpointer(ckpt.CheckpointStore.open(uri), 0, 1, keep=2,
                                       async_save=m == "async") for m in runs}
        step = 0
        for _ in range(args.repeats):
            for mode in ("sync", "async"):
                step += 1
                runs[mode].append(save_once(savers[mode], step, state))
        med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for m, rs in runs.items()}
        same = [restore_once(uri, step, spec, ref, spec.layers, 1)[0]
                for _ in range(args.repeats)]
        other = [restore_once(uri, step, spec, ref, spec.layers // 2, 2)[0]
                 for _ in range(args.repeats)]
        pp2_uri = uri.rstrip("/") + "/saved-pp2"
        pp2_save = [save_stages(pp2_uri, step + 1 + i, spec, 2) for i in range(args.repeats)]
        last = step + args.repeats
        layouts = {}
        for label, (pp, dp, tp) in LAYOUTS.items():
            runs_l = [restore_layout(pp2_uri, last, spec, ref, pp, dp, tp)
                      for _ in range(args.repeats)]
            sec = statistics.median(r[0] for r in runs_l)
            layouts[label] = {"seconds": sec, "bytes": runs_l[0][1],
                              "throughput_Bps": runs_l[0][1] / sec}
        as_saved = layouts[AS_SAVED]["seconds"]
        for row in layouts.values():
            row["ratio_to_as_saved"] = row["seconds"] / as_saved
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    nbytes = med["sync"]["bytes"]
    out = {
        "state_bytes": int(nbytes), "repeats": args.repeats,
        "sync": {"stall_s": med["sync"]["stall_s"],
                 "throughput_Bps": nbytes / med["sync"]["write_s"]},
        "async": {"stall_s": med["async"]["stall_s"],
                  "throughput_Bps": nbytes / med["async"]["write_s"],
                  "overlapped_train_steps": med["async"]["overlapped_steps"]},
        "stall_ratio_async_over_sync": med["async"]["stall_s"] / med["sync"]["stall_s"],
        "restore_same_layout_s": statistics.median(same),
        "restore_pp2_tp2_stage0_s": statistics.median(other),
        "restore_ratio_other_over_same": statistics.median(other) / statistics.median(same),
        "save_pp2_dp1": {"seconds": statistics.median(r["seconds"] for r in pp2_save),
                         "bytes": int(pp2_save[0]["bytes"]),
                         "throughput_Bps": pp2_save[0]["bytes"] / statistics.median(
                             r["seconds"] for r in pp2_save)},
        "restore_from_pp2_dp1": layouts,
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
