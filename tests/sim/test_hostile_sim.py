"""Hostile input to ``hettrain simulate`` through the real CLI (a subprocess with a timeout):
a failure model or checkpoint interval that would sample/run without end, oversized numbers
and fields in a trace, and trace rows naming unknown nodes or pools all end in exit 2 with one
line on stderr naming the file (and row) and the field, no traceback, no hang."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from tests.cli.hostile import ROOT, TIMEOUT_S, assert_clean_refusal, run_hettrain

JOB = ROOT / "examples/jobs/gpt-tiny-local.yaml"
BASE = ["simulate", "--generate", "16:H100-SXM", "--job", str(JOB), "--days", "1",
        "--policies", "restart"]
TRACE_HEADER = "time_s,target,kind,duration_s,slowdown\n"


def _simulate(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``hettrain simulate`` on the 16-GPU base scenario plus ``args``, as a new process."""
    return run_hettrain([*BASE, *args], tmp_path)


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
    assert_clean_refusal(proc, f"fm1.yaml: {field}", "--days")
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
    assert_clean_refusal(_simulate(args, tmp_path), field)


def test_trace_huge_numbers_and_fields(tmp_path: Path) -> None:
    """Defect 2: a 5000-digit JSON number (int digit limit) and a 200,000-character CSV field
    (csv field size limit) gave tracebacks."""
    (tmp_path / "t.jsonl").write_text('{"time_s": 1, "kind": "software"}\n'
                                      f'{{"time_s": {"9" * 5000}, "kind": "software"}}\n')
    assert_clean_refusal(_simulate(["--trace", "t.jsonl"], tmp_path), "t.jsonl:2: ")
    (tmp_path / "t.csv").write_text(TRACE_HEADER + "3600,job,software,0,\n"
                                    + "1" * 200_000 + ",job,software,0,\n")
    assert_clean_refusal(_simulate(["--trace", "t.csv"], tmp_path), "t.csv:3: ")


@pytest.mark.parametrize("target, what", [("node:nope-001", "node"), ("rack:nope/0", "pool")])
def test_trace_unknown_node_or_pool_names_the_row(tmp_path: Path, target: str, what: str
                                                   ) -> None:
    """Defect 3: an unknown node/pool in a trace row was reported as ``node: ...``."""
    (tmp_path / "n.csv").write_text(TRACE_HEADER + f"3600,{target},fail,100,\n")
    assert_clean_refusal(_simulate(["--trace", "n.csv"], tmp_path), "n.csv:2.target: ",
                          f"not a {what} of the cluster")


def test_young_daly_interval_is_raised_for_a_tiny_model(tmp_path: Path) -> None:
    """A tiny model's checkpoint takes milliseconds, so Young–Daly asked for one every ~5 s:
    10^8 checkpoints over 3650 days, minutes of simulation. The default interval is raised to
    at most MAX_EXPECTED_EVENTS checkpoints per run and the report says so."""
    from hettrain.sim.model import MAX_EXPECTED_EVENTS

    days = 3650
    t0 = time.perf_counter()
    proc = run_hettrain(["simulate", "--generate", "16:H100-SXM", "--job", str(JOB), "--days",
                         str(days), "--policies", "restart", "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert time.perf_counter() - t0 < TIMEOUT_S / 4
    report = json.loads(proc.stdout)
    least = days * 86400 / MAX_EXPECTED_EVENTS
    ckpt = report["checkpoint"]
    assert ckpt["interval_s"] == pytest.approx(least)
    assert ckpt["interval"].startswith("young-daly") and "raised to" in ckpt["interval"]


def test_trace_over_the_size_limit_is_refused_unread(tmp_path: Path) -> None:
    """A trace was read whole into memory, however large: a (sparse) file one byte over
    MAX_TRACE_BYTES is refused after one bounded read, naming the file and --days."""
    from hettrain.sim.timeline import MAX_TRACE_BYTES

    with (tmp_path / "big.csv").open("wb") as f:
        f.truncate(MAX_TRACE_BYTES + 1)
    assert_clean_refusal(_simulate(["--trace", "big.csv"], tmp_path), "big.csv: ", "MiB",
                         "--days")


@pytest.mark.parametrize("name", ["t.csv", "t.jsonl"])
def test_trace_with_more_rows_than_simulated_is_refused(tmp_path: Path, name: str,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """More rows than MAX_EXPECTED_EVENTS (events simulated per seed) are refused while
    reading (here with the limit lowered to 3, in-process: the real limit is 10^6 rows)."""
    from hettrain.sim import timeline
    from hettrain.sim.model import SimInputError

    monkeypatch.setattr(timeline, "MAX_EXPECTED_EVENTS", 3)
    path = tmp_path / name
    row = ('{"time_s": 1, "kind": "software"}\n' if name.endswith("jsonl")
           else "1,job,software,0,\n")
    path.write_text(("" if name.endswith("jsonl") else TRACE_HEADER) + row * 3)
    assert len(timeline._rows(path)) == 3
    path.write_text(("" if name.endswith("jsonl") else TRACE_HEADER) + row * 4)
    with pytest.raises(SimInputError, match="more than 3 events"):
        timeline._rows(path)
