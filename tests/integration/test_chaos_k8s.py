"""Chaos on the real control plane: several HetTrainingJobs share kwok GPU nodes while a
seeded random sequence of faults hits them: nodes go NotReady/unreachable or are deleted,
gang pods fail, the operator is SIGKILLed and restarted, a job is deleted and recreated under
the same name, and the kube-apiserver itself is crashed and restarted (etcd keeps the
state). Replacement nodes join as real ones would. When the faults stop (and fresh capacity
arrives for jobs left waiting), the operator must settle every job to Running or Failed,
and then:

- no node is held by the live pods of two jobs (double booking), also sampled after every
  fault, nor by two Running jobs' recorded plans;
- no orphan pod (its job is gone or it belongs to a stale attempt) and no duplicate pod
  (two live pods for one rank of one job);
- no ForeignObject warning (a recreated job's leftovers are replaced, not foreign);
- every job's status agrees with its live pods: a Running job's pods are exactly its
  recorded plan's nodes and names (the plan ConfigMap of that attempt, owned by the job),
  all Running on Ready nodes not in ``failedNodes``; ``attempt == 1 + repairs`` and
  ``restarts == repairs <= maxRepairs``; a Failed job has no pods and names its reason.

The counts (faults by kind, jobs survived / re-planned / failed with reason) are printed and
written to ``chaos-report.json`` in the test's temp dir. ``HETTRAIN_CHAOS_SEED`` and
``HETTRAIN_CHAOS_ROUNDS`` change the run. Run alone:
``pytest tests/integration/test_chaos_k8s.py -m k8s -q``.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from e2e.cluster import kwoknodes
from e2e.cluster.pytest_plugin import K8sCluster, wait_for
from opproc import CRD, OperatorProcess

from hettrain.api import constants as c
from hettrain.kube import apply as kube
from hettrain.manifests.builders import configmap_name, plan_fingerprint, pod_names
from hettrain.manifests.ownership import controller_job
from hettrain.planning.plan import Plan

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

SEED = int(os.environ.get("HETTRAIN_CHAOS_SEED", "1603"))
ROUNDS = int(os.environ.get("HETTRAIN_CHAOS_ROUNDS", "18"))
NODES_PER_POOL = 7
PINS = {"tp": 8, "pp": 2, "dp": 1}  # every job: exactly 2 nodes of 8 GPUs
SETTLE_SECONDS = 150.0
OPERATOR_ENV = {"HETTRAIN_UNSCHEDULABLE_SECONDS": "20"}
# fault kind -> weight of the random choice (the apiserver restart is also forced once)
WEIGHTS = {"node-not-ready": 3, "node-delete": 2, "operator-kill": 2, "pod-fail": 1,
           "job-recreate": 1, "apiserver-restart": 0}

T = TypeVar("T")


# ---------------------------------------------------------------- the cluster as plain JSON


@dataclass
class World:
    """One consistent-enough read of what the invariants look at (raw JSON dicts)."""

    jobs: dict[str, dict[str, Any]]  # name -> job
    pods: list[dict[str, Any]]
    nodes: dict[str, dict[str, Any]]  # name -> node
    configmaps: dict[str, dict[str, Any]]  # name -> ConfigMap

    def live_pods(self) -> list[dict[str, Any]]:
        """Pods of hettrain jobs that still hold their node: not deleting, not finished."""
        return [p for p in self.pods if controller_job(p) is not None
                and not p["metadata"].get("deletionTimestamp")
                and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]

    def job_uid(self, name: str) -> str:
        return str(self.jobs[name]["metadata"]["uid"])


def read_world(api: Any, ns: str) -> World:
    """Jobs, pods and ConfigMaps of ``ns`` and all nodes, each one LIST."""
    jobs = kube.request(api, "GET", f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{ns}/{c.PLURAL}")[1]
    pods = kube.request(api, "GET", f"/api/v1/namespaces/{ns}/pods")[1]
    cms = kube.request(api, "GET", f"/api/v1/namespaces/{ns}/configmaps")[1]
    nodes = kube.request(api, "GET", "/api/v1/nodes?labelSelector=type%3Dkwok")[1]
    return World({j["metadata"]["name"]: j for j in jobs.get("items") or []},
                 list(pods.get("items") or []),
                 {n["metadata"]["name"]: n for n in nodes.get("items") or []},
                 {m["metadata"]["name"]: m for m in cms.get("items") or []})


def pod_node(pod: Mapping[str, Any]) -> str:
    """The node a gang pod is bound to, else the one its nodeAffinity pins it to."""
    spec = pod.get("spec") or {}
    if spec.get("nodeName"):
        return str(spec["nodeName"])
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return str(terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"][0])


def node_is_ready(node: Mapping[str, Any] | None) -> bool:
    """The node exists and its Ready condition is True."""
    return node is not None and any(
        x.get("type") == "Ready" and x.get("status") == "True"
        for x in (node.get("status") or {}).get("conditions") or ())


def _condition(job: Mapping[str, Any], ctype: str) -> dict[str, Any]:
    return next((x for x in (job.get("status") or {}).get("conditions") or ()
                 if x.get("type") == ctype), {})


# ---------------------------------------------------------------- invariants


def booking_violations(w: World) -> list[str]:
    """Double booking and duplicates among live pods (must hold at every instant): a node
    with live pods of two jobs (by owner uid), or one rank of one job in two live pods."""
    out = []
    by_node: dict[str, set[str]] = defaultdict(set)
    by_rank: dict[tuple[str, str], list[str]] = defaultdict(list)
    for p in w.live_pods():
        owner = controller_job(p)
        assert owner is not None
        by_node[pod_node(p)].add(f"{owner[0]}({owner[1][:8]})")
        by_rank[(owner[1], p["metadata"]["labels"].get(c.LABEL_RANK, "?"))].append(
            p["metadata"]["name"])
    out += [f"double booking: node {n} holds live pods of {sorted(jobs)}"
            for n, jobs in sorted(by_node.items()) if len(jobs) > 1]
    out += [f"duplicate pods for rank {rank} of job uid {uid[:8]}: {sorted(names)}"
            for (uid, rank), names in sorted(by_rank.items()) if len(names) > 1]
    return out


def settled_violations(w: World, max_repairs: Mapping[str, int]) -> list[str]:
    """Everything that must hold once the operator has settled (see the module docstring)."""
    out = booking_violations(w)
    uids = {w.job_uid(n): n for n in w.jobs}
    live = w.live_pods()
    pods_of: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in live:
        owner = controller_job(p)
        assert owner is not None
        job = uids.get(owner[1])
        if job is None:
            out.append(f"orphan pod {p['metadata']['name']}: its job {owner[0]} "
                       f"(uid {owner[1][:8]}) is gone")
            continue
        pods_of[job].append(p)
    planned_by: dict[str, list[str]] = defaultdict(list)
    for name, job in sorted(w.jobs.items()):
        st = job.get("status") or {}
        phase, attempt = st.get("phase"), int(st.get("attempt") or 0)
        pods = pods_of.get(name, [])
        stale = [p["metadata"]["name"] for p in pods
                 if p["metadata"]["labels"].get(c.LABEL_ATTEMPT) != str(attempt)]
        if stale:
            out.append(f"{name}: orphan pods of a stale attempt (status attempt {attempt}): "
                       f"{sorted(stale)}")
        repairs = int((st.get("repairs") or {}).get("count") or 0)
        if repairs > max_repairs[name]:
            out.append(f"{name}: {repairs} repairs > maxRepairs {max_repairs[name]}")
        if int(st.get("restarts") or 0) != repairs:
            out.append(f"{name}: restarts {st.get('restarts')} != repairs {repairs}")
        if phase == c.PHASE_FAILED:
            reason = _condition(job, c.COND_FAILED).get("reason")
            if not reason:
                out.append(f"{name}: Failed without a Failed condition reason")
            if reason == c.REASON_MAX_REPAIRS and repairs != max_repairs[name]:
                out.append(f"{name}: MaxRepairsExceeded after {repairs} repairs "
                           f"(maxRepairs {max_repairs[name]})")
            if pods:
                out.append(f"{name}: Failed but pods live: "
                           f"{sorted(p['metadata']['name'] for p in pods)}")
            continue
        if phase != c.PHASE_RUNNING:
            out.append(f"{name}: not settled (phase {phase})")
            continue
        if attempt != 1 + repairs:
            out.append(f"{name}: attempt {attempt} but {repairs} repairs (no spec change: "
                       "every new attempt is a repair)")
        out += _running_violations(name, job, pods, w)
        for node in (st.get("plan") or {}).get("nodes") or ():
            planned_by[node].append(name)
    out += [f"double booking: node {n} in the recorded plans of {sorted(jobs)}"
            for n, jobs in sorted(planned_by.items()) if len(jobs) > 1]
    return out


def _running_violations(name: str, job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]],
                        w: World) -> list[str]:
    """A Running job: its live pods are exactly its recorded plan (ConfigMap of the attempt,
    owned by the job), one per planned node, Running and bound on Ready nodes it never
    lost."""
    out = []
    st = job.get("status") or {}
    attempt = int(st["attempt"])
    summary = st.get("plan") or {}
    cm = w.configmaps.get(configmap_name(name, attempt))
    if summary.get("configMap") != configmap_name(name, attempt) or cm is None:
        return [f"{name}: plan ConfigMap of attempt {attempt} missing ({summary})"]
    owner = controller_job(cm)
    if owner is None or owner[1] != w.job_uid(name):
        out.append(f"{name}: plan ConfigMap {cm['metadata']['name']} not owned by the job")
    plan = Plan.from_json(cm["data"][c.PLAN_CONFIGMAP_KEY])
    if summary.get("hash") != plan_fingerprint(plan) or sorted(
            summary.get("nodes") or ()) != sorted(plan.nodes()):
        out.append(f"{name}: status.plan {summary.get('hash')} {summary.get('nodes')} != "
                   f"ConfigMap plan {plan_fingerprint(plan)} {plan.nodes()}")
    if int(st.get("worldSize") or 0) != plan.world_size:
        out.append(f"{name}: worldSize {st.get('worldSize')} != plan {plan.world_size}")
    names = sorted(p["metadata"]["name"] for p in pods)
    if names != sorted(pod_names(name, plan, attempt)):
        out.append(f"{name}: live pods {names} != plan's {sorted(pod_names(name, plan, attempt))}")
    if sorted(pod_node(p) for p in pods) != sorted(plan.nodes()):
        out.append(f"{name}: pods on {sorted(pod_node(p) for p in pods)} != plan nodes "
                   f"{sorted(plan.nodes())}")
    failed = set(st.get("failedNodes") or ())
    for p in pods:
        node = pod_node(p)
        if (p.get("status") or {}).get("phase") != "Running" or (p.get("spec") or {}).get(
                "nodeName") != node:
            out.append(f"{name}: pod {p['metadata']['name']} not Running on {node}")
        if not node_is_ready(w.nodes.get(node)):
            out.append(f"{name}: pod {p['metadata']['name']} on a lost node {node}")
        if node in failed:
            out.append(f"{name}: runs on {node}, which is in its failedNodes")
    return out


def settled(w: World) -> bool:
    """Every job Failed, or Running with one Running pod per planned node of its attempt."""
    uids = {w.job_uid(n): n for n in w.jobs}
    live: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in w.live_pods():
        owner = controller_job(p)
        if owner is not None and owner[1] in uids:
            live[uids[owner[1]]].append(p)
    for name, job in w.jobs.items():
        st = job.get("status") or {}
        if st.get("phase") == c.PHASE_FAILED:
            if live[name]:
                return False
            continue
        nodes = (st.get("plan") or {}).get("nodes") or []
        pods = live[name]
        if (st.get("phase") != c.PHASE_RUNNING or len(pods) != len(nodes) or not all(
                (p.get("status") or {}).get("phase") == "Running"
                and p["metadata"]["labels"].get(c.LABEL_ATTEMPT) == str(st.get("attempt"))
                for p in pods)):
            return False
    return True


# ---------------------------------------------------------------- the chaos run


def _pools(prefix: str, nodes: int = NODES_PER_POOL) -> dict[str, Any]:
    return {"apiVersion": c.API_VERSION, "kind": "Cluster", "metadata": {"name": prefix},
            "datacenters": [{"name": "dc-a"}, {"name": "dc-b"}],
            "pools": [
                {"name": f"{prefix}-h100", "datacenter": "dc-a", "device": "H100-SXM",
                 "vendor": "nvidia", "nodes": nodes, "gpusPerNode": 8},
                {"name": f"{prefix}-mi300", "datacenter": "dc-b", "device": "MI300X",
                 "vendor": "amd", "nodes": nodes, "gpusPerNode": 8}]}


def _jobs(prefix: str) -> dict[str, dict[str, Any]]:
    """Four small jobs: one per pool, two free to span both; one with a tight maxRepairs."""
    h100, mi300 = f"{prefix}-h100", f"{prefix}-mi300"
    specs = {"alpha": ([h100], 10), "bravo": ([mi300], 10), "charlie": ([h100, mi300], 10),
             "delta": ([h100, mi300], 2)}
    return {name: {
        "apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name},
        "spec": {"model": {"preset": "gpt3-1.3b"}, "training": {"globalBatch": 64, "steps": 10},
                 "parallelism": dict(PINS), "placement": {"pools": pools},
                 "data": {"synthetic": True}, "checkpoint": {"uri": "/ckpt"},
                 "failurePolicy": {"maxRepairs": max_repairs, "minGPUs": 8,
                                   "debounceSeconds": 1}}}
        for name, (pools, max_repairs) in specs.items()}


def _retry(fn: Callable[[], T], what: str, timeout: float = 60.0) -> T:
    """Call ``fn`` until it does not raise (the apiserver may be coming back)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except Exception as err:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: still failing after {timeout:.0f}s: {err}") from err
            time.sleep(0.5)


