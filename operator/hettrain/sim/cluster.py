"""The simulated cluster: a generated or loaded inventory plus its node → pool/rack/DC topology.

``--generate 16384:H100-SXM,4096:MI300X`` gives, per entry, that many GPUs of one catalog device
(rounded up to whole nodes of ``gpus_per_node``) split as evenly as possible over ``dcs``
datacenters (one pool per device and datacenter, pools named ``<device>-dc<k>``), plus
``spare_nodes`` extra nodes per pool: hot spares, held out of every plan, that stand in for
failed nodes (:meth:`Topology.plannable`).
Racks are consecutive nodes of a pool (``nodes_per_rack`` of them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hettrain.planning.catalog import CATALOG
from hettrain.planning.errors import PlanningInputError
from hettrain.planning.inventory import ClusterInventory, load_cluster
from hettrain.sim.model import SimInputError

DEFAULT_NIC_GBPS = 3200.0  # 8 × 400 Gb/s per 8-GPU node, as in current H100 clusters
DEFAULT_INTER_DC_GBPS = 400.0
DEFAULT_INTER_DC_MS = 20.0


@dataclass(frozen=True, slots=True)
class Topology:
    """Pool sizes and placement of the cluster's nodes (indices follow ``inventory.pools``)."""

    inventory: ClusterInventory
    pool_nodes: tuple[int, ...]
    pool_dc: tuple[str, ...]
    pool_device: tuple[str, ...]
    pool_gpus_per_node: tuple[int, ...]
    nodes_per_rack: int
    spare_nodes: int = 0  # per pool, held out of every plan (hot spares)

    def plannable(self, up: tuple[int, ...]) -> tuple[int, ...]:
        """Up nodes a plan may use per pool: all but the pool's ``spare_nodes`` (hot spares
        stand in for failed nodes; they are never planned as extra capacity)."""
        return tuple(min(u, n - self.spare_nodes) for u, n in zip(up, self.pool_nodes,
                                                                    strict=True))

    @property
    def pools(self) -> int:
        """Number of pools."""
        return len(self.pool_nodes)

    @property
    def nodes(self) -> int:
        """Total nodes."""
        return sum(self.pool_nodes)

    @property
    def gpus(self) -> int:
        """Total GPUs."""
        return sum(n * g for n, g in zip(self.pool_nodes, self.pool_gpus_per_node, strict=True))

    def racks(self, pool: int) -> int:
        """Racks in one pool (the last one may be partly filled)."""
        return -(-self.pool_nodes[pool] // self.nodes_per_rack)

    def node_offset(self, pool: int) -> int:
        """Global index of the pool's first node (nodes are numbered pool by pool)."""
        return sum(self.pool_nodes[:pool])

    def pool_index(self, name: str, where: str = "pool") -> int:
        """Index of a pool by name; unknown names raise :class:`SimInputError` naming
        ``where`` (e.g. a trace row's ``F:LINE.target``)."""
        for i, p in enumerate(self.inventory.pools):
            if p.name == name:
                return i
        names = ", ".join(p.name for p in self.inventory.pools)
        raise SimInputError(where, f"{name!r} is not a pool of the cluster ({names})")

    def node_index(self, name: str, where: str = "node") -> int:
        """Global index of a node by its inventory name (``<pool>-<index:03d>``); unknown names
        raise :class:`SimInputError` naming ``where``."""
        for i, p in enumerate(self.inventory.pools):
            try:
                return self.node_offset(i) + p.nodes.index(name)
            except ValueError:
                continue
        raise SimInputError(where, f"{name!r} is not a node of the cluster; node names are "
                                    "<pool>-<index:03d>, e.g. "
                                    f"{self.inventory.pools[0].nodes[0]}")


def topology_of(inventory: ClusterInventory, nodes_per_rack: int, spare_nodes: int = 0
                ) -> Topology:
    """The :class:`Topology` of an inventory, ``spare_nodes`` of every pool held as spares."""
    pools = inventory.pools
    if spare_nodes < 0 or any(len(p.nodes) <= spare_nodes for p in pools):
        raise SimInputError("--spare-nodes", f"must be >= 0 and leave every pool at least one "
                                             f"non-spare node (got {spare_nodes})")
    return Topology(
        inventory=inventory,
        pool_nodes=tuple(len(p.nodes) for p in pools),
        pool_dc=tuple(p.datacenter for p in pools),
        pool_device=tuple(p.device.name for p in pools),
        pool_gpus_per_node=tuple(p.gpus_per_node for p in pools),
        nodes_per_rack=nodes_per_rack,
        spare_nodes=spare_nodes,
    )


def parse_generate(spec: str) -> list[tuple[int, str]]:
    """``"16384:H100-SXM,4096:MI300X"`` → [(16384, "H100-SXM"), (4096, "MI300X")]."""
    lookup = {name.lower(): name for name in CATALOG}
    lookup.update({"h100": "H100-SXM", "a100": "A100-80GB"})
    out = []
    for part in (p.strip() for p in spec.split(",")):
        count, _, device = part.partition(":")
        try:
            gpus = int(count)
        except ValueError:
            gpus = 0
        if gpus < 1 or not device:
            raise SimInputError("--generate", f"entry {part!r} must be GPUS:DEVICE with GPUS an "
                                              "integer >= 1, e.g. 16384:H100-SXM")
        name = lookup.get(device.lower())
        if name is None or name == "CPU":
            raise SimInputError("--generate", f"device {device!r} is not in the catalog; use one "
                                              f"of {', '.join(n for n in CATALOG if n != 'CPU')}")
        out.append((gpus, name))
    return out


def generate_cluster_doc(entries: Sequence[tuple[int, str]], *, dcs: int = 1,
                         gpus_per_node: int = 8, spare_nodes: int = 0) -> dict[str, Any]:
    """A cluster YAML document (``kind: Cluster``) for the generated cluster."""
    if dcs < 1:
        raise SimInputError("--dcs", f"must be >= 1 (got {dcs})")
    if gpus_per_node < 1:
        raise SimInputError("--gpus-per-node", f"must be >= 1 (got {gpus_per_node})")
    if spare_nodes < 0:
        raise SimInputError("--spare-nodes", f"must be >= 0 (got {spare_nodes})")
    names = [f"dc{k}" for k in range(dcs)]
    pools = []
    for gpus, device in entries:
        nodes = -(-gpus // gpus_per_node)
        for k in range(dcs):
            share = nodes // dcs + (1 if k < nodes % dcs else 0)
            if share == 0:
                continue
            pools.append({"name": f"{device.lower()}-dc{k}", "datacenter": names[k],
                          "device": device, "nodes": share + spare_nodes,
                          "gpusPerNode": gpus_per_node, "nicGbps": DEFAULT_NIC_GBPS})
    links = [{"between": [a, b], "bandwidthGbps": DEFAULT_INTER_DC_GBPS,
              "latencyMs": DEFAULT_INTER_DC_MS}
             for i, a in enumerate(names) for b in names[i + 1:]]
    total = sum(g for g, _ in entries)
    return {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
            "metadata": {"name": f"generated-{total}"},
            "datacenters": [{"name": n} for n in names], "links": links, "pools": pools}


def generate_cluster(spec: str, *, dcs: int = 1, gpus_per_node: int = 8,
                     spare_nodes: int = 0) -> ClusterInventory:
    """The generated cluster of ``--generate SPEC`` as an inventory."""
    doc = generate_cluster_doc(parse_generate(spec), dcs=dcs, gpus_per_node=gpus_per_node,
                               spare_nodes=spare_nodes)
    try:
        return load_cluster(doc)
    except PlanningInputError as exc:  # e.g. more nodes than a cluster may hold
        raise SimInputError("--generate", f"gives a cluster outside the bounds: {exc}") from None
