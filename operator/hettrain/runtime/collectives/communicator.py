"""HetCommunicator: every process group of a plan, and the collectives the trainer calls."""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from hettrain.planning.plan import Plan
from hettrain.runtime.collectives.bridge import (
    CHUNK_BYTES,
    bridged_all_reduce_async,
    compressed_all_reduce_,
)
from hettrain.runtime.collectives.choice import (
    EXCHANGE_MIN_LATENCY_MS,
    PIPELINE_BYTES,
    LinkModel,
    best_pieces,
    choose,
    use_exchange,
)
from hettrain.runtime.collectives.compression import Codec, ErrorFeedback
from hettrain.runtime.collectives.hierarchical import (
    _finish,
    hierarchical_all_reduce_,
    leader_all_reduce_,
)
from hettrain.runtime.collectives.p2p import plan_streams, recv_tensor, send_tensor
from hettrain.runtime.collectives.stats import CommStats, Tier, tier_of
from hettrain.runtime.collectives.topology import Hierarchy, layout, peer_rank

ALGORITHMS = ("auto", "flat", "hierarchical", "leader")
SCOPES = ("global", "dc")
CROSS_DC_LINK = LinkModel(inter_gbps=10.0, inter_latency_ms=5.0)  # plan gives no link speed
SAME_DC_LINK = LinkModel(inter_gbps=25.0, inter_latency_ms=0.05)  # host-staged NIC hop


# modules that register the ``hccl`` backend with torch.distributed when imported
HCCL_PLUGINS = ("habana_frameworks.torch.distributed.hccl", "torch_npu")


@functools.cache  # the host's plugins do not change while the process runs
def _hccl_available() -> bool:
    for module in HCCL_PLUGINS:
        if dist.is_backend_available("hccl"):
            break
        try:
            importlib.import_module(module)
        except ImportError:
            continue
    return dist.is_backend_available("hccl")


def resolve_backend(requested: str) -> str:
    """The backend usable on this host for a pool that asks for ``requested``; else gloo.

    ``hccl`` is registered by the Gaudi (``habana_frameworks``) or Ascend (``torch_npu``)
    plugin, imported here when present."""
    if requested == "nccl" and torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    if requested == "hccl" and _hccl_available():
        return "hccl"
    return "gloo"


def choose_algorithm(nbytes: int, hier: Hierarchy, link: LinkModel | None = None,
                     pipeline_bytes: int | None = PIPELINE_BYTES) -> str:
    """``auto``: flat for one block, singleton blocks or one host; else the fastest of flat,
    hierarchical and leader for ``nbytes`` by the link model (see :mod:`.choice`)."""
    return choose(nbytes, hier, link, pipeline_bytes)


def bridge_chunk_bytes(buf: torch.Tensor, link: LinkModel) -> int:
    """The bridge's chunk size for ``buf``: :data:`CHUNK_BYTES` where chunks overlap
    something (device<->host copies, or round trips on a link of >= 1 ms), else one chunk
    (host tensors on a fast link or one host: chunks would only add per-op costs; measured on
    loopback, 2 pools x 4 ranks, 64 MiB: 1.1-1.25x slower than one op)."""
    if buf.device.type != "cpu" or (not link.one_host
                                    and link.inter_latency_ms >= EXCHANGE_MIN_LATENCY_MS):
        return CHUNK_BYTES
    return max(1, buf.numel() * buf.element_size())


def link_model(plan: Plan, hier: Hierarchy) -> LinkModel:
    """Link speeds for ``hier`` from the plan.

    One host when every rank of ``hier`` has the same ``node``. Across datacenters:
    ``plan.cross_dc["link_gbps"]`` / ``["link_latency_ms"]`` when the planner set them, else
    10 Gbit/s, 5 ms. Between pools of one datacenter: 25 Gbit/s, 0.05 ms (host-staged NIC hop).
    """
    nodes = {plan.ranks[r].node for r in hier.ranks}
    if hier.spans_dcs:
        base = CROSS_DC_LINK
        cross = plan.cross_dc or {}
        base = LinkModel(inter_gbps=float(cross.get("link_gbps") or base.inter_gbps),
                         inter_latency_ms=float(cross.get("link_latency_ms",
                                                          base.inter_latency_ms)))
    else:
        base = SAME_DC_LINK
    if len(nodes) == 1:
        return LinkModel(base.inter_gbps, base.inter_latency_ms, one_host=True)
    return base


