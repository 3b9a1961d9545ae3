"""The demo, step by step: control plane → nodes → operator → job → plan → train → failure →
repair → resumed training → metrics → teardown."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hettrain.api import constants as c
from hettrain.demo import cluster as kc
from hettrain.demo import storage, training
from hettrain.demo.children import Children, interrupts_as_keyboard_interrupt, no_interrupts
from hettrain.demo.progress import Progress
from hettrain.planning.plan import Plan

NAMESPACE = "hettrain-demo"
CLUSTER_YAML = "examples/demo/cluster.yaml"
JOB_YAML = "examples/demo/job.yaml"


@dataclass
class Demo:
    """State shared by the steps; ``summary`` is written to ``WORKDIR/summary.json``."""

    args: argparse.Namespace
    repo: Path
    workdir: Path
    progress: Progress
    children: Children
    cluster: kc.LocalCluster | None = None
    api: Any = None
    job_name: str = ""
    metrics_port: int = 0
    runs: list[training.Run] = field(default_factory=list)
    s3: storage.S3Server | None = None
    data_uri: str | None = None
    checkpoint_uri: str = ""
    keep: str = "?"
    summary: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ helpers
    def job(self) -> dict[str, Any]:
        return kc.get_job(self.api, self.args.namespace, self.job_name)

    def operator_alive(self) -> None:
        for name, proc in self.children.procs:
            if name == "operator" and proc.poll() is not None:
                raise kc.DemoError(f"the operator exited with {proc.returncode}; log: "
                                   f"{self.workdir / 'operator.log'}")

    def show_plan(self, plan: Plan, attempt: int) -> None:
        from hettrain.render.table import plan_view

        self.progress.raw(plan_view(plan))
        png = self.workdir / f"plan-attempt-{attempt}.png"
        try:
            from hettrain.render.figure import render_plan_figure

            render_plan_figure(plan, png)
            self.progress.info(f"picture: {png}")
        except ImportError as exc:
            self.progress.info(f"(no picture: {exc.name} is not installed; "
                               "pip install 'hettrain[viz]')")

    def show_loss(self, rec: dict[str, Any]) -> None:
        self.progress.info(f"step {rec['step'] + 1:3d}  loss {rec['loss']:.4f}  "
                           f"({rec['seconds'] * 1000:.0f} ms)")


def _sleep_poll(seconds: float) -> None:
    time.sleep(seconds)


# ---------------------------------------------------------------------- steps


def step_cluster(d: Demo) -> None:
    state = d.workdir / "cluster"
    d.progress.info(f"state dir {state} (binaries: ~/.cache/hettrain, built once by "
                    "e2e/cluster/build)")
    d.children.on_cleanup("control plane", lambda: _down(d, state))
    d.cluster = kc.LocalCluster.start(d.repo, state, d.workdir / "cluster-up.log")
    d.api = kc.api_client(d.cluster.kubeconfig)
    d.progress.info(f"KUBECONFIG={d.cluster.kubeconfig}")


def _down(d: Demo, state: Path) -> None:
    if d.args.keep:
        d.progress.info(f"--keep: cluster left running (the operator is stopped): "
                        f"export KUBECONFIG={state / 'kubeconfig'}; kubectl get htj -A; "
                        f"stop it with HETTRAIN_CLUSTER_DIR={state} e2e/cluster/down")
        return
    if d.api is not None:
        d.api.close()
    kc.LocalCluster(d.repo, state, state / "kubeconfig", None).stop()


def step_nodes(d: Demo) -> None:
    assert d.cluster is not None
    kc.kubectl(d.cluster.kubeconfig, d.cluster.tools_bin, "apply", "--server-side", "-f",
               str(d.repo / kc.CRD_FILE))
    kc.wait_for(lambda: _crd_established(d), 60, "the CRD Established", interval=0.5)
    d.progress.info("CRD hettrainingjobs.hettrain.dev established")
    kwoknodes = _kwoknodes(d.repo)
    names = kwoknodes.create_nodes(d.api, d.repo / d.args.cluster)
    kwoknodes.wait_nodes(d.api, names, timeout=180)
    # The planner skips tainted nodes: wait until the node lifecycle controller has lifted
    # the not-ready taint kwok's fresh nodes start with, or the first plan sees a part only.
    kc.wait_for(lambda: kc.untainted(d.api, names), 120, "nodes untainted", interval=0.5)
    out = kc.kubectl(d.cluster.kubeconfig, d.cluster.tools_bin, "get", "nodes", "-L",
                     "hettrain.dev/vendor,hettrain.dev/device,topology.kubernetes.io/region")
    d.progress.info(out.rstrip())


def _crd_established(d: Demo) -> bool:
    """``kubectl wait`` for the CRD; False while the apiserver has not written its status yet
    (kubectl then fails with an accessor error instead of waiting)."""
    assert d.cluster is not None
    try:
        kc.kubectl(d.cluster.kubeconfig, d.cluster.tools_bin, "wait", "--timeout=10s",
                   "--for=condition=Established", "crd/hettrainingjobs.hettrain.dev")
    except kc.DemoError as exc:
        if "accessor error" in str(exc):
            return False
        raise
    return True


def _kwoknodes(repo: Path) -> Any:
    import sys

    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    from e2e.cluster import kwoknodes

    return kwoknodes


def step_operator(d: Demo) -> None:
    assert d.cluster is not None
    d.metrics_port = kc.free_port()
    log = d.workdir / "operator.log"
    # Node objects carry no inter-DC links: the cluster YAML gives them to the planner.
    topology = {"HETTRAIN_CLUSTER_CONFIG": str(d.repo / d.args.cluster),
                "HETTRAIN_METRICS_ADDR": "127.0.0.1"}
    proc = kc.start_operator(d.cluster.kubeconfig, d.metrics_port, kc.free_port(), log,
                             topology)
    d.children.add("operator", proc)
    d.progress.info(f"kopf run -m hettrain.handlers --all-namespaces --standalone "
                    f"(pid {proc.pid}); log: {log}")
    kc.wait_for(lambda: kc.http_get(f"http://127.0.0.1:{d.metrics_port}/metrics"), 90,
                "the operator's /metrics", alive=d.operator_alive)
    d.progress.info(f"metrics: http://127.0.0.1:{d.metrics_port}/metrics")


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hettrain" / "demo"


def step_storage(d: Demo) -> None:
    """The job's storage: the token set of the shipped corpus (prepared once, cached), the
    local S3 server for the checkpoints and the Secret with its credentials."""
    assert d.cluster is not None
    ns = d.args.namespace
    spec = (yaml.safe_load((d.repo / d.args.job).read_text()) or {}).get("spec") or {}
    data, ck = spec.get("data") or {}, spec.get("checkpoint") or {}
    if data.get("uri"):
        d.data_uri = str(storage.prepared_corpus(d.repo, _cache_dir(), d.progress.info))
    else:
        d.progress.info(f"spec.data {data}: used as given")
    kc.ensure_namespace(d.api, ns)
    if not str(ck.get("uri", "")).startswith("s3://"):
        d.checkpoint_uri = str(d.workdir / "checkpoints")
        d.progress.info(f"spec.checkpoint.uri is not s3://: checkpoints in {d.checkpoint_uri}")
        return
    if not ck.get("secretRef"):
        raise kc.DemoError(f"{d.args.job}: spec.checkpoint.secretRef must name the Secret for "
                           "the demo's S3 credentials")
    d.s3 = storage.start_s3(d.workdir / "s3.log", d.children.add)
    d.progress.info(f"S3 server (moto, pid {d.s3.proc.pid}, IAM auth on: unsigned or "
                    f"wrongly signed requests are refused) at {d.s3.endpoint}, bucket "
                    f"{d.s3.bucket}; log {d.workdir / 's3.log'}")
    storage.create_secret(d.api, ns, ck["secretRef"], d.s3.creds)
    d.progress.info(f"Secret {ns}/{ck['secretRef']} holds the access key "
                    f"({', '.join(sorted(d.s3.creds))}); the ranks get it only as the pods' "
                    "secretKeyRef env")


def step_job(d: Demo) -> Plan:
    assert d.cluster is not None
    ns = d.args.namespace
    doc = kc.load_job_manifest(d.repo / d.args.job, d.args.steps, d.args.checkpoint_interval,
                               data_uri=d.data_uri,
                               checkpoint_endpoint=d.s3.endpoint if d.s3 else None)
    if d.s3 is None:
        doc["spec"].setdefault("checkpoint", {})["uri"] = d.checkpoint_uri
    d.job_name = doc["metadata"]["name"]
    out = kc.kubectl(d.cluster.kubeconfig, d.cluster.tools_bin, "apply", "-n", ns, "-f", "-",
                     stdin=yaml.safe_dump(doc))
    d.progress.info(f"kubectl apply -n {ns} -f {d.args.job}: {out.strip()}")
    watch_phases(d, lambda j: kc.is_true(j, c.COND_PLANNED) and kc.is_true(
        j, c.COND_PODS_READY), 120, "Planned and PodsReady")
    job = d.job()
    cond = kc.condition(job, c.COND_PLANNED) or {}
    d.progress.info(f"Planned: {cond.get('message', '')}")
    pods = kc.job_pods(d.api, ns, d.job_name)
    for p in sorted(pods, key=lambda p: p.metadata.name):
        d.progress.info(f"pod {p.metadata.name:28s} {p.status.phase:8s} on {p.spec.node_name}")
    plan = Plan.from_json(kc.plan_json(d.api, ns, job))
    d.summary["plans"] = [_plan_info(plan)]
    return plan


def watch_phases(d: Demo, done: Any, timeout: float, what: str) -> dict[str, Any]:
    """Poll the job, printing each phase change with its time, until ``done(job)``."""
    t0 = time.monotonic()
    last = None
    seen = d.summary.setdefault("phases", [])

    def check() -> Any:
        nonlocal last
        job = d.job()
        status = job.get("status") or {}
        now = (status.get("phase"), int(status.get("attempt") or 0))
        if now != last:
            last = now
            seen.append(now[0])
            d.progress.info(f"+{time.monotonic() - t0:5.1f} s  phase {now[0]}  "
                            f"attempt {now[1]}")
        return job if done(job) else None

    return kc.wait_for(check, timeout, f"job {what}", interval=0.1, alive=d.operator_alive)


def layout(plan: Plan) -> str:
    """The plan's parallel shape, e.g. ``dp2×pp2`` (``×tpN`` only when TP is used)."""
    tps = sorted({s.tp for s in plan.stages})
    tp = "" if tps == [1] else "×tp" + "/".join(map(str, tps))
    return f"dp{plan.dp}×pp{plan.pp}{tp}"


