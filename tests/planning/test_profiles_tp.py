"""Device profiles with the layer measured sharded (``tp`` section): parsing with field-path
errors, a profile without it loads as before, the time model takes the measured line at that
TP degree only (and only without recompute), a crowded CPU node does not slow it twice, the
plan notes say so, and fast == exhaustive with such profiles (the root bound stays
admissible)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tests.planning.test_fast_vs_exhaustive import assert_fast_equals_exhaustive_on

from hettrain.api.spec import parse_job_spec
from hettrain.planning import cost
from hettrain.planning.errors import PlanningInputError
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import plan_job
from hettrain.planning.profiles import apply_profiles, profile_doc, profile_from_doc

JOB = {"model": {"layers": 6, "hidden": 1024, "heads": 16, "seqLen": 512, "vocab": 8000},
       "training": {"globalBatch": 8, "steps": 1, "recompute": "none"}}
ROWS = tuple((b, 0.5e-3 * (1 + b), 1e-3 * (1 + b)) for b in (1, 2, 4))  # t = 1.5 ms·(1 + b)
# at tp 2: forward + backward 1 ms + 0.6 ms·b (exact rows of that line)
TP_ROWS = tuple((b, (1e-3 + 6e-4 * b) / 3, 2 * (1e-3 + 6e-4 * b) / 3) for b in (1, 2, 4))


def _cluster(nodes: int = 1, gpus: int = 4) -> dict:
    pools = [{"name": "h", "datacenter": "a", "device": "H100-SXM", "nodes": nodes,
              "gpusPerNode": gpus, "nicGbps": 400},
             {"name": "m", "datacenter": "a", "device": "MI300X", "nodes": 1, "gpusPerNode": 4,
              "nicGbps": 400}]
    return {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "t"},
            "datacenters": [{"name": "a"}], "pools": pools}


def _doc(tp_rows=TP_ROWS, **kw) -> dict:
    tp = None if tp_rows is None else [{"tp": 2, "backend": "nccl", "layer": list(tp_rows)}]
    return profile_doc("H100-SXM", {"torch": "x"}, parse_job_spec(JOB).model, ROWS,
                       precision="bf16", tp=tp, **kw)


def _h100(doc: dict, cluster: dict | None = None):
    inv = apply_profiles(load_cluster(cluster or _cluster()), [profile_from_doc(doc, "p")])
    return inv, inv.pool("h").device


def test_tp_rows_parse_to_their_line() -> None:
    doc = _doc()
    assert doc["tp"][0]["tp"] == 2 and len(doc["tp"][0]["layer"]) == 3
    prof = profile_from_doc(doc, "p.yaml")
    assert prof.measured_tp(2) == pytest.approx((1e-3, 6e-4))
    assert prof.measured_tp(4) is None
    assert (prof.alpha, prof.beta) == pytest.approx((1.5e-3, 1.5e-3))  # tp 1 unchanged


def test_a_profile_without_tp_rows_loads_as_before() -> None:
    prof = profile_from_doc(_doc(None), "old.yaml")
    assert prof.tp_layers == () and prof.measured_tp(2) is None
    old = {**_doc(), "version": 1}
    old.pop("precision")
    with pytest.raises(PlanningInputError, match=r"^p.yaml.tp: "):
        profile_from_doc(old, "p.yaml")  # version 1 had no tp section


@pytest.mark.parametrize("tp,field", [
    ([{"tp": 1, "layer": [{"microBatch": 1, "forwardS": 1, "backwardS": 1}]}],
     r"p.yaml.tp\[0\].tp"),
    ([{"tp": 2, "layer": [{"microBatch": 1, "forwardS": 1, "backwardS": 1}]},
      {"tp": 2, "layer": [{"microBatch": 1, "forwardS": 1, "backwardS": 1}]}],
     r"p.yaml.tp\[1\].tp"),
    ([{"tp": 2, "layer": []}], r"p.yaml.tp\[0\].layer"),
    ([{"tp": 2, "layer": [{"microBatch": 1, "forwardS": -1, "backwardS": 1}]}],
     r"p.yaml.tp\[0\].layer\[0\]"),
    ({"tp": 2}, "p.yaml.tp"),
])
def test_bad_tp_sections_name_the_field(tp, field: str) -> None:
    with pytest.raises(PlanningInputError, match=rf"^{field}: "):
        profile_from_doc({**_doc(None), "tp": tp}, "p.yaml")


def test_time_model_takes_the_measured_tp_line_there_only() -> None:
    """At tp 2 without recompute: the measured line (1 + 0.6·b ms, TP all-reduces included);
    tp 4, selective recompute, another device: derived as before."""
    spec = parse_job_spec(JOB)
    _, h100 = _h100(_doc())
    _, plain = _h100(_doc(None))
    assert cost.layer_time_s(spec.model, spec.training, 2, 2, h100) == pytest.approx(2.2e-3)
    assert cost.layer_time_s(spec.model, spec.training, 2, 1, h100) == pytest.approx(4.5e-3)
    assert cost.layer_time_s(spec.model, spec.training, 2, 4, h100) == pytest.approx(
        cost.layer_time_s(spec.model, spec.training, 2, 4, plain))
    sel = dataclasses.replace(spec.training, recompute="selective")
    assert cost.layer_time_s(spec.model, sel, 2, 2, h100) == pytest.approx(
        cost.layer_time_s(spec.model, sel, 2, 2, plain))
    fp32 = dataclasses.replace(spec.training, precision="fp32")  # the profile is bf16
    assert cost.measured_tp_line(spec.model, fp32, 2, h100) is None


def _pinned(tp: int, pp: int = 2) -> dict:
    return {**JOB, "parallelism": {"tp": tp, "pp": pp, "dp": 1}, "placement": {"pools": ["h"]},
            "training": {**JOB["training"], "microBatch": 2}}


def test_planner_uses_the_measured_tp_line_and_says_so() -> None:
    """A pinned tp=2 layout: each stage's time is the same layout's without the tp rows plus
    its layers times (measured − derived) layer seconds; the notes name the measured degree.
    A tp=1 layout neither changes nor gets the note."""
    spec = parse_job_spec(_pinned(2))
    inv, h100 = _h100(_doc())
    ref_inv, plain = _h100(_doc(None))
    got, ref = plan_job("j", spec, inv), plan_job("j", spec, ref_inv)
    assert [s.tp for s in got.stages] == [2, 2]
    delta = (cost.layer_time_s(spec.model, spec.training, 2, 2, h100)
             - cost.layer_time_s(spec.model, spec.training, 2, 2, plain))
    assert delta != pytest.approx(0.0)
    for a, b in zip(got.stages, ref.stages, strict=True):
        n = a.layer_end - a.layer_start
        if n == b.layer_end - b.layer_start:
            assert a.time_ms == pytest.approx(b.time_ms + 1e3 * n * delta)
    assert any("layer times of H100-SXM at tp=2 measured sharded" in n for n in got.notes)
    assert not any("measured sharded" in n for n in ref.notes)
    one = plan_job("j", parse_job_spec(_pinned(1)), inv)
    one_ref = plan_job("j", parse_job_spec(_pinned(1)), ref_inv)
    assert one.predicted.step_time_s == pytest.approx(one_ref.predicted.step_time_s)
    assert not any("measured sharded" in n for n in one.notes)


def test_a_crowded_node_does_not_slow_the_measured_tp_layer_again() -> None:
    """Pool h is ONE node: tp=2 keeps two busy ranks there, so the measured concurrent
    slowdown applies, but only to the stage's fixed part; the layers measured sharded already
    ran with those ranks busy."""
    conc = {"ranks": 2, "layer": [(b, f * 1.3, bw * 1.3) for b, f, bw in ROWS]}
    spec = parse_job_spec(_pinned(2, pp=1))
    inv, h100 = _h100(_doc(concurrent=conc))
    ref_inv, _ = _h100(_doc())
    got, ref = plan_job("j", spec, inv), plan_job("j", spec, ref_inv)
    layers = 6 * cost.layer_time_s(spec.model, spec.training, 2, 2, h100)
    fixed = ref.stages[0].time_ms / 1e3 - layers
    assert fixed > 0
    assert got.stages[0].time_ms / 1e3 == pytest.approx(layers + 1.3 * fixed)


# -- fast == exhaustive on random clusters whose devices measured tp rows -------------------

DEVICES = ["H100-SXM", "MI300X", "A100-80GB", "L40S"]


def _profiled(cluster: dict, job: dict, profiles: list[tuple[str, float, float]]):
    """The inventory with a bf16 profile of the job's layer per ``(device, scale, tp_scale)``:
    the catalog model's tp-1 layer times ``scale``, and a tp-2 row of the derived tp-2 layer
    (tp-1 / 2 + modelled TP comm) times ``tp_scale``."""
    spec = parse_job_spec(job)
    inv = load_cluster(cluster)
    devices = {p.device.name: p.device for p in inv.pools}
    none = dataclasses.replace(spec.training, recompute="none")
    docs = []
    for name, scale, tp_scale in profiles:
        dev = devices[name]
        rows, tp_rows = [], []
        for b in (1, 2, 4):
            t = cost.layer_compute_s(spec.model, b, 1, dev, "none") * scale
            rows.append((b, t / 3, 2 * t / 3))
            t2 = (t / 2 + cost.tp_comm_per_layer_s(spec.model, b, 2, dev)) * tp_scale
            tp_rows.append((b, t2 / 3, 2 * t2 / 3))
        assert none.recompute == "none"
        docs.append(profile_doc(name, {}, spec.model, rows, precision="bf16",
                                tp=[{"tp": 2, "layer": tp_rows}]))
    return spec, apply_profiles(inv, [profile_from_doc(d, d["device"]) for d in docs])


@st.composite
def tp_instances(draw: st.DrawFn):
    n = draw(st.integers(1, 3))
    pools = [{"name": f"p{i}", "datacenter": "a", "device": draw(st.sampled_from(DEVICES)),
              "nodes": draw(st.integers(1, 2)), "gpusPerNode": draw(st.sampled_from([1, 2, 4])),
              "nicGbps": draw(st.sampled_from([100, 400]))} for i in range(n)]
    cluster = {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
               "metadata": {"name": "h"}, "datacenters": [{"name": "a"}], "pools": pools}
    job = {"model": {"layers": draw(st.integers(2, 8)),
                     "hidden": draw(st.sampled_from([1024, 4096, 12288])), "heads": 16,
                     "seqLen": draw(st.sampled_from([1024, 4096])), "vocab": 32000},
           "training": {"globalBatch": draw(st.sampled_from([4, 8, 12])), "steps": 1,
                        "recompute": draw(st.sampled_from(["none", "none", "selective"]))}}
    profiles = [(d, draw(st.sampled_from([0.3, 1.0, 3.0])),
                 draw(st.sampled_from([0.1, 0.5, 1.0, 4.0])))
                for d in sorted({p["device"] for p in pools}) if draw(st.booleans())]
    return cluster, job, profiles


def _cl(*pools: dict) -> dict:
    return {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "h"},
            "datacenters": [{"name": "a"}], "pools": list(pools)}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(tp_instances())
# a tp-2 layer measured 10x faster than derived: below tp-1's rate, the root bound must see it
@example((_cl({"name": "p0", "datacenter": "a", "device": "H100-SXM", "nodes": 2,
               "gpusPerNode": 4, "nicGbps": 400}),
          {"model": {"layers": 4, "hidden": 4096, "heads": 16, "seqLen": 4096, "vocab": 32000},
           "training": {"globalBatch": 8, "steps": 1, "recompute": "none"}},
          [("H100-SXM", 1.0, 0.1)]))
def test_fast_equals_exhaustive_with_random_tp_rows(instance) -> None:
    assert_fast_equals_exhaustive_on(*_profiled(*instance))
