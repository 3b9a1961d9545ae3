"""Time model: hand-computed values of the new time functions, the Megatron SC'21 Table 1
fidelity targets (through bench/fidelity.py, the same code as the bench), the searched
interleaved chunk count and ``recompute: auto`` against brute force over pinned runs, and the
refusal message."""

from __future__ import annotations

import dataclasses

import pytest

from bench import fidelity
from hettrain.api.spec import RECOMPUTE_MODES, SpecError, parse_job_spec
from hettrain.planning import cost
from hettrain.planning.catalog import DeviceSpec
from hettrain.planning.errors import PlanningError
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import plan_job

DEV = DeviceSpec("X", "nvidia", 100.0, 80.0, 2.0, 100.0, "nccl", 0.5)  # 100 TF, 2 TB/s, 100 GB/s


def _model(**extra):
    return parse_job_spec({"model": {"layers": 2, "hidden": 1024, "heads": 16, "seqLen": 512,
                                     "vocab": 1000, **extra},
                           "training": {"globalBatch": 8, "steps": 1}}).model


def _cluster(pools: list[dict]) -> dict:
    return {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "t"},
            "datacenters": [{"name": "a"}], "pools": pools}


def _pool(name: str, device: str, nodes: int, gpn: int) -> dict:
    return {"name": name, "datacenter": "a", "device": device, "nodes": nodes,
            "gpusPerNode": gpn, "nicGbps": 400}


# ---------------------------------------------------------------- hand-computed values


def test_layer_compute_matches_hand_computation() -> None:
    m = _model()  # h 1024, f 4096, s 512, MHA: matmul params 4h² + 2hf = 12,582,912
    assert cost.layer_matmul_params(m) == 12_582_912
    # mb 2, tp 2, no recompute: 1024 tokens, 3 passes
    gemm = 3 * 2 * 1024 * 12_582_912 / 2 / (100e12 * 0.5)  # 7.7309e-4 s
    attn = 3 * 4 * 1024 * 512 * 1024 / 2 / (100e12 * 0.5 * cost.ATTENTION_EFFICIENCY)
    elem = 3 * 1024 * (cost.ELEMENTWISE_BYTES_PER_HIDDEN * 1024
                       + cost.ELEMENTWISE_BYTES_PER_FFN * 4096) / 2 / 2e12
    kernels = 3 * cost.KERNELS_PER_PASS * cost.KERNEL_FIXED_S
    assert cost.layer_compute_s(m, 2, 2, DEV, "none") == pytest.approx(
        gemm + attn + elem + kernels, rel=1e-12)
    assert gemm == pytest.approx(7.7309411328e-4, rel=1e-10)
    # full recompute: 4 passes of everything; selective: the attention core once more
    gemm4 = gemm * 4 / 3
    assert cost.layer_compute_s(m, 2, 2, DEV, "full") == pytest.approx(
        gemm4 + attn * 4 / 3 + elem * 4 / 3 + kernels * 4 / 3, rel=1e-12)
    assert cost.layer_compute_s(m, 2, 2, DEV, "selective") == pytest.approx(
        gemm + attn * 4 / 3 + elem + kernels, rel=1e-12)
    # attention-free: full less the attention core's re-run forward, between none and full
    free = cost.layer_compute_s(m, 2, 2, DEV, "attention-free")
    assert free == pytest.approx(
        cost.layer_compute_s(m, 2, 2, DEV, "full") - attn / 3, rel=1e-12)
    assert cost.layer_compute_s(m, 2, 2, DEV, "none") < free < cost.layer_compute_s(
        m, 2, 2, DEV, "full")
    assert cost.layer_flops(m, 1024, "attention-free") == pytest.approx(
        cost.layer_flops(m, 1024, "full") - 4 * 1024 * 512 * 1024, rel=1e-12)


def test_tp_comm_hand_computation() -> None:
    m = _model()
    nbytes = 512 * 2 * 1024 * 2  # s·b·h·2 bytes
    bw = 100e9 * cost.TP_BUS_EFFICIENCY
    ring = 2 * 1 * cost.TP_LATENCY_S + 2 * (1 / 2) * nbytes / bw  # 2 ranks
    assert cost.tp_comm_per_layer_s(m, 2, 2, DEV, 2, "none") == pytest.approx(4 * ring)
    assert cost.tp_comm_per_layer_s(m, 2, 2, DEV, 2, "full") == pytest.approx(6 * ring)
    assert cost.tp_comm_per_layer_s(m, 2, 2, DEV, 2, "attention-free") == pytest.approx(6 * ring)
    assert cost.tp_comm_per_layer_s(m, 2, 1, DEV, 2, "full") == 0.0


