"""planning/replica_groups.py: extra groups with fewer replicas than their idle nodes hold."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from hettrain.planning.inventory import load_cluster
from hettrain.planning.plan import Plan
from hettrain.planning.planner import plan_job
from hettrain.planning.replica_groups import (
    feasible_splits,
    fewer_replicas,
    greedy_groups,
    group_options,
    largest_divisor_within,
    split_time,
)
from hettrain.planning.support import replica_group_errors

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import plan_quality as pq


def test_largest_divisor_within_equals_the_enumeration():
    rng = random.Random(3)
    for _ in range(3000):
        n, cap = rng.randint(1, 5000), rng.randint(1, 300)
        assert largest_divisor_within(n, cap) == max(d for d in range(1, min(n, cap) + 1)
                                                     if n % d == 0)


def _brute(lines, dp0, m, dp_max):
    """Every replica count below ``dp_max`` with its fastest split: ``{R: (time, M_1)}``."""
    out = {}
    for r in range(1, dp_max):
        splits = feasible_splits(dp0 * m, dp0, r)
        if splits:
            t, m1 = min((split_time(lines, *s), s[1]) for s in splits)
            out[r] = (t, m1)
    return out


def test_fewer_replicas_finds_the_fastest_smaller_group_on_random_lines():
    rng = random.Random(11)
    checked = 0
    for _ in range(1500):
        lines = ((rng.uniform(0, 3), rng.uniform(0.05, 1)),
                 (rng.uniform(0, 3), rng.uniform(0.05, 2)))
        dp0, m, dp_max = rng.randint(1, 40), rng.randint(1, 24), rng.randint(1, 60)
        got = fewer_replicas(lines[0], dp0, m, lines[1], dp_max, count=2)
        every = _brute(lines, dp0, m, dp_max)
        if not every:
            assert got == []
            continue
        checked += 1
        assert got, (lines, dp0, m, dp_max)
        times = []
        for r, m1 in got:  # each a real split: R·M_1 whole group-0 microbatches, 1 <= k < m
            assert 1 <= r < dp_max and m1 >= 1 and (r * m1) % dp0 == 0
            k = r * m1 // dp0
            assert 1 <= k < m
            times.append(split_time(lines, m - k, m1))
            assert times[-1] >= every[r][0] * (1 - 1e-12)  # no better than R's best split
        assert len({r for r, _ in got}) == len(got)
        assert times == sorted(times)
        assert times[0] == pytest.approx(min(t for t, _ in every.values()), rel=1e-12)
    assert checked > 1000


def test_a_group_on_fewer_replicas_wins_where_all_idle_nodes_split_badly():
    """c22 (464 H200 in dc0, 164 MI300X in dc2), llama3-8b: group 0 takes 384 H200 and 128
    MI300X (dp 64, 8 microbatches each) and leaves 20 H200 nodes idle. A group on all of them
    (40 replicas at tp 2) admits no split of the 512 microbatches near the groups' balance;
    32 replicas of 2 microbatches each do (group 0 keeps 7)."""
    inv = load_cluster(pq.clusters(40)[22])
    spec = pq.job("llama3-8b", replica_groups=True)
    plain = plan_job("q", pq.job("llama3-8b"), inv)
    grouped = plan_job("q", spec, inv)
    options = group_options(plain, inv)
    filling = [o for o in options if o.fills_idle]
    assert len(filling) < len(options)
    _, only_filling = greedy_groups(plain, inv, filling)
    assert grouped.groups, grouped.notes
    g1 = grouped.groups[1]
    idle = {n for p in inv.pools for n in p.nodes} - set(plain.nodes())
    nodes = {r.node for r in grouped.group_ranks(1)}
    gpn = {p.name: p.gpus_per_node for p in inv.pools}[g1.stages[0].pools[0]]
    assert nodes <= idle and len(nodes) * gpn < sum(1 for n in idle if n in
                                                     inv.pool(g1.stages[0].pools[0]).nodes) * gpn
    best_filling = plain.predicted.step_time_s if only_filling is None else only_filling[0]
    assert grouped.predicted.step_time_s < best_filling * (1 - 1e-3)
    assert grouped.predicted.step_time_s < plain.predicted.step_time_s
    assert sum(g.microbatches for g in grouped.groups) == plain.dp * plain.num_microbatches
    assert grouped.global_batch == plain.global_batch
    assert len({(r.node, r.local_rank) for r in grouped.ranks}) == len(grouped.ranks)
    assert replica_group_errors(grouped) == []
    assert Plan.from_json(grouped.to_json()) == grouped
