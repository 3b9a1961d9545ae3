"""The demo, step by step: control plane → nodes → operator → job → plan → train → failure →
repair → resumed training → metrics → teardown."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hettrain.api import constants as c
from hettrain.demo import cluster as kc
from hettrain.demo import training
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
    kc.kubectl(d.cluster.kubeconfig, d.cluster.tools_bin, "wait", "--timeout=60s",
               "--for=condition=Established", "crd/hettrainingjobs.hettrain.dev")
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


def step_job(d: Demo) -> Plan:
    assert d.cluster is not None
    ns = d.args.namespace
    kc.ensure_namespace(d.api, ns)
    doc = kc.load_job_manifest(d.repo / d.args.job, d.args.steps,
                               str(d.workdir / "checkpoints"), d.args.checkpoint_interval)
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


def _plan_info(plan: Plan) -> dict[str, Any]:
    return {"world_size": plan.world_size, "dp": plan.dp, "pp": plan.pp,
            "nodes": list(plan.nodes()), "pools": list(plan.pools),
            "fingerprint": plan.fingerprint()}


def step_train(d: Demo, plan: Plan, attempt: int, until_step: int | None) -> training.Run:
    workdir = d.workdir / f"train-attempt-{attempt}"
    run = training.start(plan, workdir, d.workdir / "checkpoints", d.children,
                         resume=attempt > 1, interval=d.args.checkpoint_interval,
                         step_sleep=d.args.step_sleep)
    d.runs.append(run)
    d.progress.info(f"{plan.world_size} ranks as local processes (CPU, gloo); logs "
                    f"{workdir}/rank-*.log; checkpoints every {d.args.checkpoint_interval} steps")
    training.stream(run, d.show_loss, until_step=until_step, timeout=d.args.train_timeout)
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
    d.progress.info(f"attempt 2: resumed from the step-{s_res} checkpoint on the new layout: "
                    f"{second[s_res]:.4f} at step {s_res + 1} → {second[s_end]:.4f} at step "
                    f"{s_end + 1}")
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
    progress = Progress(9 if train else 7)
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
