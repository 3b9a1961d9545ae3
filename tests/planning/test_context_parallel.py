"""Context parallelism in the planner: long sequences where CP wins, checked against brute force.

Two ways CP wins in the cost model (planning/context.py, cost.stage_memory): over PCIe (L40S:
32 GB/s between GPUs) the TP all-reduces of every layer cost more than CP's K/V exchange, and
at long sequences the activations of a full sequence do not fit an 80 GB GPU without
recomputation while a CP rank holds ``1/cp`` of them."""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import replace

import pytest

from hettrain.api.spec import parse_job_spec
from hettrain.planning import context, cost
from hettrain.planning.errors import PlanningError
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import CP_MIN_LOCAL_TOKENS, _cp_options, _cp_orders, plan_job
from hettrain.planning.support import context_parallel_errors


def _cluster(device: str, nodes: int, gpus: int = 8, nic: float = 400) -> dict:
    return {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "h"},
            "datacenters": [{"name": "a"}],
            "pools": [{"name": "p", "datacenter": "a", "device": device, "nodes": nodes,
                       "gpusPerNode": gpus, "nicGbps": nic}]}


def _job(seq: int, layers: int, gb: int, recompute: str, overlap: bool = True,
         **parallelism) -> dict:
    return {"model": {"preset": "llama3-8b", "seqLen": seq, "layers": layers},
            "training": {"globalBatch": gb, "steps": 1, "recompute": recompute,
                         "optimizerSharding": True, "overlapGradReduce": overlap},
            "parallelism": parallelism}


def _brute_force_one_stage(spec, inv) -> tuple[float, int, int, int]:
    """(step seconds, cp, tp, micro_batch) of the fastest single-stage layout of one replica
    (global batch 1: dp = 1) on one node, by enumerating the cost model directly: every
    ``tp·cp ≤`` GPUs per node, the step is ``layers·layer + head`` (one stage, one microbatch:
    no bubble, no pipeline boundary) plus the gradient sync of the ``cp`` ranks and the
    optimizer step, and the stage
    must fit ``MEMORY_HEADROOM`` of its HBM; each with the whole-sequence loss and, from 16k
    tokens, the chunked one (and with a re-run layer the whole and the chunked MLP)."""
    pool = inv.pools[0]
    dev, model = pool.device, spec.model
    best = (float("inf"), 0, 0, 0)
    # the whole-sequence loss and, from 16k tokens, the chunked one (cost.loss_chunk_tokens)
    chunks = sorted({0, cost.loss_chunk_tokens(model)})
    # and, with a re-run layer from 16k tokens, the whole and the chunked MLP
    mlps = sorted({0, cost.mlp_chunk_tokens(model, spec.training)})
    for chunk, mlp, cp, tp in itertools.product(chunks, mlps, (1, 2, 4, 8), (1, 2, 4, 8)):
        training = replace(spec.training, loss_chunk_tokens=chunk, mlp_chunk_tokens=mlp)
        if tp * cp > pool.gpus_per_node or model.seq_len % (2 * cp):
            continue
        link = context.cp_link(dev, pool.gpus_per_node, pool.nic_gbytes_per_gpu, tp, cp)
        layer = context.cp_layer_time_s(model, training, 1, tp, cp, dev, link)
        head = context.cp_head_time_s(model, 1, tp, cp, dev, loss_chunk_tokens=chunk)
        mem = cost.stage_memory(model, training, tp=tp, dp=1, cp=cp, micro_batch=1,
                                first=True, last=True,
                                **cost.schedule_memory_args(0, 1, 1, "1f1b"))
        if mem.bytes_for(model.layers) > dev.hbm_bytes * cost.MEMORY_HEADROOM:
            continue
        # the DP×CP gradient all-reduce (dp = 1: the cp ranks), after the backward
        # (overlapGradReduce: false), ZeRO-1's parameter all-gather adding eb/8 of its bytes
        grads = 4.0 * (cost.layer_params(model) * model.layers / tp
                       + 2 * cost.embedding_params(model) / cost.vocab_shards(model, tp))
        bw = (dev.intra_node_gbps if cp * tp <= pool.gpus_per_node
              else pool.nic_gbytes_per_gpu)
        factor = 1 + cost.precision_bytes(training) / 8
        sync = cost.ring_all_reduce_s(grads * factor, cp, bw) if cp > 1 else 0.0
        # then the optimizer step over the rank's parameters (ZeRO-1 over the cp ranks)
        opt = cost.optimizer_step_s(grads / 4.0, training, cp, dev)
        best = min(best, (model.layers * layer + head + sync + opt, cp, tp, 1))
    return best


