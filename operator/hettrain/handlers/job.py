"""One daemon per HetTrainingJob reconciles it whenever its pods, nodes or spec change.

Pods (label ``hettrain.dev/job``) and Nodes are kept in kopf indices, so a reconcile never lists
the cluster. Pod/Node/job events only wake the job's daemon; the daemon reads the job afresh
(one GET: no stale status, resourceVersions never compared), calls the pure
:func:`hettrain.reconcile.reconcile`, and applies the decision (:mod:`hettrain.kube.apply`).

Environment (all optional): ``HETTRAIN_METRICS_PORT`` (8080; 0 disables),
``HETTRAIN_METRICS_ADDR`` (0.0.0.0), ``HETTRAIN_CLUSTER_CONFIG`` (a cluster YAML whose
``links:``/``devices:`` feed the planner), ``HETTRAIN_RESYNC_SECONDS`` (30),
``HETTRAIN_CREATE_PARALLELISM`` (16), ``HETTRAIN_KOPF_LOG_LEVEL`` (WARNING: kopf's per-object
"handler succeeded" lines), ``KUBECONFIG`` (outside a cluster), the planning budget
(:mod:`hettrain.planguard`: ``HETTRAIN_PLAN_TIMEOUT_SECONDS`` 30, ``HETTRAIN_PLAN_MEMORY_MB``
1024, ``HETTRAIN_PLAN_WORKERS`` 2), ``HETTRAIN_ALLOWED_PRIORITY_CLASSES`` (comma-separated;
empty: none), ``HETTRAIN_UNSCHEDULABLE_SECONDS`` (120), ``HETTRAIN_SCRAPER_NAMESPACE``
(monitoring), ``HETTRAIN_OPERATOR_NAMESPACE`` (the operator's namespace, admitted to the
training pods' metrics ports for calibration; the chart sets it; empty: not admitted),
``HETTRAIN_EVENT_INTERVAL_SECONDS`` (60).

Shared clusters: a node is held only by pods whose controller ownerReference is a live job
(uid checked against the job index) or by the recorded plan of a live job that is launching
or running; GPUs that other workloads' bound pods request are taken off their node's
capacity. kopf fills every index (initial LIST) before any daemon runs, so after a restart
the holdings are rebuilt before the first launch.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import kopf
import yaml

from hettrain import calibration_scrape, metrics
from hettrain.api import constants as c
from hettrain.api.spec import SpecError, parse_job_spec
from hettrain.eventlimit import EventLimiter
from hettrain.kube import apply as kube
from hettrain.kube import profile_store
from hettrain.kube.storage import checkpoint_storage_problem
from hettrain.manifests.ownership import controller_job, owned_by
from hettrain.manifests.profiles import PROFILE_STORE
from hettrain.planguard import Budget, PassWatchdog, PlanWorkers
from hettrain.planning.calibration import store_key
from hettrain.planning.catalog import DeviceSpec
from hettrain.planning.errors import PlanningInputError
from hettrain.planning.inventory import Link, load_topology
from hettrain.planning.plan import Plan
from hettrain.planning.profiles import model_shape, profile_from_doc
from hettrain.reconcile import (
    UNSCHEDULABLE_SECONDS,
    Decision,
    Observed,
    default_planner,
    nodes_held_by_others,
    reconcile,
)

log = logging.getLogger("hettrain.operator")
JOB = (c.GROUP, c.VERSION, c.PLURAL)
FINALIZER = f"{c.GROUP}/finalizer"
FINALIZER_POLICIES = ("finalizer", "none")
# Read at import: it decides which handlers register. "finalizer" (default): one kopf daemon per
# job, which makes kopf put FINALIZER on every job (deletion waits for the daemon to stop).
# "none": per-job loops are asyncio tasks spawned from job events; jobs carry no finalizer, so
# they delete even with the operator gone (children still go by ownerReferences). Single
# replica only: kopf peering pauses watches, not these tasks.
FINALIZER_POLICY = os.environ.get("HETTRAIN_FINALIZER_POLICY", "finalizer")
if FINALIZER_POLICY not in FINALIZER_POLICIES:
    raise ValueError(f"HETTRAIN_FINALIZER_POLICY={FINALIZER_POLICY!r}: must be one of "
                     f"{FINALIZER_POLICIES} (chart value operator.finalizerPolicy)")
ERROR_RETRY_SECONDS = 5.0

_wake: dict[tuple[str, str], asyncio.Event] = {}
_plans: dict[tuple[str, str], tuple[int, Plan]] = {}  # (ns, job) -> (attempt, plan)
_generations: dict[tuple[str, str], int] = {}  # last seen metadata.generation per job
# Pods we created that the watch may not have delivered yet: (ns, job) -> (attempt, monotonic
# time, {name: pod}). Without this, the next pass would see a "missing" part of the gang and
# create it again (harmless 409s, but a second full pass of API calls during the launch).
_expected: dict[tuple[str, str], tuple[int, float, dict[str, dict[str, Any]]]] = {}
# Launches (a new plan's pods) are decided-again and applied one at a time, against the nodes
# every other job holds at that moment, so two jobs planned at once never take the same node.
_launch_lock = threading.Lock()
_tasks: dict[tuple[str, str], asyncio.Task[None]] = {}  # finalizer policy "none" only
# Reconcile passes run here, not in asyncio's small default executor: a pass may wait for a
# planning worker up to the plan budget, and other jobs' passes must not queue behind it.
_pass_pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="hettrain-pass")
EXPECTATION_TTL_SECONDS = 30.0
_api: Any = None
_links: tuple[Link, ...] = ()
_devices: dict[str, DeviceSpec] = {}
_workers: PlanWorkers | None = None  # planning processes (time/memory budget), from startup
_watchdog = PassWatchdog(limit_s=3 * 30.0 + 60.0)
_events = EventLimiter()
_events_lock = threading.Lock()
_priority_classes: tuple[str, ...] = ()
_unschedulable_seconds = UNSCHEDULABLE_SECONDS
_scraper_namespace = "monitoring"
_operator_namespace = ""  # HETTRAIN_OPERATOR_NAMESPACE: admitted to the metrics ports too
HOLDING_PHASES = (c.PHASE_LAUNCHING, c.PHASE_RUNNING)


def _resync_seconds() -> float:
    return float(os.environ.get("HETTRAIN_RESYNC_SECONDS", "30"))


def _wake_job(namespace: str, job: str) -> None:
    """Wake a job's daemon. Call from the event loop only (asyncio.Event is not thread-safe;
    hence every watching handler here is async: no executor hop per watch event either)."""
    ev = _wake.get((namespace, job))
    if ev is not None:
        ev.set()


def _wake_unplanned() -> None:
    """Wake the jobs without a plan (waiting for capacity): nodes came or were freed."""
    for key in list(_wake):
        if key not in _plans:
            _wake_job(*key)


@kopf.on.login()
def login(**kwargs: Any) -> Any:
    """In-cluster ServiceAccount, else $KUBECONFIG (client certificates included)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Fast reaction, quiet per-object logs, topology config, API client, metrics server."""
    global _api, _links, _devices
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=c.GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = FINALIZER
    settings.queueing.idle_timeout = 0.5
    settings.watching.reconnect_backoff = 0.1
    settings.watching.server_timeout = 300
    settings.posting.level = logging.WARNING
    settings.scanning.disabled = os.environ.get("HETTRAIN_SCANNING", "") == "0"
    level = os.environ.get("HETTRAIN_KOPF_LOG_LEVEL", "WARNING").upper()
    logging.getLogger("kopf.objects").setLevel(level)
    topology = os.environ.get("HETTRAIN_CLUSTER_CONFIG")
    if topology:
        try:
            _links, _devices = load_topology(topology)
        except Exception as err:
            raise kopf.PermanentError(
                f"HETTRAIN_CLUSTER_CONFIG={topology}: {err}; point it at a cluster YAML "
                "(kind: Cluster) with links:/devices:, or unset it") from err
        log.info("topology from %s: %d links, %d devices", topology, len(_links), len(_devices))
    _configure_shared_cluster()
    _api = kube.load_client(os.environ.get("KUBECONFIG"))
    port = int(os.environ.get("HETTRAIN_METRICS_PORT", "8080"))
    if port:
        metrics.serve(port, os.environ.get("HETTRAIN_METRICS_ADDR", "0.0.0.0"))


def _configure_shared_cluster() -> None:
    """Planning workers, pass watchdog, allow-lists and limits from the environment; a bad
    value stops the operator naming the variable."""
    global _workers, _watchdog, _events, _priority_classes, _unschedulable_seconds
    global _scraper_namespace, _operator_namespace
    try:
        budget = Budget.from_env()
        _unschedulable_seconds = _positive_env("HETTRAIN_UNSCHEDULABLE_SECONDS",
                                               UNSCHEDULABLE_SECONDS)
        _events = EventLimiter(_positive_env("HETTRAIN_EVENT_INTERVAL_SECONDS", 60.0))
    except ValueError as err:
        raise kopf.PermanentError(str(err)) from err
    _priority_classes = tuple(x.strip() for x in os.environ.get(
        "HETTRAIN_ALLOWED_PRIORITY_CLASSES", "").split(",") if x.strip())
    _scraper_namespace = os.environ.get("HETTRAIN_SCRAPER_NAMESPACE", "monitoring")
    _operator_namespace = os.environ.get("HETTRAIN_OPERATOR_NAMESPACE", "").strip()
    _watchdog = PassWatchdog(limit_s=3 * budget.timeout_s + 60.0)
    _workers = PlanWorkers(budget)
    _workers.warm()
    log.info("planning: %d workers, %gs and %d MiB per plan", budget.workers, budget.timeout_s,
             budget.memory_mb)


def _positive_env(var: str, default: float) -> float:
    raw = os.environ.get(var, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ValueError(f"{var}={raw!r}: must be a number of seconds > 0")
    return value


@kopf.on.cleanup()
async def stop_planning_workers(**_: Any) -> None:
    """Kill the planning worker processes when the operator exits."""
    if _workers is not None:
        _workers.close()


@kopf.on.probe(id="jobs")
async def probe_jobs(**_: Any) -> int:
    """Liveness detail: number of jobs with a running reconcile daemon."""
    return len(_wake)


@kopf.on.probe(id="planning")
async def probe_planning(**_: Any) -> str:
    """Liveness: unhealthy (HTTP 500) while a planning worker or a reconcile pass is stuck
    past its deadline; the kubelet then restarts the operator."""
    stuck = _watchdog.stuck() + (_workers.stuck() if _workers is not None else [])
    if stuck:
        raise kopf.PermanentError("stuck: " + "; ".join(stuck[:5]))
    return "ok"


@kopf.index("", "v1", "pods", labels={c.LABEL_JOB: kopf.PRESENT})
async def pods_by_job(namespace: str, body: Any, **_: Any) -> Any:
    """Pods of each job by their controller ownerReference (never by label alone):
    {(namespace, job): [pod, ...]}; the owner's uid is checked where the pods are used."""
    owner = controller_job(body)
    if owner is None:
        return None
    return {(namespace, owner[0]): dict(body)}


