"""``hettrain demo`` end to end on the real local control plane, and its Ctrl-C cleanup.

Run: ``.venv/bin/pytest tests/demo -x -q`` (~2 min on 2 cores with warm binaries).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from procscan import MARKER, marked_pids

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
HETTRAIN = str(Path(sys.executable).parent / "hettrain")


def _start(workdir: Path, token: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, MARKER: token, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([HETTRAIN, "demo", "--workdir", str(workdir), *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _reap(proc: subprocess.Popen, token: str) -> None:
    """Last resort if a test failed midway: kill whatever the run left (by marker)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in marked_pids(token):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class _LineReader:
    """Reads a pipe on a thread, so waiting for a line never blocks past a deadline."""

    def __init__(self, pipe: Any) -> None:
        self.queue: queue.Queue[str] = queue.Queue()
        self.thread = threading.Thread(target=self._run, args=(pipe,), daemon=True)
        self.thread.start()

    def _run(self, pipe: Any) -> None:
        for line in pipe:
            self.queue.put(line)

    def done(self) -> bool:
        return not self.thread.is_alive() and self.queue.empty()

    def take(self, timeout: float) -> list[str]:
        out = []
        try:
            out.append(self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait())
            while True:
                out.append(self.queue.get_nowait())
        except queue.Empty:
            pass
        return out


def test_demo_trains_fails_a_node_repairs_and_resumes(tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    proc = _start(tmp_path, token, "--steps", "16", "--fail-at", "10",
                  "--checkpoint-interval", "4")
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        _reap(proc, token)
    assert proc.returncode == 0, out[-6000:]
    for i, title in enumerate(["local control plane up", "CRD + kwok GPU nodes",
                               "operator running", "storage: token set, local S3 server",
                               "apply examples/demo/job.yaml", "the plan",
                               "train the planned ranks", "inject a node failure",
                               "resume from the checkpoint", "metrics"], start=1):
        assert f"[{i}/10] {title}" in out, title
    assert out.count(": ok ") == 10, out[-6000:]
    assert "phase Repairing" in out and "loss fell before and after the repair" in out
    # the model is the small Llama, trained on the shipped corpus's token set
    assert "llama-opticks" in out and "/opticks-" in out

    summary = json.loads((tmp_path / "summary.json").read_text())
    first = {int(k): v for k, v in summary["losses"]["attempt1"].items()}
    second = {int(k): v for k, v in summary["losses"]["attempt2"].items()}
    # attempt 1 ran steps 0..>=9; the failure came after 10 steps; checkpoints every 4 steps
    assert min(first) == 0 and max(first) >= 9
    assert summary["resumed_at_step"] in (4, 8) and max(second) == 15
    # checkpoints went to the S3 server: committed there before the resume (the one resumed
    # from among them), and retention kept the last 3 at the end
    committed = summary["committed_before_resume"]
    assert summary["resumed_at_step"] == max(committed) and set(committed) <= {4, 8}
    assert summary["committed_at_end"] == [8, 12, 16]
    assert f"rank 0: resumed from checkpoint step {summary['resumed_at_step']}" in out
    assert "s3://hettrain-demo/checkpoints/hettrain-demo/llama-opticks-demo" in out
    # losses fall before the failure and keep falling after the repair
    assert first[max(first)] < first[0]
    assert second[15] < first[0] and second[15] < second[min(second)]
    assert sum(second.values()) / len(second) < sum(first.values()) / len(first)
    # steps replayed after the resume, on another placement, reproduce the first run's losses
    assert summary["replayed_steps_max_abs_diff"] < 1e-4
    # the repair re-planned without the failed node
    old, new = summary["plans"]
    assert summary["failed_node"] in old["nodes"] and summary["failed_node"] not in new["nodes"]
    assert old["fingerprint"] != new["fingerprint"]
    # ... on a new parallel shape: the surviving pools yield dp=1 (pp=2 pinned), so the resume
    # resharded the dp=2 checkpoint (the replayed losses above match the dp=2 run)
    assert (old["dp"], old["pp"], old["layout"]) == (2, 2, "dp2×pp2")
    assert (new["dp"], new["pp"], new["layout"]) == (1, 2, "dp1×pp2")
    assert new["world_size"] == 2
    assert "layout dp2×pp2 → dp1×pp2" in out
    assert "on the new layout (dp2×pp2 → dp1×pp2)" in out
    assert any(ln.startswith("hettrain_repairs_total{") and 'cause="NodeLost"' in ln
               and ln.endswith(" 1.0") for ln in summary["operator_metrics"])
    assert any(ln.startswith("hettrain_runtime_step{") and ln.endswith(" 16.0")
               for ln in summary["runtime_metrics"])
    assert (tmp_path / "plan-attempt-1.png").stat().st_size > 10_000
    assert (tmp_path / "plan-attempt-2.png").stat().st_size > 10_000
    assert not (tmp_path / "cluster").exists()  # e2e/cluster/down removed the state dir
    assert marked_pids(token) == {}
    # the S3 credentials reached the ranks only through the Secret: no file of the run (logs,
    # summary, plan files) and not the demo's output holds an access key
    assert not _ACCESS_KEY.search(out)
    for f in tmp_path.rglob("*"):
        if f.is_file():
            assert not _ACCESS_KEY.search(f.read_text(errors="replace")), f


_ACCESS_KEY = re.compile(r"AKIA[A-Z0-9]{16}")  # the form of the keys moto (and AWS) issue


def test_sigint_mid_training_stops_every_child(tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    proc = _start(tmp_path, token, "--steps", "200", "--step-sleep", "0.3")
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        reader = _LineReader(proc.stdout)
        deadline = time.monotonic() + 300
        while not any("step   3  loss" in ln for ln in lines):
            if time.monotonic() > deadline or (proc.poll() is not None and reader.done()):
                pytest.fail("demo did not reach step 3:\n" + "".join(lines)[-4000:])
            lines.extend(reader.take(timeout=0.5))
        running = marked_pids(token)
        names = " ".join(running.values())
        # the cluster's five components, the operator, the S3 server and the four ranks
        for exe in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
                    "kwok", "kopf run", "moto.server", "hettrain.runtime"):
            assert exe in names, names
        assert sum("hettrain.runtime" in cmd for cmd in running.values()) == 4
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
        took = time.monotonic() - t0
        reader.thread.join(timeout=10)
        rest = "".join(reader.take(timeout=0))
    finally:
        _reap(proc, token)
    out = "".join(lines) + rest
    assert proc.returncode == 130, out[-4000:]
    assert "interrupted" in rest and "teardown done" in rest
    left = marked_pids(token)
    assert left == {}, left
    assert not (tmp_path / "cluster").exists()
    print(f"SIGINT → all {len(running)} processes gone in {took:.1f} s")
