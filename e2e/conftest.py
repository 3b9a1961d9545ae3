"""e2e suite configuration: the cluster fixtures, the ``e2e`` marker, ``KUBECONFIG`` targeting.

Cluster choice: ``HETTRAIN_KUBECONFIG`` or ``KUBECONFIG`` → that cluster (start and stop
nothing); otherwise the local control plane from ``e2e/cluster`` (started once per session).
``HETTRAIN_E2E_LOCAL=1`` forces the local one even when ``KUBECONFIG`` is set.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from e2e.support import CHART, PENDING_SELECTOR, OperatorProcess, sa_kubeconfig
from kubernetes import client as k8s

if TYPE_CHECKING:
    from e2e.cluster.pytest_plugin import K8sCluster

pytest_plugins = ["e2e.cluster.pytest_plugin"]


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``e2e`` marker; point the cluster plugin at ``$KUBECONFIG`` if set."""
    config.addinivalue_line("markers", "e2e: end-to-end test against a whole cluster")
    if (os.environ.get("KUBECONFIG") and not os.environ.get("HETTRAIN_KUBECONFIG")
            and os.environ.get("HETTRAIN_E2E_LOCAL", "") not in ("1", "true", "yes")):
        os.environ["HETTRAIN_KUBECONFIG"] = os.environ["KUBECONFIG"]


# ---------------------------------------------------------------- fixtures


CRD = Path(__file__).resolve().parents[1] / "crds" / "hettrainingjobs.hettrain.dev.yaml"


def tool(cluster: K8sCluster, name: str) -> str:
    """kubectl/helm: the pinned one of the local control plane, else $PATH (or $HELM/$KUBECTL)."""
    if cluster.tools_bin and (cluster.tools_bin / name).exists():
        return str(cluster.tools_bin / name)
    found = os.environ.get(name.upper()) or shutil.which(name)
    if not found:
        pytest.skip(f"{name} not found on PATH (set ${name.upper()})")
    return found


@dataclass
class ChartOperator:
    """The chart installed (release in ``namespace``) and the operator running as its SA."""

    release: str
    namespace: str
    service_account: str
    kubeconfig: Path
    operator: OperatorProcess
    helm: str
    kubectl: str

    def as_operator(self, *args: str, check: bool = False) -> subprocess.CompletedProcess:
        """kubectl with the operator's ServiceAccount token."""
        return subprocess.run([self.kubectl, "--kubeconfig", str(self.kubeconfig), *args],
                              capture_output=True, text=True, check=check, timeout=60)


def _helm(helm: str, cluster: K8sCluster, *args: str) -> str:
    res = subprocess.run([helm, "--kubeconfig", str(cluster.kubeconfig), *args],
                         capture_output=True, text=True, timeout=300)
    if res.returncode:
        raise RuntimeError(f"helm {' '.join(args)}: {res.stderr.strip()}")
    return res.stdout


@pytest.fixture(scope="module")
def chart_operator(k8s_cluster: K8sCluster, tmp_path_factory: pytest.TempPathFactory,
                   request: pytest.FixtureRequest) -> Iterator[ChartOperator]:
    """``helm install`` of charts/hettrain-operator (CRDs + RBAC), then the operator as a local
    process with a token of the chart's ServiceAccount. Uninstalled afterwards; the test
    then checks nothing of the release is left. The test module's ``TOPOLOGY`` (a cluster
    YAML, optional) gives the operator the inter-DC links (``HETTRAIN_CLUSTER_CONFIG``)."""
    from e2e.cluster.pytest_plugin import wait_for

    helm, kubectl = tool(k8s_cluster, "helm"), tool(k8s_cluster, "kubectl")
    ns = f"hettrain-e2e-{uuid.uuid4().hex[:6]}"
    release = f"e2e{uuid.uuid4().hex[:5]}"
    core = k8s.CoreV1Api(k8s_cluster.api)
    core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=ns)))
    tmp = tmp_path_factory.mktemp("chart-operator")
    op: OperatorProcess | None = None
    try:
        _helm(helm, k8s_cluster, "install", release, str(CHART), "-n", ns, "--wait=false",
              "--set-string", f"nodeSelector.{PENDING_SELECTOR}=true")
        k8s_cluster.kubectl("wait", "--timeout=60s", "--for=condition=Established",
                            "crd/hettrainingjobs.hettrain.dev")
        sa = f"{release}-hettrain-operator"
        wait_for(lambda: core.list_namespaced_service_account(
            ns, field_selector=f"metadata.name={sa}").items, 30, what=f"ServiceAccount {sa}")
        kubeconfig = sa_kubeconfig(k8s_cluster.kubeconfig, kubectl, ns, sa,
                                   tmp / "operator.kubeconfig")
        op = OperatorProcess.start(kubeconfig, tmp / "operator.log",
                                   topology=getattr(request.module, "TOPOLOGY", None))
        yield ChartOperator(release, ns, sa, kubeconfig, op, helm, kubectl)
    finally:
        if op is not None:
            op.stop()
            print(f"\noperator log {op.log}; 403s: {len(op.forbidden_lines())}")
        subprocess.run([helm, "--kubeconfig", str(k8s_cluster.kubeconfig), "uninstall",
                        release, "-n", ns, "--wait", "--timeout=120s"], capture_output=True,
                       timeout=180, check=False)
        try:
            core.delete_namespace(ns)
        except k8s.ApiException as exc:
            if exc.status != 404:
                raise
