"""``spec.training.sharding`` (none | optimizer | gradients | full | auto): spec parsing and
back-compat with ``optimizerSharding``, the memory and time of each option against hand-computed
values, ``auto``, the runtime's rules (planning/support.py), refusal messages, the CRD and the
plan JSON round trip."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.planning.test_fast_vs_exhaustive import _assert_fast_equals_exhaustive, instances

from hettrain.api.spec import SHARDING_SPEC_MODES, SpecError, TrainingSpec, parse_job_spec
from hettrain.planning import cost
from hettrain.planning import planner as P
from hettrain.planning.errors import NotFaster, PlanningError
from hettrain.planning.inventory import load_cluster
from hettrain.planning.plan import Plan
from hettrain.planning.planner import plan_job
from hettrain.planning.support import unsupported
from hettrain.planning.units import build_units

ROOT = Path(__file__).resolve().parents[2]


def _cluster(device: str, nodes: int, gpn: int, nic: int = 400) -> dict:
    return {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "t"},
            "datacenters": [{"name": "a"}],
            "pools": [{"name": "p", "datacenter": "a", "device": device, "nodes": nodes,
                       "gpusPerNode": gpn, "nicGbps": nic}]}


def _spec(training: dict | None = None, **over) -> object:
    job = {"model": {"layers": 2, "hidden": 1024, "heads": 16, "seqLen": 512, "vocab": 1000},
           "training": {"globalBatch": 8, "steps": 1, **(training or {})}, **over}
    return parse_job_spec(job)


# ---------------------------------------------------------------- spec


@pytest.mark.parametrize("value", ["none", "optimizer", "gradients", "full", "auto"])
def test_every_sharding_value_parses(value: str) -> None:
    t = _spec({"sharding": value}).training
    assert t.sharding == value
    assert t.optimizer_sharding is (value != "none")


@pytest.mark.parametrize("flag,want", [(None, "optimizer"), (True, "optimizer"),
                                       (False, "none")])
def test_absent_sharding_follows_optimizer_sharding(flag: bool | None, want: str) -> None:
    t = _spec({} if flag is None else {"optimizerSharding": flag}).training
    assert (t.sharding, t.optimizer_sharding) == (want, want != "none")


@pytest.mark.parametrize("flag,sharding", [(False, "full"), (False, "optimizer"),
                                           (False, "auto"), (True, "none")])
def test_disagreeing_fields_are_a_spec_error_naming_both(flag: bool, sharding: str) -> None:
    with pytest.raises(SpecError) as err:
        _spec({"optimizerSharding": flag, "sharding": sharding})
    assert err.value.field == "spec.training.sharding"
    msg = err.value.message
    assert f"sharding: {sharding}" in msg and f"optimizerSharding: {str(flag).lower()}" in msg
    assert "remove optimizerSharding" in msg


@pytest.mark.parametrize("flag,sharding", [(True, "gradients"), (False, "none"),
                                           (True, "auto")])
def test_agreeing_fields_parse(flag: bool, sharding: str) -> None:
    assert _spec({"optimizerSharding": flag, "sharding": sharding}).training.sharding == sharding


def test_unknown_sharding_is_refused() -> None:
    with pytest.raises(SpecError, match="must be one of none, optimizer, gradients, full, auto"):
        _spec({"sharding": "zero3"})


def test_training_spec_keeps_the_flag_and_the_sharding_in_step() -> None:
    t = TrainingSpec(global_batch=8, steps=1)
    assert (t.sharding, t.optimizer_sharding) == ("optimizer", True)
    assert TrainingSpec(global_batch=8, steps=1, optimizer_sharding=False).sharding == "none"
    full = TrainingSpec(global_batch=8, steps=1, sharding="full")
    assert full.optimizer_sharding
    # either field turned off turns sharding off (dataclasses.replace passes both)
    assert dataclasses.replace(full, optimizer_sharding=False).sharding == "none"
    off = dataclasses.replace(full, sharding="none")
    assert (off.sharding, off.optimizer_sharding) == ("none", False)
    assert dataclasses.replace(full, sharding="gradients").sharding == "gradients"


@pytest.mark.parametrize("sharding", ["optimizer", "gradients", "full", "auto"])
def test_diloco_refuses_every_sharding_but_none(sharding: str) -> None:
    with pytest.raises(SpecError) as err:
        _spec({"sharding": sharding}, crossDC={"mode": "diloco"})
    assert err.value.field == "spec.training.sharding"
    assert "set spec.training.sharding: none" in err.value.message
    assert _spec({"sharding": "none"}, crossDC={"mode": "diloco"}).training.sharding == "none"


@pytest.mark.parametrize("sharding", ["gradients", "full"])
def test_zb_h1_and_replica_groups_refuse_zero2_and_3(sharding: str) -> None:
    with pytest.raises(SpecError, match="schedule: zb-h1"):
        _spec({"sharding": sharding}, parallelism={"schedule": "zb-h1"})
    with pytest.raises(SpecError, match="schedule: interleaved-zb"):
        _spec({"sharding": sharding}, parallelism={"schedule": "interleaved-zb"})
    with pytest.raises(SpecError, match="replicaGroups"):
        _spec({"sharding": sharding}, parallelism={"replicaGroups": True})
    # auto: skips what the rules forbid instead
    _spec({"sharding": "auto"}, parallelism={"schedule": "zb-h1", "replicaGroups": True})


def test_tied_embeddings_refuse_full_only() -> None:
    with pytest.raises(SpecError) as err:
        _spec({"sharding": "full"}, model={"preset": "llama-tiny", "tieEmbeddings": True})
    assert "tieEmbeddings: true" in err.value.message and "set sharding: gradients" in \
        err.value.message
    _spec({"sharding": "gradients"}, model={"preset": "llama-tiny", "tieEmbeddings": True})


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize("precision,want", [
    # d = 4: none p+4+12, optimizer p+4+12/d, gradients p+(4+12)/d, full (p+4+12)/d
    ("bf16", {"none": 18.0, "optimizer": 9.0, "gradients": 6.0, "full": 4.5}),
    # fp32: p = 4, master none, moments 8 (ZeRO-2: a master copy of its chunks, 4/d)
    ("fp32", {"none": 16.0, "optimizer": 10.0, "gradients": 8.0, "full": 4.0}),
])
def test_state_bytes_per_parameter_by_hand(precision: str, want: dict) -> None:
    for sharding, b in want.items():
        t = TrainingSpec(global_batch=8, steps=1, precision=precision, sharding=sharding)
        assert cost.state_bytes_per_param(t, 4) == b, sharding


@pytest.mark.parametrize("overlap", [False, True])
def test_stage_memory_adds_one_units_transient_by_hand(overlap: bool) -> None:
    model = _spec().model  # h 1024, f 4096: 12,582,912 matmul + 2·1024 norm params per layer
    layer = 12_582_912 + 2 * 1024
    assert cost.layer_matmul_params(model) == 12_582_912
    assert cost.SHARDING_REDUCES_IN_FLIGHT == 1
    kw = dict(tp=1, dp=4, micro_batch=1, in_flight=1, first=False, last=False)

    def mem(sharding: str) -> cost.StageMemory:
        t = TrainingSpec(global_batch=8, steps=1, sharding=sharding, recompute="none",
                         overlap_grad_reduce=overlap)
        return cost.stage_memory(model, t, **kw)

    opt, grads, full = mem("optimizer"), mem("gradients"), mem("full")
    # per layer: the state (bf16, d = 4: 9, 6, 4.5 bytes per parameter)
    assert grads.per_layer - opt.per_layer == pytest.approx(layer * (6.0 - 9.0))
    assert full.per_layer - opt.per_layer == pytest.approx(layer * (4.5 - 9.0))
    # fixed: one layer's fp32 bucket and bf16 grads (4 + 2); full also the gathered layer (2);
    # overlapped, one more bucket in flight (4) and, full, the prefetched layer (2)
    assert grads.fixed - opt.fixed == pytest.approx((6.0 + 4.0 * overlap) * layer)
    assert full.fixed - opt.fixed == pytest.approx((8.0 + 6.0 * overlap) * layer)
    assert mem("none").fixed == opt.fixed


def test_the_largest_unit_is_the_embedding_where_it_is() -> None:
    model = _spec(model={"layers": 2, "hidden": 1024, "heads": 16, "seqLen": 512,
                         "vocab": 64000}).model
    embed = 64000 * 1024  # 65.5M > a layer's 12.6M
    kw = dict(tp=1, dp=8, micro_batch=1, in_flight=1, first=True, last=False)
    t = {s: TrainingSpec(global_batch=8, steps=1, sharding=s) for s in ("optimizer", "full")}
    opt, full = (cost.stage_memory(model, t[s], **kw) for s in ("optimizer", "full"))
    # the table's state: (2+4+12/8) vs 18/8 bytes; the transient: 14 bytes of the table
    # (bucket 4, grad 2, gathered 2; overlapped: a bucket in flight 4, a prefetched unit 2)
    assert full.fixed - opt.fixed == pytest.approx(embed * (18 / 8 - 7.5) + 14.0 * embed)


# ---------------------------------------------------------------- time


def test_dp_sync_counts_per_option() -> None:
    assert cost.dp_sync_counts("none", 8) == (1, 0)
    assert cost.dp_sync_counts("optimizer", 8) == (1, 1)
    assert cost.dp_sync_counts("gradients", 8) == (8, 1)
    assert cost.dp_sync_counts("full", 8) == (8, 16)


@pytest.mark.parametrize("sharding,reduces,gathers", [
    ("optimizer", 1, 1), ("gradients", 4, 1), ("full", 4, 8)])
def test_dp_sync_seconds_by_hand(sharding: str, reduces: int, gathers: int) -> None:
    """A100 node, dp = 4, tp = 2 (one node: NVLink at 300 GB/s), bf16, m = 4 microbatches,
    overlap off so ZeRO-1's all-reduce is exposed too: R = n·(4·L/2)·2·3/4/300e9 + 2·3·20us,
    G = eb/8 of R's bytes; the stage pays reduces·R + gathers·G. ZeRO-2/3 run them unit by
    unit: a latency per layer (an all-gather's is half an all-reduce's) and per fixed unit."""
    inv = load_cluster(_cluster("A100-80GB", 1, 8))
    unit = build_units(inv.pools, merged=False)[0]
    assert cost.measured_comm(unit.device) is None and unit.device.intra_node_gbps == 300
    spec = _spec({"sharding": sharding, "overlapGradReduce": False, "globalBatch": 16})
    layer = cost.layer_params(spec.model)
    ring = 2 * 3 / 4 / 300e9
    lat = 2 * 3 * 20e-6
    per_unit = sharding != "optimizer"
    c, e = P._dp_sync_coeffs(unit, 4, 2, inv, spec, 4, 1.0, 0.0, False, False)
    red_c, gat_c = layer * 4.0 / 2 * ring, layer * 4.0 / 2 * ring * 2 / 8
    if per_unit:
        red_c, gat_c = red_c + lat, gat_c + lat / 2
    assert c == pytest.approx(reduces * red_c + gathers * gat_c, rel=1e-12)
    assert e == pytest.approx(0.0 if per_unit else reduces * lat, abs=1e-15)
    # the last stage also syncs the head: its fp32 grads (vocab·h / tp) in both collectives
    # (per unit: the final norm's and the head's collectives, two latencies each)
    c2, e2 = P._dp_sync_coeffs(unit, 4, 2, inv, spec, 4, 1.0, 0.0, False, True)
    head = 1000 * 1024 * 4.0 / 2
    assert c2 == c
    units = 2 if per_unit else 1
    assert e2 == pytest.approx(reduces * (units * lat + head * ring)
                               + gathers * (head * ring / 4 + (lat if per_unit else 0.0)),
                               rel=1e-12)


def test_measured_all_reduce_is_interpolated_between_its_sizes() -> None:
    from hettrain.planning.profiles import CommProfile
    rows = (("allReduce", 1000, 1e-4), ("allReduce", 100_000, 3e-3),
            ("allReduce", 1_000_000, 4e-3), ("p2p", 1000, 1e-5))
    comm = CommProfile(1e-5, 1e9, 5e-5, 1e9, ranks=2, rows=rows)
    assert comm.all_reduce_s(100_000) == pytest.approx(3e-3)
    assert comm.all_reduce_s(550_000) == pytest.approx(3.5e-3)  # halfway, linear
    # outside the measured sizes, the fitted line: 2 steps of latency + bytes·2·1/2 / bus
    assert comm.all_reduce_s(2_000_000) == pytest.approx(2 * 5e-5 + 2_000_000 / 1e9)
    # 4 ranks move 3/4 of the bytes per rank where 2 moved 1/2
    assert comm.all_reduce_s(100_000, 4) == pytest.approx(3e-3 * 1.5)


@pytest.mark.parametrize("sharding", ["gradients", "full"])
@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("layer_s,head_s", [(1.0, 0.0), (1e-4, 3e-4), (1e-6, 1e-6)])
@pytest.mark.parametrize("first,last", [(False, False), (True, False), (False, True)])
def test_zero23_expose_only_what_the_overlap_cannot_hide(sharding, recompute, layer_s,
                                                         head_s, first, last) -> None:
    """A100 node, dp = 4, tp = 2, m = 4: overlapped (the default, one pool), each
    microbatch's per-unit reductions (full: and backward gathers) run in its backward
    window, full's forward gathers in its forward window, by hand with cost.dp_exposed_coeffs;
    the unit whose reduction starts after the backward (and full's first gathers) exposed.
    Never more than the synchronous charge (overlapGradReduce: false), equal to it when
    there is no compute to hide behind."""
    inv = load_cluster(_cluster("A100-80GB", 1, 8))
    unit = build_units(inv.pools, merged=False)[0]
    m, share = 4, cost.DP_OVERLAP_SHARE
    on = _spec({"sharding": sharding, "globalBatch": 16, "recompute": recompute})
    off = _spec({"sharding": sharding, "globalBatch": 16, "recompute": recompute,
                 "overlapGradReduce": False})
    args = (unit, 4, 2, inv)
    c_on, e_on = P._dp_sync_coeffs(*args, on, m, layer_s, head_s, first, last)
    c_off, e_off = P._dp_sync_coeffs(*args, off, m, layer_s, head_s, first, last)
    for n in range(1, 9):  # a stage of n >= 1 layers
        assert c_on * n + e_on <= (c_off * n + e_off) * (1 + 1e-12)
    # by hand from the rates (no device profile here)
    lat, red, gat, _, _ = P._dp_rates(unit, 4, 2, inv, on)
    layer = cost.layer_params(on.model) * 4.0 / 2
    table = cost.embedding_params(on.model) * 4.0 / cost.vocab_shards(on.model, 2)
    n_fixed = int(first) + 2 * int(last)  # units beside the layers: embedding; norm, head
    # overlapped on NCCL the reductions are reduce-scatters: half an all-reduce's bytes and
    # steps (synchronous, off: all-reduces)
    rs = 0.5
    c_r, c_g = (layer * red + lat) * rs, layer * gat + lat / 2
    e_r = (lat + table * red * (first + last) + (n_fixed - 1) * lat) * rs
    e_g = table * gat * (first + last) + n_fixed * lat / 2
    c_ar = layer * red + lat  # the synchronous all-reduce's
    back = cost.backward_fraction(recompute)
    wb, wf = share * layer_s * back, share * layer_s * (1 - back)
    # exposed: a fixed unit's collective whole; a layer's beyond c' (at most the hidden share)
    first_red = (lat + table * red) * rs if first else 0.0
    layer_red = 0.0 if first else min(c_r, wb)
    if sharding == "full":
        first_gat = lat / 2 + table * gat if first else 0.0
        last_gat = lat / 2 + table * gat if last else 0.0
        layer_b = layer_red if last else min(c_r * (not first) + c_g, wb)
        bc = max(0.0, c_r + c_g - wb)
        be = (first_red + last_gat + layer_b
              + max(0.0, e_r + e_g - first_red - last_gat - share * head_s * 2 / 3))
        fc = max(0.0, c_g - wf)
        fe = (first_gat + (0.0 if first else min(c_g, wf))
              + max(0.0, e_g - first_gat - share * head_s / 3))
        want = m * (bc + fc), m * (be + fe)
    else:
        bc = max(0.0, c_r - wb)
        be = first_red + layer_red + max(0.0, e_r - first_red - share * head_s * 2 / 3)
        want = m * bc + c_g, m * be + e_g
    assert (c_on, e_on) == pytest.approx(want, rel=1e-12, abs=1e-18)
    if layer_s >= 1.0:  # a second of compute per layer hides every per-layer collective
        assert c_on == (0.0 if sharding == "full" else c_g)
    if layer_s == head_s == 1e-6:  # nothing to hide behind: all but share·window exposed
        assert c_on == pytest.approx(c_off - m * (c_ar - c_r) - m * share * layer_s
                                     * (1.0 if sharding == "full" else back), rel=1e-9)


@pytest.mark.parametrize("sharding", ["gradients", "full"])
def test_zero23_reductions_are_reduce_scatters_on_nccl_and_all_reduces_on_gloo(sharding):
    """The runtime reduce-scatters ZeRO-2/3's overlapped reductions on NCCL/HCCL and
    all-reduces them on gloo (whose reduce-scatter measured slower): with no compute to hide
    behind, the per-layer reduction the plan charges on an NCCL pool is half the same device's
    on gloo; the gathers are the same."""
    def coeffs(backend: str) -> tuple[float, float]:
        doc = _cluster("X", 1, 8)
        doc["devices"] = [{"name": "X", "vendor": "nvidia", "bf16Tflops": 300, "hbmGiB": 80,
                           "hbmTBps": 2.0, "intraNodeGBps": 300, "backend": backend}]
        inv = load_cluster(doc)
        unit = build_units(inv.pools, merged=False)[0]
        spec = _spec({"sharding": sharding, "globalBatch": 16})
        lat, red, gat, _, _ = P._dp_rates(unit, 4, 2, inv, spec)
        layer = cost.layer_params(spec.model) * 4.0 / 2
        gathers = (2 * 4 if sharding == "full" else 1) * (layer * gat + lat / 2)
        c, _ = P._dp_sync_coeffs(unit, 4, 2, inv, spec, 4, 0.0, 0.0, False, False)
        return c - gathers, layer * red + lat
    (nccl, ar), (gloo, ar_gloo) = coeffs("nccl"), coeffs("gloo")
    assert ar == pytest.approx(ar_gloo, rel=1e-12)  # the same link either way
    assert gloo == pytest.approx(4 * ar, rel=1e-9)  # m = 4 all-reduces
    assert nccl == pytest.approx(4 * ar / 2, rel=1e-9)  # m = 4 reduce-scatters


# ---------------------------------------------------------------- auto


def _tt_70b(sharding: str) -> object:
    """torchtitan's Llama 2 70B row (FSDP on 64 A100s), pinned dp = 64."""
    return parse_job_spec({
        "model": {"layers": 80, "hidden": 8192, "heads": 64, "kvHeads": 8, "ffnHidden": 28672,
                  "seqLen": 4096, "vocab": 32000, "gatedMlp": True},
        "training": {"globalBatch": 128, "steps": 1, "microBatch": 2, "recompute": "full",
                     "sharding": sharding},
        "parallelism": {"tp": 1, "pp": 1, "dp": 64, "schedule": "1f1b"}})


def test_auto_picks_full_where_only_full_fits() -> None:
    inv = load_cluster(_cluster("A100-80GB", 8, 8))
    for s in ("optimizer", "gradients"):
        with pytest.raises(PlanningError):
            plan_job("j", _tt_70b(s), inv)
    full = plan_job("j", _tt_70b("full"), inv)
    auto = plan_job("j", _tt_70b("auto"), inv)
    assert auto.training.sharding == "full" and auto.training.optimizer_sharding
    assert auto.predicted.step_time_s == full.predicted.step_time_s
    assert "sharding=auto chose full, the only one that fits" in auto.notes[-1]
    assert "optimizer: no layout fits" in auto.notes[-1]


def test_auto_picks_optimizer_where_all_fit_and_it_is_fastest() -> None:
    inv = load_cluster(_cluster("H100-SXM", 2, 8))
    job = {"model": {"preset": "gpt3-1.3b"}, "training": {"globalBatch": 32, "steps": 1}}
    times = {}
    for s in ("optimizer", "gradients", "full"):
        spec = parse_job_spec({**job, "training": {**job["training"], "sharding": s}})
        times[s] = plan_job("j", spec, inv).predicted.step_time_s
    assert times["optimizer"] < times["gradients"] and times["optimizer"] < times["full"]
    auto = plan_job("j", parse_job_spec({**job, "training": {**job["training"],
                                                               "sharding": "auto"}}), inv)
    assert auto.training.sharding == "optimizer"
    assert auto.predicted.step_time_s == times["optimizer"]
    assert auto.notes[-1].startswith("sharding=auto chose optimizer, the fastest (")
    # the later options searched only below optimizer's time (the ceiling) and found nothing
    assert "gradients: not faster, full: not faster" in auto.notes[-1]


def test_a_ceiling_keeps_only_faster_layouts() -> None:
    inv = load_cluster(_cluster("H100-SXM", 2, 8))
    spec = parse_job_spec({"model": {"preset": "gpt3-1.3b"},
                           "training": {"globalBatch": 32, "steps": 1, "sharding": "full"}})
    free = plan_job("j", spec, inv)
    t = free.predicted.step_time_s
    assert plan_job("j", spec, inv, ceiling_s=t * 1.001).predicted.step_time_s == t
    with pytest.raises(NotFaster):
        plan_job("j", spec, inv, ceiling_s=t * 0.999)
    with pytest.raises(NotFaster):
        plan_job("j", spec, inv, ceiling_s=t * 0.5)


def test_auto_with_tied_embeddings_never_tries_full() -> None:
    inv = load_cluster(_cluster("H100-SXM", 1, 8))
    spec = _spec({"sharding": "auto"}, model={"preset": "llama-tiny", "tieEmbeddings": True})
    plan = plan_job("j", spec, inv)
    assert "full" not in plan.notes[-1]
    assert plan.training.sharding in ("optimizer", "gradients")


@st.composite
def sharded_instances(draw: st.DrawFn) -> tuple[dict, dict]:
    cluster, job = draw(instances())
    job["training"].pop("optimizerSharding", None)
    sharding = draw(st.sampled_from(["gradients", "full", "auto"]))
    if (job.get("parallelism") or {}).get("schedule") in ("zb-h1", "interleaved-zb", "helix"):
        sharding = "auto"  # gradients/full with a split backward (or helix) are a spec error
    job["training"]["sharding"] = sharding
    return cluster, job


@settings(max_examples=40, deadline=None, derandomize=True)
@given(sharded_instances())
def test_fast_equals_exhaustive_with_zero2_3_and_auto(instance: tuple[dict, dict]) -> None:
    _assert_fast_equals_exhaustive(instance)


# ---------------------------------------------------------------- runtime rules


def _plan(sharding: str = "optimizer") -> Plan:
    inv = load_cluster(_cluster("H100-SXM", 1, 8))
    return plan_job("j", _spec({"sharding": sharding}, data={"synthetic": True}), inv)


def test_support_refuses_zero2_3_with_zb_h1_groups_and_tied_full() -> None:
    plan = _plan("gradients")
    assert unsupported(plan) == []
    zb = dataclasses.replace(plan, schedule="zb-h1")
    errs = unsupported(zb)
    assert any("plan.training.sharding=gradients with plan.schedule=zb-h1" in e
               and "spec.training.sharding: optimizer" in e for e in errs)
    tied = dataclasses.replace(plan, model=dataclasses.replace(plan.model, tie_embeddings=True),
                               training=dataclasses.replace(plan.training, sharding="full"))
    assert any("tie_embeddings" in e and "spec.model.tieEmbeddings: false" in e
               for e in unsupported(tied))
    assert not any("tie_embeddings" in e for e in unsupported(dataclasses.replace(
        tied, training=dataclasses.replace(plan.training, sharding="gradients"))))
    unresolved = dataclasses.replace(plan, training=dataclasses.replace(plan.training,
                                                                        sharding="auto"))
    assert any("plan.training.sharding='auto'" in e for e in unsupported(unresolved))


@pytest.mark.parametrize("sharding", ["gradients", "full"])
def test_support_refuses_zero2_3_with_replica_groups(sharding: str) -> None:
    from tests.runtime.training.plans import grouped_plan

    two = [{"splits": [(0, 2, "a"), (2, 4, "b")]}, {"splits": [(0, 4, "c")], "dc": "dc2"}]
    plan = grouped_plan(two)
    assert not any("sharding" in e for e in unsupported(plan))
    sharded = dataclasses.replace(plan, training=dataclasses.replace(plan.training,
                                                                     sharding=sharding))
    assert any(f"plan.training.sharding={sharding} with plan.groups" in e
               and "replicaGroups: false" in e for e in unsupported(sharded))


def test_support_refuses_zero_with_diloco() -> None:
    plan = dataclasses.replace(_plan("full"), cross_dc={"mode": "diloco"}, dp=2)
    assert any("plan.cross_dc.mode=diloco" in e and "sharding: none" in e
               for e in unsupported(plan))


# ---------------------------------------------------------------- refusals


def test_refusal_suggests_full_sharding_only_where_it_fits() -> None:
    inv = load_cluster(_cluster("A100-80GB", 8, 8))
    with pytest.raises(PlanningError) as err:
        plan_job("j", _tt_70b("optimizer"), inv)
    msg = err.value.message
    assert "set spec.training.sharding: full (ZeRO-3/FSDP; now optimizer" in msg
    assert "sharding: gradients" not in msg  # does not fit either: not suggested
    # already fully sharded and still too big: nothing about sharding
    small = load_cluster(_cluster("A100-80GB", 1, 8))
    spec = dataclasses.replace(_tt_70b("full"), parallelism=dataclasses.replace(
        _tt_70b("full").parallelism, dp=8))
    with pytest.raises(PlanningError) as err2:
        plan_job("j", spec, small)
    assert "set spec.training.sharding" not in err2.value.message


@pytest.mark.parametrize("sharding", ["optimizer", "gradients"])
def test_refusal_names_a_need_above_the_capacity(sharding: str) -> None:
    """The Llama 3 405B fidelity row (8,192 H100s, pinned tp 8, pp 16, dp 64, no recompute):
    the message names the closest layout's real peak (embedding, in-flight microbatches),
    never a relaxed bound below the capacity (it once said 41.9 of 68.5 GiB)."""
    row = ROOT / "bench" / "calibration" / "llama3-405b" / "8k-dp64"
    inv = load_cluster(yaml.safe_load((row / "cluster.yaml").read_text()))
    doc = yaml.safe_load((row / "job.yaml").read_text())
    doc["spec"]["training"]["sharding"] = sharding
    spec = parse_job_spec(doc["spec"])
    with pytest.raises(PlanningError) as err:
        plan_job("j", spec, inv)
    msg = err.value.message
    m = re.search(r"stage (\d+) of 16 \(H100-SXM, tp=8, dp=64, microBatch 1, interleaved\) "
                  r"needs ([\d.]+) GiB per device for 8 layers; it has ([\d.]+) GiB usable", msg)
    assert m, msg
    need, have = float(m.group(2)), float(m.group(3))
    assert need > have == 68.5
    assert "set spec.training.recompute: full (now none)" in msg
    assert "set spec.training.sharding" not in msg  # activations: sharding would not help


# ---------------------------------------------------------------- contract


def test_plan_json_round_trip_keeps_sharding() -> None:
    plan = _plan("full")
    assert plan.to_dict()["training"]["sharding"] == "full"
    back = Plan.from_json(plan.to_json())
    assert back.training.sharding == "full" and back.training.optimizer_sharding
    assert back == plan
    # a plan written before the field: its flag decides
    old = plan.to_dict()
    del old["training"]["sharding"]
    old["training"]["optimizer_sharding"] = False
    assert Plan.from_dict(old).training.sharding == "none"


def test_crd_copies_are_identical_and_list_every_sharding() -> None:
    paths = [ROOT / "crds" / "hettrainingjobs.hettrain.dev.yaml",
             ROOT / "charts" / "hettrain-operator" / "crds" / "hettrainingjobs.hettrain.dev.yaml"]
    texts = [p.read_text() for p in paths]
    assert texts[0] == texts[1]
    doc = yaml.safe_load(texts[0])
    schema = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    field = schema["properties"]["spec"]["properties"]["training"]["properties"]["sharding"]
    assert tuple(field["enum"]) == SHARDING_SPEC_MODES
    assert "ZeRO-3" in field["description"]


@pytest.mark.parametrize("sharding", ["optimizer", "gradients", "full"])
def test_a_cpu_hides_no_dp_sync(sharding: str) -> None:
    """gloo's collectives are CPU work on the ranks' own cores: on a CPU the overlapped
    sync is charged as the synchronous one (cost.dp_overlap_share), whatever the window."""
    inv = load_cluster(_cluster("CPU", 1, 4))
    unit = build_units(inv.pools, merged=False)[0]
    assert cost.dp_overlap_share(unit.device) == 0.0
    on = _spec({"sharding": sharding, "globalBatch": 16})
    off = _spec({"sharding": sharding, "globalBatch": 16, "overlapGradReduce": False})
    for first, last in ((False, False), (True, False), (False, True)):
        got = P._dp_sync_coeffs(unit, 2, 1, inv, on, 4, 1.0, 0.5, first, last)
        want = P._dp_sync_coeffs(unit, 2, 1, inv, off, 4, 1.0, 0.5, first, last)
        assert got == pytest.approx(want, rel=1e-12, abs=1e-18), (first, last)
