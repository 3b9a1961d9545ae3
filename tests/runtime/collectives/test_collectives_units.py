"""Single-process checks: group layout from a Plan, shard arithmetic, codecs, error feedback."""

from __future__ import annotations

import itertools

import pytest
import torch
from collective_harness import make_plan

from hettrain.runtime.collectives import (
    Codec,
    ErrorFeedback,
    LinkModel,
    choose_algorithm,
    estimate_seconds,
    layout,
    link_model,
    peer_rank,
)
from hettrain.runtime.collectives.bridge import chunk_slices
from hettrain.runtime.collectives.choice import (
    MAX_PIECES,
    MIN_PIECE_BYTES,
    PIECES_TOLERANCE,
    PIPELINE_BYTES,
    _hierarchical_seconds,
    best_pieces,
    piece_bytes,
    use_exchange,
)
from hettrain.runtime.collectives.communicator import _Intervals, bridge_chunk_bytes
from hettrain.runtime.collectives.hierarchical import pipeline_pieces, shard_bounds


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


# ------------------------------------------------------------------ automatic algorithm choice

def _two_pools(per_pool: int, dcs=("east", "west")):
    return make_plan([{"tp": 1, "pools": [("a", dcs[0], "nvidia", per_pool),
                                          ("b", dcs[1], "amd", per_pool)]}], dp=2 * per_pool)


def test_estimates_follow_the_ring_byte_counts():
    plan = _two_pools(2)
    hier = dict(layout(plan).dp)[(0, 0)]
    link = LinkModel(inter_gbps=1.0, inter_latency_ms=0.0, intra_gbps=1e6, intra_latency_ms=0.0)
    m = 64 << 20
    # flat ring over 4 ranks: 6 steps of M/4, each bound by the 125 MB/s crossing edge
    assert estimate_seconds("flat", m, hier, link) == pytest.approx(6 * (m / 4) / 125e6)
    # hierarchical: the 2 shard-owner pairs put M per direction on the link (intra ~free)
    assert estimate_seconds("hierarchical", m, hier, link) == pytest.approx(m / 125e6, rel=1e-3)
    assert estimate_seconds("leader", m, hier, link) == pytest.approx(m / 125e6, rel=1e-3)
    with pytest.raises(ValueError, match="algo must be"):
        estimate_seconds("tree", m, hier, link)


@pytest.mark.parametrize("per_pool", [2, 4])
@pytest.mark.parametrize("nbytes", [4 << 10, 1 << 20, 64 << 20])
@pytest.mark.parametrize("gbps,lat", [(1.0, 5.0), (1.0, 0.0), (100.0, 0.01)])
def test_choose_is_the_argmin_of_the_estimates(per_pool, nbytes, gbps, lat):
    hier = dict(layout(_two_pools(per_pool)).dp)[(0, 0)]
    link = LinkModel(inter_gbps=gbps, inter_latency_ms=lat)
    best = min(("flat", "hierarchical", "leader"),
               key=lambda a: estimate_seconds(a, nbytes, hier, link))
    assert choose_algorithm(nbytes, hier, link) == best


def test_auto_over_a_slow_link_avoids_flat_and_on_one_host_picks_flat():
    hier = dict(layout(_two_pools(4)).dp)[(0, 0)]
    slow = LinkModel(inter_gbps=1.0, inter_latency_ms=5.0)
    # 2 blocks: leader and hierarchical put the same M per direction on the link; the leader's
    # intra reduce + broadcast do not overlap the slow hop, the pipelined shards' do
    assert choose_algorithm(64 << 20, hier, slow) == "hierarchical"
    assert choose_algorithm(1 << 20, hier, slow) == "hierarchical"
    # 4 KiB: latency only; the leader's 2 log2(4) intra hops beat 2 (n-1) intra steps
    assert choose_algorithm(4 << 10, hier, slow) in ("leader", "hierarchical")
    assert choose_algorithm(64 << 20, hier, LinkModel(1.0, 0.0)) == "hierarchical"
    assert choose_algorithm(64 << 20, hier, LinkModel(one_host=True)) == "flat"
    single = dict(layout(make_plan([{"tp": 1, "pools": [("a", "e", "nvidia", 4)]}], dp=4)).dp)
    assert choose_algorithm(64 << 20, single[(0, 0)], slow) == "flat"


