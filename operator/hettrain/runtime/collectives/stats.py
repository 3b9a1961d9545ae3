"""Per-tier accounting of collective traffic (bytes this rank sent, seconds spent)."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


class Tier(enum.Enum):
    """Which link a collective hop uses (the metric label is ``.value``)."""

    INTRA_POOL = "intra_pool"
    INTER_POOL = "inter_pool"
    CROSS_DC = "cross_dc"


def tier_of(ranks: Iterable) -> Tier:
    """The slowest link among ``ranks`` (plan ``RankPlan`` entries): across datacenters,
    across pools, else inside one pool."""
    ranks = list(ranks)
    if len({r.datacenter for r in ranks}) > 1:
        return Tier.CROSS_DC
    return Tier.INTER_POOL if len({r.pool for r in ranks}) > 1 else Tier.INTRA_POOL


@dataclass
class TierStats:
    """Accumulated bytes and seconds for one tier."""

    bytes: int = 0
    seconds: float = 0.0
    ops: int = 0


class CommStats(dict):
    """``{Tier: TierStats}``; every tier is present."""

    def __init__(self) -> None:
        super().__init__({t: TierStats() for t in Tier})

    def add(self, tier: Tier, nbytes: int, seconds: float) -> None:
        """Record one hop."""
        s = self[tier]
        s.bytes += int(nbytes)
        s.seconds += seconds
        s.ops += 1

    @contextmanager
    def timed(self, tier: Tier, nbytes: int) -> Iterator[None]:
        """Time a block and record it under ``tier``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(tier, nbytes, time.perf_counter() - t0)

    def reset(self) -> None:
        """Zero every tier."""
        for t in Tier:
            self[t] = TierStats()
