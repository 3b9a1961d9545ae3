"""ZeRO-1 optimizer checkpoints without a full-size gather: each DP rank presents (and writes)
views of its own optimizer slice, placed as boxes in the unsharded global tensors, and any
tp/dp layout loads its own slice back. Checked against brute-force slicing of a full reference
state, in one process (the optimizers of several "ranks" side by side; saving and loading the
optimizer state needs no communication)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.distributed as dist
from tests.runtime.training.plans import TINY

from hettrain.api.spec import TrainingSpec
from hettrain.runtime import checkpoint as ckpt
from hettrain.runtime.checkpoint_format import local_range_pieces, range_boxes
from hettrain.runtime.model import whole_model
from hettrain.runtime.optim import ShardGroup, StageOptimizer
from hettrain.runtime.tensor_parallel import shard_stage_

META = {"model": ckpt.model_meta(TINY)}


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (1, 6), (4, 1)])
def test_range_boxes_are_the_flat_range_in_order(shape):
    t = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    for a, b in itertools.combinations(range(t.numel() + 1), 2):
        boxes = range_boxes(shape, a, b)
        got = torch.cat([t[tuple(slice(o, o + e) for o, e in zip(off, ext, strict=True))]
                         .reshape(-1) for off, ext in boxes])
        assert torch.equal(got, t.reshape(-1)[a:b]), (a, b, boxes)
        assert len(boxes) <= 2 * len(shape) - 1


@pytest.mark.parametrize(("dim", "index"), [(0, [0, 1, 4, 5]), (1, [2, 3, 4, 7, 8]),
                                            (None, None)])
def test_local_range_pieces_place_a_tp_shard_slice_in_the_global_tensor(dim, index):
    """A flat slice of a TP shard (rows or columns, two index runs like fused K/V halves):
    every piece is a view of the slice and equals the global tensor at its box; a partition of
    the shard into slices covers the shard's image exactly once."""
    torch.manual_seed(0)
    full = torch.randn(6, 10)
    local = full if dim is None else full.index_select(dim, torch.tensor(index))
    flat = local.reshape(-1).clone()
    seen = torch.zeros_like(full, dtype=torch.int64)
    cuts = [0, 3, 4, 17, 18, flat.numel()]
    for a, b in itertools.pairwise(cuts):
        for p in local_range_pieces(flat[a:b], local.shape, a, dim=dim, index=index):
            assert p.tensor.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            box = tuple(slice(o, o + e) for o, e in zip(p.offsets, p.tensor.shape, strict=True))
            assert torch.equal(full[box], p.tensor)
            seen[box] += 1
    image = torch.zeros_like(seen) if dim is None else torch.zeros_like(seen).index_fill_(
        dim, torch.tensor(index), 1)
    assert torch.equal(seen, torch.ones_like(seen) if dim is None else image)


def _training(precision: str) -> TrainingSpec:
    return TrainingSpec(global_batch=8, steps=4, precision=precision, optimizer_sharding=True)


def _rank_optimizers(tp: int, dp: int, precision: str):
    """One (optimizer, TPShards) per (tp index, dp index) of a stage holding the whole model."""
    out = {}
    for t in range(tp):
        for d in range(dp):
            model = whole_model(TINY, seed=3)
            shards = shard_stage_(model, TINY, tp, t, None, list(range(tp)))
            shard = ShardGroup(None, d, dp, torch.device("cpu")) if dp > 1 else None
            opt = StageOptimizer(model, _training(precision), shard=shard,
                                 tp_sharded=set(shards.shards), tp=tp, tp_index=t)
            out[t, d] = (opt, shards)
    return out


def _reference(precision: str) -> dict[str, torch.Tensor]:
    """A full optimizer state per global name, random (what every layout must reproduce)."""
    g = torch.Generator().manual_seed(7)
    model = whole_model(TINY, seed=3)
    kinds = ["exp_avg", "exp_avg_sq"] + (["master"] if precision != "fp32" else [])
    return {f"optim.{n}.{k}": torch.randn(p.shape, generator=g)
            for n, p in model.named_parameters() for k in kinds}


