"""The overlapped, bucketed DP gradient sync (runtime/grad_sync.py) in one process: bucket
layout by brute force, WHEN buckets launch (only during the last microbatch's backward, in
bucket order; under ZB-H1 a linear weight's bucket only after its last W pass), and that the
optimizer never reads a gradient whose all-reduce handle was not waited on.

The collective is a test double: a handle whose ``wait()`` applies the reduction (sum over two
identical replicas = doubling), so a gradient read before its wait is visibly wrong."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from tests.runtime.training.plans import TINY

from hettrain.api.spec import TrainingSpec
from hettrain.runtime.data import microbatches
from hettrain.runtime.grad_sync import bucket_ranges
from hettrain.runtime.model import (
    defer_weight_grads,
    lm_loss,
    set_weight_grad_deferral,
    whole_model,
)
from hettrain.runtime.optim import StageOptimizer

M = 3


def _training(**kw) -> TrainingSpec:
    base = dict(global_batch=2 * M, steps=2, precision="fp32", learning_rate=1e-2,
                lr_schedule="constant", grad_clip=0.0, weight_decay=0.0)
    return TrainingSpec(**{**base, **kw})


def _batches(step: int):
    return list(microbatches(3, step, dp=1, dp_index=0, micro_batch=2, num_microbatches=M,
                             seq_len=TINY.seq_len, vocab=TINY.vocab))


class _DeferredSum:
    """A fake all-reduce over two identical replicas: the sum lands only on ``wait()``."""

    def __init__(self, view: torch.Tensor, log: list) -> None:
        self.view, self.log = view, log

    def wait(self) -> None:
        self.view.mul_(2.0)
        self.log.append(("wait", self.view.data_ptr()))


@pytest.mark.parametrize("seed", range(20))
def test_bucket_ranges_tile_the_buffer_in_reverse_order(seed):
    rng = random.Random(seed)
    sizes = [rng.randint(1, 40) for _ in range(rng.randint(1, 12))]
    segs, at = [], 0
    for n in sizes:
        segs.append((at, at + n))
        at += n
    limit = rng.randint(1, 200)
    buckets = bucket_ranges(segs, 4, limit)
    # brute force: walk parameters from the last, close a bucket at >= limit bytes
    want, cur, size = [], [], 0
    for i in reversed(range(len(segs))):
        cur.append(i)
        size += sizes[i] * 4
        if size >= limit:
            want.append(cur)
            cur, size = [], 0
    if cur:
        want.append(cur)
    assert [m for _, _, m in buckets] == want
    # contiguous, descending, tiling [0, total)
    assert buckets[0][1] == at and buckets[-1][0] == 0
    for (a, _, _), (_, b, _) in itertools.pairwise(buckets):
        assert b == a
    for a, b, m in buckets:
        assert (a, b) == (segs[m[-1]][0], segs[m[0]][1])


def _run_step(opt: StageOptimizer, model, step: int, events: list, zb: bool = False) -> None:
    """One step of M microbatches; ``events`` gets ("phase", ...) markers around passes."""
    opt.zero_grad()
    opt.begin_step(M)
    stores = []
    for i, (x, y) in enumerate(_batches(step)):
        events.append(("B", i))
        loss = lm_loss(model(x), y) / M
        if zb:
            with defer_weight_grads() as store:
                loss.backward()
            stores.append(store)
        else:
            loss.backward()
    for i, store in enumerate(stores):
        events.append(("W", i))
        store.flush()
    events.append(("finish", None))
    opt.step(step)


def _overlapped(zb: bool = False, bucket_bytes: int = 4096, precision: str = "fp32"):
    model = whole_model(TINY, 5)
    set_weight_grad_deferral(model, zb)
    opt = StageOptimizer(model, _training(precision=precision), kind="sgd")
    events: list = []

    def launch(view):
        events.append(("launch", view.data_ptr(), view.numel()))
        return _DeferredSum(view, events)

    sync = opt.enable_overlap(launch, 2, bucket_bytes=bucket_bytes)
    return model, opt, sync, events


def _reference(precision: str = "fp32"):
    model = whole_model(TINY, 5)
    opt = StageOptimizer(model, _training(precision=precision), kind="sgd")
    return model, opt


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_buckets_launch_in_order_during_the_last_microbatch_backward(precision):
    model, opt, sync, events = _overlapped(precision=precision)
    ref, ref_opt = _reference(precision)
    assert len(sync.buckets) >= 4  # a small bucket size: several buckets
    for step in range(2):
        events.clear()
        _run_step(opt, model, step, events)
        ref_opt.zero_grad()
        for x, y in _batches(step):
            (lm_loss(ref(x), y) / M).backward()
        ref_opt.step(step)
        phase = None
        launches = []
        for ev in events:
            if ev[0] in ("B", "finish"):
                phase = ev
            elif ev[0] == "launch":
                launches.append((phase, ev[1]))
        # every bucket launched during the last microbatch's backward, none earlier or later
        assert [p for p, _ in launches] == [("B", M - 1)] * len(sync.buckets)
        assert sync.launched_early == len(sync.buckets)
        # in bucket order: the last parameters' gradients first (highest addresses first)
        ptrs = [ptr for _, ptr in launches]
        assert ptrs == sorted(ptrs, reverse=True)
        assert ptrs == [opt.main_grad[a:b].data_ptr() for a, b, _ in sync.buckets]
        # every handle waited before the optimizer read the gradients: x2 then /2 = the
        # single-process gradient, so the SGD step equals the reference bit for bit
        assert sum(1 for e in events if e[0] == "wait") == len(sync.buckets)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q)


def test_an_unwaited_handle_would_be_caught():
    # a finish() that averages without waiting reads unreduced gradients (the fake sum lands
    # only on wait): the step then differs from the reference, so the equality asserted above
    # really depends on every handle being waited before the optimizer
    model, opt, sync, _ = _overlapped()
    ref, ref_opt = _reference()

    def finish_without_wait():
        for k, _work in sync._work:
            a, b, _ = sync.buckets[k]
            opt.main_grad[a:b].div_(2)
        sync._work.clear()

    sync.finish = finish_without_wait
    _run_step(opt, model, 0, [])
    ref_opt.zero_grad()
    for x, y in _batches(0):
        (lm_loss(ref(x), y) / M).backward()
    ref_opt.step(0)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(),
                                                    strict=True))


def test_zb_h1_weight_buckets_launch_after_the_last_w_pass():
    model, opt, sync, events = _overlapped(zb=True)
    ref, ref_opt = _reference()
    _run_step(opt, model, 0, events, zb=True)
    ref_opt.zero_grad()
    for x, y in _batches(0):
        (lm_loss(ref(x), y) / M).backward()
    ref_opt.step(0)
    phase, launches = None, []
    for ev in events:
        if ev[0] in ("B", "W", "finish"):
            phase = ev
        elif ev[0] == "launch":
            launches.append(phase)
    assert len(launches) == len(sync.buckets)
    # no bucket before the last microbatch; any bucket holding a deferred linear weight only
    # in the last microbatch's W pass (its gradient is final there)
    assert all(p in (("B", M - 1), ("W", M - 1)) for p in launches), launches
    assert ("W", M - 1) in launches
    assert sync.launched_early == len(sync.buckets)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
