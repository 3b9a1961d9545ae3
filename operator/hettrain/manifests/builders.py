"""Child objects of a HetTrainingJob as plain dicts: headless Service, plan ConfigMap, gang Pods.

Names are deterministic (same job, attempt and plan → same names), so a restarted operator finds
what it already created instead of duplicating it.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hettrain.api import constants as c
from hettrain.api.spec import DATA_MOUNT_DIR, JobSpec
from hettrain.planning.plan import Plan

MAX_NAME = 63
MAX_LABEL_VALUE = 63
PLAN_MOUNT_DIR = "/etc/hettrain"
CHECKPOINT_MOUNT_DIR = "/checkpoints"
RUNTIME_GID = 10001  # the runtime image's group (images/runtime/Dockerfile)
TERMINATION_LOG = "/dev/termination-log"
S3_SECRET_KEYS = (("AWS_ACCESS_KEY_ID", False), ("AWS_SECRET_ACCESS_KEY", False),
                  ("AWS_SESSION_TOKEN", True), ("AWS_DEFAULT_REGION", True))  # (key, optional)
COMPONENT_WORKER = "worker"
MANAGED_BY = "hettrain-operator"


@dataclass(frozen=True, slots=True)
class JobRef:
    """Identity of the owning HetTrainingJob (from its metadata)."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> JobRef:
        """Read name/namespace/uid from a CR body."""
        meta = body.get("metadata") or {}
        return cls(str(meta["name"]), str(meta.get("namespace") or "default"),
                   str(meta.get("uid") or ""))


def dns_name(*parts: str | int, limit: int = MAX_NAME) -> str:
    """A DNS-1123 label from parts; too long → truncated with a stable 6-hex hash suffix."""
    raw = "-".join(str(p) for p in parts).lower()
    name = re.sub(r"[^a-z0-9-]+", "-", raw).strip("-")
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(raw.encode()).hexdigest()[:6]
    return f"{name[: limit - 7].rstrip('-')}-{digest}"


_FINGERPRINTS: OrderedDict[int, tuple[Plan, str]] = OrderedDict()
_FINGERPRINT_CACHE = 32


def plan_fingerprint(plan: Plan) -> str:
    """``plan.fingerprint()``, memoised per plan object (it hashes the whole plan, ~40 ms for
    512 ranks, and one launch needs it for the ConfigMap, every pod and the status)."""
    hit = _FINGERPRINTS.get(id(plan))
    if hit is not None and hit[0] is plan:
        return hit[1]
    fp = plan.fingerprint()
    _FINGERPRINTS[id(plan)] = (plan, fp)  # holding the plan keeps its id() unique
    while len(_FINGERPRINTS) > _FINGERPRINT_CACHE:
        _FINGERPRINTS.popitem(last=False)
    return fp


def service_name(job: str) -> str:
    """Headless rendezvous Service of a job."""
    return dns_name(job, "ranks")


def configmap_name(job: str, attempt: int) -> str:
    """Plan ConfigMap of one attempt."""
    return dns_name(job, "plan", f"a{attempt}", limit=253)


def pod_name(job: str, attempt: int, rank_start: int) -> str:
    """Pod hosting ranks starting at ``rank_start`` in one attempt."""
    return dns_name(job, f"a{attempt}", f"r{rank_start}")


def owner_reference(job: JobRef) -> dict[str, Any]:
    """controller=true ownerReference so children are garbage-collected with the job."""
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "name": job.name, "uid": job.uid,
            "controller": True, "blockOwnerDeletion": True}


def job_label(job: str) -> str:
    """The job's name as a label value: itself when it fits (≤ 63), else truncated with a
    stable 6-hex hash suffix (job names may have up to 253 characters)."""
    if len(job) <= MAX_LABEL_VALUE:
        return job
    digest = hashlib.sha256(job.encode()).hexdigest()[:6]
    return f"{job[: MAX_LABEL_VALUE - 7].rstrip('-.')}-{digest}"


