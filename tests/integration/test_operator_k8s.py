"""The operator against the real local control plane with kwok heterogeneous GPU nodes.

One operator subprocess per module (``opproc.OperatorProcess``; log in a temp file, shown on
failures). Every test uses its own kwok pools (unique prefix) and namespace, so they do not
interfere. Run: ``.venv/bin/pytest tests/integration -m k8s -q``.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from e2e.cluster import kwoknodes
from e2e.cluster.pytest_plugin import K8sCluster, exists, wait_for
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException
from opproc import CRD, ROOT, OperatorProcess, http_get
from prometheus_client.parser import text_string_to_metric_families

from hettrain.api import constants as c
from hettrain.kube import apply as kube
from hettrain.planning.plan import Plan

pytestmark = pytest.mark.k8s


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def operator(k8s_cluster: K8sCluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    """CRD applied; the operator running as a subprocess for the whole module."""
    k8s_cluster.kubectl("apply", "--server-side", "-f", str(CRD))
    k8s_cluster.kubectl("wait", "--for=condition=Established", "--timeout=30s",
                        "crd/hettrainingjobs.hettrain.dev")
    op = OperatorProcess(k8s_cluster.kubeconfig,
                         tmp_path_factory.mktemp("operator") / "operator.log")
    op.start()
    try:
        yield op
    finally:
        op.stop()


class Ctx:
    """What a test needs: API, namespace, operator (for its log), and helpers."""

    def __init__(self, cluster: K8sCluster, ns: str, op: OperatorProcess) -> None:
        self.cluster, self.api, self.ns, self.op = cluster, cluster.api, ns, op
        self.core = k8s.CoreV1Api(cluster.api)
        self.custom = k8s.CustomObjectsApi(cluster.api)
        self.nodes: Callable[..., list[str]] = lambda *a, **k: []

    def wait(self, predicate: Callable[[], Any], timeout: float, what: str,
             interval: float = 0.1) -> Any:
        """Poll until truthy; on timeout fail with the cluster state and the operator's log."""
        try:
            return wait_for(predicate, timeout, interval, what)
        except TimeoutError as err:
            pytest.fail(f"{err}\n--- cluster ---\n{self.snapshot()}\n"
                        f"--- operator log tail ---\n{self.op.tail()}", pytrace=False)

    def snapshot(self) -> str:
        """Jobs (phase, attempt, repairs, conditions) and pods of the namespace, for failures."""
        lines = []
        for job in self.custom.list_namespaced_custom_object(c.GROUP, c.VERSION, self.ns,
                                                             c.PLURAL)["items"]:
            st = job.get("status") or {}
            lines.append(f"job {job['metadata']['name']}: phase={st.get('phase')} "
                         f"attempt={st.get('attempt')} repairs={st.get('repairs')}")
            lines += [f"  {x['type']}={x['status']} {x['reason']}: {x['message'][:200]}"
                      for x in st.get("conditions") or []]
        for p in self.core.list_namespaced_pod(self.ns).items:
            lines.append(f"pod {p.metadata.name} {p.status.phase} node={p.spec.node_name} "
                         f"deleting={p.metadata.deletion_timestamp is not None}")
        return "\n".join(lines)

    def create(self, doc: dict[str, Any]) -> None:
        self.custom.create_namespaced_custom_object(c.GROUP, c.VERSION, self.ns, c.PLURAL, doc)

    def get(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(c.GROUP, c.VERSION, self.ns, c.PLURAL,
                                                        name)

    def status(self, name: str) -> dict[str, Any]:
        return self.get(name).get("status") or {}

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(c.GROUP, c.VERSION, self.ns, c.PLURAL, name,
                                                   {"spec": spec})

    def pods(self, job: str) -> list[Any]:
        return self.core.list_namespaced_pod(
            self.ns, label_selector=f"{c.LABEL_JOB}={job}").items

    def live_pods(self, job: str) -> list[Any]:
        return [p for p in self.pods(job) if p.metadata.deletion_timestamp is None]

    def plan(self, name: str) -> Plan:
        cm = self.status(name)["plan"]["configMap"]
        data = self.core.read_namespaced_config_map(cm, self.ns).data
        return Plan.from_json(data[c.PLAN_CONFIGMAP_KEY])

    def events(self, name: str) -> list[Any]:
        return self.core.list_namespaced_event(
            self.ns, field_selector=f"involvedObject.name={name}").items

    def wait_running(self, name: str, timeout: float = 60.0) -> tuple[dict[str, Any], list[Any]]:
        """Phase Running and one Running pod per planned node; (status, pods)."""
        def ready() -> Any:
            st = self.status(name)
            if st.get("phase") != c.PHASE_RUNNING or not st.get("plan"):
                return None
            pods = self.live_pods(name)
            attempt = str(st["attempt"])
            if len(pods) == len(st["plan"]["nodes"]) and all(
                    p.status.phase == "Running" and p.metadata.labels[c.LABEL_ATTEMPT] == attempt
                    for p in pods):
                return st, pods
            return None
        return self.wait(ready, timeout, f"job {name} Running with all pods")


@pytest.fixture
def ctx(k8s_cluster: K8sCluster, namespace: str, operator: OperatorProcess, kwok_nodes: Any
        ) -> Iterator[Ctx]:
    """Per test: its namespace; afterwards its jobs are deleted (and gone) before its kwok
    nodes, so no job is left repairing into a terminating namespace."""
    context = Ctx(k8s_cluster, namespace, operator)

    def nodes(cluster: dict[str, Any]) -> list[str]:
        """Ready kwok nodes, also untainted (the lifecycle controller lifts the initial
        not-ready taint a moment after Ready; the planner skips tainted nodes)."""
        names = kwok_nodes(cluster)
        context.wait(lambda: all(not kwoknodes.node_taints(context.api, n) for n in names), 60,
                     "new nodes untainted", interval=0.2)
        return names

    context.nodes = nodes
    yield context
    context.custom.delete_collection_namespaced_custom_object(c.GROUP, c.VERSION, namespace,
                                                              c.PLURAL)
    context.wait(lambda: not context.custom.list_namespaced_custom_object(
        c.GROUP, c.VERSION, namespace, c.PLURAL)["items"], 30, "jobs deleted")


def _prefix() -> str:
    return f"p{uuid.uuid4().hex[:5]}"


def _pools(prefix: str, nodes: int = 2, gpus: int = 8) -> dict[str, Any]:
    return {"apiVersion": c.API_VERSION, "kind": "Cluster", "metadata": {"name": prefix},
            "datacenters": [{"name": "dc-a"}, {"name": "dc-b"}],
            "pools": [
                {"name": f"{prefix}-h100", "datacenter": "dc-a", "device": "H100-SXM",
                 "vendor": "nvidia", "nodes": nodes, "gpusPerNode": gpus},
                {"name": f"{prefix}-mi300", "datacenter": "dc-b", "device": "MI300X",
                 "vendor": "amd", "nodes": nodes, "gpusPerNode": gpus}]}


def _job(name: str, prefix: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"preset": "gpt3-1.3b"}, "training": {"globalBatch": 64, "steps": 10},
        "placement": {"pools": [f"{prefix}-h100", f"{prefix}-mi300"]},
        "data": {"synthetic": True}, "checkpoint": {"uri": "/ckpt"},
        "failurePolicy": {"maxRepairs": 3, "minGPUs": 8, "debounceSeconds": 0.5}}
    body.update(spec)
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name},
            "spec": body}


