"""Closed-loop calibration, pure part: the layer factor recovered from synthetic measurements,
the refined profile against the true one, the re-plan verdict against planning with the true
profile directly (brute force reference), the threshold, and the profile store documents."""

from __future__ import annotations

import dataclasses

import pytest

from hettrain.api.spec import SpecError, parse_job_spec
from hettrain.planning import calibration as cal
from hettrain.planning import cost
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import plan_job, step_time_for_split
from hettrain.planning.profiles import (
    LayerProfile,
    StageProfile,
    model_shape,
    profile_from_doc,
)

JOB = {"model": {"layers": 12, "hidden": 64, "heads": 4, "seqLen": 64, "vocab": 256},
       "training": {"globalBatch": 8, "microBatch": 2, "steps": 10, "recompute": "none",
                    "precision": "fp32"},
       "parallelism": {"pp": 2, "dp": 1}}
DEV = {"vendor": "cpu", "bf16Tflops": 0.5, "hbmGiB": 16, "hbmTBps": 0.05, "intraNodeGBps": 5,
       "backend": "gloo"}


def _inventory():
    return load_cluster({
        "apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "t"},
        "datacenters": [{"name": "a"}],
        "devices": [{"name": "CPU-A", **DEV}, {"name": "CPU-B", **DEV}],
        "pools": [{"name": "pa", "datacenter": "a", "device": "CPU-A", "nodes": 1,
                   "gpusPerNode": 1, "nicGbps": 10},
                  {"name": "pb", "datacenter": "a", "device": "CPU-B", "nodes": 1,
                   "gpusPerNode": 1, "nicGbps": 10}]})


def _true_profile(spec, device: str) -> LayerProfile:
    return LayerProfile(device, model_shape(spec.model), 2e-3, 3e-3, 1 / 3, source="true")


def _measure(spec, plan, inv_true) -> dict[cal.StageKey, cal.StageMeasurement]:
    """What a runtime on the TRUE devices measures for ``plan``'s stages: the true model's
    stage time of the same layout (the planner's own stage costing of the true inventory)."""
    devices = cal.devices_of(inv_true)
    out = {}
    for s in plan.stages:
        dev = devices[s.device]
        layers = s.layer_end - s.layer_start
        eb = cost.precision_bytes(spec.training)
        # the true layers' part, plus what the plan prices outside its layers
        wrong = cal.devices_of(_planned_inventory(spec))[s.device]
        part_wrong = layers * cost.layer_compute_s(spec.model, plan.micro_batch, s.tp, wrong,
                                                   "none", eb)
        other = s.time_ms / 1e3 - part_wrong
        true = other + layers * cost.layer_compute_s(spec.model, plan.micro_batch, s.tp, dev,
                                                     "none", eb)
        out[(0, s.index)] = cal.StageMeasurement(s.index, true, 1e-4, steps=5, step=6)
    return out


def _planned_inventory(spec):
    """The inventory the job was planned on: CPU-A's profile claims it 3x too fast."""
    a = _true_profile(spec, "CPU-A")
    wrong = dataclasses.replace(a, alpha=a.alpha / 3, beta=a.beta / 3, source="wrong")
    return cal.with_profiles(_inventory(), {"CPU-A": wrong,
                                            "CPU-B": _true_profile(spec, "CPU-B")},
                             spec.model, "fp32")


def _true_inventory(spec):
    return cal.with_profiles(_inventory(), {d: _true_profile(spec, d)
                                            for d in ("CPU-A", "CPU-B")}, spec.model, "fp32")


def _planner(spec, inv, prev):
    return plan_job("j", spec, inv, previous=prev)


