"""planning/replica_groups.py: the extra replica group on idle nodes vs brute force."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from tests.operator.optest_helpers import hetero_nodes, job_body, make_node
from tests.planning.grad_sum_reference import grad_sum_s

from hettrain.api.spec import parse_job_spec
from hettrain.planning.inventory import inventory_from_nodes, load_cluster
from hettrain.planning.plan import Plan
from hettrain.planning.planner import even_data_parallel, own_grad_sync_s, plan_job
from hettrain.planning.replica_groups import (
    add_replica_groups,
    affine,
    best_split,
    evaluate,
    feasible_progression,
    feasible_splits,
    group_options,
    grouped_step_s,
    split_time,
    tp_runs,
)
from hettrain.planning.support import replica_group_errors, unsupported

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import plan_quality as pq

# sequences per step: enough tokens that an extra group's compute outweighs the host-staged
# gradient sum between the groups (replica_groups.groups_grad_sum_s)
GROUP_BATCH = 4096


def _group_spec(**training):
    """job_body's spec (gpt3-1.3b) at :data:`GROUP_BATCH` sequences per step."""
    body = job_body()["spec"]
    body["training"] = {**body["training"], "globalBatch": GROUP_BATCH, **training}
    return body


SPEC = parse_job_spec(_group_spec())


def test_best_split_equals_brute_force_on_random_lines():
    rng = random.Random(7)
    for _ in range(2000):
        lines = ((rng.uniform(0, 2), rng.uniform(0.01, 1)), (rng.uniform(0, 2),
                                                            rng.uniform(0.01, 1)))
        dp0, dp1 = rng.randint(1, 6), rng.randint(1, 6)
        total = rng.randint(2, 80)
        every = feasible_splits(total, dp0, dp1)
        got = best_split(lines, total, dp0, dp1)
        if not every:
            assert got is None
            continue
        assert all(dp0 * a + dp1 * b == total and a >= 1 and b >= 1 for a, b in every)
        want = min(split_time(lines, *s) for s in every)
        assert got is not None and split_time(lines, *got) == pytest.approx(want, rel=1e-12)


def _plans(n_amd: int, dc: str = "dc-b"):
    """The search's plan on the H100 pool alone, and the cluster with ``n_amd`` idle MI300X
    nodes in ``dc`` (the H100s are in dc-a)."""
    spec = parse_job_spec(_group_spec())
    uniform = plan_job("job1", spec, inventory_from_nodes(hetero_nodes(2, 0)))
    amd = [make_node(f"mi300-{i:03d}", "mi300", "MI300X", "amd", 8, dc) for i in range(n_amd)]
    return uniform, inventory_from_nodes(hetero_nodes(2, 0) + amd)


@pytest.mark.parametrize(("n_amd", "dc", "expect_group"), [(1, "dc-a", True), (2, "dc-a", True),
                                                      (1, "dc-b", False), (2, "dc-b", True)])
def test_extra_group_is_the_brute_force_best_and_a_valid_plan(n_amd, dc, expect_group):
    uniform, inv = _plans(n_amd, dc)
    options = group_options(uniform, inv)
    assert options and all(o.pool.name == "mi300" for o in options)
    # brute force: every option, every split of the step's microbatches (a group's last
    # replicas may run one fewer: the plan's schedule and sharding allow short replicas)
    total = uniform.dp * uniform.num_microbatches
    brute = []
    for o in options:
        got = evaluate(uniform, o, inv, own_grad_sync_s(SPEC, inv, uniform))
        times = [_time(uniform, inv, o, s) for s in _every_split(
            total, uniform.dp, o.dp, uniform.num_microbatches, o.max_m)]
        assert (got is None) == (not times)  # too many replicas for the step's microbatches
        if times:
            assert got is not None and got[0] == pytest.approx(min(times), rel=1e-12)
        brute += times
    grouped = add_replica_groups(uniform, SPEC, inv)
    best = min(brute)
    # same DC: the idle MI300Xs speed the step up; across the 10 Gb/s DC link the gradient
    # sum of a 1.3B model costs more than one node saves, less than two save
    assert (best < uniform.predicted.step_time_s) == expect_group
    if expect_group:
        assert grouped.groups and grouped.predicted.step_time_s == pytest.approx(best, rel=1e-12)
        assert unsupported(grouped) == []
        assert Plan.from_json(grouped.to_json()) == grouped
        assert grouped.global_batch == uniform.global_batch
        assert {r.node for r in grouped.group_ranks(1)} <= {
            n for p in inv.pools if p.name == "mi300" for n in p.nodes}
        g0, g1 = grouped.groups
        # the faster group per replica gets more microbatches per replica (shares by speed)
        speed = [g.dp / max(s.time_ms for s in g.stages) for g in (g0, g1)]
        share = [g.microbatches for g in (g0, g1)]
        assert (speed[1] > speed[0]) == (share[1] > share[0]) or abs(share[0] - share[1]) <= 1
    else:
        assert grouped is uniform