@dataclass
class Chaos:
    """The run's state: API, namespace, operator, RNG and what was done."""

    cluster: K8sCluster
    ns: str
    op: OperatorProcess
    prefix: str
    rng: random.Random
    docs: dict[str, dict[str, Any]]
    faults: Counter[str] = field(default_factory=Counter)
    log: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)  # replacement nodes (deleted at the end)
    next_index: dict[str, int] = field(default_factory=dict)
    transient: list[str] = field(default_factory=list)  # booking violations seen mid-run
    recreated: Counter[str] = field(default_factory=Counter)
    t0: float = field(default_factory=time.monotonic)

    @property
    def api(self) -> Any:
        return self.cluster.api

    def note(self, text: str) -> None:
        self.log.append(f"+{time.monotonic() - self.t0:6.1f}s {text}")

    def world(self) -> World:
        return _retry(lambda: read_world(self.api, self.ns), "read the cluster")

    def create_job(self, name: str) -> None:
        kube.request(self.api, "POST",
                     f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{self.ns}/{c.PLURAL}",
                     self.docs[name])

    # ------------------------------------------------------------ faults

    def victim_node(self, w: World) -> str | None:
        """Mostly a node under a live gang pod, sometimes any Ready node."""
        held = sorted({pod_node(p) for p in w.live_pods()} & set(w.nodes))
        ready = sorted(n for n, node in w.nodes.items() if node_is_ready(node))
        pick = held if held and self.rng.random() < 0.8 else ready
        return self.rng.choice(pick) if pick else None

    def node_not_ready(self, w: World) -> None:
        node = self.victim_node(w)
        if node is None:
            return
        fault = self.rng.choice(kwoknodes.FAULTS)
        kwoknodes.mark_not_ready(self.api, node, fault)
        self.note(f"node {node} {fault}")

    def node_delete(self, w: World) -> None:
        node = self.victim_node(w)
        if node is None:
            return
        kwoknodes.delete_nodes(self.api, [node])
        self.note(f"node {node} deleted")

    def pod_fail(self, w: World) -> None:
        pods = [p for p in w.live_pods() if (p.get("status") or {}).get("phase") == "Running"]
        if not pods:
            return
        pod = self.rng.choice(pods)["metadata"]["name"]
        kube.request(self.api, "PATCH", f"/api/v1/namespaces/{self.ns}/pods/{pod}/status",
                     {"status": {"phase": "Failed", "reason": "Error"}},
                     "application/merge-patch+json", ok=(404,))
        self.note(f"pod {pod} Failed")

    def operator_kill(self, w: World) -> None:
        """SIGKILL (mid-repair when the last fault was a moment ago); half the time a node
        also fails while the operator is down, so the restart finds work waiting."""
        self.op.kill()
        down = self.rng.uniform(0.2, 3.0)
        self.note(f"operator SIGKILLed, down {down:.1f}s")
        if self.rng.random() < 0.5:
            self.node_not_ready(w)
        time.sleep(down)
        self.op.start(timeout=90)
        self.note("operator restarted")

    def job_recreate(self, w: World) -> None:
        name = self.rng.choice(sorted(self.docs))
        path = f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{self.ns}/{c.PLURAL}/{name}"
        kube.request(self.api, "DELETE", path, ok=(404,))
        wait_for(lambda: kube.request(self.api, "GET", path, ok=(404,))[0] == 404, 60, 0.2,
                 f"job {name} deleted (finalizer released)")
        self.create_job(name)
        self.recreated[name] += 1
        self.note(f"job {name} deleted and recreated")

    def apiserver_restart(self, _: World) -> None:
        took = self.cluster.restart_apiserver()
        self.note(f"kube-apiserver SIGKILLed and restarted, ready again in {took:.1f}s")

    def inject(self, kind: str) -> None:
        w = self.world()
        _retry(lambda: getattr(self, kind.replace("-", "_"))(w), kind)
        self.faults[kind] += 1

    # ------------------------------------------------------------ capacity

    def add_node(self, pool: str) -> str:
        """A replacement node joins ``pool`` (a fresh name: never in any failedNodes)."""
        p = next(x for x in kwoknodes.load_cluster(_pools(self.prefix)) if x.name == pool)
        index = self.next_index.get(pool, NODES_PER_POOL)
        self.next_index[pool] = index + 1
        manifest = kwoknodes.node_manifest(p, index)
        _retry(lambda: kube.request(self.api, "POST", "/api/v1/nodes", manifest, ok=(409,)),
               "add a node")
        self.added.append(manifest["metadata"]["name"])
        return str(manifest["metadata"]["name"])

    def keep_capacity(self, w: World, spare: int = 2) -> None:
        """Each pool keeps ``spare`` Ready nodes no live gang pod uses (new hardware)."""
        used = {pod_node(p) for p in w.live_pods()}
        for pool in (f"{self.prefix}-h100", f"{self.prefix}-mi300"):
            free = [n for n, node in w.nodes.items() if node_is_ready(node) and n not in used
                    and node["metadata"]["labels"].get(c.LABEL_POOL) == pool]
            for _ in range(spare - len(free)):
                self.note(f"replacement node {self.add_node(pool)} joined")

    def sample(self) -> None:
        """Check the instant invariants (double booking, duplicates) now."""
        try:
            w = read_world(self.api, self.ns)
        except Exception:  # the apiserver may be restarting: skip this sample
            return
        found = booking_violations(w)
        self.transient += [f"+{time.monotonic() - self.t0:.1f}s {v}" for v in found]