def common_labels(job: str, component: str) -> dict[str, str]:
    """app.kubernetes.io/* and hettrain.dev/job labels (values per :func:`job_label`)."""
    value = job_label(job)
    return {c.LABEL_APP_NAME: "hettrain", c.LABEL_APP_INSTANCE: value,
            c.LABEL_APP_COMPONENT: component, c.LABEL_APP_MANAGED_BY: MANAGED_BY,
            c.LABEL_JOB: value}


def _meta(job: JobRef, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": job.namespace, "labels": labels,
            "ownerReferences": [owner_reference(job)]}


def build_service(job: JobRef) -> dict[str, Any]:
    """Headless Service giving each pod a stable DNS name (subdomain) for rendezvous."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(job, service_name(job.name), common_labels(job.name, "rendezvous")),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": {c.LABEL_JOB: job_label(job.name)},
                 "ports": [{"name": "rendezvous", "port": c.DEFAULT_MASTER_PORT}]},
    }


def build_configmap(job: JobRef, plan: Plan, attempt: int) -> dict[str, Any]:
    """ConfigMap holding ``plan.json`` for one attempt."""
    labels = common_labels(job.name, "plan")
    labels[c.LABEL_PLAN_HASH] = plan_fingerprint(plan)
    labels[c.LABEL_ATTEMPT] = str(attempt)
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(job, configmap_name(job.name, attempt), labels),
            "data": {c.PLAN_CONFIGMAP_KEY: plan.to_json(indent=1)}}


def master_addr(job: JobRef, plan: Plan, attempt: int) -> str:
    """DNS name of the pod hosting rank 0 (hostname.subdomain.namespace.svc)."""
    first = plan.ranks_on(plan.ranks[0].node)[0].rank
    return f"{pod_name(job.name, attempt, first)}.{service_name(job.name)}.{job.namespace}.svc"


def pod_names(job: str, plan: Plan, attempt: int) -> list[str]:
    """Names of the pods :func:`build_pods` makes for this plan and attempt (cheap)."""
    return [pod_name(job, attempt, plan.ranks_on(node)[0].rank) for node in plan.nodes()]


def node_pinning(node: str) -> dict[str, Any]:
    """Pod-spec fields that pin a pod to ``node`` (required node affinity on its hostname
    label) and tolerate the kwok fake-node taint, so the same manifests run on kwok."""
    return {
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": c.LABEL_HOSTNAME, "operator": "In", "values": [node]}]}]}}},
        "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists",
                         "effect": "NoSchedule"}],
    }


def build_pods(job: JobRef, spec: JobSpec, plan: Plan, attempt: int,
               resume: bool) -> list[dict[str, Any]]:
    """One Pod per planned node, hosting that node's consecutive ranks, pinned to the node."""
    addr = master_addr(job, plan, attempt)
    fingerprint = plan_fingerprint(plan)
    pods = []
    for node in plan.nodes():
        ranks = plan.ranks_on(node)
        start = ranks[0].rank
        if [r.rank for r in ranks] != list(range(start, start + len(ranks))):
            raise ValueError(f"plan: ranks on node {node} are not consecutive; re-plan")
        stage = plan.stage_of(ranks[0])  # its replica group's stage with plan.groups
        resource = c.VENDOR_RESOURCES.get(stage.vendor)
        name = pod_name(job.name, attempt, start)
        labels = common_labels(job.name, COMPONENT_WORKER)
        labels.update({c.LABEL_RANK: str(start), c.LABEL_STAGE: str(stage.index),
                       c.LABEL_PLAN_HASH: fingerprint, c.LABEL_ATTEMPT: str(attempt),
                       c.LABEL_POOL: ranks[0].pool})
        if plan.groups:  # the stage label is a coordinate inside this group's pipeline
            labels[c.LABEL_GROUP] = str(ranks[0].group)
        env = {
            c.ENV_PLAN_PATH: f"{PLAN_MOUNT_DIR}/{c.PLAN_CONFIGMAP_KEY}",
            c.ENV_MASTER_ADDR: addr,
            c.ENV_MASTER_PORT: str(c.DEFAULT_MASTER_PORT),
            c.ENV_WORLD_SIZE: str(plan.world_size),
            c.ENV_NODE_RANK_START: str(start),
            c.ENV_LOCAL_WORLD_SIZE: str(len(ranks)),
            c.ENV_BACKEND: stage.backend,
            c.ENV_RESUME: "1" if resume else "0",
            "HETTRAIN_CHECKPOINT_INTERVAL": str(spec.checkpoint.interval_steps),
            "HETTRAIN_JOB": job.name,
            "HETTRAIN_ATTEMPT": str(attempt),
        }
        volumes: list[dict[str, Any]] = [
            {"name": "plan", "configMap": {"name": configmap_name(job.name, attempt)}}]
        mounts: list[dict[str, Any]] = [
            {"name": "plan", "mountPath": PLAN_MOUNT_DIR, "readOnly": True}]
        storage = checkpoint_storage(job, spec)
        env.update(storage.env)
        volumes.extend(storage.volumes)
        mounts.extend(storage.mounts)
        if spec.data.pvc:  # the token set; the plan's data.uri points inside this mount
            volumes.append({"name": "data", "persistentVolumeClaim": {
                "claimName": spec.data.pvc, "readOnly": True}})
            mounts.append({"name": "data", "mountPath": DATA_MOUNT_DIR, "readOnly": True})
        container: dict[str, Any] = {
            "name": "trainer", "image": spec.image,
            "env": [{"name": k, "value": v} for k, v in env.items()] + storage.secret_env,
            "volumeMounts": mounts,
            "ports": [{"name": "rendezvous", "containerPort": c.DEFAULT_MASTER_PORT},
                      {"name": "metrics", "containerPort": 9400}],
        }
        if resource:
            qty = str(len(ranks))
            container["resources"] = {"requests": {resource: qty}, "limits": {resource: qty}}
        if spec.command:
            container["command"] = list(spec.command)
        if spec.args:
            container["args"] = list(spec.args)
        pod_spec: dict[str, Any] = {
            "restartPolicy": "Never",
            "hostname": name,
            "subdomain": service_name(job.name),
            **node_pinning(node),
            "containers": [container],
            "volumes": volumes,
        }
        if storage.fs_group is not None:  # the image user can write the mounted PVC
            pod_spec.setdefault("securityContext", {}).setdefault("fsGroup", storage.fs_group)
        if spec.priority_class_name:
            pod_spec["priorityClassName"] = spec.priority_class_name
        if spec.scheduler_name:
            pod_spec["schedulerName"] = spec.scheduler_name
        _harden_pod(pod_spec, container, spec)
        pods.append({"apiVersion": "v1", "kind": "Pod",
                     "metadata": _meta(job, name, labels), "spec": pod_spec})
    return pods


