"""Operator latency on the real control plane (kwok nodes): apply → all pods created for a
64-pod job, and node failure → all replacement pods created. Medians of repeats.

    .venv/bin/python bench/operator_latency.py [--repeats 5] [--kubeconfig K]

Without ``--kubeconfig`` (or ``HETTRAIN_KUBECONFIG``) it starts a throwaway cluster with
``e2e/cluster/up`` and stops it at the end. Heterogeneous cluster: 36 H100 nodes (dc-a) and 36
MI300X nodes (dc-b), 8 GPUs each. Job: llama3-8b pinned to tp=8, pp=4, dp=16 = 512 GPUs, so the
gang is exactly 64 pods (one per node) and, after a node fails, the re-plan on the 71 survivors
is again 64 pods. ``failurePolicy.debounceSeconds: 0``, so the repair number is the
operator's reaction, not the debounce it is told to wait. Times are taken from a raw
pod watch in this process: the moment the last pod of the gang is ADDED.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "integration"), str(ROOT / "operator"), str(ROOT)]

from e2e.cluster import kwoknodes  # noqa: E402
from e2e.cluster.pytest_plugin import wait_for  # noqa: E402
from kubernetes import client as k8s  # noqa: E402
from opproc import CRD, OperatorProcess  # noqa: E402

from hettrain.api import constants as c  # noqa: E402
from hettrain.kube import apply as kube  # noqa: E402

TARGET_LAUNCH_S = 1.0
TARGET_REPAIR_S = 5.0
NODES_PER_POOL = 36
GPUS_PER_NODE = 8


def cluster_doc(prefix: str) -> dict[str, Any]:
    """36 H100 + 36 MI300X nodes in two datacenters."""
    return {"apiVersion": c.API_VERSION, "kind": "Cluster", "metadata": {"name": prefix},
            "datacenters": [{"name": "dc-a"}, {"name": "dc-b"}],
            "links": [{"between": ["dc-a", "dc-b"], "bandwidthGbps": 400, "latencyMs": 2}],
            "pools": [
                {"name": f"{prefix}-h100", "datacenter": "dc-a", "device": "H100-SXM",
                 "vendor": "nvidia", "nodes": NODES_PER_POOL, "gpusPerNode": GPUS_PER_NODE},
                {"name": f"{prefix}-mi300", "datacenter": "dc-b", "device": "MI300X",
                 "vendor": "amd", "nodes": NODES_PER_POOL, "gpusPerNode": GPUS_PER_NODE}]}


def job_doc(name: str, prefix: str) -> dict[str, Any]:
    """The 64-pod job."""
    par = {"tp": 8, "pp": 4, "dp": 16}
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name},
            "spec": {"model": {"preset": "llama3-8b"},
                     "training": {"globalBatch": 512, "steps": 100},
                     "placement": {"pools": [f"{prefix}-h100", f"{prefix}-mi300"]},
                     "parallelism": par, "checkpoint": {"uri": "/ckpt"},
                     "data": {"synthetic": True},
                     "failurePolicy": {"maxRepairs": 10, "minGPUs": 8, "debounceSeconds": 0}}}


class PodWatch:
    """Raw pod watch of one namespace in a thread: records when each pod is first ADDED."""

    def __init__(self, api: k8s.ApiClient, ns: str) -> None:
        self.api, self.ns = api, ns
        self.added: dict[str, tuple[float, str]] = {}  # name -> (time, attempt label)
        self.cond = threading.Condition()
        self.stop = False
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        if not self.ready.wait(10):
            raise TimeoutError("pod watch did not start")

    def _run(self) -> None:
        path = f"/api/v1/namespaces/{self.ns}/pods"
        query = [("watch", "true"), ("labelSelector", c.LABEL_JOB),
                 ("allowWatchBookmarks", "false"), ("timeoutSeconds", "600")]
        headers = {"Accept": "application/json"}
        if hasattr(self.api, "param_serialize"):  # kubernetes client 37+
            params = self.api.param_serialize(
                method="GET", resource_path=path, query_params=query,
                header_params=headers, auth_settings=["BearerToken"])
            stream = self.api.call_api(*params, _request_timeout=(10, 620)).response
        else:  # kubernetes client 36: the older call_api returns the urllib3 response
            stream = self.api.call_api(
                path, "GET", query_params=query, header_params=headers,
                auth_settings=["BearerToken"], _preload_content=False,
                _return_http_data_only=True, _request_timeout=(10, 620))
        self.ready.set()
        buf = b""
        for chunk in stream.stream(65536, decode_content=True):
            now = time.perf_counter()
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                ev = json.loads(line)
                if ev.get("type") != "ADDED":
                    continue
                meta = ev["object"]["metadata"]
                with self.cond:
                    self.added.setdefault(meta["name"], (now, meta["labels"][c.LABEL_ATTEMPT]))
                    self.cond.notify_all()
            if self.stop:
                break

    def wait_attempt(self, attempt: int, count: int, timeout: float) -> float:
        """Time the ``count``-th pod of ``attempt`` was ADDED."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                times = sorted(t for t, a in self.added.values() if a == str(attempt))
                if len(times) >= count:
                    return times[count - 1]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(times)}/{count} pods of attempt {attempt} after "
                                       f"{timeout:.0f}s")
                self.cond.wait(min(left, 0.5))


