"""Placement keeps every pipeline hop the planner prices inside a datacenter inside one.

A unit of the ``merged`` grouping spans datacenters. The planner prices a hop between two stages
whose units share a datacenter as an intra-datacenter transfer, and a merged unit's DP sync as
``dp/k`` replicas in each of its ``k`` datacenters. ``placement.replica_datacenters`` gives each
replica one datacenter per run of such hops; these tests check it against brute force (every
assignment of sequence groups to datacenters, placed by the plain node-filling loop), check
that ``place_ranks`` follows it, and that plans never put a hop priced inside a datacenter
across a link (it used to: a merged unit filled stage by stage in datacenter order split a
stage over the link).
"""

from __future__ import annotations

import itertools
import random

import pytest

from hettrain.api.spec import parse_job_spec
from hettrain.planning.inventory import load_cluster
from hettrain.planning.placement import (
    _advance,
    pipeline_runs,
    place_ranks,
    replica_datacenters,
)
from hettrain.planning.planner import plan_job
from hettrain.planning.units import build_units


def _loop_advance(cursor: tuple[int, int], n: int, tp: int, gpn: int) -> tuple[int, int]:
    """``place_ranks``' node-filling loop, one TP group at a time."""
    node, gpu = cursor
    for _ in range(n):
        if gpu + tp > gpn:
            node, gpu = node + 1, 0
        gpu += tp
    return node, gpu


def test_closed_form_cursor_matches_the_filling_loop() -> None:
    for gpn in (1, 2, 4, 8):
        for tp in (t for t in (1, 2, 4, 8) if t <= gpn):
            for start_gpu in range(0, gpn + 1, tp):
                for n in range(0, 40):
                    assert _advance((3, start_gpu), n, tp, gpn) == _loop_advance(
                        (3, start_gpu), n, tp, gpn), (gpn, tp, start_gpu, n)


def _cluster(pools: list[dict]) -> dict:
    dcs = sorted({p["datacenter"] for p in pools})
    links = [{"between": [a, b], "bandwidthGbps": 100, "latencyMs": 20}
             for i, a in enumerate(dcs) for b in dcs[i + 1:]]
    return {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "r"},
            "datacenters": [{"name": d} for d in dcs], "links": links, "pools": pools}


def _random_layout(rng: random.Random):
    """Merged units of 1-3 devices over 2-3 datacenters, and a block-ordered layout on them
    (each unit's stages contiguous, one TP per unit: the planner's layouts)."""
    dcs = ["a", "b", "c"][:rng.randint(2, 3)]
    pools = []
    for d, dev in enumerate(rng.sample(["H100-SXM", "MI300X", "A100-80GB"], rng.randint(1, 3))):
        gpn = rng.choice([2, 4, 8])
        for dc in rng.sample(dcs, rng.randint(1, len(dcs))):
            pools.append({"name": f"p{d}{dc}", "datacenter": dc, "device": dev,
                          "nodes": rng.randint(1, 6), "gpusPerNode": gpn, "nicGbps": 400})
    inv = load_cluster(_cluster(pools))
    units = list(build_units(inv.pools, merged=True))
    rng.shuffle(units)
    stage_units, tps = [], []
    for u in units[:rng.randint(1, len(units))]:
        tp = rng.choice([t for t in (1, 2, 4) if t <= u.gpus_per_node])
        for _ in range(rng.randint(1, 3)):
            stage_units.append(u)
            tps.append(tp)
    cp = rng.choice([1, 1, 2])
    dp = cp * rng.randint(1, 6)
    return stage_units, tps, dp, cp


