"""Measured communication in device profiles (``comm``): the relative-error line fit against
exact and hand values, parsing with field-path errors, and the time model using the measured
links (ring all-reduce inside a node for TP and DP, a floor and a cap on pipeline transfers) and
saying so, checked against the α–β formulas by hand; a slow measured all-reduce moves the
planner off tensor parallelism."""

from __future__ import annotations

import dataclasses

import pytest

from hettrain.api.spec import parse_job_spec
from hettrain.planning import cost
from hettrain.planning import planner as P
from hettrain.planning.errors import PlanningInputError
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import plan_job
from hettrain.planning.profiles import (
    apply_profiles,
    comm_doc,
    fit_line,
    fit_line_relative,
    profile_doc,
    profile_from_doc,
)
from hettrain.planning.units import build_units

JOB = {"model": {"layers": 8, "hidden": 1024, "heads": 16, "seqLen": 512, "vocab": 8000},
       "training": {"globalBatch": 16, "steps": 1, "recompute": "none"}}
SIZES = (4096, 65536, 1 << 20, 1 << 24)
P2P_LAT, P2P_BW = 80e-6, 2.0e9
STEP_LAT, BUS_BW = 30e-6, 1.5e9


def _cluster(gpus_per_node: int = 4, nodes: int = 1) -> dict:
    return {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "t"},
            "datacenters": [{"name": "a"}],
            "pools": [{"name": "h", "datacenter": "a", "device": "H100-SXM", "nodes": nodes,
                       "gpusPerNode": gpus_per_node, "nicGbps": 400}]}


def _comm(ranks: int = 2, p2p=(P2P_LAT, P2P_BW), ring=(STEP_LAT, BUS_BW)) -> dict:
    """A comm section whose rows lie exactly on the given lines."""
    steps = 2 * (ranks - 1)
    return {"ranks": ranks, "backend": "nccl",
            "p2p": [{"bytes": b, "seconds": p2p[0] + b / p2p[1]} for b in SIZES],
            "allReduce": [{"bytes": b, "seconds": steps * ring[0] + steps / ranks * b / ring[1]}
                          for b in SIZES]}


def _profile(comm: dict | None = None):
    doc = profile_doc("H100-SXM", {"torch": "x"}, parse_job_spec(JOB).model,
                      [(1, 1e-3, 2e-3), (2, 1.5e-3, 3e-3)], 0.0, comm or _comm(),
                      precision="bf16")
    return profile_from_doc(doc, "p.yaml")


def test_relative_fit_is_exact_on_a_line_and_keeps_the_latency_under_noise() -> None:
    line = [(float(b), 1e-4 + b / 2e9) for b in SIZES]
    assert fit_line_relative(line) == pytest.approx((1e-4, 1 / 2e9), rel=1e-9)
    # +20% on a large message: the relative fit keeps the small messages' latency, the plain
    # least squares lets the large messages' noise set the intercept
    noisy = [*line[:2], (line[2][0], line[2][1] * 1.2), line[3]]
    assert abs(fit_line_relative(noisy)[0] - 1e-4) / 1e-4 < 0.01
    assert abs(fit_line(noisy)[0] - 1e-4) / 1e-4 > 0.3
    # no positive slope (flat noise): the smallest time is the latency, the rest per byte
    assert fit_line_relative([(10.0, 3.0), (20.0, 2.0), (40.0, 2.5)]) == pytest.approx(
        (2.0, 0.5 / 40))
    assert fit_line_relative([(10.0, 4.0), (20.0, 3.0), (40.0, 2.5)]) == pytest.approx(
        (0.0, 2.5 / 40))  # the largest message is also the fastest: its rate alone
    # a negative intercept: through the origin (weighted Σxy/Σx²)
    a, b = fit_line_relative([(1.0, 1.0), (2.0, 4.0)])
    assert a == 0.0 and b == pytest.approx((1 + 2 * 4 / 16) / (1 + 4 / 16))


@pytest.mark.parametrize("ranks", [2, 4])
def test_comm_section_fits_the_p2p_line_and_the_ring(ranks: int) -> None:
    comm = _profile(_comm(ranks)).comm
    assert comm is not None and comm.ranks == ranks and comm.backend == "nccl"
    assert (comm.p2p_latency_s, comm.p2p_bytes_per_s) == pytest.approx((P2P_LAT, P2P_BW))
    assert (comm.ring_step_latency_s, comm.bus_bytes_per_s) == pytest.approx((STEP_LAT, BUS_BW))
    # the ring at another size: 2(n−1) steps, 2(n−1)/n bytes per byte
    bw, lat = cost.node_ring_link(dataclasses.replace(
        load_cluster(_cluster()).pools[0].device, profile=_profile(_comm(ranks))))
    assert cost.ring_all_reduce_s(1e6, 8, bw, lat) == pytest.approx(
        14 * STEP_LAT + 14 / 8 * 1e6 / BUS_BW)
    # the document round-trips (what calibration writes back to the store)
    again = profile_from_doc(profile_doc("H100-SXM", {}, parse_job_spec(JOB).model,
                                         [(1, 1e-3, 2e-3)], 0.0, comm_doc(comm)), "q.yaml").comm
    assert dataclasses.replace(again, rows=()) == dataclasses.replace(comm, rows=())