class Bench:
    """The cluster, the operator and helpers."""

    def __init__(self, kubeconfig: Path, log: Path) -> None:
        self.api = kwoknodes.api_client(kubeconfig)
        self.core = k8s.CoreV1Api(self.api)
        self.custom = k8s.CustomObjectsApi(self.api)
        self.op = OperatorProcess(kubeconfig, log)

    def status(self, ns: str, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(
            c.GROUP, c.VERSION, ns, c.PLURAL, name).get("status") or {}

    def wait(self, pred: Any, timeout: float, what: str) -> Any:
        try:
            return wait_for(pred, timeout, 0.1, what)
        except TimeoutError as err:
            raise TimeoutError(f"{err}\n{self.op.tail()}") from err

    def namespace(self) -> str:
        name = f"bench-{uuid.uuid4().hex[:6]}"
        self.core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=name)))
        self.wait(lambda: self._has_sa(name), 30, "default ServiceAccount")
        return name

    def _has_sa(self, ns: str) -> bool:
        return bool(self.core.list_namespaced_service_account(ns).items)

    def drop(self, ns: str) -> None:
        self.custom.delete_collection_namespaced_custom_object(c.GROUP, c.VERSION, ns, c.PLURAL)
        self.wait(lambda: not self.custom.list_namespaced_custom_object(
            c.GROUP, c.VERSION, ns, c.PLURAL)["items"], 60, "job deleted")
        self.clear(ns)

    def clear(self, ns: str) -> None:
        """Delete the namespace once its pods are gone: the next measurement starts on free
        nodes (the operator never plans onto nodes that other jobs' pods still hold)."""
        self.core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        self.wait(lambda: not self.core.list_namespaced_pod(ns).items, 60, "pods gone")
        self.core.delete_namespace(ns, propagation_policy="Background")

    def launch_once(self, prefix: str) -> tuple[float, float]:
        """(apply → 64 pods created, apply → phase Running) in seconds."""
        ns = self.namespace()
        watch = PodWatch(self.api, ns)
        try:
            t0 = time.perf_counter()
            self.custom.create_namespaced_custom_object(c.GROUP, c.VERSION, ns, c.PLURAL,
                                                        job_doc("llm", prefix))
            created = watch.wait_attempt(1, 64, 60) - t0
            self.wait(lambda: self.status(ns, "llm").get("phase") == c.PHASE_RUNNING, 60,
                      "Running")
            running = time.perf_counter() - t0
            return created, running
        finally:
            watch.stop = True
            self.drop(ns)

    def raw_once(self, template: list[dict[str, Any]]) -> float:
        """The API floor: the same 64 pod POSTs from a bare client here (no operator, no
        planning), 16 in parallel like the operator; seconds until the watch saw all 64."""
        ns = self.namespace()
        watch = PodWatch(self.api, ns)
        pods = json.loads(json.dumps(template))
        for pod in pods:
            pod["metadata"]["namespace"] = ns
            pod["metadata"].pop("ownerReferences", None)
            pod["metadata"]["labels"][c.LABEL_JOB] = "raw"  # no such job: the operator ignores
        try:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(16) as ex:
                list(ex.map(lambda p: kube.create(self.api, ns, p), pods))
            return watch.wait_attempt(1, len(pods), 60) - t0
        finally:
            watch.stop = True
            self.clear(ns)

    def pod_template(self, prefix: str) -> list[dict[str, Any]]:
        """The pods the operator made for the job (read back from a launch)."""
        ns = self.namespace()
        try:
            self.custom.create_namespaced_custom_object(c.GROUP, c.VERSION, ns, c.PLURAL,
                                                        job_doc("llm", prefix))
            self.wait(lambda: self.status(ns, "llm").get("phase") == c.PHASE_RUNNING, 60,
                      "Running")
            _, body = kube.request(self.api, "GET", f"/api/v1/namespaces/{ns}/pods")
            out = []
            for pod in body["items"]:
                meta = pod["metadata"]
                out.append({"apiVersion": "v1", "kind": "Pod",
                            "metadata": {"name": meta["name"], "labels": meta["labels"]},
                            "spec": {k: v for k, v in pod["spec"].items() if k != "nodeName"}})
            return out
        finally:
            self.drop(ns)

    def repair_once(self, prefix: str) -> tuple[float, int, int]:
        """(node failure → all replacement pods created, pods before, pods after)."""
        ns = self.namespace()
        watch = PodWatch(self.api, ns)
        lost = None
        try:
            self.custom.create_namespaced_custom_object(c.GROUP, c.VERSION, ns, c.PLURAL,
                                                        job_doc("llm", prefix))
            st = self.wait(lambda: (s := self.status(ns, "llm")).get("phase") == c.PHASE_RUNNING
                           and s, 60, "Running")
            before = len(st["plan"]["nodes"])
            lost = sorted(st["plan"]["nodes"])[len(st["plan"]["nodes"]) // 2]
            t0 = time.perf_counter()
            kwoknodes.mark_not_ready(self.api, lost)
            st2 = self.wait(lambda: (s := self.status(ns, "llm")).get("attempt") == 2 and s,
                            30, "attempt 2")
            after = len(st2["plan"]["nodes"])
            done = watch.wait_attempt(2, after, 30) - t0
            return done, before, after
        finally:
            watch.stop = True
            if lost:
                kwoknodes.mark_ready(self.api, lost)
            self.drop(ns)
            if lost:
                kwoknodes.wait_nodes(self.api, [lost], timeout=60)
                self.wait(lambda: not kwoknodes.node_taints(self.api, lost), 60, "healed")


def _up() -> tuple[Path, Path]:
    state = Path(tempfile.mkdtemp(prefix="hettrain-bench-")) / "cluster"
    env = {**os.environ, "HETTRAIN_CLUSTER_DIR": str(state)}
    out = subprocess.run([str(ROOT / "e2e/cluster/up")], env=env, check=True,
                         capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1]), state