def test_gemm_efficiency_is_a_saturating_curve() -> None:
    half = DEV.flops * DEV.efficiency * cost.KERNEL_FIXED_S  # 4e8 FLOPs at 100 TF, 8 us
    assert half == pytest.approx(4e8)
    assert cost.gemm_efficiency(DEV, half) == pytest.approx(DEV.efficiency / 2)
    assert cost.gemm_efficiency(DEV, 1e15) == pytest.approx(DEV.efficiency, rel=1e-6)
    effs = [cost.gemm_efficiency(DEV, x) for x in (1e6, 1e8, 1e10, 1e12)]
    assert effs == sorted(effs)


def test_per_kernel_overhead_makes_larger_microbatches_cheaper_per_sequence() -> None:
    m = _model()
    one = cost.layer_compute_s(m, 1, 1, DEV, "none")
    four = cost.layer_compute_s(m, 4, 1, DEV, "none")
    assert four < 4 * one
    assert 4 * one - four == pytest.approx(3 * 3 * cost.KERNELS_PER_PASS * cost.KERNEL_FIXED_S)


def test_head_time_hand_computation() -> None:
    m = _model()
    want = 3 * 2 * 512 * 1024 * 1000 / 1 / 5e13 + 3 * cost.KERNEL_FIXED_S
    assert cost.head_time_s(m, 1, 1, DEV) == pytest.approx(want, rel=1e-12)
    # tp 2, vocab 1000 divides: half the logits per rank, plus the all-reduce of the head's
    # input gradient (s·b·h bf16 over 2 ranks: 2·α + n/bw)
    n = 512 * 1024 * 2
    ring = 2 * cost.TP_LATENCY_S + n / (100e9 * cost.TP_BUS_EFFICIENCY)
    half = 3 * 2 * 512 * 1024 * 1000 / 2 / 5e13 + 3 * cost.KERNEL_FIXED_S
    assert cost.head_time_s(m, 1, 2, DEV) == pytest.approx(half + ring, rel=1e-12)
    # vocab 1001 does not divide: replicated head, every rank computes all logits, no comm
    odd = _model(vocab=1001)
    assert cost.vocab_shards(odd, 2) == 1
    assert cost.head_time_s(odd, 1, 2, DEV) == pytest.approx(
        3 * 2 * 512 * 1024 * 1001 / 5e13 + 3 * cost.KERNEL_FIXED_S, rel=1e-12)


@pytest.mark.parametrize("device", ["test", "H100-SXM", "H200", "A100-80GB", "L40S", "MI300X",
                                    "MI250X", "Gaudi2", "Gaudi3", "Ascend-910B", "CPU"])
def test_min_seconds_per_flop_is_a_lower_bound(device: str) -> None:
    """The planner's root bound divides model FLOPs by peak·efficiency (and the attention
    core's share of them by the attention efficiency where it is above 1: Hopper's causal
    flash attention): every layer time must be at least its FLOPs at that rate, in bf16 and
    fp32, at 2k and 32k tokens; the model-free bound is looser still."""
    from hettrain.planning.catalog import CATALOG
    dev = DEV if device == "test" else CATALOG[device]
    assert 0 < cost.ATTENTION_EFFICIENCY <= 1
    for preset, seq in (("gpt3-1.3b", 2048), ("llama3-70b", 2048), ("llama3-8b", 32768)):
        m = parse_job_spec({"model": {"preset": preset, "seqLen": seq},
                            "training": {"globalBatch": 8, "steps": 1}}).model
        for mb, tp, rc in ((1, 1, "none"), (4, 8, "full"), (2, 2, "selective")):
            flops = cost.layer_flops(m, mb * m.seq_len, rc) / tp
            model_flops = cost.layer_flops(m, mb * m.seq_len, "none") / tp
            for eb in (2, 4):
                t = cost.layer_compute_s(m, mb, tp, dev, rc, eb)
                assert t >= flops * cost.min_seconds_per_flop(dev, None, eb)
                # given the model, the bound is per model FLOP (what the search divides)
                assert t >= model_flops * cost.min_seconds_per_flop(dev, m, eb) * (1 - 1e-12)
                assert (cost.min_seconds_per_flop(dev, m, eb)
                        >= cost.min_seconds_per_flop(dev, None, eb))


