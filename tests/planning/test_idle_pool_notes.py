"""planning/idle_pools.py: every pool a plan leaves wholly idle gets a note saying why, and
each reason is checked against what it claims."""

from __future__ import annotations

import re

import pytest

from hettrain.api.spec import JobSpec, parse_job_spec
from hettrain.planning import cost
from hettrain.planning.catalog import CATALOG
from hettrain.planning.inventory import ClusterInventory, load_cluster
from hettrain.planning.plan import Plan
from hettrain.planning.planner import plan_job

SMALL = {"preset": "llama3-8b", "seqLen": 4096, "layers": 8}


def _cluster(pools: list[tuple[str, str, str, int, int]],
             links: tuple[tuple[str, str, float, float], ...] = ()) -> ClusterInventory:
    """Pools as (name, datacenter, device, nodes, GPUs per node); links (a, b, Gb/s, ms)."""
    return load_cluster({
        "apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "t"},
        "datacenters": [{"name": d} for d in sorted({p[1] for p in pools})],
        "links": [{"between": [a, b], "bandwidthGbps": bw, "latencyMs": ms}
                  for a, b, bw, ms in links],
        "pools": [{"name": n, "datacenter": dc, "device": dev, "nodes": nodes,
                   "gpusPerNode": gpn, "nicGbps": 400} for n, dc, dev, nodes, gpn in pools]})


def _job(model: dict, gb: int = 32, **extra: dict) -> JobSpec:
    return parse_job_spec({"model": model, "training": {"globalBatch": gb, "steps": 1,
                                                        "recompute": "selective"}, **extra})


def _idle_notes(plan: Plan) -> dict[str, str]:
    """pool -> the reason of its ``pool NAME idle: WHY`` note."""
    out = {}
    for note in plan.notes:
        m = re.fullmatch(r"pool (\S+) idle: (.+)", note)
        if m:
            out[m[1]] = m[2]
    return out


def _used(plan: Plan) -> set[str]:
    return {r.pool for r in plan.ranks}


def test_a_pool_behind_a_slow_link_is_idle_because_its_link_is_the_slowest_step():
    inv = _cluster([("near", "a", "H100-SXM", 2, 8), ("far", "b", "A100-80GB", 1, 8)],
                   (("a", "b", 1, 60),))
    spec = _job(SMALL, gb=8)
    plan = plan_job("j", spec, inv)
    assert _used(plan) == {"near"}
    why = _idle_notes(plan)["far"]
    # (the link named in the direction the trial layout's pipeline crosses it)
    assert re.match(r"its 1 Gb/s link (b-a|a-b) is the slowest step", why), why
    # the numbers it quotes: a link transfer slower than the slowest stage, and a slower step
    # than the plan's
    link, stage = map(float, re.search(r"step \(([\d.]+) vs ([\d.]+) ms\)", why).groups())
    assert link > stage
    with_it, plan_s = map(float, re.search(r"([\d.]+)s vs ([\d.]+)s per step with it",
                                           why).groups())
    assert plan_s == pytest.approx(plan.predicted.step_time_s, abs=5e-4)
    assert with_it > plan_s
    # and it is true: the exhaustive search (every layout, those using "far" included) finds
    # nothing faster than the plan
    best = plan_job("j", spec, inv, exhaustive=True)
    assert best.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-12)
    assert "far" not in _used(best)


def test_a_pool_whose_memory_cannot_hold_one_layer_says_so():
    big_layer = {"layers": 4, "hidden": 16384, "heads": 128, "seqLen": 2048, "vocab": 32000,
                 "ffnHidden": 131072}
    inv = _cluster([("big", "a", "MI300X", 2, 8), ("tiny", "a", "L40S", 4, 1)])
    spec = _job(big_layer, gb=16)
    plan = plan_job("j", spec, inv)
    assert _used(plan) == {"big"}
    why = _idle_notes(plan)["tiny"]
    assert why.startswith("the model does not fit: a one-layer stage needs >=")
    need = float(re.search(r"needs >= ([\d.]+) GiB per L40S", why)[1])
    usable = CATALOG["L40S"].hbm_gib * cost.MEMORY_HEADROOM
    assert need > usable and f"{usable:.1f} GiB usable" in why
    # the claim holds: the job on the L40S pool alone has no plan
    with pytest.raises(Exception, match="does not fit"):
        plan_job("j", spec, _cluster([("tiny", "a", "L40S", 4, 1)]))


def test_pools_outside_the_placement_or_over_max_gpus_say_so():
    inv = _cluster([("near", "a", "H100-SXM", 1, 8), ("other", "a", "A100-80GB", 1, 8)])
    plan = plan_job("j", _job(SMALL, placement={"pools": ["near"]}), inv)
    assert _idle_notes(plan) == {"other": "excluded by spec.placement"}
    plan = plan_job("j", _job(SMALL, placement={"maxGPUs": 8}), inv)
    assert _used(plan) == {"near"} and plan.world_size == 8
    assert _idle_notes(plan)["other"].startswith("spec.placement.maxGPUs=8: the plan uses 8 GPUs")


def test_no_idle_pool_no_idle_note():
    inv = _cluster([("near", "a", "H100-SXM", 1, 8), ("other", "a", "A100-80GB", 1, 8)])
    plan = plan_job("j", _job(SMALL), inv)
    assert _used(plan) == {"near", "other"}
    assert not any(" idle: " in n for n in plan.notes)
    assert _idle_notes(plan) == {}


def test_a_faster_layout_with_an_idle_group_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast search's large-instance heuristics (fixed stage order past 4 device groups,
    the stage-count window) leave out the layout with one more MI250X stage on this generated
    cluster (bench/plan_quality.py c25, llama3-8b; c26's Gaudi2 stage until the DP all-reduce
    across nodes became hierarchical); the check after the search finds it by
    exact evaluation and the plan takes it: faster than the same search without that check,
    its predicted step the exact price of its layout, and a note saying what was added."""
    import sys
    from pathlib import Path

    from hettrain.planning import idle_pools
    from hettrain.planning.planner import step_time_for_split

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import plan_quality as pq

    doc = next(d for d in pq.clusters(40) if d["metadata"]["name"] == "c25")
    inv, spec = load_cluster(doc), pq.job("llama3-8b")
    plan = plan_job("j", spec, inv)
    added = [n for n in plan.notes if "added after the search" in n]
    assert len(added) == 1 and "large-instance heuristics" in added[0], plan.notes
    split = [s.layer_end - s.layer_start for s in plan.stages]
    assert step_time_for_split(spec, inv, plan, split) == pytest.approx(
        plan.predicted.step_time_s, rel=1e-9)
    with monkeypatch.context() as m:
        m.setattr(idle_pools, "with_idle_groups", lambda c, s, i: (c, [], {}))
        searched = plan_job("j", spec, inv)
    assert plan.predicted.step_time_s < searched.predicted.step_time_s
    assert not any("added after the search" in n for n in searched.notes)
    # the added stage is an MI250X group's (dc2), which the searched plan left idle
    assert ([s.device for s in plan.stages].count("MI250X")
            == [s.device for s in searched.stages].count("MI250X") + 1)
    assert len(plan.stages) == len(searched.stages) + 1
