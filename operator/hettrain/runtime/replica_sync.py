"""Heterogeneous replica groups (``plan.groups``): their worlds and the gradient sync between them.

Each replica group runs as its own torch.distributed world (``dist.init_process_group`` over
the group's ranks, renumbered ``0..n-1``: :meth:`Plan.group_plan`), so the existing pipeline,
tensor-parallel, ZeRO-1 and checkpoint code runs unchanged inside it. Everything between groups
goes through gloo process groups built here directly on the job's TCP store (one prefix per
group), so building them is not collective over the world and needs no common call order
beyond the one this module keeps.

Gradient sync, per parameter: a parameter is a global Hugging Face-named tensor; its *unit* is
the embedding, one decoder layer or the head (final norm + output layer), and its holders are
the ranks, in every group and every replica, whose stage holds that unit with the same TP index
(:func:`holder_sets`). Groups must give every unit the same TP degree (``planning.support``
refuses the rest at start-up), so holders hold the same shard slice: no re-sharding. After the
backward, each rank's main grads are the mean over its own ``M_g`` microbatches; multiplied by
``M_g / N`` (``N``: microbatches of the whole step, every replica of every group) and summed
over the holders, they become the gradient of the global batch's mean loss, whatever the
groups' token shares. Holders are summed with one all-reduce per distinct holder set; a set
spanning datacenters is summed hierarchically (inside each DC, then the DC leaders, then a
broadcast inside each DC), so each gradient byte crosses the DC link once per leader.

This sum replaces the group's own DP all-reduce (the result is the same on every holder), so
ZeRO-1 keeps its slice of it and the within-group gradient norm (each parameter counted once,
as in a plain plan) is already the global norm. The loss and validation loss of each group
(means over its microbatches) are combined by their shares over an all-rank group.

Deadlocks: every process group is a rendezvous of its members, and every rank creates and uses
the groups it belongs to in one global order (holder sets sorted, then the all-rank group), so
no two ranks can wait on each other in opposite orders. The groups are built before any group
world exists (:func:`run_grouped_rank` in the trainer).
"""

from __future__ import annotations

import datetime
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from hettrain.planning.plan import Plan
from hettrain.planning.support import group_stage_units
from hettrain.runtime.collectives.stats import Tier

Account = Callable[[Tier, int, float], None]
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def unit_of(name: str) -> str:
    """The unit of a global parameter name: ``embedding``, ``layer i`` or ``head``."""
    if name.startswith("model.embed_tokens."):
        return "embedding"
    m = _LAYER.match(name)
    if m:
        return f"layer {int(m.group(1))}"
    if name.startswith(("model.norm.", "lm_head.")):
        return "head"
    raise ValueError(f"parameter {name!r}: not an embedding, decoder layer or head tensor")


def holder_sets(plan: Plan) -> dict[tuple[str, int], tuple[int, ...]]:
    """``{(unit, tp index): global ranks holding that shard}`` over every group and replica."""
    units = group_stage_units(plan)
    out: dict[tuple[str, int], list[int]] = {}
    for r in plan.ranks:
        for u in units[(r.group, r.stage)]:
            out.setdefault((u, r.tp), []).append(r.rank)
    return {k: tuple(sorted(v)) for k, v in out.items()}


def group_config(cfg, rank: int):
    """``(cfg, local rank)`` of global ``rank`` inside its replica group's world: the group's
    plain plan and the node's first rank renumbered alike (node-relative offsets such as the
    device index and metrics port stay the same)."""
    plan = cfg.plan
    g = plan.ranks[rank].group
    members = [r.rank for r in plan.group_ranks(g)]
    local = members.index(rank)
    view = plan.group_plan(g)
    return replace(cfg, plan=view, world_size=view.world_size,
                   rank_start=local - (rank - cfg.rank_start)), local


def _tier(plan: Plan, ranks: Sequence[int]) -> Tier:
    if len({plan.ranks[r].datacenter for r in ranks}) > 1:
        return Tier.CROSS_DC
    return Tier.INTER_POOL if len({plan.ranks[r].pool for r in ranks}) > 1 else Tier.INTRA_POOL


@dataclass
class _SetSync:
    """This rank's part in summing one holder set: flat (``full``) or hierarchical."""

    members: tuple[int, ...]
    full: dist.ProcessGroup | None = None  # one DC: all holders
    local: dist.ProcessGroup | None = None  # several DCs: this rank's DC's holders
    leaders: dict | None = None  # {"group": PG of the DC leaders (leaders only), "root": 0}
    local_size: int = 1
    ranges: list[tuple[int, int]] | None = None  # of the flat main-grad buffer


