"""The closed calibration loop live: the operator process on the real local control plane
scrapes the real runtime's stage gauges, records them, stores refined profiles, re-plans.

Two kwok pools (one node, one GPU each) carry a loopback ``spec.podCIDR``
(``127.X.Y.0/24``), so kwok gives their pods loopback IPs (``PodIPsWith`` allocates from the
node's podCIDR). Each planned rank runs as a local CPU process (gloo, like the demo) that
binds its metrics endpoint on its pod's IP and port 9400 (``HETTRAIN_METRICS_ADDR``) — the
address and port a real pod would serve on — so the operator's scraper reads
``podIP:9400/metrics`` exactly as in a cluster: nothing in the operator is redirected.

The namespace's ``hettrain-profiles`` ConfigMap holds a deliberately wrong profile for pool
``a``'s device (3x too fast) next to an honest one measured here for pool ``b``'s. The
operator plans the faster-looking stage with most layers; it then scrapes, posts
``Calibrated`` with predicted vs measured, writes the refined profiles into the store,
waits for the next checkpoint, posts ``CalibrationReplan`` and launches attempt 2 on a
rebalanced split, which the test runs from the checkpoint (the operator's view of it is
measured again and kept: ``maxReplans`` 1).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import random
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from e2e.cluster import kwoknodes
from e2e.cluster.pytest_plugin import K8sCluster, wait_for
from kubernetes import client as k8s
from opproc import CRD, OperatorProcess, http_get
from prometheus_client.parser import text_string_to_metric_families

from hettrain.api import constants as c
from hettrain.api.spec import parse_job_spec
from hettrain.manifests.builders import RUNTIME_METRICS_PORT
from hettrain.manifests.profiles import PROFILE_STORE, build_profile_store
from hettrain.planning.calibration import profile_to_doc, store_key
from hettrain.planning.plan import Plan
from hettrain.planning.profiles import model_shape, profile_from_doc
from hettrain.runtime.launch import launch_local, wait_all
from hettrain.runtime.metrics import ENV_METRICS_ADDR
from hettrain.runtime.profile import profile

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

DEV = {"vendor": "nvidia", "bf16Tflops": 0.5, "hbmGiB": 16, "hbmTBps": 0.05,
       "intraNodeGBps": 5, "backend": "gloo"}
JOB = "cal"
WAIT_S = 150.0  # each wait; the whole test stays within about 6 minutes


def _spec(ckpt: Path) -> dict[str, Any]:
    return {"model": {"layers": 8, "hidden": 64, "heads": 4, "seqLen": 64, "vocab": 256},
            "data": {"synthetic": True},
            "training": {"globalBatch": 8, "microBatch": 2, "steps": 5000, "recompute": "none",
                         "precision": "fp32", "learningRate": 0.001, "lrSchedule": "constant"},
            "parallelism": {"pp": 2, "dp": 1},
            "checkpoint": {"uri": str(ckpt), "intervalSteps": 5},
            # 8 layers on 2 stages move in ~12% steps; shared cores blur the measurement, so
            # the stage medians are taken over 16 steps (over 4, the operator unit test's
            # refined profiles of the two identical cores differed by up to 1.75x)
            "calibration": {"enabled": True, "minSteps": 16, "maxReplans": 1,
                            "replanThreshold": 0.05}}


class Live:
    """API access, the operator (for its log) and bounded waits that show the state."""

    def __init__(self, cluster: K8sCluster, ns: str, op: OperatorProcess) -> None:
        self.ns, self.op = ns, op
        self.core = k8s.CoreV1Api(cluster.api)
        self.custom = k8s.CustomObjectsApi(cluster.api)

    def status(self) -> dict[str, Any]:
        job = self.custom.get_namespaced_custom_object(c.GROUP, c.VERSION, self.ns, c.PLURAL,
                                                       JOB)
        return job.get("status") or {}

    def wait(self, predicate: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
        try:
            return wait_for(predicate, timeout, 0.25, what)
        except TimeoutError as err:
            pytest.fail(f"{err}\nstatus: {self.status()}\nevents: {self.events()}\n"
                        f"--- operator log ---\n{self.op.tail(60)}", pytrace=False)

    def events(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for e in self.core.list_namespaced_event(
                self.ns, field_selector=f"involvedObject.name={JOB},"
                                        f"involvedObject.kind={c.KIND}").items:
            out.setdefault(e.reason, []).append(e.message)
        return out

    def plan(self) -> Plan:
        cm = self.status()["plan"]["configMap"]
        return Plan.from_json(self.core.read_namespaced_config_map(cm, self.ns)
                              .data[c.PLAN_CONFIGMAP_KEY])

    def pod_ips(self, attempt: int) -> dict[str, str] | None:
        """{node: pod IP} of the attempt's running pods, once every one has its IP."""
        pods = [p for p in self.core.list_namespaced_pod(
                    self.ns, label_selector=f"{c.LABEL_JOB}={JOB},"
                                            f"{c.LABEL_ATTEMPT}={attempt}").items
                if p.metadata.deletion_timestamp is None]
        if not pods or any(p.status.phase != "Running" or not p.status.pod_ip for p in pods):
            return None
        return {p.spec.node_name: p.status.pod_ip for p in pods}

    def store(self) -> dict[str, str]:
        return dict(self.core.read_namespaced_config_map(PROFILE_STORE, self.ns).data or {})

    def calibration(self, attempt: int, ranks: Ranks) -> dict[str, Any]:
        """``status.calibration`` once it compares ``attempt``'s stages (its ranks kept alive)."""
        def compared() -> dict[str, Any] | None:
            ranks.alive()
            cal = self.status().get("calibration") or {}
            return cal if cal.get("attempt") == attempt and cal.get("stages") else None

        return self.wait(compared, f"status.calibration of attempt {attempt}")


