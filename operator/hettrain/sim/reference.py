"""Minimal single-job failure/checkpoint simulator: Poisson failures, fixed restart cost.

Time is accounted per cause so that the causes always sum to wall time.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SimResult:
    """Per-cause time accounting of one simulated run (seconds)."""

    wall_s: float
    productive_s: float
    lost_s: dict[str, float] = field(default_factory=dict)

    @property
    def ettr(self) -> float:
        """Effective training time ratio: productive time / wall time."""
        return self.productive_s / self.wall_s


def simulate_restart(
    wall_s: float, rate_per_s: float, restart_s: float, interval_s: float, ckpt_s: float,
    seed: int = 0,
) -> SimResult:
    """Simulate restart-from-checkpoint under Poisson failures at `rate_per_s`.

    Work runs in segments of `interval_s` followed by a blocking checkpoint of `ckpt_s`;
    a failure loses work since the last completed checkpoint and costs `restart_s`.
    """
    for name, v in (("wall_s", wall_s), ("interval_s", interval_s)):
        if v <= 0:
            raise ValueError(f"{name} must be > 0, got {v}")
    rng = random.Random(seed)
    t, saved = 0.0, 0.0
    lost = {"restart": 0.0, "lost_work": 0.0, "checkpoint": 0.0}
    next_fail = rng.expovariate(rate_per_s) if rate_per_s > 0 else float("inf")
    while t < wall_s:
        seg_end = min(t + interval_s + ckpt_s, wall_s)
        if next_fail >= seg_end:
            work = min(interval_s, seg_end - t)
            saved += work
            lost["checkpoint"] += seg_end - t - work
            t = seg_end
            continue
        lost["lost_work"] += next_fail - t
        end = min(next_fail + restart_s, wall_s)
        lost["restart"] += end - next_fail
        t = end
        next_fail = t + rng.expovariate(rate_per_s)
    return SimResult(wall_s=t, productive_s=saved, lost_s=lost)


def renewal_ettr(rate_per_s: float, restart_s: float, interval_s: float, ckpt_s: float) -> float:
    """Exact long-run ETTR of :func:`simulate_restart` (renewal-reward argument).

    A segment of ``L = τ + C`` (work then checkpoint) must run without a failure; each failure
    wastes the time since the segment began and costs ``R``. With Poisson failures at rate λ,
    the expected wall time to finish one segment is ``(e^{λL} − 1)(1/λ + R)`` (standard result
    for restart-on-failure), and the segment yields ``τ`` of kept work, so
    ``ETTR = τ / ((e^{λL} − 1)(1/λ + R))``; λ → 0 gives ``τ / (τ + C)``.
    """
    seg = interval_s + ckpt_s
    if rate_per_s <= 0:
        return interval_s / seg
    return interval_s / (math.expm1(rate_per_s * seg) * (1.0 / rate_per_s + restart_s))
