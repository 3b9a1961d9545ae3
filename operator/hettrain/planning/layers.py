"""Non-uniform layer split across heterogeneous pipeline stages.

Stage ``i`` with ``n`` layers has compute time ``t_i(n) = a_i·n + b_i``, data-parallel
all-reduce time ``d_i(n) = c_i·n + e_i`` and memory ``mem_i(n) = f_i + g_i·n ≤ cap_i``. The step
time to minimise is ``T(n) = (m−1)·max(max_i t_i, P) + Σ_i t_i + max_i d_i`` with ``Σ n_i = L``,
``n_i ≥ lo`` (``P`` is the slowest boundary transfer, a constant here).

:func:`split_layers` is exact: the optimum has some bottleneck values ``(C, D) = (max t, max d)``;
for a candidate pair the layer caps are ``n_i ≤ min(mem, t⁻¹(C), d⁻¹(D))`` and, with caps fixed,
``Σ a_i n_i`` is minimised greedily (fill the cheapest stages first). Enumerating candidate pairs in
ascending order with a lower bound ``(m−1)·max(C, P) + Σ_min + D`` prunes almost all of them.
:func:`split_layers_brute_force` enumerates every composition; tests check both agree.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StageCost:
    """Affine costs of one stage as functions of its layer count."""

    a: float  # seconds per layer (per microbatch, fwd+bwd)
    b: float  # fixed seconds (embedding / head)
    c: float  # DP all-reduce seconds per layer
    e: float  # fixed DP seconds
    max_layers: int  # memory cap (layers that fit)

    def time(self, n: int) -> float:
        """Compute time with ``n`` layers."""
        return self.a * n + self.b

    def dp(self, n: int) -> float:
        """Gradient all-reduce time with ``n`` layers."""
        return self.c * n + self.e


def step_time(stages: Sequence[StageCost], split: Sequence[int], m: float,
              boundary: float) -> float:
    """The objective ``T`` for one split."""
    times = [s.time(n) for s, n in zip(stages, split, strict=True)]
    dps = [s.dp(n) for s, n in zip(stages, split, strict=True)]
    return (m - 1) * max(max(times), boundary) + sum(times) + max(dps)


def _greedy(stages: Sequence[StageCost], caps: Sequence[int], total: int,
            lo: int, order: Sequence[int]) -> list[int] | None:
    if sum(caps) < total or min(caps) < lo:
        return None
    split = [lo] * len(stages)
    left = total - lo * len(stages)
    for i in order:
        take = min(left, caps[i] - lo)
        split[i] += take
        left -= take
        if not left:
            break
    return split


def _cap(slope: float, fixed: float, limit: float, hard: int) -> int:
    if slope <= 0:
        return hard if fixed <= limit + 1e-15 else 0
    return min(hard, int((limit - fixed) / slope + 1e-9))


def lower_bound(stages: Sequence[StageCost], total: int, m: float, boundary: float = 0.0,
                lo: int = 1) -> float:
    """A valid lower bound on the optimal ``T`` (inf when memory cannot hold the layers).

    The bottleneck ``X`` satisfies ``Σ (X − b_i)/a_i ≥ total``; ``Σ t`` is at least its
    minimum under the memory caps; ``max d`` is at least every stage's ``d(lo)``.
    """
    k = len(stages)
    hard = [min(s.max_layers, total - lo * (k - 1)) for s in stages]
    if any(h < lo for h in hard) or sum(hard) < total:
        return math.inf
    order = sorted(range(k), key=lambda i: (stages[i].a, i))
    base = _greedy(stages, hard, total, lo, order)
    assert base is not None
    sigma_min = sum(s.time(n) for s, n in zip(stages, base, strict=True))
    if all(s.a > 0 for s in stages):
        x_lb = (total + sum(s.b / s.a for s in stages)) / sum(1 / s.a for s in stages)
    else:
        x_lb = 0.0
    x_lb = max(x_lb, max(s.time(lo) for s in stages))
    return (m - 1) * max(x_lb, boundary) + sigma_min + max(s.dp(lo) for s in stages)


def split_layers(stages: Sequence[StageCost], total: int, m: float, boundary: float = 0.0,
                 lo: int = 1, bound: float = math.inf) -> tuple[float, list[int]] | None:
    """Optimal split of ``total`` layers; None when memory cannot hold them, or when no split
    beats ``bound`` (an incumbent from elsewhere in a search)."""
    k = len(stages)
    hard = [min(s.max_layers, total - lo * (k - 1)) for s in stages]
    if any(h < lo for h in hard) or sum(hard) < total:
        return None
    order = sorted(range(k), key=lambda i: (stages[i].a, i))
    base = _greedy(stages, hard, total, lo, order)
    assert base is not None
    sigma_min = sum(s.time(n) for s, n in zip(stages, base, strict=True))
    d_min = max(s.dp(lo) for s in stages)
    # identical stages (same unit, same position class) contribute the same candidate values
    distinct = {(s.a, s.b, s.c, s.e, h) for s, h in zip(stages, hard, strict=True)}
    c_values = sorted({a * n + b for a, b, _, _, h in distinct for n in range(lo, h + 1)})
    d_values = sorted({c * n + e for _, _, c, e, h in distinct for n in range(lo, h + 1)})
    best: tuple[float, list[int]] | None = None
    incumbent = bound

    def caps_for(cap_c: float) -> list[int]:
        return [_cap(s.a, s.b, cap_c, h) for s, h in zip(stages, hard, strict=True)]

    def feasible(caps: list[int]) -> bool:
        return sum(caps) >= total and min(caps) >= lo

    # Feasibility is monotone in the cap: bisect to the smallest feasible bottleneck.
    first = bisect.bisect_left(range(len(c_values)), True,
                               key=lambda j: feasible(caps_for(c_values[j])))
    for cap_c in c_values[first:]:
        lower = (m - 1) * max(cap_c, boundary) + sigma_min + d_min
        if lower >= incumbent - 1e-15:
            break
        caps_c = caps_for(cap_c)
        if not feasible(caps_c):
            continue
        # every split with max t ≤ cap_c has Σt at least the greedy fill under these caps
        fill = _greedy(stages, caps_c, total, lo, order)
        if fill is not None and (m - 1) * max(cap_c, boundary) + d_min + sum(
                s.time(n) for s, n in zip(stages, fill, strict=True)) >= incumbent - 1e-15:
            continue

        def caps_cd(cap_d: float, caps_c: list[int] = caps_c) -> list[int]:
            return [min(cc, _cap(s.c, s.e, cap_d, cc)) for s, cc in zip(stages, caps_c,
                                                                        strict=True)]

        first_d = bisect.bisect_left(range(len(d_values)), True,
                                     key=lambda j: feasible(caps_cd(d_values[j])))
        for cap_d in d_values[first_d:]:
            if (m - 1) * max(cap_c, boundary) + sigma_min + cap_d >= incumbent - 1e-15:
                break
            split = _greedy(stages, caps_cd(cap_d), total, lo, order)
            if split is None:
                continue
            t = step_time(stages, split, m, boundary)
            if t < incumbent - 1e-15:
                best, incumbent = (t, split), t
    return best


def split_layers_brute_force(stages: Sequence[StageCost], total: int, m: float,
                             boundary: float = 0.0, lo: int = 1) -> tuple[float, list[int]] | None:
    """Every composition of ``total`` into ``len(stages)`` parts ≥ ``lo``: the reference."""
    k = len(stages)
    best: tuple[float, list[int]] | None = None
    if total < k * lo:
        return None
    for cuts in itertools.combinations(range(1, total - k * (lo - 1)), k - 1):
        parts = [b - a for a, b in zip((0, *cuts), (*cuts, total - k * (lo - 1)), strict=True)]
        split = [p + lo - 1 for p in parts]
        if any(n > s.max_layers for n, s in zip(split, stages, strict=True)):
            continue
        t = step_time(stages, split, m, boundary)
        if best is None or t < best[0] - 1e-15:
            best = (t, split)
    return best


def chunk_counts(n: int, v: int) -> list[int]:
    """``n`` layers split into ``v`` near-equal contiguous counts (the larger ones first)."""
    return [n // v + (1 if c < n % v else 0) for c in range(v)]


def chunk_layer_ranges(plan) -> list[list[tuple[int, int]]]:
    """Global layer range ``(start, end)`` of every model chunk, per stage: ``out[s][c]``.

    The one mapping the planner side, the renderer and the runtime share. Stage ``s`` holds
    ``n_s = layer_end - layer_start`` layers (from the plan). Without virtual stages
    (``plan.schedule != "interleaved"`` or ``virtual_stages == 1``) that is the plan's own
    contiguous range. With ``v`` virtual stages stage ``s`` holds ``v`` chunks; chunk ``(c, s)``
    gets the ``c``-th of :func:`chunk_counts` ``(n_s, v)`` and the global layer order is
    chunk-major: ``(0,0), (0,1), ..., (0,p-1), (1,0), ..., (v-1,p-1)``. The embedding lives
    in chunk ``(0, 0)``, the head in chunk ``(v-1, p-1)``.

    Raises ``ValueError`` naming the field when a stage has fewer layers than chunks or the
    stages do not cover the model's layers.
    """
    v = plan.virtual_stages if plan.schedule == "interleaved" else 1
    if v < 1:
        raise ValueError(f"plan.virtual_stages={v}: must be >= 1")
    counts = [st.layer_end - st.layer_start for st in plan.stages]
    for st, n in zip(plan.stages, counts, strict=True):
        if n < v:
            raise ValueError(
                f"plan.stages[{st.index}] has {n} layers (layer_start={st.layer_start}, "
                f"layer_end={st.layer_end}) < plan.virtual_stages={v}: every stage needs at "
                "least one layer per model chunk; lower virtual_stages or move layers")
    if sum(counts) != plan.model.layers:
        raise ValueError(f"plan.stages hold {sum(counts)} layers in all, the model has "
                         f"{plan.model.layers} (model.layers): fix the stage layer ranges")
    if v == 1:
        return [[(st.layer_start, st.layer_end)] for st in plan.stages]
    per_stage = [chunk_counts(n, v) for n in counts]
    out: list[list[tuple[int, int]]] = [[] for _ in plan.stages]
    start = 0
    for c in range(v):
        for s, split in enumerate(per_stage):
            out[s].append((start, start + split[c]))
            start += split[c]
    return out
