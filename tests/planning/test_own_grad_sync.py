"""planner.own_grad_sync_s: the part of a plan's step that is its own DP gradient sync, which
replica groups replace by their sum (runtime/replica_sync.py runs no DP all-reduce beside it),
and ``split_costs(summed_elsewhere=True)``, which prices group 0's tail without it."""

from __future__ import annotations

import pytest
from tests.operator.optest_helpers import hetero_nodes, job_body

from hettrain.api.spec import parse_job_spec
from hettrain.planning.inventory import inventory_from_nodes
from hettrain.planning.planner import own_grad_sync_s, plan_job, split_costs


def _one_stage_plan(sharding: str):
    """gpt3-1.3b on the H100 nodes only, one pipeline stage, DP 8 (layout pinned)."""
    body = job_body()["spec"]
    body["training"] = {**body["training"], "globalBatch": 64, "microBatch": 1,
                        "sharding": sharding}
    body["parallelism"] = {"pp": 1, "tp": 1, "dp": 8}
    body["placement"] = {"vendors": ["nvidia"]}
    spec = parse_job_spec(body)
    inv = inventory_from_nodes(hetero_nodes(2, 0))
    return spec, inv, plan_job("job1", spec, inv)


def test_one_stage_own_sync_is_the_exposed_all_reduce():
    """One stage: the step is ``m·stage + sync + optimizer``, so the own sync is the plan's
    exposed DP sync (``dp_comm_s``) and the tail after the sum its optimizer step."""
    spec, inv, plan = _one_stage_plan("none")
    assert plan.pp == 1 and plan.dp == 8 and plan.predicted.dp_comm_s > 0
    own = own_grad_sync_s(spec, inv, plan)
    assert own == pytest.approx(plan.predicted.dp_comm_s, rel=1e-9)
    stage_s, _, after = split_costs(spec, inv, plan, [spec.model.layers],
                                    summed_elsewhere=True)
    assert after == pytest.approx(plan.predicted.optimizer_s, rel=1e-9)
    assert plan.predicted.step_time_s == pytest.approx(
        plan.num_microbatches * stage_s[0] + own + after, rel=1e-9)


def test_zero1_keeps_its_parameter_all_gather_after_the_sum():
    """ZeRO-1: the sum replaces the gradient all-reduce, not the all-gather of the updated
    parameters: the own sync is the same layout's all-reduce without sharding, less than
    ZeRO-1's whole DP sync, and the tail after the sum is the optimizer plus the gather."""
    _, _, plain = _one_stage_plan("none")
    spec, inv, plan = _one_stage_plan("optimizer")
    own = own_grad_sync_s(spec, inv, plan)
    assert own == pytest.approx(plain.predicted.dp_comm_s, rel=1e-9)
    assert own < plan.predicted.dp_comm_s
    _, _, after = split_costs(spec, inv, plan, [spec.model.layers], summed_elsewhere=True)
    gather = plan.predicted.dp_comm_s - own
    assert after == pytest.approx(plan.predicted.optimizer_s + gather, rel=1e-9)