def _job_series(text: str, ns: str) -> dict[tuple[str, str], float]:
    """{(sample name, stage label): value} of the job's samples in the operator's metrics."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("namespace") == ns and s.labels.get("job") == JOB:
                out[(s.name, s.labels.get("stage", ""))] = s.value
    return out


def _split(plan: Plan) -> dict[str, int]:
    return {s.device: s.layer_end - s.layer_start for s in plan.stages}


class Ranks:
    """One attempt's ranks as local processes, each serving metrics on its pod's IP:9400."""

    def __init__(self, plan: Plan, ips: dict[str, str], workdir: Path, ckpt: Path,
                 resume: bool) -> None:
        assert plan.world_size == len(ips) == plan.pp  # one rank per pod: port 9400 each
        self.loss_log = workdir / "losses.jsonl"
        self.procs = launch_local(
            plan, workdir,
            {"HETTRAIN_CHECKPOINT_URI": str(ckpt), "HETTRAIN_CHECKPOINT_INTERVAL": "5",
             "HETTRAIN_RESUME": "1" if resume else "0", "HETTRAIN_LOSS_LOG": str(self.loss_log),
             "HETTRAIN_DEVICE": "cpu", "HETTRAIN_OPTIMIZER": "sgd",
             "HETTRAIN_CHECKPOINT_ASYNC": "0"},
            rank_env=lambda r: {ENV_METRICS_ADDR: ips[plan.ranks[r].node],
                                "HETTRAIN_METRICS_PORT": str(RUNTIME_METRICS_PORT)})
        self.workdir = workdir

    def alive(self) -> None:
        for r, p in enumerate(self.procs):
            if p.poll() is not None:
                tail = (self.workdir / f"rank-{r}.log").read_text()[-1500:]
                pytest.fail(f"rank {r} exited with {p.returncode}:\n{tail}", pytrace=False)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        wait_all(self.procs, timeout=30)


def _loopback_nodes(cluster_doc: dict[str, Any], octet: int) -> list[dict[str, Any]]:
    """The kwok nodes of the cluster, node i with podCIDR 127.<octet>.<i+1>.0/24."""
    nodes = kwoknodes.node_manifests(kwoknodes.load_cluster(cluster_doc))
    for i, n in enumerate(nodes):
        n["spec"]["podCIDR"] = f"127.{octet}.{i + 1}.0/24"
    return nodes


@pytest.fixture
def live(k8s_cluster: K8sCluster, namespace: str, tmp_path: Path) -> Iterator[tuple[Live, str]]:
    """CRD, two loopback-podCIDR kwok pools, the operator with their cluster YAML."""
    k8s_cluster.kubectl("apply", "--server-side", "-f", str(CRD))
    k8s_cluster.kubectl("wait", "--for=condition=Established", "--timeout=30s",
                        "crd/hettrainingjobs.hettrain.dev")
    tag = uuid.uuid4().hex[:5]
    cluster_doc = {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
                   "metadata": {"name": f"cal-{tag}"}, "datacenters": [{"name": "a"}],
                   "devices": [{"name": "CPU-A", **DEV}, {"name": "CPU-B", **DEV}],
                   "pools": [{"name": f"cal{tag}a", "datacenter": "a", "device": "CPU-A",
                              "nodes": 1, "gpusPerNode": 1, "nicGbps": 10},
                             {"name": f"cal{tag}b", "datacenter": "a", "device": "CPU-B",
                              "nodes": 1, "gpusPerNode": 1, "nicGbps": 10}]}
    cluster_yaml = tmp_path / "cluster.yaml"
    cluster_yaml.write_text(yaml.safe_dump(cluster_doc))
    core = k8s.CoreV1Api(k8s_cluster.api)
    nodes = _loopback_nodes(cluster_doc, random.randint(100, 250))
    names = [n["metadata"]["name"] for n in nodes]
    op = OperatorProcess(k8s_cluster.kubeconfig, tmp_path / "operator.log",
                         env={"HETTRAIN_CLUSTER_CONFIG": str(cluster_yaml),
                              "HETTRAIN_RESYNC_SECONDS": "2"})
    try:
        for n in nodes:
            core.create_node(n)
        kwoknodes.wait_nodes(k8s_cluster.api, names, timeout=120)
        wait_for(lambda: all(not core.read_node(n).spec.taints for n in names), 120, 0.5,
                 "nodes untainted")
        op.start()
        yield Live(k8s_cluster, namespace, op), tag
    finally:
        op.stop()
        kwoknodes.delete_nodes(k8s_cluster.api, names)


def test_live_operator_calibrates_and_replans(live: tuple[Live, str], tmp_path: Path) -> None:
    lv, _ = live
    torch.set_num_threads(1)
    ckpt = tmp_path / "ckpt"
    spec = _spec(ckpt)
    job = parse_job_spec(spec)
    shape = model_shape(job.model)
    honest_doc = profile(job.model, "CPU-B", [1, 2, 4], 5, torch.device("cpu"))
    honest = profile_from_doc(honest_doc, "honest")
    wrong = dataclasses.replace(honest, device="CPU-A", alpha=honest.alpha / 3,
                                beta=honest.beta / 3)
    key_a, key_b = (store_key(d, shape, job.image, job.training.precision)
                    for d in ("CPU-A", "CPU-B"))
    wrong_text = yaml.safe_dump(profile_to_doc(wrong, job.model, {"image": job.image}))
    lv.core.create_namespaced_config_map(lv.ns, build_profile_store(lv.ns, {
        key_a: wrong_text, key_b: yaml.safe_dump(honest_doc)}))
    lv.custom.create_namespaced_custom_object(c.GROUP, c.VERSION, lv.ns, c.PLURAL, {
        "apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": JOB}, "spec": spec})

    # attempt 1: planned with the wrong profile, so pool a's stage gets most layers
    lv.wait(lambda: lv.status().get("phase") == c.PHASE_RUNNING, "attempt 1 Running")
    first = lv.plan()
    assert lv.status()["attempt"] == 1
    assert _split(first)["CPU-A"] > _split(first)["CPU-B"], _split(first)
    ips = lv.wait(lambda: lv.pod_ips(1), "attempt 1 pod IPs")
    assert all(ipaddress.ip_address(ip).is_loopback for ip in ips.values()), ips
    assert set(ips) == set(first.nodes())
    run1 = Ranks(first, ips, tmp_path / "a1", ckpt, resume=False)
    try:
        # the operator scrapes podIP:9400 and compares (status.calibration, Calibrated Event)
        cal = lv.calibration(1, run1)
        ratios = {r["device"]: r["ratio"] for r in cal["stages"]}
        assert {r["device"] for r in cal["stages"]} == {"CPU-A", "CPU-B"}
        assert all(r["measuredMs"] > 0 and r["predictedMs"] > 0 for r in cal["stages"]), cal
        assert ratios["CPU-A"] > 1.3 * ratios["CPU-B"], cal  # a is slower than claimed
        assert cal["pendingReplan"] is True or lv.status()["attempt"] == 2, cal
        assert cal["bestStepSeconds"] < 0.95 * cal["currentStepSeconds"], cal
        events = lv.wait(lambda: lv.events().get(c.REASON_CALIBRATED) and lv.events(),
                         "Calibrated Event")
        assert "re-planning at the next checkpoint" in events[c.REASON_CALIBRATED][0], events
        # the refined profiles are in the store: a's is no longer 3x too fast
        store = lv.store()
        assert set(cal["profiles"]) == {key_a, key_b} <= set(store)
        refined_a = profile_from_doc(yaml.safe_load(store[key_a]), key_a)
        refined_b = profile_from_doc(yaml.safe_load(store[key_b]), key_b)
        # both devices are this machine's cores, measured side by side (so under the same
        # load, unlike ``honest``, measured earlier): the refined profiles close most of the
        # wrong profile's 3x gap between them (how much depends on how evenly the machine's
        # load fell on the two ranks; tests/operator/test_calibration_loop.py checks them
        # against the measured per-layer times exactly)
        assert wrong.beta / honest.beta < 0.34
        assert refined_a.beta / refined_b.beta > 1.5 * (wrong.beta / honest.beta), (
            refined_a, refined_b)
        # the operator's metrics carry predicted vs measured per stage
        series = _job_series(http_get(lv.op.metrics_url)[1], lv.ns)
        for name in ("hettrain_job_stage_predicted_seconds",
                     "hettrain_job_stage_measured_seconds"):
            got = {k[1]: v for k, v in series.items() if k[0] == name}
            assert set(got) == {"0", "1"} and all(v > 0 for v in got.values()), series

        # after the next checkpoint: CalibrationReplan and attempt 2 on a new split
        def replanned() -> bool:
            run1.alive()
            return int(lv.status().get("attempt") or 0) == 2
        lv.wait(replanned, "CalibrationReplan (attempt 2)")
    finally:
        run1.stop()
    events = lv.events()
    assert c.REASON_CALIBRATION_REPLAN in events, events
    msg = events[c.REASON_CALIBRATION_REPLAN][0]
    ckpt_step = int(msg.split("checkpoint at step ")[1].split(":")[0])
    assert ckpt_step > 0, msg
    assert lv.status()["calibration"]["replans"] == 1
    assert _job_series(http_get(lv.op.metrics_url)[1], lv.ns)[
        ("hettrain_calibration_replans_total", "")] == 1.0

    lv.wait(lambda: lv.status().get("phase") == c.PHASE_RUNNING, "attempt 2 Running")
    second = lv.plan()
    assert _split(second)["CPU-A"] < _split(first)["CPU-A"], (_split(first), _split(second))
    ips2 = lv.wait(lambda: lv.pod_ips(2), "attempt 2 pod IPs")
    run2 = Ranks(second, ips2, tmp_path / "a2", ckpt, resume=True)
    try:
        cal2 = lv.calibration(2, run2)
        assert cal2["replans"] == 1 and cal2["pendingReplan"] is False, cal2
        assert int(lv.status()["attempt"]) == 2  # maxReplans 1: the plan is kept
        second_verdict = lv.wait(lambda: len(lv.events().get(c.REASON_CALIBRATED, [])) >= 2
                                 and lv.events()[c.REASON_CALIBRATED], "second Calibrated")
        assert any("maxReplans (1) reached" in m or "the current plan is kept" in m
                   for m in second_verdict), second_verdict
        # a stage's metrics are published before rank 0 appends the step to its loss log
        text = lv.wait(lambda: run2.loss_log.exists()
                       and run2.loss_log.read_text().rpartition("\n")[0],
                       "attempt 2 loss log (a whole line)")
        records = [yaml.safe_load(line) for line in text.splitlines()]
        assert records[0]["step"] >= ckpt_step  # resumed from the checkpoint, not restarted
    finally:
        run2.stop()