@pytest.fixture
def chaos(k8s_cluster: K8sCluster, namespace: str, kwok_nodes: Any, tmp_path: Path
          ) -> Iterator[Chaos]:
    """CRD, 14 kwok nodes (two pools), an operator of its own; afterwards the jobs are deleted
    while the operator still runs, then the replacement nodes."""
    if k8s_cluster.external or k8s_cluster.state_dir is None:
        pytest.skip("the chaos test restarts the kube-apiserver: local cluster only")
    k8s_cluster.kubectl("apply", "--server-side", "-f", str(CRD))
    k8s_cluster.kubectl("wait", "--for=condition=Established", "--timeout=30s",
                        "crd/hettrainingjobs.hettrain.dev")
    prefix = f"x{random.Random(SEED).randrange(16 ** 5):05x}{os.getpid() % 1000:03d}"
    names = kwok_nodes(_pools(prefix))
    wait_for(lambda: all(not kwoknodes.node_taints(k8s_cluster.api, n) for n in names), 60,
             0.2, "new nodes untainted")
    op = OperatorProcess(k8s_cluster.kubeconfig, tmp_path / "operator.log", env=OPERATOR_ENV)
    op.start(timeout=90)
    run = Chaos(k8s_cluster, namespace, op, prefix, random.Random(SEED), _jobs(prefix))
    try:
        yield run
    finally:
        if op.proc is None or op.proc.poll() is not None:
            op.start(timeout=90)
        path = f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{namespace}/{c.PLURAL}"
        kube.request(k8s_cluster.api, "DELETE", path, ok=(404,))
        wait_for(lambda: not kube.request(k8s_cluster.api, "GET", path)[1].get("items"), 60,
                 0.2, "jobs deleted")
        op.stop()
        kwoknodes.delete_nodes(k8s_cluster.api, run.added)


