"""Sampled timelines: rates match the model, thinning drops hits on down nodes."""

from __future__ import annotations

import math
import statistics

from hettrain.sim.cluster import generate_cluster, topology_of
from hettrain.sim.model import HOUR, Duration, FailureModel
from hettrain.sim.timeline import DOWN, SLOW_END, SLOW_START, SOFTWARE, UP, sample_timeline

TOPO = topology_of(generate_cluster("4096:H100-SXM"), 2)


def test_counts_match_poisson_means():
    """Short repairs (so thinning is negligible): counts over 20 seeds within 4 sigma."""
    m = FailureModel(gpu_mtbf_h=50000.0, rack_mtbf_h=20000.0, software_gpu_mtbf_h=100000.0,
                     repair=Duration("fixed", 60.0, 0.0))
    horizon = 20 * 86400
    expect = {"node": TOPO.nodes * 8 / (50000 * HOUR) * horizon,
              "rack": TOPO.racks(0) / (20000 * HOUR) * horizon,
              "software": TOPO.gpus / (100000 * HOUR) * horizon}
    seen: dict[str, list[int]] = {k: [] for k in expect}
    for seed in range(20):
        tl = sample_timeline(TOPO, m, horizon, seed)
        seen["node"].append(tl.count(DOWN, "node"))
        seen["rack"].append(tl.count(DOWN, "rack"))
        seen["software"].append(tl.count(SOFTWARE))
    for k, mean in expect.items():
        got = statistics.fmean(seen[k])
        assert abs(got - mean) < 4 * math.sqrt(mean / 20), (k, got, mean)


def test_every_down_has_its_up_and_hits_only_up_nodes():
    m = FailureModel(gpu_mtbf_h=5000.0, repair=Duration("lognormal", 24 * HOUR, 1.0),
                     straggler_gpu_mtbf_h=20000.0)
    tl = sample_timeline(TOPO, m, 30 * 86400, 4)
    downs = [e for e in tl.events if e.kind == DOWN]
    ups = [e for e in tl.events if e.kind == UP]
    back = {(e.time_s, e.counts) for e in ups}
    for d in downs:
        assert d.until_s >= 30 * 86400 or (d.until_s, d.counts) in back
    assert all(a.time_s <= b.time_s for a, b in zip(tl.events, tl.events[1:], strict=False))
    starts = {e.ref for e in tl.events if e.kind == SLOW_START}
    ends = {e.ref for e in tl.events if e.kind == SLOW_END}
    assert starts and ends <= starts


def test_long_repairs_thin_node_failures():
    """With 2-day repairs many nodes are down, so fewer distinct failures are kept."""
    fast = FailureModel(gpu_mtbf_h=2000.0, rack_mtbf_h=0.0, repair=Duration("fixed", 60.0, 0.0))
    slow = FailureModel(gpu_mtbf_h=2000.0, rack_mtbf_h=0.0,
                        repair=Duration("fixed", 48 * HOUR, 0.0))
    a = sample_timeline(TOPO, fast, 10 * 86400, 1).count(DOWN)
    b = sample_timeline(TOPO, slow, 10 * 86400, 1).count(DOWN)
    assert b < a
