"""Reconcile with checkpoint storage signals: a missing PVC/Secret fails fast (no pods, no
repair), a runtime checkpoint-storage error is not repaired, a resume that found no
checkpoint becomes a Warning event and status.checkpoint."""

from __future__ import annotations

from tests.operator.optest_helpers import hetero_nodes, job_body

from hettrain.api import constants as c
from hettrain.api.status import get_condition
from hettrain.reconcile import NO_CHECKPOINT_MARK, Observed, reconcile


def _terminated(pod, phase, message):
    pod["status"] = {"phase": phase, "containerStatuses": [
        {"name": "trainer", "state": {"terminated": {"exitCode": 2 if phase == "Failed" else 0,
                                                     "message": message}}}]}


def _merge(body, d):
    body["status"] = {**body.get("status", {}), **d.status}


def test_missing_storage_fails_fast_without_pods_or_repairs():
    body = job_body({"checkpoint": {"pvc": "gone"}})
    problem = "spec.checkpoint.pvc: PersistentVolumeClaim 'gone' not found in namespace 'ns'"
    d = reconcile(body, Observed([], hetero_nodes(), None, now=1.0, storage_problem=problem))
    _merge(body, d)
    assert not [o for o in d.create if o["kind"] == "Pod"]
    assert body["status"]["phase"] == c.PHASE_FAILED
    cond = get_condition(body["status"], c.COND_CHECKPOINT_STORAGE)
    assert cond["status"] == "False" and cond["reason"] == c.REASON_CHECKPOINT_STORAGE
    assert "spec.checkpoint.pvc" in cond["message"]
    assert "repairs" not in body["status"]
    assert [e.type for e in d.events] == ["Warning"] and "spec.checkpoint.pvc" in \
        d.events[0].message


def _launched():
    body = job_body()
    nodes = hetero_nodes()
    d = reconcile(body, Observed([], nodes, None, now=1000.0))
    _merge(body, d)
    pods = [o for o in d.create if o["kind"] == "Pod"]
    return body, nodes, d.plan, pods


def test_a_runtime_checkpoint_error_is_not_repaired():
    body, nodes, plan, pods = _launched()
    for p in pods:
        p["status"] = {"phase": "Running"}
    _terminated(pods[0], "Failed", "HETTRAIN_CHECKPOINT_ERROR: spec.checkpoint.uri (env "
                "HETTRAIN_CHECKPOINT_URI)='s3://b/x': cannot write a probe object "
                "(PermissionError: Forbidden); check ... spec.checkpoint.secretRef")
    d = reconcile(body, Observed(pods, nodes, plan, now=1001.0))
    _merge(body, d)
    assert body["status"]["phase"] == c.PHASE_FAILED
    assert d.repair_cause is None and "repairs" not in body["status"]
    msg = get_condition(body["status"], c.COND_CHECKPOINT_STORAGE)["message"]
    assert msg.startswith("spec.checkpoint.uri") and "secretRef" in msg
    assert {n for k, n in d.delete if k == "Pod"} == {p["metadata"]["name"] for p in pods}


def test_a_resume_without_checkpoint_posts_one_warning_and_records_it():
    body, nodes, plan, pods = _launched()
    msg = f"{NO_CHECKPOINT_MARK}: resume requested but no committed checkpoint under /x"
    for p in pods:
        _terminated(p, "Succeeded", "")
    _terminated(pods[0], "Succeeded", msg)
    d = reconcile(body, Observed(pods, nodes, plan, now=1002.0))
    _merge(body, d)
    warn = [e for e in d.events if e.reason == c.REASON_NO_CHECKPOINT]
    assert len(warn) == 1 and warn[0].type == "Warning" and "step 0" not in warn[0].reason
    assert body["status"]["checkpoint"] == {"noCheckpointAttempt": 1, "message": msg}
    again = reconcile(body, Observed(pods, nodes, plan, now=1003.0))
    assert not [e for e in again.events if e.reason == c.REASON_NO_CHECKPOINT]


def test_a_missing_secret_seen_in_the_pods_fails_fast_naming_the_field():
    body = job_body({"checkpoint": {"uri": "s3://b/x", "secretRef": "s3-creds"}})
    nodes = hetero_nodes()
    d = reconcile(body, Observed([], nodes, None, now=1000.0))
    _merge(body, d)
    pods = [o for o in d.create if o["kind"] == "Pod"]
    for p in pods:
        p["status"] = {"phase": "Pending", "containerStatuses": [{"name": "trainer", "state": {
            "waiting": {"reason": "CreateContainerConfigError",
                        "message": 'secret "s3-creds" not found'}}}]}
    out = reconcile(body, Observed(pods, nodes, d.plan, now=1001.0))
    _merge(body, out)
    assert body["status"]["phase"] == c.PHASE_FAILED and "repairs" not in body["status"]
    msg = get_condition(body["status"], c.COND_CHECKPOINT_STORAGE)["message"]
    assert msg.startswith("spec.checkpoint.secretRef: Secret 's3-creds'")
    assert {n for k, n in out.delete if k == "Pod"} == {p["metadata"]["name"] for p in pods}
