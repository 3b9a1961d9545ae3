"""The operator's reconcile path with a grouped plan (``spec.parallelism.replicaGroups``).

Cluster: 2 H100 nodes + 2 MI300X nodes in one datacenter; the job pins dp 8 x pp 2 x tp 1,
so the search fills the H100 pool (group 0: its bf16 attention runs at the causal flash rate)
and leaves the MI300X nodes idle, which ``plan_with_replica_group`` turns into group 1
(tests/planning/test_replica_groups_planner.py ``_pinned``). Launch, capacity accounting and
repairs (a node of either group lost) are driven through :func:`reconcile` like the other pure
operator tests.
"""

from __future__ import annotations

from typing import Any

import pytest
from optest_helpers import apply_decision, hetero_nodes, job_body, make_node

from hettrain.api import constants as c
from hettrain.api.spec import JobSpec
from hettrain.api.status import get_condition
from hettrain.calibration_scrape import stage_targets
from hettrain.manifests.builders import configmap_name
from hettrain.planning.calibration import StageMeasurement
from hettrain.planning.inventory import ClusterInventory
from hettrain.planning.plan import Plan
from hettrain.planning.planner import plan_job
from hettrain.planning.support import unsupported
from hettrain.reconcile import Decision, Observed, nodes_held_by_others, reconcile

PINNED = {"tp": 1, "pp": 2, "dp": 8, "schedule": "zb-h1", "replicaGroups": True}
# sequences per step: enough tokens that the idle MI300X group outweighs the host-staged
# gradient sum between the groups (planning/replica_groups.groups_grad_sum_s)
GROUP_BATCH = 2048


def _nodes() -> list[dict[str, Any]]:
    return hetero_nodes(2, 0) + [make_node(f"mi300-{i:03d}", "mi300", "MI300X", "amd", 8, "dc-a")
                                 for i in range(2)]


def _body(**policy: Any) -> dict[str, Any]:
    return job_body({"parallelism": dict(PINNED),
                     "training": {"globalBatch": GROUP_BATCH, "steps": 10},
                     "failurePolicy": {"maxRepairs": 2, "minGPUs": 8, "debounceSeconds": 2,
                                       **policy}})


class Recorder:
    """The real planner, remembering every call's ``previous`` and inventory nodes."""

    def __init__(self) -> None:
        self.calls: list[tuple[Plan | None, tuple[str, ...]]] = []

    def __call__(self, name: str, spec: JobSpec, inv: ClusterInventory,
                 prev: Plan | None) -> Plan:
        self.calls.append((prev, tuple(inv.node_names())))
        return plan_job(name, spec, inv, previous=prev)




def _running(pods: list[dict[str, Any]]) -> None:
    for p in pods:
        p["status"] = {"phase": "Running"}


def _env(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}


def _pinned_node(pod: dict[str, Any]) -> str:
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return terms[0]["matchExpressions"][0]["values"][0]


def _launch(planner: Any = None) -> tuple[dict[str, Any], Decision, list[dict[str, Any]]]:
    body = _body()
    d = reconcile(body, Observed([], _nodes(), None, now=1000.0),
                  *(() if planner is None else (planner,)))
    pods = apply_decision(body, d, [])
    _running(pods)
    return body, d, pods


def _check_pods(plan: Plan, pods: list[dict[str, Any]]) -> None:
    """One pod per planned node, each pinned to its node, carrying its ranks' group's vendor
    resource, backend and stage, its group in a label."""
    assert sorted(_pinned_node(p) for p in pods) == sorted(plan.nodes())
    for pod in pods:
        node = _pinned_node(pod)
        ranks = plan.ranks_on(node)
        env = _env(pod)
        assert int(env[c.ENV_NODE_RANK_START]) == ranks[0].rank
        assert int(env[c.ENV_LOCAL_WORLD_SIZE]) == len(ranks)
        assert int(env[c.ENV_WORLD_SIZE]) == plan.world_size
        groups = {r.group for r in ranks}
        assert len(groups) == 1  # a node hosts ranks of one group only
        group = groups.pop()
        stages = plan.groups[group].stages if plan.groups else plan.stages
        stage = stages[ranks[0].stage]
        labels = pod["metadata"]["labels"]
        assert labels[c.LABEL_STAGE] == str(ranks[0].stage)
        assert labels.get(c.LABEL_GROUP) == (str(group) if plan.groups else None)
        assert env[c.ENV_BACKEND] == stage.backend
        resources = pod["spec"]["containers"][0]["resources"]["limits"]
        assert resources == {c.VENDOR_RESOURCES[stage.vendor]: str(len(ranks))}
        assert ranks[0].pool in stage.pools


