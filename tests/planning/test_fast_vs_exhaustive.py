"""Property: on small random clusters and jobs the fast search finds the exhaustive optimum.

``plan_job(..., exhaustive=True)`` enumerates every dp, tp, stage count, stage order, microbatch,
schedule and layer composition (brute force). The fast search prunes with bounds and dominance
only, so the step times must agree to 1e-9 — or both must refuse the job.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hettrain.api.spec import parse_job_spec
from hettrain.planning.errors import PlanningError
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import plan_job

DEVICES = ["H100-SXM", "MI300X", "A100-80GB", "Gaudi3", "L40S", "Ascend-910B"]


@st.composite
def instances(draw: st.DrawFn) -> tuple[dict, dict]:
    """A cluster of 1-4 pools over 1-3 DCs and a job small enough to enumerate."""
    n_pools = draw(st.integers(1, 4))
    pools = []
    for i in range(n_pools):
        pools.append({
            "name": f"p{i}", "datacenter": draw(st.sampled_from(["a", "b", "c"])),
            "device": draw(st.sampled_from(DEVICES)),
            "nodes": draw(st.integers(1, 2 if n_pools < 4 else 1)),
            "gpusPerNode": draw(st.sampled_from([1, 2, 4] if n_pools < 4 else [1, 2])),
            "nicGbps": draw(st.sampled_from([100, 400, 1600])),
        })
    dcs = sorted({p["datacenter"] for p in pools})
    links = [{"between": [x, y], "bandwidthGbps": draw(st.sampled_from([10, 100, 400])),
              "latencyMs": draw(st.sampled_from([1, 20]))}
             for i, x in enumerate(dcs) for y in dcs[i + 1:]]
    cluster = {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
               "metadata": {"name": "h"}, "datacenters": [{"name": d} for d in dcs],
               "links": links, "pools": pools}
    hidden = draw(st.sampled_from([1024, 4096, 12288]))
    training = {"globalBatch": draw(st.sampled_from([2, 4, 6, 8, 12])), "steps": 1,
                "optimizerSharding": draw(st.booleans()),
                "recompute": draw(st.sampled_from(["none", "selective", "attention-free", "full",
                                                   "auto"]))}
    job = {"model": {"layers": draw(st.integers(2, 6)), "hidden": hidden, "heads": 16,
                     "seqLen": draw(st.sampled_from([1024, 4096])), "vocab": 32000},
           "training": training}
    schedule = draw(st.sampled_from(["auto", "auto", "1f1b", "interleaved", "zb-h1",
                                     "interleaved-zb", "helix"]))
    if schedule != "auto":
        job["parallelism"] = {"schedule": schedule}
    cp = draw(st.sampled_from([None, None, 1, 2, 4]))  # pinned context parallelism
    if cp is not None and not (schedule == "helix" and cp > 1):  # helix runs without CP
        job.setdefault("parallelism", {})["cp"] = cp
    return cluster, job


def _step_or_error(spec, inv, exhaustive: bool) -> float | str:
    try:
        return plan_job("j", spec, inv, exhaustive=exhaustive).predicted.step_time_s
    except PlanningError as exc:
        return exc.reason


def _assert_fast_equals_exhaustive(instance: tuple[dict, dict]) -> None:
    """The pruned search finds the exhaustive search's step time, or the same refusal."""
    cluster, job = instance
    assert_fast_equals_exhaustive_on(parse_job_spec(job), load_cluster(cluster))


def assert_fast_equals_exhaustive_on(spec, inv) -> None:
    """:func:`_assert_fast_equals_exhaustive` for a parsed spec and inventory (profiled
    inventories of the profile tests)."""
    full = _step_or_error(spec, inv, exhaustive=True)
    fast = _step_or_error(spec, inv, exhaustive=False)
    if isinstance(full, str):
        assert fast == full
    else:
        assert isinstance(fast, float)
        assert fast == pytest.approx(full, rel=1e-9)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(instances())
def test_fast_equals_exhaustive(instance: tuple[dict, dict]) -> None:
    _assert_fast_equals_exhaustive(instance)


