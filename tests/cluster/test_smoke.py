"""Smoke tests: the local control plane is a real Kubernetes, not a mock.

Each test proves one component does its real job: the apiserver validates CRs against a CRD
schema, kube-scheduler binds a pod to a kwok node by affinity and kwok runs it, the
controller-manager's garbage collector follows ownerReferences, its node lifecycle controller
taints failed nodes, kwok keeps up with a thousand nodes, and a crashed kube-apiserver comes
back with every object (etcd keeps the state).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from e2e.cluster import kwoknodes
from e2e.cluster.pytest_plugin import K8sCluster, exists, wait_for
from kubernetes import client as k8s

pytestmark = pytest.mark.k8s

GROUP = "smoke.hettrain.dev"
CRD_NAME = f"widgets.{GROUP}"


def _cluster_yaml(prefix: str, pools: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "hettrain.dev/v1alpha1",
        "kind": "Cluster",
        "metadata": {"name": prefix},
        "datacenters": [{"name": f"{prefix}-dc", "zones": [f"{prefix}-dc-a"]}],
        "pools": [{"datacenter": f"{prefix}-dc", "zone": f"{prefix}-dc-a", **p} for p in pools],
    }


def _prefix() -> str:
    return f"smk{uuid.uuid4().hex[:5]}"


# ---------------------------------------------------------------- apiserver: CRD schema


def _widget_crd() -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "required": ["size", "replicas"],
                "properties": {
                    "size": {"type": "string", "enum": ["small", "large"]},
                    "replicas": {"type": "integer", "minimum": 1, "maximum": 8},
                },
            }
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def _widget(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": {"name": name}, "spec": spec}


def test_crd_schema_validated_by_apiserver(k8s_cluster: K8sCluster, namespace: str) -> None:
    ext = k8s.ApiextensionsV1Api(k8s_cluster.api)
    try:
        ext.create_custom_resource_definition(_widget_crd())
    except k8s.ApiException as exc:
        if exc.status != 409:
            raise

    def established() -> bool:
        crd = ext.read_custom_resource_definition(CRD_NAME)
        conds = crd.status.conditions or []
        return any(c.type == "Established" and c.status == "True" for c in conds)

    wait_for(established, 30, what="CRD Established")
    objs = k8s.CustomObjectsApi(k8s_cluster.api)
    # Discovery of a fresh CRD can lag a moment behind Established.
    created = wait_for(
        lambda: _try_create(objs, namespace, _widget("good", {"size": "small", "replicas": 2})),
        30,
        what="good Widget accepted",
    )
    assert created["spec"] == {"size": "small", "replicas": 2}

    bad = [
        ({"size": "huge", "replicas": 2}, "spec.size"),
        ({"size": "small", "replicas": 0}, "spec.replicas"),
        ({"size": "small"}, "spec.replicas"),
    ]
    for spec, field in bad:
        with pytest.raises(k8s.ApiException) as err:
            objs.create_namespaced_custom_object(
                GROUP, "v1", namespace, "widgets", _widget("bad", spec)
            )
        assert err.value.status == 422, err.value.body
        assert field in str(err.value.body), err.value.body


def _try_create(objs: k8s.CustomObjectsApi, ns: str, body: dict[str, Any]) -> Any:
    try:
        return objs.create_namespaced_custom_object(GROUP, "v1", ns, "widgets", body)
    except k8s.ApiException as exc:
        if exc.status == 404:
            return None
        raise


# ---------------------------------------------------------------- scheduler + kwok


def test_pod_scheduled_onto_kwok_node_by_affinity(
    k8s_cluster: K8sCluster, namespace: str, kwok_nodes: Any
) -> None:
    p = _prefix()
    kwok_nodes(
        _cluster_yaml(
            p,
            [
                {
                    "name": f"{p}-h100",
                    "device": "H100-SXM",
                    "nodes": 2,
                    "gpusPerNode": 8,
                    "nicGbps": 400,
                },
                {
                    "name": f"{p}-mi300",
                    "device": "MI300X",
                    "nodes": 2,
                    "gpusPerNode": 8,
                    "nicGbps": 200,
                },
            ],
        )
    )
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "hettrain.dev/pool", "operator": "In", "values": [f"{p}-mi300"]}
                        ]
                    }
                ]
            }
        }
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "trainer"},
        "spec": {
            "affinity": affinity,
            "containers": [
                {
                    "name": "main",
                    "image": "example.invalid/trainer:1",
                    "resources": {"limits": {"amd.com/gpu": "8"}},
                }
            ],
        },
    }
    core = k8s.CoreV1Api(k8s_cluster.api)
    core.create_namespaced_pod(namespace, pod)

    def running() -> Any:
        got = core.read_namespaced_pod("trainer", namespace)
        return got if got.status.phase == "Running" else None

    got = wait_for(running, 60, what="pod Running")
    assert got.spec.node_name.startswith(f"{p}-mi300-"), got.spec.node_name
    assert got.status.pod_ip, "kwok assigns a pod IP"
    node = core.read_node(got.spec.node_name)
    assert node.metadata.labels["hettrain.dev/vendor"] == "amd"
    assert node.status.allocatable["amd.com/gpu"] == "8"


# ---------------------------------------------------------------- controller-manager: GC


def test_owner_reference_garbage_collection(k8s_cluster: K8sCluster, namespace: str) -> None:
    core = k8s.CoreV1Api(k8s_cluster.api)
    owner = core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "owner"}, "data": {"role": "owner"}}
    )
    ref = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner.metadata.uid,
        "blockOwnerDeletion": True,
    }
    core.create_namespaced_config_map(
        namespace,
        {"metadata": {"name": "child", "ownerReferences": [ref]}, "data": {"role": "child"}},
    )
    core.delete_namespaced_config_map("owner", namespace, propagation_policy="Background")

    wait_for(lambda: not exists(core.read_namespaced_config_map, "child", namespace), 60,
             what="garbage collector to delete the child")


# ---------------------------------------------------------------- node lifecycle controller


def _taints(api: k8s.ApiClient, name: str) -> set[tuple[str, str]]:
    return {(t["key"], t["effect"]) for t in kwoknodes.node_taints(api, name)}


def test_apiserver_restart_keeps_every_object(k8s_cluster: K8sCluster, namespace: str) -> None:
    """restart_apiserver crashes the kube-apiserver (SIGKILL) and starts it again on the same
    port: it is a new process, objects written before are served from etcd again, and
    writes work at once."""
    if k8s_cluster.external or k8s_cluster.state_dir is None:
        pytest.skip("restarts a component of the local cluster")
    core = k8s.CoreV1Api(k8s_cluster.api)
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "kept"},
                                                  "data": {"k": "v"}})
    pid_file = k8s_cluster.state_dir / "pids" / "kube-apiserver"
    before = pid_file.read_text().strip()
    took = k8s_cluster.restart_apiserver()
    assert pid_file.read_text().strip() != before and 0 < took < 120
    assert k8s_cluster.api_ready()
    assert core.read_namespaced_config_map("kept", namespace).data == {"k": "v"}
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "after"}})
    assert exists(core.read_namespaced_config_map, "after", namespace)


def test_failed_nodes_get_lifecycle_taints(k8s_cluster: K8sCluster, kwok_nodes: Any) -> None:
    api = k8s_cluster.api
    p = _prefix()
    # Four nodes in one zone: one or two failures keep the zone below the disruption
    # thresholds, so the controller taints normally instead of pausing.
    names = kwok_nodes(
        _cluster_yaml(p, [{"name": f"{p}-gaudi", "device": "Gaudi3", "nodes": 4, "gpusPerNode": 8}])
    )
    sick, lost = names[0], names[1]

    kwoknodes.mark_not_ready(api, sick)
    kwoknodes.mark_not_ready(api, lost, kwoknodes.FAULT_UNREACHABLE)
    kwoknodes.wait_nodes(api, [sick], ready="False", timeout=30)
    kwoknodes.wait_nodes(api, [lost], ready="Unknown", timeout=30)
    want_sick = {
        (kwoknodes.TAINT_NOT_READY, "NoSchedule"),
        (kwoknodes.TAINT_NOT_READY, "NoExecute"),
    }
    want_lost = {
        (kwoknodes.TAINT_UNREACHABLE, "NoSchedule"),
        (kwoknodes.TAINT_UNREACHABLE, "NoExecute"),
    }
    wait_for(lambda: want_sick <= _taints(api, sick), 60, what=f"not-ready taints on {sick}")
    wait_for(lambda: want_lost <= _taints(api, lost), 60, what=f"unreachable taints on {lost}")
    assert not _taints(api, names[2]), "healthy nodes stay untainted"

    # No heartbeat may flip the failed node back: it stays NotReady.
    time.sleep(3)
    kwoknodes.wait_nodes(api, [sick], ready="False", timeout=1)

    kwoknodes.mark_ready(api, sick)
    kwoknodes.wait_nodes(api, [sick], timeout=30)
    wait_for(lambda: not _taints(api, sick), 60, what=f"taints removed from healed {sick}")


# ---------------------------------------------------------------- scale


@pytest.mark.slow
def test_thousand_fake_nodes(k8s_cluster: K8sCluster, kwok_nodes: Any) -> None:
    p = _prefix()
    t0 = time.monotonic()
    names = kwok_nodes(
        _cluster_yaml(
            p,
            [
                {"name": f"{p}-h100", "device": "H100-SXM", "nodes": 500, "gpusPerNode": 8},
                {"name": f"{p}-mi300", "device": "MI300X", "nodes": 300, "gpusPerNode": 8},
                {"name": f"{p}-910b", "device": "Ascend-910B", "nodes": 200, "gpusPerNode": 8},
            ],
        ),
        timeout=300,
    )
    elapsed = time.monotonic() - t0
    assert len(names) == 1000
    print(f"1000 kwok nodes created and Ready in {elapsed:.1f}s")
    assert elapsed < 180
