"""Device profiles: parsing with field-path errors, the fitted line against hand values, the
time model using measured layer times (and saying so), and fast == exhaustive with a profile
(its lower bound stays admissible)."""

from __future__ import annotations

import dataclasses

import pytest

from hettrain.api.spec import parse_job_spec
from hettrain.planning import cost
from hettrain.planning.errors import PlanningInputError
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import plan_job
from hettrain.planning.profiles import (
    apply_profiles,
    fit_line,
    profile_doc,
    profile_from_doc,
)

JOB = {"model": {"layers": 6, "hidden": 1024, "heads": 16, "seqLen": 512, "vocab": 8000},
       "training": {"globalBatch": 8, "steps": 1, "recompute": "none"}}


def _cluster() -> dict:
    pools = [{"name": "h", "datacenter": "a", "device": "H100-SXM", "nodes": 1, "gpusPerNode": 4,
              "nicGbps": 400},
             {"name": "m", "datacenter": "a", "device": "MI300X", "nodes": 1, "gpusPerNode": 4,
              "nicGbps": 400}]
    return {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "t"},
            "datacenters": [{"name": "a"}], "pools": pools}


def _doc(device: str = "H100-SXM", rows=((1, 1e-3, 2e-3), (2, 1.5e-3, 3e-3),
                                         (4, 2.5e-3, 5e-3)), modes=None) -> dict:
    """A profile of the job's layer in the job's precision (bf16, the default)."""
    return profile_doc(device, {"torch": "x"}, parse_job_spec(JOB).model, rows,
                       precision="bf16", modes=modes)


def test_fit_line_hand_values() -> None:
    assert fit_line([(1, 3), (2, 5), (4, 9)]) == pytest.approx((1.0, 2.0))
    # a negative intercept is refit through the origin: β = Σxy / Σx²
    assert fit_line([(1, 1), (2, 4)]) == pytest.approx((0.0, 9 / 5))
    assert fit_line([(2, 4)]) == pytest.approx((0.0, 2.0))


def test_profile_parses_and_fits_forward_plus_backward() -> None:
    prof = profile_from_doc(_doc(), "p.yaml")
    # t = fwd + bwd: (1, 3e-3), (2, 4.5e-3), (4, 7.5e-3) → α = 1.5e-3, β = 1.5e-3
    assert (prof.alpha, prof.beta) == pytest.approx((1.5e-3, 1.5e-3))
    assert prof.forward_share == pytest.approx(5e-3 / 15e-3)
    model = parse_job_spec(JOB).model
    assert prof.precision == "bf16" and prof.recompute == ()
    assert prof.matches(model, 2)
    assert not prof.matches(model, 4)  # an fp32 plan: another precision
    assert not prof.matches(dataclasses.replace(model, seq_len=1024), 2)


@pytest.mark.parametrize("edit,field", [
    ({"kind": "Cluster"}, "p.yaml.kind"), ({"version": 7}, "p.yaml.version"),
    ({"device": ""}, "p.yaml.device"), ({"layer": []}, "p.yaml.layer"),
    ({"layer": [{"microBatch": 1, "forwardS": -1, "backwardS": 1}]}, r"p.yaml.layer\[0\]"),
    ({"model": {"hidden": 64}}, "p.yaml.model"), ({"precision": "fp8"}, "p.yaml.precision"),
    ({"layer": [{"microBatch": 1, "forwardS": 1, "backwardS": 1, "fullS": 0}]},
     r"p.yaml.layer\[0\]"),
    ({"layer": [{"microBatch": 1, "forwardS": 1, "backwardS": 1, "fullS": 3},
                {"microBatch": 2, "forwardS": 1, "backwardS": 1}]}, "p.yaml.layer"),
])
def test_bad_profiles_name_the_field(edit: dict, field: str) -> None:
    with pytest.raises(PlanningInputError, match=rf"^{field}: "):
        profile_from_doc({**_doc(), **edit}, "p.yaml")


