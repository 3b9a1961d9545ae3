"""Automatic all-reduce algorithm choice from message size and link speeds (pure, no torch).

A two-level group has ``B`` blocks (pools or datacenters) of at least ``n`` ranks, ``W`` ranks in
all. The link between blocks (``inter``) is shared by every stream that crosses it; the fabric
inside a block (``intra``) is per rank. Per call of ``M`` bytes (bandwidth in bytes/s, one-way
latency ``α``), with the ring ordering of ``dist.all_reduce`` (blocks contiguous in rank order).
A gloo step over a link costs a round trip plus its bytes, ``2α + bytes/β``: the receiver
announces its buffer before the sender's data flows (measured over the 1 Gbit/5 ms delay line
of ``bench/slowlink.py``: a 2-rank all-reduce of 8 bytes takes 10.8 ms, one of 512 KiB 27 ms,
an all-gather of 512 KiB 19 ms).

- flat ring over all ``W`` ranks: ``2(W−1)`` steps of ``M/W``; every step waits for the slowest
  edge, a crossing one: ``2(W−1)·(2α_x + M/W / β_x)``. Per direction the link carries
  ``2(W−1)/W·M``.
- inter op on a shard of ``S`` bytes among ``B`` owners: with ``B = 2`` over a link of at least
  :data:`EXCHANGE_MIN_LATENCY_MS` the two owners *exchange* shards (one all-gather, then the
  same fixed-order sum on both: one step of ``S``); else a ring, ``2(B−1)`` steps of ``S/B``.
  Both put ``S`` per direction on the link when ``B = 2``.
- hierarchical, pipelined over ``p`` pieces (:func:`best_pieces` picks ``p`` by this model):
  intra reduce-scatter and all-gather ``2(n−1)·(p·α_i + M/n / β_i)`` overlap with the inter ops
  of the pieces, :data:`INFLIGHT` of them at once, whose ``n`` owner streams together put
  ``2(B−1)/B·M`` on the link: inter ``= max(L + bytes/β_x, ⌈p/INFLIGHT⌉·L)`` with ``L`` the
  latency of one op (the link is either busy or waiting on round trips), total
  ``max(intra, inter) + min(intra, inter)/p``.
- leader: reduce to one rank and broadcast back (``2·⌈log2 n⌉`` intra hops of ``M``), one inter
  op on ``M`` among the leaders, nothing overlapped.

When every rank sits on one host, all "links" are the same memory bus: ``auto`` picks flat (one
gloo ring, the fewest copies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hettrain.runtime.collectives.topology import Hierarchy

PIPELINE_BYTES = 8 << 20  # largest piece of the pipelined hierarchical all-reduce
MIN_PIECES = 4  # without a link model a message is cut into at least this many pieces ...
MIN_PIECE_BYTES = 1 << 20  # ... unless they would get smaller than this
MAX_PIECES = 16  # the model picks 1, 2, 4, ... up to this many pieces
PIECES_TOLERANCE = 0.02  # ... the fewest within 2 % of the model's best
INFLIGHT = 2  # pieces on the inter group at once (the hierarchical pipeline's depth)
EXCHANGE_MIN_LATENCY_MS = 1.0  # 2 owners over a link this slow exchange shards (one step)


def piece_bytes(nbytes: int, pipeline_bytes: int | None = PIPELINE_BYTES) -> int:
    """Piece size for a message of ``nbytes``: ``nbytes/MIN_PIECES`` clamped to
    ``[MIN_PIECE_BYTES, pipeline_bytes]`` (``pipeline_bytes=None``: one piece)."""
    if pipeline_bytes is None:
        return max(1, nbytes)
    return max(1, min(pipeline_bytes, max(MIN_PIECE_BYTES, -(-nbytes // MIN_PIECES))))


@dataclass(frozen=True, slots=True)
class LinkModel:
    """Speeds used by ``auto``: Gbit/s per direction and one-way latency in milliseconds."""

    inter_gbps: float = 10.0
    inter_latency_ms: float = 0.5
    intra_gbps: float = 100.0
    intra_latency_ms: float = 0.02
    one_host: bool = False  # every rank on one machine: auto picks flat

    def __post_init__(self) -> None:
        for name in ("inter_gbps", "intra_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LinkModel.{name} must be > 0 Gbit/s, got {getattr(self, name)}")
        for name in ("inter_latency_ms", "intra_latency_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"LinkModel.{name} must be >= 0 ms, got {getattr(self, name)}")


def use_exchange(owners: int, link: LinkModel) -> bool:
    """Whether the inter op among ``owners`` exchanges shards (all-gather + fixed-order sum,
    one step) instead of a ring all-reduce (two steps of half): two owners over a link whose
    latency, not its per-op overhead, dominates (gloo's all-gather is 2-8x slower than its
    all-reduce on loopback, measured: never on one host)."""
    return (owners == 2 and not link.one_host
            and link.inter_latency_ms >= EXCHANGE_MIN_LATENCY_MS)


def _inter_op_seconds(nbytes: float, owners: int, link: LinkModel) -> tuple[float, float]:
    """(latency, bytes per direction) of one inter op on an ``nbytes`` shard among ``owners``."""
    ax = link.inter_latency_ms / 1e3
    if owners < 2:
        return 0.0, 0.0
    if use_exchange(owners, link):
        return 2 * ax, nbytes
    return 2 * (owners - 1) * 2 * ax, 2 * (owners - 1) / owners * nbytes


def _hierarchical_seconds(m: float, pieces: int, b: int, n: int, link: LinkModel) -> float:
    bx, bi = link.inter_gbps * 1e9 / 8, link.intra_gbps * 1e9 / 8
    ai = link.intra_latency_ms / 1e3
    intra = 2 * (n - 1) * (pieces * ai + m / n / bi)
    lat, per_dir = _inter_op_seconds(m, b, link)
    # INFLIGHT pieces' ops overlap: bandwidth-bound, one latency shows; else latency-bound
    inter = max(lat + per_dir / bx, math.ceil(pieces / INFLIGHT) * lat)
    return max(intra, inter) + min(intra, inter) / pieces


def best_pieces(nbytes: int, hier: Hierarchy, link: LinkModel,
                pipeline_bytes: int | None = PIPELINE_BYTES) -> int:
    """Number of pipelined pieces for the hierarchical all-reduce: the fewest whose model time
    is within :data:`PIECES_TOLERANCE` of the best (every piece costs per-op overheads the
    model leaves out). Candidates: powers of two up to :data:`MAX_PIECES`, pieces no smaller
    than :data:`MIN_PIECE_BYTES` nor larger than ``pipeline_bytes``. One piece with
    ``pipeline_bytes=None`` or on one host (intra and inter then share the same cores and
    memory: overlapping them gains nothing, and every piece costs per-op overheads: on 2 cores
    the forced hierarchical path ran 1.0-1.3x flat with one piece, 1.2-2.3x with 4-16)."""
    if pipeline_bytes is None or link.one_host:  # one host: both "links" are the same CPUs
        return 1
    m, b, n = float(nbytes), len(hier.blocks), hier.shards
    least = max(1, math.ceil(m / pipeline_bytes))
    cands = [least] + [1 << k for k in range(MAX_PIECES.bit_length())
                       if (1 << k) > least and m / (1 << k) >= MIN_PIECE_BYTES
                       and (1 << k) <= MAX_PIECES]
    times = {c: _hierarchical_seconds(m, c, b, n, link) for c in cands}
    best = min(times.values())
    return min(c for c, t in times.items() if t <= best * (1 + PIECES_TOLERANCE))


def estimate_seconds(algo: str, nbytes: int, hier: Hierarchy, link: LinkModel,
                     pipeline_bytes: int | None = PIPELINE_BYTES) -> float:
    """Model time of one all-reduce of ``nbytes`` with ``algo`` on ``hier`` (see module doc);
    hierarchical with :func:`best_pieces` pieces."""
    w, b, n = len(hier.ranks), len(hier.blocks), hier.shards
    bx, bi = link.inter_gbps * 1e9 / 8, link.intra_gbps * 1e9 / 8
    ax, ai = link.inter_latency_ms / 1e3, link.intra_latency_ms / 1e3
    m = float(nbytes)
    if algo == "flat":
        crossing = b > 1
        step = max(2 * ax + m / w / bx if crossing else 0.0, ai + m / w / bi)
        return 2 * (w - 1) * step
    if algo == "hierarchical":
        pieces = best_pieces(nbytes, hier, link, pipeline_bytes)
        return _hierarchical_seconds(m, pieces, b, n, link)
    if algo == "leader":
        hops = math.ceil(math.log2(n)) if n > 1 else 0
        lat, per_dir = _inter_op_seconds(m, b, link)
        return 2 * hops * (ai + m / bi) + lat + per_dir / bx
    raise ValueError(f"algo must be flat, hierarchical or leader, got {algo!r}")


def choose(nbytes: int, hier: Hierarchy, link: LinkModel | None = None,
           pipeline_bytes: int | None = PIPELINE_BYTES) -> str:
    """The algorithm ``auto`` uses: flat for one block, singleton blocks or one host; else the
    fastest of flat / hierarchical / leader by :func:`estimate_seconds`."""
    link = link or LinkModel()
    if len(hier.blocks) == 1 or all(len(b) == 1 for b in hier.blocks) or link.one_host:
        return "flat"
    algos = ("flat", "hierarchical", "leader")
    return min(algos, key=lambda a: estimate_seconds(a, nbytes, hier, link, pipeline_bytes))
