"""The layer split's two exact methods agree: the bisection over kinds of stages (used above
``SCAN_CANDIDATES`` candidates, cost independent of the layer count) equals brute force on small
instances and the plain scan on large ones."""

from __future__ import annotations

import random

import pytest

from hettrain.planning.layers import (
    StageCost,
    _split_layers_kinds,
    _split_layers_scan,
    split_layers_brute_force,
)


def _stages(rng: random.Random, total: int, kinds: int, per_kind: int) -> list[StageCost]:
    """``kinds`` distinct stage costs, each repeated ``per_kind`` times (a pipeline of identical
    stages of a few device types, as the planner builds them)."""
    out = []
    for _ in range(kinds):
        s = StageCost(rng.uniform(0.5, 3), rng.choice([0.0, rng.uniform(0, 2)]),
                      rng.choice([0.0, rng.uniform(0, 0.3)]), rng.uniform(0, 0.5),
                      rng.randint(1, total))
        out.extend([s] * per_kind)
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_kinds_method_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    kinds, per_kind = rng.randint(1, 3), rng.randint(1, 2)
    total = rng.randint(kinds * per_kind, 12)
    stages = _stages(rng, total, kinds, per_kind)
    m, boundary = rng.choice([1, 2, 5, 24]), rng.uniform(0, 0.5)
    ref = split_layers_brute_force(stages, total, m, boundary)
    got = _split_layers_kinds(stages, total, m, boundary, 1, float("inf"))
    assert (ref is None) == (got is None)
    if ref is not None and got is not None:
        assert got[0] == pytest.approx(ref[0], rel=1e-9)
        assert sum(got[1]) == total and all(n >= 1 for n in got[1])
        assert all(n <= s.max_layers for s, n in zip(stages, got[1], strict=True))


@pytest.mark.parametrize("seed", range(20))
def test_kinds_method_equals_scan_on_thousands_of_layers(seed: int) -> None:
    rng = random.Random(100 + seed)
    total = rng.randint(200, 3000)
    stages = _stages(rng, total, rng.randint(1, 4), rng.randint(1, 6))
    m, boundary = rng.choice([1, 3, 12, 96]), rng.uniform(0, 5)
    ref = _split_layers_scan(stages, total, m, boundary, 1, float("inf"))
    got = _split_layers_kinds(stages, total, m, boundary, 1, float("inf"))
    assert (ref is None) == (got is None)
    if ref is not None and got is not None:
        assert got[0] == pytest.approx(ref[0], rel=1e-9)
