"""HetCommunicator: every process group of a plan, and the collectives the trainer calls."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from hettrain.planning.plan import Plan
from hettrain.runtime.collectives.bridge import (
    CHUNK_BYTES,
    bridged_all_reduce_,
    compressed_all_reduce_,
)
from hettrain.runtime.collectives.compression import Codec, ErrorFeedback
from hettrain.runtime.collectives.hierarchical import (
    hierarchical_all_reduce_,
    leader_all_reduce_,
)
from hettrain.runtime.collectives.p2p import recv_tensor, send_tensor
from hettrain.runtime.collectives.stats import CommStats, Tier
from hettrain.runtime.collectives.topology import Hierarchy, layout, peer_rank

ALGORITHMS = ("auto", "flat", "hierarchical", "leader")
LEADER_MAX_BYTES = 256 << 10  # below this, latency dominates: fewer hops win (leader-based)
SCOPES = ("global", "dc")


def resolve_backend(requested: str) -> str:
    """The backend usable on this host for a pool that asks for ``requested``; else gloo."""
    if requested == "nccl" and torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    if requested == "hccl" and dist.is_backend_available("hccl"):
        return "hccl"
    return "gloo"


def choose_algorithm(nbytes: int, hier: Hierarchy) -> str:
    """flat for one block or singleton blocks; leader for small messages; else hierarchical."""
    if len(hier.blocks) == 1 or all(len(b) == 1 for b in hier.blocks):
        return "flat"
    if nbytes < LEADER_MAX_BYTES:
        return "leader"
    return "hierarchical"


class _Groups:
    """Memoised ``dist.new_group`` calls; every rank calls in the same order (collective)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[tuple[int, ...], str], object] = {}
        self.me = dist.get_rank()

    def get(self, ranks: Sequence[int], backend: str) -> dist.ProcessGroup | None:
        key = (tuple(ranks), backend)
        if key not in self._cache:
            self._cache[key] = dist.new_group(list(key[0]), backend=backend)
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