def _env(pod: Any) -> dict[str, str]:
    return {e.name: e.value for e in pod.spec.containers[0].env}


def _affinity_node(pod: Any) -> str:
    terms = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
    return str(terms.node_selector_terms[0].match_expressions[0].values[0])


def _assert_pods_match_plan(pods: list[Any], plan: Plan, attempt: int, resume: bool) -> None:
    """Every pod is pinned to and bound on a planned node, hosting exactly its ranks."""
    by_node = {_affinity_node(p): p for p in pods}
    assert sorted(by_node) == sorted(plan.nodes()), "one pod per planned node"
    assert len(by_node) == len(pods), "no two pods on one node"
    for node, pod in by_node.items():
        ranks = [r.rank for r in plan.ranks_on(node)]
        env = _env(pod)
        assert pod.spec.node_name == node
        assert pod.metadata.labels[c.LABEL_ATTEMPT] == str(attempt)
        assert env[c.ENV_NODE_RANK_START] == str(ranks[0])
        assert env[c.ENV_LOCAL_WORLD_SIZE] == str(len(ranks))
        assert env[c.ENV_WORLD_SIZE] == str(plan.world_size)
        assert env[c.ENV_RESUME] == ("1" if resume else "0")
        assert env[c.ENV_CHECKPOINT_URI] == "/ckpt"
        assert pod.metadata.owner_references[0].kind == c.KIND
        assert pod.metadata.owner_references[0].controller is True