def _plan_info(plan: Plan) -> dict[str, Any]:
    return {"world_size": plan.world_size, "dp": plan.dp, "pp": plan.pp, "layout": layout(plan),
            "nodes": list(plan.nodes()), "pools": list(plan.pools),
            "fingerprint": plan.fingerprint()}


def _pod_env(d: Demo, attempt: int) -> dict[str, str]:
    """The env the operator gave this attempt's pods (Secret refs resolved like the kubelet)."""
    pods = [p for p in kc.job_pods(d.api, d.args.namespace, d.job_name)
            if (p.metadata.labels or {}).get(c.LABEL_ATTEMPT) == str(attempt)]
    if not pods:
        raise kc.DemoError(f"no pods of attempt {attempt} for job {d.job_name}")
    pod = sorted(pods, key=lambda p: p.metadata.name)[0]
    return storage.rank_env(storage.resolve_pod_env(d.api, d.args.namespace, pod))


def _committed(d: Demo) -> list[int]:
    """Steps of the checkpoints published in the object store (listed with the job's key)."""
    if d.s3 is None or not d.checkpoint_uri.startswith("s3://"):
        return []
    prefix = d.checkpoint_uri.removeprefix(f"s3://{d.s3.bucket}/")
    return d.s3.committed_steps(prefix)


