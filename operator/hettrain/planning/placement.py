"""Rank → node placement: TP groups inside a node, a stage's replicas in its unit, ranks on a node
consecutive. With a previous plan, surviving nodes keep their stage where possible (fewer moves).

A unit that spans datacenters (the planner's ``merged`` grouping) holds each replica in one of
them: :func:`replica_datacenters` gives every replica one datacenter per *run* of the pipeline
(consecutive stages whose units share a datacenter, the hops the planner prices inside one),
so no hop priced inside a datacenter crosses a link and no context-parallel group is split,
and splits the replicas equally over the datacenters (the planner prices such a unit's DP
sync as ``dp/k`` replicas in each of its ``k``). The planner only offers layouts it can place
so (``planner._placeable``).
"""

from __future__ import annotations

from collections.abc import Sequence

from hettrain.planning.plan import Plan, RankPlan
from hettrain.planning.units import Unit

# [(plan, node -> (stage, rank), (node, gpu) -> stage, node -> {stage: GPUs})] for the last plan
_INDEX: list = []


def _index(previous: Plan) -> tuple[dict[str, tuple[int, int]], dict[tuple[str, int], int],
                                    dict[str, dict[int, int]]]:
    """Per-node first (stage, rank), per-GPU stage and per-node GPUs by stage of ``previous``;
    a re-plan compares many placements against one previous plan, so the last one is kept."""
    if _INDEX and _INDEX[0][0] is previous:
        return _INDEX[0][1:]
    first: dict[str, tuple[int, int]] = {}
    counts: dict[str, dict[int, int]] = {}
    for r in previous.ranks:
        first.setdefault(r.node, (r.stage, r.rank))
        node = counts.setdefault(r.node, {})
        node[r.stage] = node.get(r.stage, 0) + 1
    stage = {(r.node, r.local_rank): r.stage for r in previous.ranks}
    _INDEX[:] = [(previous, first, stage, counts)]
    return first, stage, counts


def _unit_nodes(unit: Unit, previous: Plan | None) -> list[tuple[str, str, str]]:
    """(node, pool, datacenter) of a unit, previous-plan stage order first, then by name."""
    prev_stage = _index(previous)[0] if previous is not None else {}
    nodes = [(n, p.name, p.datacenter) for p in unit.pools for n in p.nodes]
    return sorted(nodes, key=lambda x: (prev_stage.get(x[0], (1 << 30, 0)), x[2], x[1], x[0]))


def pipeline_runs(stage_units: Sequence[Unit]) -> list[list[int]]:
    """Stage indices in runs: a hop between two stages whose units share a datacenter (the
    planner prices it inside one) joins them in one run; every other hop starts a new run."""
    runs: list[list[int]] = []
    for s, unit in enumerate(stage_units):
        if runs and set(stage_units[s - 1].datacenters) & set(unit.datacenters):
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def _advance(cursor: tuple[int, int], n: int, tp: int, gpus_per_node: int) -> tuple[int, int]:
    """The ``(node, gpu)`` cursor after placing ``n`` TP groups of ``tp`` GPUs from ``cursor``,
    a group never split over two nodes (:func:`place_ranks`' loop, in closed form)."""
    node, gpu = cursor
    if n <= 0:
        return cursor
    per = gpus_per_node // tp
    here = (gpus_per_node - gpu) // tp
    if n <= here:
        return node, gpu + n * tp
    full, rem = divmod(n - here, per)
    return (node + full, per * tp) if rem == 0 else (node + full + 1, rem * tp)


def _nodes_used(cursor: tuple[int, int]) -> int:
    return cursor[0] + (1 if cursor[1] else 0)


