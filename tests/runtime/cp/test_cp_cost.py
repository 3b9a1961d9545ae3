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
        if isinstance(mask, CausalBias):  # the square block of chunk 0
            assert mask.variant == CausalVariant.LOWER_RIGHT
            assert (mask.seq_len_q, mask.seq_len_kv) == (lq, lk) and lq == lk
        else:  # on the CPU the lower-right mask materialised once, additive (0 or -inf)
            want = LowerRightCausal(lq, lk)._materialize()
            assert mask.dtype == q.dtype and torch.equal(mask == 0, want)
            assert torch.isneginf(mask[~want]).all()
        # (every pair of the block, the causal ones: query i sees keys <= lk - lq + i), in
        # units of all of the rank's query heads (one call per key/value head group)
        share = q.shape[1] / (MODEL.heads // tp)
        pairs.append((share * lq * lk, share * (lq * (lk - lq) + lq * (lq + 1) // 2)))
        return sdpa(q, k, v, **kw)

    real_gather = StandInContextParallel.start_gather

    def counting_gather(self, x):
        out = real_gather(self, x)
        gathered.append(out[0].numel() * out[0].element_size())
        return out

    # the CP module's own handle on SDPA (torch.nn.functional stays as it is: the causal bias
    # dispatches on the real function)
    monkeypatch.setattr(context_parallel, "F",
                        types.SimpleNamespace(scaled_dot_product_attention=counting_sdpa))
    monkeypatch.setattr(StandInContextParallel, "start_gather", counting_gather)
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
    # one gather per key/value head of this TP rank in each layer (its K and V side by side),
    # together the whole sequence of the rank's kv heads
    groups = MODEL.kv_heads // tp
    assert len(gathered) == groups * MODEL.layers
    assert gathered == [2 * context.kv_bytes(MODEL, 1, tp, eb) / groups] * len(gathered)


def test_cp_comm_is_a_gather_and_a_reduce_scatter_of_keys_and_values_per_head_group():
    groups = context.head_groups(MODEL, 1)
    assert groups == MODEL.kv_heads == 2
    n = 2 * context.kv_bytes(MODEL, 1, 1, 2) / groups  # one group's K and V
    bw, lat = 10.0, 1e-6
    one = cost.ring_reduce_scatter_s(n, 4, bw, lat)  # a group's gather, or its reduce-scatter
    nccl = {"scatter_rows": True}
    # nothing to overlap: every collective exposed, each with its own latency
    assert context.cp_comm_per_layer_s(MODEL, 1, 1, 4, 2, "none", bw, lat,
                                       **nccl) == pytest.approx(2 * groups * one)
    # full recompute re-runs the forward's gathers in the backward
    full = context.cp_comm_per_layer_s(MODEL, 1, 1, 4, 2, "full", bw, lat, **nccl)
    assert full == pytest.approx(3 * groups * one)
    assert context.cp_comm_per_layer_s(MODEL, 1, 1, 1, 2, "none", bw, lat, **nccl) == 0.0
    # gloo: the gradient all-reduced
    gloo = context.cp_comm_per_layer_s(MODEL, 1, 1, 4, 2, "none", bw, lat, scatter_rows=False)
    assert gloo == pytest.approx(groups * (one + cost.ring_all_reduce_s(n, 4, bw, lat)))


def test_cp_comm_under_the_attention_leaves_the_first_gather_and_the_last_reduction():
    n = 2 * context.kv_bytes(MODEL, 1, 1, 2) / 2
    bw, lat = 10.0, 1e-6
    one = cost.ring_reduce_scatter_s(n, 4, bw, lat)
    nccl = {"scatter_rows": True}

    def comm(recompute, window):
        return context.cp_comm_per_layer_s(MODEL, 1, 1, 4, 2, recompute, bw, lat,
                                           attention_s=window, **nccl)

    # each group's attention outlasts the next group's collective: one of each is exposed
    assert comm("none", 10 * one) == pytest.approx(2 * one)
    # a group's forward attention half a collective: the second gather waits the other half;
    # the backward (two passes) hides the first reduce-scatter whole
    assert comm("none", one) == pytest.approx(one + 0.5 * one + one)
    # full recompute's re-run gathers under its re-run attention; attention-free's re-run
    # computes no attention, so its gathers are exposed
    assert comm("full", 10 * one) == pytest.approx(3 * one)
    assert comm("attention-free", 10 * one) == pytest.approx(2 * one + 2 * one)
    # never more than with nothing to overlap, never less than one of each
    for recompute in ("none", "selective", "full", "attention-free"):
        assert 2 * one <= comm(recompute, one) <= comm(recompute, 0.0)


def test_exposed_collectives_against_a_brute_force_timeline():
    """exposed_s against an event simulation: collectives back to back on one stream, each
    group's compute waiting for its gather."""
    import random
    rng = random.Random(3)
    for _ in range(200):
        groups = rng.randint(1, 8)
        t, w = rng.uniform(0.1, 2.0), rng.uniform(0.0, 2.0)
        comm_end = compute_end = 0.0
        for _g in range(groups):
            comm_end += t  # the gathers run back to back from time 0
            compute_end = max(compute_end, comm_end) + w
        assert context.exposed_s(groups * t, groups * w, groups) == pytest.approx(
            compute_end - groups * w)


def test_the_window_is_a_share_of_the_ranks_attention_off_the_cpu():
    from hettrain.planning.catalog import CATALOG
    h100, cpu = CATALOG["H100-SXM"], CATALOG["CPU"]
    w = context.attention_window_s(MODEL, 1, 1, 4, h100)
    share = context.attention_share(4, skips_masked=True)
    flops = 4 * share * MODEL.seq_len ** 2 * MODEL.hidden
    assert w == pytest.approx(cost.dp_overlap_share(h100) * flops
                              / (h100.matmul_flops(2) * cost.attention_efficiency(h100)))
    assert 0 < cost.dp_overlap_share(h100) < 1  # the collectives slow the attention down
    assert context.attention_window_s(MODEL, 1, 1, 4, cpu) == 0.0  # gloo: nothing overlaps
    assert context.attention_window_s(MODEL, 1, 1, 1, h100) == 0.0


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
