"""Single-process checks: group layout from a Plan, shard arithmetic, codecs, error feedback."""

from __future__ import annotations

import itertools

import pytest
import torch
from collective_harness import make_plan

from hettrain.runtime.collectives import Codec, ErrorFeedback, layout, peer_rank
from hettrain.runtime.collectives.bridge import chunk_slices
from hettrain.runtime.collectives.hierarchical import shard_bounds


def test_layout_from_plan_groups_dp_by_pool_and_dc():
    plan = make_plan([{"tp": 2, "pools": [("a", "east", "nvidia", 2), ("b", "west", "amd", 1)]},
                      {"tp": 1, "pools": [("c", "east", "intel", 3)]}], dp=3)
    lay = layout(plan)
    assert [name for name, _ in lay.pools] == ["a", "b", "c"]
    dp = dict(lay.dp)
    # stage 0, tp 0: replicas 0,1 in pool a (ranks 0, 2) and replica 2 in pool b (rank 4)
    assert dp[(0, 0)].blocks == ((0, 2), (4,))
    assert dp[(0, 0)].spans_dcs and dp[(0, 0)].shards == 1 and not dp[(0, 0)].uniform
    assert dp[(1, 0)].blocks == ((6, 7, 8),) and not dp[(1, 0)].spans_dcs
    assert dict(lay.dp_dc)[(0, 1, "east")].ranks == (1, 3)
    assert dict(lay.tp)[(0, 1)] == (2, 3)
    assert peer_rank(plan, 3, 1) == 7  # (stage 0, dp 1, tp 1) -> (stage 1, dp 1, tp 0)
    with pytest.raises(ValueError, match="to_stage"):
        peer_rank(plan, 0, 2)


def test_layout_rejects_duplicate_coordinates():
    plan = make_plan([{"tp": 1, "pools": [("a", "east", "nvidia", 2)]}], dp=2)
    bad = plan.__class__(**{**{f: getattr(plan, f) for f in plan.__slots__},
                            "ranks": (plan.ranks[0], plan.ranks[0].__class__(
                                **{**{f: getattr(plan.ranks[1], f)
                                      for f in plan.ranks[1].__slots__}, "dp": 0}))})
    with pytest.raises(ValueError, match="share one"):
        layout(bad)


@pytest.mark.parametrize("n,k", [(0, 1), (1, 3), (7, 3), (1001, 4), (12, 12)])
def test_shard_bounds_cover_exactly(n, k):
    b = shard_bounds(n, k)
    assert len(b) == k and b[0][0] == 0 and b[-1][1] == n
    assert all(x[1] == y[0] for x, y in itertools.pairwise(b))
    assert max(e - s for s, e in b) - min(e - s for s, e in b) <= 1


def test_chunk_slices_respect_the_byte_limit():
    sl = chunk_slices(1001, 4, 400)
    assert len(sl) == 11 and sl[-1] == slice(1000, 1001)
    assert sum(s.stop - s.start for s in sl) == 1001
    with pytest.raises(ValueError, match="chunk_bytes"):
        chunk_slices(10, 4, 2)


@pytest.mark.parametrize("kind", ["none", "bf16", "int8"])
def test_codec_round_trip_error_bounds(kind):
    x = torch.randn(10_001, generator=torch.Generator().manual_seed(1)) * 3
    codec = Codec(kind, chunk=512)
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes(x.numel())
    y = codec.decode(payload, x.numel())
    err = (y - x).abs()
    if kind == "none":
        assert torch.equal(x, y)
    elif kind == "bf16":
        assert torch.all(err <= x.abs() * 2**-8)  # 8 significant bits, round to nearest
    else:
        for c in range(0, x.numel(), 512):
            blk = x[c: c + 512]
            assert err[c: c + 512].max() <= blk.abs().max() / 127 / 2 + 1e-6


def test_codec_rejects_unknown_kind():
    with pytest.raises(ValueError, match="compression must be one of"):
        Codec("fp4")


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_error_feedback_tracks_the_true_cumulative_sum(kind):
    """Sum of decoded updates with feedback stays within one step's quantisation error of the
    true sum; without feedback a constant small bias accumulates linearly."""
    codec = Codec(kind, chunk=256)
    g = torch.Generator().manual_seed(0)
    big = torch.zeros(1024)
    big[::256] = 100.0  # one large value per chunk sets the int8 scale
    ef = ErrorFeedback()
    true = torch.zeros(1024, dtype=torch.float64)
    with_ef = torch.zeros(1024, dtype=torch.float64)
    plain = torch.zeros(1024, dtype=torch.float64)
    steps = 300
    for _ in range(steps):
        u = big + 0.05 + 0.01 * torch.randn(1024, generator=g)  # small steady drift under noise
        true += u.double()
        with_ef += codec.decode(ef.compress("w", u, codec), u.numel()).double()
        plain += codec.decode(codec.encode(u), u.numel()).double()
    ef_err = (with_ef - true).abs().max().item()
    plain_err = (plain - true).abs().max().item()
    # the cumulative error with feedback is minus the last residual: one quantisation error of
    # a value of magnitude <= 101 (bf16: half an ulp, 2**-8 relative; int8: scale / 2)
    bound = 101 * (2**-8 if kind == "bf16" else 1 / 254)
    assert ef_err <= bound
    assert plain_err > 20 * ef_err