@kopf.index(*JOB)
async def jobs_by_key(namespace: str, name: str, uid: str, body: Any, **_: Any) -> Any:
    """Live jobs: {(namespace, job): {uid, phase, nodes of the recorded plan}}."""
    status = body.get("status") or {}
    return {(namespace, name): {"uid": uid, "phase": status.get("phase"),
                                "nodes": list((status.get("plan") or {}).get("nodes") or [])}}


@kopf.index("", "v1", "pods")
async def gpu_pods_by_node(namespace: str, name: str, body: Any, **_: Any) -> Any:
    """Bound, live pods that request GPUs: {node: {pod, owner, gpus}} (any workload)."""
    spec = body.get("spec") or {}
    node = spec.get("nodeName")
    if not node or (body.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return None
    gpus: dict[str, int] = {}
    for ctr in spec.get("containers") or ():
        res = ctr.get("resources") or {}
        for resource in c.VENDOR_RESOURCES.values():
            qty = (res.get("requests") or {}).get(resource) or (res.get("limits") or {}).get(
                resource)
            try:
                n = int(str(qty)) if qty is not None else 0
            except ValueError:
                n = 0
            if n > 0:
                gpus[resource] = gpus.get(resource, 0) + n
    if not gpus:
        return None
    owner = controller_job(body)
    return {node: {"pod": f"{namespace}/{name}", "gpus": gpus,
                   "owner": None if owner is None else (namespace, owner[0], owner[1])}}


@kopf.index("", "v1", "nodes")
async def nodes_by_name(name: str, body: Any, **_: Any) -> Any:
    """All nodes: {name: node}."""
    return {name: dict(body)}


@kopf.on.event("", "v1", "pods", labels={c.LABEL_JOB: kopf.PRESENT})
async def pod_changed(namespace: str, type: str | None, body: Any, **_: Any) -> None:
    """A job's pod changed: wake its owner's daemon; a pod gone or finished frees its node,
    so also wake the jobs without a plan (waiting for capacity that other jobs hold)."""
    owner = controller_job(body or {})
    if owner is not None:
        _wake_job(namespace, owner[0])
    phase = ((body or {}).get("status") or {}).get("phase")
    if type == "DELETED" or phase in ("Succeeded", "Failed"):
        _wake_unplanned()


@kopf.on.event("", "v1", "nodes")
async def node_changed(name: str, type: str | None, **_: Any) -> None:
    """A node changed: wake the daemons of jobs whose plan uses it, all jobs when a node comes
    or goes, and jobs without a plan yet (waiting for capacity)."""
    for key, (_, plan) in list(_plans.items()):
        # ADDED: a replacement node may be what a WaitForReplacement repair waits for
        if type in ("DELETED", "ADDED") or name in plan.nodes():
            _wake_job(*key)
    _wake_unplanned()


@kopf.on.event(*JOB)
async def job_changed(namespace: str, name: str, meta: Mapping[str, Any], type: str | None,
                      body: Any, pods_by_job: Any, nodes_by_name: Any, jobs_by_key: Any,
                      gpu_pods_by_node: Any, **_: Any) -> None:
    """A spec edit (new generation: suspend, resize...) wakes the daemon, which re-plans;
    deletion drops the job's caches and metrics.

    Our own status writes do not change the generation, so they do not wake it again. (No
    kopf change handlers: kopf writes no diff-base annotation on the jobs.)
    """
    key = (namespace, name)
    if FINALIZER_POLICY == "none":
        _supervise(key, type, meta, body, pods_by_job, nodes_by_name, jobs_by_key,
                   gpu_pods_by_node)
    deleting = type == "DELETED" or meta.get("deletionTimestamp")
    if deleting and _workers is not None and _workers.abandon(key):  # stop planning it
        log.info("%s/%s deleted: its planning was abandoned", namespace, name)
    if type == "DELETED":  # children are garbage-collected through their ownerReferences
        with _events_lock:
            _events.forget(key)
        _generations.pop(key, None)
        _plans.pop(key, None)
        _expected.pop(key, None)
        metrics.set_phase(namespace, name, None)
        return
    generation = int(meta.get("generation") or 0)
    if _generations.get(key) != generation:
        _generations[key] = generation
        _wake_job(namespace, name)


def _current_plan(ns: str, name: str, status: Mapping[str, Any], uid: str) -> Plan | None:
    attempt = int(status.get("attempt") or 0)
    cm = (status.get("plan") or {}).get("configMap")
    if not attempt or not cm:  # no plan recorded (or dropped by a repair waiting for room)
        _plans.pop((ns, name), None)
        return None
    cached = _plans.get((ns, name))
    if cached and cached[0] == attempt:
        return cached[1]
    text = kube.read_plan_json(_api, ns, cm, owner_uid=uid)
    if text is None:
        return None
    plan = Plan.from_json(text)
    _plans[(ns, name)] = (attempt, plan)
    return plan


def _apply(ns: str, name: str, d: Decision, old_phase: str | None, uid: str) -> None:
    """Deletes; Service + plan ConfigMap; status (write-ahead: attempt and plan are recorded
    before any pod exists, so a restart resumes the same attempt); then the pods as a gang,
    only for a job that still exists (:func:`_job_alive`, checked before and after)."""
    if d.leftovers:  # a deleted job's pods under this name: only if that job still owns them
        kube.run_all([functools.partial(kube.delete, _api, ns, "Pod", pod, owner)
                      for pod, owner in d.leftovers])
        log.info("%s/%s: deleted %d pods of a deleted job of the same name", ns, name,
                 len(d.leftovers))
    if d.delete:
        kube.delete_all(_api, ns, d.delete, owner_uid=uid)
    pods = [o for o in d.create if o["kind"] == "Pod"]
    # Service, NetworkPolicy and ConfigMap go out together, then the status write, then the
    # pods. A status naming a new plan is written only once its ConfigMap exists: a crash
    # in between (operator killed, apiserver gone) never leaves a recorded plan without it.
    # (A new attempt's ConfigMap left by a crash before its status write is stale: replace.)
    try:
        kube.run_all([functools.partial(kube.create, _api, ns, obj,
                                        replace=d.plan is not None and obj["kind"] == "ConfigMap")
                      for obj in d.create if obj["kind"] != "Pod"])
    except kube.ForeignObjectError as err:
        if d.plan is not None and d.status and err.kind == "ConfigMap":
            # the new attempt's ConfigMap name is taken by a foreign object: record the
            # attempt anyway, so the next pass (no plan to read) plans attempt+1 under a
            # fresh name instead of retrying this one forever
            kube.patch_status(_api, ns, name, d.status)
        raise
    if d.status:
        kube.patch_status(_api, ns, name, d.status)
    if d.plan is not None:
        _plans[(ns, name)] = (int(d.status.get("attempt") or 0), d.plan)
        metrics.set_plan(ns, name, d.plan.world_size, d.plan.predicted.tokens_per_s,
                         d.plan.predicted.mfu)
    if d.plan_seconds is not None:
        metrics.PLAN_DURATION.observe(d.plan_seconds)
    if pods and not _job_alive(ns, name, uid):
        log.info("%s/%s: deleted during this pass; its %d pods are not created", ns, name,
                 len(pods))
        pods = []
    if pods:
        t_gang = time.perf_counter()
        kube.create_gang(_api, ns, pods)
        log.info("%s/%s: %d pods created in %.0f ms", ns, name, len(pods),
                 1e3 * (time.perf_counter() - t_gang))
        if not _job_alive(ns, name, uid):
            # deleted while the gang was created (kopf stops the daemon, not this thread): a
            # pod created after its owner is gone waits for the garbage collector's dangling
            # owner check and holds its GPU meanwhile; take the gang back now
            kube.delete_all(_api, ns, [("Pod", p["metadata"]["name"]) for p in pods],
                            owner_uid=uid)
            log.info("%s/%s: deleted while its gang was created; %d pods deleted", ns, name,
                     len(pods))
            pods = []
    if pods:
        _expected[(ns, name)] = (int(pods[0]["metadata"]["labels"][c.LABEL_ATTEMPT]),
                                 time.monotonic(), {p["metadata"]["name"]: p for p in pods})
    if d.repair_cause:
        metrics.REPAIRS.labels(ns, name, d.repair_cause).inc()
    _apply_calibration(ns, name, d)
    if d.plan_failure:
        metrics.PLAN_FAILURES.labels(ns, name, d.plan_failure).inc()
    phase = d.status.get("phase") or old_phase
    if phase:
        metrics.set_phase(ns, name, phase)


def _job_alive(ns: str, name: str, uid: str) -> bool:
    """Whether the job ``uid`` still exists and is not being deleted (one GET): the pods of a
    pass are created only for such a job, and taken back if it went away meanwhile."""
    body = kube.get_job(_api, ns, name)
    meta = (body or {}).get("metadata") or {}
    return body is not None and meta.get("uid") == uid and not meta.get("deletionTimestamp")


def _with_expected(ns: str, name: str, pods: list[dict[str, Any]], attempt: int
                   ) -> list[dict[str, Any]]:
    """The indexed pods plus the ones we just created that the index has not shown yet."""
    exp = _expected.get((ns, name))
    if exp is None:
        return pods
    exp_attempt, since, created = exp
    if exp_attempt != attempt or time.monotonic() - since > EXPECTATION_TTL_SECONDS:
        _expected.pop((ns, name), None)
        return pods
    seen = {p["metadata"]["name"] for p in pods}
    if seen >= created.keys():
        _expected.pop((ns, name), None)
        return pods
    return pods + [p for n, p in created.items() if n not in seen]


def reconcile_once(ns: str, name: str, pods_by_job: Any, nodes_by_name: Any,
                   jobs_by_key: Any = None, gpu_pods_by_node: Any = None
                   ) -> tuple[dict[str, Any], Decision] | None:
    """Read the job, observe (indices), decide (pure), apply (API) once; None if it is gone."""
    key = (ns, name)
    _watchdog.begin(key)
    try:
        return _reconcile_once(ns, name, pods_by_job, nodes_by_name, jobs_by_key or {},
                               gpu_pods_by_node or {})
    finally:
        _watchdog.end(key)


def _reconcile_once(ns: str, name: str, pods_by_job: Any, nodes_by_name: Any,
                    jobs_by_key: Any, gpu_pods_by_node: Any
                    ) -> tuple[dict[str, Any], Decision] | None:
    t0 = time.perf_counter()
    body = kube.get_job(_api, ns, name)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return None
    status = body.get("status") or {}
    pods = _with_expected(ns, name, list(pods_by_job.get((ns, name), [])),
                          int(status.get("attempt") or 0))
    nodes = [n for store in nodes_by_name.values() for n in store]
    key = (ns, name)
    live = _live_jobs(jobs_by_key)
    live[key] = str((body.get("metadata") or {}).get("uid") or "")
    obs = Observed(pods=pods, nodes=nodes, plan=_current_plan(ns, name, status, live[key]),
                   links=_links, devices=_devices,
                   foreign_gpus=_foreign_gpus(gpu_pods_by_node, live),
                   unschedulable_seconds=_unschedulable_seconds,
                   priority_classes=_priority_classes, scraper_namespace=_scraper_namespace,
                   operator_namespace=_operator_namespace,
                   storage_problem=checkpoint_storage_problem(_api, ns, body.get("spec")))
    obs = replace(obs, held=_held_by_others(ns, name, pods_by_job, jobs_by_key))
    obs = _with_calibration_inputs(ns, body, obs)
    planner = (_workers.planner((ns, name)) if _workers is not None else default_planner)
    t1 = time.perf_counter()
    d = reconcile(body, obs, planner)
    if d.plan_failure and not d.plan_budget_exceeded:
        # Never fail or park a job on a lagging watch cache: re-plan once on a fresh LIST.
        d = reconcile(body, replace(obs, nodes=kube.list_nodes(_api)), planner)
    if d.plan is None:
        t2 = time.perf_counter()
        _apply(ns, name, d, status.get("phase"), live[key])
    else:
        with _launch_lock:  # another job may have launched onto these nodes meanwhile
            held = _held_by_others(ns, name, pods_by_job, jobs_by_key)
            if not set(d.plan.nodes()).isdisjoint(held):
                d = reconcile(body, replace(obs, held=held), planner)
            t2 = time.perf_counter()
            _apply(ns, name, d, status.get("phase"), live[key])
    if d.create or d.delete:
        log.info("%s/%s: read %.0f ms, decide %.0f ms (plan %.0f ms), apply %.0f ms: "
                 "%d created, %d deleted", ns, name, 1e3 * (t1 - t0), 1e3 * (t2 - t1),
                 1e3 * (d.plan_seconds or 0), 1e3 * (time.perf_counter() - t2),
                 len(d.create), len(d.delete))
    return body, d


def _with_calibration_inputs(ns: str, body: Mapping[str, Any], obs: Observed) -> Observed:
    """With ``spec.calibration`` (``enabled`` or ``profile``): the profile store's profiles
    for this job's model and image, and (enabled, while Running) the stage times its runtime
    measured
    (:mod:`hettrain.calibration_scrape`). Unusable inputs are skipped, never fatal."""
    try:
        spec = parse_job_spec(body.get("spec"))
    except SpecError:
        return obs
    if not (spec.calibration.enabled or spec.calibration.profile):
        return obs
    profiles = {}
    for key, text in profile_store.read_profiles(_api, ns).items():
        try:
            prof = profile_from_doc(yaml.safe_load(text), f"{PROFILE_STORE}/{key}")
        except (yaml.YAMLError, PlanningInputError):
            log.warning("%s/%s: unusable profile %s in %s", ns, body["metadata"]["name"], key,
                        PROFILE_STORE)
            continue
        if key == store_key(prof.device, model_shape(spec.model), spec.image,
                            spec.training.precision):
            profiles[prof.device] = prof
    reports = []
    status = body.get("status") or {}
    done = status.get("calibration") or {}
    decided = (str(done.get("attempt")) == str(status.get("attempt"))
               and not done.get("pendingReplan"))  # nothing left to measure this attempt
    if (spec.calibration.enabled and status.get("phase") == c.PHASE_RUNNING
            and obs.plan is not None and not decided):
        attempt = str(status.get("attempt") or 0)
        pods = [p for p in obs.pods
                if ((p.get("metadata") or {}).get("labels") or {}).get(c.LABEL_ATTEMPT) == attempt]
        reports = calibration_scrape.scrape(calibration_scrape.stage_targets(obs.plan, pods))
    return replace(obs, profiles=profiles, stage_reports=tuple(reports))


def _apply_calibration(ns: str, name: str, d: Decision) -> None:
    """Store refined profiles; export predicted vs measured stage times and re-plans."""
    if d.profiles_to_store:
        profile_store.store_profiles(_api, ns, d.profiles_to_store)
    if d.calibration:
        metrics.set_calibration(ns, name, d.calibration)
    if d.calibration_replan:
        metrics.CALIBRATION_REPLANS.labels(ns, name).inc()


def _live_jobs(jobs_by_key: Any) -> dict[tuple[str, str], str]:
    """{(namespace, job): uid} of the jobs the index holds."""
    out = {}
    for key, store in list(jobs_by_key.items()):
        for entry in store:
            out[tuple(key)] = str(entry.get("uid") or "")
    return out  # type: ignore[return-value]


def _held_by_others(ns: str, name: str, pods_by_job: Any, jobs_by_key: Any = None
                    ) -> dict[str, str]:
    """Nodes other live jobs hold: their own pods (controller ownerReference with the job's
    uid; a pod that merely carries the label holds nothing), pods just created but not
    indexed yet, and the recorded plan of every other job launching or running (its status
    is written before its pods: after a restart mid-launch, the nodes stay booked)."""
    live = _live_jobs(jobs_by_key or {})
    pods: dict[tuple[str, str], list[Any]] = {}
    for key, store in list(pods_by_job.items()):
        uid = live.get(tuple(key))
        if uid:
            pods[tuple(key)] = [p for p in store if owned_by(p, uid)]  # type: ignore[index]
    for key, (_, _, created) in list(_expected.items()):
        pods.setdefault(key, []).extend(created.values())
    held = nodes_held_by_others(pods, (ns, name))
    for key, store in list((jobs_by_key or {}).items()):
        if tuple(key) == (ns, name):
            continue
        for entry in store:
            if entry.get("phase") in HOLDING_PHASES:
                for node in entry.get("nodes") or ():
                    held.setdefault(node, f"{key[0]}/{key[1]}")
    return held


def _foreign_gpus(gpu_pods_by_node: Any, live: Mapping[tuple[str, str], str]
                  ) -> dict[str, dict[str, int]]:
    """GPUs requested per node by bound pods that are not a live job's own (other workloads,
    pods of deleted jobs still terminating, label squatters)."""
    out: dict[str, dict[str, int]] = {}
    for node, store in list(gpu_pods_by_node.items()):
        for entry in store:
            owner = entry.get("owner")
            if owner is not None and live.get((owner[0], owner[1])) == owner[2]:
                continue
            used = out.setdefault(node, {})
            for resource, n in (entry.get("gpus") or {}).items():
                used[resource] = used.get(resource, 0) + int(n)
    return out


def _post_events(body: Mapping[str, Any], d: Decision) -> None:
    """Post the decision's Events, rate-limited and aggregated per job and reason."""
    now = time.monotonic()
    for ev in d.events:
        _post_event(body, ev.type, ev.reason, ev.message, now)


def _post_event(body: Mapping[str, Any], type_: str, reason: str, message: str,
                now: float) -> None:
    """Post one Event unless the rate limiter holds it back (then it is aggregated)."""
    meta = body.get("metadata") or {}
    key = (meta.get("namespace"), meta.get("name"))
    with _events_lock:
        admitted = _events.admit(key, type_, reason, message, now)
    if admitted is not None:
        kopf.event(dict(body), type=type_, reason=reason, message=admitted[:1000])


class _Running:
    """The stop flag of a job loop that runs as a task (falsy until stopped)."""

    def __init__(self) -> None:
        self.stopped = False

    def __bool__(self) -> bool:
        return self.stopped


def _supervise(key: tuple[str, str], type: str | None, meta: Mapping[str, Any], body: Any,
               pods_by_job: Any, nodes_by_name: Any, jobs_by_key: Any = None,
               gpu_pods_by_node: Any = None) -> None:
    """Finalizer policy "none": one job loop task per live job, started on its first event
    (the initial listing too, so a restarted operator picks every job up), ended on DELETED."""
    task = _tasks.get(key)
    if type == "DELETED" or meta.get("deletionTimestamp"):
        if task is not None:
            task.cancel()
            _tasks.pop(key, None)
        return
    if task is None or task.done():
        _tasks[key] = asyncio.create_task(
            job_loop(_Running(), body, key[0], key[1], pods_by_job, nodes_by_name,
                     jobs_by_key, gpu_pods_by_node),
            name=f"hettrain-job-{key[0]}-{key[1]}")


@kopf.on.cleanup()
async def stop_job_tasks(**_: Any) -> None:
    """Finalizer policy "none": cancel the job loops when the operator exits."""
    for task in list(_tasks.values()):
        task.cancel()
    await asyncio.gather(*_tasks.values(), return_exceptions=True)
    _tasks.clear()


async def job_daemon(stopped: kopf.DaemonStopped, body: Any, namespace: str, name: str,
                     pods_by_job: Any, nodes_by_name: Any, jobs_by_key: Any,
                     gpu_pods_by_node: Any, **_: Any) -> None:
    """One kopf daemon per job (finalizer policy "finalizer"): runs :func:`job_loop`."""
    await job_loop(stopped, body, namespace, name, pods_by_job, nodes_by_name, jobs_by_key,
                   gpu_pods_by_node)


if FINALIZER_POLICY == "finalizer":
    job_daemon = kopf.daemon(*JOB, cancellation_timeout=5.0)(job_daemon)


async def job_loop(stopped: Any, body: Any, namespace: str, name: str, pods_by_job: Any,
                   nodes_by_name: Any, jobs_by_key: Any = None, gpu_pods_by_node: Any = None
                   ) -> None:
    """Reconcile the job on every wake-up (pod/node/spec events) or retry deadline, until
    ``stopped`` is truthy or the job is gone."""
    key = (namespace, name)
    wake = _wake.setdefault(key, asyncio.Event())
    try:
        while not stopped:
            wake.clear()
            try:
                result = await asyncio.get_running_loop().run_in_executor(
                    _pass_pool, reconcile_once, namespace, name, pods_by_job, nodes_by_name,
                    jobs_by_key, gpu_pods_by_node)
                if result is None:
                    return
                fresh, d = result
                _post_events(fresh, d)
                delay = d.retry_after if d.retry_after is not None else _resync_seconds()
            except kube.ForeignObjectError as err:
                metrics.RECONCILE_ERRORS.labels("foreign-object").inc()
                log.warning("%s/%s: %s", namespace, name, err)
                _post_event(body, "Warning", "ForeignObject", str(err), time.monotonic())
                delay = ERROR_RETRY_SECONDS
            except kube.GangCreateError as err:
                metrics.RECONCILE_ERRORS.labels("gang-create").inc()
                log.warning("gang create %s/%s failed: %s", namespace, name, err)
                _post_event(body, "Warning", "GangCreateFailed", str(err), time.monotonic())
                delay = ERROR_RETRY_SECONDS
            except Exception:
                metrics.RECONCILE_ERRORS.labels("reconcile").inc()
                log.exception("reconcile %s/%s failed", namespace, name)
                delay = ERROR_RETRY_SECONDS
            try:
                await asyncio.wait_for(wake.wait(), timeout=max(0.05, delay))
                await asyncio.sleep(0.02)  # coalesce a burst of watch events into one pass
            except TimeoutError:
                pass
    finally:
        _wake.pop(key, None)