def test_best_pieces_is_the_fewest_within_tolerance_of_the_brute_force_best():
    hier = dict(layout(_two_pools(4)).dp)[(0, 0)]
    for link in (LinkModel(1.0, 5.0), LinkModel(1.0, 5.0, intra_gbps=2.5),
                 LinkModel(10.0, 0.05), LinkModel(100.0, 0.01, intra_gbps=50.0)):
        for nbytes in (4 << 10, 1 << 20, 3 << 20, 16 << 20, 64 << 20, 200 << 20):
            cands = [p for p in range(1, 2 * MAX_PIECES + 1)
                     if (p == 1 or nbytes / p >= MIN_PIECE_BYTES)
                     and nbytes / p <= PIPELINE_BYTES and p <= MAX_PIECES]
            cands = cands or [-(-nbytes // PIPELINE_BYTES)]
            cands = [p for p in cands if p & (p - 1) == 0 or p == min(cands)]
            t = {p: _hierarchical_seconds(nbytes, p, 2, 4, link) for p in cands}
            got = best_pieces(nbytes, hier, link)
            assert got in t and t[got] <= min(t.values()) * (1 + PIECES_TOLERANCE)
            assert all(t[p] > min(t.values()) * (1 + PIECES_TOLERANCE) for p in t if p < got)
            assert estimate_seconds("hierarchical", nbytes, hier, link) == pytest.approx(t[got])
    assert best_pieces(64 << 20, hier, LinkModel(1.0, 5.0), pipeline_bytes=None) == 1
    # slow intra fabric (2.5 Gbit/s): pipelining pays; fast intra: one piece is as good
    assert best_pieces(16 << 20, hier, LinkModel(1.0, 5.0, intra_gbps=2.5)) > 1
    assert best_pieces(4 << 20, hier, LinkModel(1.0, 5.0)) == 1
    assert best_pieces(64 << 20, hier, LinkModel(1.0, 5.0, intra_gbps=2.5, one_host=True)) == 1


def test_exchange_only_for_two_owners_over_a_slow_link_off_one_host():
    assert use_exchange(2, LinkModel(1.0, 5.0))
    assert not use_exchange(3, LinkModel(1.0, 5.0))
    assert not use_exchange(2, LinkModel(25.0, 0.05))
    assert not use_exchange(2, LinkModel(1.0, 5.0, one_host=True))
    # the exchange halves the latency of a two-owner op, the bytes stay the same
    hier = dict(layout(_two_pools(2)).dp)[(0, 0)]
    m = 1 << 20
    lead = estimate_seconds("leader", m, hier, LinkModel(1.0, 5.0, intra_gbps=1e6,
                                                         intra_latency_ms=0.0))
    assert lead == pytest.approx(2 * 5e-3 + m / 125e6)


def test_bridge_chunks_only_where_chunks_overlap_something():
    host = torch.zeros(16 << 20)  # 64 MiB fp32 on the host
    assert bridge_chunk_bytes(host, LinkModel(1.0, 5.0)) == 4 << 20  # round trips overlap
    assert bridge_chunk_bytes(host, LinkModel(25.0, 0.05)) == 64 << 20  # one op
    assert bridge_chunk_bytes(host, LinkModel(1.0, 5.0, one_host=True)) == 64 << 20
    assert bridge_chunk_bytes(torch.zeros(0), LinkModel(25.0, 0.05)) == 1


def test_link_model_from_the_plan():
    plan = _two_pools(2)
    hier = dict(layout(plan).dp)[(0, 0)]
    assert link_model(plan, hier).inter_latency_ms == 5.0  # cross-DC default
    local = _two_pools(2, dcs=("east", "east"))
    assert link_model(local, dict(layout(local).dp)[(0, 0)]).inter_gbps == 25.0
    fast = make_plan([{"tp": 1, "pools": [("a", "east", "nvidia", 2), ("b", "west", "amd", 2)]}],
                     dp=4, cross_dc={"mode": "sync", "link_gbps": 1.0, "link_latency_ms": 0})
    lm = link_model(fast, dict(layout(fast).dp)[(0, 0)])
    assert (lm.inter_gbps, lm.inter_latency_ms, lm.one_host) == (1.0, 0.0, False)
    one = fast.__class__(**{**{f: getattr(fast, f) for f in fast.__slots__},
                            "ranks": tuple(r.__class__(**{**{f: getattr(r, f) for f in r.__slots__},
                                                          "node": "localhost"})
                                           for r in fast.ranks)})
    assert link_model(one, dict(layout(one).dp)[(0, 0)]).one_host


def test_link_model_rejects_bad_speeds():
    with pytest.raises(ValueError, match="inter_gbps"):
        LinkModel(inter_gbps=0)
    with pytest.raises(ValueError, match="intra_latency_ms"):
        LinkModel(intra_latency_ms=-1)


@pytest.mark.parametrize("numel,n,pieces", [(1001, 2, 3), (1000, 4, 7), (7, 3, 1), (10, 4, 16),
                                            (4096, 4, 4)])
def test_pipeline_pieces_exact_count(numel, n, pieces):
    got = pipeline_pieces(numel, 4, n, None, pieces)
    assert got[0][0] == 0 and got[-1][1] == numel and len(got) <= pieces
    assert all(x[1] == y[0] for x, y in itertools.pairwise(got))
    assert all((b - a) % n == 0 for a, b in got[:-1])
    if numel >= pieces * n:  # enough elements: as many pieces as asked, or one fewer (rounding)
        assert len(got) >= pieces - 1
    with pytest.raises(ValueError, match="pieces"):
        pipeline_pieces(numel, 4, n, None, 0)


@pytest.mark.parametrize("numel,n,piece", [(1001, 2, 400), (1000, 4, 64), (7, 3, None),
                                           (10, 4, 4000), (4096, 4, 1024)])
def test_pipeline_pieces_cover_in_multiples_of_n(numel, n, piece):
    pieces = pipeline_pieces(numel, 4, n, piece)
    assert pieces[0][0] == 0 and pieces[-1][1] == numel
    assert all(x[1] == y[0] for x, y in itertools.pairwise(pieces))
    assert all((b - a) % n == 0 for a, b in pieces[:-1])
    if piece is not None and numel * 4 > piece:
        assert all((b - a) * 4 <= max(piece, 4 * n) for a, b in pieces)


def test_busy_intervals_are_a_union():
    iv = _Intervals()
    iv.spans += [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7)]
    assert iv.busy() == pytest.approx(4.0)


@pytest.mark.parametrize("nbytes,expected", [(64 << 20, 8 << 20), (16 << 20, 4 << 20),
                                             (4 << 20, 1 << 20), (1 << 20, 1 << 20),
                                             (100 << 10, 1 << 20)])
def test_piece_bytes_at_least_four_pieces_of_at_least_1mib(nbytes, expected):
    assert piece_bytes(nbytes) == expected
    assert piece_bytes(nbytes, None) == nbytes
    assert piece_bytes(nbytes, 1000) == 1000
