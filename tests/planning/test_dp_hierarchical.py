"""The DP gradient all-reduce across nodes is priced as the runtime's hierarchical all-reduce
(intra-node reduce-scatter, inter-node all-reduce of the shards side by side on each GPU's NIC
share, intra-node all-gather): against a step-by-step sum of the collective's phases, and
against the old flat ring on one NIC share (``g×`` slower with ``g`` members per node)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from hettrain.api.spec import parse_job_spec
from hettrain.planning import cost
from hettrain.planning import planner as P
from hettrain.planning.inventory import load_cluster
from hettrain.planning.units import build_units


def _phases_s(nbytes: float, ranks: int, per_node: int, intra_gbytes: float, intra_lat: float,
              nic_gbytes: float, nic_lat: float) -> float:
    """One all-reduce of ``nbytes`` per rank, step by step: each ring step costs its latency
    plus the bytes one rank sends in it over that rank's link."""
    g = min(ranks, per_node)
    nodes = -(-ranks // g)
    t = 0.0
    shard = nbytes / g
    for _ in range(g - 1):  # 1. reduce-scatter inside the node: g − 1 steps of M/g
        t += intra_lat + shard / (intra_gbytes * 1e9)
    # 2. g shard all-reduces side by side over the nodes, each on its own NIC share:
    #    reduce-scatter then all-gather of N − 1 steps each, M/(g·N) per step
    for _ in range(2 * (nodes - 1)):
        t += nic_lat + shard / nodes / (nic_gbytes * 1e9)
    for _ in range(g - 1):  # 3. all-gather inside the node
        t += intra_lat + shard / (intra_gbytes * 1e9)
    return t


@pytest.mark.parametrize("ranks,per_node", [(1, 8), (2, 8), (8, 8), (16, 8), (32, 8),
                                            (64, 4), (24, 2), (6, 1), (12, 3), (5, 8)])
def test_hierarchical_all_reduce_is_the_sum_of_its_phases(ranks: int, per_node: int) -> None:
    nbytes = 123_456_789.0
    for intra, ia, nic, na in itertools.product((300.0, 150.0), (5e-6, 20e-6), (25.0, 12.5),
                                                (20e-6, 1e-4)):
        lat, per_byte = cost.node_hierarchical_all_reduce(ranks, per_node, intra, ia, nic, na)
        assert lat + nbytes * per_byte == pytest.approx(
            _phases_s(nbytes, ranks, per_node, intra, ia, nic, na), rel=1e-12)


def test_one_node_is_a_ring_and_one_member_per_node_is_the_nic_ring() -> None:
    lat, per_byte = cost.node_hierarchical_all_reduce(8, 8, 300.0, 5e-6, 25.0, 20e-6)
    assert lat + 1e9 * per_byte == pytest.approx(cost.ring_all_reduce_s(1e9, 8, 300.0, 5e-6))
    lat, per_byte = cost.node_hierarchical_all_reduce(6, 1, 300.0, 5e-6, 25.0, 20e-6)
    assert lat + 1e9 * per_byte == pytest.approx(cost.ring_all_reduce_s(1e9, 6, 25.0, 20e-6))


def _unit(nodes: int, gpn: int = 8, nic_gbps: int = 1600, intra: float | None = None):
    inv = load_cluster({"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
                        "metadata": {"name": "t"}, "datacenters": [{"name": "a"}],
                        "pools": [{"name": "p", "datacenter": "a", "device": "A100-80GB",
                                   "nodes": nodes, "gpusPerNode": gpn, "nicGbps": nic_gbps}]})
    unit = build_units(inv.pools, merged=False)[0]
    if intra is not None:
        unit = dataclasses.replace(unit, device=dataclasses.replace(unit.device,
                                                                    intra_node_gbps=intra))
    return unit, inv


SPEC = parse_job_spec({"model": {"preset": "gpt3-1.3b"},
                       "training": {"globalBatch": 64, "steps": 1, "overlapGradReduce": False}})


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_cross_node_dp_time_is_one_gth_of_the_flat_ring_on_one_nic_share(tp: int) -> None:
    """Megatron Table 1's shapes: 32 replicas on 8-GPU nodes. With the intra-node link taken
    as free, what is left is the inter-node phase: the old model's flat ring over one GPU's NIC
    share ``2(W−1)/W / nic`` divided by the ``g = 8/tp`` members per node (up to the ring
    factor of ``N = W/g`` nodes instead of ``W`` ranks); at tp 8 (g = 1) exactly the old one."""
    dp = 32
    unit, inv = _unit(nodes=dp * tp // 8, intra=1e12)
    nic = unit.nic_gbytes_per_gpu * 1e9
    g = 8 // tp
    nodes = dp // g
    old = 2 * (dp - 1) / dp / nic
    lat, red, gat, _, _ = P._dp_rates(unit, dp, tp, inv, SPEC)
    assert red == pytest.approx(old / g * ((nodes - 1) / nodes) / ((dp - 1) / dp), rel=1e-6)
    assert red < old / g * 1.04  # the ring factors differ by < 4% here
    assert gat == pytest.approx(red * 2 / 8)  # ZeRO's bf16 all-gather: eb/8 of the bytes
    assert lat == pytest.approx(2 * (g - 1) * cost.COLLECTIVE_LATENCY_S
                                + 2 * (nodes - 1) * cost.COLLECTIVE_LATENCY_S)
    if tp == 8:
        assert red == pytest.approx(old, rel=1e-12)


def test_stage_dp_sync_uses_the_hierarchical_rates() -> None:
    """The whole stage's exposed sync (no overlap, no ZeRO) is its fp32 gradient bytes at the
    hierarchical rate: the brute-force phase sum over the stage's bytes."""
    unit, inv = _unit(nodes=4)
    spec = parse_job_spec({"model": {"preset": "gpt3-1.3b"},
                           "training": {"globalBatch": 64, "steps": 1, "optimizerSharding": False,
                                        "overlapGradReduce": False}})
    c, e = P._dp_sync_coeffs(unit, 32, 1, inv, spec, 2, 1.0, 0.0, False, False)
    layer_bytes = cost.layer_params(spec.model) * 4.0
    nic = unit.nic_gbytes_per_gpu
    want = _phases_s(24 * layer_bytes, 32, 8, unit.device.intra_node_gbps,
                     cost.COLLECTIVE_LATENCY_S, nic, cost.COLLECTIVE_LATENCY_S)
    assert 24 * c + e == pytest.approx(want, rel=1e-12)
