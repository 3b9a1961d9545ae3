"""The operator's holdings from its indices (hettrain.handlers.job): only pods owned by a live
job (uid) hold nodes, recorded plans of launching/running jobs hold theirs, and GPUs of
everything else are foreign."""

from __future__ import annotations

import copy
from typing import Any

from optest_helpers import hetero_nodes, job_body

from hettrain.api import constants as c
from hettrain.handlers import job as handlers
from hettrain.reconcile import Observed, reconcile


def _launched(name: str, uid: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    body = job_body()
    body["metadata"].update(name=name, uid=uid)
    d = reconcile(body, Observed([], hetero_nodes(2, 2), None, now=1.0))
    pods = [copy.deepcopy(o) for o in d.create if o["kind"] == "Pod"]
    for p in pods:
        p["spec"]["nodeName"] = p["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
            "matchExpressions"][0]["values"][0]
        p["status"] = {"phase": "Running"}
    return {**body, "status": d.status}, pods


def test_only_pods_owned_by_a_live_job_hold_nodes() -> None:
    _, pods = _launched("a", "uid-a")
    jobs = {("ns", "a"): [{"uid": "uid-a", "phase": c.PHASE_RUNNING, "nodes": []}]}
    held = handlers._held_by_others("ns", "other", {("ns", "a"): pods}, jobs)
    assert set(held) == {p["spec"]["nodeName"] for p in pods}
    # the same pods claiming a job that is gone, or a uid that is not the live job's: nothing
    assert handlers._held_by_others("ns", "other", {("ns", "a"): pods}, {}) == {}
    forged = {("ns", "a"): [{"uid": "uid-new", "phase": c.PHASE_RUNNING, "nodes": []}]}
    assert handlers._held_by_others("ns", "other", {("ns", "a"): pods}, forged) == {}


def test_a_launching_jobs_recorded_plan_holds_its_nodes_without_pods() -> None:
    a, _ = _launched("a", "uid-a")
    nodes = a["status"]["plan"]["nodes"]
    for phase, holds in ((c.PHASE_LAUNCHING, True), (c.PHASE_RUNNING, True),
                         (c.PHASE_PENDING, False), (c.PHASE_SUSPENDED, False)):
        jobs = {("ns", "a"): [{"uid": "uid-a", "phase": phase, "nodes": nodes}]}
        held = handlers._held_by_others("ns", "other", {}, jobs)
        assert (set(held) == set(nodes)) is holds and (held == {}) is not holds
        assert handlers._held_by_others("ns", "a", {}, jobs) == {}  # never against itself


def test_gpus_of_pods_not_owned_by_a_live_job_are_foreign() -> None:
    _, pods = _launched("a", "uid-a")
    node = pods[0]["spec"]["nodeName"]
    index = {node: [
        {"pod": "ns/a-pod", "gpus": {"nvidia.com/gpu": 8}, "owner": ("ns", "a", "uid-a")},
        {"pod": "x/hog", "gpus": {"nvidia.com/gpu": 2}, "owner": None},
        {"pod": "ns/old", "gpus": {"nvidia.com/gpu": 1}, "owner": ("ns", "a", "uid-old")}]}
    foreign = handlers._foreign_gpus(index, {("ns", "a"): "uid-a"})
    assert foreign == {node: {"nvidia.com/gpu": 3}}
