"""Cluster inventory: pools of identical nodes, datacenters and the links between them.

Two ways in, one frozen result (:class:`ClusterInventory`):
- :func:`load_cluster` reads the offline cluster YAML (docs/contracts.md §2);
- :func:`inventory_from_nodes` reads Kubernetes Node objects (plain dicts as the API returns them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hettrain.api import constants as c
from hettrain.api.yamlsafe import YamlInputError, read_yaml_document
from hettrain.planning import fields
from hettrain.planning.catalog import DeviceSpec, device_from_yaml, resolve_device
from hettrain.planning.errors import PlanningInputError

DEFAULT_NIC_GBPS = 400.0  # per node, when a node does not say
INTRA_DC_LATENCY_MS = 0.01
DEFAULT_INTER_DC = (10.0, 50.0)  # Gbps, ms: a pessimistic default for an undeclared DC pair


@dataclass(frozen=True, slots=True)
class Pool:
    """Identical nodes of one device model in one datacenter (and zone)."""

    name: str
    device: DeviceSpec
    datacenter: str
    zone: str
    nodes: tuple[str, ...]
    gpus_per_node: int
    nic_gbps: float = DEFAULT_NIC_GBPS  # per node

    @property
    def vendor(self) -> str:
        """Vendor of the pool's device."""
        return self.device.vendor

    @property
    def gpus(self) -> int:
        """Total GPUs in the pool."""
        return len(self.nodes) * self.gpus_per_node

    @property
    def nic_gbytes_per_gpu(self) -> float:
        """Scale-out bandwidth per GPU in GB/s (node NIC shared by its GPUs)."""
        return self.nic_gbps / 8 / self.gpus_per_node


@dataclass(frozen=True, slots=True)
class Link:
    """A network link between two datacenters."""

    a: str
    b: str
    bandwidth_gbps: float
    latency_ms: float

    @property
    def gbytes(self) -> float:
        """Bandwidth in GB/s."""
        return self.bandwidth_gbps / 8


@dataclass(frozen=True, slots=True)
class ClusterInventory:
    """Everything the planner knows about the cluster. Frozen; derive new ones with methods."""

    pools: tuple[Pool, ...]
    links: tuple[Link, ...] = ()
    devices: Mapping[str, DeviceSpec] = field(default_factory=dict)
    name: str = "cluster"

    @property
    def gpus(self) -> int:
        """Total GPUs."""
        return sum(p.gpus for p in self.pools)

    @property
    def datacenters(self) -> tuple[str, ...]:
        """Datacenters with at least one pool, sorted."""
        return tuple(sorted({p.datacenter for p in self.pools}))

    def pool(self, name: str) -> Pool:
        """Pool by name (KeyError if absent)."""
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)

    def link(self, dc_a: str, dc_b: str) -> Link:
        """The link between two datacenters; same DC is a fast local fabric."""
        if dc_a == dc_b:
            return Link(dc_a, dc_b, 1e9, INTRA_DC_LATENCY_MS)
        for link in self.links:
            if {link.a, link.b} == {dc_a, dc_b}:
                return link
        bw, lat = DEFAULT_INTER_DC
        return Link(dc_a, dc_b, bw, lat)

    def slowest_link(self, dcs_a: Sequence[str], dcs_b: Sequence[str]) -> Link:
        """The worst of the links between any datacenter of ``dcs_a`` and any of ``dcs_b``:
        the least bandwidth and the most latency among them (a hop between two units that
        span datacenters may take any of those links, depending on the replica)."""
        links = [self.link(a, b) for a in dcs_a for b in dcs_b]
        if len(links) == 1:
            return links[0]
        slow = min(links, key=lambda k: (k.bandwidth_gbps, -k.latency_ms))
        return Link(slow.a, slow.b, slow.bandwidth_gbps, max(k.latency_ms for k in links))

    def without_nodes(self, names: Iterable[str]) -> ClusterInventory:
        """A copy without the given nodes (failed or drained); empty pools are dropped."""
        gone = set(names)
        pools = []
        for p in self.pools:
            kept = tuple(n for n in p.nodes if n not in gone)
            if kept:
                pools.append(replace(p, nodes=kept))
        return replace(self, pools=tuple(pools))

    def node_names(self) -> tuple[str, ...]:
        """All node names, pool by pool."""
        return tuple(n for p in self.pools for n in p.nodes)


# ---------------------------------------------------------------- cluster YAML