@st.composite
def chunked_instances(draw: st.DrawFn) -> tuple[dict, dict]:
    """1-2 pools and 8-12 layers: interleaved with 2-4 chunks per stage is reachable."""
    pools = [{"name": f"p{i}", "datacenter": "a", "device": draw(st.sampled_from(DEVICES)),
              "nodes": draw(st.integers(1, 2)), "gpusPerNode": draw(st.sampled_from([1, 2])),
              "nicGbps": draw(st.sampled_from([100, 1600]))}
             for i in range(draw(st.integers(1, 2)))]
    cluster = {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
               "metadata": {"name": "h"}, "datacenters": [{"name": "a"}], "pools": pools}
    job = {"model": {"layers": draw(st.integers(8, 12)), "hidden": draw(st.sampled_from(
               [1024, 4096])), "heads": 16, "seqLen": 2048, "vocab": 32000},
           "training": {"globalBatch": draw(st.sampled_from([4, 8])), "steps": 1,
                        "recompute": draw(st.sampled_from(["selective", "attention-free",
                                                           "full"]))},
           "parallelism": {"schedule": draw(st.sampled_from(["auto", "interleaved"]))}}
    return cluster, job


@settings(max_examples=20, deadline=None, derandomize=True)
@given(chunked_instances())
def test_fast_equals_exhaustive_with_chunk_counts(instance: tuple[dict, dict]) -> None:
    """The searched interleaved chunk count (2..4 when interleaved is pinned; under auto
    2..3, all dominated by ZB-H1)."""
    _assert_fast_equals_exhaustive(instance)


def _four_pool_instance(seed: int) -> tuple[dict, dict]:
    rng = random.Random(seed)
    pools = [{"name": f"p{i}", "datacenter": rng.choice("abc"), "device": rng.choice(DEVICES),
              "nodes": 1, "gpusPerNode": rng.choice([1, 2]), "nicGbps": 400} for i in range(4)]
    dcs = sorted({p["datacenter"] for p in pools})
    links = [{"between": [x, y], "bandwidthGbps": 400, "latencyMs": 5}
             for i, x in enumerate(dcs) for y in dcs[i + 1:]]
    cluster = {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
               "metadata": {"name": "h"}, "datacenters": [{"name": d} for d in dcs],
               "links": links, "pools": pools}
    job = {"model": {"layers": rng.randint(4, 6), "hidden": 12288, "heads": 96, "seqLen": 2048,
                     "vocab": 32000},
           "training": {"globalBatch": rng.choice([2, 4]), "steps": 1}}
    return cluster, job


# seeds (of 60 tried) whose optimum needs all four pools: every stage order is searched
@pytest.mark.parametrize("seed", [8, 11, 33])
def test_four_pools_in_one_pipeline_fast_equals_exhaustive(seed: int) -> None:
    cluster, job = _four_pool_instance(seed)
    inv, spec = load_cluster(cluster), parse_job_spec(job)
    full = plan_job("j", spec, inv, exhaustive=True)
    assert len({p for s in full.stages for p in s.pools}) == 4
    fast = plan_job("j", spec, inv)
    assert fast.predicted.step_time_s == pytest.approx(full.predicted.step_time_s, rel=1e-9)


@st.composite
def stash_bound_instances(draw: st.DrawFn) -> tuple[dict, dict]:
    """Memory-bound jobs under ``schedule: auto`` where ZB-H1's stash of deferred weight-gradient
    inputs (large next to full recompute's checkpoints at long sequences) caps a stage harder
    than interleaving does: there the optimum may be interleaved or 1F1B, not ZB-H1."""
    pools = [{"name": f"p{i}", "datacenter": "a",
              "device": draw(st.sampled_from(["L40S", "A100-80GB", "H100-SXM", "Ascend-910B"])),
              "nodes": draw(st.integers(1, 2)), "gpusPerNode": 1,
              "nicGbps": draw(st.sampled_from([100, 1600]))}
             for i in range(draw(st.integers(1, 2)))]
    cluster = {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
               "metadata": {"name": "h"}, "datacenters": [{"name": "a"}], "pools": pools}
    job = {"model": {"layers": draw(st.integers(8, 16)), "hidden": draw(st.sampled_from(
               [2048, 4096])), "heads": 16, "seqLen": draw(st.sampled_from([8192, 16384, 32768])),
               "vocab": 32000},
           "training": {"globalBatch": draw(st.sampled_from([2, 4, 8])), "steps": 1,
                        "recompute": "full"}}
    return cluster, job


