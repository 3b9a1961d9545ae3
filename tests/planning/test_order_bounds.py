"""The fast search's per-order bounds and memoised memory caps against brute force.

- :func:`bounds.order_caps_bound` never exceeds the best split's step time (every composition
  of the layers enumerated), and its bottleneck is exactly the brute-force min-max stage time;
- :class:`capsrows.CapsRows` answers exactly what the caps of the whole order answer
  (``fits``, ``caps``), and ``may_fit`` is a relaxation: True whenever some order fits;
- :class:`bounds.LeafBound` reused over many orders returns what a fresh
  :func:`bounds.step_lower_bound` returns for each.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from hettrain.planning.bounds import (
    Choice,
    LeafBound,
    UnitStats,
    _caps_bottleneck,
    order_caps_bound,
    step_lower_bound,
)
from hettrain.planning.capsrows import CapsRows


def _splits(caps: list[int], layers: int):
    """Every split with 1 ≤ n_i ≤ caps[i] and Σ n_i = layers."""
    for n in itertools.product(*(range(1, c + 1) for c in caps)):
        if sum(n) == layers:
            yield n


def _random_groups(rng: random.Random) -> tuple[list[tuple[float, float, list[int]]], list]:
    """Groups (a, b, caps) as the planner builds them (the last stage alone, with a head), and
    the flat per-stage list (a, b, cap)."""
    groups = []
    for _ in range(rng.randint(1, 3)):
        a = rng.uniform(0.5, 3.0)
        caps = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
        groups.append((a, 0.0, caps))
    a = rng.uniform(0.5, 3.0)
    groups.append((a, rng.uniform(0.0, 4.0), [rng.randint(1, 5)]))
    flat = [(a, b, c) for a, b, caps in groups for c in caps]
    return groups, flat


@pytest.mark.parametrize("seed", range(40))
def test_order_caps_bound_is_below_every_split(seed: int) -> None:
    rng = random.Random(seed)
    groups, flat = _random_groups(rng)
    pp = len(flat)
    layers = rng.randint(pp, pp + 8)
    m, div, d = rng.randint(1, 12), rng.choice([1.0, 2.0, 3.0]), rng.uniform(0.0, 2.0)
    p_max = rng.uniform(0.0, 3.0)
    boundaries = (p_max, p_max * max(0, pp - 1))
    bound = order_caps_bound(groups, layers, m, div, boundaries, d)
    best, bottleneck = math.inf, math.inf
    for n in _splits([c for *_, c in flat], layers):
        times = [a * k + b for (a, b, _), k in zip(flat, n, strict=True)]
        x = max(max(times), p_max)
        best = min(best, (m - 1.0 / div) * x + (sum(times) + boundaries[1]) / div + d)
        bottleneck = min(bottleneck, max(times))
    if best == math.inf:
        assert bound == math.inf
        return
    assert bound <= best * (1 + 1e-12)
    assert _caps_bottleneck(groups, layers) == pytest.approx(bottleneck, rel=1e-9)


def test_order_caps_bound_sees_a_capped_position() -> None:
    """Two equal stages, the first capped at 2 of 8 layers: the bottleneck is 6 layers, not
    the 4 an even split (no caps) would give."""
    a = 1.0
    groups = [(a, 0.0, [2]), (a, 0.0, [8])]
    assert _caps_bottleneck(groups, 8) == pytest.approx(6.0)
    uncapped = [(a, 0.0, [8]), (a, 0.0, [8])]
    assert _caps_bottleneck(uncapped, 8) == pytest.approx(4.0)


def _stage_cap_table(rng: random.Random):
    """A random pure stage_cap(unit, tp, position, pp, schedule, v) function."""
    table: dict[tuple, int] = {}

    def stage_cap(unit: int, tp: int, i: int, pp: int, schedule: str, v: int) -> int:
        key = (unit, tp, i, pp, schedule, v)
        if key not in table:
            table[key] = rng.randint(0, 6)
        return table[key]
    return stage_cap


@pytest.mark.parametrize("seed", range(30))
def test_caps_rows_match_the_full_caps(seed: int) -> None:
    rng = random.Random(seed)
    layers = rng.randint(3, 14)
    stage_cap = _stage_cap_table(rng)
    rows = CapsRows(layers, stage_cap)
    blocks = [(u, rng.choice([1, 2]), rng.randint(1, 3)) for u in range(rng.randint(1, 4))]
    for schedule, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)):
        lo = v if schedule == "interleaved" else 1
        any_fits = False
        for order in itertools.permutations(blocks):
            pp = sum(k for *_, k in order)
            caps = [stage_cap(u, tp, i, pp, schedule, v)
                    for i, (u, tp) in enumerate((u, tp) for u, tp, k in order for _ in range(k))]
            hard = [min(c, layers - lo * (pp - 1)) for c in caps]
            direct = min(hard) >= lo and sum(hard) >= layers
            assert rows.fits(order, schedule, v) == direct
            assert rows.caps(order, schedule, v) == caps
            any_fits |= direct
        if any_fits:  # a relaxation over the orders never refuses a fitting one
            assert rows.may_fit(blocks, schedule, v)


def _choice(rng: random.Random, unit: int, m: int) -> Choice:
    stats = UnitStats(a=rng.uniform(0.5, 2.0), head=rng.uniform(0.0, 2.0),
                      dp_c=rng.uniform(0.0, 0.3), dp_e=rng.uniform(0.0, 0.5),
                      cap=rng.randint(2, 8), fixed_bytes=1.0, layer_bytes=1.0,
                      act_bytes=rng.choice([0.0, 0.2]), usable_bytes=10.0, microbatches=m)
    return Choice(unit, rng.choice([1, 2, 4]), rng.randint(1, 3), stats)


@pytest.mark.parametrize("seed", range(30))
def test_leaf_bound_reused_equals_fresh_step_lower_bound(seed: int) -> None:
    rng = random.Random(seed)
    m = rng.randint(1, 16)
    choices = tuple(_choice(rng, u, m) for u in range(rng.randint(1, 4)))
    layers = rng.randint(sum(c.k for c in choices), 24)
    leaf = LeafBound(choices, layers, m)
    for _ in range(12):
        last = rng.choice([None, *choices])
        div = rng.choice([1.0, 2.0, 3.0])
        p = rng.uniform(0.0, 1.0)
        boundary = (p, p * rng.randint(0, 4))
        cutoff = rng.choice([math.inf, rng.uniform(1.0, 60.0)])
        assert leaf.bound(boundary, last, div, cutoff) == step_lower_bound(
            choices, layers, m, boundary, last, div, cutoff)