@pytest.mark.parametrize("edit,field", [
    ({"ranks": 1}, r"p.yaml.comm.ranks"), ({"ranks": True}, r"p.yaml.comm.ranks"),
    ({"p2p": [{"bytes": 4096, "seconds": 1e-4}]}, r"p.yaml.comm.p2p"),
    ({"allReduce": [{"bytes": 4096, "seconds": 1e-4}, {"bytes": 4096, "seconds": 2e-4}]},
     r"p.yaml.comm.allReduce"),
    ({"p2p": [{"bytes": 4096, "seconds": -1}, {"bytes": 8192, "seconds": 1}]},
     r"p.yaml.comm.p2p\[0\]"),
    ({"allReduce": [{"bytes": 4096}, {"bytes": 8192, "seconds": 1}]},
     r"p.yaml.comm.allReduce\[0\]"),
])
def test_bad_comm_sections_name_the_field(edit: dict, field: str) -> None:
    doc = profile_doc("H100-SXM", {}, parse_job_spec(JOB).model, [(1, 1e-3, 2e-3)], 0.0,
                      {**_comm(), **edit})
    with pytest.raises(PlanningInputError, match=rf"^{field}: "):
        profile_from_doc(doc, "p.yaml")
    with pytest.raises(PlanningInputError, match=r"^p.yaml.comm: "):
        profile_from_doc({**doc, "comm": [1, 2]}, "p.yaml")


def test_time_model_uses_the_measured_links() -> None:
    inv = apply_profiles(load_cluster(_cluster()), [_profile()])
    dev = inv.pools[0].device
    plain = dataclasses.replace(dev, profile=None)
    model = parse_job_spec(JOB).model
    nbytes = model.seq_len * 2 * model.hidden * 2  # microbatch 2, bf16
    # TP: 4 ring all-reduces per layer over the measured ring
    assert cost.tp_comm_per_layer_s(model, 2, 4, dev) == pytest.approx(
        4 * (6 * STEP_LAT + 6 / 4 * nbytes / BUS_BW))
    assert cost.tp_comm_per_layer_s(model, 2, 4, plain) == pytest.approx(
        4 * cost.ring_all_reduce_s(nbytes, 4, plain.intra_node_gbps * cost.TP_BUS_EFFICIENCY,
                                   cost.TP_LATENCY_S))
    # pipeline transfers: no faster than the measured p2p, no quicker than its latency
    assert cost.p2p_link(dev, 50.0, 20e-6) == pytest.approx((P2P_BW / 1e9, P2P_LAT))
    assert cost.p2p_link(dev, 1.0, 1e-3) == pytest.approx((1.0, 1e-3))
    assert cost.p2p_link(plain, 50.0, 20e-6) == (50.0, 20e-6)
    # DP inside a node: the measured ring; across nodes: hierarchical, the measured ring
    # inside each node and the NIC (floored by the measurement) between them
    spec = parse_job_spec({**JOB, "training": {**JOB["training"], "optimizerSharding": False}})
    unit = build_units(inv.pools, merged=False)[0]
    lat, per_byte, *_ = P._dp_rates(unit, 4, 1, inv, spec)
    assert (lat, per_byte) == pytest.approx((6 * STEP_LAT, 2 * 3 / 4 / BUS_BW))
    wide = apply_profiles(load_cluster(_cluster(gpus_per_node=2, nodes=2)), [_profile()])
    unit = build_units(wide.pools, merged=False)[0]
    lat, per_byte, *_ = P._dp_rates(unit, 4, 1, wide, spec)
    nic = min(unit.nic_gbytes_per_gpu * 1e9, BUS_BW)
    # 2 members per node: reduce-scatter + all-gather of 1 step each inside the node, then
    # each member's half crosses between the 2 nodes over its own NIC share
    assert (lat, per_byte) == pytest.approx(
        (2 * STEP_LAT + 2 * max(STEP_LAT, cost.COLLECTIVE_LATENCY_S),
         2 * 1 / 2 / BUS_BW + 2 * 1 / 2 / 2 / nic))


def test_plan_notes_say_which_links_were_measured() -> None:
    spec = parse_job_spec(JOB)
    plan = plan_job("j", spec, apply_profiles(load_cluster(_cluster()), [_profile()]))
    assert any("collectives inside a node of H100-SXM from device profiles" in n
               for n in plan.notes), plan.notes
    layer_note = next(n for n in plan.notes if n.startswith("layer times of"))
    assert "communication" not in layer_note
    plain = plan_job("j", spec, load_cluster(_cluster()))
    assert not any("collectives inside a node" in n for n in plain.notes)


