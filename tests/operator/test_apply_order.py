"""The order in which the operator applies a decision (hettrain.handlers.job._apply): a
status that names a new plan is written only after that plan's ConfigMap exists, so no crash
(operator SIGKILL, apiserver restart) can leave a recorded plan without its ConfigMap; and the
gang is created only for a job that still exists, and taken back when the job goes away while
it is created (a pass runs in a thread that deleting the job does not stop)."""

from __future__ import annotations

from typing import Any

import pytest
from optest_helpers import hetero_nodes, job_body

from hettrain.api import constants as c
from hettrain.handlers import job as handlers
from hettrain.reconcile import Observed, reconcile


class FakeKube:
    """Records the API calls of _apply; creating the ConfigMap can be made to fail."""

    def __init__(self, fail_configmap: bool, foreign: bool = False,
                 alive: tuple[bool, ...] = (True, True)) -> None:
        self.fail_configmap, self.foreign = fail_configmap, foreign
        self.alive = list(alive)  # what each job read answers, in turn
        self.calls: list[str] = []

    def get_job(self, _api: Any, _ns: str, name: str) -> dict[str, Any] | None:
        self.calls.append("get job")
        if not self.alive.pop(0):
            return None
        return {"metadata": {"name": name, "uid": "u-1"}}

    def delete_all(self, _api: Any, _ns: str, objs: list[tuple[str, str]],
                   owner_uid: str | None = None) -> None:
        assert owner_uid == "u-1"
        self.calls.append(f"delete {len(objs)} {objs[0][0] if objs else ''}".strip())

    def create(self, _api: Any, _ns: str, obj: dict[str, Any], replace: bool = False) -> bool:
        if obj["kind"] == "ConfigMap" and self.foreign:
            self.calls.append("ConfigMap foreign")
            raise handlers.kube.ForeignObjectError("taken", kind="ConfigMap")
        if obj["kind"] == "ConfigMap" and self.fail_configmap:
            self.calls.append("ConfigMap failed")
            raise ConnectionError("apiserver went away")
        self.calls.append(obj["kind"])
        return True

    def patch_status(self, _api: Any, _ns: str, _name: str, _status: dict[str, Any]) -> None:
        self.calls.append("status")

    def create_gang(self, _api: Any, _ns: str, pods: list[dict[str, Any]]) -> int:
        self.calls.append(f"{len(pods)} pods")
        return len(pods)


@pytest.mark.parametrize("fail_configmap", [False, True])
def test_the_status_naming_a_new_plan_is_written_after_its_configmap(
        monkeypatch: pytest.MonkeyPatch, fail_configmap: bool) -> None:
    fake = FakeKube(fail_configmap)
    for fn in ("create", "patch_status", "create_gang", "get_job", "delete_all"):
        monkeypatch.setattr(handlers.kube, fn, getattr(fake, fn))
    d = reconcile(job_body(), Observed([], hetero_nodes(), None, now=1.0))
    assert d.plan is not None and d.status["plan"]["configMap"]
    if fail_configmap:
        with pytest.raises(ConnectionError):
            handlers._apply("ns", "job1", d, None, "u-1")
        assert "status" not in fake.calls and not any("pods" in x for x in fake.calls)
    else:
        handlers._apply("ns", "job1", d, None, "u-1")
        assert fake.calls.index("status") > fake.calls.index("ConfigMap")
        assert fake.calls[-3:] == ["get job", f"{len(d.plan.nodes())} pods", "get job"]
    handlers._plans.pop(("ns", "job1"), None)
    handlers._expected.pop(("ns", "job1"), None)


def test_a_foreign_configmap_taking_the_plans_name_burns_the_attempt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The new attempt's ConfigMap name is taken by an object the job does not own: the
    attempt is recorded (so the next pass plans attempt+1 under a fresh name), no pod is
    created, and the error goes up (ForeignObject Warning)."""
    fake = FakeKube(False, foreign=True)
    for fn in ("create", "patch_status", "create_gang", "get_job", "delete_all"):
        monkeypatch.setattr(handlers.kube, fn, getattr(fake, fn))
    d = reconcile(job_body(), Observed([], hetero_nodes(), None, now=1.0))
    with pytest.raises(handlers.kube.ForeignObjectError):
        handlers._apply("ns", "job1", d, None, "u-1")
    assert fake.calls[-1] == "status" and not any("pods" in x for x in fake.calls)
    handlers._plans.pop(("ns", "job1"), None)


@pytest.mark.parametrize("alive", [(False,), (True, False)])
def test_a_job_deleted_during_the_pass_gets_no_gang(monkeypatch: pytest.MonkeyPatch,
                                                     alive: tuple[bool, ...]) -> None:
    """Deleted before the gang (the job read finds it gone): no pod is created; deleted while
    the gang is created: the pods just created are deleted again. Either way no pod of a
    gone job waits for the garbage collector holding its GPU (the chaos test's orphans)."""
    fake = FakeKube(False, alive=alive)
    for fn in ("create", "patch_status", "create_gang", "get_job", "delete_all"):
        monkeypatch.setattr(handlers.kube, fn, getattr(fake, fn))
    d = reconcile(job_body(), Observed([], hetero_nodes(), None, now=1.0))
    n = len(d.plan.nodes())
    handlers._apply("ns", "job1", d, None, "u-1")
    if len(alive) == 1:
        assert fake.calls[-1] == "get job" and not any("pods" in x for x in fake.calls)
    else:
        assert fake.calls[-3:] == [f"{n} pods", "get job", f"delete {n} Pod"]
    assert ("ns", "job1") not in handlers._expected
    handlers._plans.pop(("ns", "job1"), None)


def _pod(name: str, job: str, uid: str, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "labels": {c.LABEL_JOB: job},
                            "ownerReferences": [{"apiVersion": c.API_VERSION, "kind": c.KIND,
                                                 "name": job, "uid": uid,
                                                 "controller": True}]}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-05T00:00:00Z"
    return {"kind": "Pod", "metadata": meta, "status": {"phase": "Running"}}


def test_a_deleted_jobs_pods_under_the_same_name_are_taken_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """job1 was deleted and recreated (uid u-1 now): the old job's pods (uid u-0) the garbage
    collector has not removed yet hold their GPUs, so the new job's pass deletes them, each
    only while the old job still controls it (a uid-checked delete); its own pods and pods
    already deleting are left alone."""
    old = [_pod("job1-a3-r0", "job1", "u-0"), _pod("job1-a3-r8", "job1", "u-0"),
           _pod("job1-a2-r0", "job1", "u-0", deleting=True)]
    d = reconcile(job_body(), Observed(old, hetero_nodes(), None, now=1.0))
    assert d.leftovers == [("job1-a3-r0", "u-0"), ("job1-a3-r8", "u-0")]
    assert d.plan is not None  # the new job still launches: the old pods are not its own
    deleted: list[tuple[str, str, str | None]] = []
    fake = FakeKube(False)
    for fn in ("create", "patch_status", "create_gang", "get_job", "delete_all"):
        monkeypatch.setattr(handlers.kube, fn, getattr(fake, fn))
    monkeypatch.setattr(handlers.kube, "delete", lambda _api, _ns, kind, name, owner=None:
                        deleted.append((kind, name, owner)) or True)
    handlers._apply("ns", "job1", d, None, "u-1")
    assert sorted(deleted) == [("Pod", "job1-a3-r0", "u-0"), ("Pod", "job1-a3-r8", "u-0")]
    handlers._plans.pop(("ns", "job1"), None)
    handlers._expected.pop(("ns", "job1"), None)