def test_hopper_attention_runs_at_the_causal_flash_rate_in_bf16_only() -> None:
    """bf16 attention on H100/H200 is SDPA's causal flash kernel: half the pairs the model
    counts at the GEMMs' efficiency (HOPPER_FLASH_ATTENTION_EFFICIENCY); fp32 (no flash
    kernel) FP32_ATTENTION_EFFICIENCY, other devices the fitted ATTENTION_EFFICIENCY."""
    from hettrain.planning.catalog import CATALOG, HOPPER_FLASH_ATTENTION_EFFICIENCY
    for name in ("H100-SXM", "H200"):
        assert cost.attention_efficiency(CATALOG[name]) == HOPPER_FLASH_ATTENTION_EFFICIENCY
        assert cost.attention_efficiency(CATALOG[name], 4) == cost.FP32_ATTENTION_EFFICIENCY
    for name in ("A100-80GB", "MI300X", "Gaudi3", "CPU"):
        assert cost.attention_efficiency(CATALOG[name]) == cost.ATTENTION_EFFICIENCY
    m = parse_job_spec({"model": {"preset": "llama3-8b", "seqLen": 8192},
                        "training": {"globalBatch": 1, "steps": 1}}).model
    h200 = CATALOG["H200"]
    slow = dataclasses.replace(h200, attention_efficiency=0.0)
    gap = cost.layer_compute_s(m, 1, 1, slow, "none") - cost.layer_compute_s(m, 1, 1, h200, "none")
    attn = 3 * 4.0 * 8192 * 8192 * 4096 / h200.effective_flops
    assert gap == pytest.approx(attn / cost.ATTENTION_EFFICIENCY
                                - attn / HOPPER_FLASH_ATTENTION_EFFICIENCY, rel=1e-9)


# ---------------------------------------------------------------- Megatron SC'21 Table 1


def test_megatron_table1_targets() -> None:
    """bench/fidelity.py's rows: median |error| ≤ 5%, max ≤ 10%, no published layout refused."""
    rows = fidelity.evaluate(["megatron-sc21"])
    assert len(rows) == 10 and all(r.role == "fitted" for r in rows)
    s = fidelity.summary(rows)
    assert s["refused"] == 0, [r.refusal for r in rows if r.refusal]
    assert s["median_abs_error"] <= 0.05
    assert s["max_abs_error"] <= 0.10
    # every row ran with its published GPU count and chunk count
    assert all("uses" not in r.layout for r in rows)
    assert {r.name: r.layout.split()[-1] for r in rows if "interleaved" in r.layout} == {
        "A-76b": "v=3", "A-145b": "v=2", "A-310b": "v=2", "A-530b": "v=3"}


def test_megatron_formula_hand_value() -> None:
    spec = parse_job_spec({"model": {"layers": 24, "hidden": 2304, "heads": 24, "seqLen": 2048,
                                     "vocab": 51200},
                           "training": {"globalBatch": 512, "steps": 1}})
    b, s, ll, h, v = 512, 2048, 24, 2304, 51200
    want = 96 * b * s * ll * h * h * (1 + s / (6 * h) + v / (16 * ll * h))
    assert fidelity.megatron_flops_per_step(spec) == pytest.approx(want, rel=1e-12)
    assert fidelity.predicted_metric("megatron_tflops", spec, 2.0, 32) == pytest.approx(
        want / 2.0 / 32 / 1e12)


# ---------------------------------------------------------------- searched options


def _job(**over) -> dict:
    job = {"model": {"layers": 16, "hidden": 4096, "heads": 32, "seqLen": 2048, "vocab": 32000},
           "training": {"globalBatch": 32, "steps": 1, "recompute": "selective"},
           "parallelism": {"schedule": "interleaved", "pp": 4, "tp": 8}}
    for k, v in over.items():
        job[k] = {**job[k], **v}
    return job