def test_a_slow_measured_all_reduce_moves_the_plan_off_tensor_parallelism() -> None:
    """On the catalog's NVLink the planner shards the layers over TP; where the profile
    measured a ring 10⁴× slower, TP's per-layer all-reduces cost more than they save."""
    spec = parse_job_spec({**JOB, "parallelism": {"pp": 1, "dp": 1}})
    fast = plan_job("j", spec, load_cluster(_cluster()))
    assert fast.stages[0].tp > 1
    slow = _profile(_comm(ring=(1e-3, 1.5e5)))
    plan = plan_job("j", spec, apply_profiles(load_cluster(_cluster()), [slow]))
    assert plan.stages[0].tp == 1
    assert plan.predicted.step_time_s > fast.predicted.step_time_s


def test_zero2_layers_pay_the_measured_all_reduce_of_their_size() -> None:
    """ZeRO-2/3 all-reduce each layer's gradient alone: inside a node the planner takes the
    profile's measured all-reduce at that size (interpolated) where it is slower than the
    fitted line -- here a measured bump 10x above the line at exactly one layer's bytes."""
    model = parse_job_spec(JOB).model
    layer_bytes = cost.layer_params(model) * 4.0
    comm = _comm()
    bump = 10 * (2 * STEP_LAT + layer_bytes / BUS_BW)
    comm["allReduce"] = sorted(comm["allReduce"] + [{"bytes": int(layer_bytes),
                                                     "seconds": bump}],
                               key=lambda r: r["bytes"])
    inv = apply_profiles(load_cluster(_cluster()), [_profile(comm)])
    unit = build_units(inv.pools, merged=False)[0]
    per_unit = {}
    for sharding in ("optimizer", "gradients"):
        spec = parse_job_spec({**JOB, "training": {**JOB["training"], "sharding": sharding,
                                                   "overlapGradReduce": False}})
        per_unit[sharding] = P._dp_sync_coeffs(unit, 2, 1, inv, spec, 1, 1.0, 0.0, False,
                                               False)
        lat, red, gat, _, _ = P._dp_rates(unit, 2, 1, inv, spec)
    # gradients: the measured bump per layer plus one per-unit all-gather (half a latency)
    assert per_unit["gradients"][0] == pytest.approx(bump + layer_bytes * gat + lat / 2)
    # ZeRO-1 reduces the whole stage at once: the fitted line, no per-layer bump
    assert per_unit["optimizer"][0] == pytest.approx(layer_bytes * (red + gat))


def test_zero3_gathers_pay_the_measured_all_gather_of_each_units_parameters() -> None:
    """Where the profile measured all-gathers (``allGather``: the gathered bytes), ZeRO-3's
    per-layer parameter gather inside a node costs the measured all-gather of one layer's
    parameters (plan precision) -- here as slow as the all-reduce of those bytes, as gloo's
    measured, not the half a ring would take; the rows read back unchanged, and a profile
    without them keeps pricing a gather at half the all-reduce."""
    model = parse_job_spec(JOB).model
    comm = _comm()
    ar = {r["bytes"]: r["seconds"] for r in comm["allReduce"]}
    comm["allGather"] = [{"bytes": b, "seconds": t} for b, t in ar.items()]
    prof = _profile(comm)
    assert prof.comm.measures_all_gather and not _profile().comm.measures_all_gather
    assert comm_doc(prof.comm)["allGather"] == comm["allGather"]
    assert "allGather" not in comm_doc(_profile().comm)
    layer_p = cost.layer_params(model) * 2.0  # bf16 parameters
    assert prof.comm.all_gather_s(layer_p) == pytest.approx(prof.comm.all_reduce_s(layer_p))
    assert _profile().comm.all_gather_s(layer_p) == pytest.approx(
        _profile().comm.all_reduce_s(layer_p) / 2)
    spec = parse_job_spec({**JOB, "training": {**JOB["training"], "sharding": "full",
                                               "overlapGradReduce": False}})
    coeffs = {}
    for name, p in (("measured", prof), ("half", _profile())):
        inv = apply_profiles(load_cluster(_cluster()), [p])
        unit = build_units(inv.pools, merged=False)[0]
        coeffs[name] = P._dp_sync_coeffs(unit, 2, 1, inv, spec, 1, 1.0, 0.0, False, False)[0]
        lat, red, _, _, _ = P._dp_rates(unit, 2, 1, inv, spec)
        c_red = max(cost.layer_params(model) * 4.0 * red + lat,
                    prof.comm.all_reduce_s(cost.layer_params(model) * 4.0))
    # full, m = 1: one reduction and two gathers per layer
    assert coeffs["measured"] == pytest.approx(c_red + 2 * prof.comm.all_gather_s(layer_p))
    assert coeffs["half"] < coeffs["measured"]