def _every_split(total, dp0, dp1, cap0, cap1):
    """``(M_0, M_1)``, each group's fullest replica, of every split of ``total`` microbatches
    that gives every replica one and keeps within the caps (even splits among them)."""
    for n1 in range(dp1, total - dp0 + 1):
        m0, m1 = -(-(total - n1) // dp0), -(-n1 // dp1)
        if m0 <= cap0 and m1 <= cap1:
            yield m0, m1


def _time(uniform, inv, option, split):
    """The modelled step time of one option and split, computed independently."""
    lines = (affine([s.time_ms / 1000 for s in uniform.stages], uniform.schedule),
             affine(option.stage_s, uniform.schedule))
    a0, b0 = lines[0]
    # group 0's own DP sync is replaced by the sum (test_own_grad_sync.py)
    return (uniform.predicted.step_time_s - (a0 + b0 * uniform.num_microbatches)
            - own_grad_sync_s(SPEC, inv, uniform) + _grad_sum_s(uniform, inv, option)
            + split_time(lines, *split))


def _grad_sum_s(uniform, inv, option):
    """The gradient sum between group 0 and ``option``'s group, recomputed
    (grad_sum_reference)."""
    return grad_sum_s(uniform.model, inv, [
        (uniform.dp, 1, [(s.layer_start, s.layer_end, s.tp, s.pools) for s in uniform.stages]),
        (option.dp, option.cp, [(a, b, tp, (option.pool.name,))
                                for (a, b), tp in zip(option.splits, option.tps, strict=True)])])


@pytest.mark.parametrize("n_amd", [1, 2])
def test_grouped_step_re_times_every_stage_of_both_groups(n_amd):
    """``grouped_step_s`` on the planning inventory reproduces the grouped plan's predicted
    step; with one device's layers twice as slow (a scaled profile, as calibration refines
    it) it equals the step computed independently from re-timed stages, same split."""
    from hettrain.planning import cost
    from hettrain.planning.calibration import catalog_profile, scaled, with_profiles

    uniform, inv = _plans(n_amd, "dc-a")
    grouped = add_replica_groups(uniform, SPEC, inv)
    assert grouped.groups
    spec = parse_job_spec(_group_spec())
    assert grouped_step_s(spec, inv, grouped) == pytest.approx(
        grouped.predicted.step_time_s, rel=1e-8)  # time_ms is rounded to 1 ns
    g0, g1 = grouped.groups
    for device in ("H100-SXM", "MI300X"):
        dev = next(p.device for p in inv.pools if p.device.name == device)
        slow = with_profiles(inv, {device: scaled(catalog_profile(
            dev, spec.model, spec.training.precision), 2.0)}, spec.model, spec.training.precision)
        got = grouped_step_s(spec, slow, grouped)
        # independently: every stage's layers re-timed on the slowed device
        def stage_s(st, pool_dev, last):
            t = ((st.layer_end - st.layer_start)
                 * cost.layer_time_s(spec.model, spec.training, grouped.micro_batch, st.tp,
                                     pool_dev))
            return t + (cost.head_time_s(spec.model, grouped.micro_batch, st.tp, pool_dev)
                        if last else 0.0)
        devs = {p.device.name: p.device for p in slow.pools}
        new1 = [stage_s(st, devs[st.device], i == g1.pp - 1) for i, st in enumerate(g1.stages)]
        old1 = [st.time_ms / 1e3 for st in g1.stages]
        old0 = [st.time_ms / 1e3 for st in g0.stages]
        if device == "MI300X":  # group 0 unchanged: only group 1's line moves
            lines_old = (affine(old0, grouped.schedule), affine(old1, grouped.schedule))
            lines_new = (lines_old[0], affine(new1, grouped.schedule))
            want = (grouped.predicted.step_time_s
                    - split_time(lines_old, g0.num_microbatches, g1.num_microbatches)
                    + split_time(lines_new, g0.num_microbatches, g1.num_microbatches))
            assert got == pytest.approx(want, rel=1e-8)
        else:  # group 0's layers slower: its stages take longer, the step too
            assert got > grouped.predicted.step_time_s * 1.2


def test_no_idle_pool_keeps_the_plan():
    uniform, _ = _plans(0)
    assert group_options(uniform, inventory_from_nodes(hetero_nodes(2, 0))) == []
    assert add_replica_groups(uniform, SPEC, inventory_from_nodes(hetero_nodes(2, 0))) is uniform


def test_replan_after_a_failure_from_a_grouped_plan():
    uniform, inv = _plans(2, "dc-a")
    grouped = add_replica_groups(uniform, SPEC, inv)
    assert grouped.groups
    failed = grouped.group_ranks(0)[0].node  # an H100 node of group 0 dies
    survivors = inv.without_nodes([failed])
    spec = parse_job_spec(_group_spec())
    h100 = survivors.__class__(pools=tuple(p for p in survivors.pools if p.name != "mi300"),
                               links=survivors.links, devices=survivors.devices)
    again = plan_job("job1", spec, h100, previous=grouped)
    assert again.global_batch == grouped.global_batch and failed not in again.nodes()
    regrouped = add_replica_groups(again, SPEC, survivors)
    assert unsupported(regrouped) == []
    assert regrouped.global_batch == grouped.global_batch
    assert regrouped.predicted.step_time_s <= again.predicted.step_time_s


def test_feasible_progression_equals_the_enumeration():
    for total in range(1, 90):
        for dp0 in range(1, 9):
            for dp1 in range(1, 9):
                every = [m1 for _, m1 in feasible_splits(total, dp0, dp1)]
                prog = feasible_progression(total, dp0, dp1)
                if not every:
                    assert prog is None, (total, dp0, dp1)
                    continue
                first, step, last = prog
                assert every == list(range(first, last + 1, step)), (total, dp0, dp1)


def test_best_split_of_a_huge_batch_is_arithmetic():
    # a hostile global batch (issue #16): 10^12 microbatches split without enumerating them
    lines = ((0.5, 0.002), (0.1, 0.003))
    total, dp0, dp1 = 10**12 + 6, 4, 6
    m0, m1 = best_split(lines, total, dp0, dp1)
    assert dp0 * m0 + dp1 * m1 == total and m0 >= 1 and m1 >= 1
    # convexity: the neighbours in the progression are no faster
    _, step, _ = feasible_progression(total, dp0, dp1)
    for d in (-step, step):
        other = (total - dp1 * (m1 + d)) // dp0
        assert split_time(lines, m0, m1) <= split_time(lines, other, m1 + d)


def _pinned_body() -> dict:
    """:func:`_group_spec` with the layout pinned to dp 8 x pp 2, ZB-H1."""
    return {**_group_spec(), "parallelism": {"tp": 1, "pp": 2, "dp": 8, "schedule": "zb-h1"}}


def _pinned(n_amd: int, dc: str, **extra) -> tuple[Plan, Plan, object]:
    """``plan_job`` without and with ``spec.parallelism.replicaGroups`` on 2 H100 nodes +
    ``n_amd`` MI300X nodes, the layout pinned to dp 8 x pp 2 (so whole nodes stay idle);
    ``extra`` goes into spec.placement."""
    body = _pinned_body()
    if extra:
        body["placement"] = extra
    amd = [make_node(f"mi300-{i:03d}", "mi300", "MI300X", "amd", 8, dc) for i in range(n_amd)]
    inv = inventory_from_nodes(hetero_nodes(2, 0) + amd)
    plain = plan_job("job1", parse_job_spec(body), inv)
    body["parallelism"]["replicaGroups"] = True
    return plain, plan_job("job1", parse_job_spec(body), inv), inv


def test_plan_job_adds_the_group_only_when_the_spec_asks():
    plain, grouped, inv = _pinned(2, "dc-a")
    # one pool's 16 GPUs take the pinned dp 8 x pp 2; the other pool's nodes sit idle
    assert plain.groups == () and len(plain.pools) == 1
    assert len(grouped.groups) == 2 and unsupported(grouped) == []
    want = add_replica_groups(plain, parse_job_spec(_pinned_body()), inv)
    assert grouped.groups == want.groups and grouped.ranks == want.ranks
    assert grouped.predicted.step_time_s == pytest.approx(want.predicted.step_time_s)
    assert grouped.predicted.step_time_s < plain.predicted.step_time_s
    assert grouped.groups[0].dp == 8 and grouped.groups[0].pp == 2  # the pins hold for group 0


def test_plan_job_notes_why_idle_nodes_stay_idle():
    # maxGPUs 16: the faster grouped plan would need 32
    _, capped, _ = _pinned(2, "dc-a", maxGPUs=16)
    assert capped.groups == () and capped.world_size == 16
    assert "stay idle" in capped.notes[-1] and "maxGPUs 16" in capped.notes[-1], capped.notes
    # one MI300X node in another datacenter: the gradient sum over the 10 Gb/s link costs more
    # than it saves
    _, far, _ = _pinned(1, "dc-b")
    assert far.groups == () and "stay idle" in far.notes[-1], far.notes
    # placement allows only the MI300X pool: nothing idle that the job may use, no note
    plain, allowed, _ = _pinned(2, "dc-a", pools=["mi300"])
    assert allowed.groups == () and allowed.notes == plain.notes


@pytest.mark.parametrize("cluster", [8])
def test_mixed_tp_plans_get_groups_that_follow_their_tp_runs_or_one_tp(cluster):
    # bench/plan_quality's fixed cluster 8 (TP runs 2/4/1), llama3-8b (cluster 4's 8/2/4/2
    # plan spans three datacenters: since the sum between groups is priced on their links it
    # gets no group) (even dp: the layout the groups are added to stays fixed)
    inv = load_cluster(pq.clusters(40)[cluster])
    with even_data_parallel():
        plain = plan_job("q", pq.job("llama3-8b"), inv)
        grouped = plan_job("q", pq.job("llama3-8b", replica_groups=True), inv)
    assert len({s.tp for s in plain.stages}) > 1 and len(grouped.groups) >= 2
    assert grouped.predicted.step_time_s < plain.predicted.step_time_s
    assert replica_group_errors(grouped) == []
    # each extra group's stages either lie in group 0's TP runs, at their TP (whole shards
    # summed between groups), or share one TP degree (the runtime sums pieces of shards)
    g0 = grouped.groups[0]
    tp_at = {layer: s.tp for s in g0.stages for layer in range(s.layer_start, s.layer_end)}
    for g in grouped.groups[1:]:
        follows = all({tp_at[layer] for layer in range(s.layer_start, s.layer_end)} == {s.tp}
                      for s in g.stages)
        assert follows or len({s.tp for s in g.stages}) == 1, g
        if follows:
            assert len(g.stages) >= len(tp_runs(grouped.group_plan(0)))
        # each stage's TP group (of one CP rank) sits on one node; no GPU holds two ranks
        ranks = grouped.group_ranks(g.index)
        blocks: dict[tuple[int, int, int], set[str]] = {}
        for r in ranks:
            blocks.setdefault((r.dp, r.cp, r.stage), set()).add(r.node)
        assert all(len(nodes) == 1 for nodes in blocks.values())
        gpus = [(r.node, r.local_rank) for r in ranks]
        assert len(set(gpus)) == len(gpus) == g.dp * sum(s.tp * s.cp for s in g.stages)