def test_launch_creates_the_grouped_plan_and_pods_on_both_groups():
    body, d, pods = _launch()
    plan = d.plan
    assert plan is not None and len(plan.groups) == 2 and unsupported(plan) == []
    g1_nodes = {r.node for r in plan.group_ranks(1)}
    assert {r.node for r in plan.group_ranks(0)} == {"h100-000", "h100-001"}
    assert g1_nodes == {"mi300-000", "mi300-001"}  # the idle pool became group 1
    cms = [o for o in d.create if o["kind"] == "ConfigMap"]
    assert [cm["metadata"]["name"] for cm in cms] == [configmap_name("job1", 1)]
    stored = Plan.from_json(cms[0]["data"][c.PLAN_CONFIGMAP_KEY])
    assert stored == plan and stored.groups == plan.groups
    assert len(pods) == 4
    _check_pods(plan, pods)
    vendors = {_pinned_node(p): next(iter(p["spec"]["containers"][0]["resources"]["limits"]))
               for p in pods}
    assert vendors == {"mi300-000": "amd.com/gpu", "mi300-001": "amd.com/gpu",
                       "h100-000": "nvidia.com/gpu", "h100-001": "nvidia.com/gpu"}
    status = body["status"]
    assert status["worldSize"] == plan.world_size == 32
    assert status["plan"]["nodes"] == list(plan.nodes())
    # the summary describes every group, not only group 0's dp / pp
    assert status["plan"]["replicaGroups"] == [
        {"group": g.index, "dp": g.dp, "pp": g.pp, "microbatchesPerReplica": g.num_microbatches,
         "tpByStage": [s.tp for s in g.stages], "cp": max(s.cp for s in g.stages),
         "pools": list(dict.fromkeys(p for s in g.stages for p in s.pools))}
        for g in plan.groups]
    assert status["plan"]["cp"] == max(s.cp for s in plan.stages)
    msg = get_condition(status, c.COND_PLANNED)["message"]
    assert "group 1" in msg and "mi300" in msg, msg


def test_the_grouped_plan_holds_group_1_nodes_against_other_jobs():
    _, d, pods = _launch()
    held = nodes_held_by_others({("ns", "job1"): pods}, ("ns", "other"))
    assert set(held) == set(d.plan.nodes())
    assert {r.node for r in d.plan.group_ranks(1)} <= set(held)
    other = job_body()
    other["metadata"].update(name="other", uid="u-2")
    spare = make_node("h100-009", "h100", "H100-SXM", "nvidia", 8, "dc-a")
    second = reconcile(other, Observed([], [*_nodes(), spare], None, now=1.0, held=held))
    assert second.plan is not None and second.plan.nodes() == ("h100-009",)
    # without the spare node the second job waits: every node is held by job1 (both groups)
    waits = reconcile(other, Observed([], _nodes(), None, now=1.0, held=held))
    assert waits.plan is None and waits.status["phase"] == c.PHASE_PENDING
    assert "held by other jobs: ns/job1" in get_condition(waits.status,
                                                          c.COND_PLANNED)["message"]