def _metrics(op: OperatorProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, text = http_get(op.metrics_url)
    assert status == 200
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _sample(m: dict[Any, float], name: str, **labels: str) -> float | None:
    return m.get((name, tuple(sorted(labels.items()))))


# ---------------------------------------------------------------- launch, kubectl, metrics


def test_create_launches_pods_on_the_planned_nodes(ctx: Ctx) -> None:
    prefix = _prefix()
    ctx.nodes(_pools(prefix))
    ctx.create(_job("llm", prefix))
    st, pods = ctx.wait_running("llm")
    plan = ctx.plan("llm")
    assert st["attempt"] == 1 and st["worldSize"] == plan.world_size
    assert st["plan"]["hash"] == plan.fingerprint()
    assert sorted(st["plan"]["nodes"]) == sorted(plan.nodes())
    _assert_pods_match_plan(pods, plan, attempt=1, resume=False)
    svc = ctx.core.read_namespaced_service("llm-ranks", ctx.ns)
    assert svc.spec.cluster_ip == "None"
    conds = {x["type"]: x for x in st["conditions"]}
    assert conds[c.COND_PLANNED]["status"] == "True"
    assert conds[c.COND_RUNNING]["status"] == "True"
    assert any(e.reason == c.REASON_PLAN_FOUND for e in ctx.events("llm"))

    # the real kubectl: printer columns and describe
    out = ctx.cluster.kubectl("get", "htj", "-n", ctx.ns).splitlines()
    assert out[0].split() == ["NAME", "PHASE", "GPUS", "POOLS", "DCS", "TOKENS/S", "RESTARTS",
                              "AGE"]
    row = out[1].split()
    assert row[:4] == ["llm", "Running", str(plan.world_size), ",".join(plan.pools)]
    assert row[4] == ",".join(plan.datacenters)
    assert float(row[5]) == pytest.approx(plan.predicted.tokens_per_s, rel=1e-3)
    assert row[6] == "0"
    described = ctx.cluster.kubectl("describe", "htj", "llm", "-n", ctx.ns)
    for pattern in (r"Kind:\s+HetTrainingJob", r"Conditions:", r"Type:\s+Planned",
                    r"Reason:\s+PlanFound", r"Phase:\s+Running", r"Events:",
                    rf"Normal\s+PlanFound\s+.*dp={plan.dp} pp={plan.pp}",
                    rf"Hash:\s+{plan.fingerprint()}", rf"World Size:\s+{plan.world_size}"):
        assert re.search(pattern, described), (pattern, described)

    # metrics over HTTP from the running operator
    m = _metrics(ctx.op)
    assert _sample(m, "hettrain_job_phase", namespace=ctx.ns, job="llm", phase="Running") == 1
    assert (_sample(m, "hettrain_jobs", phase="Running") or 0) >= 1
    assert _sample(m, "hettrain_job_world_size", namespace=ctx.ns, job="llm") == plan.world_size
    tokens = _sample(m, "hettrain_job_predicted_tokens_per_second", namespace=ctx.ns, job="llm")
    assert tokens == pytest.approx(plan.predicted.tokens_per_s)
    mfu = _sample(m, "hettrain_job_predicted_mfu", namespace=ctx.ns, job="llm")
    assert mfu == pytest.approx(plan.predicted.mfu)
    assert (_sample(m, "hettrain_plan_duration_seconds_count") or 0) >= 1
    assert _sample(m, "hettrain_plan_duration_seconds_bucket", le="+Inf") == _sample(
        m, "hettrain_plan_duration_seconds_count")
    assert _sample(m, "hettrain_reconcile_errors_total", handler="reconcile") is not None
    health = ctx.op.health()  # kopf caches probe results (up to a minute), so only the shape
    assert isinstance(health["jobs"], int) and health["jobs"] >= 0


# ---------------------------------------------------------------- repair


@pytest.mark.parametrize("fault", ["not-ready", "unreachable", "deleted", "burst-of-two"])
def test_node_loss_repairs_on_the_survivors_with_resume(ctx: Ctx, fault: str) -> None:
    """NotReady (Ready=False), unreachable (Unknown) or deleted node → one repair on the
    survivors; two nodes failing together within the debounce window → still one repair."""
    prefix = _prefix()
    ctx.nodes(_pools(prefix))
    extra = {"parallelism": {"dp": 16, "pp": 1, "tp": 1}} if fault == "burst-of-two" else {}
    ctx.create(_job("llm", prefix, failurePolicy={"maxRepairs": 3, "minGPUs": 8,
                                                  "debounceSeconds": 2}, **extra))
    st, pods = ctx.wait_running("llm")
    old_names = {p.metadata.name for p in pods}
    planned = sorted(st["plan"]["nodes"])
    lost = planned if fault == "burst-of-two" else planned[:1]
    assert len(lost) == (2 if fault == "burst-of-two" else 1)
    for node in lost:
        if fault == "deleted":
            kwoknodes.delete_nodes(ctx.api, [node])
        else:
            kwoknodes.mark_not_ready(ctx.api, node, kwoknodes.FAULT_UNREACHABLE
                                     if fault == "unreachable" else kwoknodes.FAULT_NOT_READY)

    ctx.wait(lambda: ctx.status("llm").get("phase") == c.PHASE_REPAIRING, 30,
             "phase Repairing", interval=0.05)
    st, pods = ctx.wait_running("llm", 60)
    assert st["attempt"] == 2
    assert st["repairs"]["count"] == 1 and st["repairs"]["lastCause"] == c.REASON_NODE_LOST
    assert st["repairs"]["history"][0]["nodes"] == lost
    assert st["restarts"] == 1
    assert set(lost) <= set(st["failedNodes"])
    plan = ctx.plan("llm")
    assert not set(lost) & set(plan.nodes()) and not set(lost) & set(st["plan"]["nodes"])
    _assert_pods_match_plan(pods, plan, attempt=2, resume=True)
    assert not old_names & {p.metadata.name for p in ctx.pods("llm")}, "old gang torn down"
    assert not exists(ctx.core.read_namespaced_config_map, "llm-plan-a1", ctx.ns)
    reasons = [e.reason for e in ctx.events("llm")]
    assert reasons.count(c.REASON_NODE_LOST) >= 2  # "repairing" + "repair 1: re-planning"
    m = _metrics(ctx.op)
    assert _sample(m, "hettrain_repairs_total", namespace=ctx.ns, job="llm",
                   cause=c.REASON_NODE_LOST) == 1


def test_failed_pod_repairs_and_max_repairs_fails_the_job(ctx: Ctx) -> None:
    prefix = _prefix()
    ctx.nodes(_pools(prefix))
    ctx.create(_job("llm", prefix, failurePolicy={"maxRepairs": 1, "minGPUs": 8,
                                                  "debounceSeconds": 0}))
    _, pods = ctx.wait_running("llm")

    def fail_pod(pod: Any) -> None:
        ctx.core.patch_namespaced_pod_status(pod.metadata.name, ctx.ns, {"status": {
            "phase": "Failed", "reason": "Error"}})

    fail_pod(pods[0])
    st, pods = ctx.wait_running("llm", 60)
    assert st["attempt"] == 2 and st["repairs"]["lastCause"] == c.REASON_POD_FAILED
    fail_pod(pods[0])
    st = ctx.wait(lambda: ctx.status("llm").get("phase") == c.PHASE_FAILED
                  and ctx.status("llm"), 60, "phase Failed after maxRepairs")
    cond = next(x for x in st["conditions"] if x["type"] == c.COND_FAILED)
    assert cond["reason"] == c.REASON_MAX_REPAIRS and "maxRepairs (1)" in cond["message"]
    ctx.wait(lambda: not ctx.live_pods("llm"), 30, "pods deleted after failure")


def test_wait_for_replacement_waits_then_relaunches_on_the_new_node(ctx: Ctx) -> None:
    """mode WaitForReplacement: the only node of the job's pool fails → the gang is torn
    down and the job waits (no shrink, no failure); a replacement node joins the pool → the
    job relaunches there at the same size."""
    prefix = _prefix()
    ctx.nodes(_pools(prefix, nodes=1))
    pool = f"{prefix}-h100"
    ctx.create(_job("llm", prefix, placement={"pools": [pool]},
                    failurePolicy={"mode": "WaitForReplacement", "waitSeconds": 120,
                                   "debounceSeconds": 0, "minGPUs": 8}))
    st, _ = ctx.wait_running("llm")
    world = st["worldSize"]
    lost = st["plan"]["nodes"][0]
    kwoknodes.mark_not_ready(ctx.api, lost)

    def waiting() -> Any:
        s = ctx.status("llm")
        cond = next((x for x in s.get("conditions") or [] if x["type"] == c.COND_REPAIRING),
                    None)
        return (s.get("phase") == c.PHASE_REPAIRING and cond and cond["status"] == "True"
                and cond["reason"] == c.REASON_WAITING_REPLACEMENT and not ctx.live_pods("llm")
                and s)
    st = ctx.wait(waiting, 30, "Repairing / WaitingForReplacement with the gang torn down")
    assert st["attempt"] == 1 and not st.get("repairs")
    time.sleep(2.0)
    assert ctx.status("llm")["phase"] == c.PHASE_REPAIRING, "it must keep waiting"
    grown = next(p for p in kwoknodes.load_cluster(_pools(prefix, nodes=2)) if p.name == pool)
    new_node = kwoknodes.node_name(pool, 1)
    kube.request(ctx.api, "POST", "/api/v1/nodes", kwoknodes.node_manifest(grown, 1))
    try:
        st, pods = ctx.wait_running("llm", 60)
    finally:
        kwoknodes.delete_nodes(ctx.api, [new_node])
    assert st["attempt"] == 2 and st["worldSize"] == world
    assert st["plan"]["nodes"] == [new_node]
    assert pods[0].spec.node_name == new_node
    assert st["repairs"]["count"] == 1 and st["repairs"]["lastCause"] == c.REASON_NODE_LOST
    _assert_pods_match_plan(pods, ctx.plan("llm"), attempt=2, resume=True)


# ---------------------------------------------------------------- operator restart


def test_operator_killed_mid_launch_resumes_without_duplicates(ctx: Ctx) -> None:
    prefix = _prefix()
    ctx.nodes(_pools(prefix, nodes=32, gpus=1))
    want = 64
    # one create at a time, so the SIGKILL reliably lands in the middle of the gang
    ctx.op.restart(env={"HETTRAIN_CREATE_PARALLELISM": "1"})
    try:
        ctx.create(_job("big", prefix, model={"preset": "gpt-small"},
                        parallelism={"pp": 2, "dp": 32, "tp": 1}))
        seen = ctx.wait(lambda: len(ctx.pods("big")), 60, "the first pod", interval=0.01)
        ctx.op.kill()
        at_kill = len(ctx.pods("big"))
        assert 1 <= seen <= at_kill < want, f"kill landed after the launch ({at_kill} pods)"
        assert ctx.status("big")["attempt"] == 1
    finally:
        ctx.op.start()
    st = ctx.wait(lambda: len(ctx.live_pods("big")) == want and ctx.status("big"), 60,
                  f"all {want} pods after the restart")
    time.sleep(1.0)  # let a wrongly re-planning operator show itself
    pods = ctx.pods("big")
    plan = ctx.plan("big")
    assert st["attempt"] == 1 and not st.get("repairs")
    assert len(pods) == want == len(plan.nodes())
    assert sorted(p.metadata.name for p in pods) == sorted(
        f"big-a1-r{plan.ranks_on(n)[0].rank}" for n in plan.nodes())
    ctx.wait(lambda: ctx.status("big").get("phase") == c.PHASE_RUNNING, 60, "Running")
    _assert_pods_match_plan(ctx.pods("big"), plan, attempt=1, resume=False)


# ---------------------------------------------------------------- lifecycle


def test_suspend_deletes_pods_and_resume_relaunches(ctx: Ctx) -> None:
    prefix = _prefix()
    ctx.nodes(_pools(prefix))
    ctx.create(_job("llm", prefix))
    ctx.wait_running("llm")
    ctx.patch_spec("llm", {"suspend": True})
    ctx.wait(lambda: ctx.status("llm").get("phase") == c.PHASE_SUSPENDED
             and not ctx.live_pods("llm"), 30, "Suspended with no pods")
    st = ctx.status("llm")
    assert next(x for x in st["conditions"] if x["type"] == c.COND_SUSPENDED)["status"] == "True"
    ctx.patch_spec("llm", {"suspend": False})
    st, pods = ctx.wait_running("llm")
    assert st["attempt"] == 2
    _assert_pods_match_plan(pods, ctx.plan("llm"), attempt=2, resume=True)


def test_spec_change_replans(ctx: Ctx) -> None:
    prefix = _prefix()
    ctx.nodes(_pools(prefix))
    ctx.create(_job("llm", prefix, placement={"pools": [f"{prefix}-h100"]}))
    st, _ = ctx.wait_running("llm")
    assert st["plan"]["pools"] == [f"{prefix}-h100"]
    ctx.patch_spec("llm", {"placement": {"pools": [f"{prefix}-mi300"]}})
    st, pods = ctx.wait(lambda: ctx.status("llm").get("attempt") == 2
                        and ctx.wait_running("llm"), 60, "re-plan to attempt 2")
    assert st["plan"]["pools"] == [f"{prefix}-mi300"]
    assert st["observedGeneration"] == ctx.get("llm")["metadata"]["generation"]
    _assert_pods_match_plan(pods, ctx.plan("llm"), attempt=2, resume=True)


def test_delete_garbage_collects_children(ctx: Ctx) -> None:
    prefix = _prefix()
    ctx.nodes(_pools(prefix))
    ctx.create(_job("llm", prefix))
    ctx.wait_running("llm")
    cm = ctx.status("llm")["plan"]["configMap"]
    ctx.custom.delete_namespaced_custom_object(c.GROUP, c.VERSION, ctx.ns, c.PLURAL, "llm")
    ctx.wait(lambda: not exists(ctx.custom.get_namespaced_custom_object, c.GROUP, c.VERSION,
                                ctx.ns, c.PLURAL, "llm"), 30, "job gone (finalizer released)")
    ctx.wait(lambda: not ctx.pods("llm")
             and not exists(ctx.core.read_namespaced_config_map, cm, ctx.ns)
             and not exists(ctx.core.read_namespaced_service, "llm-ranks", ctx.ns),
             60, "pods, ConfigMap and Service garbage-collected")
    m = _metrics(ctx.op)
    assert _sample(m, "hettrain_job_phase", namespace=ctx.ns, job="llm", phase="Running") is None


# ---------------------------------------------------------------- bad input


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
    ({"crossDC": {"mode": "compress", "compression": "none"}}, "spec.crossDC.compression"),
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
    ({"parallelism": {"pp": 3}, "model": {"layers": 2, "hidden": 64, "heads": 4, "seqLen": 8,
                                          "vocab": 8}}, "spec.parallelism.pp"),
]