def test_interleaved_chunk_count_searched_equals_best_pinned() -> None:
    inv = load_cluster(_cluster([_pool("h", "H100-SXM", 8, 8)]))
    free = plan_job("j", parse_job_spec(_job()), inv)
    pinned = {}
    for v in (2, 3, 4):
        plan = plan_job("j", parse_job_spec(_job(parallelism={"virtualStages": v})), inv,
                        exhaustive=True)
        assert plan.virtual_stages == v
        pinned[v] = plan.predicted.step_time_s
    assert free.predicted.step_time_s == pytest.approx(min(pinned.values()), rel=1e-9)
    assert free.virtual_stages == min(pinned, key=lambda v: (pinned[v], v))
    assert f"chunks={free.virtual_stages}" in free.notes[1]


def _llama3_8b_plans(seq: int, gb: int) -> dict[str, object]:
    """llama3-8b at ``seq`` tokens on one node of 8 H100s (80 GB), planned with every
    recompute mode and ``auto``; a mode without a layout is left out."""
    inv = load_cluster(_cluster([_pool("h", "H100-SXM", 1, 8)]))
    plans = {}
    for mode in (*RECOMPUTE_MODES, "auto"):
        spec = parse_job_spec({"model": {"preset": "llama3-8b", "seqLen": seq},
                               "training": {"globalBatch": gb, "steps": 1,
                                            "optimizerSharding": True, "recompute": mode}})
        try:
            plans[mode] = plan_job("j", spec, inv)
        except PlanningError:
            continue
    return plans


def test_recompute_auto_picks_attention_free_at_128k_tokens() -> None:
    """128k tokens on 80 GB: none and selective keep too much, attention-free fits and skips
    the attention core's re-run forward, which dominates the FLOPs at this length: the planner
    takes it over full (54.4 s vs 65.7 s a step)."""
    plans = _llama3_8b_plans(131072, 8)
    assert "none" not in plans and "selective" not in plans
    free, full = (plans[m].predicted.step_time_s for m in ("attention-free", "full"))
    assert free < 0.9 * full
    assert plans["auto"].training.recompute == "attention-free"
    assert plans["auto"].predicted.step_time_s == pytest.approx(free, rel=1e-12)
    assert "recompute=auto chose attention-free" in plans["auto"].notes[-1]


@pytest.mark.parametrize("seq", [4096, 8192])
def test_recompute_auto_keeps_none_at_short_sequences(seq: int) -> None:
    """4k-8k tokens with memory to spare: recomputing anything only costs time."""
    plans = _llama3_8b_plans(seq, 16)
    times = {m: p.predicted.step_time_s for m, p in plans.items()}
    assert times["none"] < times["selective"] < times["attention-free"] < times["full"]
    assert plans["auto"].training.recompute == "none"


def test_virtual_stages_spec_errors() -> None:
    with pytest.raises(SpecError, match=r"spec.parallelism.virtualStages: only the interleaved"):
        parse_job_spec(_job(parallelism={"schedule": "1f1b", "virtualStages": 2}))
    with pytest.raises(SpecError, match=r"spec.parallelism.virtualStages: must be >= 2"):
        parse_job_spec(_job(parallelism={"virtualStages": 1}))


@pytest.mark.parametrize("layers,nodes", [(16, 4), (40, 1)])
def test_recompute_auto_is_best_pinned_mode(layers: int, nodes: int) -> None:
    inv = load_cluster(_cluster([_pool("a", "A100-80GB", nodes, 8)]))
    base = {"model": {"layers": layers, "hidden": 5120, "heads": 40, "seqLen": 2048,
                      "vocab": 32000},
            "training": {"globalBatch": 16, "steps": 1, "optimizerSharding": True}}
    times = {}
    for mode in RECOMPUTE_MODES:
        spec = parse_job_spec({**base, "training": {**base["training"], "recompute": mode}})
        try:
            times[mode] = plan_job("j", spec, inv).predicted.step_time_s
        except PlanningError:
            continue
    auto = plan_job("j", parse_job_spec({**base, "training": {**base["training"],
                                                                "recompute": "auto"}}), inv)
    assert times, "at least one mode fits"
    want = min(times, key=lambda k: times[k])
    assert auto.training.recompute == want  # concrete: the runtime never sees auto
    assert auto.predicted.step_time_s == pytest.approx(times[want], rel=1e-12)
    assert f"recompute=auto chose {want}" in auto.notes[-1]


