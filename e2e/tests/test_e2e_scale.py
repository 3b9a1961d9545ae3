"""Scale: 1000 kwok GPU nodes (four vendors, three datacenters), 20 concurrent jobs, all planned
and placed, no node double-booked: the first 10 pinned to two pools each, the other 10 free to
use any pool, so they compete for the same best nodes (the operator plans every job around the
nodes the other jobs hold); then 3 more free jobs arrive while the 20 run.

Run: ``.venv/bin/pytest e2e/tests -m "e2e and slow" -x -q -s`` (prints the times).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e.cluster import kwoknodes
from e2e.cluster.pytest_plugin import K8sCluster, wait_for
from e2e.support import wait_schedulable
from kubernetes import client as k8s

from hettrain.api import constants as c

pytestmark = [pytest.mark.e2e, pytest.mark.k8s, pytest.mark.slow]
TOPOLOGY = Path(__file__).resolve().parents[1] / "clusters" / "scale-1k.yaml"
JOBS = 20


def _job(name: str, pools: list[str] | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"preset": "gpt3-1.3b"}, "training": {"globalBatch": 64, "steps": 100},
        "parallelism": {"dp": 4, "pp": 2, "tp": 8}, "checkpoint": {"uri": "/ckpt"},
        "data": {"synthetic": True},
        "failurePolicy": {"maxRepairs": 3, "minGPUs": 8}}
    if pools:
        spec["placement"] = {"pools": pools}
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name},
            "spec": spec}


def _jobs(api: k8s.ApiClient, ns: str) -> list[dict[str, Any]]:
    return k8s.CustomObjectsApi(api).list_namespaced_custom_object(
        c.GROUP, c.VERSION, ns, c.PLURAL)["items"]


def _true(job: dict[str, Any], ctype: str) -> bool:
    return any(x["type"] == ctype and x["status"] == "True"
               for x in (job.get("status") or {}).get("conditions") or ())


def _gpu_requests(pod: Any) -> int:
    total = 0
    for ctr in pod.spec.containers:
        for key, val in ((ctr.resources and ctr.resources.requests) or {}).items():
            if key in c.VENDOR_RESOURCES.values():
                total += int(val)
    return total


def _overbooked(pods: list[Any], capacity: dict[str, int]) -> dict[str, int]:
    used: dict[str, int] = defaultdict(int)
    for p in pods:
        if p.spec.node_name:
            used[p.spec.node_name] += _gpu_requests(p)
    return {n: u for n, u in used.items() if u > capacity.get(n, 0)}


def test_1000_nodes_20_jobs_planned_and_placed(k8s_cluster: K8sCluster, chart_operator,
                                               namespace: str, kwok_nodes) -> None:
    api, ns = k8s_cluster.api, namespace
    core = k8s.CoreV1Api(api)
    times: dict[str, float] = {}
    t0 = time.monotonic()
    names = kwok_nodes(TOPOLOGY, timeout=300)
    assert len(names) == 1000
    wait_schedulable(api, names, timeout=300)
    times["1000 nodes Ready + untainted"] = time.monotonic() - t0
    capacity = {n.metadata.name: sum(int(v) for k, v in n.status.allocatable.items()
                                     if k in c.VENDOR_RESOURCES.values())
                for n in core.list_node(label_selector="type=kwok").items}

    pools = [p.name for p in kwoknodes.load_cluster(TOPOLOGY)]
    pinned = JOBS // 2
    docs = [_job(f"job-{j:02d}", pools[2 * j:2 * j + 2] if j < pinned else None)
            for j in range(JOBS)]
    t1 = time.monotonic()
    k8s_cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(docs))

    def all_with(ctype: str) -> list[dict[str, Any]] | None:
        jobs = _jobs(api, ns)
        failed = [j["metadata"]["name"] for j in jobs
                  if (j.get("status") or {}).get("phase") == c.PHASE_FAILED]
        assert not failed, f"jobs Failed: {failed}"
        return jobs if len(jobs) == JOBS and all(_true(j, ctype) for j in jobs) else None

    wait_for(lambda: all_with(c.COND_PLANNED), 300, interval=0.5, what="20 jobs Planned")
    times["20 jobs Planned (from apply)"] = time.monotonic() - t1
    jobs = wait_for(lambda: all_with(c.COND_PODS_READY), 300, interval=0.5,
                    what="20 jobs PodsReady")
    times["20 jobs placed: every pod Running (from apply)"] = time.monotonic() - t1

    pods = core.list_namespaced_pod(ns).items
    expected = sum(len(j["status"]["plan"]["nodes"]) for j in jobs)
    assert len(pods) == expected == JOBS * 8
    assert all(p.spec.node_name and p.status.phase == "Running" for p in pods)
    per_node = Counter(p.spec.node_name for p in pods)
    assert max(per_node.values()) == 1, "a node hosts two gang pods"
    assert _overbooked(pods, capacity) == {}
    for j, job in enumerate(sorted(jobs, key=lambda x: x["metadata"]["name"])):
        if j < pinned:
            assert set(job["status"]["plan"]["pools"]) <= set(pools[2 * j:2 * j + 2])
        assert job["status"]["worldSize"] == 64

    # Three more unpinned jobs while the 20 hold their nodes: planned around them, all placed.
    extra = [_job(f"free-{i}", None) for i in range(3)]
    t2 = time.monotonic()
    k8s_cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(extra))
    total = JOBS + len(extra)
    wait_for(lambda: len(_jobs(api, ns)) == total and all(_true(j, c.COND_PODS_READY)
                                                          for j in _jobs(api, ns)),
             300, interval=0.5, what="23 jobs PodsReady")
    times["3 more jobs placed around the 20 (from apply)"] = time.monotonic() - t2
    pods = core.list_namespaced_pod(ns).items
    assert len(pods) == total * 8
    assert all(p.spec.node_name and p.status.phase == "Running" for p in pods)
    assert max(Counter(p.spec.node_name for p in pods).values()) == 1, "node double-booked"
    assert all(_pinned_node(p) == p.spec.node_name for p in pods)
    assert _overbooked(pods, capacity) == {}
    times_rows = "\n".join(f"  {k:48s} {v:6.1f} s" for k, v in times.items())
    print(f"\nscale: 1000 nodes, {total} jobs x 8 pods x 8 GPUs "
          f"({pinned} pinned to pools, {total - pinned} free)\n{times_rows}")

    k8s_cluster.kubectl("delete", "htj", "--all", "-n", ns, "--wait=false")
    wait_for(lambda: not _jobs(api, ns), 120, what="jobs deleted")


def _pinned_node(pod: Any) -> str | None:
    try:
        terms = pod.spec.affinity.node_affinity \
            .required_during_scheduling_ignored_during_execution.node_selector_terms
        return terms[0].match_expressions[0].values[0]
    except (AttributeError, IndexError, TypeError):
        return pod.spec.node_name