@pytest.fixture(scope="module")
def bad_ns(k8s_cluster: K8sCluster, operator: OperatorProcess) -> Iterator[str]:
    """One namespace for all malformed specs (they create nothing that could collide)."""
    core = k8s.CoreV1Api(k8s_cluster.api)
    name = f"t-bad-{uuid.uuid4().hex[:6]}"
    core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=name)))
    try:
        yield name
    finally:
        core.delete_namespace(name, propagation_policy="Background")


@pytest.mark.parametrize(("patch", "field_path"), BAD_SPECS,
                         ids=[f"{i:02d}-{p}" for i, (_, p) in enumerate(BAD_SPECS)])
def test_malformed_spec_is_rejected_naming_the_field(k8s_cluster: K8sCluster, bad_ns: str,
                                                     operator: OperatorProcess,
                                                     patch: dict[str, Any], field_path: str
                                                     ) -> None:
    """Rejected by the apiserver (422 naming the field), or else InvalidSpec/PlanFailed with
    the reason, an Event and zero pods."""
    ctx = Ctx(k8s_cluster, bad_ns, operator)
    name = f"bad-{uuid.uuid4().hex[:6]}"
    try:
        ctx.create(_job(name, "none", **patch))
    except ApiException as err:
        assert err.status == 422, (patch, err.body)
        assert field_path in err.body, (patch, field_path, err.body)
        assert not exists(ctx.custom.get_namespaced_custom_object, c.GROUP, c.VERSION, bad_ns,
                          c.PLURAL, name)
        return
    st = ctx.wait(lambda: ctx.status(name).get("phase") == c.PHASE_FAILED and ctx.status(name),
                  30, f"{name} Failed")
    cond = next(x for x in st["conditions"] if x["type"] == c.COND_PLANNED)
    assert cond["status"] == "False"
    assert cond["reason"] in (c.REASON_INVALID_SPEC, c.REASON_PLAN_FAILED)
    assert field_path in cond["message"]
    assert ctx.wait(lambda: [e for e in ctx.events(name) if e.reason == cond["reason"]], 10,
                    "the Event")
    assert ctx.pods(name) == []


