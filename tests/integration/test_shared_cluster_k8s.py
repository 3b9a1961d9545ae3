"""The operator on a shared cluster, against the real control plane: squatters and foreign
objects, other workloads' GPUs, restricted namespaces and 253-character names, refused spec
fields, the planning budget, restart mid-launch without double booking, and a gang pod the
real scheduler cannot place (Unschedulable) re-planned without its node.

Run one at a time: ``pytest tests/integration/test_shared_cluster_k8s.py -m k8s -q``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from e2e.cluster import kwoknodes
from e2e.cluster.pytest_plugin import K8sCluster
from kubernetes import client as k8s
from opproc import CRD, OperatorProcess, http_get
from test_operator_k8s import Ctx, _affinity_node, _job, _metrics, _prefix, _sample

from hettrain.api import constants as c
from hettrain.kube import apply as kube
from hettrain.manifests.builders import configmap_name, job_label, network_policy_name
from hettrain.reconcile import CAUSE_UNSCHEDULABLE

pytestmark = pytest.mark.k8s

OPERATOR_ENV = {"HETTRAIN_ALLOWED_PRIORITY_CLASSES": "batch",
                "HETTRAIN_UNSCHEDULABLE_SECONDS": "4",
                "HETTRAIN_EVENT_INTERVAL_SECONDS": "60"}


@pytest.fixture(scope="module")
def operator(k8s_cluster: K8sCluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    """CRD applied; one operator subprocess for the module (shared-cluster settings)."""
    k8s_cluster.kubectl("apply", "--server-side", "-f", str(CRD))
    k8s_cluster.kubectl("wait", "--for=condition=Established", "--timeout=30s",
                        "crd/hettrainingjobs.hettrain.dev")
    op = OperatorProcess(k8s_cluster.kubeconfig,
                         tmp_path_factory.mktemp("operator") / "operator.log", env=OPERATOR_ENV)
    op.start()
    try:
        yield op
    finally:
        op.stop()


@pytest.fixture
def ctx(k8s_cluster: K8sCluster, namespace: str, operator: OperatorProcess, kwok_nodes: Any
        ) -> Iterator[Ctx]:
    """Per test: its namespace and kwok nodes; its jobs deleted (and gone) afterwards."""
    context = Ctx(k8s_cluster, namespace, operator)

    def nodes(cluster: dict[str, Any]) -> list[str]:
        names = kwok_nodes(cluster)
        context.wait(lambda: all(not kwoknodes.node_taints(context.api, n) for n in names), 60,
                     "new nodes untainted", interval=0.2)
        return names

    context.nodes = nodes
    yield context
    if operator.proc is None or operator.proc.poll() is not None:
        operator.start()
    context.custom.delete_collection_namespaced_custom_object(c.GROUP, c.VERSION, namespace,
                                                              c.PLURAL)
    context.wait(lambda: not context.custom.list_namespaced_custom_object(
        c.GROUP, c.VERSION, namespace, c.PLURAL)["items"], 60, "jobs deleted")


def _pool(prefix: str, nodes: int, gpus: int = 8) -> dict[str, Any]:
    return {"apiVersion": c.API_VERSION, "kind": "Cluster", "metadata": {"name": prefix},
            "datacenters": [{"name": "dc-a"}],
            "pools": [{"name": f"{prefix}-h100", "datacenter": "dc-a", "device": "H100-SXM",
                       "vendor": "nvidia", "nodes": nodes, "gpusPerNode": gpus}]}


def _one_pool_job(name: str, prefix: str, **spec: Any) -> dict[str, Any]:
    doc = _job(name, prefix, **spec)
    doc["spec"]["placement"] = {"pools": [f"{prefix}-h100"], **spec.get("placement", {})}
    return doc


def _pods_of(ctx: Ctx, job: str) -> list[Any]:
    """The job's own live pods (controller ownerReference; squatters carry the label too)."""
    return [p for p in ctx.core.list_namespaced_pod(
        ctx.ns, label_selector=f"{c.LABEL_JOB}={job_label(job)}").items
        if p.metadata.deletion_timestamp is None and p.metadata.owner_references
        and p.metadata.owner_references[0].kind == c.KIND]


