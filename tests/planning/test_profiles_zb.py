"""ZB-H1 with a measured B/W split: a profile's ``bS``/``wS`` rows give ZB-H1's bubble as
``(F + B − W)/(F + B + W)`` of 1F1B's (hand values), a profile without them loads and keeps the
catalog's third, the plan notes say which, and fast == exhaustive whatever the split."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tests.planning.test_fast_vs_exhaustive import assert_fast_equals_exhaustive_on

from hettrain.api.spec import parse_job_spec
from hettrain.planning import cost
from hettrain.planning.errors import PlanningInputError
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import plan_job, split_costs
from hettrain.planning.profiles import apply_profiles, profile_doc, profile_from_doc

JOB = {"model": {"layers": 6, "hidden": 1024, "heads": 16, "seqLen": 512, "vocab": 8000},
       "training": {"globalBatch": 8, "steps": 1, "recompute": "none"}}
# forward 0.5 ms·(1 + b), backward 1 ms·(1 + b): exact lines, so the fits are the hand values
ROWS = tuple((b, 0.5e-3 * (1 + b), 1e-3 * (1 + b)) for b in (1, 2, 4))


def _cluster() -> dict:
    pools = [{"name": "h", "datacenter": "a", "device": "H100-SXM", "nodes": 1, "gpusPerNode": 4,
              "nicGbps": 400},
             {"name": "m", "datacenter": "a", "device": "MI300X", "nodes": 1, "gpusPerNode": 4,
              "nicGbps": 400}]
    return {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "t"},
            "datacenters": [{"name": "a"}], "pools": pools}


def _doc(w_frac: float | None, scale: float = 1.0, device: str = "H100-SXM") -> dict:
    """A bf16 profile of JOB's layer whose backward splits into B = (1 − w_frac)·backward and
    W = w_frac·backward (None: no split measured, as before this field)."""
    rows = [(b, f * scale, bw * scale) for b, f, bw in ROWS]
    split = (None if w_frac is None else
             [((1 - w_frac) * bw, w_frac * bw) for _, _, bw in rows])
    return profile_doc(device, {"torch": "x"}, parse_job_spec(JOB).model, rows,
                       precision="bf16", split=split)


def _inv(*docs: dict):
    return apply_profiles(load_cluster(_cluster()), [profile_from_doc(d, "p") for d in docs])


def test_split_rows_parse_and_give_the_hand_ratio() -> None:
    """b = 2: F = 1.5 ms, backward 3 ms split B = 2.25, W = 0.75 ms:
    (F + B − W)/(F + B + W) = 3/4.5 = 2/3, so ZB-H1 divides 1F1B's bubble by 1.5."""
    doc = _doc(0.25)
    assert doc["layer"][1] == {"microBatch": 2, "forwardS": 1.5e-3, "backwardS": 3e-3,
                               "bS": pytest.approx(2.25e-3), "wS": pytest.approx(0.75e-3)}
    prof = profile_from_doc(doc, "p.yaml")
    assert prof.weight_grad == pytest.approx((0.25e-3, 0.25e-3))
    assert prof.input_grad == pytest.approx((0.75e-3, 0.75e-3))
    f, b, w = 1.5e-3, 2.25e-3, 0.75e-3
    assert prof.zb_bubble_ratio(2, "none") == pytest.approx((f + b - w) / (f + b + w))
    h100 = _inv(doc).pool("h").device
    spec = parse_job_spec(JOB)
    assert cost.zb_bubble_divisor([h100], spec.model, spec.training, 2) == pytest.approx(1.5)
    # a layout with an unmeasured device takes the smaller divisor (the larger bubble)
    mi300 = _inv(doc).pool("m").device
    assert cost.zb_bubble_divisor([h100, mi300], spec.model, spec.training, 2) == 1.5
    assert cost.zb_bubble_divisor([mi300], spec.model, spec.training, 2) == 3.0
    # an fp32 plan of the same shape: the profile does not match, the catalog's third
    fp32 = parse_job_spec({**JOB, "training": {**JOB["training"], "precision": "fp32"}})
    assert cost.zb_bubble_divisor([h100], fp32.model, fp32.training, 2) == 3.0
    # a W pass of (nearly) half the layer is clamped: some bubble is always left
    assert profile_from_doc(_doc(0.74), "p").zb_bubble_ratio(2, "none") == pytest.approx(0.1)