def _local_flat(opt: StageOptimizer, shards, ref: dict, kind: str) -> torch.Tensor:
    """Brute force: this rank's slice of ``kind``, sliced from the full reference state."""
    flat = torch.zeros(opt.padded)
    for s in opt.segments:
        full = ref[f"optim.{s.name}.{kind}"]
        local = shards.local(s.name, full) if s.name in shards.shards else full
        flat[s.start:s.end] = local.reshape(-1)
    return flat[opt.lo:opt.hi]


def _fill(opt, shards, ref, step):
    opt.exp_avg.copy_(_local_flat(opt, shards, ref, "exp_avg"))
    opt.exp_avg_sq.copy_(_local_flat(opt, shards, ref, "exp_avg_sq"))
    if opt.dtype != torch.float32:
        opt.master.copy_(_local_flat(opt, shards, ref, "master"))
    opt.step_count = step


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero1_state_saved_by_tp2_dp2_loads_into_other_layouts(tmp_path, precision,
                                                               monkeypatch):
    ref = _reference(precision)
    store = ckpt.CheckpointStore.open(str(tmp_path))
    writers = _rank_optimizers(tp=2, dp=2, precision=precision)
    gathers = []
    monkeypatch.setattr(dist, "all_gather", lambda *a, **k: gathers.append(a))
    per_rank = []
    for (t, d), (opt, shards) in writers.items():
        _fill(opt, shards, ref, step=5)
        state = opt.checkpoint_state(shards, dp_index=d)
        per_rank.append(state)
        # views of this rank's own 1/dp slice: nothing full-size is built to save it
        bufs = [opt.exp_avg, opt.exp_avg_sq] + ([opt.master] if precision != "fp32" else [])
        ptrs = {b.untyped_storage().data_ptr() for b in bufs}
        optim = [p for st in state if not st.name.endswith(".step") for p in st.pieces]
        assert {p.tensor.untyped_storage().data_ptr() for p in optim} <= ptrs
        owned = min(opt.hi, opt.numel) - opt.lo
        mine = sum(p.tensor.numel() for p in optim)
        if t == 0:  # TP index 0 also writes the TP-replicated parameters' state
            assert mine == len(bufs) * owned
        else:
            assert 0 < mine < len(bufs) * owned
    assert not gathers
    world = len(per_rank)
    savers = [ckpt.Checkpointer(store, r, world, async_save=False) for r in range(world)]
    for r in reversed(range(world)):  # rank 0 last: it merges and publishes
        savers[r].save(1, per_rank[r], META)
    # every element of the global state is stored exactly once (merge checks coverage),
    # and the per-rank files together hold the whole state once: ~1/4 each
    manifest = json.loads((tmp_path / "step-1" / "manifest.json").read_text())
    stored = {k: v for k, v in manifest["tensors"].items() if not k.endswith(".step")}
    assert set(stored) == set(ref)
    total = sum(t.numel() * 4 for t in ref.values())
    written = [s.history[-1].bytes for s in savers]
    assert sum(written) < total * 1.05 and max(written) < total / 2
    for tp, dp in [(1, 1), (1, 3), (2, 1), (2, 3)]:
        for (t, d), (opt, shards) in _rank_optimizers(tp, dp, precision).items():
            targets = opt.checkpoint_state(shards, for_save=False)
            loaded = ckpt.load(store, 1, targets)
            assert loaded == {st.name for st in targets}
            opt.load_finish()
            assert opt.step_count == 5
            m = max(0, min(opt.hi, opt.numel) - opt.lo)  # this slice's real (unpadded) part
            for kind, buf in [("exp_avg", opt.exp_avg), ("exp_avg_sq", opt.exp_avg_sq)] + (
                    [("master", opt.master)] if precision != "fp32" else []):
                assert torch.equal(buf[:m], _local_flat(opt, shards, ref, kind)[:m]), \
                    (tp, dp, t, d, kind)