def step_train(d: Demo, plan: Plan, attempt: int, until_step: int | None) -> training.Run:
    workdir = d.workdir / f"train-attempt-{attempt}"
    env = _pod_env(d, attempt)
    d.checkpoint_uri = env.get(c.ENV_CHECKPOINT_URI, d.checkpoint_uri)
    d.keep = env.get("HETTRAIN_CHECKPOINT_KEEP", d.keep)
    if attempt > 1 and d.s3 is not None:
        steps = _committed(d)
        d.summary["committed_before_resume"] = steps
        d.progress.info(f"object store: committed checkpoints at steps {steps} in "
                        f"{d.checkpoint_uri}")
    run = training.start(plan, workdir, d.children, env, step_sleep=d.args.step_sleep)
    d.runs.append(run)
    d.progress.info(f"{plan.world_size} ranks as local processes (CPU, gloo) with the pods' "
                    f"env ({c.ENV_RESUME}={env.get(c.ENV_RESUME)}); logs {workdir}/rank-*.log")
    d.progress.info(f"data {d.data_uri or 'as in the spec'}; checkpoints every "
                    f"{env.get('HETTRAIN_CHECKPOINT_INTERVAL')} steps to {d.checkpoint_uri}"
                    + (f" (endpoint {d.s3.endpoint})" if d.s3 else ""))
    training.stream(run, d.show_loss, until_step=until_step, timeout=d.args.train_timeout)
    if attempt > 1:  # what rank 0 did with the object store at the resume
        log = (workdir / "rank-0.log").read_text(errors="replace").splitlines()
        said = [ln.split(" INFO ", 1)[-1] for ln in log if " INFO " in ln and (
            "resumed from checkpoint" in ln or "removed incomplete checkpoint" in ln)]
        d.summary["resume_log"] = said
        for ln in said:
            d.progress.info(ln if ln.startswith("rank ") else f"rank 0: {ln}")
    return run


