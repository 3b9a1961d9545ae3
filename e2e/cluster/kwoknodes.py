"""Heterogeneous fake GPU nodes for the local control plane, backed by kwok.

A cluster YAML (``kind: Cluster``, the format the planner reads) becomes one Node object per
pool node, named ``<pool>-<index:03d>``, labelled and sized like a real GPU node, annotated
``kwok.x-k8s.io/node: fake`` so the kwok started by ``e2e/cluster/up`` adopts it (marks it
Ready, heartbeats it, runs the pods bound to it). Faults are injected through kwok stages
(``kwok-node-stages.yaml``): :func:`mark_not_ready` annotates the node ``hettrain.dev/fault``,
kwok writes Ready=False (or Unknown) once and stops heartbeating, and the node lifecycle
controller taints it like a real failed node. :func:`mark_ready` heals it.

Usable as a library (tests, fixtures) and from the shell::

    python -m e2e.cluster.kwoknodes create examples/clusters/demo.yaml
    python -m e2e.cluster.kwoknodes not-ready h100-east-003
    python -m e2e.cluster.kwoknodes delete examples/clusters/demo.yaml
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from hettrain.api import constants as c
from hettrain.kube.apply import raw_request
from hettrain.planning.catalog import CATALOG
from hettrain.planning.inventory import DEFAULT_NIC_GBPS

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
FAULT_ANNOTATION = "hettrain.dev/fault"
FAULT_NOT_READY = "not-ready"  # kwok writes Ready=False -> node.kubernetes.io/not-ready taints
FAULT_UNREACHABLE = "unreachable"  # kwok writes Ready=Unknown -> .../unreachable taints
FAULTS = (FAULT_NOT_READY, FAULT_UNREACHABLE)
TAINT_NOT_READY = "node.kubernetes.io/not-ready"
TAINT_UNREACHABLE = "node.kubernetes.io/unreachable"
NODE_CPU = "128"
NODE_MEMORY = "1Ti"
NODE_PODS = "110"

_MERGE_PATCH = "application/merge-patch+json"
_STRATEGIC_PATCH = "application/strategic-merge-patch+json"


class ClusterSpecError(ValueError):
    """The cluster YAML does not describe a usable set of pools."""


@dataclass(frozen=True, slots=True)
class Pool:
    """One homogeneous pool of GPU nodes from the cluster YAML."""

    name: str
    datacenter: str
    zone: str | None
    device: str
    vendor: str
    nodes: int
    gpus_per_node: int
    nic_gbps: float

    @property
    def gpu_resource(self) -> str:
        """The vendor's extended resource name, e.g. ``nvidia.com/gpu``."""
        return c.VENDOR_RESOURCES[self.vendor]

    def node_names(self) -> list[str]:
        """``<pool>-000`` ... in index order."""
        return [node_name(self.name, i) for i in range(self.nodes)]


def node_name(pool: str, index: int) -> str:
    """Name of node ``index`` (0-based) of ``pool``: ``h100-east-000``."""
    return f"{pool}-{index:03d}"


# ---------------------------------------------------------------- cluster YAML -> pools


def load_cluster(source: str | Path | Mapping[str, Any]) -> list[Pool]:
    """Pools of a cluster YAML, given as a path, YAML text or an already-parsed mapping."""
    if isinstance(source, Mapping):
        doc: Any = source
    elif isinstance(source, Path) or (isinstance(source, str) and "\n" not in source):
        doc = yaml.safe_load(Path(source).read_text())
    else:
        doc = yaml.safe_load(source)
    if not isinstance(doc, Mapping):
        raise ClusterSpecError("cluster YAML must be a mapping")
    if doc.get("kind", c.CLUSTER_KIND) != c.CLUSTER_KIND:
        raise ClusterSpecError(f"kind must be {c.CLUSTER_KIND}, got {doc.get('kind')!r}")
    declared = {d["name"]: d for d in doc.get("devices") or [] if isinstance(d, Mapping)}
    pools = [_pool(p, declared, f"pools[{i}]") for i, p in enumerate(doc.get("pools") or [])]
    if not pools:
        raise ClusterSpecError("the cluster has no pools")
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise ClusterSpecError(f"duplicate pool names in {names}")
    return pools


