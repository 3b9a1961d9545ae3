"""Hostile input to ``hettrain simulate`` through the real CLI (a subprocess with a timeout):
a failure model or checkpoint interval that would sample/run without end, oversized numbers
and fields in a trace, and trace rows naming unknown nodes or pools all end in exit 2 with one
line on stderr naming the file (and row) and the field, no traceback, no hang."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "examples/jobs/gpt-tiny-local.yaml"
TIMEOUT_S = 120  # generous: the 2 shared cores may be loaded; a hang is what this catches
BASE = ["simulate", "--generate", "16:H100-SXM", "--job", str(JOB), "--days", "1",
        "--policies", "restart"]
TRACE_HEADER = "time_s,target,kind,duration_s,slowdown\n"


def _simulate(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``hettrain simulate`` on the 16-GPU base scenario plus ``args``, as a new process."""
    path = os.pathsep.join(p for p in (str(ROOT / "operator"), os.environ.get("PYTHONPATH"))
                           if p)
    return subprocess.run([sys.executable, "-m", "hettrain.cli", *BASE, *args],
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": path})


def _assert_clean_refusal(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    assert err.startswith("error: ") and err.count("\n") == 1, err[-2000:]
    assert len(err) < 500, err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.mark.parametrize("failures, field", [
    ("{gpuMtbfHours: 1.0e-9}", "failures.gpuMtbfHours"),
    ("{devices: {H100-SXM: {gpuMtbfHours: 1.0e-300}}}",
     "failures.devices.H100-SXM.gpuMtbfHours"),
    ("{softwareGpuMtbfHours: 1.0e-9}", "failures.softwareGpuMtbfHours"),
    ("{rack: {mtbfHours: 5.0e-324}}", "failures.rack.mtbfHours"),
    ("{datacenter: {mtbfHours: 1.0e-9}}", "failures.datacenter.mtbfHours"),
    ("{stragglers: {gpuMtbfHours: 1.0e-9}}", "failures.stragglers.gpuMtbfHours"),
])
def test_tiny_mtbf_is_refused_quickly(tmp_path: Path, failures: str, field: str) -> None:
    """Defect 1: a tiny MTBF sampled events without end (memory growing ~60 MB/s)."""
    (tmp_path / "fm1.yaml").write_text(f"kind: FailureModel\nfailures: {failures}\n")
    t0 = time.perf_counter()
    proc = _simulate(["--failures", "fm1.yaml"], tmp_path)
    _assert_clean_refusal(proc, f"fm1.yaml: {field}", "--days")
    assert time.perf_counter() - t0 < TIMEOUT_S / 4


@pytest.mark.parametrize("args, field", [
    (["--failures", "fm.yaml"], "fm.yaml: recovery.checkpointIntervalSeconds"),
    (["--ckpt-interval-s", "1e-9"], "--ckpt-interval-s"),
])
def test_tiny_checkpoint_interval_is_refused(tmp_path: Path, args: list[str], field: str
                                             ) -> None:
    """Defect 1 (the other rate-like field): a tiny checkpoint interval ran without end."""
    (tmp_path / "fm.yaml").write_text("kind: FailureModel\n"
                                      "recovery: {checkpointIntervalSeconds: 1.0e-9}\n")
    _assert_clean_refusal(_simulate(args, tmp_path), field)


def test_trace_huge_numbers_and_fields(tmp_path: Path) -> None:
    """Defect 2: a 5000-digit JSON number (int digit limit) and a 200,000-character CSV field
    (csv field size limit) gave tracebacks."""
    (tmp_path / "t.jsonl").write_text('{"time_s": 1, "kind": "software"}\n'
                                      f'{{"time_s": {"9" * 5000}, "kind": "software"}}\n')
    _assert_clean_refusal(_simulate(["--trace", "t.jsonl"], tmp_path), "t.jsonl:2: ")
    (tmp_path / "t.csv").write_text(TRACE_HEADER + "3600,job,software,0,\n"
                                    + "1" * 200_000 + ",job,software,0,\n")
    _assert_clean_refusal(_simulate(["--trace", "t.csv"], tmp_path), "t.csv:3: ")


@pytest.mark.parametrize("target, what", [("node:nope-001", "node"), ("rack:nope/0", "pool")])
def test_trace_unknown_node_or_pool_names_the_row(tmp_path: Path, target: str, what: str
                                                   ) -> None:
    """Defect 3: an unknown node/pool in a trace row was reported as ``node: ...``."""
    (tmp_path / "n.csv").write_text(TRACE_HEADER + f"3600,{target},fail,100,\n")
    _assert_clean_refusal(_simulate(["--trace", "n.csv"], tmp_path), "n.csv:2.target: ",
                          f"not a {what} of the cluster")
