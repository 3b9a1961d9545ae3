"""Units: groups of pools that can host the same pipeline stage.

A unit is one device model with one GPUs-per-node count, either inside one datacenter
(``split`` grouping: a pipeline boundary crosses a slow link) or across datacenters (``merged``
grouping: the stage's data-parallel all-reduce crosses it, hierarchically).
"""

from __future__ import annotations

from dataclasses import dataclass

from hettrain.api.spec import PlacementSpec
from hettrain.planning.catalog import DeviceSpec
from hettrain.planning.inventory import ClusterInventory, Pool


@dataclass(frozen=True, slots=True)
class Unit:
    """Pools of one device model and node shape; a stage's replicas all come from one unit."""

    key: str
    device: DeviceSpec
    pools: tuple[Pool, ...]
    gpus_per_node: int

    @property
    def datacenters(self) -> tuple[str, ...]:
        """Datacenters the unit spans, sorted."""
        return tuple(sorted({p.datacenter for p in self.pools}))

    @property
    def gpus(self) -> int:
        """GPUs in the unit."""
        return sum(p.gpus for p in self.pools)

    @property
    def nodes(self) -> int:
        """Nodes in the unit."""
        return sum(len(p.nodes) for p in self.pools)

    def tp_groups(self, tp: int) -> int:
        """How many node-local groups of ``tp`` GPUs the unit holds."""
        return self.nodes * (self.gpus_per_node // tp)

    def stage_slots(self, tp: int, dp: int, cp: int = 1) -> int:
        """Stages of ``dp`` replicas of ``tp`` GPUs each the unit can hold (``dp`` counts the
        ``dp·cp`` replicas, ``cp`` consecutive ones sharing a sequence): its node-local TP
        groups over ``dp`` inside one datacenter. Spanning ``k`` datacenters, the sequence
        groups split equally over them (``placement.replica_datacenters``, as the planner
        prices the DP sync): none unless ``k`` divides them, else the fewest that any of its
        datacenters holds of its share."""
        dcs = self.datacenters
        if len(dcs) == 1:
            return self.tp_groups(tp) // dp
        if dp % cp or (dp // cp) % len(dcs):
            return 0
        share = dp // len(dcs)
        per_node = self.gpus_per_node // tp
        return min(self.nodes_in(dc) * per_node // share for dc in dcs)

    def nodes_in(self, datacenter: str) -> int:
        """Nodes of the unit in ``datacenter``."""
        return sum(len(p.nodes) for p in self.pools if p.datacenter == datacenter)

    @property
    def nic_gbytes_per_gpu(self) -> float:
        """Slowest per-GPU scale-out bandwidth among the unit's pools (GB/s)."""
        return min(p.nic_gbytes_per_gpu for p in self.pools)


def filter_pools(inventory: ClusterInventory, placement: PlacementSpec) -> tuple[Pool, ...]:
    """Pools allowed by ``spec.placement`` (vendors, datacenters, pool names)."""
    out = []
    for p in inventory.pools:
        if placement.vendors and p.vendor not in placement.vendors:
            continue
        if placement.datacenters and p.datacenter not in placement.datacenters:
            continue
        if placement.pools and p.name not in placement.pools:
            continue
        out.append(p)
    return tuple(out)


def build_units(pools: tuple[Pool, ...], merged: bool) -> tuple[Unit, ...]:
    """Group pools into units; ``merged`` puts one device's pools of all DCs together."""
    groups: dict[tuple[str, ...], list[Pool]] = {}
    for p in pools:
        key = (p.device.name, str(p.gpus_per_node)) if merged else (
            p.device.name, str(p.gpus_per_node), p.datacenter
        )
        groups.setdefault(key, []).append(p)
    units = []
    for key in sorted(groups):
        members = tuple(sorted(groups[key], key=lambda p: (p.datacenter, p.name)))
        units.append(Unit("/".join(key), members[0].device, members, members[0].gpus_per_node))
    return tuple(units)


def spans_datacenters(pools: tuple[Pool, ...]) -> bool:
    """True when some device model is present in more than one datacenter."""
    seen: dict[str, set[str]] = {}
    for p in pools:
        seen.setdefault(p.device.name, set()).add(p.datacenter)
    return any(len(v) > 1 for v in seen.values())
