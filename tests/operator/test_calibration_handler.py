"""The operator's calibration glue (hettrain.handlers.job): which stored profiles a job plans
with, when it reads the runtime's stage times, and the predicted/measured metrics series."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY
from tests.operator.test_calibration_loop import SPEC, _body, _nodes

from hettrain import metrics
from hettrain.api import constants as c
from hettrain.api.spec import parse_job_spec
from hettrain.handlers import job as handlers
from hettrain.planning import calibration as cal
from hettrain.planning.profiles import LayerProfile, model_shape
from hettrain.reconcile import Observed

SPEC_ON = {**SPEC, "checkpoint": {"uri": "/ckpt"}}


def _doc(device: str, spec: Any, beta: float) -> str:
    prof = LayerProfile(device, model_shape(spec.model), 1e-3, beta, 1 / 3)
    return yaml.safe_dump(cal.profile_to_doc(prof, spec.model, {"image": spec.image}))


def test_the_job_plans_with_the_profiles_of_its_own_key(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = parse_job_spec(SPEC_ON)
    other = parse_job_spec({**SPEC_ON, "image": "elsewhere:2"})
    shape = model_shape(spec.model)
    fp = spec.training.precision
    store = {cal.store_key("CPU-A", shape, spec.image, fp): _doc("CPU-A", spec, 2e-3),
             cal.store_key("CPU-B", shape, other.image, fp): _doc("CPU-B", spec, 5e-3),
             "broken.yaml": "kind: [",
             "CPU-B.typo.yaml": _doc("CPU-B", spec, 7e-3)}  # a key that is not its own
    monkeypatch.setattr(handlers.profile_store, "read_profiles", lambda api, ns: store)
    scraped: list[Any] = []
    monkeypatch.setattr(handlers.calibration_scrape, "scrape",
                        lambda targets: scraped.append(targets) or [])
    obs = handlers._with_calibration_inputs("ns", _body(SPEC_ON, {}), Observed([], _nodes()))
    assert set(obs.profiles) == {"CPU-A"} and obs.profiles["CPU-A"].beta == pytest.approx(2e-3)
    assert scraped == []  # not running: nothing read from the runtime
    off = {**SPEC_ON, "calibration": {"enabled": False}}
    assert handlers._with_calibration_inputs("ns", _body(off, {}), Observed([], _nodes())
                                             ).profiles == {}


def test_a_running_job_reads_its_stage_first_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    from hettrain.reconcile import reconcile

    d = reconcile(_body(SPEC_ON, {}), Observed(pods=[], nodes=_nodes(),
                                               devices=handlers_devices()))
    assert d.plan is not None
    pods = [{**p, "status": {"phase": "Running", "podIP": "10.1.0.9"}} for p in d.create
            if p["kind"] == "Pod"]
    monkeypatch.setattr(handlers.profile_store, "read_profiles", lambda api, ns: {})
    seen: list[dict[int, str]] = []
    report = cal.StageMeasurement(0, 0.01, 0.0, 5)
    monkeypatch.setattr(handlers.calibration_scrape, "scrape",
                        lambda targets: seen.append(dict(targets)) or [report])
    status = {**d.status, "phase": c.PHASE_RUNNING}
    obs = handlers._with_calibration_inputs("ns", _body(SPEC_ON, status),
                                            Observed(pods=pods, nodes=_nodes(), plan=d.plan))
    assert seen == [{(0, 0): "http://10.1.0.9:9400/metrics",
                     (0, 1): "http://10.1.0.9:9400/metrics"}]
    assert obs.stage_reports == (report,)
    # decided for this attempt (no re-plan pending): the runtime is not read again
    decided = {**status, "calibration": {"attempt": status["attempt"], "pendingReplan": False}}
    obs = handlers._with_calibration_inputs("ns", _body(SPEC_ON, decided),
                                            Observed(pods=pods, nodes=_nodes(), plan=d.plan))
    assert len(seen) == 1 and obs.stage_reports == ()
    pending = {**decided, "calibration": {**decided["calibration"], "pendingReplan": True}}
    handlers._with_calibration_inputs("ns", _body(SPEC_ON, pending),
                                      Observed(pods=pods, nodes=_nodes(), plan=d.plan))
    assert len(seen) == 2  # waiting for the checkpoint: read


def handlers_devices() -> dict[str, Any]:
    from tests.operator.test_calibration_loop import _devices

    return _devices()


def _value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_stage_metrics_are_set_and_removed() -> None:
    rows = [cal.StageComparison(0, "CPU-A", 0.010, 0.030, 0.001),
            cal.StageComparison(1, "CPU-B", 0.020, 0.021, 0.001)]
    metrics.set_calibration("ns", "m1", rows)
    lab = {"namespace": "ns", "job": "m1", "group": "0", "stage": "0", "device": "CPU-A"}
    assert _value("hettrain_job_stage_predicted_seconds", **lab) == pytest.approx(0.010)
    assert _value("hettrain_job_stage_measured_seconds", **lab) == pytest.approx(0.030)
    metrics.set_calibration("ns", "m1", rows[1:])  # stage 0 gone from the new plan
    assert _value("hettrain_job_stage_measured_seconds", **lab) is None
    metrics.set_phase("ns", "m1", None)  # the job is deleted: its series go
    assert _value("hettrain_job_stage_measured_seconds", namespace="ns", job="m1", group="0",
                  stage="1", device="CPU-B") is None
