"""Heterogeneous replica groups (``plan.groups``): their worlds and the gradient sync between them.

Each replica group runs as its own torch.distributed world (``dist.init_process_group`` over
the group's ranks, renumbered ``0..n-1``: :meth:`Plan.group_plan`), so the existing pipeline,
tensor-parallel, ZeRO-1 and checkpoint code runs unchanged inside it. Everything between groups
goes through gloo process groups built here directly on the job's TCP store (one prefix per
group), so building them is not collective over the world and needs no common call order
beyond the one this module keeps.

Gradient sync, per piece of a parameter: a parameter is a global Hugging Face-named tensor; its
*unit* is the embedding, one decoder layer or the head (final norm + output layer), and its
holders are the ranks, in every group and every replica, whose stage holds that unit. Groups
may give a unit different TP degrees: a TP rank holds a contiguous span of the parameter along
its shard dimension (:func:`shard_span`: rows of a column-parallel weight or of the vocabulary,
columns of a row-parallel one; the norms whole), so the spans of every holder cut the dimension
into *cells* (their common refinement) and each cell is held by exactly the ranks whose span
covers it (:func:`cell_sets`): with equal degrees the cells are the TP shards and the holders
the ranks of one TP index, as before; with TP 2 beside TP 1 each half of a weight is summed
between its TP-2 owner and the TP-1 rank's matching half. Where several TP ranks of one replica
hold the same cell (a norm, a vocabulary left unsharded) they are paired by position when every
replica has as many of them, else summed in one set in which only the first of each replica
contributes (the others add zeros and receive the sum): each replica's gradient counts once.
After the backward, each rank's main grads are the mean over its own ``M_g`` microbatches;
multiplied by ``M_g / N`` (``N``: microbatches of the whole step, every replica of every group)
and summed over the holders, they become the gradient of the global batch's mean loss, whatever
the groups' token shares. In a group with short replicas (its last ones run ``M_g − 1``:
``ReplicaGroup.short_replicas``) each replica's main grads are ``dp_g / N_g`` times the sum
over its microbatches (``N_g``: the group's microbatches), as inside a plain uneven plan, and
the factor is ``N_g / (dp_g·N)`` (:func:`grad_weight`). The cells of one holder set are summed
together (in the order of parameter name and cell start, which every member computes alike): in
two levels where :func:`two_level` allows it (inside each group a reduce-scatter over the
group's own DP×CP group leaves each member the group's sum of its slice, each slice is summed
with the other groups' owners of the same elements in gloo, and an all-gather fills the slices
back in: :meth:`ReplicaSync.reduce_`, the rings of all of a rank's sets in flight together;
between groups in different datacenters the slices' rings cross the link, each byte once per
ring edge there, while the in-group steps stay on each group's own fabric), else with one
gloo all-reduce over every holder; such a set spanning datacenters is summed hierarchically
(inside each DC, then the DC leaders, then a broadcast inside each DC), so each of its bytes
crosses the DC link once per leader.

Context parallelism (``stages[i].cp``, each group its own degree ``C_g``, 1 included): the
``C_g`` CP ranks of a replica each hold the gradient of the mean loss of their ``1/C_g`` of
every sequence's tokens (``runtime/context_parallel.py``), so each is a replica of its own
here (the holders of a cell are keyed by ``(group, dp, cp)``, as ``comm_view`` does inside
the group) and its weight is ``M_g / (N·C_g)``: the ``C_g`` of them sum to the replica's.

This sum replaces the group's own DP all-reduce (the result is the same on every holder), so
ZeRO-1 keeps its slice of it and the within-group gradient norm (each parameter counted once,
as in a plain plan) is already the global norm. The loss and validation loss of each group
(means over its microbatches) are combined by their shares over an all-rank group.

Deadlocks: every process group is a rendezvous of its members, and every rank creates and uses
the groups it belongs to in one global order (holder sets sorted, then the all-rank group), so
no two ranks can wait on each other in opposite orders (a rank alone in its DP×CP group sums
its sets one after another in that order). A two-level set holds the whole DP×CP group of
each of its ranks, so every DP peer meets the same sets in the same order and runs
the group's own collectives on them alike. A rank runs the in-group step of each of its
two-level sets, then starts every chunk ring of them, and only then waits on any: its
in-group steps wait only for its DP×CP peers (who reach them the same way), and no ring
waits on a rank that has not yet started all of its own, so the rings all complete; the
all-gathers follow in the sets' order, then the one-ring sets in theirs. The gloo groups of
the slices' rings are built with the others, in the set's order and then by element offset.
The groups are built before any group world exists (:func:`run_grouped_rank` in the
trainer).
"""