@pytest.mark.parametrize("recompute", ["none", "selective", "attention-free", "full"])
def test_pcie_long_sequence_planner_picks_the_brute_force_cp(recompute):
    """llama3-8b (8 of its layers) at 32k tokens on 8 L40S (PCIe), one sequence per step: the
    planner's best single-stage layout is the brute-force optimum of the cost model, and it
    uses CP (TP=8 over PCIe is slower)."""
    inv = load_cluster(_cluster("L40S", 1))
    spec = parse_job_spec(_job(32768, 8, 1, recompute, overlap=False, pp=1))
    want, cp, tp, _ = _brute_force_one_stage(spec, inv)
    plan = plan_job("j", spec, inv)
    assert plan.predicted.step_time_s == pytest.approx(want, rel=1e-9)
    assert (plan.stages[0].cp, plan.stages[0].tp) == (cp, tp)
    if recompute != "selective":
        # with selective recompute the brute force's optimum is tp = 8 (narrowly); there the
        # test checks only that the planner finds it
        assert cp > 1
    assert context_parallel_errors(plan) == []


def test_pcie_long_sequence_cp_beats_every_cp1_layout_exhaustively():
    """Unpinned pipeline depth and recompute: the fast plan equals the exhaustive one, is the
    best of the exhaustive plans at each pinned CP degree, has cp > 1, and beats cp = 1."""
    inv = load_cluster(_cluster("L40S", 1))
    job = _job(32768, 8, 1, "auto")
    fast = plan_job("j", parse_job_spec(job), inv)
    full = plan_job("j", parse_job_spec(job), inv, exhaustive=True)
    assert fast.predicted.step_time_s == pytest.approx(full.predicted.step_time_s, rel=1e-9)
    pinned = {cp: plan_job("j", parse_job_spec(_job(32768, 8, 1, "auto", cp=cp)), inv,
                           exhaustive=True).predicted.step_time_s for cp in (1, 2, 4, 8)}
    assert full.predicted.step_time_s == pytest.approx(min(pinned.values()), rel=1e-9)
    assert fast.stages[0].cp > 1
    assert pinned[1] > fast.predicted.step_time_s * 1.05


def test_memory_forces_cp_at_32k_on_80gb_gpus():
    """llama3-8b (all 32 layers) at 32k tokens on 2 x 8 H100-SXM (80 GB), two pipeline
    stages, no recomputation, TP pinned to 1 (with sequence parallelism tp = 8 alone would
    fit): no cp = 1 layout fits (a full sequence's activations), CP ones do; the fast search
    equals the exhaustive one and the best pinned CP degree."""
    inv = load_cluster(_cluster("H100-SXM", 2))
    with pytest.raises(PlanningError, match="does not fit"):
        plan_job("j", parse_job_spec(_job(32768, 32, 16, "none", pp=2, tp=1, cp=1)), inv)
    assert plan_job("j", parse_job_spec(_job(32768, 32, 16, "none", pp=2, cp=1)),
                    inv).stages[0].tp > 1  # TP unpinned: TP + SP shards the activations
    job = _job(32768, 32, 16, "none", pp=2, tp=1)
    fast = plan_job("j", parse_job_spec(job), inv)
    full = plan_job("j", parse_job_spec(job), inv, exhaustive=True)
    assert fast.predicted.step_time_s == pytest.approx(full.predicted.step_time_s, rel=1e-9)
    times = []
    for cp in (2, 4, 8):
        with contextlib.suppress(PlanningError):  # a degree may not fit either
            times.append(plan_job("j", parse_job_spec(_job(32768, 32, 16, "none", pp=2, tp=1,
                                                           cp=cp)),
                                  inv, exhaustive=True).predicted.step_time_s)
    assert full.predicted.step_time_s == pytest.approx(min(times), rel=1e-9)
    assert fast.stages[0].cp > 1
    assert all(s.memory_gib <= s.capacity_gib * cost.MEMORY_HEADROOM for s in fast.stages)
    assert fast.world_size == fast.dp * sum(s.tp * s.cp for s in fast.stages) <= 16
    assert context_parallel_errors(fast) == []


