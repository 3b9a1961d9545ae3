"""Admissible lower bounds on a layout's step time, from per-unit aggregates only.

The fast search (``planner._search_fast``) fixes ``(dp, micro_batch)`` and picks, unit by unit, a
tensor-parallel degree ``tp`` and a stage count ``k``. Every stage of one unit has the same
per-layer time ``a``, per-layer gradient time ``c`` and latency ``e`` (first/last stages only add
to these), so a candidate's bound needs one :class:`UnitStats` per ``(unit, tp)``, not per stage.

For any stage order, split and schedule (1F1B, interleaved, ZB-H1) the step time satisfies
``T ≥ (m − 1/3)·X + Σt/3 + D`` where ``X`` is the slowest stage, ``Σt`` the sum of stage times
and ``D`` the slowest DP all-reduce: ``T = (m − 1/r)·X' + Σ'/r + D`` with ``r ∈ {1, v, 3}`` and
``X' ≥ X``, ``Σ' ≥ Σt ≥ X``. Each term is bounded separately:

- ``X``: the smallest ``X`` with ``Σ_u k_u·min(cap_u, X/a_u) ≥ L`` (a stage with ``n`` layers takes
  at least ``a·n``), and ``X ≥ a_u + head_u`` for the cheapest possible last stage;
- ``Σt``: every stage holds ``≥ 1`` layer, the rest go to the cheapest stages first, up to their
  memory caps, plus the cheapest head;
- ``D``: every used unit's ``c + e`` (one layer).

``cap_u`` is the layers one stage can hold with a single microbatch in flight and no embedding or
head: a relaxation of the real per-position caps, so the bound stays valid.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class UnitStats:
    """Per-stage aggregates of one unit at one ``(tp, dp, micro_batch)``."""

    a: float  # seconds per layer per microbatch (compute + TP comm)
    head: float  # seconds of the LM head when this unit hosts the last stage
    dp_one: float  # DP all-reduce seconds of a stage with one layer (0 when dp == 1)
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


def bottleneck_lower_bound(choices: Sequence[Choice], layers: int) -> float:
    """Smallest ``X`` with ``Σ k·min(cap, X/a) ≥ layers`` (inf when the caps cannot hold them)."""
    if sum(ch.k * ch.stats.cap for ch in choices) < layers:
        return math.inf
    items = sorted(((ch.stats.cap * ch.stats.a, ch) for ch in choices), key=lambda x: x[0])
    rate = sum(ch.k / ch.stats.a for ch in choices)
    held = 0.0
    for brk, ch in items:
        x = (layers - held) / rate
        if x <= brk:
            return x
        held += ch.k * ch.stats.cap
        rate -= ch.k / ch.stats.a
    return items[-1][0]


def sum_lower_bound(choices: Sequence[Choice], layers: int) -> float:
    """Minimum of ``Σ a_i·n_i`` with ``1 ≤ n_i ≤ cap`` per stage and ``Σ n_i = layers``."""
    pp = sum(ch.k for ch in choices)
    left = layers - pp
    if left < 0:
        return math.inf
    total = sum(ch.k * ch.stats.a for ch in choices)
    for ch in sorted(choices, key=lambda c: c.stats.a):
        take = min(left, ch.k * (ch.stats.cap - 1))
        total += take * ch.stats.a
        left -= take
        if not left:
            break
    return total if left == 0 else math.inf


def step_lower_bound(choices: Sequence[Choice], layers: int, m: int) -> float:
    """Admissible bound on the step time of every layout built from ``choices`` (module doc)."""
    if not choices:
        return math.inf
    x = bottleneck_lower_bound(choices, layers)
    if x == math.inf:
        return math.inf
    head = min(ch.stats.head for ch in choices)
    x = max(x, max(ch.stats.a for ch in choices),  # every stage holds at least one layer
            min(ch.stats.a + ch.stats.head for ch in choices))
    sigma = sum_lower_bound(choices, layers)
    if sigma == math.inf:
        return math.inf
    sigma += head
    d = max(ch.stats.dp_one for ch in choices)
    return (m - 1.0 / 3.0) * x + sigma / 3.0 + d


def partial_lower_bound(chosen: Sequence[Choice], rest_rate: float, rest_cap: int,
                        rest_min_a: float, layers: int, m: int) -> float:
    """Bound over every completion of ``chosen`` by units that add at most ``rest_rate`` layers
    per second of bottleneck, ``rest_cap`` layers of memory, and no layer cheaper than
    ``rest_min_a``."""
    pp = sum(ch.k for ch in chosen)
    if pp > layers:
        return math.inf
    cap = sum(ch.k * ch.stats.cap for ch in chosen) + rest_cap
    if cap < layers:
        return math.inf
    rate = sum(ch.k / ch.stats.a for ch in chosen) + rest_rate
    if rate <= 0:
        return math.inf
    x = layers / rate
    min_a = min([rest_min_a, *(ch.stats.a for ch in chosen)])
    sigma = sum(ch.k * ch.stats.a for ch in chosen) + (layers - pp) * min_a
    d = max((ch.stats.dp_one for ch in chosen), default=0.0)
    return (m - 1.0 / 3.0) * x + sigma / 3.0 + d


def memory_need_gib(choices: Sequence[Choice], layers: int, gib: float, headroom: float) -> float:
    """GiB per device the best of ``choices`` would need for an even split (error messages)."""
    pp = max(1, sum(ch.k for ch in choices))
    per = math.ceil(layers / pp)
    return min((ch.stats.fixed_bytes + ch.stats.layer_bytes * per) / headroom / gib
               for ch in choices)
