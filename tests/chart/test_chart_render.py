"""The chart rendered by the real helm: lint, schema, RBAC, args, security, and sync checks."""

from __future__ import annotations

import filecmp
import subprocess
from pathlib import Path

import pytest
import yaml
from chart_render import CHART, ROOT, by_kind, helm_template, render

CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
CI_IDS = [p.name.removesuffix("-values.yaml") for p in CI_VALUES]


def test_ci_values_cover_the_four_scenarios() -> None:
    assert set(CI_IDS) >= {"default", "ha", "monitoring-on", "namespaced"}


@pytest.mark.parametrize("values", CI_VALUES, ids=CI_IDS)
def test_helm_lint_strict(helm: Path, values: Path) -> None:
    out = subprocess.run([str(helm), "lint", "--strict", str(CHART), "-f", str(values)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout


def test_chart_version_differs_from_app_version() -> None:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert meta["apiVersion"] == "v2" and meta["version"] != meta["appVersion"]


@pytest.mark.parametrize(("flag", "field"), [
    ("replicaCount=0", "/replicaCount"),
    ("bogus=1", "bogus"),
    ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
    ("monitoring.podMonitor.interval=often", "/monitoring/podMonitor/interval"),
])
def test_schema_rejects_bad_values_naming_the_field(helm: Path, flag: str, field: str) -> None:
    out = helm_template(helm, "--set", flag)
    assert out.returncode != 0
    assert field in out.stderr


def test_every_value_is_commented() -> None:
    """Each key has a '# --' comment, unless it is a section header or sits in a documented map."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    for i, line in enumerate(lines):
        text = line.strip()
        if not text or text.startswith("#") or text.startswith("-"):
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        documented = lines[i - 1].strip().startswith("# --")
        nxt = next((n for n in lines[i + 1:] if n.strip()), "")
        header = text.endswith(":") and len(nxt) - len(nxt.lstrip()) > indent
        in_documented_map = any(doc for _, doc in stack)
        assert documented or header or in_documented_map, (
            f"values.yaml line {i + 1} has no '# --' comment: {line}")
        stack.append((indent, documented))


def _rules(role: dict) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"]
            for r in rule["resources"] for v in rule["verbs"]}


def _grants(resources: dict[tuple[str, str], tuple[str, ...]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for (g, r), verbs in resources.items() for v in verbs}


NAMESPACED = _grants({
    ("hettrain.dev", "hettrainingjobs"): ("get", "list", "watch", "patch"),
    ("hettrain.dev", "hettrainingjobs/status"): ("get", "patch"),
    ("", "pods"): ("get", "list", "watch", "create", "delete"),
    ("", "services"): ("get", "list", "watch", "create", "delete", "patch"),
    ("", "configmaps"): ("get", "list", "watch", "create", "delete", "patch"),
    ("networking.k8s.io", "networkpolicies"): ("get", "create", "delete"),
    ("", "events"): ("create", "patch"),
    ("events.k8s.io", "events"): ("create", "patch"),
    ("kopf.dev", "kopfpeerings"): ("get", "list", "watch", "patch"),
    ("", "persistentvolumeclaims"): ("get",),
})
CLUSTER = _grants({
    ("", "nodes"): ("get", "list", "watch"),
    ("apiextensions.k8s.io", "customresourcedefinitions"): ("list", "watch"),
    ("kopf.dev", "clusterkopfpeerings"): ("get", "list", "watch", "patch"),
})


def test_rbac_all_namespaces_is_exactly_the_operator_verbs(helm: Path) -> None:
    objs = render(helm)
    (role,) = by_kind(objs, "ClusterRole")
    assert _rules(role) == CLUSTER | NAMESPACED | _grants({("", "namespaces"): ("list", "watch")})
    assert not by_kind(objs, "Role")
    (binding,) = by_kind(objs, "ClusterRoleBinding")
    (sa,) = by_kind(objs, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": "hettrain"}]


def test_rbac_namespaced_uses_roles_per_namespace(helm: Path) -> None:
    objs = render(helm, "-f", str(CHART / "ci" / "namespaced-values.yaml"))
    (role,) = by_kind(objs, "ClusterRole")
    assert _rules(role) == CLUSTER  # nothing namespaced cluster-wide
    roles = by_kind(objs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert all(_rules(r) == NAMESPACED for r in roles)
    assert sorted(b["metadata"]["namespace"] for b in by_kind(objs, "RoleBinding")) == [
        "team-a", "team-b"]
    args = by_kind(objs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    assert "--all-namespaces" not in args


def _args(objs: list[dict]) -> list[str]:
    return by_kind(objs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_standalone_by_default_and_peering_in_ha(helm: Path) -> None:
    default = render(helm)
    assert "--standalone" in _args(default)
    assert not by_kind(default, "ClusterKopfPeering")
    ha = render(helm, "-f", str(CHART / "ci" / "ha-values.yaml"))
    args = _args(ha)
    assert "--peering=hettrain-ha" in args and "--priority=200" in args
    assert "--standalone" not in args
    assert by_kind(ha, "Deployment")[0]["spec"]["replicas"] == 2
    (peering,) = by_kind(ha, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "hettrain-ha"
    (pdb,) = by_kind(ha, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1


def test_operator_args_are_accepted_by_kopf_run() -> None:
    """Every flag the Deployment passes is an option of the installed `kopf run`."""
    kopf = ROOT / ".venv" / "bin" / "kopf"
    help_text = subprocess.run([str(kopf), "run", "--help"], capture_output=True, text=True,
                               timeout=60, check=True).stdout
    for flag in ("-m", "--all-namespaces", "--namespace", "--standalone", "--peering",
                 "--priority", "--liveness", "--verbose"):
        assert flag in help_text, flag


def test_pods_are_hardened(helm: Path) -> None:
    pod = by_kind(render(helm), "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = pod["containers"][0]["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]


def test_monitoring_objects(helm: Path) -> None:
    objs = render(helm, "-f", str(CHART / "ci" / "monitoring-on-values.yaml"))
    (sm,) = by_kind(objs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (pm,) = by_kind(objs, "PodMonitor")
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert pm["spec"]["selector"]["matchExpressions"][0]["key"] == "hettrain.dev/job"
    (cm,) = [c for c in by_kind(objs, "ConfigMap") if c["metadata"]["name"].endswith("dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = (ROOT / "monitoring" / "dashboards" / "hettrain.json").read_text()
    assert cm["data"]["hettrain.json"] == dashboard.rstrip("\n")
    (rule,) = by_kind(objs, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((ROOT / "monitoring" / "alerts.yaml").read_text())
    # training pods: the operator makes one NetworkPolicy per job; the chart names the scraper
    assert not [n for n in by_kind(objs, "NetworkPolicy") if "training" in n["metadata"]["name"]]
    env = {e["name"]: e.get("value") for e in by_kind(objs, "Deployment")[0]["spec"]["template"][
        "spec"]["containers"][0]["env"]}
    assert env["HETTRAIN_SCRAPER_NAMESPACE"] == "prometheus"


def test_shared_cluster_settings_reach_the_operator_and_one_replica_has_no_pdb(helm: Path
                                                                             ) -> None:
    objs = render(helm, "--set", "operator.allowedPriorityClasses={batch,low}",
                  "--set", "operator.planning.timeoutSeconds=12",
                  "--set", "operator.planning.memoryMiB=512")
    env = {e["name"]: e.get("value") for e in by_kind(objs, "Deployment")[0]["spec"]["template"][
        "spec"]["containers"][0]["env"]}
    assert env["HETTRAIN_ALLOWED_PRIORITY_CLASSES"] == "batch,low"
    assert env["HETTRAIN_PLAN_TIMEOUT_SECONDS"] == "12"
    assert env["HETTRAIN_PLAN_MEMORY_MB"] == "512"
    assert env["HETTRAIN_PLAN_WORKERS"] == "2"
    assert env["HETTRAIN_UNSCHEDULABLE_SECONDS"] == "120"
    assert env["HETTRAIN_SCRAPER_NAMESPACE"] == "monitoring"
    assert not by_kind(objs, "PodDisruptionBudget")  # a one-replica PDB blocks node drains


def test_chart_crds_are_a_synced_copy_of_crds_dir() -> None:
    src = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    assert src, "crds/*.yaml missing"
    assert sorted(p.name for p in (CHART / "crds").glob("*.yaml")) == src, "run tools/sync-crds"
    for name in src:
        assert filecmp.cmp(ROOT / "crds" / name, CHART / "crds" / name, shallow=False), (
            f"charts/hettrain-operator/crds/{name} differs from crds/{name}: run tools/sync-crds")


@pytest.mark.parametrize("src", ["alerts.yaml", "dashboards/hettrain.json"])
def test_chart_monitoring_files_are_synced(src: str) -> None:
    copy = CHART / "files" / Path(src).name
    assert filecmp.cmp(ROOT / "monitoring" / src, copy, shallow=False), (
        f"{copy} differs from monitoring/{src}: run tools/sync-monitoring")


def test_topology_configmap_feeds_the_operator(helm: Path, tmp_path: Path) -> None:
    """operator.topology renders a cluster YAML the operator's own loader accepts, mounted + env."""
    from hettrain.planning.inventory import load_topology

    example = yaml.safe_load((ROOT / "examples" / "clusters" / "four-vendors-two-dcs.yaml")
                             .read_text())
    values = tmp_path / "topology.yaml"
    values.write_text(yaml.safe_dump({"operator": {"topology": {"links": example["links"]}}}))
    objs = render(helm, "-f", str(values))
    (cm,) = [c for c in by_kind(objs, "ConfigMap") if c["metadata"]["name"].endswith("topology")]
    links, devices = load_topology(yaml.safe_load(cm["data"]["cluster.yaml"]))
    assert [(sorted((lk.a, lk.b)), lk.bandwidth_gbps) for lk in links] == [
        (["eu-west", "us-east"], 100.0)] and devices == {}
    pod = by_kind(objs, "Deployment")[0]["spec"]["template"]
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["HETTRAIN_CLUSTER_CONFIG"] == "/etc/hettrain/topology/cluster.yaml"
    mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["topology"] == "/etc/hettrain/topology"
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols["topology"]["configMap"]["name"] == cm["metadata"]["name"]
    assert "checksum/topology" in pod["metadata"]["annotations"]
    plain = render(helm)
    names = [o["metadata"]["name"] for o in by_kind(plain, "ConfigMap")]
    assert not [n for n in names if n.endswith("topology")]
    plain_pod = by_kind(plain, "Deployment")[0]["spec"]["template"]["spec"]
    assert "HETTRAIN_CLUSTER_CONFIG" not in {e["name"] for e in plain_pod["containers"][0]["env"]}


def test_schema_rejects_a_link_without_bandwidth(helm: Path) -> None:
    out = helm_template(helm, "--set-json",
                        'operator.topology.links=[{"between":["a","b"],"latencyMs":5}]')
    assert out.returncode != 0 and "bandwidthGbps" in out.stderr


def test_finalizer_policy_reaches_the_operator_and_refuses_peering(helm: Path) -> None:
    pod = by_kind(render(helm, "--set", "operator.finalizerPolicy=none"), "Deployment")[0]
    env = {e["name"]: e.get("value") for e in
           pod["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["HETTRAIN_FINALIZER_POLICY"] == "none"
    out = helm_template(helm, "--set", "operator.finalizerPolicy=none",
                        "--set", "peering.enabled=true")
    assert out.returncode != 0 and "finalizerPolicy=none" in out.stderr
    bad = helm_template(helm, "--set", "operator.finalizerPolicy=sometimes")
    assert bad.returncode != 0 and "finalizerPolicy" in bad.stderr


def test_operator_namespace_is_admitted_to_the_metrics_ports_by_default(helm: Path) -> None:
    def operator_env(*args: str) -> dict[str, dict]:
        objs = render(helm, *args)
        return {e["name"]: e for e in by_kind(objs, "Deployment")[0]["spec"]["template"][
            "spec"]["containers"][0]["env"]}

    env = operator_env()
    # the downward API gives the operator its own namespace; each job's NetworkPolicy then
    # admits it to the training pods' metrics ports (calibration reads them)
    assert env["HETTRAIN_OPERATOR_NAMESPACE"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.namespace"}}
    assert "HETTRAIN_OPERATOR_NAMESPACE" not in operator_env(
        "--set", "networkPolicy.admitOperatorNamespace=false")