# ---------------------------------------------------------------- security (shared clusters)

#: TCP ports a training pod listens on besides the TCPStore (MASTER_PORT): the ephemeral
#: range is pinned by the namespaced sysctl ``net.ipv4.ip_local_port_range`` (a "safe"
#: sysctl, allowed by Pod Security "restricted"), so gloo/NCCL listeners land inside it and
#: the job's NetworkPolicy can admit exactly these ports.
COLLECTIVE_PORT_RANGE = (30000, 30999)
RUNTIME_METRICS_PORT = 9400
METRICS_PORTS_PER_POD = 64  # one per rank of a pod (gpusPerNode <= 64)
RUNTIME_UID = 10001  # the runtime image's user (images/runtime/Dockerfile)
ENV_COLLECTIVE_PORTS = "HETTRAIN_COLLECTIVE_PORTS"


def _harden_pod(pod_spec: dict[str, Any], container: dict[str, Any], spec: JobSpec) -> None:
    """Pod Security "restricted": non-root, RuntimeDefault seccomp, no privilege escalation,
    all capabilities dropped; no ServiceAccount token; collective ports pinned."""
    lo, hi = COLLECTIVE_PORT_RANGE
    pod_spec["automountServiceAccountToken"] = False
    pod_spec["securityContext"] = {
        "runAsNonRoot": True, "runAsUser": RUNTIME_UID, "runAsGroup": RUNTIME_UID,
        "fsGroup": RUNTIME_UID, "seccompProfile": {"type": "RuntimeDefault"},
        "sysctls": [{"name": "net.ipv4.ip_local_port_range", "value": f"{lo} {hi}"}]}
    container["securityContext"] = {
        "allowPrivilegeEscalation": False, "runAsNonRoot": True, "privileged": False,
        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
    container["env"].append({"name": ENV_COLLECTIVE_PORTS, "value": f"{lo}-{hi}"})


def network_policy_name(job: str) -> str:
    """The per-job NetworkPolicy."""
    return dns_name(job, "net", limit=253)


def build_network_policy(job: JobRef, scraper_namespace: str = "monitoring",
                         operator_namespace: str = "") -> dict[str, Any]:
    """Ingress to the job's pods only from the job's own pods, on the ports they use
    (TCPStore, the pinned collective range), plus the metrics ports from the scraper's
    namespace and (when given) the operator's own, whose calibration reads them.
    Everything else (other tenants, other jobs) is denied."""
    me = {c.LABEL_JOB: job_label(job.name)}
    lo, hi = COLLECTIVE_PORT_RANGE
    scrapers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}
                for ns in dict.fromkeys((scraper_namespace, operator_namespace)) if ns]
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _meta(job, network_policy_name(job.name),
                          common_labels(job.name, "network-policy")),
        "spec": {
            "podSelector": {"matchLabels": me},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": me}}],
                 "ports": [{"protocol": "TCP", "port": c.DEFAULT_MASTER_PORT},
                           {"protocol": "TCP", "port": lo, "endPort": hi}]},
                {"from": scrapers,
                 # rank r of a pod serves on 9400 + r (calibration reads every stage's first)
                 "ports": [{"protocol": "TCP", "port": RUNTIME_METRICS_PORT,
                            "endPort": RUNTIME_METRICS_PORT + METRICS_PORTS_PER_POD - 1}]},
            ],
        },
    }