def _links_from(docs: Any, where: str, dcs: set[str] | None = None) -> tuple[Link, ...]:
    """``links:`` entries, checked; with ``dcs`` both ends must be known datacenters."""
    links = []
    seen: set[frozenset[str]] = set()
    for i, d in enumerate(fields.sequence(docs, where, fields.MAX_DATACENTERS ** 2)):
        at = f"{where}[{i}]"
        d = fields.mapping(d, at)
        fields.known_keys(d, at, _LINK_KEYS)
        between = d.get("between")
        if not isinstance(between, list) or len(between) != 2:
            raise PlanningInputError(f"{at}.between", "must list exactly two datacenters")
        a, b = (fields.name(x, f"{at}.between[{j}]") for j, x in enumerate(between))
        for j, dc in enumerate((a, b)):
            if dcs is not None and dc not in dcs:
                raise PlanningInputError(
                    f"{at}.between[{j}]", f"{dc!r} is not a datacenter of this cluster "
                    f"({', '.join(sorted(dcs)) or 'none'}); fix the name or add it under "
                    "datacenters:")
        if a == b:
            raise PlanningInputError(f"{at}.between", f"names {a!r} twice; a link joins two "
                                                      "different datacenters")
        if frozenset((a, b)) in seen:
            raise PlanningInputError(f"{at}.between", f"duplicate link {a} <-> {b}")
        seen.add(frozenset((a, b)))
        if "bandwidthGbps" not in d:
            raise PlanningInputError(f"{at}.bandwidthGbps", "is required")
        links.append(Link(
            a, b, fields.number(d["bandwidthGbps"], f"{at}.bandwidthGbps", fields.LINK_GBPS,
                                "Gbps"),
            fields.number(d.get("latencyMs", 1.0), f"{at}.latencyMs", fields.LATENCY_MS, "ms"),
        ))
    return tuple(links)


def _devices_from(docs: Any, where: str) -> dict[str, DeviceSpec]:
    out: dict[str, DeviceSpec] = {}
    for i, d in enumerate(fields.sequence(docs, where, fields.MAX_DEVICES)):
        dev = device_from_yaml(fields.mapping(d, f"{where}[{i}]"), f"{where}[{i}]")
        if dev.name in out:
            raise PlanningInputError(f"{where}[{i}].name", f"duplicate device {dev.name!r}")
        out[dev.name] = dev
    return out


def node_name(pool: str, index: int) -> str:
    """Deterministic node name used by the cluster YAML and the kwok node helper."""
    return f"{pool}-{index:03d}"


