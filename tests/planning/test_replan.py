"""Re-planning after node loss: global batch kept, fewest moved ranks (vs brute force),
unchanged plans when the loss does not matter, and byte-identical output for identical input."""

from __future__ import annotations

import random

import pytest

from hettrain.api.spec import parse_job_spec
from hettrain.planning import planner as P
from hettrain.planning.inventory import load_cluster
from hettrain.planning.placement import moved_at_least, moved_ranks, place_ranks
from hettrain.planning.planner import plan_job, step_time_for_split
from hettrain.planning.units import build_units, filter_pools, spans_datacenters


def _cluster(pools: list[dict]) -> dict:
    dcs = sorted({p["datacenter"] for p in pools})
    links = [{"between": [a, b], "bandwidthGbps": 100, "latencyMs": 10}
             for i, a in enumerate(dcs) for b in dcs[i + 1:]]
    return {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "r"},
            "datacenters": [{"name": d} for d in dcs], "links": links, "pools": pools}


def _pool(name: str, dc: str, device: str, nodes: int, gpn: int) -> dict:
    return {"name": name, "datacenter": dc, "device": device, "nodes": nodes, "gpusPerNode": gpn,
            "nicGbps": 400}


CASES = {
    "two-vendors-one-dc": [_pool("h100", "a", "H100-SXM", 2, 2), _pool("mi", "a", "MI300X", 2, 2)],
    "three-pools-two-dcs": [_pool("h100", "a", "H100-SXM", 2, 2),
                            _pool("a100", "a", "A100-80GB", 2, 1),
                            _pool("g3", "b", "Gaudi3", 2, 2)],
    "one-device-two-dcs": [_pool("ha", "a", "H100-SXM", 2, 2), _pool("hb", "b", "H100-SXM", 2, 2)],
}


def _spec(gb: int = 8, hidden: int = 4096, layers: int = 4) -> object:
    return parse_job_spec({"model": {"layers": layers, "hidden": hidden, "heads": 32,
                                     "seqLen": 2048, "vocab": 32000},
                           "training": {"globalBatch": gb, "steps": 1}})


def _near_layouts(spec, inv) -> list:
    """The exhaustive search's layouts near the best (within the re-plan tolerance of the
    incumbent as found), over the groupings ``plan_job`` searches."""
    pools = filter_pools(inv, spec.placement)
    groupings = [("split", build_units(pools, merged=False))]
    if spans_datacenters(pools):
        groupings.append(("merged", build_units(pools, merged=True)))
    near = []
    for grouping, units in groupings:
        search = P._Search(spec, True, P.REPLAN_TOLERANCE)
        P._search_exhaustive(search, units, inv, grouping)
        near.extend(search.near)
    return near


def _brute_force_min_moved(spec, inv, previous) -> tuple[int, float]:
    """Every layout within the re-plan tolerance (exhaustive search), each placed: min moves."""
    near = _near_layouts(spec, inv)
    best = min(c.step_time_s for c in near)
    within = [c for c in near if c.step_time_s <= best * P.REPLAN_TOLERANCE]
    return min(moved_ranks(previous, place_ranks(c.units, c.tps, c.dp, previous))
               for c in within), best


@pytest.mark.parametrize("case", sorted(CASES))
def test_replan_moves_fewest_ranks_vs_brute_force(case: str) -> None:
    inv = load_cluster(_cluster(CASES[case]))
    spec = _spec()
    first = plan_job("j", spec, inv)
    failed = first.ranks[-1].node
    smaller = inv.without_nodes([failed])
    second = plan_job("j", spec, smaller, previous=first)
    assert failed not in {r.node for r in second.ranks}
    assert second.global_batch == first.global_batch == 8  # grad accumulation absorbs dp
    assert second.dp * second.micro_batch * second.num_microbatches == 8
    want_moves, best = _brute_force_min_moved(spec, smaller, first)
    assert moved_ranks(first, second.ranks) == want_moves
    assert second.predicted.step_time_s <= best * P.REPLAN_TOLERANCE * (1 + 1e-12)
    assert f"re-plan: {want_moves} of {second.world_size} ranks" in second.notes[-1]


def _random_case(seed: int) -> tuple[list[dict], object, int]:
    rng = random.Random(seed)
    devices = ["H100-SXM", "MI300X", "A100-80GB", "Gaudi3"]
    pools = [_pool(f"p{i}", rng.choice("ab"), rng.choice(devices), rng.randint(1, 3),
                   rng.choice([1, 2])) for i in range(rng.randint(2, 3))]
    spec = _spec(gb=rng.choice([4, 8, 12]), hidden=rng.choice([2048, 4096, 8192]),
                 layers=rng.randint(3, 6))
    return pools, spec, rng.randrange(1 << 16)