def test_cp_is_searched_while_each_rank_keeps_its_minimum_of_tokens():
    """CP degrees are searched while each rank keeps ``CP_MIN_LOCAL_TOKENS`` of the sequence:
    at 8k tokens 1, 2 and 4, and the plan is the fastest of the three pinned one by one (over
    PCIe on L40S a degree > 1 wins); at 2k tokens cp = 1 alone, and the plan says nothing of
    CP. Wider than a node too (over the NIC), but never wider than the pools' GPUs or than
    the largest degree a spec may pin (64)."""
    inv = load_cluster(_cluster("L40S", 1))
    assert CP_MIN_LOCAL_TOKENS == 2048
    spec = parse_job_spec(_job(8192, 8, 1, "none"))
    assert _cp_options(spec, inv.pools) == [1, 2, 4]
    plan = plan_job("j", spec, inv)
    pinned = {cp: plan_job("j", parse_job_spec(_job(8192, 8, 1, "none", cp=cp)),
                           inv).predicted.step_time_s for cp in (1, 2, 4)}
    assert plan.predicted.step_time_s == pytest.approx(min(pinned.values()), rel=1e-12)
    assert plan.stages[0].cp == min(pinned, key=pinned.get) > 1
    short = parse_job_spec(_job(2048, 8, 1, "none"))
    assert _cp_options(short, inv.pools) == [1]
    plan = plan_job("j", short, inv)
    assert [s.cp for s in plan.stages] == [1] * plan.pp
    assert "cp" not in plan.to_json()
    long = parse_job_spec(_job(131072, 8, 1, "none"))
    assert _cp_options(long, inv.pools) == [1, 2, 4, 8]  # one 8-GPU node
    assert _cp_options(long, load_cluster(_cluster("L40S", 4)).pools) == [1, 2, 4, 8, 16, 32]
    assert _cp_options(long, load_cluster(_cluster("L40S", 16)).pools)[-1] == 64
    longer = parse_job_spec(_job(262144, 8, 1, "none"))
    assert _cp_options(longer, load_cluster(_cluster("L40S", 32)).pools)[-1] == 64


def test_a_replan_keeps_the_cp_degree():
    """A re-plan searches the previous plan's CP degree alone (another degree moves nearly
    every rank): the previous plan pinned to cp 1 on two L40S nodes, re-planned unpinned on
    one node, stays cp 1, though a first plan there picks cp > 1. ``_cp_orders``: the
    previous degree, then (:func:`test_a_replan_falls_back_to_every_degree`) all of them;
    a first plan's order is the second widest, the widest, then down."""
    two, one = load_cluster(_cluster("L40S", 2)), load_cluster(_cluster("L40S", 1))
    spec = parse_job_spec(_job(8192, 8, 1, "none"))
    previous = plan_job("j", parse_job_spec(_job(8192, 8, 1, "none", cp=1)), two)
    assert previous.stages[0].cp == 1
    assert plan_job("j", spec, one).stages[0].cp > 1
    again = plan_job("j", spec, one, previous=previous)
    assert [s.cp for s in again.stages] == [1] * again.pp
    assert _cp_orders([1, 2, 4], previous) == [[1], [2, 4, 1]]
    assert _cp_orders([1, 2, 4], None) == [[2, 4, 1]]
    assert _cp_orders([1, 2, 4, 8], None) == [[4, 8, 2, 1]]
    assert _cp_orders([1, 2], None) == [[2, 1]]
    assert _cp_orders([1], previous) == [[1]]


def test_a_replan_falls_back_to_every_degree():
    """Where the previous degree finds no layout the re-plan searches every degree: cp 8 of
    a 64k-token replica fits an H100 node (the previous plan) but not an L40S node, where
    the re-plan then finds the same plan as a first plan there; where the previous degree
    is no option at all (4 GPUs in all: cp ≤ 4), every degree from the start."""
    spec = parse_job_spec(_job(65536, 8, 1, "none"))
    previous = plan_job("j", parse_job_spec(_job(65536, 8, 1, "none", cp=8)),
                        load_cluster(_cluster("H100-SXM", 1)))
    assert previous.stages[0].cp == 8
    l40s = load_cluster(_cluster("L40S", 1))
    with pytest.raises(PlanningError):
        plan_job("j", parse_job_spec(_job(65536, 8, 1, "none", cp=8)), l40s)
    again = plan_job("j", spec, l40s, previous=previous)
    first = plan_job("j", spec, l40s)
    assert again.stages[0].cp == first.stages[0].cp < 8
    assert again.predicted.step_time_s == pytest.approx(first.predicted.step_time_s, rel=1e-12)
    small = load_cluster(_cluster("L40S", 1, gpus=4))
    assert _cp_orders(_cp_options(spec, small.pools), previous) == [[2, 4, 1]]
    assert plan_job("j", spec, small, previous=previous).stages[0].cp in (1, 2, 4)


