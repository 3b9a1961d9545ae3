"""spec.calibration.profile: profiling pods before the first plan (pure reconcile), each pod's
command run for real here (the job manifest from its ConfigMap, the profile written where
the pod's termination message would be), the first plan made with the measured profiles."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from tests.operator.test_calibration_loop import SPEC, _body, _devices, _nodes

from hettrain.api import constants as c
from hettrain.api.spec import parse_job_spec
from hettrain.manifests.profiling import JOB_KEY, JOB_MOUNT_DIR, TERMINATION_LOG
from hettrain.planning.calibration import store_key
from hettrain.planning.profiles import model_shape
from hettrain.reconcile import Observed, reconcile

PROFILE_SPEC = {**SPEC, "checkpoint": {"uri": "/ckpt"},
                "calibration": {"enabled": True, "profile": True}}


def _key(device: str, job) -> str:
    """The profile store key the operator gives ``device``'s profile for ``job``."""
    return store_key(device, model_shape(job.model), job.image, job.training.precision)


def _run_pod(pod: dict[str, Any], job_yaml: str, tmp: Path) -> str:
    """Run the profiling container's command locally; its termination message."""
    (tmp / JOB_KEY).write_text(job_yaml)
    out = tmp / f"{pod['metadata']['name']}.termination"
    cmd = [str(tmp / JOB_KEY) if a == f"{JOB_MOUNT_DIR}/{JOB_KEY}" else
           str(out) if a == TERMINATION_LOG else a
           for a in pod["spec"]["containers"][0]["command"]]
    assert cmd[:3] == ["python", "-m", "hettrain.runtime.profile"]
    cmd = [sys.executable, *cmd[1:]]
    cmd[cmd.index("--repeats") + 1] = "2"  # keep it short on a shared CPU
    subprocess.run(cmd, check=True, timeout=300)
    return out.read_text()


def test_profiling_pods_then_the_first_plan_uses_their_profiles(tmp_path: Path) -> None:
    obs = Observed(pods=[], nodes=_nodes(), devices=_devices())
    d1 = reconcile(_body(PROFILE_SPEC, {}), obs)
    assert d1.plan is None and d1.status["phase"] == c.PHASE_PENDING
    assert d1.status["calibration"]["profiling"] == {"state": "Running", "pools": ["pa", "pb"]}
    assert [e.reason for e in d1.events] == [c.REASON_PROFILING]
    cms = [o for o in d1.create if o["kind"] == "ConfigMap"]
    pods = [o for o in d1.create if o["kind"] == "Pod"]
    assert len(cms) == 1 and len(pods) == 2
    devices = {p["spec"]["containers"][0]["command"][5] for p in pods}
    assert devices == {"CPU-A", "CPU-B"}
    for p in pods:
        assert p["metadata"]["labels"][c.LABEL_ATTEMPT] == "0"
        assert p["spec"]["automountServiceAccountToken"] is False
    status = {**d1.status}

    # still running: wait, create nothing
    running = [{**p, "status": {"phase": "Running"}} for p in pods]
    d2 = reconcile(_body(PROFILE_SPEC, status), Observed(pods=running, nodes=_nodes(),
                                                         devices=_devices()))
    assert not d2.create and not d2.delete and d2.retry_after

    done = []
    for p in pods:
        message = _run_pod(p, cms[0]["data"][JOB_KEY], tmp_path)
        done.append({**p, "status": {"phase": "Succeeded", "containerStatuses": [
            {"name": "profiler", "state": {"terminated": {"exitCode": 0,
                                                          "message": message}}}]}})
    d3 = reconcile(_body(PROFILE_SPEC, status), Observed(pods=done, nodes=_nodes(),
                                                         devices=_devices()))
    assert d3.plan is not None and d3.status["attempt"] == 1
    job = parse_job_spec(PROFILE_SPEC)
    assert set(d3.profiles_to_store) == {_key(dev, job)
                                         for dev in ("CPU-A", "CPU-B")}
    for text in d3.profiles_to_store.values():
        assert yaml.safe_load(text)["kind"] == "DeviceProfile"
    assert {n for k, n in d3.delete if k == "Pod"} == {p["metadata"]["name"] for p in pods}
    assert ("ConfigMap", cms[0]["metadata"]["name"]) in d3.delete
    assert any("from device profiles (measured)" in n for n in d3.plan.notes), d3.plan.notes
    # each pod also timed two local ranks' transfers: the plan's links are the measured ones
    assert any("collectives inside a node of" in n for n in d3.plan.notes), d3.plan.notes
    assert d3.status["calibration"]["profiling"]["state"] == "Done"


def test_profiles_in_the_store_skip_profiling() -> None:
    from hettrain.planning.profiles import LayerProfile

    job = parse_job_spec(PROFILE_SPEC)
    profiles = {d: LayerProfile(d, model_shape(job.model), 1e-3, 2e-3, 1 / 3)
                for d in ("CPU-A", "CPU-B")}
    d = reconcile(_body(PROFILE_SPEC, {}), Observed(pods=[], nodes=_nodes(),
                                                    devices=_devices(), profiles=profiles))
    assert d.plan is not None  # planned at once with the stored profiles
    assert not any(o["kind"] == "Pod" and o["metadata"]["labels"][c.LABEL_ATTEMPT] == "0"
                   for o in d.create)


def test_a_failed_profiling_pod_falls_back_to_the_catalog() -> None:
    d1 = reconcile(_body(PROFILE_SPEC, {}), Observed(pods=[], nodes=_nodes(),
                                                     devices=_devices()))
    pods = [{**p, "status": {"phase": "Failed"}} for p in d1.create if p["kind"] == "Pod"]
    d2 = reconcile(_body(PROFILE_SPEC, d1.status), Observed(pods=pods, nodes=_nodes(),
                                                            devices=_devices()))
    assert d2.plan is not None and not d2.profiles_to_store
    warnings = [e for e in d2.events if e.type == "Warning"]
    assert len(warnings) == 2 and "catalog model" in warnings[0].message