def test_time_model_uses_the_profile_for_its_device_and_shape_only() -> None:
    inv = apply_profiles(load_cluster(_cluster()), [profile_from_doc(_doc(), "p.yaml")])
    h100 = inv.pool("h").device
    model = parse_job_spec(JOB).model
    assert cost.layer_compute_s(model, 2, 2, h100, "none") == pytest.approx(4.5e-3 / 2)
    assert cost.layer_compute_s(model, 2, 1, h100, "full") == pytest.approx(
        4.5e-3 * (1 + 1 / 3))
    attn = 4.0 * 1024 * 512 * 1024 / (h100.flops * h100.efficiency
                                      * cost.attention_efficiency(h100))
    assert cost.layer_compute_s(model, 2, 1, h100, "selective") == pytest.approx(4.5e-3 + attn)
    other = dataclasses.replace(model, hidden=2048)  # another shape: the catalog model
    plain = dataclasses.replace(h100, profile=None)
    assert cost.layer_compute_s(other, 2, 1, h100, "none") == cost.layer_compute_s(
        other, 2, 1, plain, "none")
    # the search's per-FLOP bound stays below the profile's slope
    per_flop = 1.5e-3 / (3 * cost.layer_forward_flops(model, 512))
    assert cost.min_seconds_per_flop(h100, model) == pytest.approx(
        min(per_flop, 1 / (h100.flops * h100.efficiency)))


def test_unknown_profile_device_is_refused() -> None:
    with pytest.raises(PlanningInputError, match=r"p.yaml.device: 'Gaudi3' is not a device"):
        apply_profiles(load_cluster(_cluster()), [profile_from_doc(_doc("Gaudi3"), "p.yaml")])


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_fast_equals_exhaustive_with_a_profile(scale: float) -> None:
    """A profile 1000x faster than, equal to, or slower than the model: the plan changes with
    it, the bound stays admissible, and the notes name the measured device when it is used."""
    rows = [(b, f * scale, bw * scale) for b, f, bw in ((1, 1e-3, 2e-3), (2, 1.5e-3, 3e-3),
                                                        (4, 2.5e-3, 5e-3))]
    inv = apply_profiles(load_cluster(_cluster()), [profile_from_doc(_doc(rows=rows), "p")])
    spec = parse_job_spec(JOB)
    fast = plan_job("j", spec, inv)
    full = plan_job("j", spec, inv, exhaustive=True)
    assert fast.predicted.step_time_s == pytest.approx(full.predicted.step_time_s, rel=1e-9)
    uses_h100 = any(s.device == "H100-SXM" for s in fast.stages)
    noted = any("layer times of H100-SXM from device profiles" in n for n in fast.notes)
    assert noted == uses_h100
    if scale == 1e-3:
        assert uses_h100  # the measured device is far faster: the plan must use it


MODES = {"selective": [3.5e-3, 5.5e-3, 9.5e-3], "full": [4e-3, 6e-3, 1e-2]}


def test_measured_recompute_modes_replace_the_derived_ones() -> None:
    """Each measured mode is its own fitted line: selective (1, 3.5), (2, 5.5), (4, 9.5) ms →
    α = 1.5 ms, β = 2 ms; full → α = 2 ms, β = 2 ms; nothing modelled is added."""
    prof = profile_from_doc(_doc(modes=MODES), "p.yaml")
    assert [m for m, _, _ in prof.recompute] == ["selective", "full"]
    assert prof.measured_mode("selective") == pytest.approx((1.5e-3, 2e-3))
    assert prof.measured_mode("full") == pytest.approx((2e-3, 2e-3))
    inv = apply_profiles(load_cluster(_cluster()), [prof])
    h100 = inv.pool("h").device
    model = parse_job_spec(JOB).model
    assert cost.layer_compute_s(model, 2, 1, h100, "selective") == pytest.approx(5.5e-3)
    assert cost.layer_compute_s(model, 4, 2, h100, "full") == pytest.approx(1e-2 / 2)
    assert cost.layer_compute_s(model, 2, 1, h100, "none") == pytest.approx(4.5e-3)
    # the per-FLOP bound takes the smallest slope of any mode (none: 1.5 ms)
    per_flop = 1.5e-3 / (3 * cost.layer_forward_flops(model, 512))
    assert cost.min_seconds_per_flop(h100, model) == pytest.approx(
        min(per_flop, 1 / (h100.flops * h100.efficiency)))
    # an fp32 plan of the same shape stays on the catalog model
    plain = dataclasses.replace(h100, profile=None)
    assert cost.layer_compute_s(model, 2, 1, h100, "none", 4) == cost.layer_compute_s(
        model, 2, 1, plain, "none", 4)