def test_wrong_profile_is_corrected_and_the_job_replanned() -> None:
    spec = parse_job_spec(JOB)
    planned = _planned_inventory(spec)
    plan = plan_job("j", spec, planned)
    split = [s.layer_end - s.layer_start for s in plan.stages]
    by_device = {s.device: s.layer_end - s.layer_start for s in plan.stages}
    assert by_device["CPU-A"] > by_device["CPU-B"]  # the wrong profile overloads CPU-A
    measured = _measure(spec, plan, _true_inventory(spec))
    rows = cal.compare(plan, measured)
    ratios = {r.device: r.ratio for r in rows}
    assert ratios["CPU-A"] > 1.5 and ratios["CPU-B"] == pytest.approx(1.0)
    scale = cal.layer_scale(spec, plan, measured, cal.devices_of(planned))
    assert scale == pytest.approx({"CPU-A": 3.0, "CPU-B": 1.0})
    refined = cal.refine_profiles(spec, plan, measured, cal.devices_of(planned))
    assert (refined["CPU-A"].alpha, refined["CPU-A"].beta) == pytest.approx((2e-3, 3e-3))
    corrected = cal.with_profiles(_inventory(), refined, spec.model, "fp32")
    verdict = cal.evaluate(spec, plan, corrected, _planner, 0.10)
    # reference: the same layout and the best plan priced on the TRUE inventory
    true_inv = _true_inventory(spec)
    reference_best = plan_job("j", spec, true_inv)
    assert verdict.current_s == pytest.approx(step_time_for_split(spec, true_inv, plan, split))
    assert verdict.best_s == pytest.approx(reference_best.predicted.step_time_s)
    assert verdict.best is not None
    assert [s.layer_end - s.layer_start for s in verdict.best.stages] == [
        s.layer_end - s.layer_start for s in reference_best.stages]
    assert verdict.gain > 0.10 and verdict.replan
    assert "faster; threshold 10%" in verdict.message()


def test_right_profile_keeps_the_plan() -> None:
    spec = parse_job_spec(JOB)
    true_inv = _true_inventory(spec)
    plan = plan_job("j", spec, true_inv)
    devices = cal.devices_of(true_inv)
    measured = {(0, s.index): cal.StageMeasurement(s.index, s.time_ms / 1e3, 0.0, 5)
                for s in plan.stages}
    assert cal.layer_scale(spec, plan, measured, devices) == pytest.approx(
        {"CPU-A": 1.0, "CPU-B": 1.0})
    refined = cal.refine_profiles(spec, plan, measured, devices)
    verdict = cal.evaluate(spec, plan, cal.with_profiles(_inventory(), refined, spec.model, "fp32"),
                           _planner, 0.10)
    assert verdict.gain == pytest.approx(0.0, abs=1e-9)
    assert not verdict.replan


@pytest.mark.parametrize("threshold,expect", [(0.0, True), (0.2, True), (0.6, False)])
def test_threshold(threshold: float, expect: bool) -> None:
    v = cal.Verdict(current_s=1.0, best_s=0.5, best=object(), threshold=threshold)  # type: ignore[arg-type]
    assert v.gain == pytest.approx(0.5)
    assert v.replan is expect
    assert not cal.Verdict(1.0, 0.5, None, 0.0).replan  # no plan: nothing to switch to


def test_catalog_device_gets_a_profile_fitted_to_the_model() -> None:
    spec = parse_job_spec(JOB)
    inv = _inventory()  # no profiles: the catalog model prices the layers
    plan = plan_job("j", spec, inv)
    devices = cal.devices_of(inv)
    measured = {}
    for s in plan.stages:  # every layer measured 2x slower than the catalog says
        layers = s.layer_end - s.layer_start
        part = layers * cost.layer_compute_s(spec.model, plan.micro_batch, s.tp,
                                             devices[s.device], "none", 4)
        measured[(0, s.index)] = cal.StageMeasurement(s.index, s.time_ms / 1e3 + part, 0.0, 5)
    refined = cal.refine_profiles(spec, plan, measured, devices)
    for name, prof in refined.items():
        for b in (1, 2, 4):  # the fitted line reproduces the catalog model, doubled
            # in the job's precision (fp32), each recompute mode on its own line
            for mode in ("none", "selective", "full"):
                assert prof.layer_s(b, 1, mode) == pytest.approx(
                    2 * cost.layer_compute_s(spec.model, b, 1, devices[name], mode, 4),
                    rel=0.02)


