"""The released pieces together on a cluster: the Helm chart's CRDs and RBAC, the operator
running as the chart's ServiceAccount, ``kubectl apply`` of an example job, conditions, a node
failure with WaitForReplacement, the repair, deletion and cleanup.

Run: ``.venv/bin/pytest e2e/tests -m "e2e and not slow" -x -q`` (local control plane), or with
``KUBECONFIG=...`` against any cluster (e2e/README.md).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e.cluster import kwoknodes
from e2e.cluster.pytest_plugin import K8sCluster, exists, wait_for
from e2e.support import wait_schedulable
from kubernetes import client as k8s

from hettrain.api import constants as c

pytestmark = [pytest.mark.e2e, pytest.mark.k8s]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_JOB = ROOT / "examples" / "jobs" / "llama3-70b-four-vendors.yaml"
EXAMPLE_CLUSTER = ROOT / "examples" / "clusters" / "four-vendors-two-dcs.yaml"
TOPOLOGY = EXAMPLE_CLUSTER  # the operator's HETTRAIN_CLUSTER_CONFIG (inter-DC links)


def _job(api: k8s.ApiClient, ns: str, name: str) -> dict[str, Any]:
    return k8s.CustomObjectsApi(api).get_namespaced_custom_object(c.GROUP, c.VERSION, ns,
                                                                  c.PLURAL, name)


def _cond(job: dict[str, Any], ctype: str) -> dict[str, Any]:
    for cond in (job.get("status") or {}).get("conditions") or ():
        if cond["type"] == ctype:
            return cond
    return {}


def _pods(api: k8s.ApiClient, ns: str, job: str) -> list[Any]:
    return k8s.CoreV1Api(api).list_namespaced_pod(ns, label_selector=f"{c.LABEL_JOB}={job}").items


def _wait_job(chart_operator, api: k8s.ApiClient, ns: str, name: str, done: Any,
              timeout: float, what: str) -> dict[str, Any]:
    """Poll the job until ``done(job)``; on timeout the error shows its status and the
    operator's log tail."""
    def check() -> Any:
        j = _job(api, ns, name)
        if (j.get("status") or {}).get("phase") == c.PHASE_FAILED:
            raise AssertionError(f"job Failed while waiting for {what}: {j['status']}")
        return j if done(j) else None

    try:
        return wait_for(check, timeout, interval=0.3, what=what)
    except TimeoutError as exc:
        status = json.dumps(_job(api, ns, name).get("status"), indent=1)[:4000]
        raise AssertionError(f"{exc}\nstatus: {status}\noperator log:\n"
                             f"{chart_operator.operator.tail(4000)}") from None


def test_operator_identity_is_the_charts_service_account(chart_operator) -> None:
    who = json.loads(chart_operator.as_operator("auth", "whoami", "-o", "json",
                                                check=True).stdout)
    assert who["status"]["userInfo"]["username"] == (
        f"system:serviceaccount:{chart_operator.namespace}:{chart_operator.service_account}")
    denied = chart_operator.as_operator("get", "secrets", "-n", chart_operator.namespace)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()
    denied = chart_operator.as_operator("delete", "node", "no-such-node")
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()


def test_every_example_job_is_accepted_by_the_apiserver(k8s_cluster: K8sCluster,
                                                        chart_operator, namespace: str) -> None:
    out = k8s_cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f",
                              str(ROOT / "examples" / "jobs"))
    jobs = sorted((ROOT / "examples" / "jobs").glob("*.yaml"))
    assert out.count("created (server dry run)") == len(jobs), out


def test_a_job_without_spec_data_is_refused_by_the_apiserver(k8s_cluster: K8sCluster,
                                                            chart_operator, namespace: str
                                                            ) -> None:
    """Synthetic tokens only when the spec says so: the CRD requires spec.data."""
    doc = yaml.safe_load(EXAMPLE_JOB.read_text())
    del doc["spec"]["data"]
    with pytest.raises(RuntimeError, match=r"spec\.data: Required value"):
        k8s_cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-",
                            input=yaml.safe_dump(doc))
    doc["spec"]["data"] = {"synthetic": True}
    out = k8s_cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-",
                              input=yaml.safe_dump(doc))
    assert "created (server dry run)" in out