# ---------------------------------------------------------------- refusals


def test_refusal_names_stage_need_capacity_and_only_helpful_options() -> None:
    inv = load_cluster(_cluster([_pool("a", "A100-80GB", 1, 8)]))
    spec = parse_job_spec({
        "model": {"preset": "llama3-70b"},
        "training": {"globalBatch": 8, "steps": 1, "recompute": "full",
                     "optimizerSharding": True},
        "parallelism": {"tp": 8, "pp": 1},
    })
    with pytest.raises(PlanningError) as err:
        plan_job("j", spec, inv)
    msg = err.value.message
    assert "the weights, gradients and optimizer state alone need" in msg
    assert "GiB usable (92% of 75 GiB)" in msg  # 80 GB = 74.5 GiB
    assert "recompute: full" not in msg  # already on
    assert "optimizerSharding" not in msg  # already on
    assert "unpin spec.parallelism (tp=8, pp=1)" in msg
    assert "sharding" not in msg  # dp = 1 (tp=8 on 8 GPUs): no ZeRO stage shards anything
    # the same job without those options suggests none of them either: the state alone does
    # not fit (recompute would not help), and at dp = 1 neither would any sharding
    spec2 = dataclasses.replace(spec, training=dataclasses.replace(
        spec.training, recompute="selective", optimizer_sharding=False))
    assert spec2.training.sharding == "none"
    with pytest.raises(PlanningError) as err2:
        plan_job("j", spec2, inv)
    assert "recompute" not in err2.value.message
    assert "sharding" not in err2.value.message


def test_refusal_names_the_limiting_stage_when_activations_do_not_fit() -> None:
    inv = load_cluster(_cluster([_pool("a", "A100-80GB", 1, 8)]))
    spec = parse_job_spec({
        "model": {"preset": "gpt3-1.3b"},
        "training": {"globalBatch": 16, "steps": 1, "recompute": "none", "microBatch": 16},
        "parallelism": {"tp": 1, "pp": 1, "dp": 1},
    })
    with pytest.raises(PlanningError) as err:
        plan_job("j", spec, inv)
    msg = err.value.message
    assert "stage" in msg and "(A100-80GB, tp=1, dp=1, microBatch 16" in msg
    assert "GiB per device for 24 layers; it has 68.5 GiB usable (92% of 75 GiB)" in msg
    assert "set spec.training.recompute: full (now none)" in msg
    assert "lower spec.training.microBatch (now 16)" in msg
    assert "optimizerSharding" not in msg  # on by default
    assert "maxGPUs" not in msg and "spec.placement" not in msg  # nothing restricts them


def test_cross_dc_auto_is_best_of_sync_and_compress() -> None:
    pools = [{**_pool("a", "H100-SXM", 1, 8), "datacenter": "a"},
             {**_pool("b", "H100-SXM", 1, 8), "datacenter": "b"}]
    cluster = {**_cluster(pools), "datacenters": [{"name": "a"}, {"name": "b"}],
               "links": [{"between": ["a", "b"], "bandwidthGbps": 10, "latencyMs": 20}]}
    inv = load_cluster(cluster)
    base = {"model": {"preset": "gpt3-1.3b"}, "training": {"globalBatch": 64, "steps": 1},
            "parallelism": {"dp": 2, "tp": 8, "pp": 1}}  # DP across the slow link
    times = {mode: plan_job("j", parse_job_spec({**base, "crossDC": {"mode": mode}}), inv)
             for mode in ("sync", "compress")}
    auto = plan_job("j", parse_job_spec({**base, "crossDC": {"mode": "auto"}}), inv)
    want = min(times, key=lambda k: (times[k].predicted.step_time_s, k != "sync"))
    assert want == "compress"  # bf16 halves the bytes on the 10 Gbps link
    assert auto.cross_dc["mode"] == want  # concrete: the runtime never sees auto
    assert auto.predicted.step_time_s == times[want].predicted.step_time_s
    assert f"crossDC.mode=auto chose {want}" in auto.notes[-1]
    # compression none leaves only sync
    none = plan_job("j", parse_job_spec({**base, "crossDC": {"mode": "auto",
                                                             "compression": "none"}}), inv)
    assert none.cross_dc["mode"] == "sync"
    assert none.predicted.step_time_s == times["sync"].predicted.step_time_s