def test_cp_ranks_sync_gradients_even_at_dp_1():
    """The DP×CP group: with dp = 1 and cp = 2 the two CP ranks still all-reduce their
    gradients (``_dp_exposed`` and the sync see ``dp·cp`` ranks); overlapped with the backward
    it is never more exposed than after it."""
    inv = load_cluster(_cluster("L40S", 1))
    times = {}
    for ov in (True, False):
        plan = plan_job("j", parse_job_spec(_job(32768, 8, 1, "none", overlap=ov, cp=2, pp=1)),
                        inv)
        assert (plan.dp, plan.stages[0].cp) == (1, 2)
        times[ov] = plan.predicted.dp_comm_s
    assert times[True] > 0 and times[False] > 0
    assert times[True] <= times[False]


def test_step_time_for_split_prices_a_cp_plan_like_the_search():
    """``planner.step_time_for_split`` (bench/plan_scale.py) re-prices a CP plan's own split
    to its predicted step time (it rebuilds the DP×CP group from ``plan.dp`` and the stages'
    ``cp``)."""
    from hettrain.planning.planner import step_time_for_split
    inv = load_cluster(_cluster("H100-SXM", 2))
    spec = parse_job_spec(_job(32768, 32, 16, "none", pp=2))
    plan = plan_job("j", spec, inv)
    assert plan.stages[0].cp > 1
    split = [s.layers for s in plan.stages]
    assert step_time_for_split(spec, inv, plan, split) == pytest.approx(
        plan.predicted.step_time_s, rel=1e-9)


def test_calibration_prices_a_cp_stage_on_its_own_tokens():
    """Closed-loop calibration (``calibration.layer_scale``) compares a CP stage's measured
    layers with the CP rank's predicted compute (plus its TP collectives, which the layer clock
    measures too): measured = predicted gives scale 1, twice it gives 2 (with the whole
    sequence's compute it would read the device as cp× faster)."""
    from hettrain.planning import calibration as cal
    inv = load_cluster(_cluster("H100-SXM", 2))
    spec = parse_job_spec(_job(32768, 32, 16, "none", pp=2))
    plan = plan_job("j", spec, inv)
    assert plan.stages[0].cp > 1
    devices = cal.devices_of(inv)
    for k in (1.0, 2.0):
        measured = {}
        for s in plan.stages:
            eb = cost.precision_bytes(spec.training)
            part = s.layers * (context.cp_layer_compute_s(
                spec.model, plan.micro_batch, s.tp, s.cp, devices[s.device], "none", eb)
                + cost.tp_comm_per_layer_s(spec.model, plan.micro_batch, s.tp,
                                           devices[s.device], eb, "none"))
            measured[(0, s.index)] = cal.StageMeasurement(s.index, s.time_ms / 1e3, 0.0, 5,
                                                     layers_s=k * part)
        assert cal.layer_scale(spec, plan, measured, devices) == pytest.approx({"H100-SXM": k})


@pytest.mark.parametrize(("device", "cp", "masks"), [("H100-SXM", 8, False), ("MI300X", 4, True)])
def test_cp_masks_counted_only_where_they_are_materialised(device, cp, masks):
    """A stage's CP causal masks (``L²·(2cp+1)`` elements per layer and microbatch in flight,
    recompute none) count on devices that materialise them (AMD, as the runtime passes the
    mask there) and not on NVIDIA, whose fused kernels take the lower-right bias: the plan's
    stage memory is ``cost.stage_memory`` with or without them, nothing else differs."""
    inv = load_cluster(_cluster(device, 2))
    spec = parse_job_spec(_job(32768, 32, 16, "none", pp=2, tp=1, cp=cp))
    plan = plan_job("j", spec, inv)
    assert cost.skips_masked_tiles(inv.pools[0].device) is not masks
    st, m = plan.stages[0], plan.num_microbatches
    args = cost.schedule_memory_args(0, plan.pp, m, plan.schedule, plan.virtual_stages)
    kw = {"tp": st.tp, "dp": plan.dp, "cp": cp, "micro_batch": plan.micro_batch, "first": True,
          "last": plan.pp == 1, **args}
    with_masks = cost.stage_memory(spec.model, spec.training, cp_masks=True, **kw)
    without = cost.stage_memory(spec.model, spec.training, cp_masks=False, **kw)
    chunk = 32768 // (2 * cp)
    per_layer = chunk * chunk * (2 * cp + 1) * cost.precision_bytes(spec.training)
    assert with_masks.per_layer - without.per_layer == pytest.approx(per_layer * args["in_flight"])
    want = (with_masks if masks else without).bytes_for(st.layers) / cost.GIB
    assert st.memory_gib == pytest.approx(want, abs=1e-3)  # the plan rounds to MiB