def test_usable_needs_every_stage_and_enough_steps() -> None:
    spec = parse_job_spec(JOB)
    plan = plan_job("j", spec, _inventory())
    full = [cal.StageMeasurement(i, 0.01, 0.0, 5) for i in range(plan.pp)]
    assert set(cal.usable(full, plan, 3)) == {(0, i) for i in range(plan.pp)}
    # a measurement of another replica group's stage never stands in for group 0's
    assert cal.usable([dataclasses.replace(full[0], group=1), *full[1:]], plan, 3) == {}
    assert cal.usable(full[:1], plan, 3) == {}
    assert cal.usable(full, plan, 6) == {}
    bad = [dataclasses.replace(full[0], compute_s=float("nan")), full[1]]
    assert cal.usable(bad, plan, 3) == {}


def test_profile_document_round_trip_and_store_key() -> None:
    spec = parse_job_spec(JOB)
    prof = cal.scaled(dataclasses.replace(_true_profile(spec, "CPU-A"),
                                          optimizer_bytes_per_s=3e10), 1.5)
    doc = cal.profile_to_doc(prof, spec.model, {"image": "img:1"})
    back = profile_from_doc(doc, "store")
    assert (back.alpha, back.beta, back.forward_share) == pytest.approx(
        (prof.alpha, prof.beta, prof.forward_share))
    assert back.optimizer_bytes_per_s == 3e10  # the measured optimizer bandwidth is kept
    assert back.matches(spec.model, 4) and doc["source"] == "calibration"
    k1 = cal.store_key("CPU-A", model_shape(spec.model), "img:1", "fp32")
    assert k1 == cal.store_key("CPU-A", model_shape(spec.model), "img:1", "fp32")
    assert k1 != cal.store_key("CPU-A", model_shape(spec.model), "img:2", "fp32")
    assert k1 != cal.store_key("CPU-B", model_shape(spec.model), "img:1", "fp32")
    assert cal.store_key("H100 SXM/x", model_shape(spec.model), "i",
                         "fp32").startswith("H100_SXM_x.")
    # bf16 and fp16 share a key (2-byte precisions), fp32 has its own
    bf16 = cal.store_key("CPU-A", model_shape(spec.model), "img:1", "bf16")
    assert bf16 == cal.store_key("CPU-A", model_shape(spec.model), "img:1", "fp16") != k1


def test_spec_calibration_block() -> None:
    spec = parse_job_spec({**JOB, "calibration": {"enabled": True, "replanThreshold": 0.25,
                                                  "maxReplans": 1, "profile": True}})
    assert spec.calibration.enabled and spec.calibration.profile
    assert spec.calibration.replan_threshold == 0.25 and spec.calibration.max_replans == 1
    assert parse_job_spec(JOB).calibration.replan_threshold == 0.10
    with pytest.raises(SpecError, match=r"spec\.calibration\.replanThreshold"):
        parse_job_spec({**JOB, "calibration": {"replanThreshold": 1.0}})
    with pytest.raises(SpecError, match=r"spec\.calibration\.bogus"):
        parse_job_spec({**JOB, "calibration": {"bogus": 1}})