@pytest.mark.parametrize("precision,factor", [("bf16", 1.25), ("fp32", 1.5)])
def test_dp_sync_charges_the_runtimes_zero1_all_reduce_and_all_gather(precision: str,
                                                                      factor: float) -> None:
    """runtime/optim.py: ZeRO-1 all-reduces the fp32 main grads, then all-gathers the params
    at the training precision (eb bytes vs the all-reduce's 2·4): 1 + eb/8 all-reduces."""
    from hettrain.planning import planner as P
    from hettrain.planning.units import build_units

    inv = load_cluster(_cluster([_pool("a", "A100-80GB", 2, 8)]))
    unit = build_units(inv.pools, merged=False)[0]
    per = {}
    for sharding in (False, True):
        spec = parse_job_spec({"model": {"preset": "gpt3-1.3b"},
                               "training": {"globalBatch": 16, "steps": 1,
                                            "precision": precision,
                                            "optimizerSharding": sharding,
                                            "overlapGradReduce": False}})
        per[sharding] = P._dp_sync_coeffs(unit, 4, 4, inv, spec, 1, 1.0, 0.0, False, False)
        red = P._dp_rates(unit, 4, 4, inv, spec)[1]
    # dp·tp = 16 GPUs span 2 nodes, 2 members of the DP group per node: reduce-scatter and
    # all-gather over NVLink, each member's half between the nodes over its own NIC share
    nic = unit.nic_gbytes_per_gpu * 1e9
    intra = unit.device.intra_node_gbps * 1e9
    assert red == pytest.approx(2 * 1 / 2 / intra + 2 * 1 / 2 / 2 / nic)
    grad_layer = cost.layer_params(spec.model) * 4.0 / 4
    assert per[False][0] == pytest.approx(grad_layer * red)
    assert per[True][0] == pytest.approx(factor * per[False][0])


def test_prediction_reports_the_bottleneck_stages_tp_comm() -> None:
    inv = load_cluster(_cluster([_pool("h", "H100-SXM", 2, 8)]))
    plan = plan_job("j", parse_job_spec(_job(parallelism={"schedule": "1f1b", "pp": 2,
                                                          "tp": 8})), inv)
    slow = max(plan.stages, key=lambda st: st.time_ms)
    per_layer = cost.tp_comm_per_layer_s(plan.model, plan.micro_batch, 8,
                                         load_cluster(_cluster([_pool("h", "H100-SXM", 1, 8)]))
                                         .pools[0].device, 2, "selective")
    want = plan.num_microbatches * (slow.layer_end - slow.layer_start) * per_layer
    assert plan.predicted.tp_comm_s == pytest.approx(want, rel=1e-12)
    assert 0 < plan.predicted.tp_comm_s < plan.predicted.compute_s


def test_palm_formula_hand_value() -> None:
    spec = parse_job_spec({"model": {"layers": 2, "hidden": 64, "heads": 4, "seqLen": 16,
                                     "vocab": 100},
                           "training": {"globalBatch": 2, "steps": 1}})
    # params: 2·(4·64² + 2·64·256 + 2·64) + 2·100·64 + 64 = 111,424
    assert spec.model.parameters() == 111_424
    per_token = 6 * 111_424 + 12 * 2 * 4 * 16 * 16  # 6N + 12·L·H·Q·T
    assert fidelity.palm_flops_per_step(spec) == per_token * 2 * 16 == 22_179_840