@dataclass(slots=True)
class CheckpointStorage:
    """What a worker pod needs for its checkpoint storage (:func:`checkpoint_storage`)."""

    env: dict[str, str] = field(default_factory=dict)
    secret_env: list[dict[str, Any]] = field(default_factory=list)  # valueFrom secretKeyRef
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    fs_group: int | None = None


def job_checkpoint_uri(job: JobRef, spec: JobSpec) -> str | None:
    """The URI the runtime writes to: a PVC or an s3:// URI gets the per-job subdirectory
    ``<namespace>/<job>`` (two jobs sharing one never collide); a plain path is used as is."""
    ck = spec.checkpoint
    if ck.pvc:
        return f"{CHECKPOINT_MOUNT_DIR}/{job.namespace}/{job.name}"
    if ck.uri and ck.uri.startswith("s3://"):
        return f"{ck.uri.rstrip('/')}/{job.namespace}/{job.name}"
    return ck.uri


def checkpoint_storage(job: JobRef, spec: JobSpec) -> CheckpointStorage:
    """Env, Secret-backed env, volume and mount for ``spec.checkpoint``.

    Credentials reach the container only as ``secretKeyRef`` env from the Secret
    ``spec.checkpoint.secretRef`` (never as values in the pod, the plan ConfigMap or args).
    """
    ck, out = spec.checkpoint, CheckpointStorage()
    uri = job_checkpoint_uri(job, spec)
    if uri is None:
        return out
    out.env.update({c.ENV_CHECKPOINT_URI: uri, "HETTRAIN_CHECKPOINT_KEEP": str(ck.keep),
                    "HETTRAIN_CHECKPOINT_ASYNC": "1" if ck.async_save else "0",
                    "HETTRAIN_TERMINATION_LOG": TERMINATION_LOG})
    if ck.pvc:
        out.volumes.append({"name": "checkpoints",
                            "persistentVolumeClaim": {"claimName": ck.pvc}})
        out.mounts.append({"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT_DIR})
        out.fs_group = RUNTIME_GID
    if ck.endpoint:
        out.env["AWS_ENDPOINT_URL"] = ck.endpoint
    if ck.secret_ref:
        out.secret_env = [{"name": key, "valueFrom": {"secretKeyRef": {
            "name": ck.secret_ref, "key": key, **({"optional": True} if optional else {})}}}
            for key, optional in S3_SECRET_KEYS]
    return out