def step_failure(d: Demo, plan: Plan) -> Plan:
    victim = plan.ranks[-1].node
    kwoknodes = _kwoknodes(d.repo)
    kwoknodes.mark_not_ready(d.api, victim)
    d.summary["failed_node"] = victim
    d.progress.info(f"node {victim} marked NotReady (annotation "
                    f"hettrain.dev/fault=not-ready; kwok reports Ready=False)")
    if d.runs:
        run = d.runs[-1]
        lost = [r.rank for r in plan.ranks_on(victim)]
        d.progress.info(f"ranks {lost} on {victim} die with it; the rest of the gang is "
                        "stopped")
        d.children.stop(list(run.procs), grace=3)
    job = watch_phases(d, lambda j: int((j.get("status") or {}).get("attempt") or 0) >= 2
                       and kc.is_true(j, c.COND_PODS_READY), 120,
                       "repaired (attempt 2, PodsReady)")
    st = job.get("status") or {}
    rep = st.get("repairs") or {}
    d.progress.info(f"repairs: {rep.get('count')} (last cause {rep.get('lastCause')}); "
                    f"failed nodes {st.get('failedNodes')}")
    for ev in kc.job_events(d.api, d.args.namespace, d.job_name):
        d.progress.info(f"event {ev.type:7s} {ev.reason:14s} {ev.message}")
    new = Plan.from_json(kc.plan_json(d.api, d.args.namespace, job))
    d.summary["plans"].append(_plan_info(new))
    if victim in new.nodes():
        raise kc.DemoError(f"the new plan still uses the failed node {victim}")
    d.show_plan(new, 2)
    d.progress.info(f"world size {plan.world_size} → {new.world_size}; pools "
                    f"{','.join(plan.pools)} → {','.join(new.pools)}")
    d.progress.info(f"layout {layout(plan)} → {layout(new)}"
                    + ("" if layout(plan) != layout(new) else " (same shape, other nodes)"))
    return new


def step_metrics(d: Demo) -> None:
    text = kc.http_get(f"http://127.0.0.1:{d.metrics_port}/metrics")
    lines = kc.metric_lines(text, "hettrain_")
    d.progress.info(f"operator (http://127.0.0.1:{d.metrics_port}/metrics):")
    for ln in lines:
        d.progress.info(f"  {ln}")
    d.summary["operator_metrics"] = lines
    if d.runs:
        run = d.runs[-1]
        rt = kc.metric_lines(run.runtime_metrics, "hettrain_runtime_")
        d.progress.info(f"runtime rank 0 (last scrape of :{run.metrics_port}/metrics):")
        for ln in rt:
            d.progress.info(f"  {ln}")
        d.summary["runtime_metrics"] = rt


