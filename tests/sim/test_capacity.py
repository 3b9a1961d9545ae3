"""The memoised planner oracle: memo, quantisation, spares, and the scaled fallback."""

from __future__ import annotations

import pytest
from tests.sim.conftest import oracle_for, small_job

from hettrain.planning.planner import plan_job
from hettrain.sim.capacity import CapacityOracle, checkpoint_bytes
from hettrain.sim.cluster import generate_cluster, topology_of
from hettrain.sim.model import SimInputError


def test_capacity_is_the_planner_on_the_survivors():
    oracle = oracle_for("64:H100-SXM")
    name, spec = small_job()
    inv = oracle.topo.inventory
    for up in (8, 7, 5):
        gone = inv.pools[0].nodes[up:]
        plan = plan_job(name, spec, inv.without_nodes(gone))
        cap = oracle.capacity((up,))
        assert cap is not None
        assert cap.tokens_per_s == plan.predicted.tokens_per_s
        assert cap.world_size == plan.world_size
        assert cap.nodes_used == (len(plan.nodes()),)


def test_memoised_by_survivor_counts():
    oracle = oracle_for("64:H100-SXM")
    a = oracle.capacity((7,))
    calls = oracle.plan_calls
    assert oracle.capacity((7,)) is a and oracle.plan_calls == calls
    assert oracle.plan_seconds > 0


def test_quantum_rounds_down_counts_up():
    name, spec = small_job()
    topo = topology_of(generate_cluster("64:H100-SXM"), 2)
    q = CapacityOracle(name, spec, topo, quantum=4)
    assert q.key((8,)) == (8,) and q.key((7,)) == (4,) and q.key((4,)) == (4,)
    assert q.capacity((7,)) is q.capacity((5,))


def test_spares_are_held_out_of_plans():
    oracle = oracle_for("64:H100-SXM", spare_nodes=2)
    assert oracle.topo.pool_nodes == (10,)
    full = oracle.capacity((10,))
    assert full is not None and full.nodes_used == (8,)
    assert oracle.capacity((9,)) is full  # a spare stands in
    assert oracle.capacity((7,)) is not full


def test_scaled_fallback_tracks_the_planner():
    """Plan 1/4 of the cluster with 1/4 of the batch, scale by 4: close to the real plan."""
    name, spec = small_job(global_batch=256)
    topo = topology_of(generate_cluster("1024:H100-SXM"), 2)
    exact = CapacityOracle(name, spec, topo).capacity(topo.pool_nodes)
    scaled_oracle = CapacityOracle(name, spec, topo, scale=4)
    scaled = scaled_oracle.capacity(topo.pool_nodes)
    assert exact is not None and scaled is not None and scaled_oracle.mode == "scaled:4"
    assert abs(scaled.tokens_per_s / exact.tokens_per_s - 1) < 0.10
    assert scaled.world_size == exact.world_size
    with pytest.raises(SimInputError, match="globalBatch"):
        CapacityOracle(name, spec, topo, scale=3)


def test_nothing_fits_is_none():
    oracle = oracle_for("64:H100-SXM")
    assert oracle.capacity((0,)) is None


def test_checkpoint_bytes_llama3_405b():
    from hettrain.sim.scenarios import llama3_job

    _, spec = llama3_job()
    # 405B parameters x 14 bytes (bf16 weights + fp32 master, Adam m, v) ~ 5.7 TB
    assert 5.5e12 < checkpoint_bytes(spec) < 5.9e12
