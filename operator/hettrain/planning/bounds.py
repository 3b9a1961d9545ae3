"""Admissible lower bounds on a layout's step time, from per-unit aggregates only.

The fast search (``planner._search_fast``) fixes ``(dp, micro_batch)`` and picks, unit by unit, a
tensor-parallel degree ``tp`` and a stage count ``k``. Every stage of one unit has the same
per-layer time ``a``, per-layer gradient time ``c`` and latency ``e`` (first/last stages only add
to these), so a candidate's bound needs one :class:`UnitStats` per ``(unit, tp)``, not per stage.

For any stage order, split and schedule the step time is ``T = (m − 1/r)·X' + Σ'/r + D`` with
``r = 1`` (1F1B), ``v`` (interleaved) or ``3`` (ZB-H1), ``X' ≥ max(X, P)`` and
``Σ' ≥ Σt + Σp`` (``X``: slowest stage, ``Σt``: sum of stage times, ``P``/``Σp``: slowest/sum of
boundary transfers, ``D``: slowest DP all-reduce). Since ``Σ' ≥ X'``, a smaller ``r`` only makes
``T`` larger, so the largest ``r`` the schedule choice allows gives a bound for all of them.
Terms are bounded as follows:

- ``X``: the smallest ``X`` with ``Σ_u k_u·min(cap_u, ⌊X/a_u⌋) ≥ L`` (whole layers), at least
  every used ``a_u`` (one layer each) and the cheapest possible last stage ``a_u + head_u``;
- ``Σt`` given ``X``: every stage holds ``≥ 1`` and ``≤ ⌊X/a⌋`` layers, the rest go to the
  cheapest stages first; ``(X, Σt)`` are coupled on a geometric grid of ``X`` (``Σt_min`` is
  non-increasing in ``X``);
- ``D ≥ c_u + e_u`` for every used unit, and ``Σ k_u·(D − e_u)/c_u ≥ L``;
- ``P``, ``Σp``: :func:`boundary_lower_bounds` (any order) or :func:`ordered_boundaries`.

``cap_u`` is the layers one stage can hold with a single microbatch in flight and no embedding or
head: a relaxation of the real per-position caps, so the bound stays valid.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

GRID_RATIO = 1.04  # geometric grid over the bottleneck X in step_lower_bound
GRID_STEPS = 12


@dataclass(frozen=True, slots=True)
class UnitStats:
    """Per-stage aggregates of one unit at one ``(tp, dp, micro_batch)``."""

    a: float  # seconds per layer per microbatch (compute + TP comm)
    head: float  # seconds of the LM head when this unit hosts the last stage
    dp_c: float  # DP all-reduce seconds per layer (0 when dp == 1)
    dp_e: float  # DP all-reduce latency of a middle stage (0 when dp == 1)
    cap: int  # layers one stage can hold (relaxed: 1 microbatch in flight, no embedding)
    fixed_bytes: float  # per-device bytes independent of the layer count (relaxed)
    layer_bytes: float  # per-device bytes per layer (relaxed)


@dataclass(frozen=True, slots=True)
class Choice:
    """One unit's choice in a candidate: ``k`` stages of ``tp`` GPUs each."""

    unit: int  # index into the search's unit tuple
    tp: int
    k: int
    stats: UnitStats
    # derived once (the bounds run on every leaf of the search)
    a: float = field(init=False)
    cap: int = field(init=False)
    kcap: int = field(init=False)  # layers the k stages can hold
    rate: float = field(init=False)  # k / a
    ka: float = field(init=False)  # k · a

    def __post_init__(self) -> None:
        for name, value in (("a", self.stats.a), ("cap", self.stats.cap),
                            ("kcap", self.k * self.stats.cap), ("rate", self.k / self.stats.a),
                            ("ka", self.k * self.stats.a)):
            object.__setattr__(self, name, value)


def _stage_caps(choices: Sequence[Choice], x: float) -> list[int]:
    """Layers each unit's stages can hold when no stage may take longer than ``x``."""
    return [n if (n := int(x / ch.a + 1e-9)) < ch.cap else ch.cap for ch in choices]


