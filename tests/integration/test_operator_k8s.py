"""The operator against the real local control plane with kwok heterogeneous GPU nodes.

Run: ``.venv/bin/pytest -p e2e.cluster.pytest_plugin -m k8s tests/integration``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e.cluster import kwoknodes
from e2e.cluster.pytest_plugin import K8sCluster, wait_for
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from hettrain.api import constants as c

pytestmark = pytest.mark.k8s
ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "hettrainingjobs.hettrain.dev.yaml"


@pytest.fixture(scope="module")
def operator(k8s_cluster: K8sCluster) -> Iterator[Any]:
    """CRD applied and the operator running in-process (kopf.testing.KopfRunner)."""
    from kopf.testing import KopfRunner

    k8s_cluster.kubectl("apply", "--server-side", "-f", str(CRD))
    k8s_cluster.kubectl("wait", "--for=condition=Established", "crd/hettrainingjobs.hettrain.dev")
    os.environ["KUBECONFIG"] = str(k8s_cluster.kubeconfig)
    os.environ["HETTRAIN_METRICS_PORT"] = "0"
    with KopfRunner(["run", "-m", "hettrain.handlers", "--all-namespaces", "--standalone"],
                    timeout=60) as runner:
        yield runner


def _pools(prefix: str) -> dict[str, Any]:
    return {"apiVersion": c.API_VERSION, "kind": "Cluster", "metadata": {"name": prefix},
            "datacenters": [{"name": "dc-a"}, {"name": "dc-b"}],
            "pools": [
                {"name": f"{prefix}-h100", "datacenter": "dc-a", "device": "H100-SXM",
                 "vendor": "nvidia", "nodes": 2, "gpusPerNode": 8},
                {"name": f"{prefix}-mi300", "datacenter": "dc-b", "device": "MI300X",
                 "vendor": "amd", "nodes": 2, "gpusPerNode": 8}]}


def _job(name: str, prefix: str, **spec: Any) -> dict[str, Any]:
    body = {"model": {"preset": "gpt3-1.3b"}, "training": {"globalBatch": 64, "steps": 10},
            "placement": {"pools": [f"{prefix}-h100", f"{prefix}-mi300"]},
            "checkpoint": {"uri": "/ckpt"},
            "failurePolicy": {"maxRepairs": 3, "minGPUs": 8, "debounceSeconds": 0.5}}
    body.update(spec)
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name},
            "spec": body}


def _create(api: k8s.ApiClient, ns: str, doc: dict[str, Any]) -> None:
    k8s.CustomObjectsApi(api).create_namespaced_custom_object(c.GROUP, c.VERSION, ns, c.PLURAL,
                                                              doc)


def _get(api: k8s.ApiClient, ns: str, name: str) -> dict[str, Any]:
    return k8s.CustomObjectsApi(api).get_namespaced_custom_object(c.GROUP, c.VERSION, ns,
                                                                  c.PLURAL, name)


def _pods(api: k8s.ApiClient, ns: str, job: str) -> list[Any]:
    return k8s.CoreV1Api(api).list_namespaced_pod(ns, label_selector=f"{c.LABEL_JOB}={job}").items


def test_launch_then_node_loss_repairs_on_survivors(k8s_cluster, operator, namespace,
                                                    kwok_nodes):
    prefix = f"p{uuid.uuid4().hex[:5]}"
    kwok_nodes(_pools(prefix))
    api = k8s_cluster.api
    _create(api, namespace, _job("llm", prefix))
    status = wait_for(lambda: _get(api, namespace, "llm").get("status", {}).get("plan"), 60,
                      what="plan in status")
    planned = set(status["nodes"])
    pods = wait_for(lambda: [p for p in _pods(api, namespace, "llm")
                             if p.status.phase == "Running"] if len(
                                 _pods(api, namespace, "llm")) == len(planned) else None,
                    60, what="all pods running")
    assert {p.spec.node_name for p in pods} == planned
    assert len(pods) == len(planned)
    wait_for(lambda: _get(api, namespace, "llm")["status"].get("phase") == c.PHASE_RUNNING, 30,
             what="phase Running")
    out = k8s_cluster.kubectl("get", "htj", "-n", namespace)
    assert "PHASE" in out and "Running" in out and "TOKENS/S" in out
    described = k8s_cluster.kubectl("describe", "htj", "llm", "-n", namespace)
    assert "Conditions:" in described and "Planned" in described

    lost = sorted(planned)[0]
    kwoknodes.mark_not_ready(api, lost)
    kwoknodes.delete_nodes(api, [lost])

    def repaired() -> Any:
        st = _get(api, namespace, "llm").get("status", {})
        if int(st.get("attempt") or 0) < 2:
            return None
        pods = _pods(api, namespace, "llm")
        if pods and all(p.metadata.labels[c.LABEL_ATTEMPT] == "2" for p in pods) and len(
                pods) == len(st["plan"]["nodes"]):
            return st, pods
        return None

    st, pods = wait_for(repaired, 90, what="repair to attempt 2")
    assert lost not in st["plan"]["nodes"]
    assert st["repairs"]["count"] == 1 and st["repairs"]["lastCause"] == c.REASON_NODE_LOST
    for p in pods:
        env = {e.name: e.value for e in p.spec.containers[0].env}
        assert env[c.ENV_RESUME] == "1"
        assert p.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution \
            .node_selector_terms[0].match_expressions[0].values[0] != lost


BAD_SPECS: list[tuple[dict[str, Any], str]] = [
    ({"model": {"preset": "llama9"}}, "spec.model.preset"),
    ({"model": {}}, "spec.model"),
    ({"model": {"layers": 0, "hidden": 64, "heads": 4, "seqLen": 8, "vocab": 8}},
     "spec.model.layers"),
    ({"model": {"layers": 2, "hidden": 65, "heads": 4, "seqLen": 8, "vocab": 8}}, "spec.model"),
    ({"model": {"layers": 2, "hidden": 64, "heads": 4, "kvHeads": 3, "seqLen": 8, "vocab": 8}},
     "spec.model"),
    ({"model": {"preset": "gpt-tiny", "hidden": "big"}}, "spec.model.hidden"),
    ({"training": {"steps": 1}}, "spec.training.globalBatch"),
    ({"training": {"globalBatch": 8}}, "spec.training.steps"),
    ({"training": {"globalBatch": 0, "steps": 1}}, "spec.training.globalBatch"),
    ({"training": {"globalBatch": 10, "steps": 1, "microBatch": 3}}, "spec.training"),
    ({"training": {"globalBatch": 8, "steps": 1, "precision": "fp8"}},
     "spec.training.precision"),
    ({"training": {"globalBatch": 8, "steps": 1, "recompute": "some"}},
     "spec.training.recompute"),
    ({"training": {"globalBatch": 8, "steps": 1, "learningRate": -1}},
     "spec.training.learningRate"),
    ({"training": {"globalBatch": 8, "steps": 1, "seed": -1}}, "spec.training.seed"),
    ({"placement": {"vendors": ["acme"]}}, "spec.placement.vendors"),
    ({"placement": {"maxGPUs": 0}}, "spec.placement.maxGPUs"),
    ({"placement": {"nodeSelector": {"a": 1}}}, "spec.placement.nodeSelector"),
    ({"parallelism": {"tp": 3}}, "spec.parallelism"),
    ({"parallelism": {"pp": 0}}, "spec.parallelism.pp"),
    ({"parallelism": {"dp": -2}}, "spec.parallelism.dp"),
    ({"parallelism": {"schedule": "gpipe"}}, "spec.parallelism.schedule"),
    ({"crossDC": {"mode": "async"}}, "spec.crossDC.mode"),
    ({"crossDC": {"compression": "fp4"}}, "spec.crossDC.compression"),
    ({"crossDC": {"outerMomentum": 1.0}}, "spec.crossDC.outerMomentum"),
    ({"crossDC": {"outerSteps": 0}}, "spec.crossDC.outerSteps"),
    ({"checkpoint": {"uri": "/a", "pvc": "b"}}, "spec.checkpoint"),
    ({"checkpoint": {"intervalSteps": 0}}, "spec.checkpoint.intervalSteps"),
    ({"failurePolicy": {"mode": "Pray"}}, "spec.failurePolicy.mode"),
    ({"failurePolicy": {"maxRepairs": -1}}, "spec.failurePolicy.maxRepairs"),
    ({"failurePolicy": {"minGPUs": 0}}, "spec.failurePolicy.minGPUs"),
    ({"failurePolicy": {"debounceSeconds": -1}}, "spec.failurePolicy.debounceSeconds"),
    ({"suspend": "yes"}, "spec.suspend"),
    ({"image": ""}, "spec.image"),
    ({"command": "train"}, "spec.command"),
]


def test_malformed_specs_are_rejected_by_the_apiserver_with_the_field_path(k8s_cluster,
                                                                           operator, namespace):
    api = k8s_cluster.api
    assert len(BAD_SPECS) >= 30
    for i, (patch, field_path) in enumerate(BAD_SPECS):
        doc = _job(f"bad-{i}", "none", **patch)
        with pytest.raises(ApiException) as info:
            _create(api, namespace, doc)
        assert info.value.status == 422, (patch, info.value.body)
        assert field_path in info.value.body, (patch, field_path, info.value.body)


@pytest.mark.parametrize("spec", [
    {"model": {"preset": "llama3-405b"}, "failurePolicy": {"minGPUs": 1}},
    {"placement": {"pools": ["no-such-pool"]}},
])
def test_unplannable_specs_fail_with_planfailed_and_zero_pods(k8s_cluster, operator, namespace,
                                                               kwok_nodes, spec):
    prefix = f"p{uuid.uuid4().hex[:5]}"
    kwok_nodes(_pools(prefix))
    api = k8s_cluster.api
    _create(api, namespace, _job("np", prefix, **spec))
    st = wait_for(lambda: _get(api, namespace, "np").get("status", {}).get("phase") == "Failed"
                  and _get(api, namespace, "np")["status"], 60, what="phase Failed")
    cond = next(x for x in st["conditions"] if x["type"] == c.COND_PLANNED)
    assert cond["status"] == "False" and cond["reason"] == c.REASON_PLAN_FAILED
    assert cond["message"]
    assert _pods(api, namespace, "np") == []
