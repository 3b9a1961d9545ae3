"""Pure reconcile decisions: launch, idempotent relaunch, repair, debounce, limits, suspend."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from optest_helpers import hetero_nodes, job_body

from hettrain.api import constants as c
from hettrain.api.status import get_condition
from hettrain.reconcile import Decision, Observed, nodes_held_by_others, reconcile


@pytest.fixture
def nodes() -> list[dict[str, Any]]:
    """Four 8-GPU nodes of two vendors in two datacenters."""
    return hetero_nodes()


def _apply(body: dict[str, Any], d: Decision, pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Apply a decision like the API server would: status merge, deletes, creates (409 ok)."""
    body["status"] = {**body.get("status", {}), **d.status}
    gone = {n for k, n in d.delete if k == "Pod"}
    pods = [p for p in pods if p["metadata"]["name"] not in gone]
    names = {p["metadata"]["name"] for p in pods}
    for obj in d.create:
        if obj["kind"] == "Pod" and obj["metadata"]["name"] not in names:
            pods.append(copy.deepcopy(obj))
    return pods


def _run(pods: list[dict[str, Any]], phase: str) -> None:
    for p in pods:
        p.setdefault("status", {})["phase"] = phase


def _launch(nodes):
    body = job_body()
    d = reconcile(body, Observed([], nodes, None, now=1000.0))
    pods = _apply(body, d, [])
    return body, d, pods


def test_first_launch_creates_service_configmap_and_one_pod_per_planned_node(nodes):
    body, d, pods = _launch(nodes)
    kinds = [o["kind"] for o in d.create]
    assert kinds[:3] == ["Service", "NetworkPolicy", "ConfigMap"] and set(kinds[3:]) == {"Pod"}
    assert d.plan is not None
    assert len(pods) == len(d.plan.nodes())
    assert sorted(p["metadata"]["labels"][c.LABEL_ATTEMPT] for p in pods) == ["1"] * len(pods)
    assert body["status"]["phase"] == c.PHASE_LAUNCHING
    assert body["status"]["worldSize"] == d.plan.world_size
    assert get_condition(body["status"], c.COND_PLANNED)["status"] == "True"


def test_reconcile_again_creates_nothing_new_and_restart_midway_fills_the_gang(nodes):
    body, d, pods = _launch(nodes)
    again = reconcile(body, Observed(pods, nodes, d.plan, now=1001.0))
    assert again.create == [] and again.delete == []
    partial = pods[:1]  # operator died after creating one pod
    fill = reconcile(body, Observed(partial, nodes, d.plan, now=1001.0))
    new = _apply(body, fill, partial)
    assert sorted(p["metadata"]["name"] for p in new) == sorted(
        p["metadata"]["name"] for p in pods)


def test_all_running_then_succeeded(nodes):
    body, d, pods = _launch(nodes)
    _run(pods, "Running")
    d2 = reconcile(body, Observed(pods, nodes, d.plan, now=1002.0))
    pods = _apply(body, d2, pods)
    assert body["status"]["phase"] == c.PHASE_RUNNING
    _run(pods, "Succeeded")
    d3 = reconcile(body, Observed(pods, nodes, d.plan, now=1003.0))
    _apply(body, d3, pods)
    assert body["status"]["phase"] == c.PHASE_SUCCEEDED
    assert body["status"]["completionTime"]


def test_node_lost_debounces_then_replans_on_survivors(nodes):
    body, d, pods = _launch(nodes)
    _run(pods, "Running")
    pods = _apply(body, reconcile(body, Observed(pods, nodes, d.plan, now=1002.0)), pods)
    lost = d.plan.nodes()[-1]
    survivors = [n for n in nodes if n["metadata"]["name"] != lost]
    first = reconcile(body, Observed(pods, survivors, d.plan, now=1010.0))
    assert first.create == [] and first.retry_after == 2.0  # debounce window
    pods = _apply(body, first, pods)
    assert body["status"]["phase"] == c.PHASE_REPAIRING
    # a second failure inside the window does not start a second repair
    second_lost = d.plan.nodes()[0]
    survivors2 = [n for n in survivors if n["metadata"]["name"] != second_lost]
    mid = reconcile(body, Observed(pods, survivors2, d.plan, now=1011.0))
    assert mid.create == [] and mid.repair_cause is None
    rep = reconcile(body, Observed(pods, survivors2, d.plan, now=1012.5))
    assert rep.repair_cause == c.REASON_NODE_LOST and rep.plan is not None
    assert lost not in rep.plan.nodes() and second_lost not in rep.plan.nodes()
    new = _apply(body, rep, pods)
    assert {p["metadata"]["labels"][c.LABEL_ATTEMPT] for p in new} == {"2"}
    env = {e["name"]: e["value"] for e in new[0]["spec"]["containers"][0]["env"]}
    assert env[c.ENV_RESUME] == "1"
    assert body["status"]["repairs"]["count"] == 1
    assert body["status"]["repairs"]["history"][0]["toWorldSize"] == rep.plan.world_size
    assert body["status"]["restarts"] == 1


