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
from hettrain.planning.planner import plan_job, split_costs

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
    assert auto.schedule == "interleaved-zb" and auto.virtual_stages in (2, 3, 4)
    assert auto.predicted.step_time_s < zb.predicted.step_time_s
    assert (auto.dp, auto.pp, auto.micro_batch) == (zb.dp, zb.pp, zb.micro_batch)
    assert [s.tp for s in auto.stages] == [s.tp for s in zb.stages]
    # the layout is pinned (pp 2, dp 1): each chunk count pinned gives what auto compared
    pinned = {}
    for v in (2, 3, 4):
        spec = _spec("interleaved-zb")
        spec = replace(spec, parallelism=replace(spec.parallelism, virtual_stages=v))
        pinned[v] = plan_job("j", spec, inv).predicted.step_time_s
    assert auto.predicted.step_time_s == pytest.approx(min(pinned.values()), rel=1e-12)
    assert auto.virtual_stages == min(pinned, key=pinned.get)
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


@pytest.mark.parametrize("schedule", ["interleaved", "interleaved-zb"])
def test_interleaved_pipelines_pay_the_hop_from_the_last_stage_back_to_the_first(schedule):
    """A pipeline across two datacenters: each chunk but the last crosses the DC link again
    from the last stage back to stage 0. The plan's p2p seconds are the charged hops
    (v·neighbours + (v − 1)·wrap, each by its own link) and its step time is
    ``cost.pipeline_time_s`` of exactly those hops; without the wrap it would be faster."""
    inv = load_cluster({"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
                        "metadata": {"name": "c"},
                        "datacenters": [{"name": "a"}, {"name": "b"}],
                        "links": [{"between": ["a", "b"], "bandwidthGbps": 10,
                                   "latencyMs": 20}],
                        "pools": [{"name": p, "datacenter": p, "device": "H100-SXM",
                                   "nodes": 1, "gpusPerNode": 1, "nicGbps": 400}
                                  for p in ("a", "b")]})
    spec = parse_job_spec({"model": {"layers": 8, "hidden": 1024, "heads": 16,
                                     "seqLen": 1024, "vocab": 32000},
                           "training": {"globalBatch": 8, "steps": 1},
                           "parallelism": {"schedule": schedule, "pp": 2, "dp": 1,
                                           "virtualStages": 2}})
    plan = plan_job("j", spec, inv)
    assert plan.pp == 2 and plan.virtual_stages == 2
    assert {s.datacenters[0] for s in plan.stages} == {"a", "b"}
    units = [inv.pool(s.pools[0]) for s in plan.stages]
    stage_s, hops, dp_s = split_costs(spec, inv, plan,
                                      [s.layer_end - s.layer_start for s in plan.stages])
    assert len(hops) == 2 and hops[1] == pytest.approx(hops[0], rel=1e-9)  # the same link
    m = plan.num_microbatches
    assert plan.predicted.pp_comm_s == pytest.approx(m * (2 * hops[0] + 1 * hops[1]),
                                                     rel=1e-6)
    zb = 3.0
    pipe, _ = cost.pipeline_time_s(stage_s, hops, m, schedule, 2, zb)
    assert plan.predicted.step_time_s == pytest.approx(pipe + dp_s, rel=1e-6)  # dp_s: + opt
    unpriced, _ = cost.pipeline_time_s(stage_s, hops[:1], m, schedule, 2, zb)
    assert unpriced < pipe
    assert units[0].device.name == units[1].device.name