@pytest.mark.parametrize("modes", [None, MODES])
def test_attention_free_is_the_profiles_full_line_scaled_by_the_models_ratio(modes) -> None:
    """Never measured: the full line (measured, or the plain one plus the forward share)
    times the catalog model's attention-free / full ratio (so a calibration factor on the
    line carries over), strictly between none and full; at least the none line (a profile
    whose full line is no slower than its none line)."""
    inv = apply_profiles(load_cluster(_cluster()), [profile_from_doc(_doc(modes=modes), "p")])
    h100 = inv.pool("h").device
    plain = dataclasses.replace(h100, profile=None)
    model = parse_job_spec(JOB).model
    for mb, tp in ((2, 1), (4, 2)):
        share = (cost.layer_compute_s(model, mb, tp, plain, "attention-free")
                 / cost.layer_compute_s(model, mb, tp, plain, "full"))
        none, full = (cost.layer_compute_s(model, mb, tp, h100, m) for m in ("none", "full"))
        free = cost.layer_compute_s(model, mb, tp, h100, "attention-free")
        assert free == pytest.approx(full * share, rel=1e-12)
        assert none < free < full
    prof = h100.profile  # a full line no slower than none: scaled down, it would undercut it
    flat = dataclasses.replace(h100, profile=dataclasses.replace(
        prof, recompute=tuple((m, prof.alpha, prof.beta) for m, _, _ in prof.recompute),
        forward_share=0.0))
    assert cost.layer_compute_s(model, 2, 1, flat, "attention-free") == pytest.approx(
        cost.layer_compute_s(model, 2, 1, flat, "none"))


def test_a_version_1_profile_reads_as_fp32_without_modes() -> None:
    """Profiles written before precision and the recompute modes: measured in fp32."""
    doc = {**_doc(), "version": 1}
    doc.pop("precision")
    prof = profile_from_doc(doc, "old.yaml")
    assert prof.precision == "fp32" and prof.recompute == ()
    model = parse_job_spec(JOB).model
    assert prof.matches(model, 4) and not prof.matches(model, 2)
    assert prof.layer_s(2, 1, "full") == pytest.approx(4.5e-3 * (1 + 1 / 3))


def test_fast_equals_exhaustive_with_measured_modes() -> None:
    """Measured selective and full lines far below the plain one (not physical, but what a
    noisy profile may hold): the bound still takes the smallest slope, so the search stays
    exact for every recompute mode."""
    cheap = {"selective": [1e-5, 2e-5, 4e-5], "full": [2e-5, 3e-5, 5e-5]}
    inv = apply_profiles(load_cluster(_cluster()), [profile_from_doc(_doc(modes=cheap), "p")])
    for recompute in ("none", "selective", "full", "auto"):
        spec = parse_job_spec({**JOB, "training": {**JOB["training"], "recompute": recompute}})
        fast = plan_job("j", spec, inv)
        full = plan_job("j", spec, inv, exhaustive=True)
        assert fast.predicted.step_time_s == pytest.approx(full.predicted.step_time_s,
                                                           rel=1e-9), recompute


