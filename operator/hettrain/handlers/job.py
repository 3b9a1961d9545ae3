"""One daemon per HetTrainingJob reconciles it whenever its pods or nodes change.

Pods (label ``hettrain.dev/job``) and Nodes are kept in kopf indices, so a reconcile never lists
the cluster. Pod/Node events only wake the job's daemon; the daemon observes, calls the pure
:func:`hettrain.reconcile.reconcile`, and applies the decision (:mod:`hettrain.kube.apply`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from hettrain import metrics
from hettrain.api import constants as c
from hettrain.kube import apply as kube
from hettrain.planning.plan import Plan
from hettrain.reconcile import Decision, Observed, reconcile

log = logging.getLogger("hettrain.operator")
JOB = (c.GROUP, c.VERSION, c.PLURAL)
IDLE_RESYNC_SECONDS = float(os.environ.get("HETTRAIN_RESYNC_SECONDS", "30"))

_wake: dict[tuple[str, str], asyncio.Event] = {}
_plans: dict[tuple[str, str], tuple[int, Plan]] = {}  # (ns, job) -> (attempt, plan)
_latest: dict[tuple[str, str], dict[str, Any]] = {}  # our last status write per job
_api: Any = None


def _wake_job(namespace: str, job: str) -> None:
    ev = _wake.get((namespace, job))
    if ev is not None:
        ev.set()


@kopf.on.login()
def login(**kwargs: Any) -> Any:
    """In-cluster ServiceAccount, else $KUBECONFIG (client certificates included)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Fast reaction, progress in annotations (status stays schema-only), metrics server."""
    global _api
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=c.GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{c.GROUP}/finalizer"
    settings.queueing.idle_timeout = 0.5
    settings.watching.reconnect_backoff = 0.1
    settings.watching.server_timeout = 300
    settings.posting.level = logging.INFO
    settings.scanning.disabled = os.environ.get("HETTRAIN_SCANNING", "") == "0"
    _api = kube.load_client(os.environ.get("KUBECONFIG"))
    port = int(os.environ.get("HETTRAIN_METRICS_PORT", "8080"))
    if port:
        try:
            metrics.serve(port)
        except OSError as err:  # already served (e.g. two in-process runs in tests)
            log.warning("metrics port %s: %s", port, err)


@kopf.on.probe(id="jobs")
def probe_jobs(**_: Any) -> int:
    """Liveness detail: number of jobs with a running reconcile daemon."""
    return len(_wake)


@kopf.index("", "v1", "pods", labels={c.LABEL_JOB: kopf.PRESENT})
def pods_by_job(namespace: str, labels: Mapping[str, str], body: Any, **_: Any) -> Any:
    """Pods of each job: {(namespace, job): [pod, ...]}."""
    return {(namespace, labels[c.LABEL_JOB]): dict(body)}


@kopf.index("", "v1", "nodes")
def nodes_by_name(name: str, body: Any, **_: Any) -> Any:
    """All nodes: {name: node}."""
    return {name: dict(body)}


@kopf.on.event("", "v1", "pods", labels={c.LABEL_JOB: kopf.PRESENT})
def pod_changed(namespace: str, labels: Mapping[str, str], **_: Any) -> None:
    """A job's pod changed: wake its daemon."""
    _wake_job(namespace, labels[c.LABEL_JOB])


@kopf.on.event("", "v1", "nodes")
def node_changed(name: str, type: str | None, **_: Any) -> None:
    """A node changed: wake the daemons of jobs whose plan uses it (or waiting for nodes)."""
    for key, (_, plan) in list(_plans.items()):
        if type == "DELETED" or name in plan.nodes():
            _wake_job(*key)
    for key in list(_wake):
        if key not in _plans:
            _wake_job(*key)


@kopf.on.update(*JOB, field="spec")
def spec_changed(namespace: str, name: str, **_: Any) -> None:
    """Spec edits (suspend, resize...) wake the daemon, which re-plans by generation."""
    _wake_job(namespace, name)


@kopf.on.delete(*JOB, optional=True)
def job_deleted(namespace: str, name: str, **_: Any) -> None:
    """Children are garbage-collected through ownerReferences; drop our caches."""
    _plans.pop((namespace, name), None)
    _latest.pop((namespace, name), None)
    metrics.set_phase(namespace, name, None)