def _pool(p: Any, declared: Mapping[str, Mapping[str, Any]], where: str) -> Pool:
    if not isinstance(p, Mapping):
        raise ClusterSpecError(f"{where} must be a mapping")
    for key in ("name", "datacenter", "device", "nodes", "gpusPerNode"):
        if key not in p:
            raise ClusterSpecError(f"{where}.{key} is required")
    device = str(p["device"])
    vendor = p.get("vendor") or _catalog_vendor(device, declared)
    if vendor not in c.VENDOR_RESOURCES:
        raise ClusterSpecError(
            f"{where}.vendor {vendor!r} (device {device}) has no GPU resource; "
            f"expected one of {', '.join(c.VENDOR_RESOURCES)}"
        )
    return Pool(
        name=str(p["name"]),
        datacenter=str(p["datacenter"]),
        zone=str(p["zone"]) if p.get("zone") else None,
        device=device,
        vendor=str(vendor),
        nodes=int(p["nodes"]),
        gpus_per_node=int(p["gpusPerNode"]),
        nic_gbps=float(p.get("nicGbps", DEFAULT_NIC_GBPS)),
    )


def _catalog_vendor(device: str, declared: Mapping[str, Mapping[str, Any]]) -> str:
    if device in declared and declared[device].get("vendor"):
        return str(declared[device]["vendor"])
    if device in CATALOG:
        return CATALOG[device].vendor
    raise ClusterSpecError(f"device {device!r} is not in the catalog; give the pool a vendor")


def _fmt_number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def node_manifest(pool: Pool, index: int) -> dict[str, Any]:
    """The Node object (with status capacity/allocatable) for node ``index`` of ``pool``."""
    name = node_name(pool.name, index)
    labels = {
        "type": "kwok",
        c.LABEL_HOSTNAME: name,
        c.LABEL_REGION: pool.datacenter,
        c.LABEL_POOL: pool.name,
        c.LABEL_DEVICE: pool.device,
        c.LABEL_VENDOR: pool.vendor,
        c.LABEL_NIC_GBPS: _fmt_number(pool.nic_gbps),
    }
    if pool.zone:
        labels[c.LABEL_ZONE] = pool.zone
    resources = {
        "cpu": NODE_CPU,
        "memory": NODE_MEMORY,
        "pods": NODE_PODS,
        pool.gpu_resource: str(pool.gpus_per_node),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": {KWOK_ANNOTATION: "fake"}},
        "spec": {},
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }


def node_manifests(pools: Iterable[Pool]) -> list[dict[str, Any]]:
    """Every node of every pool, pool by pool, in index order."""
    return [node_manifest(p, i) for p in pools for i in range(p.nodes)]


# ---------------------------------------------------------------- raw API access


def api_client(kubeconfig: str | Path | None = None) -> k8s.ApiClient:
    """An ApiClient for ``kubeconfig`` (default: the usual KUBECONFIG lookup)."""
    return k8s_config.new_client_from_config(config_file=str(kubeconfig) if kubeconfig else None)


def _pooled(api: k8s.ApiClient, size: int) -> k8s.ApiClient:
    """A sibling ApiClient whose HTTP pool holds ``size`` connections (for fan-out)."""
    cfg = copy.copy(api.configuration)
    cfg.connection_pool_maxsize = max(size, cfg.connection_pool_maxsize or 0)
    return k8s.ApiClient(cfg)


def _call(
    api: k8s.ApiClient,
    method: str,
    path: str,
    body: Any = None,
    content_type: str = "application/json",
    ok: Sequence[int] = (),
) -> tuple[int, dict[str, Any]]:
    """One raw JSON request; returns (status, body). Raises ApiException unless 2xx or ``ok``."""
    status, reason, data = raw_request(api, method, path, body, content_type, timeout=60)
    if not (200 <= status < 300 or status in ok):
        raise k8s.ApiException(status=status, reason=reason, body=data)
    return status, json.loads(data) if data else {}


def _fan_out(api: k8s.ApiClient, fn: Any, items: Sequence[Any], workers: int) -> list[Any]:
    workers = max(1, min(workers, len(items)))
    pooled = _pooled(api, workers)
    try:
        with ThreadPoolExecutor(max_workers=workers) as ex:
            return list(ex.map(lambda item: fn(pooled, item), items))
    finally:
        pooled.close()


# ---------------------------------------------------------------- create / wait / delete


def create_nodes(
    api: k8s.ApiClient,
    cluster: str | Path | Mapping[str, Any] | Sequence[Pool],
    *,
    workers: int = 32,
    exist_ok: bool = True,
) -> list[str]:
    """Create every node of ``cluster`` concurrently; returns the node names in order.

    ``cluster`` is a cluster YAML (path, text or mapping) or a list of :class:`Pool`. An
    existing node of the same name is left as it is when ``exist_ok``.
    """
    pools = list(cluster) if _is_pool_list(cluster) else load_cluster(cluster)  # type: ignore[arg-type]
    manifests = node_manifests(pools)
    ok = (409,) if exist_ok else ()

    def create(a: k8s.ApiClient, m: dict[str, Any]) -> str:
        _call(a, "POST", "/api/v1/nodes", m, ok=ok)
        return str(m["metadata"]["name"])

    return _fan_out(api, create, manifests, workers)