def _read_cluster_doc(source: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    """A cluster YAML document (path or already-parsed dict), checked for ``kind: Cluster``.

    Files are read with :func:`hettrain.api.yamlsafe.read_yaml_document` (bounded size,
    nesting and alias expansion; UTF-8 only).
    """
    if isinstance(source, Mapping):
        doc: Any = source
    else:
        try:
            doc = read_yaml_document(source)
        except YamlInputError as exc:
            raise PlanningInputError(exc.where, exc.message) from None
    if not isinstance(doc, Mapping) or doc.get("kind") != c.CLUSTER_KIND:
        raise PlanningInputError("kind", f"a cluster file must have kind: {c.CLUSTER_KIND}")
    fields.known_keys(doc, "(cluster)", _CLUSTER_KEYS)
    return doc


# the keys a cluster file may use (docs/cluster.md); any other is a typo, refused
_CLUSTER_KEYS = frozenset({"apiVersion", "kind", "metadata", "datacenters", "links", "devices",
                           "pools"})
_DATACENTER_KEYS = frozenset({"name", "zones"})
_LINK_KEYS = frozenset({"between", "bandwidthGbps", "latencyMs"})
_POOL_KEYS = frozenset({"name", "datacenter", "device", "vendor", "nodes", "gpusPerNode", "zone",
                        "nicGbps"})


def load_topology(
    source: str | Path | Mapping[str, Any],
) -> tuple[tuple[Link, ...], dict[str, DeviceSpec]]:
    """``links:`` and ``devices:`` of a cluster YAML; ``pools:`` may be absent (Nodes supply them).

    What the operator reads from ``HETTRAIN_CLUSTER_CONFIG`` (the chart's ``operator.topology``).
    When pools are present the whole file is validated as :func:`load_cluster` would.
    """
    doc = _read_cluster_doc(source)
    if doc.get("pools"):
        inv = load_cluster(doc)
        return tuple(inv.links), dict(inv.devices)
    dcs = _datacenters_from(doc.get("datacenters"), "datacenters")
    return (_links_from(doc.get("links"), "links", dcs or None),
            _devices_from(doc.get("devices"), "devices"))


def _datacenters_from(docs: Any, where: str) -> set[str]:
    """Names under ``datacenters:`` (empty when the section is absent)."""
    names: set[str] = set()
    for i, d in enumerate(fields.sequence(docs, where, fields.MAX_DATACENTERS)):
        d = fields.mapping(d, f"{where}[{i}]")
        fields.known_keys(d, f"{where}[{i}]", _DATACENTER_KEYS)
        dc = fields.name(d.get("name"), f"{where}[{i}].name")
        if dc in names:
            raise PlanningInputError(f"{where}[{i}].name", f"duplicate datacenter {dc!r}")
        names.add(dc)
    return names


def _pool_from(p: Any, where: str, dcs: set[str], devices: Mapping[str, DeviceSpec]) -> Pool:
    """One ``pools:`` entry, every field checked."""
    p = fields.mapping(p, where)
    fields.known_keys(p, where, _POOL_KEYS)
    for key in ("name", "datacenter", "device", "nodes", "gpusPerNode"):
        if key not in p:
            raise PlanningInputError(f"{where}.{key}", "is required")
    name = fields.name(p["name"], f"{where}.name", dns=True)
    dc = fields.name(p["datacenter"], f"{where}.datacenter")
    if dcs and dc not in dcs:
        raise PlanningInputError(f"{where}.datacenter", f"{dc!r} is not listed under datacenters:")
    device = resolve_device(fields.name(p["device"], f"{where}.device"), devices,
                            f"{where}.device")
    if "vendor" in p and p["vendor"] != device.vendor:
        raise PlanningInputError(
            f"{where}.vendor",
            f"{p['vendor']!r} contradicts device {device.name} (vendor {device.vendor})",
        )
    n = fields.integer(p["nodes"], f"{where}.nodes", 1, fields.MAX_POOL_NODES)
    g = fields.integer(p["gpusPerNode"], f"{where}.gpusPerNode", 1, fields.MAX_GPUS_PER_NODE)
    zone = p.get("zone") or ""  # (null: no zone, as an absent key)
    if zone != "":
        zone = fields.name(zone, f"{where}.zone")
    nic = fields.number(p.get("nicGbps", DEFAULT_NIC_GBPS), f"{where}.nicGbps", fields.NIC_GBPS,
                        "Gbps")
    return Pool(name=name, device=device, datacenter=dc, zone=zone,
                nodes=tuple(node_name(name, k) for k in range(n)), gpus_per_node=g,
                nic_gbps=nic)


def load_cluster(source: str | Path | Mapping[str, Any]) -> ClusterInventory:
    """Read a cluster YAML (path or already-parsed dict) into a :class:`ClusterInventory`.

    Every field is checked (:mod:`hettrain.planning.fields`): types, finite positive
    bandwidths and speeds, efficiency in (0, 1], links between known datacenters, sizes
    bounded. Raises :class:`PlanningInputError` naming the field.
    """
    doc = _read_cluster_doc(source)
    devices = _devices_from(doc.get("devices"), "devices")
    dcs = _datacenters_from(doc.get("datacenters"), "datacenters")
    pools = []
    seen: set[str] = set()
    total_nodes = 0
    for i, p in enumerate(fields.sequence(doc.get("pools"), "pools", fields.MAX_POOLS)):
        where = f"pools[{i}]"
        if isinstance(p, Mapping) and isinstance(p.get("nodes"), int):
            total_nodes += p["nodes"]
            if total_nodes > fields.MAX_CLUSTER_NODES:
                raise PlanningInputError(f"{where}.nodes", f"the pools hold more than "
                                         f"{fields.MAX_CLUSTER_NODES} nodes in all; describe a "
                                         "smaller cluster")
        pool = _pool_from(p, where, dcs, devices)
        if pool.name in seen:
            raise PlanningInputError(f"{where}.name", f"duplicate pool name {pool.name!r}")
        seen.add(pool.name)
        pools.append(pool)
    if not pools:
        raise PlanningInputError("pools", "the cluster has no pools")
    known = dcs or {p.datacenter for p in pools}
    meta = fields.mapping(doc.get("metadata"), "metadata", optional=True)
    name = fields.name(meta.get("name", "cluster"), "metadata.name")
    return ClusterInventory(tuple(pools), _links_from(doc.get("links"), "links", known), devices,
                            name)


# ---------------------------------------------------------------- Kubernetes Nodes

# Vendor product labels set by the vendors' device plugins / feature discovery.
_PRODUCT_LABELS = (
    "nvidia.com/gpu.product",
    "amd.com/gpu.product-name",
    "habana.ai/device.type",
    "huawei.com/npu.product",
)
_PRODUCT_ALIASES = {
    "NVIDIA-H100-80GB-HBM3": "H100-SXM",
    "NVIDIA-H200": "H200",
    "NVIDIA-A100-SXM4-80GB": "A100-80GB",
    "NVIDIA-L40S": "L40S",
    "AMD-Instinct-MI300X": "MI300X",
    "AMD-Instinct-MI250X": "MI250X",
    "gaudi2": "Gaudi2",
    "gaudi3": "Gaudi3",
    "Ascend910B": "Ascend-910B",
}
_SCHEDULING_EFFECTS = {"NoSchedule", "NoExecute"}


def _node_is_usable(node: Mapping[str, Any], tolerated: set[str]) -> bool:
    spec = node.get("spec") or {}
    if spec.get("unschedulable"):
        return False
    for taint in spec.get("taints") or []:
        if taint.get("effect") in _SCHEDULING_EFFECTS and taint.get("key") not in tolerated:
            return False
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def _quantity(value: Any) -> int:
    try:
        return int(str(value))
    except ValueError:
        return 0


def _accelerator(node: Mapping[str, Any]) -> tuple[str, int] | None:
    alloc = (node.get("status") or {}).get("allocatable") or {}
    for vendor, resource in c.VENDOR_RESOURCES.items():
        count = _quantity(alloc.get(resource, 0))
        if count > 0:
            return vendor, count
    return None


def inventory_from_nodes(
    nodes: Iterable[Mapping[str, Any]],
    links: Iterable[Link] = (),
    devices: Mapping[str, DeviceSpec] | None = None,
    tolerated_taints: Iterable[str] = (),
) -> ClusterInventory:
    """Build the inventory from Node objects; skips NotReady, cordoned and tainted nodes.

    Device model: label ``hettrain.dev/device`` or a vendor product label; GPU count: the
    vendor's extended resource in ``allocatable``; datacenter/zone: topology labels; pool: label
    ``hettrain.dev/pool`` or ``<device>-<region>-<zone>``; NIC: label ``hettrain.dev/nic-gbps``.
    """
    devices = dict(devices or {})
    tolerated = set(tolerated_taints)
    groups: dict[str, dict[str, Any]] = {}
    for node in nodes:
        meta = node.get("metadata") or {}
        labels = meta.get("labels") or {}
        acc = _accelerator(node)
        if acc is None or not _node_is_usable(node, tolerated):
            continue
        vendor, count = acc
        model = labels.get(c.LABEL_DEVICE)
        if model is None:
            for key in _PRODUCT_LABELS:
                if key in labels:
                    model = _PRODUCT_ALIASES.get(labels[key], labels[key])
                    break
        name = str(meta.get("name"))
        if model is None:
            raise PlanningInputError(
                f"node {name}", f"has {vendor} GPUs but no {c.LABEL_DEVICE} label; label it "
                "with the device model (e.g. H100-SXM)",
            )
        device = resolve_device(model, devices, f"node {name} label {c.LABEL_DEVICE}")
        region = labels.get(c.LABEL_REGION, "default")
        zone = labels.get(c.LABEL_ZONE, "")
        pool = labels.get(c.LABEL_POOL) or "-".join(x for x in (model, region, zone) if x).lower()
        try:
            nic = float(labels.get(c.LABEL_NIC_GBPS, DEFAULT_NIC_GBPS))
        except ValueError:
            nic = -1.0
        if not nic > 0:
            raise PlanningInputError(
                f"node {name} label {c.LABEL_NIC_GBPS}",
                f"must be a positive number of Gbps (got {labels[c.LABEL_NIC_GBPS]!r})",
            )
        g = groups.setdefault(
            f"{pool}/{count}",
            dict(pool=pool, device=device, dc=region, zone=zone, gpn=count, nic=nic, nodes=[]),
        )
        g["nic"] = min(g["nic"], nic)
        g["nodes"].append(name)
    pools = []
    names = {g["pool"] for g in groups.values()}
    for key in sorted(groups):
        g = groups[key]
        suffix = "" if sum(1 for k in groups if k.startswith(g["pool"] + "/")) == 1 else (
            f"-x{g['gpn']}"
        )
        pname = g["pool"] + suffix if g["pool"] + suffix not in names or not suffix else key
        pools.append(
            Pool(pname, g["device"], g["dc"], g["zone"], tuple(sorted(g["nodes"])), g["gpn"],
                 g["nic"])
        )
    return ClusterInventory(tuple(pools), tuple(links), devices)
