"""Shared-cluster rules of the pure reconcile and builders: ownership by uid, other workloads'
GPUs, nodeSelector, priorityClassName allow-list, Unschedulable gang pods, repairs waiting
for capacity, Pod Security "restricted", the per-job NetworkPolicy, names for any legal job
name, and the Event limiter."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
from optest_helpers import apply_decision, hetero_nodes, job_body, make_node

from hettrain.api import constants as c
from hettrain.api.status import get_condition
from hettrain.eventlimit import EventLimiter
from hettrain.manifests.builders import (
    COLLECTIVE_PORT_RANGE,
    JobRef,
    build_network_policy,
    build_service,
    configmap_name,
    network_policy_name,
    service_name,
)
from hettrain.manifests.ownership import controller_job, owned_by
from hettrain.planning.planner import plan_job
from hettrain.reconcile import (
    CAUSE_UNSCHEDULABLE,
    Decision,
    Observed,
    reconcile,
    without_foreign_gpus,
)

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")




def _pods(d: Decision) -> list[dict[str, Any]]:
    return [o for o in d.create if o["kind"] == "Pod"]


def test_a_foreign_pod_with_the_jobs_label_is_never_adopted_or_deleted() -> None:
    nodes = hetero_nodes()
    body = job_body()
    d = reconcile(body, Observed([], nodes, None, now=1.0))
    pods = apply_decision(body, d, [])
    squatter = copy.deepcopy(pods[0])
    squatter["metadata"].update(name="squatter", ownerReferences=[])
    squatter["metadata"]["labels"][c.LABEL_ATTEMPT] = "7"  # looks stale: would be deleted
    forged = copy.deepcopy(pods[1])
    forged["metadata"]["name"] = "forged"
    forged["metadata"]["ownerReferences"][0]["uid"] = "someone-else"
    for p in pods:
        p["status"] = {"phase": "Running"}
    out = reconcile(body, Observed([*pods, squatter, forged], nodes, d.plan, now=2.0))
    deleted = {n for _, n in out.delete}
    assert "squatter" not in deleted and "forged" not in deleted
    assert out.status["phase"] == c.PHASE_RUNNING  # counted only its own pods
    assert controller_job(pods[0]) == ("job1", "u-1") and owned_by(pods[0], "u-1")
    assert not owned_by(squatter, "u-1") and not owned_by(forged, "u-1")
    assert not owned_by(pods[0], "")


def test_other_workloads_gpus_are_taken_off_the_nodes_capacity() -> None:
    nodes = hetero_nodes(2, 2)
    used = {"h100-000": {"nvidia.com/gpu": 8}, "mi300-000": {"amd.com/gpu": 3}}
    part = reconcile(job_body(), Observed([], nodes, None, now=1.0, foreign_gpus=used))
    assert part.plan is not None and "h100-000" not in part.plan.nodes()  # fully used
    inv = Observed([], nodes, foreign_gpus=used).inventory()
    assert inv.gpus == 32 - 8 - 3
    assert "h100-000" not in inv.node_names()
    node = next(n for n in nodes if n["metadata"]["name"] == "mi300-000")
    assert without_foreign_gpus(node, used)["status"]["allocatable"]["amd.com/gpu"] == "5"
    assert node["status"]["allocatable"]["amd.com/gpu"] == "8"  # not mutated




def test_node_selector_is_honoured_and_a_selector_matching_nothing_fails_naming_it() -> None:
    nodes = hetero_nodes(2, 2)
    body = job_body({"placement": {"nodeSelector": {c.LABEL_POOL: "mi300"}}})
    d = reconcile(body, Observed([], nodes, None, now=1.0))
    assert d.plan is not None and set(d.plan.pools) == {"mi300"}
    bad = job_body({"placement": {"nodeSelector": {c.LABEL_POOL: "no-such-pool"}}})
    out = reconcile(bad, Observed([], nodes, None, now=1.0))
    assert out.status["phase"] == c.PHASE_FAILED and _pods(out) == []
    cond = get_condition(out.status, c.COND_PLANNED)
    assert cond["reason"] == c.REASON_PLAN_FAILED
    assert "spec.placement.nodeSelector" in cond["message"]


def test_priority_class_must_be_on_the_allow_list() -> None:
    nodes = hetero_nodes()
    body = job_body({"priorityClassName": "system-node-critical"})
    out = reconcile(body, Observed([], nodes, None, now=1.0, priority_classes=("batch",)))
    assert out.status["phase"] == c.PHASE_FAILED and _pods(out) == []
    cond = get_condition(out.status, c.COND_PLANNED)
    assert cond["reason"] == c.REASON_INVALID_SPEC
    assert cond["message"].startswith("spec.priorityClassName:") and "batch" in cond["message"]
    ok = reconcile(job_body({"priorityClassName": "batch"}),
                   Observed([], nodes, None, now=1.0, priority_classes=("batch",)))
    assert {p["spec"]["priorityClassName"] for p in _pods(ok)} == {"batch"}


def test_image_with_blanks_is_invalid_spec() -> None:
    out = reconcile(job_body({"image": " "}), Observed([], hetero_nodes(), None, now=1.0))
    cond = get_condition(out.status, c.COND_PLANNED)
    assert cond["reason"] == c.REASON_INVALID_SPEC and cond["message"].startswith("spec.image:")


def _unschedulable(pod: dict[str, Any], since: str) -> None:
    pod["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "lastTransitionTime": since}]}


def test_unschedulable_gang_pod_past_the_timeout_replans_without_its_node() -> None:
    nodes = hetero_nodes(3, 3)
    body = job_body({"failurePolicy": {"maxRepairs": 2, "minGPUs": 8, "debounceSeconds": 0}})
    d = reconcile(body, Observed([], nodes, None, now=1000.0))
    pods = apply_decision(body, d, [])
    for p in pods[1:]:
        p["status"] = {"phase": "Running"}
    _unschedulable(pods[0], "1970-01-01T00:16:40Z")  # at 1000 s
    node = pods[0]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"][0]["values"][0]
    early = reconcile(body, Observed(pods, nodes, d.plan, now=1050.0, unschedulable_seconds=120))
    assert early.repair_cause is None and not early.create
    # the pass comes back when the timeout runs out (1120 s), not at the next resync
    assert early.retry_after == pytest.approx(70.1)
    late = reconcile(body, Observed(pods, nodes, d.plan, now=1200.0, unschedulable_seconds=120))
    assert late.repair_cause == CAUSE_UNSCHEDULABLE and late.plan is not None
    assert node not in late.plan.nodes()
    assert node not in late.status["failedNodes"]  # the node is fine, just not free


def test_an_unschedulable_repair_that_waits_for_capacity_still_skips_its_node() -> None:
    """Regression (live chaos/Unschedulable test): an Unschedulable repair that finds no room
    drops the plan and waits; the relaunch must still leave out the node the pod could not
    be scheduled on (it is not in failedNodes), else it lands there again, counts a repair
    and loops."""
    nodes = hetero_nodes(2, 0)
    pins = {"parallelism": {"tp": 8, "pp": 2, "dp": 1},
            "failurePolicy": {"maxRepairs": 1, "minGPUs": 8, "debounceSeconds": 0}}
    body = job_body(pins)
    d = reconcile(body, Observed([], nodes, None, now=1000.0))
    pods = apply_decision(body, d, [])
    assert sorted(d.plan.nodes()) == ["h100-000", "h100-001"]
    pods[0]["status"] = {"phase": "Running"}
    _unschedulable(pods[1], "1970-01-01T00:16:40Z")
    bad = pods[1]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"][0]["values"][0]
    plan = d.plan
    for step in range(3):  # no room without the bad node: the repair waits, uncounted
        out = reconcile(body, Observed(pods, nodes, plan, now=1200.0 + step,
                                       unschedulable_seconds=120))
        pods = apply_decision(body, out, pods)
        if out.status.get("plan", "kept") is None:
            plan = None
        assert out.plan is None and out.repair_cause is None, out.plan and out.plan.nodes()
        assert body["status"]["phase"] == c.PHASE_REPAIRING
        assert not (body["status"].get("repairs") or {}).get("count")
    assert pods == [] and plan is None
    assert bad not in (body["status"].get("failedNodes") or [])
    extra = make_node("h100-002", "h100", "H100-SXM", "nvidia", 8, "dc-a")
    out = reconcile(body, Observed(pods, [*nodes, extra], None, now=1210.0))
    assert out.plan is not None and bad not in out.plan.nodes()
    assert sorted(out.plan.nodes()) == sorted({"h100-000", "h100-001", "h100-002"} - {bad})
    assert out.repair_cause == CAUSE_UNSCHEDULABLE
    apply_decision(body, out, pods)
    assert body["status"]["repairs"]["count"] == 1
    assert body["status"]["repairs"]["history"][-1]["nodes"] == [bad]


def test_a_repair_cut_short_by_a_crash_still_leaves_out_and_records_the_failed_node() -> None:
    """Regression (chaos: operator SIGKILLed between the repair's deletes and its status
    patch): the gang and the old plan ConfigMap are gone, the status still holds the
    debounce pass's failureCause/failureNodes. The restarted operator finds no plan and
    re-plans a new attempt: it must leave the failed node out and record it in
    failedNodes, as the uninterrupted repair would have."""
    nodes = hetero_nodes(3, 0)
    body = job_body({"parallelism": {"tp": 8, "pp": 1, "dp": 1},
                     "failurePolicy": {"maxRepairs": 3, "minGPUs": 8, "debounceSeconds": 2}})
    d = reconcile(body, Observed([], nodes, None, now=1000.0))
    pods = apply_decision(body, d, [])
    bad = d.plan.nodes()[0]
    pods[0]["status"] = {"phase": "Failed"}
    first = reconcile(body, Observed(pods, nodes, d.plan, now=1001.0))  # debounce pass
    assert first.status["failureNodes"] == [bad] and first.retry_after
    apply_decision(body, first, pods)
    # the repair pass deleted the pods and the ConfigMap, then the operator died
    out = reconcile(body, Observed([], nodes, None, now=1004.0))
    assert out.plan is not None and bad not in out.plan.nodes()
    assert out.repair_cause == c.REASON_POD_FAILED
    assert out.status["failedNodes"] == [bad]
    assert out.status["repairs"]["count"] == 1 and out.status["attempt"] == 2


def test_a_new_job_whose_pins_need_more_gpus_than_are_usable_now_waits() -> None:
    """Regression (live, a node deleted or NotReady while a job is created): pins needing
    two nodes with one usable must wait Pending/InsufficientCapacity, not fail for good
    (the planner's "model does not fit" was recorded as PlanFailed); it launches when a
    node joins. A model too big for any layout still fails."""
    body = job_body({"parallelism": {"tp": 8, "pp": 2, "dp": 1}})
    out = reconcile(body, Observed([], hetero_nodes(1, 0), None, now=1.0))
    assert out.status["phase"] == c.PHASE_PENDING and _pods(out) == []
    cond = get_condition(out.status, c.COND_PLANNED)
    assert cond["reason"] == c.REASON_INSUFFICIENT_CAPACITY
    assert "tp×pp×dp = 16 GPUs; 8 are usable" in cond["message"]
    assert out.retry_after and not out.status.get("completionTime")
    apply_decision(body, out, [])
    later = reconcile(body, Observed([], hetero_nodes(2, 0), None, now=20.0))
    assert later.plan is not None and later.plan.world_size == 16
    assert later.status["phase"] == c.PHASE_LAUNCHING and later.status["attempt"] == 1
    # only the pools spec.placement allows count
    mi300_only = job_body({"parallelism": {"tp": 8, "pp": 2, "dp": 1},
                           "placement": {"pools": ["mi300"]}})
    out = reconcile(mi300_only, Observed([], hetero_nodes(2, 1), None, now=1.0))
    assert out.status["phase"] == c.PHASE_PENDING and _pods(out) == []
    big = reconcile(job_body({"model": {"preset": "llama3-405b"},
                              "failurePolicy": {"minGPUs": 1}}),
                    Observed([], hetero_nodes(1, 0), None, now=1.0))
    assert big.status["phase"] == c.PHASE_FAILED
    assert get_condition(big.status, c.COND_PLANNED)["reason"] == c.REASON_PLAN_FAILED


def test_a_repair_waiting_for_capacity_does_not_use_up_max_repairs() -> None:
    nodes = hetero_nodes(1, 0)
    body = job_body({"failurePolicy": {"maxRepairs": 1, "minGPUs": 8, "debounceSeconds": 0}})
    d = reconcile(body, Observed([], nodes, None, now=1000.0))
    pods = apply_decision(body, d, [])
    assert d.plan.world_size == 8
    for p in pods:
        p["status"] = {"phase": "Running"}
    lost = d.plan.nodes()[0]
    survivors = [n for n in nodes if n["metadata"]["name"] != lost]
    plan = d.plan
    for step in range(5):  # many passes while no capacity: no repair is counted
        out = reconcile(body, Observed(pods, survivors, plan, now=1001.0 + step))
        pods = apply_decision(body, out, pods)
        if out.status.get("plan", "kept") is None:
            plan = None
        assert out.plan is None and out.repair_cause is None
        assert int((body["status"].get("repairs") or {}).get("count") or 0) == 0
        assert body["status"]["phase"] == c.PHASE_REPAIRING
    assert pods == [] and plan is None
    cond = get_condition(body["status"], c.COND_REPAIRING)
    assert cond["reason"] == c.REASON_INSUFFICIENT_CAPACITY
    # a replacement node joins: the repair relaunches and counts once
    extra = hetero_nodes(2, 0)[1]
    out = reconcile(body, Observed(pods, [*survivors, extra], None, now=1010.0))
    assert out.plan is not None and lost not in out.plan.nodes()
    assert out.repair_cause == c.REASON_NODE_LOST
    apply_decision(body, out, pods)
    assert body["status"]["repairs"]["count"] == 1 and body["status"]["restarts"] == 1
    assert body["status"]["repairs"]["history"][-1]["toWorldSize"] == 8
    assert body["status"]["attempt"] == 2 and body["status"]["failureCause"] is None


def test_training_pods_meet_pod_security_restricted_and_mount_no_token() -> None:
    d = reconcile(job_body(), Observed([], hetero_nodes(), None, now=1.0))
    lo, hi = COLLECTIVE_PORT_RANGE
    for pod in _pods(d):
        spec = pod["spec"]
        assert spec["automountServiceAccountToken"] is False
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["seccompProfile"]["type"] == "RuntimeDefault"
        assert {"name": "net.ipv4.ip_local_port_range", "value": f"{lo} {hi}"} in psc["sysctls"]
        for ctr in spec["containers"]:
            sc = ctr["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {
                "drop": ["ALL"]}
            assert not sc.get("privileged")
            env = {e["name"]: e["value"] for e in ctr["env"]}
            assert env["HETTRAIN_COLLECTIVE_PORTS"] == f"{lo}-{hi}"
        assert not any(v.get("hostPath") for v in spec["volumes"])


def test_network_policy_admits_only_the_jobs_pods_and_the_scraper() -> None:
    job = JobRef("job1", "ns", "u-1")
    np = build_network_policy(job, "prom")
    me = {c.LABEL_JOB: "job1"}
    assert np["spec"]["podSelector"] == {"matchLabels": me}
    peers, scrape = np["spec"]["ingress"]
    assert peers["from"] == [{"podSelector": {"matchLabels": me}}]
    ports = {(p["port"], p.get("endPort")) for p in peers["ports"]}
    assert ports == {(c.DEFAULT_MASTER_PORT, None), COLLECTIVE_PORT_RANGE}
    assert scrape["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "prom"}
    assert owned_by(np, "u-1")


@pytest.mark.parametrize("length", [63, 64, 200, 253])
def test_child_names_and_labels_are_valid_for_any_legal_job_name(length: int) -> None:
    name = ("a" + "b.c-d" * 60)[:length - 1] + "z"
    other = name[:-1] + "y"
    body = job_body()
    body["metadata"]["name"] = name
    d = reconcile(body, Observed([], hetero_nodes(), None, now=1.0))
    assert d.plan is not None
    names = set()
    for obj in d.create:
        meta = obj["metadata"]
        limit = 63 if obj["kind"] in ("Pod", "Service") else 253
        assert len(meta["name"]) <= limit and meta["name"] == meta["name"].lower()
        if obj["kind"] in ("Pod", "Service"):
            assert DNS_LABEL.fullmatch(meta["name"]), meta["name"]
        for value in meta["labels"].values():
            assert len(value) <= 63 and LABEL_VALUE.fullmatch(value), value
        names.add(meta["name"])
        if obj["kind"] == "Pod":
            assert len(obj["spec"]["hostname"]) <= 63 and len(obj["spec"]["subdomain"]) <= 63
    assert len(names) == len(d.create)
    job, twin = JobRef(name, "ns", "u"), JobRef(other, "ns", "u")
    assert service_name(name) != service_name(other)
    assert configmap_name(name, 1) != configmap_name(other, 1)
    assert network_policy_name(name) != network_policy_name(other)
    assert build_service(job)["spec"]["selector"] != build_service(twin)["spec"]["selector"]


def test_event_limiter_posts_once_then_aggregates() -> None:
    lim = EventLimiter(interval_s=60)
    key = ("ns", "j")
    assert lim.admit(key, "Warning", "InsufficientCapacity", "no room", 0.0) == "no room"
    assert all(lim.admit(key, "Warning", "InsufficientCapacity", "no room", t) is None
               for t in range(1, 60, 5))
    assert lim.admit(key, "Normal", "PlanFound", "ok", 2.0) == "ok"  # another reason
    assert lim.admit(key, "Warning", "InsufficientCapacity", "other", 3.0) == "other"
    again = lim.admit(key, "Warning", "InsufficientCapacity", "no room", 61.0)
    assert again == "no room (repeated 13 times in the last 60s)"
    lim.forget(key)
    assert lim.admit(key, "Warning", "InsufficientCapacity", "x", 62.0) == "x"


def test_planning_inventory_is_what_the_planner_sees() -> None:
    """The selector/foreign-GPU inventory is a real planner input (same plan as by hand)."""
    nodes = hetero_nodes(2, 2)
    obs = Observed([], nodes, None, now=1.0)
    inv = obs.inventory({c.LABEL_POOL: "h100"})
    body = job_body()
    from hettrain.api.spec import parse_job_spec
    spec = parse_job_spec(body["spec"])
    assert set(plan_job("job1", spec, inv).pools) == {"h100"}