def test_chaos_no_double_booking_no_orphans_status_matches_pods(chaos: Chaos, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture
                                                               ) -> None:
    run = chaos
    for name in run.docs:
        run.create_job(name)
    run.note(f"{len(run.docs)} jobs created (seed {SEED}, {ROUNDS} rounds)")
    _wait_settled(run, 120, "the jobs Running before any fault")
    run.note("all jobs Running")
    run.sample()

    schedule = fault_schedule(SEED, ROUNDS)
    run.note(f"schedule: {' '.join(schedule)}")
    for kind in schedule:
        run.inject(kind)
        run.sample()
        time.sleep(run.rng.uniform(0.1, 3.0))  # the next fault may land mid-repair
        run.sample()
        run.keep_capacity(run.world())
    run.note("faults stopped")

    w = run.world()
    waiting = [n for n, j in w.jobs.items()
               if (j.get("status") or {}).get("phase") not in (c.PHASE_RUNNING, c.PHASE_FAILED)]
    for _ in waiting:  # fresh hardware: two nodes per pool per job not Running
        for pool in (f"{run.prefix}-h100", f"{run.prefix}-mi300"):
            run.add_node(pool)
            run.add_node(pool)
    if waiting:
        run.note(f"fresh capacity for {sorted(waiting)}")
    t_settle = time.monotonic()
    w = _wait_settled(run, SETTLE_SECONDS, "every job Running or Failed after the faults")
    settle_s = time.monotonic() - t_settle
    run.note(f"settled in {settle_s:.1f}s")
    time.sleep(3.0)  # a wrongly re-planning operator would show itself now
    w = run.world()
    max_repairs = {n: int(d["spec"]["failurePolicy"]["maxRepairs"]) for n, d in run.docs.items()}
    violations = run.transient + settled_violations(w, max_repairs)
    # nothing foreign exists here: a recreated job's leftovers (GC pending) are not foreign
    foreign = run.op.log_path.read_text(errors="replace").count("is not owned by job")
    if foreign:
        violations.append(f"{foreign} ForeignObject warnings for the jobs' own leftovers")

    report = _report(run, w, settle_s, violations)
    (tmp_path / "chaos-report.json").write_text(json.dumps(report, indent=2))
    with capsys.disabled():
        print("\n" + _summary(report))
    assert not violations, ("\n".join(violations) + "\n--- timeline ---\n" + "\n".join(run.log)
                            + f"\n--- operator log tail ---\n{run.op.tail(60)}")
    assert sum(run.faults.values()) == ROUNDS and run.faults["apiserver-restart"] >= 1
    assert report["replanned"], "no job was repaired: the faults missed every gang"


