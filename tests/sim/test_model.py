"""Failure model defaults (Llama 3 calibration), YAML parsing and its field-named errors."""

from __future__ import annotations

import math

import pytest

from hettrain.sim.cluster import generate_cluster, topology_of
from hettrain.sim.model import (
    LLAMA3_DAYS,
    LLAMA3_GPUS,
    LLAMA3_INTERRUPTIONS,
    LLAMA3_RUNNING_FRACTION,
    FailureModel,
    SimInputError,
    failure_model_from_dict,
    load_models,
    recovery_model_from_dict,
    young_daly_interval,
)
from hettrain.sim.scenarios import expected_interruption_rate


def test_defaults_reproduce_llama3_rates():
    """16,384 H100 running 92 % of 54 days: 419 interruptions, 78 % hardware (8.4 % switches)."""
    topo = topology_of(generate_cluster(f"{LLAMA3_GPUS}:H100-SXM"), 2)
    m = FailureModel()
    horizon = LLAMA3_DAYS * 86400
    total = expected_interruption_rate(topo, m, topo.pool_nodes, topo.gpus) * horizon
    assert abs(total * LLAMA3_RUNNING_FRACTION - LLAMA3_INTERRUPTIONS) < 1.0
    node = topo.nodes * m.node_rate_per_s("H100-SXM", 8) * horizon
    rack = topo.racks(0) / (m.rack_mtbf_h * 3600) * horizon
    assert abs((node + rack) / total - 0.78) < 0.005
    assert abs(rack / total - 0.084) < 0.002


def test_yaml_defaults_and_overrides(tmp_path):
    path = tmp_path / "f.yaml"
    path.write_text("kind: FailureModel\n"
                    "failures:\n  gpuMtbfHours: 1000\n  devices: {MI300X: {gpuMtbfHours: 500}}\n"
                    "  repair: {dist: exponential, meanHours: 2}\n"
                    "  datacenter: {mtbfHours: 100, durationHours: 3}\n"
                    "recovery: {detectionSeconds: 60, checkpointIntervalSeconds: 900}\n")
    f, r = load_models(path)
    assert f.gpu_mtbf_h == 1000 and f.device_mtbf_h == {"MI300X": 500}
    assert math.isclose(f.node_rate_per_s("MI300X", 8), 8 / (500 * 3600))
    assert (f.repair.dist, f.repair.mean_s) == ("exponential", 7200)
    assert (f.dc_mtbf_h, f.dc_duration.mean_s) == (100, 3 * 3600)
    assert f.rack_mtbf_h == FailureModel().rack_mtbf_h  # untouched default
    assert (r.detection_s, r.checkpoint_interval_s, r.restart_s) == (60, 900, 600)
    assert recovery_model_from_dict({}).checkpoint_interval_s is None  # auto = Young-Daly


@pytest.mark.parametrize(("doc", "field"), [
    ({"gpuMtbfHours": -1}, "failures.gpuMtbfHours"),
    ({"gpuMtbfHours": "x"}, "failures.gpuMtbfHours"),
    ({"mtbf": 1}, "failures.mtbf"),
    ({"repair": {"dist": "weibull"}}, "failures.repair.dist"),
    ({"rack": {"nodesPerRack": 0}}, "failures.rack.nodesPerRack"),
    ({"stragglers": {"slowdown": 0.5}}, "failures.stragglers.slowdown"),
])
def test_bad_failure_fields_are_named(doc, field):
    with pytest.raises(SimInputError) as exc:
        failure_model_from_dict(doc)
    assert exc.value.field == field


def test_bad_file_kind(tmp_path):
    path = tmp_path / "f.yaml"
    path.write_text("kind: Cluster\n")
    with pytest.raises(SimInputError, match="kind: FailureModel"):
        load_models(path)
    with pytest.raises(SimInputError, match="storageGBps"):
        recovery_model_from_dict({"storageGBps": 0})


def test_young_daly():
    assert math.isclose(young_daly_interval(10.0, 3600.0), math.sqrt(2 * 10 * 3600))
    assert young_daly_interval(10.0, math.inf) == math.inf


def test_example_failure_file_parses():
    from pathlib import Path

    f, r = load_models(Path(__file__).parents[2] / "examples" / "sim" / "llama3-failures.yaml")
    assert f == FailureModel() and r.checkpoint_interval_s is None


def test_llama3_scenario_sees_about_419_interruptions():
    """The preset reproduces the paper's count and lands near its >90 % effective time."""
    from hettrain.sim.run import run_scenario
    from hettrain.sim.scenarios import preset

    rep = run_scenario(preset("llama3-16k"), policies=("restart",), seeds=(0, 1, 2))
    assert abs(rep.mean("restart", "total_interruptions") / LLAMA3_INTERRUPTIONS - 1) < 0.05
    runs = rep.results["restart"]
    running = [sum(r.time_s[b] for b in ("productive", "checkpoint", "lost_work")) / r.wall_s
               for r in runs]
    assert abs(sum(running) / len(running) - LLAMA3_RUNNING_FRACTION) < 0.01
    assert 0.88 < rep.mean("restart", "ettr") < 0.92