def _cond(st: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((x for x in st.get("conditions") or () if x["type"] == ctype), {})


def _running(ctx: Ctx, name: str, timeout: float = 90.0) -> tuple[dict[str, Any], list[Any]]:
    def ready() -> Any:
        st = ctx.status(name)
        if st.get("phase") != c.PHASE_RUNNING or not st.get("plan"):
            return None
        pods = _pods_of(ctx, name)
        if len(pods) == len(st["plan"]["nodes"]) and all(
                p.status.phase == "Running"
                and p.metadata.labels[c.LABEL_ATTEMPT] == str(st["attempt"]) for p in pods):
            return st, pods
        return None
    return ctx.wait(ready, timeout, f"job {name} Running with all pods")


def _failed(ctx: Ctx, name: str, timeout: float = 60.0) -> dict[str, Any]:
    return ctx.wait(lambda: (st := ctx.status(name)).get("phase") == c.PHASE_FAILED and st,
                    timeout, f"job {name} Failed")


# ---------------------------------------------------------------- ownership and capacity


def test_squatters_foreign_objects_and_other_workloads_are_respected(ctx: Ctx) -> None:
    """A Pending pod carrying the job label pinned to node0 holds nothing and is left alone;
    a foreign ConfigMap named like the first plan is never merged into or deleted; a
    non-hettrain pod using all GPUs of node1 keeps the job off node1."""
    prefix = _prefix()
    n0, n1, n2 = ctx.nodes(_pool(prefix, nodes=3))
    squatter = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "squatter", "labels": {c.LABEL_JOB: "victim", c.LABEL_ATTEMPT: "1"}},
        "spec": {"containers": [{"name": "x", "image": "busybox",
                                 "resources": {"requests": {"cpu": "100000"}}}],
                 "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                     "nodeSelectorTerms": [{"matchExpressions": [
                         {"key": c.LABEL_HOSTNAME, "operator": "In", "values": [n0]}]}]}}},
                 "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists"}]}}
    hog = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gpu-hog"},
           "spec": {"nodeName": n1, "containers": [{
               "name": "x", "image": "busybox",
               "resources": {"requests": {"nvidia.com/gpu": "8"},
                             "limits": {"nvidia.com/gpu": "8"}}}],
               "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists"}]}}
    foreign_cm = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": configmap_name("victim", 1)}, "data": {"mine": "yes"}}
    ctx.core.create_namespaced_pod(ctx.ns, squatter)
    ctx.core.create_namespaced_pod(ctx.ns, hog)
    ctx.core.create_namespaced_config_map(ctx.ns, foreign_cm)
    ctx.wait(lambda: ctx.core.read_namespaced_pod("gpu-hog", ctx.ns).status.phase == "Running",
             60, "the GPU hog running")
    ctx.create(_one_pool_job("victim", prefix))
    st, pods = _running(ctx, "victim")
    nodes = {p.spec.node_name for p in pods}
    assert n1 not in nodes, "planned onto the node another workload's GPUs fill"
    assert nodes == {n0, n2}, "the squatter's label made node0 unavailable"
    assert st["attempt"] == 2  # the foreign ConfigMap blocked attempt 1's plan
    cm = ctx.core.read_namespaced_config_map(configmap_name("victim", 1), ctx.ns)
    assert cm.data == {"mine": "yes"} and not cm.metadata.owner_references
    assert ctx.core.read_namespaced_pod("squatter", ctx.ns).metadata.deletion_timestamp is None
    reasons = Counter(e.reason for e in ctx.events("victim"))
    assert reasons["ForeignObject"] == 1, reasons  # rate-limited: one, not one per retry