def fault_schedule(seed: int, rounds: int) -> list[str]:
    """The fault kinds in order: a pure function of the seed (victims and gaps are drawn
    during the run, from the live state), with the apiserver restart in the middle."""
    rng = random.Random(seed)
    kinds = [k for k, wt in WEIGHTS.items() if wt]
    out = rng.choices(kinds, [WEIGHTS[k] for k in kinds], k=rounds)
    out[rounds // 2] = "apiserver-restart"
    return out


def _wait_settled(run: Chaos, timeout: float, what: str) -> World:
    def done() -> World | None:
        w = run.world()
        return w if settled(w) else None
    try:
        return wait_for(done, timeout, 0.5, what)
    except TimeoutError as err:
        w = run.world()
        state = "\n".join(_job_line(n, j) for n, j in sorted(w.jobs.items()))
        pods = "\n".join(f"pod {p['metadata']['name']} {(p.get('status') or {}).get('phase')} "
                         f"on {pod_node(p)}" for p in w.live_pods())
        pytest.fail(f"{err}\n{state}\n{pods}\n--- timeline ---\n" + "\n".join(run.log)
                    + f"\n--- operator log tail ---\n{run.op.tail(60)}", pytrace=False)


def _job_line(name: str, job: Mapping[str, Any]) -> str:
    """One job's phase, attempt, planned nodes and true conditions (for failure messages)."""
    st = job.get("status") or {}
    conds = [(x["type"], x["reason"]) for x in st.get("conditions") or ()
             if x["status"] == "True"]
    return (f"{name}: phase={st.get('phase')} attempt={st.get('attempt')} "
            f"plan={(st.get('plan') or {}).get('nodes')} conditions={conds}")


def _report(run: Chaos, w: World, settle_s: float, violations: list[str]) -> dict[str, Any]:
    jobs = {}
    for name, job in sorted(w.jobs.items()):
        st = job.get("status") or {}
        repairs = st.get("repairs") or {}
        jobs[name] = {
            "phase": st.get("phase"), "attempt": st.get("attempt"),
            "repairs": int(repairs.get("count") or 0),
            "causes": dict(Counter(h.get("cause") for h in repairs.get("history") or ())),
            "failedReason": _condition(job, c.COND_FAILED).get("reason")
            if st.get("phase") == c.PHASE_FAILED else None,
            "nodes": sorted((st.get("plan") or {}).get("nodes") or ()),
            "recreated": run.recreated[name]}
    return {
        "seed": SEED, "rounds": ROUNDS, "faults": dict(sorted(run.faults.items())),
        "operatorStarts": run.op.starts, "replacementNodes": len(run.added),
        "settleSeconds": round(settle_s, 1), "wallSeconds": round(time.monotonic() - run.t0, 1),
        "survived": sorted(n for n, j in jobs.items() if j["phase"] == c.PHASE_RUNNING),
        "replanned": sorted(n for n, j in jobs.items() if j["repairs"]),
        "failed": {n: j["failedReason"] for n, j in jobs.items() if j["phase"] == c.PHASE_FAILED},
        "jobs": jobs, "violations": violations, "timeline": run.log}


def _summary(r: Mapping[str, Any]) -> str:
    lines = [f"chaos (seed {r['seed']}): {sum(r['faults'].values())} faults "
             + ", ".join(f"{k}={v}" for k, v in r["faults"].items())
             + f"; {r['operatorStarts']} operator starts; {r['replacementNodes']} replacement "
             f"nodes; settled in {r['settleSeconds']}s, {r['wallSeconds']}s in all",
             f"jobs: {len(r['jobs'])}, survived (Running) {len(r['survived'])}, re-planned "
             f"{len(r['replanned'])}, failed {len(r['failed'])} {r['failed'] or ''}"]
    lines += [f"  {n}: {j['phase']} attempt {j['attempt']}, {j['repairs']} repairs "
              f"{j['causes'] or ''}{', recreated' if j['recreated'] else ''}"
              for n, j in r["jobs"].items()]
    lines.append(f"violations: {len(r['violations'])}")
    return "\n".join(lines)
