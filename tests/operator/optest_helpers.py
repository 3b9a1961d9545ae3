"""Node and job builders for the pure operator tests."""

from __future__ import annotations

import copy
from typing import Any

from hettrain.api import constants as c


def make_node(name: str, pool: str, device: str, vendor: str, gpus: int, dc: str,
              ready: bool = True) -> dict[str, Any]:
    """A Node dict as the API returns it (labels, allocatable, Ready condition)."""
    resource = c.VENDOR_RESOURCES[vendor]
    return {
        "metadata": {"name": name, "labels": {
            c.LABEL_HOSTNAME: name, c.LABEL_REGION: dc, c.LABEL_POOL: pool,
            c.LABEL_DEVICE: device, c.LABEL_VENDOR: vendor}},
        "spec": {},
        "status": {"allocatable": {resource: str(gpus), "cpu": "64"},
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def hetero_nodes(n_nvidia: int = 2, n_amd: int = 2, gpus: int = 8) -> list[dict[str, Any]]:
    """H100 nodes in dc-a and MI300X nodes in dc-b."""
    return ([make_node(f"h100-{i:03d}", "h100", "H100-SXM", "nvidia", gpus, "dc-a")
             for i in range(n_nvidia)]
            + [make_node(f"mi300-{i:03d}", "mi300", "MI300X", "amd", gpus, "dc-b")
               for i in range(n_amd)])


def job_body(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None,
             generation: int = 1) -> dict[str, Any]:
    """A HetTrainingJob body."""
    base = {"model": {"preset": "gpt3-1.3b"},
            "training": {"globalBatch": 64, "steps": 10},
            "data": {"synthetic": True},
            "checkpoint": {"uri": "/ckpt", "intervalSteps": 5},
            "failurePolicy": {"maxRepairs": 2, "minGPUs": 8, "debounceSeconds": 2}}
    base.update(spec or {})
    return {"apiVersion": c.API_VERSION, "kind": c.KIND,
            "metadata": {"name": "job1", "namespace": "ns", "uid": "u-1",
                         "generation": generation},
            "spec": base, "status": status or {}}


def apply_decision(body: dict[str, Any], d: Any, pods: list[dict[str, Any]]
                   ) -> list[dict[str, Any]]:
    """Apply a reconcile ``Decision`` like the API server would: merge its status into
    ``body``, delete its pods, create its new pods; returns the pods after it."""
    body["status"] = {**body.get("status", {}), **d.status}
    gone = {n for k, n in d.delete if k == "Pod"}
    pods = [p for p in pods if p["metadata"]["name"] not in gone]
    names = {p["metadata"]["name"] for p in pods}
    pods += [copy.deepcopy(o) for o in d.create
             if o["kind"] == "Pod" and o["metadata"]["name"] not in names]
    return pods