def _freshest(body: Mapping[str, Any], key: tuple[str, str]) -> dict[str, Any]:
    """The body, with our last status write if the watch has not delivered it yet."""
    live = {"metadata": dict(body["metadata"]), "spec": dict(body.get("spec") or {}),
            "status": dict(body.get("status") or {})}
    mine = _latest.get(key)
    if mine is not None:
        try:
            newer = int(mine["metadata"]["resourceVersion"]) > int(
                live["metadata"]["resourceVersion"])
        except (KeyError, ValueError):
            newer = False
        if newer:
            live["status"] = dict(mine.get("status") or {})
    return live


def _current_plan(ns: str, name: str, status: Mapping[str, Any]) -> Plan | None:
    attempt = int(status.get("attempt") or 0)
    cached = _plans.get((ns, name))
    if cached and cached[0] == attempt:
        return cached[1]
    cm = (status.get("plan") or {}).get("configMap")
    if not attempt or not cm:
        return None
    text = kube.read_plan_json(_api, ns, cm)
    if text is None:
        return None
    plan = Plan.from_json(text)
    _plans[(ns, name)] = (attempt, plan)
    return plan


def _apply(body: Mapping[str, Any], ns: str, name: str, d: Decision) -> None:
    if d.delete:
        kube.delete_all(_api, ns, d.delete)
    if d.create:
        kube.create_gang(_api, ns, d.create)
    if d.plan is not None:
        _plans[(ns, name)] = (int(d.status.get("attempt") or 0), d.plan)
        metrics.set_plan(ns, name, d.plan.world_size, d.plan.predicted.tokens_per_s,
                         d.plan.predicted.mfu, d.plan_seconds)
    if d.status:
        _latest[(ns, name)] = kube.patch_status(_api, ns, name, d.status)
    for ev in d.events:
        kopf.event(dict(body), type=ev.type, reason=ev.reason, message=ev.message[:1000])
    if d.repair_cause:
        metrics.REPAIRS.labels(ns, name, d.repair_cause).inc()
    if d.plan_failure:
        metrics.PLAN_FAILURES.labels(ns, name, d.plan_failure).inc()
    phase = d.status.get("phase") or (body.get("status") or {}).get("phase")
    if phase:
        metrics.set_phase(ns, name, phase)


def reconcile_once(body: Mapping[str, Any], pods_by_job: Any, nodes_by_name: Any
                   ) -> Decision:
    """Observe (indices), decide (pure), apply (API) once for one job."""
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    fresh = _freshest(body, (ns, name))
    pods = list(pods_by_job.get((ns, name), []))
    nodes = [n for store in nodes_by_name.values() for n in store]
    obs = Observed(pods=pods, nodes=nodes, plan=_current_plan(ns, name, fresh["status"]))
    d = reconcile(fresh, obs)
    _apply(body, ns, name, d)
    return d


@kopf.daemon(*JOB, cancellation_timeout=5.0)
async def job_daemon(stopped: kopf.DaemonStopped, body: Any, namespace: str, name: str,
                     pods_by_job: Any, nodes_by_name: Any, **_: Any) -> None:
    """Reconcile the job on every wake-up (pod/node/spec events) or retry deadline."""
    key = (namespace, name)
    wake = _wake.setdefault(key, asyncio.Event())
    try:
        while not stopped:
            wake.clear()
            try:
                d = await asyncio.to_thread(reconcile_once, body, pods_by_job, nodes_by_name)
                delay = d.retry_after if d.retry_after is not None else IDLE_RESYNC_SECONDS
            except kube.GangCreateError as err:
                metrics.RECONCILE_ERRORS.labels("gang-create").inc()
                kopf.event(dict(body), type="Warning", reason="GangCreateFailed",
                           message=str(err)[:1000])
                delay = 5.0
            except Exception:
                metrics.RECONCILE_ERRORS.labels("reconcile").inc()
                log.exception("reconcile %s/%s failed", namespace, name)
                delay = 5.0
            try:
                await asyncio.wait_for(wake.wait(), timeout=max(0.05, delay))
                await asyncio.sleep(0.05)  # coalesce bursts of watch events
            except TimeoutError:
                pass
    finally:
        _wake.pop(key, None)