# seeds where the fastest plan on the survivors would move more ranks than a near-best one
# found for the time model (seeds 0-88; the optimizer step's time moved the earlier ones, the
# hierarchical DP all-reduce across nodes seed 16: 2, 9, 25, 31, 42, 58, 70 also qualify now)
@pytest.mark.parametrize("seed", [9, 38, 56, 69, 88])
def test_replan_prefers_fewer_moves_within_tolerance(seed: int) -> None:
    pools, spec, pick = _random_case(seed)
    inv = load_cluster(_cluster(pools))
    first = plan_job("j", spec, inv)
    smaller = inv.without_nodes([first.ranks[pick % first.world_size].node])
    second = plan_job("j", spec, smaller, previous=first)
    fresh = plan_job("j", spec, smaller)
    want_moves, best = _brute_force_min_moved(spec, smaller, first)
    assert best == pytest.approx(fresh.predicted.step_time_s, rel=1e-9)
    assert moved_ranks(first, second.ranks) == want_moves < moved_ranks(first, fresh.ranks)
    assert second.predicted.step_time_s <= best * P.REPLAN_TOLERANCE * (1 + 1e-12)
    assert second.global_batch == first.global_batch


def test_losing_an_unused_node_keeps_the_plan() -> None:
    # 5 H100 nodes of 2 GPUs and gb = 4: the best plan cannot use all ten GPUs
    inv = load_cluster(_cluster([_pool("h", "a", "H100-SXM", 5, 2)]))
    spec = _spec(gb=4, hidden=2048, layers=4)
    first = plan_job("j", spec, inv)
    unused = [n for n in inv.node_names() if n not in set(first.nodes())]
    assert unused, "the fixture must leave a node idle"
    second = plan_job("j", spec, inv.without_nodes(unused[:1]), previous=first)
    assert moved_ranks(first, second.ranks) == 0
    assert second.stages == first.stages and second.ranks == first.ranks
    assert second.predicted == first.predicted


def test_replan_with_half_the_gpus_keeps_global_batch() -> None:
    inv = load_cluster(_cluster(CASES["two-vendors-one-dc"]))
    spec = _spec(gb=12)
    first = plan_job("j", spec, inv)
    gone = list(first.nodes())[: len(first.nodes()) // 2]
    second = plan_job("j", spec, inv.without_nodes(gone), previous=first)
    assert second.global_batch == 12
    assert not set(gone) & set(second.nodes())


def test_same_input_gives_byte_identical_plan_json() -> None:
    pools = CASES["three-pools-two-dcs"]
    spec = _spec()
    a = plan_job("j", spec, load_cluster(_cluster(pools)))
    b = plan_job("j", spec, load_cluster(_cluster(list(reversed(pools)))))
    assert a.to_json() == b.to_json()
    smaller = load_cluster(_cluster(pools)).without_nodes([a.ranks[0].node])
    r1 = plan_job("j", spec, smaller, previous=a)
    r2 = plan_job("j", spec, smaller, previous=a)
    assert r1.to_json() == r2.to_json()


@pytest.mark.parametrize("case", sorted(CASES))
def test_step_time_for_split_reproduces_the_plan(case: str) -> None:
    inv = load_cluster(_cluster(CASES[case]))
    spec = _spec(layers=6)
    plan = plan_job("j", spec, inv)
    split = [s.layers for s in plan.stages]
    assert step_time_for_split(spec, inv, plan, split) == pytest.approx(
        plan.predicted.step_time_s, rel=1e-12)
    with pytest.raises(ValueError, match="split must have"):
        step_time_for_split(spec, inv, plan, [1] * (plan.pp + 1))


def _without_search_count(plan) -> dict:
    d = plan.to_dict()
    d["notes"] = [n for n in d["notes"] if not n.startswith("searched ")]
    return d


@pytest.mark.parametrize("seed", [2, 9, 25, 38, 56])
def test_replan_searching_the_previous_pair_first_changes_only_the_work(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # the re-plan visits the previous plan's (dp, mb) first so its layout prunes the rest
    # early; which layout wins is Candidate.sort_key's, so the plan must be the one the search
    # in bound order gives (only the "searched N layouts" note may differ)
    pools, spec, pick = _random_case(seed)
    inv = load_cluster(_cluster(pools))
    first = plan_job("j", spec, inv)
    smaller = inv.without_nodes([first.ranks[pick % first.world_size].node])
    assert P._previous_pair(first, first.stages[0].cp) == (first.dp, first.micro_batch)
    ordered = plan_job("j", spec, smaller, previous=first)
    monkeypatch.setattr(P, "_previous_pair", lambda previous, cp: None)
    plain = plan_job("j", spec, smaller, previous=first)
    assert _without_search_count(ordered) == _without_search_count(plain)


@pytest.mark.parametrize("seed", range(0, 40, 4))
def test_moved_at_least_never_exceeds_a_placements_moves(seed: int) -> None:
    # the bound that lets the re-plan skip placing a near layout: for every layout within the
    # tolerance of the best (exhaustive search, the groupings plan_job searches), on the whole
    # cluster and on the survivors of a node loss, at most the moves of its placement
    pools, spec, pick = _random_case(seed)
    inv = load_cluster(_cluster(pools))
    first = plan_job("j", spec, inv)
    smaller = inv.without_nodes([first.ranks[pick % first.world_size].node])
    tight = zero = 0
    for cluster in (inv, smaller):
        for c in _near_layouts(spec, cluster):
            bound = moved_at_least(first, c.units, c.tps, c.dp)
            moved = moved_ranks(first, place_ranks(c.units, c.tps, c.dp, first, c.cp))
            assert 0 <= bound <= moved
            tight += bound == moved
            zero += moved == 0
    assert tight and zero  # not vacuous: some layouts reach it, the first plan's moves none