def test_pod_failure_past_max_repairs_fails_the_job(nodes):
    body, d, pods = _launch(nodes)
    body["status"]["repairs"] = {"count": 2}
    pods[0]["status"] = {"phase": "Failed"}
    reconcile(body, Observed(pods, nodes, d.plan, now=1000.0))
    body["status"]["failureSince"] = "1970-01-01T00:16:40Z"  # 1000.0
    out = reconcile(body, Observed(pods, nodes, d.plan, now=1005.0))
    _apply(body, out, pods)
    assert body["status"]["phase"] == c.PHASE_FAILED
    assert get_condition(body["status"], c.COND_FAILED)["reason"] == c.REASON_MAX_REPAIRS
    assert {n for k, n in out.delete if k == "Pod"} == {p["metadata"]["name"] for p in pods}


def test_plan_failure_sets_planfailed_with_planner_message_and_no_pods():
    body = job_body({"model": {"preset": "llama3-405b"}, "failurePolicy": {"minGPUs": 1}})
    small = hetero_nodes(1, 0, 1)
    d = reconcile(body, Observed([], small, None, now=1.0))
    assert [o for o in d.create if o["kind"] == "Pod"] == []
    assert d.status["phase"] == c.PHASE_FAILED
    cond = get_condition(d.status, c.COND_PLANNED)
    assert cond["status"] == "False" and cond["reason"] == c.REASON_PLAN_FAILED
    assert cond["message"] and d.events[-1].type == "Warning"


def test_invalid_spec_names_the_field():
    body = job_body({"training": {"globalBatch": 10, "steps": 1, "microBatch": 3}})
    d = reconcile(body, Observed([], hetero_nodes(), None, now=1.0))
    cond = get_condition(d.status, c.COND_PLANNED)
    assert cond["reason"] == c.REASON_INVALID_SPEC
    assert cond["message"].startswith("spec.training.microBatch")


def test_a_job_without_spec_data_fails_naming_it_and_creates_nothing():
    """Synthetic tokens only when the spec says so: no spec.data is an invalid spec."""
    body = job_body()
    del body["spec"]["data"]
    d = reconcile(body, Observed([], hetero_nodes(), None, now=1.0))
    assert d.create == [] and d.status["phase"] == c.PHASE_FAILED
    cond = get_condition(d.status, c.COND_PLANNED)
    assert cond["reason"] == c.REASON_INVALID_SPEC
    assert cond["message"].startswith("spec.data: is required") and "synthetic: true" in (
        cond["message"])
    body["spec"]["data"] = {"synthetic": True}
    assert reconcile(body, Observed([], hetero_nodes(), None, now=1.0)).plan is not None


def test_min_gpus_at_first_launch_waits_for_capacity(nodes):
    """Never launched: fewer GPUs than minGPUs parks the job Pending and retries (nodes may
    still be joining), creating nothing."""
    body = job_body({"failurePolicy": {"minGPUs": 16}})
    d = reconcile(body, Observed([], nodes[:1], None, now=1.0))
    assert d.status["phase"] == c.PHASE_PENDING and d.create == [] and d.retry_after
    cond = get_condition(d.status, c.COND_PLANNED)
    assert cond["reason"] == c.REASON_INSUFFICIENT_CAPACITY and "minGPUs (16)" in cond["message"]
    later = reconcile(body | {"status": d.status}, Observed([], nodes, None, now=20.0))
    assert later.plan is not None and later.plan.world_size >= 16