class ReplicaSync:
    """The gradient, loss and validation sums between replica groups for one rank."""

    def __init__(self, plan: Plan, rank: int, store: dist.Store,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=120),
                 account: Account | None = None) -> None:
        if not plan.groups:
            raise ValueError("ReplicaSync needs a plan with plan.groups")
        self.plan, self.rank, self.account = plan, rank, account
        me = plan.ranks[rank]
        self.group = me.group
        g = plan.groups[me.group]
        self.grad_weight = g.num_microbatches / plan.total_microbatches
        self.loss_weight = g.microbatches / plan.total_microbatches
        self.leader = rank == min(r.rank for r in plan.group_ranks(me.group))
        self.writes_checkpoints = me.group == 0
        self._store, self._timeout = store, timeout
        mine = {k[0]: v for k, v in holder_sets(plan).items() if rank in v}
        self.unit_members: dict[str, tuple[int, ...]] = mine
        self.sets: dict[tuple[int, ...], _SetSync] = {}
        for members in sorted(set(mine.values())):  # the global order (module docstring)
            self.sets[members] = self._build(members)
        self.world = self._pg("world", tuple(range(plan.world_size)))
        self._bound: tuple[int, int] | None = None

    def _pg(self, key: str, members: tuple[int, ...]) -> dist.ProcessGroup:
        store = dist.PrefixStore(f"hetrep/{key}/", self._store)
        return dist.ProcessGroupGloo(store, members.index(self.rank), len(members),
                                     self._timeout)

    def _build(self, members: tuple[int, ...]) -> _SetSync:
        name = "-".join(map(str, members))
        by_dc: dict[str, list[int]] = {}
        for r in members:
            by_dc.setdefault(self.plan.ranks[r].datacenter, []).append(r)
        s = _SetSync(members)
        if len(by_dc) == 1:
            s.full = self._pg(f"set/{name}", members) if len(members) > 1 else None
            return s
        dcs = sorted(by_dc)
        mine = self.plan.ranks[self.rank].datacenter
        local = tuple(by_dc[mine])
        s.local_size = len(local)
        if len(local) > 1:
            s.local = self._pg(f"set/{name}/dc/{mine}", local)
        if self.rank == local[0]:
            s.leaders = {"group": self._pg(f"set/{name}/leaders",
                                           tuple(by_dc[d][0] for d in dcs))}
        return s

    def _bind(self, segments: Sequence) -> None:
        """Map the optimizer's flat layout (``name, start, end`` segments) to holder sets."""
        per: dict[tuple[int, ...], list[tuple[int, int]]] = {m: [] for m in self.sets}
        for seg in segments:
            unit = unit_of(seg.name)
            if unit not in self.unit_members:
                raise ValueError(f"rank {self.rank}: parameter {seg.name} ({unit}) is not in "
                                 "this rank's stage of the plan")
            ranges = per[self.unit_members[unit]]
            if ranges and ranges[-1][1] == seg.start:
                ranges[-1] = (ranges[-1][0], seg.end)
            else:
                ranges.append((seg.start, seg.end))
        for members, s in self.sets.items():
            s.ranges = per[members]
        self._bound = (len(segments), segments[-1].end if segments else 0)

    def _record(self, members: Sequence[int], nbytes: int, t0: float) -> None:
        if self.account is not None:
            self.account(_tier(self.plan, members), nbytes, time.perf_counter() - t0)

    @torch.no_grad()
    def reduce_(self, flat: torch.Tensor, segments: Sequence) -> None:
        """Turn this rank's main grads (``flat``, laid out by ``segments``) into the gradient of
        the global batch's mean loss, in place, on every holder of every parameter."""
        if self._bound is None:
            self._bind(segments)
        flat.mul_(self.grad_weight)
        for s in self.sets.values():
            if len(s.members) == 1 or not s.ranges:
                continue
            parts = [flat[a:b] for a, b in s.ranges]
            on_host = len(parts) == 1 and flat.device.type == "cpu"
            buf = parts[0] if on_host else torch.cat(parts).cpu()
            self._sum(s, buf)
            if not on_host:
                offset = 0
                for p in parts:
                    p.copy_(buf[offset:offset + p.numel()])
                    offset += p.numel()

    def _sum(self, s: _SetSync, buf: torch.Tensor) -> None:
        """Sum ``buf`` (host memory) over the set's holders."""
        nbytes = buf.numel() * buf.element_size()
        if s.full is not None:
            n = len(s.members)
            t0 = time.perf_counter()
            s.full.allreduce([buf]).wait()
            self._record(s.members, int(2 * (n - 1) / n * nbytes), t0)
            return
        me = self.plan.ranks[self.rank].datacenter
        local = [r for r in s.members if self.plan.ranks[r].datacenter == me]
        if s.local is not None:
            t0 = time.perf_counter()
            s.local.allreduce([buf]).wait()
            self._record(local, int(2 * (len(local) - 1) / len(local) * nbytes), t0)
        if s.leaders is not None:
            pg = s.leaders["group"]
            n = pg.size()
            t0 = time.perf_counter()
            pg.allreduce([buf]).wait()
            if self.account is not None:
                self.account(Tier.CROSS_DC, int(2 * (n - 1) / n * nbytes),
                             time.perf_counter() - t0)
        if s.local is not None:
            t0 = time.perf_counter()
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            s.local.broadcast([buf], opts).wait()
            self._record(local, nbytes if self.rank == local[0] else 0, t0)

    def global_mean(self, group_mean: float) -> float:
        """The job's mean of a per-microbatch quantity (loss) from each group's mean: the
        groups' means weighted by their shares of the step's microbatches (every rank of a
        group passes the same value; its first rank contributes it)."""
        vec = torch.tensor([group_mean * self.loss_weight if self.leader else 0.0],
                           dtype=torch.float64)
        self.world.allreduce([vec]).wait()
        return float(vec[0])

    def barrier(self) -> None:
        """Wait for every rank of every group (before leaving: rank 0 hosts the store)."""
        self.world.barrier().wait()