def test_apply_example_fail_node_replace_repair_delete(k8s_cluster: K8sCluster, chart_operator,
                                                       namespace: str, kwok_nodes) -> None:
    api, ns = k8s_cluster.api, namespace
    wait_schedulable(api, kwok_nodes(EXAMPLE_CLUSTER))
    k8s_cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE_JOB))
    name = "llama3-70b-global"

    job = _wait_job(chart_operator, api, ns, name,
                    lambda j: _cond(j, c.COND_PODS_READY).get("status") == "True", 180,
                    "Planned and PodsReady")
    assert _cond(job, c.COND_PLANNED)["status"] == "True"
    st = job["status"]
    assert st["phase"] == c.PHASE_RUNNING and st["attempt"] == 1 and st["worldSize"] == 96
    planned = set(st["plan"]["nodes"])
    pods = _pods(api, ns, name)
    assert len(pods) == len(planned) == 12
    assert {p.spec.node_name for p in pods} == planned
    assert all(p.status.phase == "Running" for p in pods)
    table = k8s_cluster.kubectl("get", "htj", "-n", ns)
    assert "Running" in table and name in table

    # A node fails; all 96 GPUs were in use, so WaitForReplacement waits for a new node.
    victim = sorted(planned)[0]
    kwoknodes.mark_not_ready(api, victim)
    job = _wait_job(chart_operator, api, ns, name,
                    lambda j: _cond(j, c.COND_REPAIRING).get("reason")
                    == c.REASON_WAITING_REPLACEMENT, 60, "Repairing/WaitingForReplacement")
    assert job["status"]["phase"] == c.PHASE_REPAIRING
    wait_for(lambda: not _pods(api, ns, name), 60, what="the broken gang deleted")
    pool = next(p for p in kwoknodes.load_cluster(EXAMPLE_CLUSTER)
                if victim.startswith(p.name + "-"))
    spare = kwoknodes.node_manifest(pool, pool.nodes)
    k8s.CoreV1Api(api).create_node(spare)
    spare_name = spare["metadata"]["name"]
    try:
        wait_schedulable(api, [spare_name], timeout=60)

        job = _wait_job(chart_operator, api, ns, name,
                        lambda j: (j.get("status") or {}).get("attempt") == 2
                        and _cond(j, c.COND_PODS_READY).get("status") == "True", 120,
                        "attempt 2 PodsReady")
        st = job["status"]
        assert victim not in st["plan"]["nodes"] and spare_name in st["plan"]["nodes"]
        assert st["repairs"]["count"] == 1 and st["repairs"]["lastCause"] == c.REASON_NODE_LOST
        pods = _pods(api, ns, name)
        assert len(pods) == 12 and all(p.metadata.labels[c.LABEL_ATTEMPT] == "2" for p in pods)
        for p in pods:
            env = {e.name: e.value for e in p.spec.containers[0].env}
            assert env[c.ENV_RESUME] == "1"
        metrics = chart_operator.operator.metrics() or ""
        assert (f'hettrain_repairs_total{{cause="NodeLost",job="{name}",namespace="{ns}"}} 1.0'
                in metrics)

        # Deletion: the operator drops its finalizer, the GC removes every child.
        k8s_cluster.kubectl("delete", "htj", name, "-n", ns, "--wait=false")
        co = k8s.CustomObjectsApi(api)
        wait_for(lambda: not exists(co.get_namespaced_custom_object, c.GROUP, c.VERSION, ns,
                                    c.PLURAL, name), 60, what="job deleted (finalizer removed)")
        left = lambda: k8s_cluster.kubectl(  # noqa: E731
            "get", "pods,configmaps,services", "-n", ns, "-l", f"{c.LABEL_JOB}={name}",
            "-o", "name").strip()
        wait_for(lambda: left() == "", 60, what="children garbage-collected")
    finally:
        kwoknodes.delete_nodes(api, [spare_name])
    core = k8s.CoreV1Api(api)
    core.delete_namespace(ns)
    wait_for(lambda: not exists(core.read_namespace, ns), 90, what=f"namespace {ns} gone")
    # The chart's RBAC was enough for all of it.
    assert chart_operator.operator.forbidden_lines() == []
    assert chart_operator.operator.proc.poll() is None


def test_uninstall_leaves_nothing(k8s_cluster: K8sCluster, chart_operator) -> None:
    """Runs last in this module: helm uninstall removes the release's cluster objects."""
    chart_operator.operator.stop()
    res = subprocess.run([chart_operator.helm, "--kubeconfig", str(k8s_cluster.kubeconfig),
                          "uninstall", chart_operator.release, "-n", chart_operator.namespace,
                          "--wait", "--timeout=120s"], capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stderr
    left = k8s_cluster.kubectl("get", "deployment,serviceaccount,clusterrole,clusterrolebinding",
                               "-A", "-o", "name", "-l",
                               f"app.kubernetes.io/instance={chart_operator.release}")
    assert left.strip() == ""
