"""Automatic all-reduce algorithm choice from message size and link speeds (pure, no torch).

A two-level group has ``B`` blocks (pools or datacenters) of at least ``n`` ranks, ``W`` ranks in
all. The link between blocks (``inter``) is shared by every stream that crosses it; the fabric
inside a block (``intra``) is per rank. Per call of ``M`` bytes (bandwidth in bytes/s, latency
``α``), with the ring ordering of ``dist.all_reduce`` (blocks contiguous in rank order):

- flat ring over all ``W`` ranks: ``2(W−1)`` steps of ``M/W``; every step waits for the slowest
  edge, a crossing one: ``2(W−1)·(α_x + M/W / β_x)``. Per direction the link carries
  ``2(W−1)/W·M``.
- hierarchical (pipelined over pieces of ``pipeline_bytes``): intra reduce-scatter and
  all-gather ``2(n−1)·(α_i + M/n / β_i)`` overlap with the inter ring among shard owners, whose
  ``n`` streams together put ``2(B−1)/B·M`` on the link: ``max(intra, inter) + fill``.
- leader: reduce to one rank and broadcast back (``2·⌈log2 n⌉`` intra hops of ``M``), one inter
  ring of ``M`` among the leaders, nothing overlapped.

When every rank sits on one host, all "links" are the same memory bus: ``auto`` picks flat (one
gloo ring, the fewest copies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hettrain.runtime.collectives.topology import Hierarchy

PIPELINE_BYTES = 8 << 20  # largest piece of the pipelined hierarchical all-reduce
MIN_PIECES = 4  # a message is cut into at least this many pieces ...
MIN_PIECE_BYTES = 1 << 20  # ... unless they would get smaller than this


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


def estimate_seconds(algo: str, nbytes: int, hier: Hierarchy, link: LinkModel,
                     pipeline_bytes: int | None = PIPELINE_BYTES) -> float:
    """Model time of one all-reduce of ``nbytes`` with ``algo`` on ``hier`` (see module doc)."""
    w, b, n = len(hier.ranks), len(hier.blocks), hier.shards
    bx, bi = link.inter_gbps * 1e9 / 8, link.intra_gbps * 1e9 / 8
    ax, ai = link.inter_latency_ms / 1e3, link.intra_latency_ms / 1e3
    m = float(nbytes)
    if algo == "flat":
        crossing = b > 1
        step = max(ax + m / w / bx if crossing else 0.0, ai + m / w / bi)
        return 2 * (w - 1) * step
    if algo == "hierarchical":
        pieces = max(1, math.ceil(m / piece_bytes(nbytes, pipeline_bytes)))
        intra = 2 * (n - 1) * (pieces * ai + m / n / bi)
        # two pieces fly on the inter group at once: their latencies overlap pairwise
        inter = 2 * (b - 1) * max(1.0, pieces / 2) * ax + 2 * (b - 1) / b * m / bx
        return max(intra, inter) + min(intra, inter) / pieces
    if algo == "leader":
        hops = math.ceil(math.log2(n)) if n > 1 else 0
        return 2 * hops * (ai + m / bi) + 2 * (b - 1) * (ax + m / b / bx)
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