def bottleneck_lower_bound(choices: Sequence[Choice], layers: int, whole: bool = True) -> float:
    """Smallest ``X`` with ``Σ k·min(cap, ⌊X/a⌋) ≥ layers`` (inf when the caps cannot hold them).

    Starts at the continuous relaxation ``Σ k·min(cap, X/a) = layers`` (returned when not
    ``whole``) and steps to the next value where some unit's stages fit one more whole layer.
    """
    if sum(ch.kcap for ch in choices) < layers:
        return math.inf
    items = sorted(((ch.cap * ch.a, ch) for ch in choices), key=lambda x: x[0])
    rate = sum(ch.rate for ch in choices)
    held = 0.0
    x = items[-1][0]
    for brk, ch in items:
        x = (layers - held) / rate
        if x <= brk:
            break
        held += ch.kcap
        rate -= ch.rate
    x = min(x, items[-1][0])
    if not whole:
        return x
    for _ in range(4 * layers):
        caps = _stage_caps(choices, x)
        if sum(ch.k * n for ch, n in zip(choices, caps, strict=True)) >= layers:
            return x
        x = min(ch.a * (n + 1) for ch, n in zip(choices, caps, strict=True)
                if n < ch.cap)
    return x


def sum_lower_bound(choices: Sequence[Choice], layers: int, x: float = math.inf) -> float:
    """Minimum of ``Σ a_i·n_i`` with ``1 ≤ n_i ≤ cap``, ``a_i·n_i ≤ x`` per stage and
    ``Σ n_i = layers`` (cheapest stages filled first); inf when infeasible."""
    pp = sum(ch.k for ch in choices)
    left = layers - pp
    if left < 0:
        return math.inf
    caps = _stage_caps(choices, x) if x < math.inf else [ch.cap for ch in choices]
    if min(caps) < 1:
        return math.inf
    total = sum(ch.ka for ch in choices)
    for ch, n in sorted(zip(choices, caps, strict=True), key=lambda t: t[0].a):
        take = min(left, ch.k * (n - 1))
        total += take * ch.a
        left -= take
        if not left:
            break
    return total if left == 0 else math.inf


def dp_lower_bound(choices: Sequence[Choice], layers: int) -> float:
    """Slowest DP all-reduce ``D``: every stage has ``c·n + e ≤ D`` and ``Σ n = layers``."""
    d = max(ch.stats.dp_c + ch.stats.dp_e for ch in choices)
    if all(ch.stats.dp_c > 0 for ch in choices):
        rate = sum(ch.k / ch.stats.dp_c for ch in choices)
        d = max(d, (layers + sum(ch.k * ch.stats.dp_e / ch.stats.dp_c for ch in choices)) / rate)
    return d


def boundary_lower_bounds(choices: Sequence[Choice],
                          cost_of: Callable[[Choice, Choice], float]) -> tuple[float, float]:
    """Lower bounds on (slowest, sum of) boundary transfers over every stage order.

    A unit's ``k`` stages are consecutive, so ``k − 1`` boundaries stay inside it; the ``n``
    units' blocks are joined by ``n − 1`` boundaries between different units, each at least the
    cheapest pair; every unit borders at least one other, so the slowest boundary is at least
    each unit's cheapest neighbour.
    """
    inside = [cost_of(c, c) for c in choices if c.k > 1]
    total = sum(cost_of(c, c) * (c.k - 1) for c in choices if c.k > 1)
    slowest = max(inside, default=0.0)
    if len(choices) > 1:
        pair = [[cost_of(x, y) for y in choices if y is not x] for x in choices]
        total += (len(choices) - 1) * min(min(row) for row in pair)
        slowest = max(slowest, max(min(row) for row in pair))
    return slowest, total


def ordered_boundaries(order: Sequence[Choice],
                       cost_of: Callable[[Choice, Choice], float]) -> tuple[float, float]:
    """Exact (slowest, sum of) boundary transfers when the units' order is fixed."""
    costs = [cost_of(c, c) for c in order if c.k > 1]
    total = sum(cost_of(c, c) * (c.k - 1) for c in order if c.k > 1)
    for x, y in itertools.pairwise(order):
        costs.append(cost_of(x, y))
        total += costs[-1]
    return max(costs, default=0.0), total