from __future__ import annotations

import datetime
import functools
import itertools
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from hettrain.api.spec import ModelSpec
from hettrain.planning.cost import vocab_shards
from hettrain.planning.plan import Plan
from hettrain.planning.support import group_cp, group_stage_units
from hettrain.runtime.collectives.stats import Tier, tier_of
from hettrain.runtime.model import LlamaDecoderLayer, whole_model
from hettrain.runtime.tensor_parallel import shard_layout

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


_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def shard_span(spec: ModelSpec, name: str, tp: int, index: int) -> tuple[int, int, int] | None:
    """``(dim, start, end)``: the span of global parameter ``name`` along its TP shard
    dimension that TP rank ``index`` of a ``tp``-way stage holds (the whole dimension where
    that degree leaves it unsharded: a vocabulary ``tp`` does not divide); None for a
    parameter no TP degree shards (the norms): every holder has all of it
    (``runtime/tensor_parallel.py`` is the sharding this mirrors)."""
    if name.startswith("model.layers."):
        suffix = name.split(".", 3)[3]
        if suffix not in shard_layout(spec, 1):
            return None
        dim, idx = shard_layout(spec, tp)[suffix]
        rows = idx[index]
        return dim, int(rows[0]), int(rows[-1]) + 1
    if name in _VOCAB:
        if tp > 1 and vocab_shards(spec, tp) == tp:
            return 0, index * spec.vocab // tp, (index + 1) * spec.vocab // tp
        return 0, 0, spec.vocab
    return None