def test_long_name_in_a_restricted_namespace_gets_hardened_pods_and_a_network_policy(
        ctx: Ctx) -> None:
    """A 253-character job launches in a namespace enforcing Pod Security "restricted": pods
    admitted, no ServiceAccount token, valid names/labels, and its NetworkPolicy."""
    ctx.core.patch_namespace(ctx.ns, {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest"}}})
    prefix = _prefix()
    ctx.nodes(_pool(prefix, nodes=2))
    name = ("long-" + "x" * 300)[:252] + "z"
    assert len(name) == 253
    ctx.create(_one_pool_job(name, prefix))
    st, pods = _running(ctx, name)
    assert st["attempt"] == 1 and st.get("restarts", 0) == 0
    for pod in pods:
        assert len(pod.metadata.name) <= 63
        assert pod.spec.automount_service_account_token is False
        assert not any(v.projected for v in pod.spec.volumes or ())  # no token volume
        assert pod.spec.security_context.run_as_non_root is True
        assert pod.spec.containers[0].security_context.capabilities.drop == ["ALL"]
    np_ = k8s.NetworkingV1Api(ctx.api).read_namespaced_network_policy(
        network_policy_name(name), ctx.ns)
    assert np_.spec.pod_selector.match_labels == {c.LABEL_JOB: job_label(name)}
    assert np_.metadata.owner_references[0].uid == ctx.get(name)["metadata"]["uid"]
    # the same pod, as a bare client would send it without the hardening, is forbidden
    bare = ctx.core.read_namespaced_pod(pods[0].metadata.name, ctx.ns).to_dict()
    with pytest.raises(k8s.ApiException) as err:
        ctx.core.create_namespaced_pod(ctx.ns, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bare"},
            "spec": {"containers": [{"name": "t", "image": bare["spec"]["containers"][0][
                "image"]}]}})
    assert err.value.status == 403 and "restricted" in str(err.value.body)


@pytest.mark.parametrize(("spec", "field", "reason"), [
    ({"placement": {"nodeSelector": {c.LABEL_POOL: "no-such-pool"}}},
     "spec.placement.nodeSelector", c.REASON_PLAN_FAILED),
    ({"priorityClassName": "system-node-critical"}, "spec.priorityClassName",
     c.REASON_INVALID_SPEC),
    ({"image": " "}, "spec.image", c.REASON_INVALID_SPEC),
])
def test_spec_fields_are_honoured_or_refused_naming_the_field(
        ctx: Ctx, spec: dict[str, Any], field: str, reason: str) -> None:
    prefix = _prefix()
    ctx.nodes(_pool(prefix, nodes=1))
    doc = _one_pool_job("refused", prefix)
    doc["spec"].update(spec)
    ctx.create(doc)
    st = _failed(ctx, "refused")
    cond = _cond(st, c.COND_PLANNED)
    assert cond["reason"] == reason and field in cond["message"], cond
    assert _pods_of(ctx, "refused") == []


def test_planning_over_its_budget_fails_the_job_and_the_operator_stays_healthy(
        ctx: Ctx) -> None:
    prefix = _prefix()
    ctx.nodes(_pool(prefix, nodes=1))
    ctx.op.restart(env={"HETTRAIN_PLAN_TIMEOUT_SECONDS": "0.001"})
    try:
        ctx.create(_one_pool_job("slow", prefix))
        st = _failed(ctx, "slow")
        cond = _cond(st, c.COND_PLANNED)
        assert cond["reason"] == c.REASON_PLAN_FAILED
        assert "HETTRAIN_PLAN_TIMEOUT_SECONDS" in cond["message"], cond
        assert _pods_of(ctx, "slow") == []
        time.sleep(11)  # kopf caches probe results for 10 s
        status, body = http_get(ctx.op.health_url)
        assert status == 200 and '"planning": "ok"' in body.replace("'", '"'), body
    finally:
        ctx.op.restart()


def test_restart_mid_launch_keeps_the_nodes_booked(ctx: Ctx) -> None:
    """Job A's status records its plan but its pods are gone (operator killed between the
    write-ahead status and the pods); job B, created meanwhile, must not get A's nodes."""
    prefix = _prefix()
    ctx.nodes(_pool(prefix, nodes=2))
    ctx.create(_one_pool_job("a", prefix))
    st, pods = _running(ctx, "a")
    a_nodes = set(st["plan"]["nodes"])
    ctx.op.kill()
    for p in pods:
        ctx.core.delete_namespaced_pod(p.metadata.name, ctx.ns, grace_period_seconds=0)
    ctx.wait(lambda: not ctx.pods("a"), 30, "a's pods gone")
    ctx.custom.patch_namespaced_custom_object_status(
        c.GROUP, c.VERSION, ctx.ns, c.PLURAL, "a", {"status": {"phase": c.PHASE_LAUNCHING}})
    ctx.create(_one_pool_job("b", prefix))
    ctx.op.start()
    st_a, pods_a = _running(ctx, "a")
    assert st_a["attempt"] == st["attempt"] and {p.spec.node_name for p in pods_a} == a_nodes
    st_b = ctx.wait(lambda: (x := ctx.status("b")).get("phase") == c.PHASE_PENDING and x, 30,
                    "b Pending")
    assert f"{ctx.ns}/a" in _cond(st_b, c.COND_PLANNED)["message"]
    time.sleep(2)
    assert _pods_of(ctx, "b") == []


# ---------------------------------------------------------------- Unschedulable gang pods


def _scheduled_condition(pod: Any) -> Any:
    return next((x for x in pod.status.conditions or () if x.type == "PodScheduled"), None)


def test_a_gang_pod_the_scheduler_cannot_place_is_replanned_without_its_node(ctx: Ctx) -> None:
    """Node B has 8 free GPUs (what the planner sees) but no free pod slot (allocatable
    pods 1, taken by another workload's pod), so the real kube-scheduler leaves the gang pod
    pinned there Pending with PodScheduled=False/Unschedulable. Past
    HETTRAIN_UNSCHEDULABLE_SECONDS (4 s) the gang is re-planned without B. No other node
    has room yet: the repair waits, torn down and uncounted, and never goes back onto B;
    a node joins → relaunch on A + C, counted once (maxRepairs 1 not exceeded), an Event
    naming B, B not in failedNodes (it is fine, just full)."""
    prefix = _prefix()
    node_a, node_b = ctx.nodes(_pool(prefix, nodes=2))
    ctx.core.patch_node_status(node_b, {"status": {"allocatable": {"pods": "1"},
                                                   "capacity": {"pods": "1"}}})
    filler = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "filler"},
              "spec": {"nodeName": node_b, "containers": [{"name": "x", "image": "busybox"}],
                       "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists"}]}}
    ctx.core.create_namespaced_pod(ctx.ns, filler)
    ctx.wait(lambda: ctx.core.read_namespaced_pod("filler", ctx.ns).status.phase == "Running",
             60, "the filler pod running on node B")
    ctx.create(_one_pool_job("llm", prefix, parallelism={"tp": 8, "pp": 2, "dp": 1},
                             failurePolicy={"maxRepairs": 1, "minGPUs": 8,
                                            "debounceSeconds": 0}))
    st = ctx.wait(lambda: (x := ctx.status("llm")).get("plan") and x, 30, "the first plan")
    assert sorted(st["plan"]["nodes"]) == sorted([node_a, node_b]) and st["attempt"] == 1

    def unschedulable_on_b() -> Any:
        for p in _pods_of(ctx, "llm"):
            cond = _scheduled_condition(p)
            if (p.status.phase == "Pending" and cond is not None and cond.status == "False"
                    and cond.reason == "Unschedulable"):
                return p, cond
        return None
    pod, cond = ctx.wait(unschedulable_on_b, 30, "the scheduler's Unschedulable verdict")
    assert "Too many pods" in cond.message, cond.message
    assert _affinity_node(pod) == node_b and not pod.spec.node_name
    t_unschedulable = cond.last_transition_time.timestamp()

    def waiting() -> Any:
        x = ctx.status("llm")
        return (x.get("phase") == c.PHASE_REPAIRING and not x.get("plan")
                and _cond(x, c.COND_REPAIRING).get("reason") == c.REASON_INSUFFICIENT_CAPACITY
                and not _pods_of(ctx, "llm") and x)
    st = ctx.wait(waiting, 30, "the repair torn down and waiting for capacity")
    assert time.time() - t_unschedulable >= 4.0, "re-planned before the timeout"
    assert st["failureCause"] == CAUSE_UNSCHEDULABLE and st["failureNodes"] == [node_b]
    assert not (st.get("repairs") or {}).get("count"), "a waiting repair was counted"
    assert node_b not in (st.get("failedNodes") or [])
    time.sleep(3.0)  # passes keep running (pod deletions woke it): it must keep waiting
    st = ctx.status("llm")
    assert st["phase"] == c.PHASE_REPAIRING and st["attempt"] == 1 and not st.get("repairs")
    assert _pods_of(ctx, "llm") == [], "relaunched onto the node its pod could not fit"

    grown = next(p for p in kwoknodes.load_cluster(_pool(prefix, nodes=3)))
    node_c = kwoknodes.node_name(grown.name, 2)
    kube.request(ctx.api, "POST", "/api/v1/nodes", kwoknodes.node_manifest(grown, 2))
    try:
        st, pods = _running(ctx, "llm")
    finally:
        kwoknodes.delete_nodes(ctx.api, [node_c])
    assert sorted(st["plan"]["nodes"]) == sorted([node_a, node_c])
    assert {p.spec.node_name for p in pods} == {node_a, node_c}
    assert st["attempt"] == 2 and st["restarts"] == 1
    assert st["repairs"]["count"] == 1 and st["repairs"]["lastCause"] == CAUSE_UNSCHEDULABLE
    assert st["repairs"]["history"][0]["nodes"] == [node_b]
    assert node_b not in (st.get("failedNodes") or [])
    events = [e for e in ctx.events("llm") if e.reason == CAUSE_UNSCHEDULABLE]
    assert [e.message for e in events] == [f"repair 1: re-planned without {node_b}"], events
    assert events[0].type == "Warning"
    assert _sample(_metrics(ctx.op), "hettrain_repairs_total", namespace=ctx.ns, job="llm",
                   cause=CAUSE_UNSCHEDULABLE) == 1