def summarize_losses(d: Demo) -> int:
    if len(d.runs) < 2:
        return 0
    first, second = d.runs[0].losses, d.runs[1].losses
    if not first or not second:
        raise kc.DemoError("no losses were logged; see the rank logs")
    s0, s_fail, s_res = min(first), max(first), min(second)
    s_end = max(second)
    d.summary["losses"] = {"attempt1": {str(k): v for k, v in sorted(first.items())},
                           "attempt2": {str(k): v for k, v in sorted(second.items())}}
    d.summary["resumed_at_step"] = s_res
    d.progress.info(f"attempt 1: loss {first[s0]:.4f} at step {s0 + 1} → {first[s_fail]:.4f} "
                    f"at step {s_fail + 1}, then the node failed")
    lay = [p.get("layout", "?") for p in d.summary.get("plans", [])]
    d.progress.info(f"attempt 2: resumed from the step-{s_res} checkpoint on the new layout "
                    f"({' → '.join(lay)}): "
                    f"{second[s_res]:.4f} at step {s_res + 1} → {second[s_end]:.4f} at step "
                    f"{s_end + 1}")
    if d.s3 is not None:
        d.summary["committed_at_end"] = _committed(d)
        d.progress.info(f"object store: committed checkpoints at steps "
                        f"{d.summary['committed_at_end']} (retention keeps the last "
                        f"{d.keep}) in {d.checkpoint_uri}")
    if s_res == 0:
        d.progress.info("WARNING: attempt 2 started at step 1: no checkpoint was resumed")
        return 1
    same = [k for k in second if k in first]
    if same:
        diff = max(abs(first[k] - second[k]) for k in same)
        d.summary["replayed_steps_max_abs_diff"] = diff
        d.progress.info(f"steps {min(same) + 1}–{max(same) + 1} ran on both layouts: losses "
                        f"agree within {diff:.1e} (same data and weights, new placement)")
    fell = second[s_end] < first[s0] and first[s_fail] < first[s0]
    d.progress.info("loss fell before and after the repair" if fell else
                    "WARNING: the loss did not fall")
    return 0 if fell else 1


# ---------------------------------------------------------------------- main


def run_demo(args: argparse.Namespace) -> int:
    """Run every step; Ctrl-C / SIGTERM anywhere stops all children and the cluster."""
    repo = kc.repo_root(args.repo)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hettrain-demo-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    train = not args.no_train
    progress = Progress(10 if train else 8)
    children = Children(log=progress.info)
    d = Demo(args, repo, workdir, progress, children)
    steps = args.steps
    fail_after = args.fail_at if args.fail_at is not None else min(steps - 2, steps // 2 + 2)
    if not 1 <= fail_after < steps:
        raise kc.DemoError(f"--fail-at {fail_after}: must be in [1, --steps) = [1, {steps})")
    progress.info(f"hettrain demo: work dir {workdir}")
    code = 1
    with interrupts_as_keyboard_interrupt():
        try:
            with progress.step("local control plane up (etcd, apiserver, controllers, "
                               "scheduler, kwok)"):
                step_cluster(d)
            with progress.step("CRD + kwok GPU nodes: 4 vendors in 2 datacenters"):
                step_nodes(d)
            with progress.step("operator running"):
                step_operator(d)
            with progress.step("storage: token set, local S3 server, credentials Secret"):
                step_storage(d)
            with progress.step(f"apply {args.job}, wait for Planned and PodsReady"):
                plan = step_job(d)
            with progress.step("the plan (table + picture)"):
                d.show_plan(plan, 1)
            if train:
                with progress.step(f"train the planned ranks locally, {fail_after} of "
                                   f"{steps} steps"):
                    step_train(d, plan, 1, until_step=fail_after - 1)
            with progress.step("inject a node failure → operator repairs on the survivors"):
                plan = step_failure(d, plan)
            if train:
                with progress.step("resume from the checkpoint on the new layout"):
                    step_train(d, plan, 2, until_step=None)
            with progress.step("metrics"):
                step_metrics(d)
                code = summarize_losses(d)
        except KeyboardInterrupt:
            progress.info("interrupted: stopping every process and the cluster")
            code = 130
        except kc.DemoError as exc:
            progress.info(f"error: {exc}")
            code = 1
        finally:
            with no_interrupts():
                t0 = time.monotonic()
                children.shutdown()
                (workdir / "summary.json").write_text(json.dumps(d.summary, indent=1))
                progress.info(f"teardown done in {time.monotonic() - t0:.1f} s; logs, "
                              f"pictures and summary.json in {workdir}")
    return code
