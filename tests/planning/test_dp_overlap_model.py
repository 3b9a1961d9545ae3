"""The cost model's exposed DP sync (cost.dp_exposed_s / dp_exposed_coeffs) against a
discrete-event simulation of the runtime's buckets, and the planner's use of it."""

from __future__ import annotations

import random

import pytest

from hettrain.api.spec import parse_job_spec
from hettrain.planning import cost
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import plan_job


def _simulate(sync_s: float, window_s: float, buckets: int, share: float) -> float:
    """Exposed seconds of the runtime's schedule: ``buckets`` equal buckets, bucket ``k``
    final at ``(k+1)/buckets`` of the backward (the last one when it ends), all-reduced one
    after another in order, at ``share`` of full speed while the backward runs."""
    per = sync_s / buckets
    t = 0.0  # when the link is free
    for k in range(buckets):
        ready = window_s * (k + 1) / buckets
        start = max(t, ready)
        if start < window_s:  # part (or all) of it runs alongside the backward
            inside = (window_s - start) * share
            t = start + per / share if inside >= per else window_s + (per - inside)
        else:
            t = start + per
    return t - window_s


@pytest.mark.parametrize("seed", range(200))
def test_exposed_formula_tracks_a_simulation_of_the_buckets(seed):
    rng = random.Random(seed)
    sync, window = rng.uniform(0, 2), rng.uniform(0, 2)
    buckets, share = rng.randint(1, 64), rng.uniform(0.3, 1.0)
    last = sync / buckets
    got = cost.dp_exposed_s(sync, last, window, share)
    sim = _simulate(sync, window, buckets, share)
    assert last - 1e-12 <= got <= sync + 1e-12  # never worse than no overlap
    # the formula lets the other buckets use the whole window; the runtime's first bucket is
    # ready after 1/buckets of it, and a bucket started late in the window spills over:
    # both are at most one bucket's backward or all-reduce
    assert abs(sim - got) <= window / buckets + last / share + 1e-9
    assert cost.dp_exposed_s(sync, last, 0.0, share) == pytest.approx(sync)


@pytest.mark.parametrize("seed", range(100))
def test_affine_coefficients_never_undercut_the_formula(seed):
    rng = random.Random(seed)
    c, e = rng.uniform(0, 1e-2), rng.uniform(0, 5e-2)
    w, wf = rng.uniform(0, 2e-2), rng.uniform(0, 2e-2)
    last = rng.uniform(e / 2, 0.1)
    cc, ee = cost.dp_exposed_coeffs(c, e, w, wf, last)
    assert 0 <= cc <= c
    for n in range(1, 80):
        exact = cost.dp_exposed_s(c * n + e, last, w * n + wf)
        assert cc * n + ee >= exact - 1e-12
        if (c - cost.DP_OVERLAP_SHARE * w) * (e - last - cost.DP_OVERLAP_SHARE * wf) >= 0 \
                and c * n + e >= last:
            assert cc * n + ee == pytest.approx(exact, rel=1e-9, abs=1e-15)


CLUSTER = {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "c"},
           "datacenters": [{"name": "a"}],
           "pools": [{"name": "p0", "datacenter": "a", "device": "A100-80GB", "nodes": 4,
                      "gpusPerNode": 8, "nicGbps": 200}]}


def _job(**training):
    return parse_job_spec({
        "model": {"preset": "llama3-8b"},
        "training": {"globalBatch": 64, "steps": 1, "microBatch": 1, "recompute": "full",
                     "precision": "bf16", **training},
        "parallelism": {"tp": 8, "pp": 1, "dp": 4, "schedule": "1f1b"},
        "data": {"synthetic": True}})


