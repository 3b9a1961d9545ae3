"""ZeRO-2/3's per-unit machinery in one process (a stand-in DP group of ``d`` ranks): the
per-unit layout, the bytes each rank holds, and ZeRO-3's gather/free cycle -- every unit's
parameters are gathered exactly twice per microbatch (forward, backward; full recompute re-runs
the forward without a third gather), freed after its backward and after a no-grad forward."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tests.runtime.training.plans import TINY

from hettrain.api.spec import TrainingSpec
from hettrain.runtime.data import microbatches
from hettrain.runtime.model import lm_loss, whole_model
from hettrain.runtime.optim import Segment, ShardGroup, StageOptimizer, unit_key, unit_layout


def _training(**kw) -> TrainingSpec:
    return TrainingSpec(**{"global_batch": 4, "steps": 2, "precision": "bf16", **kw})


def _opt(sharding: str, d: int, index: int = 0, recompute: str = "none", precision="bf16"):
    model = whole_model(TINY, 5, recompute=recompute)
    opt = StageOptimizer(model, _training(sharding=sharding, recompute=recompute,
                                          precision=precision),
                         shard=ShardGroup(None, index, d, torch.device("cpu"), stand_in=True))
    return model, opt


def test_unit_keys_and_the_padded_per_unit_layout():
    assert unit_key("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    assert unit_key("model.embed_tokens.weight") == "model.embed_tokens"
    assert unit_key("lm_head.weight") == "lm_head"
    segs = [Segment("model.embed_tokens.weight", 0, 10, "embeddings", True, False),
            Segment("model.layers.0.a.weight", 10, 13, "weights", True, False),
            Segment("model.layers.0.b.weight", 13, 20, "weights", True, False),
            Segment("model.norm.weight", 20, 21, "norms", False, False)]
    out, units = unit_layout(segs, 4)
    # units padded to multiples of 4: 10 -> 12, 10 -> 12, 1 -> 4
    assert [(u.key, u.start, u.padded, u.chunk, u.local) for u in units] == [
        ("model.embed_tokens", 0, 12, 3, 0), ("model.layers.0", 12, 12, 3, 3),
        ("model.norm", 24, 4, 1, 6)]
    assert [(s.start, s.end) for s in out] == [(0, 10), (12, 15), (15, 22), (24, 25)]
    with pytest.raises(ValueError, match="not consecutive"):
        unit_layout([*segs, replace(segs[1], name="model.layers.0.c.weight", start=21, end=22)],
                    4)


@pytest.mark.parametrize("sharding,d", [("gradients", 4), ("full", 4), ("full", 3)])
def test_each_rank_holds_its_share_of_the_state(sharding, d):
    _, ref = _opt("optimizer", 1)
    n = ref.numel  # parameters of the whole (tiny) model
    _model, opt = _opt(sharding, d)
    padded = opt.padded
    assert n <= padded < n + d * len(opt.units)
    params, grads, optim = opt.state_bytes()
    assert grads == 4 * padded // d  # fp32 main grads of the own chunks only
    assert optim == 12 * padded // d  # fp32 master + 2 moments of the own chunks
    assert params == (2 * padded if sharding == "gradients" else 2 * padded // d)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_zero3_gathers_each_unit_twice_per_microbatch_and_frees_it(recompute):
    model, opt = _opt("full", 2, recompute=recompute)
    gathers: list[str] = []
    real = opt._gather

    def counting(u, wait=True):
        if not u.gathered:
            gathers.append(u.key)
        real(u, wait)

    opt._gather = counting
    assert all(u.full.untyped_storage().nbytes() == 0 for u in opt.units)  # freed at rest
    mbs = list(microbatches(3, 0, dp=1, dp_index=0, micro_batch=2, num_microbatches=3,
                            seq_len=TINY.seq_len, vocab=TINY.vocab))
    outs = [lm_loss(model(x), y) for x, y in mbs]  # three forwards in flight (as GPipe)
    assert all(u.full.untyped_storage().nbytes() == 0 for u in opt.units)
    for loss in reversed(outs):
        loss.backward()
    assert sorted(gathers) == sorted(u.key for u in opt.units for _ in range(2 * len(mbs)))
    assert all(u.full.untyped_storage().nbytes() == 0 and u.bucket is None
               for u in opt.units)
    assert all(p.grad is None for p in model.parameters())
    assert float(opt.main_grad.abs().sum()) > 0
    gathers.clear()
    with torch.no_grad():  # validation: gathered for the forward only
        model(mbs[0][0])
    assert sorted(gathers) == sorted(u.key for u in opt.units)
    assert all(u.full.untyped_storage().nbytes() == 0 for u in opt.units)


def test_zero3_refuses_tied_embeddings_naming_the_fields():
    model = whole_model(replace(TINY, tie_embeddings=True), 5)
    with pytest.raises(ValueError, match="tieEmbeddings: false"):
        StageOptimizer(model, _training(sharding="full"),
                       shard=ShardGroup(None, 0, 2, torch.device("cpu"), stand_in=True))
