"""Real multi-process runs over gloo: a heterogeneous 2-pool x 2-stage pipeline must reproduce
the single-process reference, expose its metrics over HTTP, and survive a SIGKILL by resuming
on a different layout from the last DCP checkpoint."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from tests.runtime.training.plans import tiny_plan

from hettrain.api.spec import parse_job_manifest
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import plan_job
from hettrain.runtime.launch import free_port_block, kill_rank, launch_local, wait_all
from hettrain.runtime.trainer import reference_losses

pytestmark = pytest.mark.slow

# fp32 on CPU: only the summation order of the DP all-reduce / microbatches differs
RTOL = 1e-5


def _losses(path):
    return {d["step"]: d["loss"] for d in map(json.loads, path.read_text().splitlines())}


def _logs(workdir):
    return "\n".join(p.read_text()[-2000:] for p in sorted(workdir.glob("rank-*.log")))


def _scrape(port):
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return ""


def test_two_pool_pipeline_matches_reference_and_serves_metrics(tmp_path):
    # uneven 3+1 split over a Gaudi and an Ascend pool (hccl): no plugin on this host, so every
    # rank falls back to the CPU (HETTRAIN_DEVICE=auto) and the pools' groups resolve to gloo
    plan = tiny_plan([(0, 3, "pool-a"), (3, 4, "pool-b")], dp=2, steps=10,
                     vendors=["intel", "huawei"])
    base = free_port_block(plan.world_size)
    procs = launch_local(plan, tmp_path, {
        "HETTRAIN_LOSS_LOG": str(tmp_path / "loss.jsonl"), "HETTRAIN_METRICS_PORT": str(base),
        "HETTRAIN_STEP_SLEEP": "0.1"})
    text, deadline = "", time.monotonic() + 90
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        text = _scrape(base + 3)  # rank 3: last stage, pool-b, dp 1
        if _value(text, "hettrain_runtime_step") >= 2:
            break
        time.sleep(0.2)
    codes = wait_all(procs, 120)
    assert codes == [0, 0, 0, 0], _logs(tmp_path)
    assert "rank 0: device cpu (no hpu device visible for vendor 'intel'; CPU fallback)" in \
        (tmp_path / "rank-0.log").read_text()
    assert "rank 3: device cpu (no npu device visible" in (tmp_path / "rank-3.log").read_text()
    got = _losses(tmp_path / "loss.jsonl")
    ref = reference_losses(plan, plan.training.steps)
    assert sorted(got) == list(range(10))
    assert ref[-1] < ref[0]  # it learns
    for step, want in enumerate(ref):
        assert got[step] == pytest.approx(want, rel=RTOL), step
    labels = 'job="rt-test",pool="pool-b",rank="3",stage="1"'
    assert f"hettrain_runtime_loss{{{labels}}}" in text
    assert _value(text, "hettrain_runtime_loss") == pytest.approx(
        got[int(_value(text, "hettrain_runtime_step")) - 1], rel=1e-6)
    assert _value(text, "hettrain_runtime_tokens_per_second") > 0
    assert "hettrain_runtime_step_seconds_bucket" in text
    # stage 1 receives activations from and sends gradients to pool-a: inter-pool traffic
    assert _value(text, "hettrain_runtime_collective_bytes_total", 'tier="inter_pool"') > 0
    assert _value(text, "hettrain_runtime_collective_bytes_total", 'tier="intra_pool"') > 0


def _value(text, name, extra=""):
    for line in text.splitlines():
        if line.startswith(name + "{") and extra in line:
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def _kill_after_checkpoint(plan, tmp_path, env, *, after_step: int, victim: int) -> int:
    """Run ``plan`` in ``tmp_path/run1`` until checkpoint ``after_step`` exists, SIGKILL rank
    ``victim`` mid-run and tear the gang down (as the operator would); the checkpointed step."""
    ck = tmp_path / "ckpt"
    procs = launch_local(plan, tmp_path / "run1", env)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (ck / f"step-{after_step}").exists():
        assert all(p.poll() is None for p in procs), _logs(tmp_path / "run1")
        time.sleep(0.1)
    kill_rank(procs, victim)
    codes = wait_all(procs, 5)
    assert codes[victim] == -9
    done = int((ck / "latest").read_text().removeprefix("step-"))
    assert after_step <= done < plan.training.steps
    return done


def test_sigkill_then_resume_on_a_smaller_different_layout(tmp_path):
    steps = 9
    first = tiny_plan([(0, 3, "pool-a"), (3, 4, "pool-b")], dp=2, steps=steps)
    ck = tmp_path / "ckpt"
    env = {"HETTRAIN_CHECKPOINT_URI": f"file://{ck}", "HETTRAIN_CHECKPOINT_INTERVAL": "3",
           "HETTRAIN_METRICS_PORT": "0", "HETTRAIN_STEP_SLEEP": "0.3",
           "HETTRAIN_LOSS_LOG": str(tmp_path / "before.jsonl")}
    done = _kill_after_checkpoint(first, tmp_path, env, after_step=3, victim=1)  # stage 0, dp 1
    # re-plan on survivors: 2 ranks, 1 replica, layers re-split 1+3, twice the microbatches,
    # the GPipe schedule -- the same global batch of 16 sequences
    second = tiny_plan([(0, 1, "pool-a"), (1, 4, "pool-b")], dp=1, steps=steps,
                       num_microbatches=8, schedule="gpipe")
    env.update({"HETTRAIN_RESUME": "1", "HETTRAIN_STEP_SLEEP": "0",
                "HETTRAIN_LOSS_LOG": str(tmp_path / "after.jsonl")})
    codes = wait_all(launch_local(second, tmp_path / "run2", env), 120)
    assert codes == [0, 0], _logs(tmp_path / "run2")
    after = _losses(tmp_path / "after.jsonl")
    assert sorted(after) == list(range(done, steps))
    ref = reference_losses(first, steps)
    for step in range(done, steps):
        assert after[step] == pytest.approx(ref[step], rel=1e-4), step
    assert (ck / "latest").read_text() == f"step-{steps}"
    assert not list(ck.glob("*.tmp"))


def test_sigkill_then_planner_replan_on_survivors_and_resume(tmp_path):
    """The path the operator takes, without the cluster: plan the example job on the example
    CPU cluster, SIGKILL a rank after a checkpoint, re-plan with the planner on the surviving
    nodes (``without_nodes`` + ``previous``), resume there: the same loss curve."""
    root = Path(__file__).resolve().parents[3]
    doc = yaml.safe_load((root / "examples/jobs/gpt-tiny-local.yaml").read_text())
    name, spec = parse_job_manifest(doc)
    spec = replace(spec, training=replace(spec.training, steps=8))
    inventory = load_cluster(root / "examples/clusters/local-cpu.yaml")
    first = plan_job(name, spec, inventory)
    assert first.world_size >= 2, first.to_json()
    env = {"HETTRAIN_CHECKPOINT_URI": str(tmp_path / "ckpt"),
           "HETTRAIN_CHECKPOINT_INTERVAL": "2", "HETTRAIN_METRICS_PORT": "0",
           "HETTRAIN_STEP_SLEEP": "0.3", "HETTRAIN_LOSS_LOG": str(tmp_path / "before.jsonl")}
    victim = first.world_size - 1
    done = _kill_after_checkpoint(first, tmp_path, env, after_step=2, victim=victim)
    survivors = inventory.without_nodes([first.ranks[victim].node])
    second = plan_job(name, spec, survivors, previous=first)
    assert first.ranks[victim].node not in second.nodes()
    assert first.ranks[victim].node not in {r.node for r in second.ranks}
    assert second.global_batch == first.global_batch  # accumulation absorbs the smaller dp
    env.update({"HETTRAIN_RESUME": "1", "HETTRAIN_STEP_SLEEP": "0",
                "HETTRAIN_LOSS_LOG": str(tmp_path / "after.jsonl")})
    codes = wait_all(launch_local(second, tmp_path / "run2", env), 120)
    assert codes == [0] * second.world_size, _logs(tmp_path / "run2")
    after = _losses(tmp_path / "after.jsonl")
    assert sorted(after) == list(range(done, 8))
    ref = reference_losses(first, 8)
    for step in range(done, 8):
        assert after[step] == pytest.approx(ref[step], rel=1e-4), step
