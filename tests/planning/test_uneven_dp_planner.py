"""Uneven data parallelism in the planner: replica counts that do not divide the global batch.

The search takes, besides the divisors of the global batch ``B``, every ``dp = ceil(B / m)``
(the fewest replicas that run at most ``m`` microbatches each); the last ``short_replicas``
replicas then run one fewer. Checked against brute force (every even ``dp`` pinned), the
plan's own arithmetic, and the replica-group interplay.
"""

from __future__ import annotations

import itertools
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hettrain.api.spec import parse_job_spec
from hettrain.planning import replica_groups
from hettrain.planning.arith import divisors_up_to, uneven_dp_values
from hettrain.planning.errors import PlanningError
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import UNEVEN_DP_STEP, _thinned, even_data_parallel, plan_job
from hettrain.planning.support import unsupported

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import plan_quality as pq


def _cluster(nodes: int) -> dict:
    return {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "t"},
            "datacenters": [{"name": "a"}],
            "pools": [{"name": "h", "datacenter": "a", "device": "H100-SXM", "nodes": nodes,
                       "gpusPerNode": 8, "nicGbps": 400}]}


def _job(gb: int, **parallelism):
    return parse_job_spec({"model": {"preset": "llama3-8b", "seqLen": 8192},
                           "training": {"globalBatch": gb, "steps": 10},
                           "parallelism": parallelism, "data": {"synthetic": True}})


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 12, 37, 512, 1000, 4096])
def test_uneven_values_are_every_ceiling_quotient_that_does_not_divide(n):
    brute = sorted({-(-n // m) for m in range(2, n + 1)} - set(divisors_up_to(n, n)))
    assert uneven_dp_values(n, n) == brute
    assert uneven_dp_values(n, 5) == [q for q in brute if q <= 5]


@pytest.mark.parametrize("n", [32, 512, 1000, 4096])
def test_the_searched_uneven_degrees_step_down_the_microbatches(n):
    """Every divisor is searched; an uneven degree only when its replicas run at most
    ``1 − UNEVEN_DP_STEP`` of the microbatches of the degree before it (ascending)."""
    even, uneven = divisors_up_to(n, n), uneven_dp_values(n, n)
    got = _thinned(n, even, uneven)
    assert set(even) <= set(got) <= set(even) | set(uneven) and got == sorted(got)
    for a, b in itertools.pairwise(got):
        if n % b:
            assert -(-n // b) <= (1 - UNEVEN_DP_STEP) * -(-n // a)
    assert len(got) < len(even) + len(uneven)


def test_three_nodes_of_tp8_take_three_uneven_replicas():
    """32 sequences on 3 nodes of one TP-8 stage: dp 2 (16 each, even) or dp 3 (11/11/10
    sequences). The search picks 3 uneven replicas, faster than every even dp (brute force:
    each divisor pinned), and the plan's arithmetic covers the batch exactly."""
    inv = load_cluster(_cluster(3))
    plan = plan_job("j", _job(32, tp=8, pp=1), inv)
    assert plan.dp == 3 and plan.short_replicas > 0
    mb, m, r = plan.micro_batch, plan.num_microbatches, plan.short_replicas
    assert mb * (plan.dp * m - r) == plan.global_batch == 32
    assert 0 < r < plan.dp and m >= 2
    assert [plan.replica_microbatches(d) for d in range(3)] == [m] * (3 - r) + [m - 1] * r
    assert unsupported(plan) == [] and plan.schedule in ("1f1b", "zb-h1")
    assert any(n.startswith("uneven data parallelism: globalBatch 32 over dp=3")
               for n in plan.notes), plan.notes
    evens = []
    for d in divisors_up_to(32, 32):
        try:
            evens.append(plan_job("j", _job(32, tp=8, pp=1, dp=d), inv).predicted.step_time_s)
        except PlanningError:
            continue
    assert evens and plan.predicted.step_time_s < min(evens)
    with even_data_parallel():
        even = plan_job("j", _job(32, tp=8, pp=1), inv)
    assert even.short_replicas == 0 and 32 % even.dp == 0
    assert even.predicted.step_time_s == pytest.approx(min(evens))
    # the tokens per second count the real global batch, not dp·mb·m
    assert plan.predicted.tokens_per_s == pytest.approx(
        32 * 8192 / plan.predicted.step_time_s)


def test_fast_equals_exhaustive_with_uneven_degrees():
    inv = load_cluster(_cluster(3))
    spec = _job(32, tp=8, pp=1)
    fast, full = plan_job("j", spec, inv), plan_job("j", spec, inv, exhaustive=True)
    assert (fast.dp, fast.micro_batch, fast.short_replicas) == (
        full.dp, full.micro_batch, full.short_replicas)
    assert fast.predicted.step_time_s == pytest.approx(full.predicted.step_time_s)


def _job_with(gb: int, training: dict | None = None, **parallelism):
    training = dict(training or {})
    cross_dc = training.pop("crossDC", {})
    return parse_job_spec({"model": {"preset": "llama3-8b", "seqLen": 8192},
                           "training": {"globalBatch": gb, "steps": 10, **training},
                           "parallelism": parallelism, "crossDC": cross_dc,
                           "data": {"synthetic": True}})


def test_a_pinned_interleaved_schedule_gets_an_even_plan():
    """6 nodes of TP 8, two stages, 32 sequences: unpinned the search runs 3 uneven replicas;
    with schedule interleaved (m a multiple of pp) it keeps to a divisor."""
    inv = load_cluster(_cluster(6))
    free = plan_job("j", _job(32, tp=8, pp=2), inv)
    assert free.short_replicas > 0
    pinned = plan_job("j", _job(32, tp=8, pp=2, schedule="interleaved"), inv)
    assert pinned.schedule == "interleaved" and pinned.short_replicas == 0
    assert 32 % pinned.dp == 0


@pytest.mark.parametrize("training", [{"sharding": "gradients"}, {"sharding": "full"},
                                      {"crossDC": {"mode": "diloco"}, "sharding": "none"}])
def test_zero2_zero3_and_diloco_get_even_plans(training):
    """ZeRO-2/3 reduce per microbatch and DiLoCo averages per datacenter: the runtime refuses
    uneven replicas there (support.uneven_dp_errors), so the search never proposes them; the
    same job with ZeRO-1 does run 3 uneven replicas on these 3 nodes."""
    inv = load_cluster(_cluster(3))
    plan = plan_job("j", _job_with(32, training, tp=8, pp=1), inv)
    assert plan.short_replicas == 0 and 32 % plan.dp == 0
    assert plan_job("j", _job_with(32, {"sharding": "optimizer"}, tp=8, pp=1),
                    inv).short_replicas > 0


def test_replica_groups_take_the_faster_of_the_uneven_plan_and_the_grouped_even_one():
    """bench/plan_quality's cluster 8, llama3-8b: with spec.parallelism.replicaGroups the
    planner compares the uneven plain plan with its groups on idle nodes (none pays there)
    with the even plan and its groups, and keeps the faster; each is what planning it alone
    gives."""
    inv = load_cluster(pq.clusters(40)[8])
    spec = pq.job("llama3-8b", replica_groups=True)
    uneven = plan_job("q", pq.job("llama3-8b"), inv)
    beside = replica_groups.groups_on_idle(uneven, spec, inv)
    with even_data_parallel():
        grouped_even = plan_job("q", spec, inv)
    got = plan_job("q", spec, inv)
    assert uneven.short_replicas > 0 and len(grouped_even.groups) >= 2
    want = min(beside.predicted.step_time_s, grouped_even.predicted.step_time_s)
    assert got.predicted.step_time_s == pytest.approx(want)
    if got.short_replicas:
        assert got.groups == () and any("stay idle: an extra group there would not make" in n
                                        for n in got.notes)


def test_grouped_plan_is_the_fastest_of_every_layout_it_compares():
    """bench/plan_quality's cluster 0, llama3-8b: the plain best runs uneven replicas on one
    pool alone. With replicaGroups the planner compares the per-pool layouts once (the pool
    the uneven plan uses alone included), the uneven plan and the even plan each with its
    groups on idle nodes; the result is the fastest of those, each planned here on its own."""
    inv = load_cluster(pq.clusters(40)[0])
    spec = pq.job("llama3-8b", replica_groups=True)
    uneven = plan_job("q", pq.job("llama3-8b"), inv)
    assert uneven.short_replicas > 0 and len(uneven.pools) == 1
    with even_data_parallel():
        even = plan_job("q", pq.job("llama3-8b"), inv)
        per_pool = [
            replica_groups.groups_on_idle(plan_job("q", replace(
                pq.job("llama3-8b"), placement=replace(spec.placement, pools=(p.name,))), inv),
                spec, inv) for p in inv.pools]
    layouts = [replica_groups.groups_on_idle(uneven, spec, inv),
               replica_groups.groups_on_idle(even, spec, inv),
               *(p for p in per_pool if p.groups)]
    got = plan_job("q", spec, inv)
    assert got.predicted.step_time_s == pytest.approx(
        min(p.predicted.step_time_s for p in layouts), rel=1e-9)


def _uneven_note_numbers(plan) -> tuple[int, int, int, int, int]:
    """``(dp, replicas at m, m, replicas at m − 1, m − 1)`` read back from the plan's note."""
    note = next(n for n in plan.notes if n.startswith("uneven data parallelism"))
    got = re.search(r"over dp=(\d+), (-?\d+) replicas run (\d+) microbatches and (-?\d+) run "
                    r"(\d+) ", note)
    assert got, note
    return tuple(int(g) for g in got.groups())


@pytest.mark.parametrize("gb", [8, 16, 32])
def test_the_uneven_note_counts_true_replicas_when_the_search_picks_cp(gb):
    """With ``cp`` left to the search (32k tokens), the note's counts are the plan's own: the
    true replicas, ``m`` and ``short_replicas`` (they once used the DP×CP group's size)."""
    spec = parse_job_spec({"model": {"preset": "llama3-8b", "seqLen": 32768},
                           "training": {"globalBatch": gb, "steps": 10},
                           "parallelism": {"pp": 2, "tp": 1}, "data": {"synthetic": True}})
    plan = plan_job("j", spec, load_cluster(_cluster(6)))
    assert plan.stages[0].cp > 1 and plan.short_replicas > 0
    dp, full, m, short, m_short = _uneven_note_numbers(plan)
    r = plan.short_replicas
    assert (dp, full, m, short, m_short) == (plan.dp, plan.dp - r, plan.num_microbatches, r,
                                             plan.num_microbatches - 1)
    assert plan.micro_batch * (full * m + short * m_short) == gb