@dataclass(frozen=True, slots=True)
class Cell:
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, end)`` of global parameter ``name``
    that one set of ranks holds; the whole tensor when ``dim`` is None."""

    name: str
    dim: int | None
    start: int
    end: int


def unit_param_names(spec: ModelSpec, unit: str) -> list[str]:
    """The global names of a unit's parameters (``runtime/model.py``'s modules, built on the
    meta device: no memory, no init)."""
    if unit == "embedding":
        return ["model.embed_tokens.weight"]
    if unit == "head":
        return ["model.norm.weight"] + ([] if spec.tie_embeddings else ["lm_head.weight"])
    i = int(unit.split()[1])
    with torch.device("meta"):
        block = LlamaDecoderLayer(spec)
    return [f"model.layers.{i}.{n}" for n, _ in block.named_parameters()]


def _unit_ranks(plan: Plan) -> dict[str, list[int]]:
    units = group_stage_units(plan)
    out: dict[str, list[int]] = {}
    for r in plan.ranks:
        for u in units[(r.group, r.stage)]:
            out.setdefault(u, []).append(r.rank)
    return out


def _tp_of(plan: Plan, rank: int) -> int:
    r = plan.ranks[rank]
    return plan.groups[r.group].stages[r.stage].tp


def grad_weight(plan: Plan, rank: int) -> float:
    """The factor on ``rank``'s main grads before the sum (module docstring): its group's
    share of the step's microbatches per replica, split between its CP ranks. A replica's
    main grads are its group's mean scaled to one replica (``Trainer._per_microbatch``: over
    its own ``M`` microbatches, or ``dp/N_g`` of their sum in a group with short replicas),
    so the factor is the group's ``N_g / dp`` of the step's ``N``."""
    g = plan.groups[plan.ranks[rank].group]
    return g.microbatches / (g.dp * plan.total_microbatches * group_cp(g.stages))


def cell_sets(plan: Plan, name: str, unit_ranks: dict[str, list[int]] | None = None
              ) -> list[tuple[Cell, tuple[int, ...], frozenset[int]]]:
    """The cells of global parameter ``name`` (module docstring), each with the sorted
    ranks summing it and the ranks among them that contribute their gradient (every replica
    of every group exactly once; each CP rank is a replica of its own)."""
    holders = (unit_ranks or _unit_ranks(plan))[unit_of(name)]
    spans = {h: shard_span(plan.model, name, _tp_of(plan, h), plan.ranks[h].tp) for h in holders}
    dims = {sp[0] for sp in spans.values() if sp is not None}
    if not dims:
        cells = [Cell(name, None, 0, 0)]
    else:
        (dim,) = dims
        cuts = sorted({x for sp in spans.values() if sp is not None for x in sp[1:]})
        cells = [Cell(name, dim, a, b) for a, b in itertools.pairwise(cuts)]
    out = []
    for cell in cells:
        by_replica: dict[tuple[int, int, int], list[int]] = {}
        for h in holders:
            sp = spans[h]
            if cell.dim is None or (sp[1] <= cell.start and cell.end <= sp[2]):
                r = plan.ranks[h]
                by_replica.setdefault((r.group, r.dp, r.cp), []).append(h)
        lists = [sorted(v, key=lambda h: plan.ranks[h].tp) for _, v in sorted(by_replica.items())]
        if len({len(v) for v in lists}) == 1:  # pair the replicas' holders by position
            for j in range(len(lists[0])):
                members = tuple(sorted(v[j] for v in lists))
                out.append((cell, members, frozenset(members)))
        else:  # one set; the first holder of each replica contributes
            out.append((cell, tuple(sorted(h for v in lists for h in v)),
                        frozenset(v[0] for v in lists)))
    return out


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
    return tier_of(plan.ranks[r] for r in ranks)


@dataclass
class _SetSync:
    """This rank's part in summing one holder set: flat (``full``) or hierarchical, or in two
    levels (``rings``)."""

    members: tuple[int, ...]
    full: dist.ProcessGroup | None = None  # one DC: all holders
    local: dist.ProcessGroup | None = None  # several DCs: this rank's DC's holders
    leaders: dict | None = None  # {"group": PG of the DC leaders (leaders only), "root": 0}
    local_size: int = 1
    # this rank's cells of the set, in the set's order: (segment start, local shape, dim,
    # local span start, end, contributes)
    pieces: list[tuple[int, tuple[int, ...], int | None, int, int, bool]] | None = None
    # two-level sum (:func:`two_level`): the set's elements, this rank's slice of them in its
    # DP×CP group (:func:`slice_bounds`) and its chunk rings between the groups, each
    # (start, end, the gloo group of the chunk's owners, its members; None when alone)
    elements: int = 0
    group_size: int = 1  # two-level: the rank's DP×CP group (1: its in-group sums are no-ops)
    slice: tuple[int, int] = (0, 0)
    members_index: int = 0  # this rank's place among its group's holders of the set
    rings: list[tuple[int, int, dist.ProcessGroup | None, tuple[int, ...]]] | None = None


def _unpack(buf: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """Copy the flat ``buf`` (``parts`` concatenated, possibly on another device) back into
    ``parts``, in order."""
    offset = 0
    for p in parts:
        p.copy_(buf[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()


def slice_width(n: int, d: int) -> int:
    """Elements of each of the ``d`` equal slices a reduce-scatter cuts ``n`` elements into
    (``ceil(n / d)``; the buffer is padded to ``d`` of them)."""
    return -(-n // d)


def slice_bounds(n: int, d: int) -> list[int]:
    """The ``d + 1`` bounds of the ``d`` slices of ``n`` elements the members of a DP×CP group
    own (a reduce-scatter's chunks: :func:`slice_width` each, so the last slices may be short
    or empty)."""
    step = slice_width(n, d)
    return [min(i * step, n) for i in range(d + 1)]


def chunk_rings(n: int, holders: Sequence[Sequence[int]]) -> list[tuple[int, int, tuple[int, ...]]]:
    """``(start, end, owners)``: the set's ``n`` elements cut at every group's slice bounds
    (``holders[g]``: group ``g``'s holders in DP×CP group order), each piece with the holder
    that owns it in each group, sorted: the ranks that sum it between the groups."""
    steps = [slice_width(n, len(h)) for h in holders]
    cuts = sorted({b for h in holders for b in slice_bounds(n, len(h))})
    return [(lo, hi, tuple(sorted(h[lo // st] for h, st in zip(holders, steps, strict=True))))
            for lo, hi in itertools.pairwise(cuts) if lo < hi]


def cell_elements(spec: ModelSpec, cell: Cell) -> int:
    """Elements of ``cell`` (of its global parameter, built on the meta device)."""
    shape = _global_shapes(spec)[cell.name]
    if cell.dim is None:
        return math.prod(shape)
    return math.prod(shape) // shape[cell.dim] * (cell.end - cell.start)


@functools.lru_cache(maxsize=8)
def _global_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in whole_model(spec, seed=0).named_parameters()}


def two_level(plan: Plan, members: Sequence[int],
              contrib: frozenset[int]) -> dict[int, list[int]] | None:
    """The holders of one set per group (sorted) when the set can be summed in two levels --
    inside each group on its own DP×CP group, then chunk by chunk between the groups (the
    chunk rings cross a datacenter link where the groups are in different ones): every
    holder contributes, and in each group they are exactly one rank per replica and CP rank
    of one stage and TP index (the members of that stage's DP×CP group); else None (the
    one-ring sum over every holder, hierarchical across datacenters)."""
    if set(members) != contrib:
        return None
    by_group: dict[int, list[int]] = {}
    for r in sorted(members):
        by_group.setdefault(plan.ranks[r].group, []).append(r)
    if len(by_group) < 2:
        return None
    for g, ranks in by_group.items():
        grp = plan.groups[g]
        coords = {(plan.ranks[r].stage, plan.ranks[r].tp) for r in ranks}
        replicas = {(plan.ranks[r].dp, plan.ranks[r].cp) for r in ranks}
        if (len(coords) != 1 or len(replicas) != len(ranks)
                or len(ranks) != grp.dp * group_cp(grp.stages)):
            return None
    return by_group


@dataclass(frozen=True)
class InGroup:
    """SUM collectives of a rank's DP×CP group inside its replica group (the communicator's
    stage DP group), in place, on the main grads' device: ``all_reduce(t)``; where the group
    has flat ones (one pool), ``reduce_scatter(full)`` (``full``: one equal chunk per member
    in group rank order; this rank's, ``index``, receives the group's sum) and
    ``all_gather(full)`` (each member's chunk fills the others'), else None (the two-level
    sum then all-reduces twice)."""

    all_reduce: Callable[[torch.Tensor], None]
    reduce_scatter: Callable[[torch.Tensor], None] | None = None
    all_gather: Callable[[torch.Tensor], None] | None = None
    index: int = 0


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
        self.grad_weight = grad_weight(plan, rank)
        self.loss_weight = g.microbatches / plan.total_microbatches
        self.leader = rank == min(r.rank for r in plan.group_ranks(me.group))
        self.writes_checkpoints = me.group == 0
        self._unit_ranks = _unit_ranks(plan)
        self._my_units = {u for u, ranks in self._unit_ranks.items() if rank in ranks}
        self._store, self._timeout = store, timeout
        self._cell_cache: dict[str, list[tuple[Cell, tuple[int, ...], frozenset[int]]]] = {}
        names = [n for u in sorted(self._my_units) for n in unit_param_names(plan.model, u)]
        members = {m for n in names for _, m, _ in self._cells(n)}
        self._contrib: dict[tuple[int, ...], frozenset[int]] = {}
        self._elements: dict[tuple[int, ...], int] = {}
        for n in names:  # the holders that contribute to every cell of a set; its elements
            for cell, m, c in self._cells(n):
                self._contrib[m] = self._contrib.get(m, c) & c
                self._elements[m] = self._elements.get(m, 0) + cell_elements(plan.model, cell)
        self.sets: dict[tuple[int, ...], _SetSync] = {}
        for m in sorted(members):  # the global order (module docstring)
            self.sets[m] = self._build(m)
        self.world = self._pg("world", tuple(range(plan.world_size)))
        self._bound: tuple[int, int] | None = None
        # the chunk rings the last :meth:`reduce_` had in flight together (all of them)
        self.rings_in_flight = 0

    def _cells(self, name: str) -> list[tuple[Cell, tuple[int, ...], frozenset[int]]]:
        """This rank's cells of parameter ``name`` (computed once: the sets are built from
        them, then the optimizer's layout is bound to them)."""
        if name not in self._cell_cache:
            unit = unit_of(name)
            if unit not in self._my_units:
                raise ValueError(f"rank {self.rank}: parameter {name} ({unit}) is not in this "
                                 "rank's stage of the plan")
            self._cell_cache[name] = [c for c in cell_sets(self.plan, name, self._unit_ranks)
                                      if self.rank in c[1]]
        return self._cell_cache[name]

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
        split = two_level(self.plan, members, self._contrib[members])
        if split is not None:
            n = self._elements[members]
            mine = split[self.group]
            bounds = slice_bounds(n, len(mine))
            i = mine.index(self.rank)
            s.elements, s.group_size, s.slice = n, len(mine), (bounds[i], bounds[i + 1])
            s.members_index = i
            s.rings = [(lo, hi, self._pg(f"set/{name}/ring/{lo}", owners)
                        if len(owners) > 1 else None, owners)
                       for lo, hi, owners in chunk_rings(n, [split[g] for g in sorted(split)])
                       if self.rank in owners]
            return s
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

    def _bind(self, segments: Sequence, shapes: Sequence[Sequence[int]]) -> None:
        """Map the optimizer's flat layout (``name, start, end`` segments, the local shape of
        each) to the cells of each holder set, in the set's order."""
        per: dict[tuple[int, ...], list[tuple[tuple[str, int], tuple]]] = {
            m: [] for m in self.sets}
        tp, index = _tp_of(self.plan, self.rank), self.plan.ranks[self.rank].tp
        for seg, shape in zip(segments, shapes, strict=True):
            span = shard_span(self.plan.model, seg.name, tp, index)
            for cell, members, contrib in self._cells(seg.name):
                lo = cell.start - span[1] if span is not None else 0
                hi = cell.end - span[1] if span is not None else 0
                per[members].append(((cell.name, cell.start), (
                    seg.start, tuple(shape), cell.dim, lo, hi, self.rank in contrib)))
        for members, s in self.sets.items():
            s.pieces = [p for _, p in sorted(per[members], key=lambda e: e[0])]
        self._bound = (len(segments), segments[-1].end if segments else 0)

    @staticmethod
    def _view(flat: torch.Tensor, piece: tuple) -> torch.Tensor:
        """The main-grad elements of one cell (a view of ``flat``)."""
        start, shape, dim, lo, hi, _ = piece
        n = math.prod(shape)
        local = flat[start:start + n].view(shape)
        if dim is None:
            return local
        return local.narrow(dim, lo, hi - lo)

    def _record(self, members: Sequence[int], nbytes: int, t0: float) -> None:
        if self.account is not None:
            self.account(_tier(self.plan, members), nbytes, time.perf_counter() - t0)

    @torch.no_grad()
    def reduce_(self, flat: torch.Tensor, segments: Sequence,
                shapes: Sequence[Sequence[int]], in_group: InGroup | None = None) -> None:
        """Turn this rank's main grads (``flat``, laid out by ``segments``, each parameter of
        local shape ``shapes[i]``) into the gradient of the global batch's mean loss, in
        place, on every holder of every parameter. ``in_group``: the collectives of this
        rank's DP×CP group inside its replica group (the communicator's); with them, the sets
        :func:`two_level` allows are summed in two levels, the others in one ring over every
        holder.

        The two-level sum, each member of a DP×CP group of ``d`` owning one slice of each set
        (:func:`slice_bounds`): (1) inside the group, a reduce-scatter leaves each member the
        group's sum of its slice (where the group has none, an all-reduce leaves it the whole
        sum), copied to host memory (:meth:`_scatter`); (2) each slice, cut where another
        group's slices end (:func:`chunk_rings`), is summed with its owners in the other
        groups in host memory (gloo, bytes ``2(G − 1)/G`` of the slice): the pieces of every
        set of the rank at once, so the step waits for one round trip between the groups
        rather than one per set (:meth:`_launch_rings`; a rank alone in its DP×CP group, whose
        slices are whole sets, runs its sets one after another instead, holding one set's
        copy at a time); (3) an all-gather inside the group fills every slice on every member
        (without one, each member zeros the others' slices and the group all-reduces:
        :meth:`_gather`). Inside a group a byte moves as in one all-reduce, and each crosses
        between groups once per owner. Steps (1) and (3) run set by set in the sets' order,
        on every member of the DP×CP group alike."""
        if self._bound is None:
            self._bind(segments, shapes)
        flat.mul_(self.grad_weight)
        chunked, rings = [], []
        for s in self.sets.values():
            if len(s.members) == 1 or not s.pieces:
                continue
            parts = [self._view(flat, p) for p in s.pieces]
            if s.rings is not None:
                if in_group is None:
                    raise ValueError("ReplicaSync.reduce_: this plan's sets are summed in two "
                                     "levels; pass in_group (the group's DP×CP collectives)")
                chunked.append((s, parts))
                continue
            rings.append((s, parts))
        # every in-group step of a batch, then all its sets' chunk rings in flight at once
        # (one round trip between the groups, not one per set), then its all-gathers (module
        # docstring: Deadlocks). One batch of every set; alone in its group, where the rank's
        # slices are whole sets, a batch per set, so that at most one set's copy is held.
        # rings_in_flight: the most rings a batch started before its first wait
        alone = bool(chunked) and chunked[0][0].group_size == 1
        self.rings_in_flight = 0
        for batch in ([c] for c in chunked) if alone else [chunked]:
            staged = [(s, parts, *self._scatter(s, parts, in_group)) for s, parts in batch]
            pending = [self._launch_rings(s, mine) for s, _, _, mine in staged]
            self.rings_in_flight = max(self.rings_in_flight, sum(map(len, pending)))
            for waits in pending:
                self._wait_rings(waits)
            for s, parts, keep, mine in staged:
                self._gather(s, parts, keep, mine, in_group)
        for s, parts in rings:
            whole = (len(parts) == 1 and parts[0].is_contiguous() and s.pieces[0][5]
                     and flat.device.type == "cpu")
            if whole:
                buf = parts[0].view(-1)
            else:
                buf = torch.cat([p.reshape(-1) if piece[5] else p.new_zeros(p.numel())
                                 for p, piece in zip(parts, s.pieces, strict=True)]).cpu()
            self._sum(s, buf)
            if not whole:
                _unpack(buf, parts)

    @staticmethod
    def _layout(s: _SetSync, grp: InGroup) -> tuple[bool, int]:
        """``(scatter, size)``: whether the set's in-group steps are a reduce-scatter and an
        all-gather (else all-reduces), and the elements of its flat buffer (a reduce-scatter's
        chunks are padded to ``d`` equal slices)."""
        n, d = s.elements, s.group_size
        scatter = d > 1 and grp.reduce_scatter is not None and grp.all_gather is not None
        return scatter, slice_width(n, d) * d if scatter else n

    def _scatter(self, s: _SetSync, parts: list[torch.Tensor], grp: InGroup
                 ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Step (1) of the two-level sum of one set (:meth:`reduce_`): ``(keep, mine)``:
        the set's cells in one flat buffer, kept where it is the main grads themselves or the
        rank is alone in its group (else None: freed), and the rank's slice of the group's
        sum in host memory (a view of ``keep`` on the host, else a copy: ``1/d`` of the
        set)."""
        n, d, (lo, hi) = s.elements, s.group_size, s.slice
        have = sum(p.numel() for p in parts)
        if have != n:
            raise RuntimeError(f"rank {self.rank}: holder set {s.members} has {have} gradient "
                               f"elements here, {n} by the model's shapes")
        scatter, size = self._layout(s, grp)
        if scatter and grp.index != s.members_index:
            raise RuntimeError(f"rank {self.rank}: DP×CP group rank {grp.index}, but holder "
                               f"{s.members_index} of its replica group's set")
        if len(parts) == 1 and parts[0].is_contiguous() and size == n:
            buf = parts[0].view(-1)
        else:  # the one copy of the set's cells (and the padding)
            buf = parts[0].new_empty(size)
            torch.cat([p.reshape(-1) for p in parts], out=buf[:n])
            buf[n:].zero_()
        if scatter:
            grp.reduce_scatter(buf)
        elif d > 1:
            grp.all_reduce(buf)
        # keep the buffer where it is the main grads themselves (nothing to free) or holds
        # the rank's whole set anyway (alone in its group); else only the slice
        keep = buf if d == 1 or buf.data_ptr() == parts[0].data_ptr() else None
        mine = buf[lo:hi]
        if mine.device.type != "cpu":
            mine = mine.cpu()
        elif keep is None:
            mine = mine.clone()
        return keep, mine

    def _launch_rings(self, s: _SetSync, mine: torch.Tensor) -> list[tuple]:
        """Step (2): start the gloo sums of the rank's pieces of its slice (``mine``) with
        their owners in the other groups; returns what :meth:`_wait_rings` waits on."""
        lo = s.slice[0]
        return [(pg.allreduce([mine[a - lo:b - lo]]), mine[a - lo:b - lo], owners,
                 time.perf_counter()) for a, b, pg, owners in s.rings if pg is not None]

    def _wait_rings(self, pending: list[tuple]) -> None:
        """Wait on :meth:`_launch_rings`' sums and account their bytes."""
        for work, piece, owners, t0 in pending:
            work.wait()
            g = len(owners)
            self._record(owners, int(2 * (g - 1) / g * piece.numel() * piece.element_size()),
                         t0)

    def _gather(self, s: _SetSync, parts: list[torch.Tensor], keep: torch.Tensor | None,
                mine: torch.Tensor, grp: InGroup) -> None:
        """Step (3): every slice filled in on every member of the group (an all-gather; where
        the group has none, the other slices zeroed and an all-reduce), then copied into the
        main grads (``keep``, ``mine``: :meth:`_scatter`'s)."""
        d, (lo, hi) = s.group_size, s.slice
        scatter, size = self._layout(s, grp)
        buf = parts[0].new_zeros(size) if keep is None else keep
        if mine.data_ptr() != buf[lo:hi].data_ptr() or mine.device != buf.device:
            buf[lo:hi].copy_(mine)
        if scatter:
            grp.all_gather(buf)
        elif d > 1:  # (alone in its group the rank owns the whole set)
            buf[:lo].zero_()
            buf[hi:].zero_()
            grp.all_reduce(buf)
        if buf.data_ptr() != parts[0].data_ptr():
            _unpack(buf, parts)

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