@pytest.mark.parametrize("sharding", [False, True])
def test_planner_charges_the_exposed_part_of_the_dp_sync(sharding):
    inv = load_cluster(CLUSTER)
    on = plan_job("j", _job(optimizerSharding=sharding), inv)
    off = plan_job("j", _job(optimizerSharding=sharding, overlapGradReduce=False), inv)
    assert (on.dp, on.pp, on.stages[0].tp) == (off.dp, off.pp, off.stages[0].tp) == (4, 1, 8)
    # by hand: the full sync c·L + e of the one stage, the window its last microbatch's
    # backward, the last bucket (the embedding's gradient, first stage) always exposed
    spec = _job(optimizerSharding=sharding)
    model, t = spec.model, spec.training
    full = off.predicted.dp_comm_s
    lat = 2 * 3 * cost.COLLECTIVE_LATENCY_S
    factor = 1 + cost.precision_bytes(t) / 8 if sharding else 1
    sync = lat + (full - lat) / factor  # the gradient all-reduce
    gather = full - sync  # ZeRO-1's parameter all-gather: after the step
    layer = cost.layer_time_s(model, t, 1, 8, inv.pools[0].device)
    head = cost.head_time_s(model, 1, 8, inv.pools[0].device)
    window = model.layers * layer * cost.backward_fraction("full") + head * 2 / 3
    embed = cost.embedding_params(model) * 4.0 / cost.vocab_shards(model, 8)
    last = lat + (sync - lat) * embed / (model.layers * cost.layer_params(model) * 4 / 8
                                         + 2 * embed)
    want = cost.dp_exposed_s(sync, last, window) + gather
    assert on.predicted.dp_comm_s == pytest.approx(want, rel=1e-9)
    assert last < on.predicted.dp_comm_s < full  # comm-bound here: partly hidden
    assert off.predicted.step_time_s - on.predicted.step_time_s == pytest.approx(
        full - on.predicted.dp_comm_s, rel=1e-9)


def test_two_pools_of_a_unit_keep_the_sync_exposed():
    two = dict(CLUSTER, pools=[dict(CLUSTER["pools"][0], name="p0", nodes=2),
                               dict(CLUSTER["pools"][0], name="p1", nodes=2)])
    inv = load_cluster(two)
    on = plan_job("j", _job(), inv)
    off = plan_job("j", _job(overlapGradReduce=False), inv)
    assert on.predicted.dp_comm_s == pytest.approx(off.predicted.dp_comm_s, rel=1e-12)


def test_a_model_under_one_bucket_exposes_its_whole_gradient_sync():
    """A model whose fp32 gradients fit one bucket (``cost.DP_BUCKET_BYTES``) syncs them in
    one all-reduce after the backward: the whole sync is exposed, counted in BYTES (4 per
    parameter; it once counted the layers' parameters, a quarter of their bytes)."""
    spec = parse_job_spec({
        "model": {"layers": 4, "hidden": 128, "heads": 4, "seqLen": 128, "vocab": 256},
        "training": {"globalBatch": 8, "steps": 1, "microBatch": 2, "precision": "fp32",
                     "recompute": "none"},
        "parallelism": {"tp": 1, "pp": 1, "dp": 2, "schedule": "1f1b"},
        "data": {"synthetic": True}})
    cluster = load_cluster({**CLUSTER, "pools": [{**CLUSTER["pools"][0], "nodes": 1}]})
    plan = plan_job("small", spec, cluster)
    m = spec.model
    grad_bytes = 4.0 * (cost.layer_params(m) * m.layers + 2 * cost.embedding_params(m))
    assert grad_bytes < cost.DP_BUCKET_BYTES
    dev = cluster.pools[0].device
    # the DP sync inside a node: the intra-node link at COLLECTIVE_LATENCY_S per ring step
    sync = 2 * cost.COLLECTIVE_LATENCY_S + grad_bytes / (dev.intra_node_gbps * 1e9)
    # the last (only) bucket is all of it; what the backward window cannot hide of the
    # per-layer part may add to it
    assert plan.predicted.dp_comm_s >= sync * (1 - 1e-9)
