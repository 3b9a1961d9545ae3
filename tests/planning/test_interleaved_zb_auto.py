"""``schedule: auto`` and interleaved-zb: auto tries it on the layout its search chose
(``planner._with_interleaved_zb``) and keeps it only when it fits and is faster; the pinned
schedule prices its own replayed order. Checked against the pinned plans and the pure replay."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hettrain.api.spec import parse_job_spec
from hettrain.planning import cost
from hettrain.planning.interleaved_zb import interleaved_zb_orders, makespan
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import plan_job

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "examples/clusters/local-cpu.yaml"


def _spec(schedule: str = "auto", **training):
    job = {"model": {"layers": 8, "hidden": 1024, "heads": 16, "seqLen": 2048,
                     "vocab": 32000},
           "training": {"globalBatch": 8, "steps": 1, **training},
           "parallelism": {"schedule": schedule, "pp": 2, "dp": 1}}
    return parse_job_spec(job)


def _cluster():
    return load_cluster({"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
                         "metadata": {"name": "c"}, "datacenters": [{"name": "a"}],
                         "pools": [{"name": "h", "datacenter": "a", "device": "H100-SXM",
                                    "nodes": 1, "gpusPerNode": 2, "nicGbps": 400}]})


def test_auto_keeps_interleaved_zb_where_it_is_faster_on_the_chosen_layout():
    inv = _cluster()
    auto = plan_job("j", _spec(), inv)
    zb = plan_job("j", _spec("zb-h1"), inv)
    assert auto.schedule == "interleaved-zb" and auto.virtual_stages == 2
    assert auto.predicted.step_time_s < zb.predicted.step_time_s
    assert (auto.dp, auto.pp, auto.micro_batch) == (zb.dp, zb.pp, zb.micro_batch)
    assert [s.tp for s in auto.stages] == [s.tp for s in zb.stages]
    pinned = plan_job("j", _spec("interleaved-zb"), inv)  # searches v = 2..4 alone
    assert pinned.predicted.step_time_s <= auto.predicted.step_time_s * (1 + 1e-12)
    note = next(n for n in auto.notes if n.startswith("schedule=auto chose interleaved-zb"))
    assert f"{auto.predicted.step_time_s:.4g}s vs {zb.predicted.step_time_s:.4g}s" in note
    exhaustive = plan_job("j", _spec(), inv, exhaustive=True)
    assert exhaustive.predicted.step_time_s == pytest.approx(auto.predicted.step_time_s,
                                                             rel=1e-9)
    assert exhaustive.schedule == auto.schedule


def test_auto_leaves_zero2_plans_and_single_stages_alone():
    inv = _cluster()
    z2 = plan_job("j", _spec(sharding="gradients"), inv)
    assert z2.schedule != "interleaved-zb"
    one = plan_job("j", replace(_spec(), parallelism=replace(_spec().parallelism, pp=1,
                                                               dp=2)), inv)
    assert one.pp == 1 and one.schedule == "1f1b"


def test_the_plans_pipeline_time_is_the_replayed_order_of_its_stage_times():
    """The pinned plan's stages replayed in the runtime's order (F = B = W per stage, boundary
    hops left out) give the planner's pipelined time within 5%."""
    inv = load_cluster(LOCAL)
    spec = parse_job_spec({"model": {"layers": 12, "hidden": 256, "heads": 4, "seqLen": 256,
                                     "vocab": 1024},
                           "training": {"globalBatch": 16, "steps": 1},
                           "parallelism": {"schedule": "interleaved-zb", "pp": 3,
                                           "virtualStages": 2}})
    plan = plan_job("j", spec, inv)
    assert plan.schedule == "interleaved-zb" and plan.pp == 3
    v, m = plan.virtual_stages, plan.num_microbatches
    stage_s = [s.time_ms / 1e3 for s in plan.stages]
    want, _ = cost.pipeline_time_s(stage_s, [0.0] * (plan.pp - 1), m, plan.schedule, v)
    got = makespan(interleaved_zb_orders(plan.pp, m, v), v,
                   [{k: t / (3 * v) for k in "FBW"} for t in stage_s])
    assert got == pytest.approx(want, rel=0.05)