@pytest.mark.parametrize(("spec", "needle"), [
    ({"model": {"preset": "llama3-405b"}, "failurePolicy": {"minGPUs": 1}}, ""),
    ({"placement": {"pools": ["no-such-pool"]}}, "no pools match spec.placement"),
], ids=["model-too-big", "no-matching-pool"])
def test_unplannable_job_gets_planfailed_event_and_zero_pods(ctx: Ctx,
                                                             spec: dict[str, Any], needle: str
                                                             ) -> None:
    prefix = _prefix()
    ctx.nodes(_pools(prefix))
    ctx.create(_job("np", prefix, **spec))
    st = ctx.wait(lambda: ctx.status("np").get("phase") == c.PHASE_FAILED and ctx.status("np"),
                  60, "phase Failed")
    cond = next(x for x in st["conditions"] if x["type"] == c.COND_PLANNED)
    assert cond["status"] == "False" and cond["reason"] == c.REASON_PLAN_FAILED
    assert cond["message"] and needle in cond["message"]
    events = ctx.wait(lambda: [e for e in ctx.events("np") if e.reason == c.REASON_PLAN_FAILED],
                      10, "PlanFailed Event")
    assert events[0].type == "Warning" and events[0].message == cond["message"][:1000]
    assert ctx.pods("np") == []
    m = _metrics(ctx.op)
    assert _sample(m, "hettrain_plan_failures_total", namespace=ctx.ns, job="np",
                   reason=c.REASON_PLAN_FAILED) == 1
    out = ctx.cluster.kubectl("get", "htj", "np", "-n", ctx.ns, "-o", "json")
    assert json.loads(out)["status"]["phase"] == c.PHASE_FAILED