def _fits(stage_units, tps, dp, cp, where) -> bool:
    """Whether a per-stage replica→datacenter assignment fits the nodes, placed by the
    filling loop (a unit's nodes in one datacenter serve its stages in pipeline order)."""
    cursors: dict = {}
    for s, (u, tp) in enumerate(zip(stage_units, tps, strict=True)):
        for d in range(dp):
            key = (u.key, where[s][d])
            cursors[key] = _loop_advance(cursors.get(key, (0, 0)), 1, tp, u.gpus_per_node)
            node, gpu = cursors[key]
            held = sum(len(p.nodes) for p in u.pools if p.datacenter == where[s][d])
            if node + (1 if gpu else 0) > held:
                return False
    return True


def _brute_force_feasible(stage_units, tps, dp, cp) -> bool:
    """Any assignment of sequence groups to datacenters, per run, that the planner's prices
    hold for (each run's units span the same datacenters, every one of them holds the same
    number of groups) and that fits."""
    runs = pipeline_runs(stage_units)
    options = []
    for run in runs:
        spans = {stage_units[s].datacenters for s in run}
        if len(spans) > 1:
            return False
        (dcs,) = spans
        options.append([pick for pick in itertools.combinations_with_replacement(dcs, dp // cp)
                        if len({pick.count(dc) for dc in dcs}) == 1])
    for pick in itertools.product(*options):
        where = [()] * len(stage_units)
        for run, groups in zip(runs, pick, strict=True):
            for s in run:
                where[s] = tuple(dc for dc in groups for _ in range(cp))
        if _fits(stage_units, tps, dp, cp, where):
            return True
    return False


@pytest.mark.parametrize("seed", range(120))
def test_replica_datacenters_vs_brute_force(seed: int) -> None:
    stage_units, tps, dp, cp = _random_layout(random.Random(seed))
    got = replica_datacenters(stage_units, tps, dp, cp)
    assert (got is not None) == _brute_force_feasible(stage_units, tps, dp, cp)
    if got is None:
        return
    assert _fits(stage_units, tps, dp, cp, got)
    for run in pipeline_runs(stage_units):
        dcs = stage_units[run[0]].datacenters
        for s in run:
            assert got[s] == got[run[0]] and set(got[s]) == set(dcs)
        assert len({got[run[0]].count(dc) for dc in dcs}) == 1  # the priced dp/k in each
        # each sequence's cp replicas in one datacenter
        assert all(len(set(got[run[0]][g:g + cp])) == 1 for g in range(0, dp, cp))
    # placed: every GPU once, each replica where replica_datacenters put it
    ranks = place_ranks(stage_units, tps, dp, cp=cp)
    assert len({(r.node, r.local_rank) for r in ranks}) == len(ranks) == dp * sum(tps)
    for r in ranks:
        assert r.datacenter == got[r.stage][r.dp]


def test_replicas_split_equally_over_the_datacenters() -> None:
    """One merged unit of tp-8 TP groups, four nodes in a and two in b: one stage's four
    replicas split 2/2 (the planner's dp/k); two stages hold two replicas (one in each), not
    three (no equal split) nor four (b holds one replica of both stages); next to a unit of
    one datacenter the run cannot split (its hop would cross or its DP sync not as priced)."""
    inv = load_cluster(_cluster([
        {"name": "ha", "datacenter": "a", "device": "H100-SXM", "nodes": 4, "gpusPerNode": 8,
         "nicGbps": 400},
        {"name": "hb", "datacenter": "b", "device": "H100-SXM", "nodes": 2, "gpusPerNode": 8,
         "nicGbps": 400},
        {"name": "ma", "datacenter": "a", "device": "MI300X", "nodes": 2, "gpusPerNode": 8,
         "nicGbps": 400}]))
    h100, mi300 = sorted(build_units(inv.pools, merged=True), key=lambda u: u.key)
    assert h100.datacenters == ("a", "b") and mi300.datacenters == ("a",)
    assert replica_datacenters([h100], [8], 4) == (("a", "a", "b", "b"),)
    assert replica_datacenters([h100, h100], [8, 8], 2) == (("a", "b"),) * 2
    assert replica_datacenters([h100, h100], [8, 8], 3) is None
    assert replica_datacenters([h100, h100], [8, 8], 4) is None
    assert replica_datacenters([h100], [8], 4, cp=2) == (("a", "a", "b", "b"),)
    assert replica_datacenters([h100, mi300], [8, 8], 2) is None
    # the stage-by-stage fill put stage 0's two replicas on a's first nodes and stage 1's
    # on a's last nodes: now each stage has one replica in each datacenter
    ranks = place_ranks([h100, h100], [8, 8], 2)
    for d in range(2):
        assert len({r.datacenter for r in ranks if r.dp == d}) == 1
    assert {r.datacenter for r in ranks if r.stage == 0} == {"a", "b"}


def _random_cluster(rng: random.Random) -> dict:
    pools = []
    for i in range(rng.randint(2, 4)):
        pools.append({"name": f"p{i}", "datacenter": rng.choice("ab"),
                      "device": rng.choice(["H100-SXM", "A100-80GB"]),
                      "nodes": rng.randint(1, 5), "gpusPerNode": rng.choice([2, 4]),
                      "nicGbps": 400})
    return _cluster(pools)


@pytest.mark.parametrize("seed", range(40))
def test_plans_keep_intra_datacenter_hops_inside_one(seed: int) -> None:
    """Random two-datacenter clusters where one device sits in both (a merged unit): every
    hop of the plan whose stages' units share a datacenter (priced inside one) is, for every
    replica, inside one once placed; and the fast search still finds the exhaustive optimum
    with the layouts it cannot place so removed."""
    rng = random.Random(seed)
    inv = load_cluster(_random_cluster(rng))
    spec = parse_job_spec({
        "model": {"layers": rng.randint(4, 8), "hidden": 4096, "heads": 32, "seqLen": 2048,
                  "vocab": 32000},
        "training": {"globalBatch": rng.choice([8, 16, 32]), "steps": 1},
        "crossDC": {"mode": "sync"}})
    plan = plan_job("j", spec, inv)
    units = build_units(inv.pools, merged=plan.cross_dc.get("grouping") == "merged")
    unit = [next(u for u in units if s.pools[0] in {p.name for p in u.pools})
            for s in plan.stages]
    where: dict[tuple[int, int], set[str]] = {}
    for r in plan.ranks:
        where.setdefault((r.stage, r.dp), set()).add(r.datacenter)
    for s in range(plan.pp - 1):
        priced_inside = set(unit[s].datacenters) & set(unit[s + 1].datacenters)
        for d in range(plan.dp):
            assert len(where[(s, d)]) == 1
            if priced_inside:
                assert where[(s, d)] == where[(s + 1, d)], (s, d, plan.stages)
    if inv.gpus <= 12:
        full = plan_job("j", spec, inv, exhaustive=True)
        assert full.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s,
                                                           rel=1e-9)


@pytest.mark.parametrize("seed", range(60))
def test_stage_slots_is_the_most_stages_the_placement_holds(seed: int) -> None:
    """``Unit.stage_slots`` (the search's stage-count limit) is the largest ``k`` for which
    ``replica_datacenters`` places ``k`` stages of the unit (0 when none)."""
    rng = random.Random(seed)
    pools = [{"name": f"h{dc}", "datacenter": dc, "device": "H100-SXM",
              "nodes": rng.randint(1, 4), "gpusPerNode": 8, "nicGbps": 400}
             for dc in rng.sample("abc", rng.randint(1, 3))]
    (unit,) = build_units(load_cluster(_cluster(pools)).pools, merged=True)
    tp, cp = rng.choice([1, 2, 4, 8]), rng.choice([1, 2])
    dp = cp * rng.randint(1, 8)
    most = 0
    while replica_datacenters([unit] * (most + 1), [tp] * (most + 1), dp, cp) is not None:
        most += 1
    assert unit.stage_slots(tp, dp, cp) == most
