"""Pure reconcile: (job body, observed pods and nodes, current plan) → a Decision to apply.

No I/O here: the kopf handlers (:mod:`hettrain.handlers`) observe, call :func:`reconcile`, and
apply the decision with :mod:`hettrain.kube`. Because pod names are deterministic and decisions
are made from observed state only, re-running a decision (after an operator restart or a 409)
never duplicates or loses pods.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import yaml

from hettrain.api import constants as c
from hettrain.api import status as st
from hettrain.api.spec import JobSpec, SpecError, parse_job_spec, require_data
from hettrain.manifests.builders import (
    JobRef,
    build_configmap,
    build_network_policy,
    build_pods,
    build_service,
    configmap_name,
    plan_fingerprint,
    pod_names,
)
from hettrain.manifests.ownership import controller_job, owned_by
from hettrain.manifests.profiling import (
    build_profiling_configmap,
    build_profiling_pods,
    profiling_configmap_name,
)
from hettrain.planning import calibration as cal
from hettrain.planning.catalog import DeviceSpec
from hettrain.planning.cost import precision_bytes
from hettrain.planning.errors import PlanningError, PlanningInputError
from hettrain.planning.inventory import (
    ClusterInventory,
    Link,
    inventory_from_nodes,
)
from hettrain.planning.plan import Plan
from hettrain.planning.planner import plan_job
from hettrain.planning.profiles import LayerProfile, model_shape, profile_from_doc
from hettrain.planning.units import filter_pools

TERMINAL = (c.PHASE_SUCCEEDED, c.PHASE_FAILED)
CAPACITY_RETRY_SECONDS = 15.0
WAIT_RETRY_SECONDS = 5.0  # WaitForReplacement re-checks (new nodes also wake the job)
CAUSE_POD_DELETED = "PodDeleted"
CAUSE_UNSCHEDULABLE = "Unschedulable"
UNSCHEDULABLE_SECONDS = 120.0  # a gang pod Pending/Unschedulable this long → re-plan without
FIELD_NODE_SELECTOR = "spec.placement.nodeSelector"
FIELD_PRIORITY_CLASS = "spec.priorityClassName"


@dataclass(frozen=True, slots=True)
class Event:
    """A Kubernetes Event to post on the job."""

    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(slots=True)
class Decision:
    """What to do: create objects (in order, gang-style), delete objects, patch status, events."""

    create: list[dict[str, Any]] = field(default_factory=list)
    delete: list[tuple[str, str]] = field(default_factory=list)  # (kind, name)
    status: dict[str, Any] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    retry_after: float | None = None  # re-run reconcile after this many seconds
    plan: Plan | None = None  # the plan of the (new) current attempt
    plan_seconds: float | None = None
    repair_cause: str | None = None
    plan_failure: str | None = None
    plan_budget_exceeded: bool = False  # planning ran out of its time/memory budget
    # closed-loop calibration: predicted vs measured per stage (metrics), profiles to put in
    # the namespace's profile store ({store key: DeviceProfile YAML}), a calibration re-plan
    calibration: list[cal.StageComparison] = field(default_factory=list)
    profiles_to_store: dict[str, str] = field(default_factory=dict)
    calibration_replan: bool = False
    # pods of an earlier job of the same name (deleted, then recreated) the garbage collector
    # has not removed yet: (pod name, that job's uid), deleted with a uid check
    leftovers: list[tuple[str, str]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Observed:
    """Observed children and cluster: the job's pods, all nodes, and the current plan.

    ``links`` and ``devices`` are the operator's topology config (inter-DC links, user-defined
    devices; see :func:`hettrain.planning.inventory.load_topology`), passed to the planner's
    inventory as they are.
    """

    pods: Sequence[Mapping[str, Any]]
    nodes: Sequence[Mapping[str, Any]]
    plan: Plan | None = None
    now: float = field(default_factory=time.time)
    links: tuple[Link, ...] = ()
    devices: Mapping[str, DeviceSpec] = field(default_factory=dict)
    held: Mapping[str, str] = field(default_factory=dict)  # node -> "ns/job" of ANOTHER job
    # node -> {GPU resource: count} requested by live pods that are NOT a hettrain job's own
    foreign_gpus: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    unschedulable_seconds: float = UNSCHEDULABLE_SECONDS
    # priorityClassName values jobs may use (operator config); empty: none allowed
    priority_classes: tuple[str, ...] = ()
    scraper_namespace: str = "monitoring"  # may scrape the runtime metrics (NetworkPolicy)
    operator_namespace: str = ""  # the operator's own (calibration scrapes); "" = not admitted
    # why spec.checkpoint's PVC / Secret cannot be used (names the field), or None
    storage_problem: str | None = None
    # closed-loop calibration: the stage times the runtime measured (current attempt) and the
    # profile store's profiles for this job's model shape and image ({device: profile})
    stage_reports: Sequence[cal.StageMeasurement] = ()
    profiles: Mapping[str, LayerProfile] = field(default_factory=dict)

    def inventory(self, node_selector: Mapping[str, str] | None = None) -> ClusterInventory:
        """The planner's inventory of the observed nodes with the topology config: only the
        nodes matching ``node_selector`` (spec.placement.nodeSelector), each with the GPUs
        other workloads request taken off its allocatable, less the nodes other jobs' gangs
        hold (:func:`nodes_held_by_others`)."""
        nodes = [n for n in self.nodes if matches_selector(n, node_selector)]
        if self.foreign_gpus:
            nodes = [without_foreign_gpus(n, self.foreign_gpus) for n in nodes]
        inv = inventory_from_nodes(nodes, links=self.links, devices=self.devices)
        if self.held:
            inv = inv.without_nodes([n for n in inv.node_names() if n in self.held])
        return inv


def matches_selector(node: Mapping[str, Any], selector: Mapping[str, str] | None) -> bool:
    """Whether a Node's labels carry every key=value of ``selector`` (None/empty: all)."""
    if not selector:
        return True
    labels = (node.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def without_foreign_gpus(node: Mapping[str, Any], used: Mapping[str, Mapping[str, int]]
                         ) -> Mapping[str, Any]:
    """The Node with the GPUs other workloads request on it taken off ``allocatable`` (a
    copy; the node unchanged when nothing foreign runs there). A node left with no GPU of
    its vendor drops out of the inventory."""
    name = str((node.get("metadata") or {}).get("name"))
    taken = used.get(name)
    if not taken:
        return node
    status = dict(node.get("status") or {})
    alloc = dict(status.get("allocatable") or {})
    for resource, qty in taken.items():
        if resource in alloc:
            try:
                free = int(str(alloc[resource])) - int(qty)
            except ValueError:
                continue
            if free > 0:
                alloc[resource] = str(free)
            else:
                alloc.pop(resource)
    status["allocatable"] = alloc
    return {**node, "status": status}


def nodes_held_by_others(pods_by_job: Mapping[tuple[str, str], Sequence[Mapping[str, Any]]],
                         job: tuple[str, str]) -> dict[str, str]:
    """Nodes held by the live (not Succeeded/Failed) pods of every job but ``job``.

    A gang pod takes its whole node (one pod per planned node), so a held node is out of the
    inventory of every other job: two jobs never plan onto the same node. Returns
    ``{node: "namespace/job"}``; pods without a node (bound or pinned) hold nothing.
    """
    held: dict[str, str] = {}
    for key, pods in sorted(pods_by_job.items()):
        if tuple(key) == tuple(job):
            continue
        for pod in pods:
            if _pod_phase(pod) in ("Succeeded", "Failed"):
                continue
            node = _pod_node(pod)
            if node is not None:
                held.setdefault(node, f"{key[0]}/{key[1]}")
    return held


Planner = Callable[[str, JobSpec, ClusterInventory, Plan | None], Plan]


def default_planner(name: str, spec: JobSpec, inv: ClusterInventory, prev: Plan | None) -> Plan:
    """The real planner (``hettrain.planning.planner.plan_job``)."""
    return plan_job(name, spec, inv, previous=prev)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_iso(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def _pod_attempt(pod: Mapping[str, Any]) -> int:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    try:
        return int(labels.get(c.LABEL_ATTEMPT, "-1"))
    except ValueError:
        return -1


def _pod_phase(pod: Mapping[str, Any]) -> str:
    return str((pod.get("status") or {}).get("phase") or "Pending")


def _pod_node(pod: Mapping[str, Any]) -> str | None:
    """The node a pod is bound to, else the node its affinity pins it to."""
    spec = pod.get("spec") or {}
    if spec.get("nodeName"):
        return str(spec["nodeName"])
    try:
        terms = spec["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        return str(terms[0]["matchExpressions"][0]["values"][0])
    except (KeyError, IndexError, TypeError):
        return None


def node_ready(node: Mapping[str, Any]) -> bool:
    """Ready condition True."""
    for cond in (node.get("status") or {}).get("conditions") or ():
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


class _Builder:
    """Accumulates the status patch on top of the old status."""

    def __init__(self, body: Mapping[str, Any], now: float) -> None:
        self.old = dict(body.get("status") or {})
        self.generation = int((body.get("metadata") or {}).get("generation") or 1)
        self.now = _iso(now)
        self.patch: dict[str, Any] = {}
        self.conditions = list(self.old.get("conditions") or [])

    def cond(self, ctype: str, value: bool, reason: str, message: str = "") -> None:
        self.conditions = st.set_condition(self.conditions, ctype, value, reason, message,
                                           self.generation, self.now)
        self.patch["conditions"] = self.conditions

    def phase(self, phase: str) -> None:
        self.patch["phase"] = phase


def _fail(b: _Builder, d: Decision, reason: str, message: str, delete: Iterable[str] = ()
          ) -> Decision:
    b.phase(c.PHASE_FAILED)
    b.cond(c.COND_FAILED, True, reason, message)
    b.cond(c.COND_RUNNING, False, reason, message)
    b.patch["completionTime"] = b.now
    b.patch["observedGeneration"] = b.generation
    d.delete.extend(("Pod", n) for n in delete)
    d.events.append(Event("Warning", reason, message))
    d.status = b.patch
    return d


def _launch(job: JobRef, spec: JobSpec, b: _Builder, d: Decision, obs: Observed,
            planner: Planner, previous: Plan | None, attempt: int, resume: bool,
            exclude: Sequence[str], repair: tuple[str, Sequence[str], int] | None = None
            ) -> Decision:
    """Plan and launch a new attempt. ``repair`` (cause, nodes, world size before) is
    recorded in status.repairs only when the relaunch happens: a repair that must wait for
    capacity does not use up ``maxRepairs``."""
    if obs.storage_problem:  # fail fast instead of launching pods that cannot checkpoint
        return _storage_unavailable(b, d, obs.storage_problem)
    t0 = time.perf_counter()
    selector = dict(spec.placement.node_selector)
    if selector and not any(matches_selector(n, selector) for n in obs.nodes):
        d.plan_failure = c.REASON_PLAN_FAILED
        msg = (f"{FIELD_NODE_SELECTOR}: no node has the labels {selector}; fix the selector "
               "or label the nodes")
        b.cond(c.COND_PLANNED, False, c.REASON_PLAN_FAILED, msg)
        return _fail(b, d, c.REASON_PLAN_FAILED, msg)
    inv: ClusterInventory | None = None
    try:
        inv = cal.with_profiles(obs.inventory(selector), obs.profiles, spec.model,
                                spec.training.precision)
        if exclude:
            inv = inv.without_nodes([n for n in exclude if n in inv.node_names()])
        plan = planner(job.name, spec, inv, previous)
    except PlanningError as err:
        d.plan_seconds = time.perf_counter() - t0
        d.plan_failure = err.reason
        message = err.message + _held_note(obs.held)
        d.plan_budget_exceeded = getattr(err, "budget_exceeded", False)
        short = (None if d.plan_budget_exceeded or inv is None
                 else _pins_short_of_gpus(spec, inv))
        if short is not None:  # the pinned layout needs more GPUs than are usable now
            return _wait_for_capacity(b, d, c.REASON_INSUFFICIENT_CAPACITY,
                                      short + _held_note(obs.held), repair)
        # a repair's job planned before: fewer usable nodes now is a capacity problem
        if not d.plan_budget_exceeded and (
                repair is not None or err.reason == c.REASON_INSUFFICIENT_CAPACITY
                or (obs.held and _fits_without_held(job, spec, obs, planner, previous,
                                                     exclude))):
            return _wait_for_capacity(b, d, err.reason, message, repair)
        b.cond(c.COND_PLANNED, False, err.reason, message)
        return _fail(b, d, err.reason, message)
    d.plan_seconds = time.perf_counter() - t0
    if plan.world_size < spec.failure_policy.min_gpus:
        msg = (f"plan uses {plan.world_size} GPUs, below spec.failurePolicy.minGPUs "
               f"({spec.failure_policy.min_gpus})") + _held_note(obs.held)
        if previous is None and repair is None:  # never launched: capacity may still come
            return _wait_for_capacity(b, d, c.REASON_INSUFFICIENT_CAPACITY, msg)
        b.cond(c.COND_PLANNED, False, c.REASON_INSUFFICIENT_CAPACITY, msg)
        return _fail(b, d, c.REASON_INSUFFICIENT_CAPACITY, msg)
    d.plan = plan
    cm = configmap_name(job.name, attempt)
    d.create.append(build_service(job))
    d.create.append(build_network_policy(job, obs.scraper_namespace, obs.operator_namespace))
    d.create.append(build_configmap(job, plan, attempt))
    d.create.extend(build_pods(job, spec, plan, attempt, resume))
    msg = (f"{_layout(plan)} on {plan.world_size} GPUs in {','.join(plan.pools)}; predicted "
           f"{plan.predicted.tokens_per_s:.0f} tokens/s")
    b.cond(c.COND_PLANNED, True, c.REASON_PLAN_FOUND, msg)
    b.cond(c.COND_PODS_READY, False, c.REASON_PODS_CREATED,
           f"{len(plan.nodes())} pods created for attempt {attempt}")
    b.cond(c.COND_FAILED, False, c.REASON_PLAN_FOUND)
    b.phase(c.PHASE_LAUNCHING)
    b.patch.update(attempt=attempt, worldSize=plan.world_size,
                   plan=st.plan_summary(plan, cm, plan_fingerprint(plan)),
                   observedGeneration=b.generation,
                   failureSince=None, failureCause=None, failureNodes=None)
    if not b.old.get("startTime"):
        b.patch["startTime"] = b.now
    if repair is not None:
        d.repair_cause, bad, from_world = repair
        b.patch["repairs"] = st.add_repair(b.old.get("repairs"), d.repair_cause, bad,
                                           from_world, plan.world_size, b.now)
        b.patch["restarts"] = int(b.old.get("restarts") or 0) + 1
        d.events.append(Event("Warning", d.repair_cause,
                              f"repair {b.patch['repairs']['count']}: re-planned without "
                              f"{', '.join(bad) or 'the failed pods'}"))
    b.patch.setdefault("restarts", int(b.old.get("restarts") or 0))
    d.events.append(Event("Normal", c.REASON_PLAN_FOUND, msg))
    d.status = b.patch
    return d


def _layout(plan: Plan) -> str:
    """``dp= pp= tp=[..]`` of the plan, one part per replica group when it has groups."""
    if not plan.groups:
        return f"dp={plan.dp} pp={plan.pp} tp={[s.tp for s in plan.stages]}"
    return "; ".join(f"group {g.index}: dp={g.dp} pp={g.pp} tp={[s.tp for s in g.stages]} "
                     + (f"cp={g.stages[0].cp} " if g.stages[0].cp > 1 else "")
                     + f"in {','.join(dict.fromkeys(p for s in g.stages for p in s.pools))}"
                     for g in plan.groups)


def _pins_short_of_gpus(spec: JobSpec, inv: ClusterInventory) -> str | None:
    """Why the pins of spec.parallelism cannot be met by the GPUs usable now within
    spec.placement (tp × pp × dp of them, the unpinned ones counted as 1), or None.

    That is a capacity problem (nodes NotReady, deleted, held by other jobs or not joined
    yet), not a bad spec: the job waits for capacity instead of failing for good."""
    par = spec.parallelism
    if not (par.tp or par.pp or par.dp):
        return None
    pp = 1 if spec.model.tie_embeddings else (par.pp or 1)  # the planner forces pp=1 then
    need = (par.tp or 1) * pp * (par.dp or 1)
    have = sum(p.gpus for p in filter_pools(inv, spec.placement))
    if not 0 < have < need:  # nothing matching spec.placement at all: the planner's verdict
        return None
    return (f"spec.parallelism pins tp×pp×dp = {need} GPUs; {have} are usable within "
            "spec.placement now; waiting for nodes to become ready, join or be freed")


def _held_note(held: Mapping[str, str]) -> str:
    if not held:
        return ""
    jobs = sorted(set(held.values()))
    shown = ", ".join(jobs[:3]) + (f" and {len(jobs) - 3} more" if len(jobs) > 3 else "")
    return f" ({len(held)} nodes are held by other jobs: {shown})"


def _fits_without_held(job: JobRef, spec: JobSpec, obs: Observed, planner: Planner,
                       previous: Plan | None, exclude: Sequence[str]) -> bool:
    """Would the job plan if the other jobs released their nodes? (Then it waits, not fails.)"""
    inv = replace(obs, held={}).inventory(dict(spec.placement.node_selector))
    if exclude:
        inv = inv.without_nodes([n for n in exclude if n in inv.node_names()])
    try:
        planner(job.name, spec, inv, previous)
    except PlanningError:
        return False
    return True


def _wait_for_capacity(b: _Builder, d: Decision, reason: str, message: str,
                       repair: tuple[str, Sequence[str], int] | None = None) -> Decision:
    """Pending with Planned=False and a retry: capacity may appear (nodes join or are freed).

    A repair that waits (``repair`` given) stays ``Repairing``: its gang is torn down and
    status.plan dropped, so the next pass relaunches through the new-attempt path and counts
    the repair only then (maxRepairs counts repairs, not waits)."""
    b.phase(c.PHASE_PENDING)
    if repair is not None:
        b.phase(c.PHASE_REPAIRING)
        b.cond(c.COND_REPAIRING, True, c.REASON_INSUFFICIENT_CAPACITY,
               f"repair ({repair[0]} on {', '.join(repair[1]) or 'pods'}) waits for capacity")
        b.patch["plan"] = None
    b.cond(c.COND_PLANNED, False, reason, message)
    d.status = b.patch
    d.retry_after = CAPACITY_RETRY_SECONDS
    d.events.append(Event("Warning", reason, message))
    return d


def _unschedulable_since(pod: Mapping[str, Any]) -> float | None:
    """When the scheduler declared the pod Unschedulable (PodScheduled=False), else None."""
    if _pod_phase(pod) != "Pending":
        return None
    for cond in (pod.get("status") or {}).get("conditions") or ():
        if (cond.get("type") == "PodScheduled" and cond.get("status") == "False"
                and cond.get("reason") == "Unschedulable"):
            try:
                return _parse_iso(cond.get("lastTransitionTime")) or 0.0
            except ValueError:
                return 0.0
    return None


def _unschedulable_due(pods: Sequence[Mapping[str, Any]], seconds: float) -> float | None:
    """When the first Pending/Unschedulable pod of ``pods`` reaches the timeout, else None."""
    since = [t for t in map(_unschedulable_since, pods) if t is not None]
    return min(since) + seconds if since and seconds < float("inf") else None


def _failures(pods: Sequence[Mapping[str, Any]], expected: set[str],
              nodes: Mapping[str, Mapping[str, Any]], launching: bool,
              now: float = 0.0, unschedulable_seconds: float = float("inf")
              ) -> tuple[str | None, list[str]]:
    """(cause, failed nodes) of the current attempt, or (None, []). A gang pod Pending and
    Unschedulable for longer than ``unschedulable_seconds`` fails with its node."""
    cause: str | None = None
    bad: list[str] = []
    seen = set()
    for pod in pods:
        name = pod["metadata"]["name"]
        seen.add(name)
        node = _pod_node(pod)
        if node is not None and (node not in nodes or not node_ready(nodes[node])):
            cause = cause or c.REASON_NODE_LOST
            bad.append(node)
        elif _pod_phase(pod) == "Failed":
            cause = cause or c.REASON_POD_FAILED
            if node:
                bad.append(node)
        else:
            since = _unschedulable_since(pod)
            if since is not None and now - since > unschedulable_seconds:
                cause = cause or CAUSE_UNSCHEDULABLE
                if node:
                    bad.append(node)
    if not launching and expected - seen and cause is None:
        cause = CAUSE_POD_DELETED
    return cause, sorted(set(bad))


def reconcile(body: Mapping[str, Any], obs: Observed,
              planner: Planner = default_planner) -> Decision:
    """Decide the next step for one HetTrainingJob from its body and observed state."""
    job = JobRef.from_body(body)
    b = _Builder(body, obs.now)
    d = Decision()
    # a deleted job's pods under this name hold their GPUs until the garbage collector removes
    # them, which can take minutes (its retries back off, e.g. across an apiserver restart)
    d.leftovers = [(str(p["metadata"]["name"]), owner[1]) for p in obs.pods
                   if (owner := controller_job(p)) is not None and owner[0] == job.name
                   and owner[1] != job.uid and not p["metadata"].get("deletionTimestamp")]
    old = b.old
    phase = old.get("phase")
    attempt = int(old.get("attempt") or 0)
    generation_changed = old.get("observedGeneration") not in (None, b.generation)
    if phase in TERMINAL and not generation_changed:
        return d
    # only pods whose controller ownerReference is this job (uid) are its own: a foreign pod
    # carrying the job's label is never adopted, counted or deleted
    obs = replace(obs, pods=[p for p in obs.pods if owned_by(p, job.uid)])
    try:
        spec = parse_job_spec(body.get("spec"))
        require_data(spec)  # synthetic tokens only when spec.data.synthetic says so
        _check_priority_class(spec, obs.priority_classes)
    except SpecError as err:
        b.cond(c.COND_PLANNED, False, c.REASON_INVALID_SPEC, str(err))
        return _fail(b, d, c.REASON_INVALID_SPEC, str(err), _names(obs.pods))
    current = [p for p in obs.pods if _pod_attempt(p) == attempt]
    stale = [p["metadata"]["name"] for p in obs.pods if _pod_attempt(p) != attempt]
    d.delete.extend(("Pod", n) for n in stale)

    if spec.suspend:
        if phase != c.PHASE_SUSPENDED or current:
            d.delete.extend(("Pod", n) for n in _names(current))
            b.phase(c.PHASE_SUSPENDED)
            b.cond(c.COND_SUSPENDED, True, c.REASON_SUSPENDED, "spec.suspend is true")
            b.cond(c.COND_RUNNING, False, c.REASON_SUSPENDED, "spec.suspend is true")
            b.patch["observedGeneration"] = b.generation
            d.events.append(Event("Normal", c.REASON_SUSPENDED, "pods deleted; job suspended"))
            d.status = b.patch
        return d
    if phase == c.PHASE_SUSPENDED or generation_changed or attempt == 0 or obs.plan is None:
        # first launch, resume after suspend, spec change, or lost plan → plan a new attempt
        if attempt > 0:
            d.delete.extend(("Pod", n) for n in _names(current))
            d.delete.append(("ConfigMap", configmap_name(job.name, attempt)))
            if phase == c.PHASE_SUSPENDED:
                b.cond(c.COND_SUSPENDED, False, "Resumed")
        repair = None
        exclude = list(old.get("failedNodes") or [])
        if old.get("failureCause") and attempt > 0 and phase != c.PHASE_SUSPENDED:
            # a repair that waited for capacity, or one cut short (operator killed between
            # its deletes and its status patch): leave its nodes out as _repair does
            repair = (str(old["failureCause"]), list(old.get("failureNodes") or []),
                      int(old.get("worldSize") or 0))
            exclude = sorted(set(exclude) | set(repair[1]))
            if repair[0] != CAUSE_UNSCHEDULABLE and exclude != sorted(
                    old.get("failedNodes") or []):
                b.patch["failedNodes"] = exclude  # (Unschedulable nodes are fine, just full)
        if attempt == 0 and spec.calibration.profile:  # profiling pods before the first plan
            waiting, measured = _profile_pools(job, body, spec, b, d, obs, current)
            if waiting is not None:
                return waiting
            obs = replace(obs, profiles={**obs.profiles, **measured})
        return _launch(job, spec, b, d, obs, planner, obs.plan, attempt + 1, attempt > 0,
                       exclude, repair)

    plan = obs.plan
    nodes = {str(n["metadata"]["name"]): n for n in obs.nodes}
    expected = set(pod_names(job.name, plan, attempt))
    launching = phase in (c.PHASE_LAUNCHING, c.PHASE_PENDING, c.PHASE_PLANNING)
    cause, bad = _failures(current, expected, nodes, launching, obs.now,
                           obs.unschedulable_seconds)
    if cause is None:
        d = _progress(job, spec, b, d, obs, plan, attempt, current, expected, launching,
                      planner)
        due = _unschedulable_due(current, obs.unschedulable_seconds)
        if due is not None and d.status.get("phase") not in TERMINAL:
            # wake up when the timeout runs out, not at the next resync
            wait = max(0.5, due - obs.now + 0.1)
            d.retry_after = wait if d.retry_after is None else min(d.retry_after, wait)
        return d
    return _repair(job, spec, b, d, obs, planner, plan, attempt, current, cause, bad)


def _check_priority_class(spec: JobSpec, allowed: Sequence[str]) -> None:
    """spec.priorityClassName must be on the operator's allow-list (chart value
    ``operator.allowedPriorityClasses``): a tenant must not pick e.g. system-node-critical."""
    name = spec.priority_class_name
    if name and name not in allowed:
        raise SpecError(FIELD_PRIORITY_CLASS,
                        f"{name!r} is not allowed on this cluster (allowed: "
                        f"{', '.join(allowed) or 'none'}); use an allowed class or ask the "
                        "operator's admin to add it to operator.allowedPriorityClasses")


def _names(pods: Iterable[Mapping[str, Any]]) -> list[str]:
    return [p["metadata"]["name"] for p in pods]


def _progress(job: JobRef, spec: JobSpec, b: _Builder, d: Decision, obs: Observed, plan: Plan,
              attempt: int, current: Sequence[Mapping[str, Any]], expected: set[str],
              launching: bool, planner: Planner = default_planner) -> Decision:
    _note_no_checkpoint(b, d, current, attempt)
    if (missing_secret := secret_error(current, spec)) is not None:  # pods can never start
        return _storage_unavailable(b, d, missing_secret, _names(current))
    seen = set(_names(current))
    missing = expected - seen
    if missing and launching:  # operator restarted mid-launch: create the rest of the gang
        d.create.append(build_service(job))
        d.create.append(build_network_policy(job, obs.scraper_namespace, obs.operator_namespace))
        d.create.append(build_configmap(job, plan, attempt))
        d.create.extend(p for p in build_pods(job, spec, plan, attempt, attempt > 1)
                        if p["metadata"]["name"] in missing)
        return d
    phases = [_pod_phase(p) for p in current]
    if phases and all(ph == "Succeeded" for ph in phases) and not missing:
        b.phase(c.PHASE_SUCCEEDED)
        b.cond(c.COND_SUCCEEDED, True, c.REASON_COMPLETED, "all pods succeeded")
        b.cond(c.COND_RUNNING, False, c.REASON_COMPLETED)
        b.patch["completionTime"] = b.now
        d.events.append(Event("Normal", c.REASON_COMPLETED, "training finished"))
        d.status = b.patch
        return d
    running = phases and all(ph in ("Running", "Succeeded") for ph in phases)
    if running and b.old.get("phase") != c.PHASE_RUNNING:
        b.phase(c.PHASE_RUNNING)
        b.cond(c.COND_PODS_READY, True, c.REASON_ALL_PODS_READY, f"{len(phases)} pods running")
        b.cond(c.COND_RUNNING, True, c.REASON_ALL_PODS_READY)
        b.cond(c.COND_REPAIRING, False, c.REASON_ALL_PODS_READY)
        d.status = b.patch
    if running and spec.calibration.enabled:
        return _calibrate(job, spec, b, d, obs, planner, plan, attempt, current)
    return d


def _repair(job: JobRef, spec: JobSpec, b: _Builder, d: Decision, obs: Observed,
            planner: Planner, plan: Plan, attempt: int, current: Sequence[Mapping[str, Any]],
            cause: str, bad: list[str]) -> Decision:
    _note_no_checkpoint(b, d, current, attempt)
    if (storage_error := checkpoint_error(current)) is not None:  # a repair cannot fix it
        return _storage_unavailable(b, d, storage_error, _names(current))
    pol = spec.failure_policy
    cause = b.old.get("failureCause") or cause
    bad = sorted(set(bad) | set(b.old.get("failureNodes") or []))
    since = _parse_iso(b.old.get("failureSince"))
    if since is None:
        since = obs.now
        b.patch.update(failureSince=b.now, failureCause=cause)
    if bad != sorted(b.old.get("failureNodes") or []):
        b.patch["failureNodes"] = bad
    d.status = b.patch
    wait = since + pol.debounce_seconds - obs.now
    if wait > 0:  # debounce: a burst of failures becomes one repair
        if b.old.get("phase") != c.PHASE_REPAIRING:
            b.phase(c.PHASE_REPAIRING)
            b.cond(c.COND_REPAIRING, True, cause, f"failure on {', '.join(bad) or 'pods'}")
            d.events.append(Event("Warning", cause,
                                  f"failure on {', '.join(bad) or 'pods'}; repairing"))
        d.retry_after = wait
        return d
    repairs = dict(b.old.get("repairs") or {})
    if int(repairs.get("count") or 0) >= pol.max_repairs:
        msg = (f"{cause}: spec.failurePolicy.maxRepairs ({pol.max_repairs}) reached; "
               "raise it to keep repairing")
        return _fail(b, d, c.REASON_MAX_REPAIRS, msg, _names(current))
    if cause == CAUSE_UNSCHEDULABLE:  # the node is fine, just not free: skip it this time
        failed = sorted(set(b.old.get("failedNodes") or []))
        exclude = sorted(set(failed) | set(bad))
    else:
        failed = sorted(set(b.old.get("failedNodes") or []) | set(bad))
        exclude = list(failed)
    if (pol.mode == "WaitForReplacement" and obs.now - since < pol.wait_seconds
            and not _replan_keeps_size(job, spec, obs, planner, plan, exclude)):
        b.phase(c.PHASE_REPAIRING)
        b.cond(c.COND_REPAIRING, True, c.REASON_WAITING_REPLACEMENT,
               f"waiting up to {pol.wait_seconds}s for replacement nodes (a plan with "
               f"{plan.world_size} GPUs in spec.placement)")
        d.delete.extend(("Pod", n) for n in _names(current))
        d.retry_after = min(WAIT_RETRY_SECONDS, since + pol.wait_seconds - obs.now)
        return d
    d.delete.extend(("Pod", n) for n in _names(current))
    d.delete.append(("ConfigMap", configmap_name(job.name, attempt)))
    b.patch["failedNodes"] = failed
    b.patch["failureCause"] = cause
    b.patch["failureNodes"] = bad
    b.phase(c.PHASE_REPAIRING)
    b.cond(c.COND_REPAIRING, True, cause, f"re-planning without {', '.join(bad) or 'pods'}")
    out = _launch(job, spec, b, d, obs, planner, plan, attempt + 1, True, exclude,
                  (cause, bad, plan.world_size))
    return out


def _replan_keeps_size(job: JobRef, spec: JobSpec, obs: Observed, planner: Planner,
                       plan: Plan, exclude: Sequence[str]) -> bool:
    """Whether the nodes usable now (within spec.placement, failed ones excluded) give a plan
    as large as the current one: what WaitForReplacement waits for."""
    try:
        inv = obs.inventory(dict(spec.placement.node_selector))
        inv = inv.without_nodes([n for n in exclude if n in inv.node_names()])
        return planner(job.name, spec, inv, plan).world_size >= plan.world_size
    except PlanningError:
        return False


# ---------------------------------------------------------------- checkpoint storage signals

CHECKPOINT_ERROR_MARK = "HETTRAIN_CHECKPOINT_ERROR"  # runtime: storage unusable / misfit
NO_CHECKPOINT_MARK = "HETTRAIN_NO_CHECKPOINT"  # runtime: a resume found no checkpoint


def termination_messages(pods: Iterable[Mapping[str, Any]]) -> list[str]:
    """The containers' termination messages (``state`` and ``lastState``) of ``pods``."""
    out = []
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or ():
            for key in ("state", "lastState"):
                msg = ((cs.get(key) or {}).get("terminated") or {}).get("message")
                if msg:
                    out.append(str(msg).strip())
    return out


def checkpoint_error(pods: Iterable[Mapping[str, Any]]) -> str | None:
    """The runtime's checkpoint storage error from a failed pod, if any (without the mark)."""
    for msg in termination_messages(pods):
        if msg.startswith(CHECKPOINT_ERROR_MARK):
            return msg.removeprefix(CHECKPOINT_ERROR_MARK).lstrip(": ")
    return None


def secret_error(pods: Iterable[Mapping[str, Any]], spec: JobSpec) -> str | None:
    """``spec.checkpoint.secretRef`` names a Secret (or key) the kubelet cannot find: the
    pods wait in ``CreateContainerConfigError`` forever; a reason naming the field, or None."""
    name = spec.checkpoint.secret_ref
    if not name:
        return None
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or ():
            waiting = (cs.get("state") or {}).get("waiting") or {}
            msg = str(waiting.get("message") or "")
            if waiting.get("reason") == "CreateContainerConfigError" and f'"{name}"' in msg:
                return (f"spec.checkpoint.secretRef: Secret {name!r} is unusable ({msg[:200]}); "
                        "create it with keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    return None


def _storage_unavailable(b: _Builder, d: Decision, message: str,
                         delete: Iterable[str] = ()) -> Decision:
    """Failed with CheckpointStorageReady=False: no repair is consumed on it."""
    b.cond(c.COND_CHECKPOINT_STORAGE, False, c.REASON_CHECKPOINT_STORAGE, message)
    return _fail(b, d, c.REASON_CHECKPOINT_STORAGE, message, delete)


def _note_no_checkpoint(b: _Builder, d: Decision, pods: Sequence[Mapping[str, Any]],
                        attempt: int) -> None:
    """A resumed attempt whose runtime found no checkpoint: one Warning event and
    ``status.checkpoint`` naming the attempt (it restarted from step 0)."""
    old = b.old.get("checkpoint") or {}
    if old.get("noCheckpointAttempt") == attempt:
        return
    msg = next((m for m in termination_messages(pods) if m.startswith(NO_CHECKPOINT_MARK)), None)
    if msg is None:
        return
    b.patch["checkpoint"] = {"noCheckpointAttempt": attempt, "message": msg[:1000]}
    d.events.append(Event("Warning", c.REASON_NO_CHECKPOINT,
                          f"attempt {attempt}: {msg[:500]}"))
    d.status = b.patch


# ---------------------------------------------------------------- closed-loop calibration


def _calibrate(job: JobRef, spec: JobSpec, b: _Builder, d: Decision, obs: Observed,
               planner: Planner, plan: Plan, attempt: int,
               current: Sequence[Mapping[str, Any]]) -> Decision:
    """Compare the measured stage times with the plan (once per attempt, when every stage
    has ``spec.calibration.minSteps`` measured steps), refine the device profiles, and decide
    (:mod:`hettrain.planning.calibration`); a re-plan that pays off waits for the next
    checkpoint, then relaunches the job from it on the corrected model."""
    cfg = spec.calibration
    measured = cal.usable(obs.stage_reports, plan, cfg.min_steps)
    if not measured:
        return d
    d.calibration = cal.compare(plan, measured)
    old = dict(b.old.get("calibration") or {})
    replans = int(old.get("replans") or 0)
    if old.get("attempt") != attempt:
        return _calibration_verdict(job, spec, b, d, obs, planner, plan, attempt, measured,
                                    replans)
    ckpt = min(m.checkpoint_step for m in measured.values())
    if not old.get("pendingReplan") or ckpt < int(old.get("pendingSinceStep") or 0):
        return d
    # the next checkpoint is written: relaunch from it on the refined profiles
    refined = {str(p["device"]): _profile_from_status(p, spec) for p in old.get("refined") or []}
    d.delete.extend(("Pod", n) for n in _names(current))
    d.delete.append(("ConfigMap", configmap_name(job.name, attempt)))
    b.patch["calibration"] = {**old, "pendingReplan": False, "replans": replans + 1}
    d.calibration_replan = True
    d.events.append(Event("Normal", c.REASON_CALIBRATION_REPLAN,
                          f"re-planning from the checkpoint at step {ckpt}: the corrected "
                          f"model predicts {old.get('currentStepSeconds')} s per step for the "
                          f"current plan, {old.get('bestStepSeconds')} s for the new one"))
    return _launch(job, spec, b, d, replace(obs, profiles={**obs.profiles, **refined}), planner,
                   plan, attempt + 1, True, b.old.get("failedNodes") or [])


def _calibration_verdict(job: JobRef, spec: JobSpec, b: _Builder, d: Decision, obs: Observed,
                         planner: Planner, plan: Plan, attempt: int,
                         measured: Mapping[cal.StageKey, cal.StageMeasurement], replans: int
                         ) -> Decision:
    """The attempt's first usable measurements: status rows, refined profiles (stored), the
    verdict, and an Event saying what was measured and what follows."""
    cfg = spec.calibration
    inv = cal.with_profiles(obs.inventory(dict(spec.placement.node_selector)), obs.profiles,
                            spec.model, spec.training.precision)
    failed = [n for n in b.old.get("failedNodes") or [] if n in inv.node_names()]
    if failed:
        inv = inv.without_nodes(failed)
    refined = cal.refine_profiles(spec, plan, measured, cal.devices_of(inv))
    verdict = cal.evaluate(spec, plan, cal.with_profiles(inv, refined, spec.model,
                                                         spec.training.precision),
                           lambda s, i, p: planner(job.name, s, i, p), cfg.replan_threshold)
    software = {"image": spec.image}
    d.profiles_to_store = {
        cal.store_key(dev, p.shape, spec.image, spec.training.precision):
            yaml_dump(cal.profile_to_doc(p, spec.model, software))
        for dev, p in refined.items()}
    step = max(m.step for m in measured.values())
    rows = ", ".join(f"{r.label} ({r.device}) {r.measured_s * 1e3:.3g} ms measured vs "
                     f"{r.predicted_s * 1e3:.3g} ms predicted" for r in d.calibration)
    status: dict[str, Any] = {
        "attempt": attempt, "step": step, "stages": [r.to_status() for r in d.calibration],
        "currentStepSeconds": round(verdict.current_s, 6),
        "bestStepSeconds": round(verdict.best_s, 6), "replans": replans,
        "pendingReplan": False, "pendingSinceStep": None,
        "profiles": sorted(d.profiles_to_store),
        "refined": [_refined_entry(dev, p) for dev, p in sorted(refined.items())]}
    old = b.old.get("calibration") or {}
    if old.get("profiling"):
        status["profiling"] = old["profiling"]
    why = ""
    if verdict.replan and replans >= cfg.max_replans:
        why = f"; not re-planning: spec.calibration.maxReplans ({cfg.max_replans}) reached"
    elif verdict.replan and not (spec.checkpoint.uri or spec.checkpoint.pvc):
        why = "; not re-planning: the job has no spec.checkpoint to resume from"
    elif verdict.replan:
        status.update(pendingReplan=True, pendingSinceStep=step)
        why = f"; re-planning at the next checkpoint (after step {step})"
    else:
        why = "; the current plan is kept"
    b.patch["calibration"] = status
    d.status = b.patch
    d.events.append(Event("Normal", c.REASON_CALIBRATED, f"{rows}. {verdict.message()}{why}"))
    return d


def _refined_entry(device: str, p: LayerProfile) -> dict[str, Any]:
    """A refined profile as ``status.calibration.refined`` records it."""
    entry = {"device": device, "alphaS": p.alpha, "betaS": p.beta,
             "forwardShare": p.forward_share, "precision": p.precision,
             "recompute": [{"mode": m, "alphaS": a, "betaS": b} for m, a, b in p.recompute]}
    if p.input_grad is not None and p.weight_grad is not None:  # the ZB-H1 B/W split
        entry.update(bPass={"alphaS": p.input_grad[0], "betaS": p.input_grad[1]},
                     wPass={"alphaS": p.weight_grad[0], "betaS": p.weight_grad[1]})
    if p.tp_layers:  # the layer measured sharded
        entry["tp"] = [{"tp": t, "alphaS": a, "betaS": b} for t, a, b in p.tp_layers]
    return entry


def _profile_from_status(entry: Mapping[str, Any], spec: JobSpec) -> LayerProfile:
    """A refined profile recorded in ``status.calibration.refined`` (an entry written before
    ``precision`` existed is the job's precision, without measured recompute modes; one
    without ``bPass``/``wPass`` has no measured ZB-H1 split, one without ``tp`` no layer
    measured sharded)."""
    modes = tuple((str(r["mode"]), float(r["alphaS"]), float(r["betaS"]))
                  for r in entry.get("recompute") or [])

    def line(key: str) -> tuple[float, float] | None:
        r = entry.get(key)
        return None if not r else (float(r["alphaS"]), float(r["betaS"]))

    return LayerProfile(str(entry["device"]), model_shape(spec.model), float(entry["alphaS"]),
                        float(entry["betaS"]), float(entry["forwardShare"]),
                        source="calibration",
                        precision=str(entry.get("precision") or spec.training.precision),
                        recompute=modes, weight_grad=line("wPass"), input_grad=line("bPass"),
                        tp_layers=tuple((int(r["tp"]), float(r["alphaS"]), float(r["betaS"]))
                                        for r in entry.get("tp") or []))


def yaml_dump(doc: Mapping[str, Any]) -> str:
    """A profile document as the YAML text the store keeps."""
    return yaml.safe_dump(dict(doc), sort_keys=False)


PROFILING_RETRY_SECONDS = 10.0


def _profile_pools(job: JobRef, body: Mapping[str, Any], spec: JobSpec, b: _Builder,
                   d: Decision, obs: Observed, pods: Sequence[Mapping[str, Any]]
                   ) -> tuple[Decision | None, dict[str, LayerProfile]]:
    """``spec.calibration.profile``: one profiling pod per device of the job's pools that
    the profile store lacks (``manifests/profiling.py``), then their profiles (read from the
    pods' termination messages, stored) for the first plan. Returns (a decision to wait
    with, None once done) and the profiles measured."""
    state = dict((b.old.get("calibration") or {}).get("profiling") or {})
    if state.get("state") == "Done":
        return None, {}
    if not state:
        targets: dict[str, tuple[str, str, str, str]] = {}
        inv = obs.inventory(dict(spec.placement.node_selector))
        for pool in filter_pools(inv, spec.placement):
            if pool.device.name not in obs.profiles and pool.nodes:
                targets.setdefault(pool.device.name, (pool.name, pool.device.name,
                                                      pool.vendor, pool.nodes[0]))
        if not targets:
            b.patch["calibration"] = {"profiling": {"state": "Done", "pools": []}}
            return None, {}
        chosen = sorted(targets.values())
        d.create.append(build_profiling_configmap(job, dict(body.get("spec") or {})))
        d.create.extend(build_profiling_pods(job, spec, chosen))
        b.phase(c.PHASE_PENDING)
        msg = (f"profiling {', '.join(t[1] for t in chosen)} on pools "
               f"{', '.join(t[0] for t in chosen)} before the first plan")
        b.cond(c.COND_PLANNED, False, c.REASON_PROFILING, msg)
        b.patch["calibration"] = {"profiling": {"state": "Running",
                                                "pools": [t[0] for t in chosen]}}
        d.events.append(Event("Normal", c.REASON_PROFILING, msg))
        d.status = b.patch
        d.retry_after = PROFILING_RETRY_SECONDS
        return d, {}
    if any(_pod_phase(p) not in ("Succeeded", "Failed") for p in pods):
        d.retry_after = PROFILING_RETRY_SECONDS
        return d, {}
    measured: dict[str, LayerProfile] = {}
    for pod in pods:
        name = pod["metadata"]["name"]
        text = "\n".join(termination_messages([pod]))
        try:
            prof = profile_from_doc(yaml.safe_load(text) if text else None, f"pod {name}")
            if not prof.matches(spec.model, precision_bytes(spec.training)):
                raise PlanningInputError(f"pod {name}", "profiled another model shape or "
                                         "precision")
        except (yaml.YAMLError, PlanningInputError) as err:
            d.events.append(Event("Warning", c.REASON_PROFILING,
                                  f"profiling pod {name} gave no profile ({err}); its device "
                                  "is planned on the catalog model"))
            continue
        measured[prof.device] = prof
        d.profiles_to_store[cal.store_key(prof.device, prof.shape, spec.image,
                                          spec.training.precision)] = text
    d.delete.extend(("Pod", p["metadata"]["name"]) for p in pods)
    d.delete.append(("ConfigMap", profiling_configmap_name(job.name)))
    b.patch["calibration"] = {"profiling": {**state, "state": "Done"}}
    if measured:
        d.events.append(Event("Normal", c.REASON_PROFILING,
                              f"profiled {', '.join(sorted(measured))}; planning with the "
                              "measured layer times"))
    return None, measured