def _is_pool_list(x: Any) -> bool:
    return (
        isinstance(x, Sequence) and not isinstance(x, str) and all(isinstance(p, Pool) for p in x)
    )


def _ready_status(node: Mapping[str, Any]) -> str | None:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return str(cond.get("status"))
    return None


def list_nodes(api: k8s.ApiClient, label_selector: str = "type=kwok") -> list[dict[str, Any]]:
    """Nodes matching ``label_selector`` as plain dicts (one LIST call, no model decoding)."""
    from urllib.parse import quote

    _, body = _call(api, "GET", f"/api/v1/nodes?labelSelector={quote(label_selector)}")
    return list(body.get("items") or [])


def wait_nodes(
    api: k8s.ApiClient,
    names: Iterable[str],
    *,
    ready: str = "True",
    label_selector: str = "type=kwok",
    timeout: float = 120.0,
    interval: float = 0.5,
) -> None:
    """Block until every named node's Ready condition is ``ready`` (True/False/Unknown)."""
    want = set(names)
    deadline = time.monotonic() + timeout
    while True:
        status = {n["metadata"]["name"]: _ready_status(n) for n in list_nodes(api, label_selector)}
        pending = sorted(n for n in want if status.get(n) != ready)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{len(pending)} node(s) not Ready={ready} after {timeout:.0f}s, e.g. "
                f"{pending[:5]} (Ready={[status.get(n) for n in pending[:5]]})"
            )
        time.sleep(interval)


def delete_nodes(api: k8s.ApiClient, names: Iterable[str], *, workers: int = 32) -> int:
    """Delete nodes by name concurrently (missing ones are fine); returns how many existed."""

    def delete(a: k8s.ApiClient, name: str) -> bool:
        status, _ = _call(a, "DELETE", f"/api/v1/nodes/{name}", ok=(404,))
        return status != 404

    return sum(_fan_out(api, delete, list(names), workers))


def delete_cluster_nodes(
    api: k8s.ApiClient, cluster: str | Path | Mapping[str, Any], *, workers: int = 32
) -> int:
    """Delete every node a cluster YAML describes."""
    return delete_nodes(
        api, [n["metadata"]["name"] for n in node_manifests(load_cluster(cluster))], workers=workers
    )


# ---------------------------------------------------------------- faults


def mark_not_ready(api: k8s.ApiClient, name: str, fault: str = FAULT_NOT_READY) -> None:
    """Fail node ``name``: kwok sets Ready=False (``not-ready``) or Unknown (``unreachable``).

    kwok stops heartbeating the node, so it stays failed until :func:`mark_ready`; the node
    lifecycle controller adds the matching ``node.kubernetes.io/*`` taints (``NoExecute`` only
    while the zone is not disrupted: all of it, or >2 nodes and >=55% of it, unhealthy).
    """
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    patch = {"metadata": {"annotations": {FAULT_ANNOTATION: fault}}}
    _call(api, "PATCH", f"/api/v1/nodes/{name}", patch, _MERGE_PATCH)


def mark_ready(api: k8s.ApiClient, name: str) -> None:
    """Heal node ``name``: drop the fault annotation; kwok re-initialises it to Ready=True."""
    patch = {"metadata": {"annotations": {FAULT_ANNOTATION: None}}}
    _call(api, "PATCH", f"/api/v1/nodes/{name}", patch, _MERGE_PATCH)


def node_taints(api: k8s.ApiClient, name: str) -> list[dict[str, Any]]:
    """The node's current ``spec.taints`` (key, effect, ...)."""
    _, node = _call(api, "GET", f"/api/v1/nodes/{name}")
    return list((node.get("spec") or {}).get("taints") or [])


# ---------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """``create|delete CLUSTER.yaml``, ``not-ready|unreachable|ready NODE...``."""
    ap = argparse.ArgumentParser(prog="kwoknodes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kubeconfig", default=None)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("create", "delete"):
        sub.add_parser(cmd).add_argument("cluster")
    for cmd in ("not-ready", "unreachable", "ready"):
        sub.add_parser(cmd).add_argument("nodes", nargs="+")
    args = ap.parse_args(argv)
    api = api_client(args.kubeconfig)
    t0 = time.monotonic()
    if args.cmd == "create":
        names = create_nodes(api, args.cluster)
        wait_nodes(api, names)
        print(f"created {len(names)} Ready nodes in {time.monotonic() - t0:.1f}s")
    elif args.cmd == "delete":
        print(f"deleted {delete_cluster_nodes(api, args.cluster)} nodes")
    else:
        for name in args.nodes:
            if args.cmd == "ready":
                mark_ready(api, name)
            else:
                mark_not_ready(api, name, args.cmd)
        print(f"{args.cmd}: {' '.join(args.nodes)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
