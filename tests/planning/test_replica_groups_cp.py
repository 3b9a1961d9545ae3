"""planning/replica_groups.py with context parallelism: extra groups beside a CP group 0, each
at its own power-of-two degree, priced and placed as the search prices and places a CP stage,
and a plan the runtime accepts (run against the reference in
tests/runtime/training/test_replica_groups.py)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hettrain.planning import cost
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import _layer_s, _stage_fixed_s, plan_job
from hettrain.planning.replica_groups import group_cps, group_stage_s, grouped_step_s
from hettrain.planning.support import context_parallel_errors, replica_group_errors
from hettrain.planning.units import build_units
from hettrain.render.table import layout_summary

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import plan_quality as pq

MODEL = "llama3-8b-128k"
CLUSTER = 17  # bench/plan_quality's fixed cluster 17: group 0 at cp 4 leaves idle nodes that pay


@pytest.fixture(scope="module")
def planned():
    inv = load_cluster(pq.clusters(40)[CLUSTER])
    spec = pq.job(MODEL, replica_groups=True)
    plain = plan_job("q", pq.job(MODEL), inv)
    return spec, inv, plain, plan_job("q", spec, inv)


def test_a_cp_plan_gets_extra_groups_the_runtime_runs(planned):
    _, inv, plain, grouped = planned
    g0 = grouped.groups[0]
    assert g0.stages[0].cp > 1 and len(grouped.groups) >= 2
    assert grouped.predicted.step_time_s < plain.predicted.step_time_s
    assert grouped.world_size > plain.world_size
    assert replica_group_errors(grouped) == [] and context_parallel_errors(grouped) == []
    assert not any("context parallelism" in n for n in grouped.notes)
    cps = group_cps(grouped.group_plan(0))
    for g in grouped.groups[1:]:
        cp = g.stages[0].cp
        assert cp in cps and {s.cp for s in g.stages} == {cp}
        assert all(s.memory_gib <= s.capacity_gib * cost.MEMORY_HEADROOM for s in g.stages)
        # each (dp, stage)'s CP ranks: TP groups side by side, a TP group on one node, a CP
        # group on one node where tp·cp fits it
        gpn = inv.pool(g.stages[0].pools[0]).gpus_per_node
        by_coord: dict[tuple[int, int], list] = {}
        for r in grouped.group_ranks(g.index):
            by_coord.setdefault((r.stage, r.dp), []).append(r)
        for (stage, _), ranks in by_coord.items():
            tp = g.stages[stage].tp
            assert sorted((r.cp, r.tp) for r in ranks) == [
                (c, t) for c in range(cp) for t in range(tp)]
            for c in range(cp):
                assert len({r.node for r in ranks if r.cp == c}) == 1
            if tp * cp <= gpn:
                assert len({r.node for r in ranks}) == 1
    gpus = [(r.node, r.local_rank) for r in grouped.ranks]
    assert len(set(gpus)) == len(gpus)
    # `hettrain plan` names each group's degree
    assert layout_summary(grouped).count(" (cp ") == sum(
        g.stages[0].cp > 1 for g in grouped.groups)


def test_grouped_step_reprices_the_cp_groups(planned):
    spec, inv, _, grouped = planned
    assert grouped_step_s(spec, inv, grouped) == pytest.approx(
        grouped.predicted.step_time_s, rel=1e-8)  # time_ms is rounded to 1 ns


def test_group_stage_times_are_the_searchs_cp_pricing(planned):
    """An extra group's stage on one pool costs what the search charges a CP stage on a unit
    of that pool alone (``planner._layer_s`` / ``_stage_fixed_s`` at the spec's cp)."""
    spec, inv, _, grouped = planned
    # the spec as the search priced it: the loss chunked as the plan says (long sequences)
    training = replace(spec.training, loss_chunk_tokens=grouped.training.loss_chunk_tokens)
    for pool in inv.pools:
        (unit,) = build_units((pool,), merged=False)
        for cp in (1, 2, 8):
            at = replace(spec, training=training,
                         parallelism=replace(spec.parallelism, cp=cp))
            for tp in (1, 4):
                got = group_stage_s(grouped, [(0, 3), (3, 32)], [tp, tp], pool, cp)
                want = [n * _layer_s(at, unit, grouped.micro_batch, tp)
                        + _stage_fixed_s(at, unit, grouped.micro_batch, tp, s == 0, s == 1)
                        for s, n in enumerate((3, 29))]
                assert got == pytest.approx(want, rel=1e-12), (pool.name, cp, tp)


def test_group_cps_are_powers_of_two_up_to_group_0s(planned):
    _, _, _, grouped = planned
    plan0 = grouped.group_plan(0)
    top = plan0.stages[0].cp
    assert group_cps(plan0) == [c for c in (1, 2, 4, 8, 16) if c <= top]
    flat = replace(plan0, stages=tuple(replace(s, cp=1) for s in plan0.stages))
    assert group_cps(flat) == [1]