class HetCommunicator:
    """All groups of a plan for one rank (see the package docstring for the contract)."""

    def __init__(self, plan: Plan, rank: int, device: torch.device,
                 backend_overrides: Mapping[str, str] | None = None,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
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
        self.pool_backends = {
            p: overrides.get(p, overrides.get("*", resolve_backend(b)))
            for p, b in pool_backend.items()
        }
        pool_of = {r.rank: r.pool for r in plan.ranks}
        dc_of = {r.rank: r.datacenter for r in plan.ranks}

        def backend_of(ranks: Sequence[int]) -> str:
            pools = {pool_of[r] for r in ranks}
            return self.pool_backends.get(pools.pop(), "gloo") if len(pools) == 1 else "gloo"

        def tier_of(ranks: Sequence[int]) -> Tier:
            if len({dc_of[r] for r in ranks}) > 1:
                return Tier.CROSS_DC
            return Tier.INTER_POOL if len({pool_of[r] for r in ranks}) > 1 else Tier.INTRA_POOL

        groups = _Groups()
        lay = layout(plan)
        self.pool_group = None
        for _, ranks in lay.pools:
            g = groups.get(ranks, backend_of(ranks))
            if rank in ranks:
                self.pool_group = g
        key = (self.me.stage, self.me.tp)
        self._levels: dict[str, _Level] = {}
        for k, hier in lay.dp:
            lvl = _Level(hier, groups, backend_of, Tier.INTRA_POOL, tier_of(hier.ranks))
            if k == key:
                self._levels["global"] = lvl
        for k, hier in lay.dp_dc:
            lvl = _Level(hier, groups, backend_of, Tier.INTRA_POOL, tier_of(hier.ranks))
            if k == (*key, self.me.datacenter):
                self._levels["dc"] = lvl
        for k, hier in lay.dp_cross_dc:
            intra_t = max((tier_of(b) for b in hier.blocks), key=lambda t: list(Tier).index(t))
            lvl = _Level(hier, groups, backend_of, intra_t, tier_of(hier.ranks))
            if k == key:
                self._levels["cross_dc"] = lvl
        self.tp_group = None
        for k, ranks in lay.tp:
            g = groups.get(ranks, backend_of(ranks))
            if k == (self.me.stage, self.me.dp):
                self.tp_group = g
        self.dp_group = self._levels["global"].full
        self.dp_size = len(self._levels["global"].hier.ranks)

    @classmethod
    def from_plan(cls, plan: Plan, rank: int, device: torch.device | None = None,
                  backend_overrides: Mapping[str, str] | None = None,
                  chunk_bytes: int = CHUNK_BYTES) -> HetCommunicator:
        """Build every group of ``plan`` (collective: all ranks must call it)."""
        return cls(plan, rank, device or torch.device("cpu"), backend_overrides, chunk_bytes)

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

    def cross_dc_all_reduce_(self, tensors: list[torch.Tensor], average: bool = True,
                             compress: bool = False) -> str:
        """Sum/average over the stage DP group, arranged by datacenter (DiLoCo outer step)."""
        return self._all_reduce(tensors, self._levels["cross_dc"], average, compress=compress)

    def _all_reduce(self, tensors, lvl: _Level, average: bool, compress: bool) -> str:
        if not tensors:
            return "none"
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        hier = lvl.hier
        algo = self.algorithm
        if algo not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algo!r}")
        if algo == "auto" or len(hier.blocks) == 1:
            algo = choose_algorithm(flat.numel() * flat.element_size(), hier)
        use_codec = compress and hier.spans_dcs and self.codec.kind != "none"
        key = ("dp", id(lvl), len(tensors), flat.numel())

        def inter(buf: torch.Tensor, group) -> None:
            g = dist.get_world_size(group)
            if use_codec and flat.dtype == torch.float32:
                with self.stats.timed(lvl.inter_tier, 0):
                    sent = compressed_all_reduce_(buf, group, self.codec, self.feedback,
                                                  (key, buf.numel()), self.chunk_bytes)
                self.stats[lvl.inter_tier].bytes += sent * (g - 1)
            else:
                nbytes = int(2 * (g - 1) / g * buf.numel() * buf.element_size())
                with self.stats.timed(lvl.inter_tier, nbytes):
                    bridged_all_reduce_(buf, group, self.chunk_bytes)

        nb = flat.numel() * flat.element_size()
        n_intra = len(lvl.block)
        if algo == "flat":
            if len(hier.blocks) == 1:
                with self.stats.timed(lvl.intra_tier, int(2 * (n_intra - 1) / n_intra * nb)):
                    dist.all_reduce(flat, group=lvl.full)
            else:
                inter(flat, lvl.full)
        elif algo == "leader":
            with self.stats.timed(lvl.intra_tier, 2 * nb if n_intra > 1 else 0):
                leader_all_reduce_(flat, lvl.intra, lvl.leaders, leader=lvl.block[0],
                                   inter_op=self._untimed(inter, lvl))
        else:
            with self.stats.timed(lvl.intra_tier, int(2 * (n_intra - 1) / n_intra * nb)):
                hierarchical_all_reduce_(flat, lvl.intra, lvl.inter, intra_ranks=lvl.block,
                                         shards=None if hier.uniform else hier.shards,
                                         inter_op=self._untimed(inter, lvl))
        if average:
            flat /= len(hier.ranks)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset: offset + n].view_as(t))
            offset += n
        return algo

    def _untimed(self, inter, lvl: _Level):
        """Inter op whose seconds are moved out of the enclosing intra timer."""
        def op(buf, group):
            before = self.stats[lvl.inter_tier].seconds
            inter(buf, group)
            self.stats[lvl.intra_tier].seconds -= self.stats[lvl.inter_tier].seconds - before
        return op

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
        other = self.plan.ranks[peer]
        if other.datacenter != self.me.datacenter:
            return Tier.CROSS_DC
        return Tier.INTER_POOL if other.pool != self.me.pool else Tier.INTRA_POOL