def _lose(body: dict[str, Any], plan: Plan, pods: list[dict[str, Any]],
          nodes: list[dict[str, Any]], lost: str, now: float, planner: Any,
          deleted: bool = False) -> tuple[Decision, list[dict[str, Any]], list[dict[str, Any]]]:
    """Node ``lost`` goes NotReady (or is deleted): the first pass debounces, the one after
    it repairs."""
    if deleted:
        nodes = [n for n in nodes if n["metadata"]["name"] != lost]
    else:
        nodes = [make_node(**_args(n), ready=False) if n["metadata"]["name"] == lost else n
                 for n in nodes]
    first = reconcile(body, Observed(pods, nodes, plan, now=now), planner)
    assert first.repair_cause is None and first.retry_after == 2.0
    pods = apply_decision(body, first, pods)
    assert body["status"]["phase"] == c.PHASE_REPAIRING
    rep = reconcile(body, Observed(pods, nodes, plan, now=now + 2.5), planner)
    pods = apply_decision(body, rep, pods)
    return rep, pods, nodes


def _args(node: dict[str, Any]) -> dict[str, Any]:
    labels = node["metadata"]["labels"]
    vendor = labels[c.LABEL_VENDOR]
    return {"name": node["metadata"]["name"], "pool": labels[c.LABEL_POOL],
            "device": labels[c.LABEL_DEVICE], "vendor": vendor,
            "gpus": int(node["status"]["allocatable"][c.VENDOR_RESOURCES[vendor]]),
            "dc": labels[c.LABEL_REGION]}


@pytest.mark.parametrize(("group", "deleted"), [(1, False), (1, True), (0, False), (0, True)])
def test_a_lost_node_of_either_group_replans_from_the_grouped_plan(group, deleted):
    planner = Recorder()
    body, d, pods = _launch(planner)
    grouped = d.plan
    lost = grouped.group_ranks(group)[-1].node
    rep, pods, _ = _lose(body, grouped, pods, _nodes(), lost, 1010.0, planner, deleted)
    assert rep.repair_cause == c.REASON_NODE_LOST and rep.plan is not None
    prev, inv_nodes = planner.calls[-1]
    assert prev is grouped and lost not in inv_nodes
    new = rep.plan
    assert unsupported(new) == [] and lost not in new.nodes()
    assert new.global_batch == grouped.global_batch
    assert ("Pod", f"job1-a1-r{grouped.ranks_on(lost)[0].rank}") in rep.delete
    assert ("ConfigMap", configmap_name("job1", 1)) in rep.delete
    assert {p["metadata"]["labels"][c.LABEL_ATTEMPT] for p in pods} == {"2"}
    _check_pods(new, pods)
    assert all(_env(p)[c.ENV_RESUME] == "1" for p in pods)
    status = body["status"]
    assert status["attempt"] == 2 and status["failedNodes"] == [lost]
    assert status["repairs"]["count"] == 1
    assert status["repairs"]["history"][-1] == {
        **status["repairs"]["history"][-1], "nodes": [lost], "fromWorldSize": 32,
        "toWorldSize": new.world_size}
    if group == 1:  # the other MI300X node still forms a (smaller) extra group
        assert len(new.groups) == 2 and {r.node for r in new.group_ranks(1)} == {
            n for n in ("mi300-000", "mi300-001") if n != lost}


def test_repairs_of_a_grouped_job_count_against_max_repairs():
    planner = Recorder()
    body, d, pods = _launch(planner)
    nodes = _nodes()
    plan, now = d.plan, 1010.0
    for i in range(2):  # a group-1 node, then a node of the re-planned job's group 0
        lost = plan.group_ranks(1 - i if plan.groups else 0)[0].node
        rep, pods, nodes = _lose(body, plan, pods, nodes, lost, now, planner)
        assert rep.plan is not None and unsupported(rep.plan) == []
        assert planner.calls[-1][0] is plan and lost not in rep.plan.nodes()
        _running(pods)
        plan, now = rep.plan, now + 10.0
        assert body["status"]["repairs"]["count"] == i + 1
    assert len(body["status"]["failedNodes"]) == 2
    lost = plan.nodes()[0]
    nodes = [make_node(**_args(n), ready=False) if n["metadata"]["name"] == lost else n
             for n in nodes]
    apply_decision(body, reconcile(body, Observed(pods, nodes, plan, now=now), planner), pods)
    out = reconcile(body, Observed(pods, nodes, plan, now=now + 2.5), planner)
    apply_decision(body, out, pods)
    assert body["status"]["phase"] == c.PHASE_FAILED
    assert get_condition(body["status"], c.COND_FAILED)["reason"] == c.REASON_MAX_REPAIRS