# ---------------------------------------------------------------- HA (kopf peering)


def test_ha_peering_only_the_leader_acts_and_the_standby_takes_over(
        ctx: Ctx, tmp_path: Any) -> None:
    """Two replicas with --peering: the higher priority one launches jobs, the other stays
    paused (no job series in its metrics); when the leader exits, the standby takes over."""
    ctx.cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "kopf-peering.yaml"))
    ctx.cluster.kubectl("wait", "--for=condition=Established", "--timeout=30s",
                        "crd/clusterkopfpeerings.kopf.dev")
    peering = f"hettrain-{uuid.uuid4().hex[:6]}"
    ctx.cluster.kubectl("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
         "metadata": {"name": peering}}))
    prefix = _prefix()
    ctx.nodes(_pools(prefix))
    leader = OperatorProcess(ctx.cluster.kubeconfig, tmp_path / "leader.log",
                             mode=[f"--peering={peering}", "--priority=200"])
    standby = OperatorProcess(ctx.cluster.kubeconfig, tmp_path / "standby.log",
                              mode=[f"--peering={peering}", "--priority=100"])
    module_op = ctx.op
    module_op.stop()  # the module's standalone operator would handle everything
    try:
        leader.start()
        standby.start()
        ctx.op = leader
        ctx.create(_job("one", prefix, placement={"pools": [f"{prefix}-h100"]}))
        ctx.wait_running("one")
        time.sleep(1.0)  # give a wrongly active standby time to show itself
        assert f"{ctx.ns}/one:" not in standby.log_path.read_text()
        lead_m, stand_m = _metrics(leader), _metrics(standby)
        assert _sample(lead_m, "hettrain_job_phase", namespace=ctx.ns, job="one",
                       phase="Running") == 1
        assert _sample(stand_m, "hettrain_job_phase", namespace=ctx.ns, job="one",
                       phase="Running") is None, "the standby acted while paused"
        leader.stop()  # a clean exit withdraws it from the peering object at once
        ctx.op = standby
        ctx.create(_job("two", prefix, placement={"pools": [f"{prefix}-mi300"]}))
        ctx.wait_running("two", 60)
        m = _metrics(standby)
        assert _sample(m, "hettrain_job_phase", namespace=ctx.ns, job="two",
                       phase="Running") == 1
        assert _sample(m, "hettrain_job_phase", namespace=ctx.ns, job="one",
                       phase="Running") == 1, "the standby resumed the leader's job"
        assert ctx.status("one")["attempt"] == 1, "taking over did not relaunch job one"
    finally:
        leader.stop()
        standby.stop()
        ctx.cluster.kubectl("delete", "clusterkopfpeering", peering, "--wait=false",
                            check=False)
        ctx.op = module_op
        module_op.start()  # also releases this test's jobs at teardown