def test_a_profile_without_the_split_loads_as_before() -> None:
    """Profiles written before bS/wS (version 2 without them, and version 1): no split,
    the catalog's third."""
    prof = profile_from_doc(_doc(None), "old.yaml")
    assert prof.weight_grad is None and prof.zb_bubble_ratio(2, "none") is None
    assert (prof.alpha, prof.beta) == pytest.approx((1.5e-3, 1.5e-3))
    old = {**_doc(0.25), "version": 1}
    old.pop("precision")
    assert profile_from_doc(old, "v1.yaml").weight_grad is None  # version 1 had no split


@pytest.mark.parametrize("rows,field", [
    ([{"microBatch": 1, "forwardS": 1, "backwardS": 2, "bS": 1, "wS": 1},
      {"microBatch": 2, "forwardS": 2, "backwardS": 3}], r"p.yaml.layer\[1\]"),
    ([{"microBatch": 1, "forwardS": 1, "backwardS": 2, "bS": 1}], r"p.yaml.layer\[0\]"),
    ([{"microBatch": 1, "forwardS": 1, "backwardS": 2, "bS": 1, "wS": 0}], r"p.yaml.layer\[0\]"),
])
def test_bad_split_rows_name_the_row(rows: list, field: str) -> None:
    with pytest.raises(PlanningInputError, match=rf"^{field}: "):
        profile_from_doc({**_doc(None), "layer": rows}, "p.yaml")


def _pinned(schedule: str = "zb-h1", pp: int = 2) -> dict:
    return {**JOB, "parallelism": {"tp": 1, "pp": pp, "dp": 1, "schedule": schedule},
            "placement": {"pools": ["h"]}, "training": {**JOB["training"], "microBatch": 2}}


@pytest.mark.parametrize("w_frac", [None, 0.25, 0.6])
def test_planner_takes_the_zb_bubble_from_the_measured_split(w_frac: float | None) -> None:
    """A pinned ZB-H1 layout on the profiled pool: the plan's bubble is (Σ − max) of its own
    stages and boundary (1F1B's) times the hand share, (F + B − W)/(F + B + W) at b = 2
    (F = 1.5, B + W = 3 ms), or a third without a split; the notes say which."""
    inv = _inv(_doc(w_frac))
    spec = parse_job_spec(_pinned())
    plan = plan_job("j", spec, inv)
    assert plan.schedule == "zb-h1" and plan.pp == 2 and plan.micro_batch == 2
    stage_s, boundaries, _ = split_costs(
        spec, inv, plan, [s.layer_end - s.layer_start for s in plan.stages])
    one_f_one_b = sum(stage_s) + sum(boundaries) - max(stage_s + boundaries)
    if w_frac is None:
        share = 1 / 3
    else:
        f, w = 1.5e-3, w_frac * 3e-3
        b = 3e-3 - w
        share = max(0.1, (f + b - w) / (f + b + w))
    assert plan.predicted.bubble_s == pytest.approx(one_f_one_b * share, rel=1e-9)
    zb = [n for n in plan.notes if n.startswith("ZB-H1 bubble")]
    assert len(zb) == 1
    if w_frac is None:
        assert "catalog rule" in zb[0]
    else:
        assert "measured B/W split of H100-SXM" in zb[0] and f"{share:.3f}" in zb[0]
    full = plan_job("j", spec, inv, exhaustive=True)
    assert plan.predicted.step_time_s == pytest.approx(full.predicted.step_time_s, rel=1e-9)


def test_other_schedules_have_no_zb_note() -> None:
    plan = plan_job("j", parse_job_spec(_pinned("1f1b")), _inv(_doc(0.25)))
    assert not any(n.startswith("ZB-H1 bubble") for n in plan.notes)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
@pytest.mark.parametrize("w_frac", [0.05, 0.25, 0.6])
@pytest.mark.parametrize("job", [JOB, _pinned("auto", 2), _pinned("auto", 3),
                                 {**_pinned("auto", 2), "placement": {}}])
def test_fast_equals_exhaustive_with_a_measured_split(job: dict, w_frac: float,
                                                      scale: float) -> None:
    """A small W pass (ZB-H1 fills less than a third: interleaved may beat it), the
    catalog-like one and a large one (fills more: the bounds' divisor grows past 3), on a
    profile faster than, like and slower than the catalog model: the fast search's bounds
    and its ZB-H1 dominance stay exact."""
    inv = _inv(_doc(w_frac, scale))
    for recompute in ("none", "selective"):
        spec = parse_job_spec({**job, "training": {**job["training"], "recompute": recompute}})
        fast = plan_job("j", spec, inv)
        full = plan_job("j", spec, inv, exhaustive=True)
        assert fast.predicted.step_time_s == pytest.approx(full.predicted.step_time_s,
                                                           rel=1e-9), recompute


# -- fast == exhaustive on random clusters whose devices measured a B/W split ---------------