def replica_datacenters(stage_units: Sequence[Unit], stage_tp: Sequence[int], dp: int,
                        cp: int = 1) -> tuple[tuple[str, ...], ...] | None:
    """Per stage, the datacenter of each of its ``dp`` replicas (``dp`` counts the ``dp·cp``
    replicas; ``cp`` consecutive ones share a sequence and one datacenter), or None when the
    layout cannot be placed as the planner prices it.

    The planner prices a hop between units that share a datacenter as a transfer inside one,
    and a unit spanning ``k`` datacenters' DP sync as ``dp/k`` replicas in each (the runtime's
    two-level all-reduce over equal blocks). So within a run (:func:`pipeline_runs`) every unit
    must span the same datacenters, the run's sequence groups split equally over them, each
    replica in one datacenter on every stage of the run, and each unit's nodes there must hold
    its share (its nodes in one datacenter serve its stages in pipeline order, TP groups
    whole, as :func:`place_ranks` fills them)."""
    if cp < 1 or dp % cp:
        return None
    groups = dp // cp
    cursors: dict[tuple[str, str], tuple[int, int]] = {}
    out: list[tuple[str, ...]] = [()] * len(stage_units)
    for run in pipeline_runs(stage_units):
        dcs = stage_units[run[0]].datacenters
        if any(stage_units[s].datacenters != dcs for s in run) or groups % len(dcs):
            return None
        share = groups // len(dcs) * cp
        for dc in dcs:
            if not _take(stage_units, stage_tp, run, dc, share, cursors):
                return None
        where = tuple(dc for dc in dcs for _ in range(share))
        for s in run:
            out[s] = where
    return tuple(out)


def _take(stage_units: Sequence[Unit], stage_tp: Sequence[int], run: Sequence[int], dc: str,
          replicas: int, cursors: dict[tuple[str, str], tuple[int, int]]) -> bool:
    """Advance the cursors of ``dc`` by ``replicas`` TP groups on each stage of ``run``;
    False when a unit runs out of nodes there."""
    for s in run:
        unit = stage_units[s]
        key = (unit.key, dc)
        cursors[key] = _advance(cursors.get(key, (0, 0)), replicas, stage_tp[s],
                                unit.gpus_per_node)
        if _nodes_used(cursors[key]) > unit.nodes_in(dc):
            return False
    return True


def place_ranks(stage_units: Sequence[Unit], stage_tp: Sequence[int], dp: int,
                previous: Plan | None = None, cp: int = 1) -> tuple[RankPlan, ...]:
    """Assign every (stage, dp, tp) coordinate to a GPU; returns ranks numbered node by node.

    Each replica's datacenter comes from :func:`replica_datacenters` (``dp`` counts the
    ``dp·cp`` replicas); where that finds no room (a layout the planner does not offer), a
    unit's nodes are filled stage by stage in datacenter order instead."""
    where = replica_datacenters(stage_units, stage_tp, dp, cp)
    # coordinate -> (node, pool, dc, local_rank)
    slots: dict[tuple[int, int, int], tuple[str, str, str, int]] = {}
    cursors: dict[tuple[str, str], tuple[list[tuple[str, str, str]], int, int]] = {}
    node_order: list[str] = []
    for s, (unit, tp) in enumerate(zip(stage_units, stage_tp, strict=True)):
        for d in range(dp):
            key = (unit.key, where[s][d] if where is not None else "")
            if key not in cursors:
                nodes = _unit_nodes(unit, previous)
                cursors[key] = ([n for n in nodes if n[2] == key[1]] if key[1] else nodes, 0, 0)
            nodes, node_i, gpu_i = cursors[key]
            if gpu_i + tp > unit.gpus_per_node:
                node_i, gpu_i = node_i + 1, 0
            node, pool, dc = nodes[node_i]
            if gpu_i == 0:
                node_order.append(node)
            for t in range(tp):
                slots[(s, d, t)] = (node, pool, dc, gpu_i + t)
            cursors[key] = (nodes, node_i, gpu_i + tp)
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


def moved_at_least(previous: Plan, stage_units: Sequence[Unit], stage_tp: Sequence[int],
                   dp: int) -> int:
    """A lower bound on :func:`moved_ranks` of any placement of ``dp`` replicas of the stages
    ``stage_units``/``stage_tp`` (``dp`` counts the ``dp·cp`` replicas): stage ``s`` keeps at
    most as many GPUs as its unit's nodes had serving stage ``s`` in ``previous``; every other
    of its ``dp·tp`` GPUs moves (or is new)."""
    per_node = _index(previous)[2]
    moved = 0
    for s, (unit, tp) in enumerate(zip(stage_units, stage_tp, strict=True)):
        had = sum(per_node.get(n, {}).get(s, 0) for p in unit.pools for n in p.nodes)
        moved += max(0, dp * tp - had)
    return moved


def moved_ranks(previous: Plan, ranks: Sequence[RankPlan]) -> int:
    """Ranks whose GPU now serves a different stage than before (or is new)."""
    before = _index(previous)[1]
    return sum(1 for r in ranks if before.get((r.node, r.local_rank)) != r.stage)