# (microBatch, middleS, firstS, lastS): the _doc layer line is 1.5e-3 + 1.5e-3·b, the middle
# stage adds 0.1 ms + 0.05 ms·b of stage machinery, the first 0.2 ms of embedding and the last
# 1 ms + 0.5 ms·b of head and loss
STAGE_ROWS = tuple((b, 1.5e-3 + 1.5e-3 * b + 1e-4 + 5e-5 * b,
                    1.5e-3 + 1.5e-3 * b + 1e-4 + 5e-5 * b + 2e-4,
                    1.5e-3 + 1.5e-3 * b + 1e-4 + 5e-5 * b + 1e-3 + 5e-4 * b)
                   for b in (1, 2, 4))


def _stage_doc(device: str = "H100-SXM", **edit) -> dict:
    doc = profile_doc(device, {"torch": "x"}, parse_job_spec(JOB).model,
                      ((1, 1e-3, 2e-3), (2, 1.5e-3, 3e-3), (4, 2.5e-3, 5e-3)), stage=STAGE_ROWS,
                      precision="bf16")
    return {**doc, **edit}


def test_stage_rows_fit_overhead_embedding_and_head_hand_values() -> None:
    doc = _stage_doc()
    assert doc["version"] == 2 and doc["model"]["vocab"] == 8000
    st = profile_from_doc(doc, "p.yaml").stage
    assert st.vocab == 8000
    assert st.overhead == pytest.approx((1e-4, 5e-5))
    assert st.embedding == pytest.approx((2e-4, 0.0), abs=1e-12)
    assert st.head == pytest.approx((1e-3, 5e-4))
    assert st.part_s("head", 2) == pytest.approx(2e-3)
    # a part below the subtraction's noise costs nothing, never less
    rows = [(b, m, m - 1e-5, m + 1e-3) for b, m, _, _ in STAGE_ROWS]
    assert profile_from_doc(_stage_doc(stage=[
        {"microBatch": b, "middleS": m, "firstS": f, "lastS": la} for b, m, f, la in rows]),
        "p").stage.part_s("embedding", 4) == 0.0


def test_stage_rows_of_a_chain_subtract_every_layer_of_it() -> None:
    """Stages timed around 3 layers (a CPU profile's chain): overhead = middle − 3·layer."""
    rows = [{"microBatch": b, "layers": 3, "middleS": m + 2 * (1.5e-3 + 1.5e-3 * b),
             "firstS": f + 2 * (1.5e-3 + 1.5e-3 * b), "lastS": la + 2 * (1.5e-3 + 1.5e-3 * b)}
            for b, m, f, la in STAGE_ROWS]
    st = profile_from_doc(_stage_doc(stage=rows), "p.yaml").stage
    assert st.layers == 3
    assert st.overhead == pytest.approx((1e-4, 5e-5))
    assert st.head == pytest.approx((1e-3, 5e-4))
    mixed = [dict(rows[0], layers=2), *rows[1:]]
    with pytest.raises(PlanningInputError, match=r"^p.yaml.stage\[\].layers: "):
        profile_from_doc(_stage_doc(stage=mixed), "p.yaml")


def test_version_1_profiles_still_load_without_stage_rows() -> None:
    doc = _doc()
    doc = {**doc, "version": 1, "model": {k: v for k, v in doc["model"].items()
                                          if k != "vocab"}}
    prof = profile_from_doc(doc, "p.yaml")
    assert prof.stage is None and prof.matches(parse_job_spec(JOB).model, 4)  # v1: fp32
    with pytest.raises(PlanningInputError, match=r"^p.yaml.model.vocab: "):
        profile_from_doc({**doc, "stage": _stage_doc()["stage"]}, "p.yaml")


@pytest.mark.parametrize("edit,field", [
    ({"stage": []}, "p.yaml.stage"),
    ({"stage": [{"microBatch": 1, "middleS": 1e-3}]}, r"p.yaml.stage\[0\]"),
    ({"stage": [{"microBatch": 1, "middleS": 1e-3, "firstS": 0, "lastS": 1e-3}]},
     r"p.yaml.stage\[0\]"),
])
def test_bad_stage_rows_name_the_field(edit: dict, field: str) -> None:
    with pytest.raises(PlanningInputError, match=rf"^{field}: "):
        profile_from_doc(_stage_doc(**edit), "p.yaml")


