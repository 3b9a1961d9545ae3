"""Planning core: cost formulas vs hand values, layer split vs brute force, planner invariants."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from hettrain.api.spec import parse_job_spec
from hettrain.planning import cost
from hettrain.planning.errors import PlanningError
from hettrain.planning.inventory import load_cluster
from hettrain.planning.layers import StageCost, split_layers, split_layers_brute_force
from hettrain.planning.planner import plan_job
from hettrain.planning.support import uneven_dp_errors


def _cluster(pools: list[dict], links: list[dict] | None = None) -> dict:
    # a link may join a datacenter without pools, but only one the cluster lists
    dcs = sorted({p["datacenter"] for p in pools}
                 | {d for lk in links or [] for d in lk["between"]})
    return {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
            "metadata": {"name": "t"}, "datacenters": [{"name": d} for d in dcs],
            "links": links or [], "pools": pools}


def _spec(preset: str = "gpt3-1.3b", gb: int = 16, **training) -> object:
    return parse_job_spec({"model": {"preset": preset},
                           "training": {"globalBatch": gb, "steps": 10, **training}})


def test_layer_flops_match_6n_tokens_within_a_few_percent() -> None:
    model = _spec("llama3-8b").model
    tokens = 8192
    layer_params = cost.layer_matmul_params(model)
    six_n = 6.0 * layer_params * tokens
    ratio = cost.layer_flops(model, tokens, "none") / six_n
    # attention adds 6·s·h·tokens-ish on top of 6N: s/(6h)·(h²·24)/(params) ≈ small
    assert 1.0 < ratio < 1.35


def test_activation_bytes_count_the_runtimes_saved_tensors() -> None:
    """The per-layer table of cost.py (fitted by tests/runtime/training/test_memory_honesty.py):
    bf16 bytes per token, no s x s scores (flash/SDPA), each RMSNorm's input and output kept
    (its fp32 work and the MLP's activation recomputed in the backward), replicated over TP
    unless sequence parallelism shards them (tp divides the tokens)."""
    model = _spec("gpt3-175b").model  # GELU MLP, f = 4h, MHA
    s, h, a, f, d = model.seq_len, model.hidden, model.heads, model.ffn_hidden, model.head_dim
    norms = 2 * (2 * h + 2 * h)  # per norm: bf16 input and output
    rope = 8 * s * d  # bf16 cos, sin for q and k
    assert cost.activation_bytes_per_layer(model, 1, 1, "none") == \
        s * (norms + (4 * h + f) * 2 + 4 * a) + rope  # q, k, v, attention out, MLP up; lse
    assert cost.sequence_shards(model, 8) == 8
    assert cost.activation_bytes_per_layer(model, 1, 8, "selective") == \
        s * (norms + (h + 2 * h + h + f) * 2) / 8 + rope
    assert cost.activation_bytes_per_layer(model, 1, 8, "full") == s * h * 2 / 8
    odd = replace(model, seq_len=2047)  # 8 does not divide it: plain TP, norms replicated
    assert cost.sequence_shards(odd, 8) == 1
    assert cost.activation_bytes_per_layer(odd, 1, 8, "selective") == \
        2047 * (norms + (h + 2 * h + h + f) * 2 / 8) + 8 * 2047 * d
    assert cost.activation_bytes_per_layer(odd, 1, 8, "full") == 2047 * h * 2
    # full recompute re-runs one layer in the backward, then runs its backward: counted
    # once per stage, not per layer
    assert cost.recompute_working_set_bytes(model, 1, 8, "full") == \
        cost.activation_bytes_per_layer(model, 1, 8, "none") + 2 * 4 * s * d \
        + cost.backward_transient_bytes(model, 1, 8)
    assert cost.recompute_working_set_bytes(model, 1, 8, "selective") == 0


def test_attention_free_keeps_the_layer_input_and_the_attention_outputs() -> None:
    """Attention-free recompute: the layer input (a sequence shard under SP), the attention
    output of this TP rank's heads over the whole sequence and the fp32 log-sum-exp; no
    per-layer RoPE tables; the working set and the per-stage tables are full's."""
    model = _spec("gpt3-175b").model
    s, h, a, d = model.seq_len, model.hidden, model.heads, model.head_dim
    assert cost.activation_bytes_per_layer(model, 2, 8, "attention-free") == \
        s * 2 * (2 * h / 8 + 2 * h / 8 + 4 * a / 8)
    odd = replace(model, seq_len=2047)  # no sequence parallelism: the input is replicated
    assert cost.activation_bytes_per_layer(odd, 1, 8, "attention-free") == \
        2047 * (2 * h + 2 * h / 8 + 4 * a / 8)
    assert cost.activation_bytes_per_layer(model, 1, 1, "attention-free") == \
        s * (2 * h + 2 * h + 4 * a)
    assert cost.activation_bytes_per_layer(model, 1, 1, "attention-free") == pytest.approx(
        2 * cost.activation_bytes_per_layer(model, 1, 1, "full"), rel=1e-2)  # + LSE: a/h
    for tp in (1, 8):
        assert cost.recompute_working_set_bytes(model, 1, tp, "attention-free") == \
            cost.recompute_working_set_bytes(model, 1, tp, "full")
    assert cost.recompute_rope_table_bytes(model, "attention-free") == 2 * 4 * s * d
    assert cost.cp_attention_extra_bytes_per_layer(model, 1, 8, 4, "attention-free",
                                                   masks=True) == 0
    training = _spec(recompute="attention-free").training
    kw = {"tp": 8, "dp": 1, "micro_batch": 1, "in_flight": 3, "first": False, "last": False}
    free = cost.stage_memory(model, training, **kw)
    full = cost.stage_memory(model, replace(training, recompute="full"), **kw)
    assert free.fixed == full.fixed
    assert free.per_layer - full.per_layer == 3 * s * (2 * h + 4 * a) / 8


def test_state_bytes_with_and_without_zero1() -> None:
    spec = _spec(optimizerSharding=False)
    assert cost.state_bytes_per_param(spec.training, 8) == 2 + 4 + 12
    spec = _spec(optimizerSharding=True)
    assert cost.state_bytes_per_param(spec.training, 8) == 2 + 4 + 12 / 8


@pytest.mark.parametrize("seed", range(40))
def test_split_layers_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    k = rng.randint(1, 4)
    total = rng.randint(k, 12)
    stages = [StageCost(rng.uniform(0.5, 3), rng.uniform(0, 2) * (i == k - 1),
                        rng.uniform(0, 0.3), rng.uniform(0, 0.5), rng.randint(1, total))
              for i in range(k)]
    m = rng.randint(1, 8)
    boundary = rng.uniform(0, 0.2)
    ref = split_layers_brute_force(stages, total, m, boundary)
    fast = split_layers(stages, total, m, boundary)
    if ref is None:
        assert fast is None
    else:
        assert fast is not None
        assert fast[0] == pytest.approx(ref[0], rel=1e-9)


HET = _cluster([
    {"name": "h100", "datacenter": "us-east", "device": "H100-SXM", "nodes": 2, "gpusPerNode": 4,
     "nicGbps": 400},
    {"name": "mi300x", "datacenter": "us-east", "device": "MI300X", "nodes": 1, "gpusPerNode": 4,
     "nicGbps": 400},
])


def _check_invariants(plan, inv, spec) -> None:
    assert len(plan.ranks) == plan.world_size == plan.dp * sum(s.tp for s in plan.stages)
    assert sum(s.layer_end - s.layer_start for s in plan.stages) == spec.model.layers
    # every replica runs num_microbatches, the last short_replicas one fewer (uneven dp)
    assert plan.micro_batch * (plan.dp * plan.num_microbatches - plan.short_replicas) \
        == plan.global_batch == spec.training.global_batch
    assert uneven_dp_errors(plan) == []  # what the runtime accepts
    per_node: dict[str, int] = {}
    for r in plan.ranks:
        per_node[r.node] = per_node.get(r.node, 0) + 1
    for pool in inv.pools:
        for node in pool.nodes:
            assert per_node.get(node, 0) <= pool.gpus_per_node
    for s in plan.stages:
        assert s.memory_gib <= s.capacity_gib


def test_plan_invariants_and_determinism() -> None:
    inv = load_cluster(HET)
    spec = _spec()
    p1 = plan_job("j", spec, inv)
    p2 = plan_job("j", spec, load_cluster(HET))
    assert p1.to_json() == p2.to_json()
    _check_invariants(p1, inv, spec)


@pytest.mark.parametrize("seed", range(12))
def test_fast_search_equals_exhaustive(seed: int) -> None:
    rng = random.Random(seed)
    devices = ["H100-SXM", "MI300X", "A100-80GB", "Gaudi3"]
    pools = [{"name": f"p{i}", "datacenter": rng.choice(["a", "b"]),
              "device": rng.choice(devices), "nodes": rng.randint(1, 2),
              "gpusPerNode": rng.choice([1, 2]), "nicGbps": 200} for i in range(rng.randint(1, 3))]
    links = [{"between": ["a", "b"], "bandwidthGbps": 100, "latencyMs": 20}]
    inv = load_cluster(_cluster(pools, links))
    spec = parse_job_spec({"model": {"layers": rng.randint(2, 6), "hidden": 1024, "heads": 16,
                                     "seqLen": 1024, "vocab": 32000},
                           "training": {"globalBatch": rng.choice([4, 6, 8]), "steps": 1}})
    fast = plan_job("j", spec, inv)
    full = plan_job("j", spec, inv, exhaustive=True)
    assert fast.predicted.step_time_s == pytest.approx(full.predicted.step_time_s, rel=1e-9)
    _check_invariants(fast, inv, spec)


def test_replan_keeps_global_batch_and_survivors() -> None:
    inv = load_cluster(HET)
    spec = _spec()
    first = plan_job("j", spec, inv)
    failed = first.ranks[-1].node
    smaller = inv.without_nodes([failed])
    second = plan_job("j", spec, smaller, previous=first)
    assert failed not in {r.node for r in second.ranks}
    assert second.dp * second.micro_batch * second.num_microbatches == 16
    _check_invariants(second, smaller, spec)


def test_errors_name_the_limit() -> None:
    inv = load_cluster(HET)
    with pytest.raises(PlanningError, match="placement"):
        plan_job("j", parse_job_spec({"model": {"preset": "gpt-small"},
                                      "training": {"globalBatch": 8, "steps": 1},
                                      "placement": {"vendors": ["intel"]}}), inv)
    with pytest.raises(PlanningError, match="GiB"):
        plan_job("j", _spec("llama3-405b", gb=8), inv)


def test_unknown_device_is_a_clear_error() -> None:
    doc = _cluster([{"name": "x", "datacenter": "a", "device": "Mystery9", "nodes": 1,
                     "gpusPerNode": 1}])
    with pytest.raises(Exception, match=r"Mystery9.*catalog"):
        load_cluster(doc)