def test_calibration_scrapes_every_groups_stage_ranks():
    """Calibration reads the first rank of every stage of both groups, keyed by (group,
    stage): a group-1 rank, whose stage index is one of its own pipeline on other devices,
    never stands in for a group-0 stage whose pod has no IP yet."""
    _, d, pods = _launch()
    plan = d.plan
    ips = {_pinned_node(p): f"10.0.0.{i + 1}" for i, p in enumerate(pods)}
    for p in pods:
        p["status"] = {"phase": "Running", "podIP": ips[_pinned_node(p)]}
    want = {}
    for r in plan.ranks:  # reference: every (group, stage)'s first rank
        if (r.group, r.stage) not in want:
            first = plan.ranks_on(r.node)[0].rank
            want[(r.group, r.stage)] = f"http://{ips[r.node]}:{9400 + r.rank - first}/metrics"
    assert stage_targets(plan, pods) == want
    assert sorted(want) == [(g.index, s) for g in plan.groups for s in range(g.pp)]
    stage0 = plan.group_ranks(0)[0].node
    assert (1, 0) in want  # a would-be stand-in
    no_ip = [{**p, "status": {"phase": "Running"}} if _pinned_node(p) == stage0 else p
             for p in pods]
    got = stage_targets(plan, no_ip)
    assert (0, 0) not in got and got == {k: u for k, u in want.items() if k != (0, 0)}


@pytest.mark.parametrize("slow_group", [None, 0, 1])
def test_calibration_of_a_grouped_plan_compares_every_stage(slow_group):
    """Every stage of both groups is measured and compared, and both devices refined.
    Measurements equal to the prediction keep the plan (the current step under the corrected
    model is the predicted one); a group measured twice as slow as modelled makes the current
    layout slower (same batch split, ``replica_groups.grouped_step_s``), and re-plans when
    the corrected model finds a plan faster by more than the threshold."""
    body, d, pods = _launch()
    plan = d.plan
    body["spec"]["calibration"] = {"enabled": True, "minSteps": 3}
    body["status"]["phase"] = c.PHASE_RUNNING
    reports = [StageMeasurement(s.index, s.time_ms / 1e3 * (2.0 if g.index == slow_group
                                                            else 1.0), 0.001, 5, 10, 5,
                                group=g.index)
               for g in plan.groups for s in g.stages]
    out = reconcile(body, Observed(pods, _nodes(), plan, now=1100.0, stage_reports=reports))
    cal = out.status["calibration"]
    assert [(r["group"], r["stage"], r["device"]) for r in cal["stages"]] == [
        (g.index, s.index, s.device) for g in plan.groups for s in g.stages]
    assert [r["ratio"] for r in cal["stages"]] == [
        pytest.approx(2.0 if g.index == slow_group else 1.0) for g in plan.groups
        for _ in g.stages]
    assert [r["device"] for r in cal["refined"]] == ["H100-SXM", "MI300X"]
    calibrated = next(e.message for e in out.events if e.reason == c.REASON_CALIBRATED)
    assert "group 1 stage 0 (MI300X)" in calibrated, calibrated
    current, best = cal["currentStepSeconds"], cal["bestStepSeconds"]
    if slow_group is None:
        assert current == pytest.approx(plan.predicted.step_time_s, rel=1e-6)
        assert current == pytest.approx(best, rel=1e-6) and not cal["pendingReplan"]
    else:
        assert current > plan.predicted.step_time_s * 1.05
        # the corrected model moves microbatches (or layers) off the slow group: > 10% faster
        assert best < current * 0.9 and cal["pendingReplan"]
