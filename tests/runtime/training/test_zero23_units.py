"""ZeRO-2/3's per-unit machinery in one process (a stand-in DP group of ``d`` ranks): the
per-unit layout, the bytes each rank holds, and ZeRO-3's gather/free cycle -- every unit's
parameters are gathered exactly twice per microbatch (forward, backward; full recompute re-runs
the forward without a third gather), freed after its backward and after a no-grad forward."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tests.runtime.training.plans import TINY

from hettrain.api.spec import RECOMPUTE_MODES, TrainingSpec
from hettrain.runtime.data import microbatches
from hettrain.runtime.grad_sync import Completed
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


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("recompute", RECOMPUTE_MODES)
def test_zero3_gathers_each_unit_twice_per_microbatch_and_frees_it(recompute, overlap):
    model, opt = _opt("full", 2, recompute=recompute)
    if overlap:  # prefetching the next unit's gather must not add a gather
        opt.enable_overlap(lambda view: Completed(), 2)
        assert opt.prefetch
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
    # overlapped: every gather but each pass's first was launched ahead (forward and backward)
    assert opt.prefetched == (2 * len(mbs) * (len(opt.units) - 1) if overlap else 0)
    if overlap:
        assert opt.grad_sync.in_flight == 1  # the embedding's last reduction, until the step
        opt.grad_sync.finish()
    assert all(u.full.untyped_storage().nbytes() == 0 and u.bucket is None
               for u in opt.units)
    assert opt._transient == 0
    assert all(p.grad is None for p in model.parameters())
    assert float(opt.main_grad.abs().sum()) > 0
    gathers.clear()
    with torch.no_grad():  # validation: gathered for the forward only
        model(mbs[0][0])
    assert sorted(gathers) == sorted(u.key for u in opt.units)
    assert all(u.full.untyped_storage().nbytes() == 0 for u in opt.units)


def test_zero3_prefetches_the_unit_that_runs_next():
    # the forward runs the embedding, the layers, the norm, the head (the parameters' order
    # has the layers first); each gather is launched while the unit before it (forward) or
    # after it (backward) is about to compute, and completed when its own hook needs it
    model, opt = _opt("full", 2)
    opt.enable_overlap(lambda view: Completed(), 2)
    events: list[tuple[str, str]] = []
    real = opt._gather

    def logging(u, wait=True):
        if not u.gathered:
            events.append(("gather" if wait else "prefetch", u.key))
        real(u, wait)

    opt._gather = logging
    order = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(TINY.layers)),
             "model.norm", "lm_head"]
    x, y = next(iter(microbatches(3, 0, dp=1, dp_index=0, micro_batch=2, num_microbatches=1,
                                  seq_len=TINY.seq_len, vocab=TINY.vocab)))
    loss = lm_loss(model(x), y)
    assert events == [("gather", order[0]), *(("prefetch", k) for k in order[1:])]
    events.clear()
    loss.backward()
    back = order[::-1]
    assert events == [("gather", back[0]), *(("prefetch", k) for k in back[1:])]


class _DeferredSum:
    """A fake all-reduce over two identical replicas: the sum lands only on ``wait()``."""

    def __init__(self, view: torch.Tensor, log: list) -> None:
        self.view, self.log = view, log
        log.append("launch")

    def wait(self) -> None:
        self.view.mul_(2.0)
        self.log.append("wait")


def _zero2_main_grads(overlap: bool):
    """ZeRO-2 rank 0 of 2 identical replicas, three microbatches: its main grads, the
    launch/wait log and the sync (the synchronous path averages identical replicas: a no-op)."""
    model = whole_model(TINY, 5)
    opt = StageOptimizer(model, _training(sharding="gradients", precision="fp32"),
                         shard=ShardGroup(None, 0, 2, torch.device("cpu")),
                         reduce_grads=lambda flat: None)
    log: list[str] = []
    sync = None
    if overlap:
        sync = opt.enable_overlap(lambda view: _DeferredSum(view, log), 2)
    opt.begin_step(3)
    for x, y in microbatches(3, 0, dp=1, dp_index=0, micro_batch=2, num_microbatches=3,
                             seq_len=TINY.seq_len, vocab=TINY.vocab):
        (lm_loss(model(x), y) / 3).backward()
        if sync is not None:
            assert sync.in_flight == 1  # bounded: one reduction in flight at a time
    return opt, log, sync


def test_zero2_overlapped_reductions_equal_the_synchronous_ones_only_once_waited():
    sync_opt, _, _ = _zero2_main_grads(overlap=False)
    opt, log, sync = _zero2_main_grads(overlap=True)
    n = len(opt.units)
    # each unit's reduction launched as its bucket filled, every microbatch: the (n - 1)
    # earlier ones waited during the backward (the bound), one after it
    assert log.count("launch") == 3 * n and log.count("wait") == 3 * n - 1
    # unit k's reduction is in flight while unit k-1's backward fills its bucket
    assert log[:4] == ["launch", "wait", "launch", "wait"]
    assert sync.max_in_flight == 1 and len(sync.buckets) == 3 * n
    assert not torch.equal(opt.main_grad, sync_opt.main_grad)  # the last unit: not yet in
    sync.finish()
    assert log.count("wait") == 3 * n and sync.in_flight == 0
    assert torch.equal(opt.main_grad, sync_opt.main_grad)  # bit for bit
    assert opt._transient == 0  # every bucket freed


def test_zero3_refuses_tied_embeddings_naming_the_fields():
    model = whole_model(replace(TINY, tie_embeddings=True), 5)
    with pytest.raises(ValueError, match="tieEmbeddings: false"):
        StageOptimizer(model, _training(sharding="full"),
                       shard=ShardGroup(None, 0, 2, torch.device("cpu"), stand_in=True))
