"""Profiling pods (``spec.calibration.profile``): one per pool, before the first plan (pure).

Each pod runs ``python -m hettrain.runtime.profile`` (what ``hettrain profile`` runs) in the
job's image on one node of its pool, with one accelerator, for the job's model (the job
manifest mounted from a ConfigMap), and writes the ``DeviceProfile`` YAML (a few hundred
bytes) to its termination message, where the operator reads it: no storage and no
Kubernetes permission in the pod. The pods carry attempt label ``0``, so the first launch
deletes them with the other stale pods.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import yaml

from hettrain.api import constants as c
from hettrain.api.spec import JobSpec
from hettrain.manifests.builders import (
    JobRef,
    _harden_pod,
    _meta,
    common_labels,
    dns_name,
    node_pinning,
)

COMPONENT_PROFILER = "profiler"
JOB_MOUNT_DIR = "/etc/hettrain-job"
JOB_KEY = "job.yaml"
TERMINATION_LOG = "/dev/termination-log"
PROFILE_MICRO_BATCHES = "1,2,4"
PROFILE_REPEATS = "5"
PROFILING_ATTEMPT = "0"


def profiling_configmap_name(job: str) -> str:
    """The ConfigMap with the job manifest the profiling pods read."""
    return dns_name(job, "profiling", limit=253)


def profiling_pod_name(job: str, pool: str) -> str:
    """The profiling pod of one pool (a DNS label; long names are hashed)."""
    digest = hashlib.sha256(pool.encode()).hexdigest()[:6]
    return dns_name(job, f"prof-{digest}", limit=63)


def build_profiling_configmap(job: JobRef, spec_doc: dict[str, Any]) -> dict[str, Any]:
    """The job manifest (``spec`` as the user wrote it) for ``hettrain.runtime.profile``."""
    doc = {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": job.name},
           "spec": spec_doc}
    labels = common_labels(job.name, COMPONENT_PROFILER)
    labels[c.LABEL_ATTEMPT] = PROFILING_ATTEMPT
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(job, profiling_configmap_name(job.name), labels),
            "data": {JOB_KEY: yaml.safe_dump(doc, sort_keys=False)}}


def build_profiling_pods(job: JobRef, spec: JobSpec,
                         targets: Sequence[tuple[str, str, str, str]]) -> list[dict[str, Any]]:
    """One pod per ``(pool, device, vendor, node)``: profile ``device`` on ``node``."""
    pods = []
    for pool, device, vendor, node in targets:
        name = profiling_pod_name(job.name, pool)
        labels = common_labels(job.name, COMPONENT_PROFILER)
        labels.update({c.LABEL_ATTEMPT: PROFILING_ATTEMPT, c.LABEL_POOL: pool})
        container: dict[str, Any] = {
            "name": "profiler", "image": spec.image,
            "command": ["python", "-m", "hettrain.runtime.profile",
                        f"{JOB_MOUNT_DIR}/{JOB_KEY}", "--device-name", device,
                        "--out", TERMINATION_LOG, "--micro-batches", PROFILE_MICRO_BATCHES,
                        "--repeats", PROFILE_REPEATS],
            "env": [{"name": "HETTRAIN_JOB", "value": job.name}],
            "volumeMounts": [{"name": "job", "mountPath": JOB_MOUNT_DIR, "readOnly": True}],
            "terminationMessagePolicy": "File",
        }
        resource = c.VENDOR_RESOURCES.get(vendor)
        if resource:
            container["resources"] = {"requests": {resource: "1"}, "limits": {resource: "1"}}
        pod_spec: dict[str, Any] = {
            "restartPolicy": "Never",
            **node_pinning(node),
            "containers": [container],
            "volumes": [{"name": "job", "configMap": {
                "name": profiling_configmap_name(job.name)}}],
        }
        if spec.priority_class_name:
            pod_spec["priorityClassName"] = spec.priority_class_name
        if spec.scheduler_name:
            pod_spec["schedulerName"] = spec.scheduler_name
        _harden_pod(pod_spec, container, spec)
        pods.append({"apiVersion": "v1", "kind": "Pod", "metadata": _meta(job, name, labels),
                     "spec": pod_spec})
    return pods