def main(argv: list[str] | None = None) -> int:
    """Run both scenarios and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kubeconfig", default=os.environ.get("HETTRAIN_KUBECONFIG"))
    args = ap.parse_args(argv)
    state = None
    if args.kubeconfig:
        kubeconfig = Path(args.kubeconfig)
    else:
        kubeconfig, state = _up()
    tmp = Path(tempfile.mkdtemp(prefix="hettrain-bench-op-"))
    bench = Bench(kubeconfig, tmp / "operator.log")
    prefix = f"b{uuid.uuid4().hex[:4]}"
    names: list[str] = []
    try:
        kubectl = [str(Path.home() / ".cache/hettrain/tools-2.2.2/bin/kubectl"),
                   "--kubeconfig", str(kubeconfig)]
        subprocess.run([*kubectl, "apply", "--server-side", "-f", str(CRD)], check=True,
                       capture_output=True)
        subprocess.run([*kubectl, "wait", "--for=condition=Established", "--timeout=30s",
                        "crd/hettrainingjobs.hettrain.dev"], check=True, capture_output=True)
        names = kwoknodes.create_nodes(bench.api, cluster_doc(prefix))
        kwoknodes.wait_nodes(bench.api, names, timeout=120)
        bench.wait(lambda: all(not kwoknodes.node_taints(bench.api, n) for n in names), 60,
                   "nodes untainted")
        bench.op.start()
        template = bench.pod_template(prefix)  # also the warm-up launch, not counted
        launches, raws = [], []
        for _ in range(args.repeats):  # interleaved, so both see the same machine load
            launches.append(bench.launch_once(prefix))
            raws.append(bench.raw_once(template))
        repairs = [bench.repair_once(prefix) for _ in range(args.repeats)]
    finally:
        bench.op.stop()
        if names:
            kwoknodes.delete_nodes(bench.api, names)
        if state is not None:
            subprocess.run([str(ROOT / "e2e/cluster/down")],
                           env={**os.environ, "HETTRAIN_CLUSTER_DIR": str(state)},
                           check=False, capture_output=True)
            shutil.rmtree(state.parent, ignore_errors=True)
    created = statistics.median(x[0] for x in launches)
    running = statistics.median(x[1] for x in launches)
    repaired = statistics.median(x[0] for x in repairs)
    raw = statistics.median(raws)
    print(f"operator latency, {len(names)} kwok nodes ({NODES_PER_POOL} H100 + {NODES_PER_POOL} "
          f"MI300X, {GPUS_PER_NODE} GPUs each), median of {args.repeats} (+1 warm-up launch)")
    print(f"{'scenario':<44} {'median s':>9} {'min s':>7} {'max s':>7} {'target':>8}  ok")
    rows = [
        ("apply -> all 64 pods created", created, [x[0] for x in launches], TARGET_LAUNCH_S),
        ("API floor: same 64 pod POSTs, bare client", raw, raws, None),
        ("apply -> phase Running (kwok-run pods)", running, [x[1] for x in launches], None),
        (f"node NotReady -> all {repairs[0][2]} replacement pods created", repaired,
         [x[0] for x in repairs], TARGET_REPAIR_S),
    ]
    for label, med, xs, target in rows:
        tgt = f"<= {target:.0f} s" if target else "-"
        ok = "-" if target is None else ("yes" if med <= target else "NO")
        print(f"{label:<44} {med:>9.3f} {min(xs):>7.3f} {max(xs):>7.3f} {tgt:>8}  {ok}")
    print(f"launch / API floor = {created / raw:.2f}x; load average during the run: "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"repair: {repairs[0][1]} pods -> {repairs[0][2]} pods (debounceSeconds 0); "
          f"operator log: {bench.op.log_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
