"""Pure rank arithmetic: which ranks form which group, derived from a :class:`Plan`.

No torch here, so the layout can be unit-tested (and reasoned about) without processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from hettrain.planning.plan import Plan, RankPlan


@dataclass(frozen=True, slots=True)
class Hierarchy:
    """A group of ranks partitioned into blocks (pools or datacenters), for two-level collectives.

    ``blocks`` are ordered lists of global ranks; ``shards`` is the common shard count
    ``min(len(b) for b in blocks)``: member ``j < shards`` of every block owns shard ``j`` and
    ``inter[j]`` is the group of shard-``j`` owners (one per block). ``inter[0]`` are the leaders.
    """

    ranks: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    block_names: tuple[str, ...]
    spans_dcs: bool

    @property
    def shards(self) -> int:
        """Common shard count across blocks (uneven blocks reduce to the smallest size)."""
        return min(len(b) for b in self.blocks)

    @property
    def uniform(self) -> bool:
        """All blocks have the same size (then reduce-scatter/all-gather primitives apply)."""
        return len({len(b) for b in self.blocks}) == 1

    @property
    def inter(self) -> tuple[tuple[int, ...], ...]:
        """Shard-owner groups: ``inter[j]`` = member ``j`` of every block."""
        return tuple(tuple(b[j] for b in self.blocks) for j in range(self.shards))

    def block_of(self, rank: int) -> int:
        """Index of the block holding ``rank``."""
        for i, b in enumerate(self.blocks):
            if rank in b:
                return i
        raise ValueError(f"rank {rank} is not in hierarchy {self.ranks}")


def _by(ranks: list[RankPlan], key: str) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
    order: dict[str, list[int]] = {}
    for r in sorted(ranks, key=lambda r: r.rank):
        order.setdefault(getattr(r, key), []).append(r.rank)
    return tuple(tuple(v) for v in order.values()), tuple(order)


def hierarchy(ranks: list[RankPlan], level: str = "pool") -> Hierarchy:
    """Partition ``ranks`` by ``level`` (``pool`` or ``datacenter``)."""
    if level not in ("pool", "datacenter"):
        raise ValueError(f"level must be 'pool' or 'datacenter', got {level!r}")
    blocks, names = _by(ranks, level)
    return Hierarchy(
        ranks=tuple(sorted(r.rank for r in ranks)),
        blocks=blocks,
        block_names=names,
        spans_dcs=len({r.datacenter for r in ranks}) > 1,
    )


@dataclass(frozen=True, slots=True)
class Layout:
    """Every group the runtime creates, in the deterministic order all ranks create them."""

    pools: tuple[tuple[str, tuple[int, ...]], ...]  # (pool, ranks)
    dp: tuple[tuple[tuple[int, int], Hierarchy], ...]  # ((stage, tp), DP hierarchy by pool)
    dp_dc: tuple[tuple[tuple[int, int, str], Hierarchy], ...]  # ((stage, tp, dc), by pool)
    dp_cross_dc: tuple[tuple[tuple[int, int], Hierarchy], ...]  # ((stage, tp), by datacenter)
    tp: tuple[tuple[tuple[int, int], tuple[int, ...]], ...]  # ((stage, dp), TP ranks)


def layout(plan: Plan) -> Layout:
    """Compute all group memberships of ``plan``; validates the rank coordinates."""
    ranks = sorted(plan.ranks, key=lambda r: r.rank)
    if [r.rank for r in ranks] != list(range(len(ranks))):
        raise ValueError("plan.ranks: rank numbers must be 0..world_size-1 without gaps")
    coords = {(r.stage, r.dp, r.tp) for r in ranks}
    if len(coords) != len(ranks):
        raise ValueError("plan.ranks: two ranks share one (stage, dp, tp) coordinate")
    pools, _ = _by(ranks, "pool")
    pool_names = tuple(dict.fromkeys(r.pool for r in ranks))
    dp, dp_dc, dp_x, tp = [], [], [], []
    for key in sorted({(r.stage, r.tp) for r in ranks}):
        members = [r for r in ranks if (r.stage, r.tp) == key]
        dp.append((key, hierarchy(members, "pool")))
        for dc in dict.fromkeys(r.datacenter for r in members):
            dp_dc.append(((*key, dc), hierarchy([r for r in members if r.datacenter == dc])))
        dp_x.append((key, hierarchy(members, "datacenter")))
    for key in sorted({(r.stage, r.dp) for r in ranks}):
        tp.append((key, tuple(r.rank for r in ranks if (r.stage, r.dp) == key)))
    return Layout(
        pools=tuple(zip(pool_names, pools, strict=True)),
        dp=tuple(dp), dp_dc=tuple(dp_dc), dp_cross_dc=tuple(dp_x), tp=tuple(tp),
    )


def peer_rank(plan: Plan, rank: int, to_stage: int) -> int:
    """The rank at the same (dp, tp) coordinate in ``to_stage``.

    When stages have different TP degrees, tp index is mapped by ``tp % peer_stage.tp``.
    """
    me = plan.ranks[rank]
    if not 0 <= to_stage < plan.pp:
        raise ValueError(f"to_stage={to_stage} out of range: plan has pp={plan.pp} stages")
    peer_tp = me.tp % plan.stages[to_stage].tp
    for r in plan.ranks:
        if (r.stage, r.dp, r.tp) == (to_stage, me.dp, peer_tp):
            return r.rank
    raise ValueError(f"no rank at (stage={to_stage}, dp={me.dp}, tp={peer_tp}) in the plan")