# found by the strategy below: the exhaustive optimum is interleaved (3 chunks), ZB-H1 does not
# fit its split, and a search evaluating only ZB-H1 and 1F1B returned a 1.2% slower plan
STASH_BOUND_EXAMPLE = (
    {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "h"},
     "datacenters": [{"name": "a"}],
     "pools": [{"name": "p0", "datacenter": "a", "device": "L40S", "nodes": 2, "gpusPerNode": 1,
                "nicGbps": 100}]},
    # the DP sync after the backward: overlapped, dp=2 pp=1 would beat every pipeline here
    {"model": {"layers": 8, "hidden": 4096, "heads": 16, "seqLen": 16384, "vocab": 32000},
     "training": {"globalBatch": 2, "steps": 1, "recompute": "full",
                  "overlapGradReduce": False}},
)


def test_auto_picks_interleaved_where_zb_h1_does_not_fit() -> None:
    cluster, job = STASH_BOUND_EXAMPLE
    inv, spec = load_cluster(cluster), parse_job_spec(job)
    full = plan_job("j", spec, inv, exhaustive=True)
    assert (full.schedule, full.virtual_stages) == ("interleaved", 3)
    fast = plan_job("j", spec, inv)
    assert (fast.schedule, fast.virtual_stages) == ("interleaved", 3)
    assert fast.predicted.step_time_s == pytest.approx(full.predicted.step_time_s, rel=1e-9)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(stash_bound_instances())
@example(STASH_BOUND_EXAMPLE)
@example((  # two device types; the exhaustive optimum is interleaved, 3 chunks
    {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "h"},
     "datacenters": [{"name": "a"}],
     "pools": [{"name": "p0", "datacenter": "a", "device": "A100-80GB", "nodes": 2,
                "gpusPerNode": 1, "nicGbps": 1600},
               {"name": "p1", "datacenter": "a", "device": "Ascend-910B", "nodes": 2,
                "gpusPerNode": 1, "nicGbps": 1600}]},
    {"model": {"layers": 15, "hidden": 4096, "heads": 16, "seqLen": 32768, "vocab": 32000},
     "training": {"globalBatch": 8, "steps": 1, "recompute": "full"}}))
def test_fast_equals_exhaustive_when_zb_h1_stash_binds(instance: tuple[dict, dict]) -> None:
    """Under ``schedule: auto`` the fast search skips 1F1B and interleaved only where their
    memory caps are no larger than ZB-H1's (then ZB-H1 dominates them on every split)."""
    _assert_fast_equals_exhaustive(instance)


@st.composite
def long_sequence_instances(draw: st.DrawFn) -> tuple[dict, dict]:
    """Long sequences on nodes of 2-8 GPUs, ``cp`` searched (``planner._cp_options``: 1 and
    the powers of two up to the node with at least 4096 tokens per rank) or pinned."""
    pools = [{"name": f"p{i}", "datacenter": "a",
              "device": draw(st.sampled_from(["A100-80GB", "H100-SXM", "L40S", "MI300X"])),
              "nodes": draw(st.integers(1, 2)), "gpusPerNode": draw(st.sampled_from([2, 4, 8])),
              "nicGbps": draw(st.sampled_from([100, 400, 1600]))}
             for i in range(draw(st.integers(1, 2)))]
    cluster = {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
               "metadata": {"name": "h"}, "datacenters": [{"name": "a"}], "pools": pools}
    job = {"model": {"layers": draw(st.integers(2, 6)), "hidden": draw(st.sampled_from(
               [1024, 4096])), "heads": 16, "kvHeads": draw(st.sampled_from([4, 16])),
               "seqLen": draw(st.sampled_from([8192, 16384, 32768])), "vocab": 32000},
           "training": {"globalBatch": draw(st.sampled_from([1, 2, 4])), "steps": 1,
                        "optimizerSharding": draw(st.booleans()),
                        "recompute": draw(st.sampled_from(["none", "selective", "attention-free",
                                                           "full"]))}}
    cp = draw(st.sampled_from([None, None, None, 2, 4]))
    if cp is not None:
        job["parallelism"] = {"cp": cp}
    return cluster, job


@settings(max_examples=30, deadline=None, derandomize=True)
@given(long_sequence_instances())
def test_fast_equals_exhaustive_with_context_parallelism(instance: tuple[dict, dict]) -> None:
    """The CP degree is one more searched dimension: one incumbent over every degree prunes
    the next, and the fast search still finds the exhaustive optimum."""
    _assert_fast_equals_exhaustive(instance)