def test_planner_adds_the_measured_stage_parts_and_says_so() -> None:
    """Every stage pays the measured machinery per microbatch, the first the embedding, the
    last the measured head instead of the catalog's; another vocabulary keeps the catalog."""
    inv = apply_profiles(load_cluster(_cluster()), [profile_from_doc(_stage_doc(), "p.yaml")])
    h100 = inv.pool("h").device
    model = parse_job_spec(JOB).model
    assert cost.head_time_s(model, 2, 1, h100) == pytest.approx(2e-3)
    assert cost.stage_overhead_s(model, 2, 1, h100, first=False) == pytest.approx(2e-4)
    assert cost.stage_overhead_s(model, 2, 1, h100, first=True) == pytest.approx(4e-4)
    other = dataclasses.replace(model, vocab=16000)
    plain = dataclasses.replace(h100, profile=None)
    assert cost.stage_overhead_s(other, 2, 1, h100, first=True) == 0.0
    assert cost.head_time_s(other, 2, 1, h100) == cost.head_time_s(other, 2, 1, plain)
    spec = parse_job_spec({**JOB, "parallelism": {"tp": 1, "pp": 2, "dp": 1},
                           "placement": {"pools": ["h"]},
                           "training": {**JOB["training"], "microBatch": 2}})
    plan = plan_job("j", spec, inv)
    layer = 1.5e-3 + 1.5e-3 * 2  # the fitted layer line at b = 2
    n0 = plan.stages[0].layer_end - plan.stages[0].layer_start
    n1 = plan.stages[1].layer_end - plan.stages[1].layer_start
    assert plan.stages[0].time_ms == pytest.approx(1e3 * (n0 * layer + 4e-4))
    assert plan.stages[1].time_ms == pytest.approx(1e3 * (n1 * layer + 2e-4 + 2e-3))
    assert any("stage machinery of H100-SXM" in n for n in plan.notes)
    assert not any("the LM head" in n for n in plan.notes)
    full = plan_job("j", spec, inv, exhaustive=True)
    assert plan.predicted.step_time_s == pytest.approx(full.predicted.step_time_s, rel=1e-9)


def _conc_doc(rows, **edit) -> dict:
    doc = profile_doc("H100-SXM", {"torch": "x"}, parse_job_spec(JOB).model,
                      ((1, 1e-3, 2e-3), (2, 1.5e-3, 3e-3), (4, 2.5e-3, 5e-3)),
                      concurrent={"ranks": 2, "layer": rows}, precision="bf16")
    return {**doc, **edit}


# the _doc layer line is 1.5e-3 + 1.5e-3·b; with two ranks at once 1.5e-3 + 2e-3·b
CONC_ROWS = [(b, (1.5e-3 + 2e-3 * b) / 3, (1.5e-3 + 2e-3 * b) * 2 / 3) for b in (1, 2, 4)]


def test_concurrent_layer_gives_the_slowdown_hand_values() -> None:
    prof = profile_from_doc(_conc_doc(CONC_ROWS), "p.yaml")
    assert prof.concurrent == pytest.approx((1.5e-3, 2e-3))
    assert prof.concurrent_ranks == 2
    assert prof.slowdown(2) == pytest.approx(5.5 / 4.5)
    assert prof.slowdown(4) == pytest.approx(9.5 / 7.5)
    # faster with a peer (noise): never below 1; not measured: 1
    fast = [(b, f / 2, bw / 2) for b, f, bw in CONC_ROWS]
    assert profile_from_doc(_conc_doc(fast), "p").slowdown(2) == 1.0
    assert profile_from_doc(_doc(), "p").slowdown(2) == 1.0