# ---------------------------------------------------------------- jobs competing for nodes


def test_jobs_never_share_a_node_and_a_third_waits_for_capacity(ctx: Ctx) -> None:
    """Two jobs of 2 nodes each fill a 4-node cluster on disjoint nodes; a third waits Pending
    (naming the jobs holding the nodes) with zero pods, and launches once one is deleted."""
    prefix = _prefix()
    ctx.nodes(_pools(prefix))
    pins = {"parallelism": {"tp": 8, "pp": 2, "dp": 1}}
    ctx.create(_job("first", prefix, **pins))
    ctx.create(_job("second", prefix, **pins))
    _, first = ctx.wait_running("first")
    _, second = ctx.wait_running("second")
    nodes_first = {p.spec.node_name for p in first}
    nodes_second = {p.spec.node_name for p in second}
    assert len(nodes_first) == len(nodes_second) == 2 and nodes_first.isdisjoint(nodes_second)

    ctx.create(_job("third", prefix, **pins))

    def waiting() -> Any:
        st = ctx.status("third")
        cond = next((x for x in st.get("conditions") or () if x["type"] == c.COND_PLANNED), None)
        return st if st.get("phase") == c.PHASE_PENDING and cond and cond["status"] == "False" \
            else None
    st = ctx.wait(waiting, 30, "third job Pending")
    msg = next(x["message"] for x in st["conditions"] if x["type"] == c.COND_PLANNED)
    assert "held by other jobs" in msg and f"{ctx.ns}/first" in msg, msg
    assert ctx.pods("third") == []

    ctx.custom.delete_namespaced_custom_object(c.GROUP, c.VERSION, ctx.ns, c.PLURAL, "first")
    ctx.wait(lambda: not ctx.pods("first"), 60, "first job's pods gone")
    _, third = ctx.wait_running("third", timeout=90)
    assert {p.spec.node_name for p in third}.isdisjoint(nodes_second)