def step_lower_bound(choices: Sequence[Choice], layers: int, m: int,
                     boundary: tuple[float, float] | Callable[[], tuple[float, float]]
                     = (0.0, 0.0), last: Choice | None = None, bubble_div: float = 3.0,
                     cutoff: float = math.inf) -> float:
    """Admissible bound on the step time of every layout built from ``choices`` (module doc).

    ``boundary``: lower bounds on the slowest and the sum of the boundary transfers (or a function
    computing them, called only when cheaper bounds do not reach ``cutoff``); ``last``: the
    unit of the last stage when the order is fixed; ``bubble_div``: the schedules' smallest
    bubble divisor (3 for ZB-H1, 2 for interleaved, 1 for 1F1B); ``cutoff``: stop refining once
    the bound reaches it (the caller discards such layouts). The bottleneck ``X`` and ``Σt``
    are coupled: for ``X`` in ``[x_j, x_{j+1})``, ``Σt ≥ Σt_min(x_{j+1})`` on a geometric grid.
    """
    if not choices or sum(ch.k for ch in choices) > layers:
        return math.inf
    xc = bottleneck_lower_bound(choices, layers, whole=False)
    if xc == math.inf:
        return math.inf
    tails = choices if last is None else (last,)
    head = min(ch.stats.head for ch in tails)
    floor = max(max(ch.a for ch in choices),  # every stage holds at least one layer
                min(ch.a + ch.stats.head for ch in tails))
    slope = m - 1.0 / bubble_div
    sigma_inf = sum_lower_bound(choices, layers)
    if sigma_inf == math.inf:
        return math.inf
    d = dp_lower_bound(choices, layers)
    best = slope * max(xc, floor) + (sigma_inf + head) / bubble_div + d  # cheap first
    if best >= cutoff:
        return best
    p_max, p_sum = boundary() if callable(boundary) else boundary
    x0 = max(bottleneck_lower_bound(choices, layers), floor)
    rest = (sigma_inf + head + p_sum) / bubble_div + d
    best = slope * max(x0, p_max) + rest  # whole layers and boundaries, X and Σt uncoupled
    if best >= cutoff:
        return best
    coupled = math.inf
    x_top = max(ch.a * ch.cap for ch in choices)
    x = x0
    for _ in range(GRID_STEPS):
        if x >= x_top or slope * max(x, p_max) + rest >= coupled:
            break
        nxt = x * GRID_RATIO
        sigma = sum_lower_bound(choices, layers, nxt)
        if sigma < math.inf:
            coupled = min(coupled, slope * max(x, p_max) + rest
                          + (sigma - sigma_inf) / bubble_div)
        x = nxt
    return max(best, min(coupled, slope * max(x, p_max) + rest))


def partial_lower_bound(chosen: Sequence[Choice], rest_rate: float, rest_cap: int,
                        rest_min_a: float, layers: int, m: int, bubble_div: float = 3.0) -> float:
    """Bound over every completion of ``chosen`` by units that add at most ``rest_rate`` layers
    per second of bottleneck, ``rest_cap`` layers of memory, and no layer cheaper than
    ``rest_min_a``."""
    pp = sum(ch.k for ch in chosen)
    if pp > layers:
        return math.inf
    cap = sum(ch.kcap for ch in chosen) + rest_cap
    if cap < layers:
        return math.inf
    rate = sum(ch.rate for ch in chosen) + rest_rate
    if rate <= 0:
        return math.inf
    x = layers / rate
    min_a = min([rest_min_a, *(ch.a for ch in chosen)])
    sigma = sum(ch.ka for ch in chosen) + (layers - pp) * min_a
    d = max((ch.stats.dp_c + ch.stats.dp_e for ch in chosen), default=0.0)
    return (m - 1.0 / bubble_div) * x + sigma / bubble_div + d


def memory_need_gib(choices: Sequence[Choice], layers: int, gib: float, headroom: float) -> float:
    """GiB per device the best of ``choices`` would need for an even split (error messages)."""
    pp = max(1, sum(ch.k for ch in choices))
    per = math.ceil(layers / pp)
    return min((ch.stats.fixed_bytes + ch.stats.layer_bytes * per) / headroom / gib
               for ch in choices)