@pytest.mark.parametrize("mode,codec", [("sync", 1.0), ("compress", 0.5)])
def test_cross_dc_bytes_count_zero1s_uncompressed_all_gather(mode: str, codec: float) -> None:
    """Across 2 DCs the gradient all-reduce sends 2(k-1)/k = 1 byte per fp32 byte of the stage
    (bf16 codec: 0.5), and ZeRO-1's parameter all-gather (HetCommunicator.dp_all_gather_, once
    per byte per receiving DC, never compressed) eb/8 more; tests/runtime/training/
    test_cross_dc.py measures that all-gather on real processes."""
    from hettrain.planning import planner as P
    from hettrain.planning.units import build_units

    pools = [{**_pool("a", "H100-SXM", 1, 8), "datacenter": "a"},
             {**_pool("b", "H100-SXM", 1, 8), "datacenter": "b"}]
    cluster = {**_cluster(pools), "datacenters": [{"name": "a"}, {"name": "b"}],
               "links": [{"between": ["a", "b"], "bandwidthGbps": 10, "latencyMs": 20}]}
    inv = load_cluster(cluster)
    unit = build_units(inv.pools, merged=True)[0]
    assert len(unit.datacenters) == 2
    spec = parse_job_spec({"model": {"preset": "gpt3-1.3b"},
                           "training": {"globalBatch": 16, "steps": 1, "precision": "bf16",
                                        "optimizerSharding": True},
                           "crossDC": {"mode": mode, "compression": "bf16"}})
    _, red, gat, x_red, x_gat = P._dp_rates(unit, 2, 1, inv, spec)
    assert x_red == pytest.approx(codec)
    assert x_gat == pytest.approx(2 / 8)  # bf16 parameters: eb = 2
    link = 10 / 8 * 1e9  # bytes/s; dp 2 = one GPU per DC: no intra-DC term
    assert red == pytest.approx(codec / link)
    assert gat == pytest.approx(2 / 8 / link)


def _llama_layer_s(device: DeviceSpec, elem_bytes: int) -> float:
    model = parse_job_spec({"model": {"preset": "llama3-8b", "seqLen": 8192},
                            "training": {"globalBatch": 1, "steps": 1}}).model
    return cost.layer_compute_s(model, 1, 1, device, "none", elem_bytes)


def test_fp32_layers_run_at_the_fp32_matrix_rate_not_the_bf16_one() -> None:
    """An fp32 plan's GEMMs and attention run at fp32_tflops·fp32_efficiency (the runtime
    leaves TF32 off): on an H200 the two-layer 8B stage of bench/gpu_check.py measured 7.9x
    its bf16 time; the model's layer ratio sits near the peak ratio, minus the HBM-bound part."""
    from hettrain.planning.catalog import CATALOG, FP32_FALLBACK_RATIO

    h200 = CATALOG["H200"]
    assert h200.matmul_flops(2) == h200.effective_flops
    assert h200.matmul_flops(4) == pytest.approx(67e12 * h200.fp32_efficiency)
    # with one attention efficiency for both (fp32 has no flash kernel; bf16 does on Hopper)
    plain = dataclasses.replace(h200, attention_efficiency=cost.FP32_ATTENTION_EFFICIENCY)
    ratio = _llama_layer_s(plain, 4) / _llama_layer_s(plain, 2)
    assert 7.0 < ratio < (989 * h200.efficiency) / (67 * h200.fp32_efficiency)
    # measured on the H200 (fwd+bwd of the stage without its optimizer step): about 9.7
    assert 8.0 < _llama_layer_s(h200, 4) / _llama_layer_s(h200, 2) < 12.0
    # no published FP32 rate (Gaudi, Ascend): bf16 / FP32_FALLBACK_RATIO
    gaudi = CATALOG["Gaudi2"]
    assert gaudi.fp32_tflops == 0.0
    assert gaudi.matmul_flops(4) == pytest.approx(
        432e12 / FP32_FALLBACK_RATIO * gaudi.fp32_efficiency)
    # the CPU pseudo-device runs fp32 and bf16 matmuls at one rate (the demo's calibration)
    assert CATALOG["CPU"].matmul_flops(4) == CATALOG["CPU"].matmul_flops(2)