# ---------------------------------------------------------------- finalizer policy


def test_finalizer_policy_none_runs_jobs_without_a_finalizer(ctx: Ctx, tmp_path: Any) -> None:
    """HETTRAIN_FINALIZER_POLICY=none: jobs launch and repair as usual but carry no finalizer,
    a restarted operator picks its job up again, and with the operator gone a job still
    deletes at once (its children by ownerReferences)."""
    prefix = _prefix()
    ctx.nodes(_pools(prefix))
    module_op = ctx.op
    module_op.stop()
    op = OperatorProcess(ctx.cluster.kubeconfig, tmp_path / "nofinalizer.log",
                         env={"HETTRAIN_FINALIZER_POLICY": "none"})
    try:
        op.start()
        ctx.op = op
        ctx.create(_job("llm", prefix))
        _, pods = ctx.wait_running("llm")
        assert not ctx.get("llm")["metadata"].get("finalizers")
        op.stop()
        op.start()  # the initial listing restarts the job's loop: a node loss is repaired
        victim = pods[0].spec.node_name
        kwoknodes.mark_not_ready(ctx.api, victim)
        ctx.wait(lambda: ctx.status("llm").get("attempt") == 2
                 and ctx.status("llm").get("phase") == c.PHASE_RUNNING, 60,
                 "repaired by the restarted operator")
        op.stop()
        ctx.custom.delete_namespaced_custom_object(c.GROUP, c.VERSION, ctx.ns, c.PLURAL, "llm")
        ctx.wait(lambda: not exists(lambda: ctx.get("llm")), 10, "job deleted, no operator")
    finally:
        op.stop()
        ctx.op = module_op
        module_op.start()