SPLIT_DEVICES = ["H100-SXM", "MI300X", "A100-80GB", "L40S"]
Instance = tuple[dict, dict, list[tuple[str, float, float]]]


def _profiled(cluster: dict, job: dict, profiles: list[tuple[str, float, float]]):
    """The inventory with a bf16 profile of the job's layer per ``(device, scale, w_frac)``:
    the catalog model's layer times times ``scale``, forward a third, the backward split
    ``w_frac`` into W."""
    spec = parse_job_spec(job)
    inv = load_cluster(cluster)
    devices = {p.device.name: p.device for p in inv.pools}
    docs = []
    for name, scale, w_frac in profiles:
        rows = []
        for b in (1, 2, 4):
            t = cost.layer_compute_s(spec.model, b, 1, devices[name], "none") * scale
            rows.append((b, t / 3, 2 * t / 3))
        docs.append(profile_doc(name, {}, spec.model, rows, precision="bf16",
                                split=[((1 - w_frac) * bw, w_frac * bw) for _, _, bw in rows]))
    return spec, apply_profiles(inv, [profile_from_doc(d, d["device"]) for d in docs])


@st.composite
def split_instances(draw: st.DrawFn) -> Instance:
    n = draw(st.integers(1, 3))
    pools = [{"name": f"p{i}", "datacenter": draw(st.sampled_from("ab")),
              "device": draw(st.sampled_from(SPLIT_DEVICES)), "nodes": draw(st.integers(1, 2)),
              "gpusPerNode": draw(st.sampled_from([1, 2, 4])),
              "nicGbps": draw(st.sampled_from([100, 400]))} for i in range(n)]
    dcs = sorted({p["datacenter"] for p in pools})
    links = ([{"between": dcs, "bandwidthGbps": draw(st.sampled_from([10, 100])),
               "latencyMs": 1}] if len(dcs) > 1 else [])
    cluster = {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
               "metadata": {"name": "h"}, "datacenters": [{"name": d} for d in dcs],
               "links": links, "pools": pools}
    job = {"model": {"layers": draw(st.integers(2, 8)),
                     "hidden": draw(st.sampled_from([1024, 4096, 12288])), "heads": 16,
                     "seqLen": draw(st.sampled_from([1024, 4096])), "vocab": 32000},
           "training": {"globalBatch": draw(st.sampled_from([4, 8, 12])), "steps": 1,
                        "recompute": draw(st.sampled_from(["none", "selective"]))}}
    if draw(st.booleans()):
        job["parallelism"] = {"schedule": "zb-h1"}
    profiles = [(d, draw(st.sampled_from([0.3, 1.0, 3.0])),
                 draw(st.sampled_from([0.05, 0.3, 0.6, 0.7])))
                for d in sorted({p["device"] for p in pools}) if draw(st.booleans())]
    return cluster, job, profiles


def _one_pool(name: str, device: str, nodes: int, gpus: int, nic: int) -> dict:
    return {"name": name, "datacenter": "a", "device": device,
            "nodes": nodes, "gpusPerNode": gpus, "nicGbps": nic}


def _cl(*pools: dict) -> dict:
    return {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "h"},
            "datacenters": [{"name": "a"}], "links": [], "pools": list(pools)}


def _job(layers: int, hidden: int, seq: int, gb: int, recompute: str, **par) -> dict:
    return {"model": {"layers": layers, "hidden": hidden, "heads": 16, "seqLen": seq,
                      "vocab": 32000},
            "training": {"globalBatch": gb, "steps": 1, "recompute": recompute},
            **({"parallelism": par} if par else {})}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(split_instances())
# a small W pass (ZB-H1 divides by 1.07): interleaved beats ZB-H1 on the layout ZB-H1 would
# otherwise be taken to dominate
@example((_cl(_one_pool("p0", "MI300X", 2, 4, 400)), _job(8, 12288, 4096, 8, "selective"),
          [("MI300X", 3.0, 0.05)]))
# a large W pass (divisor 10): the bounds' ZB-H1 divisor must exceed the catalog's 3
@example((_cl(_one_pool("p0", "MI300X", 2, 1, 100), _one_pool("p1", "MI300X", 1, 4, 400),
              _one_pool("p2", "A100-80GB", 2, 4, 400)),
          _job(3, 1024, 4096, 4, "selective", schedule="zb-h1"),
          [("A100-80GB", 0.3, 0.7), ("MI300X", 1.0, 0.7)]))
def test_fast_equals_exhaustive_with_random_splits(instance: Instance) -> None:
    """The pruned search finds the exhaustive step time (or both refuse), whatever ZB-H1's
    measured divisor on each device."""
    assert_fast_equals_exhaustive_on(*_profiled(*instance))
