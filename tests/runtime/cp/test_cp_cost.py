"""The planner's CP cost terms (planning/context.py) against what the runtime's CP attention
really computes and moves: the query-key pairs its SDPA calls evaluate and the bytes of the
keys/values it gathers, counted on a real stage model (``StandInContextParallel``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from tests.runtime.cp.plans import with_cp
from tests.runtime.training.plans import TINY, tiny_plan

from hettrain.planning import context, cost
from hettrain.runtime import context_parallel
from hettrain.runtime.context_parallel import StandInContextParallel, enable_
from hettrain.runtime.memory import build_stage

MODEL = replace(TINY, layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, seq_len=128,
                vocab=256, gated_mlp=True)


def _count(monkeypatch, cp: int, tp: int = 1, precision: str = "fp32"):
    """(query-key pairs of every SDPA call, gathered bytes of every K/V gather, the plan) of
    one forward of CP rank 0 through a two-layer stage (its weights in fp32: not converted to
    the plan precision without an optimizer, so the plan says fp32 too)."""
    plan = with_cp(tiny_plan([(0, 2, "a")], dp=1, tp=tp, model=MODEL, micro_batch=1,
                             num_microbatches=1, precision=precision), cp)
    model, _ = build_stage(plan, 0)
    enable_(model, StandInContextParallel(cp, 0, MODEL.seq_len))
    pairs, gathered = [], []
    sdpa = F.scaled_dot_product_attention

    def counting_sdpa(q, k, v, **kw):
        pairs.append(q.shape[-2] * k.shape[-2])
        return sdpa(q, k, v, **kw)

    real_gather = StandInContextParallel.gather

    def counting_gather(self, x):
        out = real_gather(self, x)
        gathered.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(context_parallel.F, "scaled_dot_product_attention", counting_sdpa)
    monkeypatch.setattr(StandInContextParallel, "gather", counting_gather)
    x = torch.randint(0, MODEL.vocab, (1, MODEL.seq_len // cp))
    model(x)
    return pairs, gathered, plan


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_share_is_the_pairs_the_runtime_computes(monkeypatch, cp):
    pairs, _, _ = _count(monkeypatch, cp)
    per_layer = sum(pairs) / MODEL.layers
    s = MODEL.seq_len
    assert per_layer == pytest.approx(context.attention_share(cp) * s * s / 2)


@pytest.mark.parametrize(("cp", "tp"), [(2, 1), (4, 1), (2, 2)])
def test_kv_bytes_are_the_gathered_tensors(monkeypatch, cp, tp):
    _, gathered, plan = _count(monkeypatch, cp, tp)
    eb = cost.precision_bytes(plan.training)
    # K and V per layer, each the whole sequence of this TP rank's kv heads
    assert gathered == [context.kv_bytes(MODEL, 1, tp, eb)] * (2 * MODEL.layers)


def test_cp_comm_is_two_gathers_and_two_all_reduces_of_kv_bytes():
    n = context.kv_bytes(MODEL, 1, 1, 2)
    bw, lat = 10.0, 1e-6
    want = (2 * cost.ring_reduce_scatter_s(n, 4, bw, lat) + 2 * cost.ring_all_reduce_s(n, 4, bw,
                                                                                       lat))
    assert context.cp_comm_per_layer_s(MODEL, 1, 1, 4, 2, "none", bw, lat) == pytest.approx(want)
    # full recompute re-runs the forward's two gathers in the backward
    full = context.cp_comm_per_layer_s(MODEL, 1, 1, 4, 2, "full", bw, lat)
    assert full == pytest.approx(want + 2 * cost.ring_reduce_scatter_s(n, 4, bw, lat))
    assert context.cp_comm_per_layer_s(MODEL, 1, 1, 1, 2, "none", bw, lat) == 0.0
