"""``spec.placement.maxGPUs`` is a hard cap on the plan's world size (fast and exhaustive)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fast_vs_exhaustive import instances

from hettrain.api.spec import parse_job_spec
from hettrain.planning.errors import PlanningError
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import plan_job


def _capped(job: dict, cap: int) -> dict:
    return {**job, "placement": {**job.get("placement", {}), "maxGPUs": cap}}


def _result(spec, inv, exhaustive: bool) -> tuple[float, int] | str:
    try:
        plan = plan_job("j", spec, inv, exhaustive=exhaustive)
    except PlanningError as exc:
        return exc.reason
    return plan.predicted.step_time_s, plan.world_size


@settings(max_examples=25, deadline=None, derandomize=True)
@given(instances(), st.integers(1, 8))
def test_capped_fast_equals_capped_exhaustive(instance: tuple[dict, dict], cap: int) -> None:
    cluster, job = instance
    inv, spec = load_cluster(cluster), parse_job_spec(_capped(job, cap))
    full, fast = _result(spec, inv, True), _result(spec, inv, False)
    if isinstance(full, str):
        assert fast == full
        return
    assert not isinstance(fast, str)
    assert fast[0] == pytest.approx(full[0], rel=1e-9)
    assert fast[1] <= cap and full[1] <= cap


def test_cap_limits_a_job_that_would_use_the_whole_cluster() -> None:
    cluster = {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
               "metadata": {"name": "c"}, "datacenters": [{"name": "a"}],
               "pools": [{"name": "h", "datacenter": "a", "device": "H100-SXM", "nodes": 48,
                          "gpusPerNode": 8}]}
    job = {"model": {"preset": "gpt3-1.3b"}, "training": {"globalBatch": 512, "steps": 1}}
    inv = load_cluster(cluster)
    free = plan_job("j", parse_job_spec(job), inv)
    assert free.world_size > 64
    capped = plan_job("j", parse_job_spec(_capped(job, 64)), inv)
    assert capped.world_size <= 64
    assert capped.predicted.step_time_s >= free.predicted.step_time_s


def test_a_cap_below_any_layout_names_maxgpus() -> None:
    cluster = {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
               "metadata": {"name": "c"}, "datacenters": [{"name": "a"}],
               "pools": [{"name": "h", "datacenter": "a", "device": "H100-SXM", "nodes": 4,
                          "gpusPerNode": 8}]}
    job = {"model": {"preset": "gpt3-1.3b"}, "training": {"globalBatch": 64, "steps": 1},
           "parallelism": {"tp": 8}}
    with pytest.raises(PlanningError) as err:
        plan_job("j", parse_job_spec(_capped(job, 4)), load_cluster(cluster))
    assert "spec.placement.maxGPUs=4" in err.value.message