def test_measured_layer_time_is_compared_with_the_layers_alone() -> None:
    spec = parse_job_spec(JOB)
    planned = _planned_inventory(spec)
    plan = plan_job("j", spec, planned)
    devices = cal.devices_of(planned)
    measured = {}
    for s in plan.stages:  # layers 3x (CPU-A) / 1x (CPU-B) their prediction; the rest 10x
        part = (s.layer_end - s.layer_start) * cost.layer_compute_s(
            spec.model, plan.micro_batch, s.tp, devices[s.device], "none", 4)
        k = 3.0 if s.device == "CPU-A" else 1.0
        measured[(0, s.index)] = cal.StageMeasurement(
            s.index, k * part + 10 * (s.time_ms / 1e3 - part), 0.0, 5, layers_s=k * part)
    assert cal.layer_scale(spec, plan, measured, devices) == pytest.approx(
        {"CPU-A": 3.0, "CPU-B": 1.0})


def test_profile_document_round_trip_keeps_the_measured_stage_parts() -> None:
    """A refined (scaled) profile's document keeps the stage parts measured around the layer:
    calibration scales the layers, not the embedding, head or stage machinery."""
    spec = parse_job_spec(JOB)
    stage = StageProfile(spec.model.vocab, (1e-4, 5e-5), (2e-4, 0.0), (1e-3, 5e-4),
                         ((1, 0.0, 0.0, 0.0), (2, 0.0, 0.0, 0.0), (4, 0.0, 0.0, 0.0)))
    base = _true_profile(spec, "CPU-A")
    conc = (base.alpha * 1.2, base.beta * 1.1)  # the layer with the node's ranks busy
    prof = cal.scaled(dataclasses.replace(base, stage=stage, concurrent=conc,
                                          concurrent_ranks=2), 1.5)
    back = profile_from_doc(cal.profile_to_doc(prof, spec.model, {"image": "img:1"}), "store")
    assert back.stage_matches(spec.model, 4)  # the job is fp32
    # calibration scales the concurrent line with the layer's: the slowdown is kept
    assert back.concurrent == pytest.approx((conc[0] * 1.5, conc[1] * 1.5))
    assert back.concurrent_ranks == 2
    assert back.slowdown(2) == pytest.approx(
        (conc[0] + 2 * conc[1]) / (base.alpha + 2 * base.beta))
    for part in ("overhead", "embedding", "head"):
        assert getattr(back.stage, part) == pytest.approx(getattr(stage, part), abs=1e-12)


def test_a_refined_profile_keeps_the_measured_zb_split() -> None:
    """Calibration scales the ZB-H1 B and W lines with the layer's (ZB-H1's bubble share is
    kept), the store document carries them, and the job status entry reads back with them
    (one written before them has none)."""
    from hettrain.reconcile import _profile_from_status, _refined_entry

    spec = parse_job_spec(JOB)
    base = _true_profile(spec, "CPU-A")
    b_line, w_line = (base.alpha * 0.5, base.beta * 0.5), (base.alpha * 0.2, base.beta * 0.2)
    prof = cal.scaled(dataclasses.replace(base, input_grad=b_line, weight_grad=w_line), 1.5)
    assert prof.weight_grad == pytest.approx((w_line[0] * 1.5, w_line[1] * 1.5))
    # W is 0.2 of the layer before and after: (F + B − W)/(F + B + W) = 1 − 0.4
    assert prof.zb_bubble_ratio(2, "none") == pytest.approx(0.6)
    back = profile_from_doc(cal.profile_to_doc(prof, spec.model, {"image": "img:1"}), "store")
    assert back.weight_grad == pytest.approx(prof.weight_grad)
    assert back.input_grad == pytest.approx(prof.input_grad)
    entry = _refined_entry("CPU-A", prof)
    again = _profile_from_status(entry, spec)
    assert again.weight_grad == pytest.approx(prof.weight_grad)
    assert again.input_grad == pytest.approx(prof.input_grad)
    old = {k: v for k, v in entry.items() if k not in ("bPass", "wPass")}
    assert _profile_from_status(old, spec).weight_grad is None