def test_a_declared_device_takes_its_fp32_rate_and_an_fp32_plan_is_slower() -> None:
    base = {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "x"},
            "datacenters": [{"name": "a"}],
            "devices": [{"name": "X1", "vendor": "amd", "bf16Tflops": 500, "hbmGiB": 192,
                         "hbmTBps": 4, "intraNodeGBps": 400, "backend": "nccl",
                         "fp32Tflops": 100}],
            "pools": [{"name": "p", "datacenter": "a", "device": "X1", "nodes": 1,
                       "gpusPerNode": 8, "nicGbps": 400}]}
    inv = load_cluster(base)
    assert inv.pools[0].device.fp32_tflops == 100
    times = {}
    for precision in ("bf16", "fp32"):
        spec = parse_job_spec({"model": {"preset": "llama3-8b", "layers": 8},
                               "training": {"globalBatch": 8, "steps": 1,
                                            "precision": precision},
                               "parallelism": {"tp": 1, "pp": 1, "dp": 8}})
        times[precision] = plan_job("j", spec, inv).predicted.step_time_s
    # the GEMMs alone: 500·0.45 / (100·0.85) = 2.65x; the attention core (no fp32 flash
    # kernel: FP32_ATTENTION_EFFICIENCY vs ATTENTION_EFFICIENCY) at most 2.65·0.75/0.5; the
    # rest (HBM, DP) grows less
    att = cost.ATTENTION_EFFICIENCY / cost.FP32_ATTENTION_EFFICIENCY
    assert 2.0 < times["fp32"] / times["bf16"] <= 2.65 * att
    bad = {**base, "devices": [{**base["devices"][0], "fp32Tflops": 0}]}
    with pytest.raises(PlanningError, match="fp32Tflops"):
        load_cluster(bad)


# ---------------------------------------------------------------- the optimizer step


def _one_stage_plan(precision: str, sharding: bool, dp: int, profile=None):
    inv = load_cluster(_cluster([_pool("h", "H100-SXM", 1, 8)]))
    if profile is not None:
        from hettrain.planning.profiles import apply_profiles
        inv = apply_profiles(inv, [profile])
    spec = parse_job_spec({"model": {"preset": "llama3-8b", "layers": 4},
                           "training": {"globalBatch": dp, "steps": 1, "precision": precision,
                                        "optimizerSharding": sharding},
                           "parallelism": {"tp": 1, "pp": 1, "dp": dp, "cp": 1}})
    return spec, plan_job("j", spec, inv)


@pytest.mark.parametrize("precision,sharding,dp", [("bf16", False, 1), ("bf16", True, 4),
                                                   ("fp32", True, 2)])
def test_the_step_adds_the_optimizer_step_at_the_hbm_bandwidth(precision, sharding, dp):
    """runtime/optim.py's step after the gradient sync: 84 bytes per owned parameter (+6 for
    the cast below fp32) and 4 per held one (zeroing the main grads), ZeRO-1 owning 1/dp, at
    OPTIMIZER_HBM_EFFICIENCY of the HBM bandwidth; counted in the step, not in dp_comm_s."""
    spec, plan = _one_stage_plan(precision, sharding, dp)
    model = spec.model
    params = cost.layer_params(model) * model.layers + 2 * cost.embedding_params(model)
    owned = params / dp if sharding else params
    per = 84.0 + (6.0 if precision != "fp32" else 0.0)
    want = (owned * per + params * 4.0) / (3.35e12 * 0.8)
    p = plan.predicted
    assert p.optimizer_s == pytest.approx(want, rel=1e-9)
    # one stage, one replica's pipeline: the step is its pipeline, the sync and the optimizer
    assert p.step_time_s == pytest.approx(p.compute_s + p.bubble_s + p.dp_comm_s + want,
                                          rel=1e-9)


def test_a_profiles_measured_optimizer_bandwidth_replaces_the_hbm_one() -> None:
    from hettrain.planning.profiles import profile_doc, profile_from_doc

    spec, plain = _one_stage_plan("bf16", False, 1)
    rows = [(1, 0.010, 0.020), (2, 0.018, 0.036)]
    doc = profile_doc("H100-SXM", {}, spec.model, rows, optimizer_bytes_per_s=1e12)
    prof = profile_from_doc(doc, "p")
    assert prof.optimizer_bytes_per_s == 1e12
    _, profiled = _one_stage_plan("bf16", False, 1, prof)
    assert profiled.predicted.optimizer_s == pytest.approx(
        plain.predicted.optimizer_s * 3.35e12 * 0.8 / 1e12, rel=1e-9)
    for bad in (0, -1.0, "fast", float("nan"), True):
        with pytest.raises(PlanningError, match="optimizerBytesPerS"):
            profile_from_doc({**doc, "optimizerBytesPerS": bad}, "p")
    assert profile_from_doc({k: v for k, v in doc.items() if k != "optimizerBytesPerS"},
                            "p").optimizer_bytes_per_s == 0.0
