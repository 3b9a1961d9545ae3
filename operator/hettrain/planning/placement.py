"""Rank → node placement: TP groups inside a node, a stage's replicas in its unit, ranks on a node
consecutive. With a previous plan, surviving nodes keep their stage where possible (fewer moves).
"""

from __future__ import annotations

from collections.abc import Sequence

from hettrain.planning.plan import Plan, RankPlan
from hettrain.planning.units import Unit

_INDEX: list = []  # [(plan, node -> (stage, rank), (node, gpu) -> stage)] for the last plan


def _index(previous: Plan) -> tuple[dict[str, tuple[int, int]], dict[tuple[str, int], int]]:
    """Per-node first (stage, rank) and per-GPU stage of ``previous``; a re-plan compares many
    placements against one previous plan, so the last one is kept."""
    if _INDEX and _INDEX[0][0] is previous:
        return _INDEX[0][1], _INDEX[0][2]
    first: dict[str, tuple[int, int]] = {}
    for r in previous.ranks:
        first.setdefault(r.node, (r.stage, r.rank))
    stage = {(r.node, r.local_rank): r.stage for r in previous.ranks}
    _INDEX[:] = [(previous, first, stage)]
    return first, stage


def _unit_nodes(unit: Unit, previous: Plan | None) -> list[tuple[str, str, str]]:
    """(node, pool, datacenter) of a unit, previous-plan stage order first, then by name."""
    prev_stage = _index(previous)[0] if previous is not None else {}
    nodes = [(n, p.name, p.datacenter) for p in unit.pools for n in p.nodes]
    return sorted(nodes, key=lambda x: (prev_stage.get(x[0], (1 << 30, 0)), x[2], x[1], x[0]))


def place_ranks(stage_units: Sequence[Unit], stage_tp: Sequence[int], dp: int,
                previous: Plan | None = None) -> tuple[RankPlan, ...]:
    """Assign every (stage, dp, tp) coordinate to a GPU; returns ranks numbered node by node."""
    # coordinate -> (node, pool, dc, local_rank)
    slots: dict[tuple[int, int, int], tuple[str, str, str, int]] = {}
    cursors: dict[str, tuple[list[tuple[str, str, str]], int, int]] = {}
    node_order: list[str] = []
    for s, (unit, tp) in enumerate(zip(stage_units, stage_tp, strict=True)):
        nodes, node_i, gpu_i = cursors.get(unit.key) or (_unit_nodes(unit, previous), 0, 0)
        for d in range(dp):
            if gpu_i + tp > unit.gpus_per_node:
                node_i, gpu_i = node_i + 1, 0
            node, pool, dc = nodes[node_i]
            if gpu_i == 0:
                node_order.append(node)
            for t in range(tp):
                slots[(s, d, t)] = (node, pool, dc, gpu_i + t)
            gpu_i += tp
        cursors[unit.key] = (nodes, node_i, gpu_i)
    by_node: dict[str, list[tuple[int, tuple[int, int, int], str, str]]] = {}
    for coord, (node, pool, dc, local) in slots.items():
        by_node.setdefault(node, []).append((local, coord, pool, dc))
    ranks = []
    rank = 0
    for node in node_order:
        for local, (s, d, t), pool, dc in sorted(by_node[node]):
            ranks.append(RankPlan(rank, node, pool, dc, local, s, d, t))
            rank += 1
    return tuple(ranks)


def moved_ranks(previous: Plan, ranks: Sequence[RankPlan]) -> int:
    """Ranks whose GPU now serves a different stage than before (or is new)."""
    before = _index(previous)[1]
    return sum(1 for r in ranks if before.get((r.node, r.local_rank)) != r.stage)
