"""helm install / upgrade / uninstall against the real local control plane.

Run: ``.venv/bin/pytest -p e2e.cluster.pytest_plugin -m k8s tests/chart``. Under kwok the
operator pod is not run (no kwok node is targeted); the test asserts the objects and, with
``kubectl auth can-i``, what the chart's RBAC lets the operator's ServiceAccount do.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from chart_render import CHART
from e2e.cluster.pytest_plugin import K8sCluster, wait_for

pytestmark = pytest.mark.k8s


def _helm(helm: Path, cluster: K8sCluster, *args: str) -> str:
    res = subprocess.run([str(helm), "--kubeconfig", str(cluster.kubeconfig), *args],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, f"helm {' '.join(args)}: {res.stderr}"
    return res.stdout


def _can(cluster: K8sCluster, sa: str, verb: str, resource: str, ns: str | None) -> bool:
    args = ["auth", "can-i", verb, resource, f"--as={sa}"]
    args += ["-n", ns] if ns else []
    return cluster.kubectl(*args, check=False).strip() == "yes"


def test_install_upgrade_uninstall(helm: Path, k8s_cluster: K8sCluster, namespace: str) -> None:
    release = f"h{namespace[-6:]}"
    name = f"{release}-hettrain-operator"
    _helm(helm, k8s_cluster, "install", release, str(CHART), "-n", namespace, "--wait=false")
    dep = json.loads(k8s_cluster.kubectl("get", "deployment", name, "-n", namespace, "-o", "json"))
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--standalone" in args and dep["spec"]["replicas"] == 1
    for kind in ("serviceaccount", "service", "poddisruptionbudget", "networkpolicy"):
        k8s_cluster.kubectl("get", kind, "-n", namespace, "-l",
                            f"app.kubernetes.io/instance={release}", "-o", "name")
    crds = k8s_cluster.kubectl("get", "crd", "-o", "name")
    assert "hettrainingjobs.hettrain.dev" in crds and "clusterkopfpeerings.kopf.dev" in crds

    sa = f"system:serviceaccount:{namespace}:{name}"
    allowed = [("create", "pods"), ("delete", "pods"), ("watch", "hettrainingjobs.hettrain.dev"),
               ("patch", "hettrainingjobs.hettrain.dev/status"), ("patch", "configmaps"),
               ("create", "events")]
    denied = [("get", "secrets"), ("update", "pods"), ("delete", "hettrainingjobs.hettrain.dev"),
              ("create", "deployments.apps")]
    for verb, res in allowed:
        assert _can(k8s_cluster, sa, verb, res, namespace), f"{sa} cannot {verb} {res}"
    for verb, res in denied:
        assert not _can(k8s_cluster, sa, verb, res, namespace), f"{sa} may {verb} {res}"
    assert _can(k8s_cluster, sa, "list", "nodes", None)
    assert not _can(k8s_cluster, sa, "delete", "nodes", None)

    _helm(helm, k8s_cluster, "upgrade", release, str(CHART), "-n", namespace, "--wait=false",
          "-f", str(CHART / "ci" / "ha-values.yaml"), "--set", f"peering.name={release}")

    def upgraded() -> bool:
        d = json.loads(k8s_cluster.kubectl("get", "deployment", name, "-n", namespace,
                                           "-o", "json"))
        return d["spec"]["replicas"] == 2 and f"--peering={release}" in (
            d["spec"]["template"]["spec"]["containers"][0]["args"])

    wait_for(upgraded, 30, what="upgraded Deployment")
    k8s_cluster.kubectl("get", "clusterkopfpeering", release)
    assert _can(k8s_cluster, sa, "patch", f"clusterkopfpeerings.kopf.dev/{release}", None)

    _helm(helm, k8s_cluster, "uninstall", release, "-n", namespace, "--wait")
    gone = k8s_cluster.kubectl("get", "deployment,clusterrole,clusterkopfpeering", "-A", "-o",
                               "name", "-l", f"app.kubernetes.io/instance={release}")
    assert gone.strip() == ""