class _Intervals:
    """Busy intervals of the inter hop during one call (pieces overlap: union, not sum)."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []

    def busy(self) -> float:
        """Seconds during which at least one inter hop was in flight."""
        total, end = 0.0, float("-inf")
        for a, b in sorted(self.spans):
            if b > end:
                total += b - max(a, end)
                end = b
        return total


class _TimedWork:
    """An in-flight inter hop; ``wait()`` completes it and records its interval."""

    def __init__(self, work, spans: _Intervals, t0: float) -> None:
        self.work, self.spans, self.t0 = work, spans, t0

    def wait(self) -> None:
        self.work.wait()
        self.spans.spans.append((self.t0, time.perf_counter()))


class _Groups:
    """Memoised ``dist.new_group`` calls; every rank calls in the same order (collective).

    Groups are keyed by the backend the PLAN names (``nccl``, ``hccl``, ``gloo``), which is the
    same on every rank; ``resolve`` maps it to what this host can run only when the group is
    created. Keyed by the resolved name instead, a rank on another vendor's host could merge
    two requests that the members keep apart, and the ranks' ``new_group`` sequences (which
    name the groups) would diverge.
    """

    def __init__(self, resolve: Callable[[str], str] = resolve_backend) -> None:
        self._cache: dict[tuple[tuple[int, ...], str], object] = {}
        self.resolve = resolve
        self.me = dist.get_rank()
        self.backends: dict[object, str] = {}  # this rank's groups -> backend they run

    def get(self, ranks: Sequence[int], backend: str) -> dist.ProcessGroup | None:
        key = (tuple(ranks), backend)
        if key not in self._cache:
            resolved = self.resolve(backend)
            group = dist.new_group(list(key[0]), backend=resolved)
            self._cache[key] = group
            if self.me in key[0]:
                self.backends[group] = resolved
        return self._cache[key] if self.me in key[0] else None


class _Level:
    """This rank's view of one Hierarchy: its intra block, shard-owner group and leader group."""

    def __init__(self, hier: Hierarchy, groups: _Groups, backend_of, intra_tier, inter_tier):
        self.hier = hier
        me = groups.me
        self.full = groups.get(hier.ranks, backend_of(hier.ranks))
        self.intra = self.inter = self.leaders = None
        self.block: tuple[int, ...] = ()
        for b in hier.blocks:
            g = groups.get(b, backend_of(b))
            if me in b:
                self.intra, self.block = g, b
        for owners in hier.inter:
            g = groups.get(owners, "gloo")
            if me in owners:
                self.inter = g
        self.leaders = groups.get(hier.inter[0], "gloo") if hier.inter else None
        self.intra_tier, self.inter_tier = intra_tier, inter_tier
        self.link: LinkModel | None = None  # set by the communicator from the plan