def test_min_gpus_blocks_shrinking_below_it():
    nodes = hetero_nodes(0, 2)
    body = job_body({"failurePolicy": {"minGPUs": 16, "debounceSeconds": 0, "maxRepairs": 5}})
    d = reconcile(body, Observed([], nodes, None, now=0.0))
    pods = _apply(body, d, [])
    assert d.plan.world_size == 16
    survivors = [n for n in nodes if n["metadata"]["name"] != d.plan.nodes()[-1]]
    r = reconcile(body, Observed(pods, survivors, d.plan, now=10.0))
    _apply(body, r, pods)
    assert body["status"]["phase"] == c.PHASE_FAILED
    assert not [o for o in r.create if o["kind"] == "Pod"]
    assert "below spec.failurePolicy.minGPUs" in get_condition(
        body["status"], c.COND_FAILED)["message"]


def _pods_of(d: Decision) -> list[dict[str, Any]]:
    return [copy.deepcopy(o) for o in d.create if o["kind"] == "Pod"]


def test_nodes_held_by_another_job_are_not_planned_onto():
    nodes = hetero_nodes(4, 4)
    first = reconcile(job_body(), Observed([], nodes, None, now=1.0))
    taken = set(first.plan.nodes())
    held = nodes_held_by_others({("ns", "job1"): _pods_of(first)}, ("ns", "other"))
    assert set(held) == taken and set(held.values()) == {"ns/job1"}
    other = job_body()
    other["metadata"]["name"] = "other"
    second = reconcile(other, Observed([], nodes, None, now=1.0, held=held))
    assert second.plan is not None and taken.isdisjoint(second.plan.nodes())
    # the job's own pods never count against it; finished pods hold nothing
    assert nodes_held_by_others({("ns", "job1"): _pods_of(first)}, ("ns", "job1")) == {}
    done = _pods_of(first)
    _run(done, "Succeeded")
    assert nodes_held_by_others({("ns", "job1"): done}, ("ns", "other")) == {}


def test_job_waits_pending_while_other_jobs_hold_the_capacity_it_needs():
    nodes = hetero_nodes(2, 0)
    first = reconcile(job_body(), Observed([], nodes, None, now=1.0))
    held = nodes_held_by_others({("ns", "job1"): _pods_of(first)}, ("ns", "other"))
    other = job_body({"failurePolicy": {"minGPUs": 16}})
    other["metadata"]["name"] = "other"
    d = reconcile(other, Observed([], nodes, None, now=1.0, held=held))
    assert d.status["phase"] == c.PHASE_PENDING and d.create == [] and d.retry_after
    msg = get_condition(d.status, c.COND_PLANNED)["message"]
    assert "held by other jobs: ns/job1" in msg
    freed = reconcile(other | {"status": d.status}, Observed([], nodes, None, now=30.0))
    assert freed.plan is not None


def test_suspend_deletes_pods_and_resume_relaunches(nodes):
    body, d, pods = _launch(nodes)
    body["spec"]["suspend"] = True
    body["metadata"]["generation"] = 2
    s = reconcile(body, Observed(pods, nodes, d.plan, now=1.0))
    pods = _apply(body, s, pods)
    assert pods == [] and body["status"]["phase"] == c.PHASE_SUSPENDED
    body["spec"]["suspend"] = False
    body["metadata"]["generation"] = 3
    r = reconcile(body, Observed(pods, nodes, d.plan, now=2.0))
    pods = _apply(body, r, pods)
    assert pods and body["status"]["attempt"] == 2 and body["status"]["phase"] == "Launching"


def test_wait_for_replacement_waits_then_shrinks():
    nodes = hetero_nodes(0, 2)
    body = job_body({"failurePolicy": {"mode": "WaitForReplacement", "waitSeconds": 60,
                                       "debounceSeconds": 0, "minGPUs": 8}})
    d = reconcile(body, Observed([], nodes, None, now=0.0))
    pods = _apply(body, d, [])
    assert d.plan.world_size == 16
    lost = d.plan.nodes()[-1]
    survivors = [n for n in nodes if n["metadata"]["name"] != lost]
    w = reconcile(body, Observed(pods, survivors, d.plan, now=10.0))
    assert w.create == [] and w.retry_after and w.repair_cause is None
    pods = _apply(body, w, pods)
    later = reconcile(body, Observed(pods, survivors, d.plan, now=75.0))
    assert later.repair_cause == c.REASON_NODE_LOST and later.plan is not None
    assert later.plan.world_size == 8 and lost not in later.plan.nodes()
