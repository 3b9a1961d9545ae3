"""Plan.groups: JSON round trip, plain plans unchanged, and support.py's checks."""

from __future__ import annotations

import json
from dataclasses import replace

from tests.runtime.training.plans import grouped_plan, tiny_plan

from hettrain.planning.plan import Plan
from hettrain.planning.support import replica_group_errors, unsupported

TWO = [{"splits": [(0, 1, "a"), (1, 4, "b")], "dp": 2, "num_microbatches": 3},
       {"splits": [(0, 4, "c")], "dp": 1, "num_microbatches": 2}]


def test_round_trip_and_derived_sizes():
    plan = grouped_plan(TWO)
    back = Plan.from_json(plan.to_json())
    assert back == plan
    assert back.fingerprint() == plan.fingerprint()
    assert plan.global_batch == 2 * (2 * 3 + 1 * 2) == plan.training.global_batch
    assert plan.world_size == 2 * 2 + 1
    assert plan.group_row_offset(0) == 0 and plan.group_row_offset(1) == 12
    assert plan.pools == ("a", "b", "c")
    view = plan.group_plan(1)
    assert (view.dp, view.pp, view.num_microbatches, view.groups) == (1, 1, 2, ())
    assert [r.rank for r in view.ranks] == [0] and view.ranks[0].node.startswith("g1-")
    assert view.global_batch == 4
    assert unsupported(plan) == []


def test_plain_plan_json_has_no_group_fields():
    plan = tiny_plan([(0, 2, "a"), (2, 4, "b")], dp=2)
    d = json.loads(plan.to_json())
    assert "groups" not in d
    assert all("group" not in r for r in d["ranks"])
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.global_batch == plan.dp * plan.micro_batch * plan.num_microbatches


def _errors(plan):
    errs = replica_group_errors(plan)
    assert errs and errs == unsupported(plan)[-len(errs):]
    return errs


def test_layer_gap_and_overlap_refused():
    bad = grouped_plan([TWO[0], {"splits": [(0, 2, "c"), (3, 4, "d")]}])
    assert "must cover every layer [0, 4) exactly once" in _errors(bad)[0]
    bad = grouped_plan([TWO[0], {"splits": [(0, 3, "c"), (2, 4, "d")]}])
    assert "plan.groups[1].stages" in _errors(bad)[0]


def test_batch_shares_must_sum_to_the_global_batch():
    plan = grouped_plan(TWO)
    bad = replace(plan, training=replace(plan.training, global_batch=20))
    assert "batch shares [12, 4]" in _errors(bad)[0] and "global_batch=20" in _errors(bad)[0]


def test_groups_may_differ_in_tp_per_layer():
    """The runtime sums each piece of a parameter between its holders (replica_sync.cell_sets,
    run against the reference in tests/runtime/training/test_replica_groups.py)."""
    for tps in ((2, 2), ([2, 1], 2), (2, 1)):
        plan = grouped_plan([{"splits": [(0, 2, "a"), (2, 4, "b")], "tp": tps[0]},
                             {"splits": [(0, 4, "c")], "tp": tps[1]}])
        assert replica_group_errors(plan) == [], tps


def test_groups_may_differ_in_context_parallelism():
    """Each group its own CP degree (replica_sync weights a CP rank by 1/cp of its group's
    share; run against the reference in tests/runtime/training/test_replica_groups.py)."""
    for cps in ((2, 1), (1, 2), (2, 2), (2, 4)):
        plan = grouped_plan([{"splits": [(0, 2, "a"), (2, 4, "b")], "cp": cps[0]},
                             {"splits": [(0, 4, "c")], "cp": cps[1]}])
        assert unsupported(plan) == [], cps
    plan = grouped_plan([TWO[0], {"splits": [(0, 4, "c")], "cp": 2}])
    ranks = plan.ranks[:-1]  # group 1 loses its CP rank 1
    errs = unsupported(replace(plan, ranks=ranks))
    assert any(e.startswith("plan.groups[1]: plan.ranks: with cp=2") for e in errs), errs
    assert "group 1 must hold every (stage, dp, tp, cp)" in replica_group_errors(
        replace(plan, ranks=ranks))[0]
    odd = grouped_plan([TWO[0], {"splits": [(0, 4, "c")], "cp": 3}])
    assert "plan.groups[1]: plan.stages[].cp=3" in unsupported(odd)[0]


def test_missing_rank_mixed_node_and_stray_group_field():
    plan = grouped_plan(TWO)
    assert "group 1 must hold every (stage, dp, tp, cp)" in _errors(
        replace(plan, ranks=plan.ranks[:-1]))[0]
    ranks = list(plan.ranks)
    ranks[-1] = replace(ranks[-1], node=ranks[0].node)
    assert "hosts ranks of several replica groups" in _errors(replace(plan, ranks=tuple(ranks)))[0]
    plain = tiny_plan([(0, 4, "a")], dp=1)
    stray = replace(plain, ranks=(replace(plain.ranks[0], group=1),))
    assert "plan.ranks[].group" in _errors(stray)[0]


def test_diloco_and_top_level_mismatch_refused():
    plan = grouped_plan(TWO)
    assert "crossDC.mode: sync" in _errors(replace(plan, cross_dc={"mode": "diloco"}))[0]
    assert "repeat plan.groups[0]" in _errors(replace(plan, dp=1))[0]



def test_pods_of_a_grouped_plan_take_their_groups_stage():
    from tests.operator.optest_helpers import job_body

    from hettrain.api import constants as c
    from hettrain.api.spec import parse_job_spec
    from hettrain.manifests.builders import JobRef, build_pods

    plan = grouped_plan([{"splits": [(0, 1, "a"), (1, 4, "b")]},
                         {"splits": [(0, 4, "c")], "tp": 2}])
    pods = build_pods(JobRef("job1", "ns", "u"), parse_job_spec(job_body()["spec"]), plan, 1,
                      False)
    labels = [p["metadata"]["labels"] for p in pods]
    stage_of = {x[c.LABEL_RANK]: x[c.LABEL_STAGE] for x in labels}
    # group 1's node (ranks 2, 3: tp 2) runs its stage 0 -- plan.stages[0] would be group 0's
    assert stage_of == {"0": "0", "1": "1", "2": "0"}
    env = {e["name"]: e["value"] for e in pods[2]["spec"]["containers"][0]["env"]}
    assert env[c.ENV_LOCAL_WORLD_SIZE] == "2" and env[c.ENV_WORLD_SIZE] == "4"