@pytest.mark.parametrize("edit,field", [
    ({"concurrent": {"ranks": 1, "layer": []}}, "p.yaml.concurrent.ranks"),
    ({"concurrent": {"ranks": 2, "layer": []}}, "p.yaml.concurrent.layer"),
    ({"concurrent": {"ranks": 2, "layer": [{"microBatch": 1}]}},
     r"p.yaml.concurrent.layer\[0\]"),
    ({"concurrent": [1], "version": 2}, "p.yaml.concurrent"),
])
def test_bad_concurrent_sections_name_the_field(edit: dict, field: str) -> None:
    with pytest.raises(PlanningInputError, match=rf"^{field}: "):
        profile_from_doc(_conc_doc(CONC_ROWS, **edit), "p.yaml")
    with pytest.raises(PlanningInputError, match=r"^p.yaml.concurrent: "):
        profile_from_doc(_conc_doc(CONC_ROWS, version=1), "p.yaml")


def _pinned(pp: int, dp: int, pool: str = "h") -> dict:
    return {**JOB, "parallelism": {"tp": 1, "pp": pp, "dp": dp},
            "placement": {"pools": [pool]}, "training": {**JOB["training"], "microBatch": 2}}


@pytest.mark.parametrize("pp,dp", [(1, 1), (2, 1), (1, 2), (3, 1)])
def test_planner_slows_the_compute_of_a_crowded_node(pp: int, dp: int) -> None:
    """Pool h is ONE node of 4 devices: a layout with two or more busy ranks there computes
    at the measured concurrent rate (every stage's layers and fixed part), one rank at the
    single-rank rate; a pool of as many nodes as ranks is not crowded. Notes say so."""
    prof = profile_from_doc(_conc_doc(CONC_ROWS), "p.yaml")
    plain = profile_from_doc(_doc(), "p.yaml")
    spec = parse_job_spec(_pinned(pp, dp))
    got = plan_job("j", spec, apply_profiles(load_cluster(_cluster()), [prof]))
    ref = plan_job("j", spec, apply_profiles(load_cluster(_cluster()), [plain]))
    f = 5.5 / 4.5 if pp * dp > 1 else 1.0
    for a, b in zip(got.stages, ref.stages, strict=True):
        assert a.time_ms == pytest.approx(b.time_ms * f)
    noted = any("compute of H100-SXM x1.222" in n for n in got.notes)
    assert noted == (f != 1.0)
    full = plan_job("j", spec, apply_profiles(load_cluster(_cluster()), [prof]),
                    exhaustive=True)
    assert got.predicted.step_time_s == pytest.approx(full.predicted.step_time_s, rel=1e-9)
    # as many nodes as ranks: every rank has a node to itself
    wide = _cluster()
    wide["pools"][0] = {**wide["pools"][0], "nodes": 4, "gpusPerNode": 1}
    spread = plan_job("j", spec, apply_profiles(load_cluster(wide), [prof]))
    spread_ref = plan_job("j", spec, apply_profiles(load_cluster(wide), [plain]))
    assert spread.predicted.step_time_s == pytest.approx(spread_ref.predicted.step_time_s)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_fast_equals_exhaustive_with_stage_and_concurrent_parts(scale: float) -> None:
    rows = [(b, f * scale, bw * scale) for b, f, bw in ((1, 1e-3, 2e-3), (2, 1.5e-3, 3e-3),
                                                        (4, 2.5e-3, 5e-3))]
    doc = profile_doc("H100-SXM", {"torch": "x"}, parse_job_spec(JOB).model, rows,
                      stage=[(b, m * scale, f * scale, la * scale) for b, m, f, la in STAGE_ROWS],
                      concurrent={"ranks": 2, "layer": [(b, f * scale, bw * scale)
                                                        for b, f, bw in CONC_ROWS]},
                      precision="bf16")
    inv = apply_profiles(load_cluster(_cluster()), [profile_from_doc(doc, "p")])
    spec = parse_job_spec(JOB)
    fast = plan_job("j", spec, inv)
    full = plan_job("j", spec, inv, exhaustive=True)
    assert fast.predicted.step_time_s == pytest.approx(full.predicted.step_time_s, rel=1e-9)
