"""The planner's CP cost terms (planning/context.py) against what the runtime's CP attention
really computes and moves: the query-key pairs its SDPA calls evaluate and the bytes of the
keys/values it gathers, counted on a real stage model (``StandInContextParallel``)."""

from __future__ import annotations

import copy
import types
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from tests.runtime.cp.plans import with_cp
from tests.runtime.training.plans import TINY, tiny_plan
from torch.nn.attention.bias import CausalBias, CausalVariant

from hettrain.planning import context, cost
from hettrain.runtime import context_parallel
from hettrain.runtime.context_parallel import LowerRightCausal, StandInContextParallel, enable_
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
        lq, lk = q.shape[-2], k.shape[-2]
        mask = kw["attn_mask"]
        assert isinstance(mask, CausalBias) and mask.variant == CausalVariant.LOWER_RIGHT
        assert (mask.seq_len_q, mask.seq_len_kv) == (lq, lk)
        # (every pair of the block, the causal ones: query i sees keys <= lk - lq + i)
        pairs.append((lq * lk, lq * (lk - lq) + lq * (lq + 1) // 2))
        return sdpa(q, k, v, **kw)

    real_gather = StandInContextParallel.gather

    def counting_gather(self, x):
        out = real_gather(self, x)
        gathered.append(out.numel() * out.element_size())
        return out

    # the CP module's own handle on SDPA (torch.nn.functional stays as it is: the causal bias
    # dispatches on the real function)
    monkeypatch.setattr(context_parallel, "F",
                        types.SimpleNamespace(scaled_dot_product_attention=counting_sdpa))
    monkeypatch.setattr(StandInContextParallel, "gather", counting_gather)
    x = torch.randint(0, MODEL.vocab, (1, MODEL.seq_len // cp))
    model(x)
    return pairs, gathered, plan


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_share_is_the_pairs_the_runtime_computes(monkeypatch, cp):
    pairs, _, _ = _count(monkeypatch, cp)
    s = MODEL.seq_len
    every = sum(p[0] for p in pairs) / MODEL.layers
    causal = sum(p[1] for p in pairs) / MODEL.layers
    # a kernel that skips masked tiles computes the causal pairs: 1/cp of the whole sequence's
    # (diagonal included); one that materialises the mask computes every pair of its prefixes
    assert causal == context.attention_share(cp, skips_masked=True) * s * (s + 1) / 2
    assert every == pytest.approx(context.attention_share(cp, skips_masked=False) * s * s / 2)


def test_masked_tiles_are_skipped_on_nvidia_only():
    from hettrain.planning.catalog import CATALOG
    skips = {d.vendor: cost.skips_masked_tiles(d) for d in CATALOG.values()}
    assert skips["nvidia"]
    assert not any(v for k, v in skips.items() if k != "nvidia")


@pytest.mark.parametrize(("cp", "tp"), [(2, 1), (4, 1), (2, 2)])
def test_kv_bytes_are_the_gathered_tensors(monkeypatch, cp, tp):
    _, gathered, plan = _count(monkeypatch, cp, tp)
    eb = cost.precision_bytes(plan.training)
    # one gather per layer: K and V side by side, each the whole sequence of this TP rank's
    # kv heads
    assert gathered == [2 * context.kv_bytes(MODEL, 1, tp, eb)] * MODEL.layers


def test_cp_comm_is_one_gather_and_one_reduce_scatter_of_keys_and_values():
    n = 2 * context.kv_bytes(MODEL, 1, 1, 2)
    bw, lat = 10.0, 1e-6
    want = 2 * cost.ring_reduce_scatter_s(n, 4, bw, lat)
    nccl = {"scatter_rows": True}
    assert context.cp_comm_per_layer_s(MODEL, 1, 1, 4, 2, "none", bw, lat,
                                       **nccl) == pytest.approx(want)
    # full recompute re-runs the forward's gather in the backward
    full = context.cp_comm_per_layer_s(MODEL, 1, 1, 4, 2, "full", bw, lat, **nccl)
    assert full == pytest.approx(want + cost.ring_reduce_scatter_s(n, 4, bw, lat))
    assert context.cp_comm_per_layer_s(MODEL, 1, 1, 1, 2, "none", bw, lat, **nccl) == 0.0
    # gloo: the gradient all-reduced
    gloo = context.cp_comm_per_layer_s(MODEL, 1, 1, 4, 2, "none", bw, lat, scatter_rows=False)
    assert gloo == pytest.approx(cost.ring_reduce_scatter_s(n, 4, bw, lat)
                                 + cost.ring_all_reduce_s(n, 4, bw, lat))


def test_only_the_cpu_all_reduces_the_kv_gradient():
    from hettrain.planning.catalog import CATALOG
    assert {n for n, d in CATALOG.items() if not context.scatters_rows(d)} == {"CPU"}


def test_lower_right_bias_holds_no_storage_and_masks_each_query_to_its_prefix():
    # torch's own causal_lower_right would allocate a (2, 32768, 131072) float tensor here
    cp = context_parallel.ContextParallel(2, 0, 131072, group=None)
    for j, bias in cp._causal.items():
        assert torch.Tensor.untyped_storage(bias).nbytes() == 0
        assert (bias.seq_len_q, bias.seq_len_kv) == (cp.chunk, (j + 1) * cp.chunk)
    bias = LowerRightCausal(4, 12)  # query i sees keys <= 8 + i
    twin = copy.deepcopy(bias)
    assert (type(twin), twin.seq_len_q, twin.seq_len_kv) == (LowerRightCausal, 4, 12)
    assert repr(bias) == "LowerRightCausal(4, 12)"
    want = torch.ones(4, 12, dtype=torch.bool).tril(diagonal=8)
    assert torch.equal(bias._materialize(), want)
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=want)
    assert torch.equal(got, ref)
    (g,) = torch.autograd.grad(got.sum(), q)
    (r,) = torch.autograd.grad(ref.sum(), q)
    assert torch.equal(g, r)