class HetCommunicator:
    """All groups of a plan for one rank (see the package docstring for the contract)."""

    def __init__(self, plan: Plan, rank: int, device: torch.device,
                 backend_overrides: Mapping[str, str] | None = None,
                 chunk_bytes: int | None = None, link: LinkModel | None = None,
                 pipeline_bytes: int | None = PIPELINE_BYTES) -> None:
        if not dist.is_initialized():
            raise RuntimeError("HetCommunicator needs torch.distributed initialised first "
                               "(dist.init_process_group)")
        if dist.get_world_size() != plan.world_size:
            raise ValueError(f"world size {dist.get_world_size()} != plan.world_size "
                             f"{plan.world_size}: every rank of the plan must join")
        if dist.get_rank() != rank:
            raise ValueError(f"rank={rank} but torch.distributed rank is {dist.get_rank()}")
        self.plan, self.rank, self.device = plan, rank, device
        self.me = plan.ranks[rank]
        self.chunk_bytes = chunk_bytes
        if pipeline_bytes is not None and pipeline_bytes < 1:
            raise ValueError(f"pipeline_bytes must be >= 1 or None, got {pipeline_bytes}")
        self.pipeline_bytes = pipeline_bytes
        self.link = link  # None: per group from the plan (link_model)
        self._buckets: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self.stats = CommStats()
        self.algorithm = "auto"
        mode = plan.cross_dc.get("mode", "sync")
        self.cross_dc_mode = mode
        wanted = plan.cross_dc.get("compression") or "none"
        self.codec = Codec(wanted if mode in ("compress", "diloco") else "none")
        self.feedback = ErrorFeedback()
        overrides = dict(backend_overrides or {})
        pool_backend: dict[str, str] = {}
        for st in plan.stages:
            for p in st.pools:
                pool_backend.setdefault(p, st.backend)
        # the plan's names (after overrides); _Groups resolves them on this host
        self.pool_backends = {p: overrides.get(p, overrides.get("*", b))
                              for p, b in pool_backend.items()}
        pool_of = {r.rank: r.pool for r in plan.ranks}

        def backend_of(ranks: Sequence[int]) -> str:
            pools = {pool_of[r] for r in ranks}
            return self.pool_backends.get(pools.pop(), "gloo") if len(pools) == 1 else "gloo"

        def link_tier(ranks: Sequence[int]) -> Tier:
            return tier_of(plan.ranks[r] for r in ranks)

        # a rank on the host CPU runs gloo in every group (nccl/hccl need device tensors); the
        # keys stay the plan's names, so its group sequence matches its accelerated peers'
        groups = self._groups = _Groups(resolve_backend if device.type != "cpu"
                                        else lambda _plan_backend: "gloo")
        lay = layout(plan)
        self.pool_group = None
        for _, ranks in lay.pools:
            g = groups.get(ranks, backend_of(ranks))
            if rank in ranks:
                self.pool_group = g
        key = (self.me.stage, self.me.tp)
        self._levels: dict[str, _Level] = {}
        for k, hier in lay.dp:
            lvl = _Level(hier, groups, backend_of, Tier.INTRA_POOL, link_tier(hier.ranks))
            lvl.link = link_model(plan, hier)
            if k == key:
                self._levels["global"] = lvl
        for k, hier in lay.dp_dc:
            lvl = _Level(hier, groups, backend_of, Tier.INTRA_POOL, link_tier(hier.ranks))
            lvl.link = link_model(plan, hier)
            if k == (*key, self.me.datacenter):
                self._levels["dc"] = lvl
        for k, hier in lay.dp_cross_dc:
            intra_t = max((link_tier(b) for b in hier.blocks), key=lambda t: list(Tier).index(t))
            lvl = _Level(hier, groups, backend_of, intra_t, link_tier(hier.ranks))
            lvl.link = link_model(plan, hier)
            if k == key:
                self._levels["cross_dc"] = lvl
        self.tp_group = None
        for k, ranks in lay.tp:
            g = groups.get(ranks, backend_of(ranks))
            if k == (self.me.stage, self.me.dp):
                self.tp_group = g
        self.dp_group = self._levels["global"].full
        self.dp_size = len(self._levels["global"].hier.ranks)
        self.p2p_groups: dict[tuple[int, int, int], dist.ProcessGroup] = {}
        self._connect_p2p(pool_of)

    def _connect_p2p(self, pool_of: Mapping[int, str]) -> None:
        """One group per pipeline stream piece ``(sender, receiver, tag)`` whose two stages
        share a vendor and whose pools share a vendor backend (nccl/hccl; gloo on a CPU host).

        Created on every rank in :func:`~.p2p.plan_streams` order (``new_group`` is
        collective); a dedicated group per stream keeps NCCL's in-order matching (it has no
        tags) per stream and lets the two directions of a pair progress independently. Groups
        on a vendor backend are connected here by one tiny send in the same global order, so no
        rank blocks later in a lazy communicator set-up while its peer waits for it. Pairs of
        different vendors get no group: they use the gloo world group, host-staged.
        """
        plan = self.plan
        for stream in plan_streams(plan):
            a, b = plan.stages[stream.from_stage], plan.stages[stream.to_stage]
            for piece in stream.pieces:
                backend = self.pool_backends.get(pool_of[piece.sender], "gloo")
                if (a.vendor != b.vendor or backend == "gloo"
                        or self.pool_backends.get(pool_of[piece.receiver]) != backend):
                    continue
                members = sorted((piece.sender, piece.receiver))
                resolved = self._groups.resolve(backend)
                group = dist.new_group(members, backend=resolved)
                if self.rank not in members:
                    continue
                self._groups.backends[group] = resolved
                self.p2p_groups[(piece.sender, piece.receiver, stream.tag)] = group
                if resolved != "gloo":
                    probe = torch.zeros(1, device=self.device)
                    if self.rank == piece.sender:
                        dist.send(probe, dst=piece.receiver, group=group)
                    else:
                        dist.recv(probe, src=piece.sender, group=group)

    def p2p_group(self, sender: int, receiver: int, tag: int) -> dist.ProcessGroup | None:
        """The dedicated group of pipeline stream ``(sender, receiver, tag)``; ``None``: the
        gloo world group (stages of different vendors, or a gloo pool), host-staged."""
        return self.p2p_groups.get((sender, receiver, tag))

    @classmethod
    def from_plan(cls, plan: Plan, rank: int, device: torch.device | None = None,
                  backend_overrides: Mapping[str, str] | None = None,
                  chunk_bytes: int | None = None, link: LinkModel | None = None,
                  pipeline_bytes: int | None = PIPELINE_BYTES) -> HetCommunicator:
        """Build every group of ``plan`` (collective: all ranks must call it).

        Pool groups run the plan's backend (``nccl``, ``hccl``) where this host has it and
        ``device`` is an accelerator, else gloo. ``backend_overrides`` (``{pool | "*":
        backend}``) replaces the plan's names and must be the same on every rank.
        ``link`` overrides the link speeds ``auto`` uses (default: from the plan, see
        :func:`link_model`); ``pipeline_bytes`` is the piece size of the pipelined hierarchical
        all-reduce (``None``: one piece); ``chunk_bytes`` the bridge's chunk size (``None``:
        :func:`bridge_chunk_bytes`).
        """
        return cls(plan, rank, device or torch.device("cpu"), backend_overrides, chunk_bytes,
                   link, pipeline_bytes)

    def backend(self, group: dist.ProcessGroup | None) -> str:
        """The backend ``group`` (one of this rank's) runs on this host; the world is gloo."""
        return self._groups.backends.get(group, "gloo")

    def staging_device(self, group: dist.ProcessGroup | None) -> torch.device:
        """Where a tensor for a plain collective on ``group`` must live: this rank's device
        for a vendor backend (nccl, hccl), host memory for gloo."""
        return torch.device("cpu") if self.backend(group) == "gloo" else self.device

    def choose(self, nbytes: int, scope: str = "global") -> str:
        """The algorithm ``auto`` picks for ``nbytes`` in ``scope`` (``global|dc|cross_dc``)."""
        hier = self._levels[scope].hier
        return choose_algorithm(nbytes, hier, self.link or link_model(self.plan, hier),
                                self.pipeline_bytes)

    def dp_all_gather_(self, parts: list[torch.Tensor], index: int) -> None:
        """ZeRO-1's parameter all-gather over a stage DP group that spans datacenters, in
        place: ``parts[i]`` is DP rank ``i``'s slice (equal sizes), ``parts[index]`` this
        rank's, already filled.

        Every byte crosses the DC link once per receiving datacenter, not once per receiving
        rank: an all-gather inside each DC, the DC leaders broadcast their DC's slices to each
        other, then each leader broadcasts the other DCs' slices inside its DC. Bytes go to
        the comm stats by tier, counted where they are received."""
        lvl = self._levels["cross_dc"]
        hier = lvl.hier
        if not hier.spans_dcs:
            raise ValueError("dp_all_gather_ is for DP groups across datacenters; a DP group "
                             "inside one datacenter all-gathers with dist.all_gather")
        nbytes = parts[0].numel() * parts[0].element_size()
        pos = {r: i for i, r in enumerate(hier.ranks)}
        mine_b = [pos[r] for r in lvl.block]
        remote = [i for i in range(len(parts)) if i not in set(mine_b)]
        # 1. inside this DC: every member gets the DC's own slices
        if len(mine_b) > 1:
            dev = self.staging_device(lvl.intra)
            outs = [torch.empty_like(parts[i], device=dev) for i in mine_b]
            t0 = time.perf_counter()
            dist.all_gather(outs, parts[index].to(dev), group=lvl.intra)
            self.stats.add(lvl.intra_tier, (len(mine_b) - 1) * nbytes, time.perf_counter() - t0)
            for i, o in zip(mine_b, outs, strict=True):
                if i != index:
                    parts[i].copy_(o)
        # 2. the DC leaders: each DC's slices once over the link to every other DC
        if lvl.leaders is not None:
            t0 = time.perf_counter()
            for b in hier.blocks:
                idx = [pos[r] for r in b]
                buf = torch.cat([parts[i].cpu() for i in idx])  # the leaders group is gloo
                dist.broadcast(buf, src=b[0], group=lvl.leaders)
                if b is not hier.blocks[hier.block_of(self.rank)]:
                    for i, piece in zip(idx, buf.split(parts[0].numel()), strict=True):
                        parts[i].copy_(piece)
            self.stats.add(lvl.inter_tier, len(remote) * nbytes, time.perf_counter() - t0)
        # 3. inside this DC: the leader passes the other DCs' slices on
        if len(mine_b) > 1 and remote:
            dev = self.staging_device(lvl.intra)
            buf = torch.cat([parts[i].to(dev) for i in remote])
            t0 = time.perf_counter()
            dist.broadcast(buf, src=lvl.block[0], group=lvl.intra)
            if self.rank != lvl.block[0]:
                self.stats.add(lvl.intra_tier, len(remote) * nbytes, time.perf_counter() - t0)
                for i, piece in zip(remote, buf.split(parts[0].numel()), strict=True):
                    parts[i].copy_(piece)

    # ----------------------------------------------------------------- data parallel

    def dp_all_reduce_(self, tensors: list[torch.Tensor], average: bool = True,
                       scope: str = "global") -> str:
        """Sum (or average) ``tensors`` in place over this rank's stage DP group.

        ``scope="dc"`` restricts the group to this rank's datacenter (DiLoCo inner steps).
        Returns the algorithm used.
        """
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        return self._all_reduce(tensors, self._levels[scope], average,
                                compress=self.cross_dc_mode == "compress")

    def dp_overlappable(self, scope: str = "global") -> bool:
        """Whether the stage DP group of ``scope`` can all-reduce asynchronously: it lies in
        one pool (one block: a single flat collective on the pool's backend, no host-staged
        bridge, no compression). Across pools or datacenters the hierarchical path runs
        synchronously after the backward."""
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        return len(self._levels[scope].hier.blocks) == 1

    def dp_scope_size(self, scope: str = "global") -> int:
        """Ranks in this rank's stage DP group of ``scope`` (``global`` or ``dc``)."""
        return len(self._levels[scope].hier.ranks)

    def dp_all_reduce_async(self, flat: torch.Tensor, scope: str = "global"):
        """Start a SUM all-reduce of the contiguous ``flat`` in place over this rank's stage DP
        group (``async_op=True``) and return its handle; the caller waits and divides by
        :meth:`dp_scope_size`. Only for a group that :meth:`dp_overlappable`."""
        if not self.dp_overlappable(scope):
            raise ValueError("dp_all_reduce_async: the stage DP group spans pools; use "
                             "dp_all_reduce_ (hierarchical, synchronous)")
        return dist.all_reduce(flat, group=self._levels[scope].full, async_op=True)

    def dp_reduce_scatter_async(self, flat: torch.Tensor, scope: str = "global"):
        """Start a SUM reduce-scatter of the contiguous ``flat`` over this rank's stage DP group
        (``async_op=True``), in place: ``flat`` splits into one equal chunk per group rank and
        this rank's chunk (its group rank's) receives the sum; the rest is left as it was.
        Half an all-reduce's bytes, for ZeRO-2/3, where a rank keeps only its chunk. Only for a
        group that :meth:`dp_overlappable`."""
        group, mine = self._own_chunk("dp_reduce_scatter_async", flat, scope)
        return dist.reduce_scatter_tensor(mine, flat, group=group, async_op=True)

    def dp_all_gather_into_(self, flat: torch.Tensor, scope: str = "global") -> None:
        """All-gather over this rank's stage DP group, in place: ``flat`` splits into one equal
        chunk per group rank, this rank's (its group rank's) already filled; afterwards every
        chunk is. The counterpart of :meth:`dp_reduce_scatter_async` (the two move one
        all-reduce's bytes). Only for a group that :meth:`dp_overlappable`."""
        group, mine = self._own_chunk("dp_all_gather_into_", flat, scope)
        dist.all_gather_into_tensor(flat, mine.clone(), group=group)

    def _own_chunk(self, what: str, flat: torch.Tensor, scope: str
                   ) -> tuple[dist.ProcessGroup, torch.Tensor]:
        """The flat stage DP group of ``scope`` and this rank's chunk of ``flat`` (a view: one
        equal chunk per group rank, in group rank order), refused for a group that is not
        :meth:`dp_overlappable` or a ``flat`` that does not split evenly."""
        if not self.dp_overlappable(scope):
            raise ValueError(f"{what}: the stage DP group spans pools; use dp_all_reduce_ "
                             "(hierarchical, synchronous)")
        group = self._levels[scope].full
        n = dist.get_world_size(group)
        if flat.numel() % n:
            raise ValueError(f"{what}: {flat.numel()} elements do not split into {n} equal "
                             "chunks")
        return group, flat.view(n, -1)[dist.get_rank(group)]

    def cross_dc_all_reduce_(self, tensors: list[torch.Tensor], average: bool = True,
                             compress: bool = False) -> str:
        """Sum/average over the stage DP group, arranged by datacenter (DiLoCo outer step)."""
        return self._all_reduce(tensors, self._levels["cross_dc"], average, compress=compress)

    def _all_reduce(self, tensors, lvl: _Level, average: bool, compress: bool) -> str:
        if not tensors:
            return "none"
        flat, in_place = self._flatten(tensors)
        hier = lvl.hier
        algo = self.algorithm
        if algo not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algo!r}")
        link = self.link or lvl.link
        if algo == "auto" or len(hier.blocks) == 1:
            algo = choose_algorithm(flat.numel() * flat.element_size(), hier, link,
                                    self.pipeline_bytes)
        use_codec = compress and hier.spans_dcs and self.codec.kind != "none"
        key = ("dp", id(lvl), len(tensors), flat.numel())
        spans = _Intervals()
        inter_bytes = [0]

        def inter(buf: torch.Tensor, group):
            g = dist.get_world_size(group)
            chunk = self.chunk_bytes or bridge_chunk_bytes(buf, link)
            t0 = time.perf_counter()
            if use_codec and flat.dtype == torch.float32:
                sent = compressed_all_reduce_(buf, group, self.codec, self.feedback,
                                              (key, buf.numel()), chunk)
                inter_bytes[0] += sent * (g - 1)
                spans.spans.append((t0, time.perf_counter()))
                return None
            exchange = use_exchange(g, link)
            share = 1.0 if exchange else 2 * (g - 1) / g
            inter_bytes[0] += int(share * buf.numel() * buf.element_size())
            return _TimedWork(bridged_all_reduce_async(buf, group, chunk, exchange),
                              spans, t0)

        nb = flat.numel() * flat.element_size()
        n_intra = len(lvl.block)
        t_start = time.perf_counter()
        intra_bytes = 0
        if algo == "flat" and len(hier.blocks) == 1:
            intra_bytes = int(2 * (n_intra - 1) / n_intra * nb)
            dist.all_reduce(flat, group=lvl.full)
        elif algo == "flat":
            _finish(inter(flat, lvl.full))
        elif algo == "leader":
            intra_bytes = 2 * nb if n_intra > 1 else 0
            leader_all_reduce_(flat, lvl.intra, lvl.leaders, leader=lvl.block[0],
                               inter_op=inter)
        else:
            intra_bytes = int(2 * (n_intra - 1) / n_intra * nb)
            hierarchical_all_reduce_(flat, lvl.intra, lvl.inter, intra_ranks=lvl.block,
                                     shards=None if hier.uniform else hier.shards,
                                     inter_op=inter, pipeline_bytes=self.pipeline_bytes,
                                     pieces=best_pieces(nb, hier, link, self.pipeline_bytes))
        total = time.perf_counter() - t_start
        busy = spans.busy()
        if spans.spans:
            self.stats.add(lvl.inter_tier, inter_bytes[0], busy)
        if intra_bytes or not spans.spans:
            self.stats.add(lvl.intra_tier, intra_bytes, max(0.0, total - busy))
        if average:
            flat /= len(hier.ranks)
        if not in_place:
            offset = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset: offset + n].view_as(t))
                offset += n
        return algo

    def _flatten(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """One flat tensor to reduce: the tensor itself when there is one contiguous tensor
        (reduced in place), else the tensors copied into a reused bucket (no fresh pages)."""
        if len(tensors) == 1 and tensors[0].is_contiguous():
            return tensors[0].detach().view(-1), True
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:
            return torch.cat([t.detach().reshape(-1) for t in tensors]), False
        total = sum(t.numel() for t in tensors)
        like = tensors[0]
        key = (like.dtype, like.device)
        buf = self._buckets.get(key)
        if buf is None or buf.numel() < total:
            buf = torch.empty(total, dtype=like.dtype, device=like.device)
            self._buckets[key] = buf
        flat = buf[:total]
        torch.cat([t.detach().reshape(-1) for t in tensors], out=flat)
        return flat, False

    # ----------------------------------------------------------------- pipeline

    def send_activation(self, t: torch.Tensor, to_stage: int) -> None:
        """Send ``t`` to the same (dp, tp) coordinate in ``to_stage`` (host-staged via gloo)."""
        peer = peer_rank(self.plan, self.rank, to_stage)
        with self.stats.timed(self._p2p_tier(peer), t.numel() * t.element_size()):
            send_tensor(t, peer)

    def recv_activation(self, shape: Sequence[int], dtype: torch.dtype,
                        from_stage: int) -> torch.Tensor:
        """Receive a tensor from the same (dp, tp) coordinate in ``from_stage``."""
        peer = peer_rank(self.plan, self.rank, from_stage)
        with self.stats.timed(self._p2p_tier(peer), 0):
            return recv_tensor(shape, dtype, peer, self.device)

    def _p2p_tier(self, peer: int) -> Tier:
        return tier_of((self.me, self.plan.ranks[peer]))