def test_a_refined_profile_keeps_its_layer_measured_sharded() -> None:
    """Calibration scales the tp-2 line with the layer's, and the store document keeps it."""
    spec = parse_job_spec(JOB)
    base = _true_profile(spec, "CPU-A")
    tp2 = (2, base.alpha * 0.7, base.beta * 0.6)
    prof = cal.scaled(dataclasses.replace(base, tp_layers=(tp2,)), 1.5)
    assert prof.measured_tp(2) == pytest.approx((tp2[1] * 1.5, tp2[2] * 1.5))
    back = profile_from_doc(cal.profile_to_doc(prof, spec.model, {"image": "img:1"}), "store")
    assert back.measured_tp(2) == pytest.approx(prof.measured_tp(2))
    from hettrain.reconcile import _profile_from_status, _refined_entry

    again = _profile_from_status(_refined_entry("CPU-A", prof), spec)
    assert again.measured_tp(2) == pytest.approx(prof.measured_tp(2))


def test_a_tp_stages_layers_are_compared_with_compute_plus_their_tp_collectives() -> None:
    """The runtime's layer clock times the layers with the TP all-reduces inside them: a
    tp = 2 stage measured at exactly its predicted compute + TP comm reads scale 1 (compared
    with compute alone it would read the device as slower by the TP share, and the planner
    would then add the TP comm a second time)."""
    inv = load_cluster({
        "apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "t"},
        "datacenters": [{"name": "a"}],
        "pools": [{"name": "h", "datacenter": "a", "device": "A100-80GB", "nodes": 1,
                   "gpusPerNode": 8, "nicGbps": 400}]})
    spec = parse_job_spec({"model": {"layers": 8, "hidden": 4096, "heads": 32, "seqLen": 4096,
                                     "vocab": 32000},
                           "training": {"globalBatch": 8, "steps": 1, "recompute": "none"},
                           "parallelism": {"tp": 2, "pp": 1, "dp": 4}})
    plan = plan_job("j", spec, inv)
    devices = cal.devices_of(inv)
    s = plan.stages[0]
    dev = devices[s.device]
    eb = cost.precision_bytes(spec.training)
    tp_comm = cost.tp_comm_per_layer_s(spec.model, plan.micro_batch, 2, dev, eb, "none")
    compute = cost.layer_compute_s(spec.model, plan.micro_batch, 2, dev, "none", eb)
    assert s.tp == 2 and tp_comm > 0.02 * compute
    for k in (1.0, 1.5):
        measured = {(0, 0): cal.StageMeasurement(0, s.time_ms / 1e3, 0.0, 5,
                                                 layers_s=k * s.layers * (compute + tp_comm))}
        assert cal.layer_scale(spec, plan, measured, devices) == pytest.approx(
            {s.device: k})


def test_a_calibration_factor_scales_attention_free_like_the_measured_modes() -> None:
    """Attention-free is never profiled: it follows the full line by the model's ratio, so a
    device's calibration factor (on every line) scales it by the same factor; the catalog
    profile reproduces the model's attention-free time (within its lines' fit at tp 1, divided
    by tp)."""
    from hettrain.planning.catalog import CATALOG
    model = parse_job_spec({"model": {"preset": "llama3-8b", "seqLen": 32768},
                            "training": {"globalBatch": 8, "steps": 1}}).model
    h100 = CATALOG["H100-SXM"]
    prof = cal.catalog_profile(h100, model, "bf16")
    for factor in (0.8, 1.3):
        base = dataclasses.replace(h100, profile=prof)
        calibrated = dataclasses.replace(h100, profile=cal.scaled(prof, factor))
        for mb, tp in ((1, 1), (2, 4)):
            free = cost.layer_compute_s(model, mb, tp, base, "attention-free")
            assert cost.layer_compute_s(model, mb, tp, calibrated, "attention-free") == \
                pytest.approx(factor * free, rel=1e-12)
            assert free == pytest.approx(cost.layer_compute_s(
                model, mb, tp, dataclasses.replace(h100, profile=None), "attention-free"),
                rel=0.01)
