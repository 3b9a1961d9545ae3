"""Hostile input through the real ``hettrain`` CLI (a subprocess with a timeout), one case per
family of issue #16: every one ends in exit 2 with one line on stderr that names the file or
flag and the field, no traceback, no hang."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from tests.cli.hostile import ROOT, assert_clean_refusal, run_hettrain

JOB = ROOT / "examples/jobs/gpt-tiny-local.yaml"
CLUSTER = ROOT / "examples/clusters/local-cpu.yaml"

GOOD_JOB = """\
apiVersion: hettrain.dev/v1alpha1
kind: HetTrainingJob
metadata: {name: tiny}
spec:
  model: {preset: gpt-tiny}
  training: {globalBatch: 8, steps: 10}
  data: {synthetic: true}
"""
GOOD_CLUSTER = """\
apiVersion: hettrain.dev/v1alpha1
kind: Cluster
metadata: {name: c}
datacenters: [{name: dc-a}, {name: dc-b}]
links: [{between: [dc-a, dc-b], bandwidthGbps: 10, latencyMs: 5}]
devices:
  - {name: X1, vendor: nvidia, bf16Tflops: 100, hbmGiB: 16, hbmTBps: 1, intraNodeGBps: 50,
     backend: nccl}
pools:
  - {name: p-a, datacenter: dc-a, device: X1, nodes: 2, gpusPerNode: 2, nicGbps: 100}
"""
BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n" for i in range(9))


def _hettrain(argv: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``hettrain ARGV`` as a new process, ``env`` added to the environment."""
    return run_hettrain(argv, tmp_path, env=env)


def _job(text: str, tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


JOB_CASES = {
    "alias bomb": (BOMB + GOOD_JOB, ("job.yaml", "alias")),
    "deep nesting": ("spec: " + "[" * 50_000 + "]" * 50_000 + "\n", ("job.yaml", "deeper")),
    "huge integer literal": (GOOD_JOB.replace("steps: 10", "steps: " + "9" * 5000),
                             ("job.yaml", "digits")),
    "non-mapping document": ("- 1\n- 2\n", ("job.yaml", "mapping")),
    "non-mapping metadata": (GOOD_JOB.replace("metadata: {name: tiny}", "metadata: [tiny]"),
                             ("job.yaml", "metadata")),
    "scalar spec": (GOOD_JOB.split("spec:")[0] + "spec: 5\n", ("job.yaml", "spec")),
    "NaN learning rate": (GOOD_JOB.replace("steps: 10", "steps: 10, learningRate: .nan"),
                          ("job.yaml", "spec.training.learningRate", "finite")),
    "inf learning rate": (GOOD_JOB.replace("steps: 10", "steps: 10, learningRate: .inf"),
                          ("job.yaml", "spec.training.learningRate")),
    "globalBatch 10^8": (GOOD_JOB.replace("globalBatch: 8", "globalBatch: 100000000"),
                         ("job.yaml", "spec.training.globalBatch", "<=")),
    "layers 10^6": (GOOD_JOB.replace("{preset: gpt-tiny}", "{preset: gpt-tiny, layers: 1000000}"),
                    ("job.yaml", "spec.model.layers", "<=")),
    "300-character pool name": (GOOD_JOB + f"  placement: {{pools: [{'p' * 300}]}}\n",
                                ("job.yaml", "spec.placement.pools[0]")),
    "60,000 adamBetas": (GOOD_JOB.replace("steps: 10", "steps: 10, adamBetas: ["
                                          + ", ".join(["0.5"] * 60_000) + "]"),
                         ("job.yaml", "spec.training.adamBetas")),
    "500 KB checkpoint uri": (GOOD_JOB + f"  checkpoint: {{uri: 'ftp://{'x' * 500_000}'}}\n",
                              ("job.yaml", "spec.checkpoint.uri")),
    "500 KB checkpoint endpoint": (GOOD_JOB + "  checkpoint: {uri: 's3://b/x', endpoint: '"
                                   + "x" * 500_000 + "'}\n",
                                   ("job.yaml", "spec.checkpoint.endpoint")),
    "name with a newline and escapes": (GOOD_JOB.replace("{name: tiny}",
                                                         '{name: "a\\nb\\u001b[31m"}'),
                                        ("job.yaml", "metadata.name")),
    "name with a path": (GOOD_JOB.replace("{name: tiny}", "{name: ../../etc/passwd}"),
                         ("job.yaml", "metadata.name")),
}


@pytest.mark.parametrize("case", sorted(JOB_CASES))
def test_hostile_job_file(case: str, tmp_path: Path) -> None:
    text, needles = JOB_CASES[case]
    job = _job(text, tmp_path)
    assert_clean_refusal(_hettrain(["plan", str(job), "--cluster", str(CLUSTER)], tmp_path),
                          *needles)


def test_non_utf8_job_file(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_bytes(GOOD_JOB.encode().replace(b"tiny}", b"t\xffny}"))
    assert_clean_refusal(_hettrain(["validate", str(job)], tmp_path), "job.yaml", "UTF-8")


CLUSTER_CASES = {
    "alias bomb": (BOMB + GOOD_CLUSTER, ("cluster.yaml", "alias")),
    "deep nesting": ("pools: " + "{a: " * 200 + "}" * 200 + "\n", ("cluster.yaml", "deeper")),
    "pools not a list": (GOOD_CLUSTER.split("pools:")[0] + "pools: 5\n", ("pools", "list")),
    "nodes a string": (GOOD_CLUSTER.replace("nodes: 2", "nodes: two"), ("pools[0].nodes",)),
    "gpusPerNode a list": (GOOD_CLUSTER.replace("gpusPerNode: 2", "gpusPerNode: [2]"),
                           ("pools[0].gpusPerNode",)),
    "nicGbps a word": (GOOD_CLUSTER.replace("nicGbps: 100", "nicGbps: fast"),
                       ("pools[0].nicGbps",)),
    "datacenter name a list": (GOOD_CLUSTER.replace("[{name: dc-a}", "[{name: [dc-a]}"),
                               ("datacenters[0].name",)),
    "zero NIC bandwidth": (GOOD_CLUSTER.replace("nicGbps: 100", "nicGbps: 0"),
                           ("pools[0].nicGbps", "positive")),
    "negative NIC bandwidth": (GOOD_CLUSTER.replace("nicGbps: 100", "nicGbps: -100"),
                               ("pools[0].nicGbps",)),
    "zero link bandwidth": (GOOD_CLUSTER.replace("bandwidthGbps: 10", "bandwidthGbps: 0"),
                            ("links[0].bandwidthGbps",)),
    "negative link bandwidth": (GOOD_CLUSTER.replace("bandwidthGbps: 10", "bandwidthGbps: -5"),
                                ("links[0].bandwidthGbps",)),
    "NaN link latency": (GOOD_CLUSTER.replace("latencyMs: 5", "latencyMs: .nan"),
                         ("links[0].latencyMs",)),
    "zero TFLOPs": (GOOD_CLUSTER.replace("bf16Tflops: 100", "bf16Tflops: 0"),
                    ("devices[0].bf16Tflops",)),
    "zero HBM bandwidth": (GOOD_CLUSTER.replace("hbmTBps: 1", "hbmTBps: 0"),
                           ("devices[0].hbmTBps",)),
    "zero efficiency": (GOOD_CLUSTER.replace("backend: nccl", "backend: nccl, efficiency: 0"),
                        ("devices[0].efficiency",)),
    "efficiency 5.0": (GOOD_CLUSTER.replace("backend: nccl", "backend: nccl, efficiency: 5.0"),
                       ("devices[0].efficiency", "<= 1")),
    "link to an unknown datacenter": (GOOD_CLUSTER.replace("between: [dc-a, dc-b]",
                                                           "between: [dc-a, mars]"),
                                      ("links[0].between[1]", "mars")),
    "10^9 nodes": (GOOD_CLUSTER.replace("nodes: 2", "nodes: 1000000000"),
                   ("pools[0].nodes",)),
    "typo in a pool key": (GOOD_CLUSTER.replace("nicGbps: 100", "nicGpbs: 100"),
                           ("pools[0].nicGpbs", "unknown field")),
    "typo in a link key": (GOOD_CLUSTER.replace("latencyMs: 5", "latencyMS: 5"),
                           ("links[0].latencyMS", "unknown field")),
    "unknown top-level key": (GOOD_CLUSTER + "bogus: 1\n", ("bogus", "unknown field")),
    "unknown datacenter key": (GOOD_CLUSTER.replace("{name: dc-a}", "{name: dc-a, rack: 4}"),
                               ("datacenters[0].rack", "unknown field")),
    "duplicate device": (GOOD_CLUSTER.replace("pools:", "  - {name: X1, vendor: amd, "
                                              "bf16Tflops: 1, hbmGiB: 1, hbmTBps: 1, "
                                              "intraNodeGBps: 1, backend: nccl}\npools:"),
                         ("devices[1].name", "duplicate")),
}


@pytest.mark.parametrize("case", sorted(CLUSTER_CASES))
def test_hostile_cluster_file(case: str, tmp_path: Path) -> None:
    text, needles = CLUSTER_CASES[case]
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(text)
    assert_clean_refusal(_hettrain(["plan", str(JOB), "--cluster", str(cluster)], tmp_path),
                          "cluster.yaml", *needles)


def test_non_utf8_cluster_file(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_bytes(b"\xfe\xff" + GOOD_CLUSTER.encode("utf-16-be"))
    assert_clean_refusal(_hettrain(["plan", str(JOB), "--cluster", str(cluster)], tmp_path),
                          "cluster.yaml", "UTF-8")


FLAG_CASES = {
    "simulate --days inf": (["simulate", "--scenario", "llama3-16k", "--days", "inf"],
                            "--days"),
    "simulate --days nan": (["simulate", "--scenario", "llama3-16k", "--days", "nan"],
                            "--days"),
    "simulate --dcs 10^9": (["simulate", "--generate", "64:H100-SXM", "--job", str(JOB),
                             "--dcs", "1000000000"], "--dcs"),
    "simulate --generate 10^12 GPUs": (["simulate", "--generate", "1000000000000:H100-SXM",
                                        "--job", str(JOB)], "--generate"),
    "simulate --seeds 10^30": (["simulate", "--scenario", "llama3-16k", "--seeds", "1" + "0" * 30],
                               "--seeds"),
    "simulate --repair-hours inf": (["simulate", "--scenario", "llama3-16k", "--repair-hours",
                                     "inf"], "--repair-hours"),
    "simulate --detection-s nan": (["simulate", "--scenario", "llama3-16k", "--detection-s",
                                    "nan"], "--detection-s"),
    "simulate --quantum 0": (["simulate", "--scenario", "llama3-16k", "--quantum", "0"],
                             "--quantum"),
    "plan --timeout-s nan": (["plan", str(JOB), "--cluster", str(CLUSTER), "--timeout-s",
                              "nan"], "--timeout-s"),
    "validate --timeout-s -1": (["validate", str(JOB), "--cluster", str(CLUSTER),
                                 "--timeout-s", "-1"], "--timeout-s"),
    "simulate --timeout-s inf": (["simulate", "--scenario", "llama3-16k", "--timeout-s", "inf"],
                                 "--timeout-s"),
    "demo --steps -1": (["demo", "--steps", "-1"], "--steps"),
    "demo --step-sleep inf": (["demo", "--step-sleep", "inf"], "--step-sleep"),
    "demo --train-timeout nan": (["demo", "--train-timeout", "nan"], "--train-timeout"),
}


@pytest.mark.parametrize("case", sorted(FLAG_CASES))
def test_hostile_numeric_flag(case: str, tmp_path: Path) -> None:
    argv, flag = FLAG_CASES[case]
    assert_clean_refusal(_hettrain(argv, tmp_path), flag)


# A job that fits nowhere, and whose search takes minutes to say so (found by the planner's fuzz
# test; tests/operator/test_planguard.py runs it through the operator's budget): 126 layers of
# one 8192-wide head pinned to ZB-H1 keep ~126 layers of activations on stage 0 at any depth.
SLOW_JOB = """\
apiVersion: hettrain.dev/v1alpha1
kind: HetTrainingJob
metadata: {name: slow}
spec:
  model: {layers: 126, hidden: 8192, heads: 1, seqLen: 8192, vocab: 256}
  training: {globalBatch: 1000000, steps: 1, precision: bf16, recompute: attention-free}
  parallelism: {schedule: zb-h1, cp: 2}
  data: {synthetic: true}
"""
SLOW_CLUSTER = """\
apiVersion: hettrain.dev/v1alpha1
kind: Cluster
metadata: {name: f}
datacenters: [{name: a}, {name: b}]
links: [{between: [a, b], bandwidthGbps: 10, latencyMs: 0}]
devices:
  - {name: X1, vendor: amd, bf16Tflops: 500, hbmGiB: 64, hbmTBps: 2, intraNodeGBps: 200,
     backend: nccl, efficiency: 0.5, fp32Tflops: 80}
pools:
  - {name: p0, datacenter: b, device: H100-SXM, nodes: 5000, gpusPerNode: 2, nicGbps: 1}
  - {name: p1, datacenter: a, device: X1, nodes: 5000, gpusPerNode: 4, nicGbps: 1}
"""


@pytest.mark.parametrize("command", ["plan", "validate", "simulate"])
def test_a_search_longer_than_the_timeout_is_stopped(command: str, tmp_path: Path) -> None:
    """Each command that plans stops the search at ``--timeout-s`` and exits 2 naming it."""
    job, cluster = _job(SLOW_JOB, tmp_path), tmp_path / "cluster.yaml"
    cluster.write_text(SLOW_CLUSTER)
    argv = ([command, str(job), "--cluster", str(cluster)] if command != "simulate" else
            [command, "--job", str(job), "--cluster", str(cluster)])
    t0 = time.monotonic()
    proc = _hettrain([*argv, "--timeout-s", "2"], tmp_path)
    assert_clean_refusal(proc, "longer than", "2", "--timeout-s")
    assert time.monotonic() - t0 < 60


def test_the_timeout_defaults_to_the_operators_budget(tmp_path: Path) -> None:
    """Without ``--timeout-s`` the limit is HETTRAIN_PLAN_TIMEOUT_SECONDS (the operator's)."""
    job, cluster = _job(SLOW_JOB, tmp_path), tmp_path / "cluster.yaml"
    cluster.write_text(SLOW_CLUSTER)
    argv = ["plan", str(job), "--cluster", str(cluster)]
    assert_clean_refusal(_hettrain(argv, tmp_path, HETTRAIN_PLAN_TIMEOUT_SECONDS="2"),
                          "--timeout-s 2 ")
    assert_clean_refusal(_hettrain(argv, tmp_path, HETTRAIN_PLAN_TIMEOUT_SECONDS="soon"),
                          "HETTRAIN_PLAN_TIMEOUT_SECONDS", "--timeout-s")


def test_a_plan_inside_its_timeout_is_printed(tmp_path: Path) -> None:
    proc = _hettrain(["plan", str(JOB), "--cluster", str(CLUSTER), "--timeout-s", "60"],
                     tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step" in proc.stdout


def test_a_bad_operator_worker_count_does_not_stop_the_cli(tmp_path: Path) -> None:
    """``HETTRAIN_PLAN_WORKERS`` is the operator's; the command line plans in-process."""
    proc = _hettrain(["plan", str(JOB), "--cluster", str(CLUSTER)], tmp_path,
                     HETTRAIN_PLAN_WORKERS="many", HETTRAIN_PLAN_MEMORY_MB="0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step" in proc.stdout


def test_exponent_floats_without_a_dot_are_numbers(tmp_path: Path) -> None:
    """``learningRate: 3e-4`` is a number (YAML 1.2, what kubectl reads), not "3e-4"."""
    job = _job(GOOD_JOB.replace("steps: 10", "steps: 10, learningRate: 3e-4"), tmp_path)
    proc = _hettrain(["plan", str(job), "--cluster", str(CLUSTER), "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["training"]["learning_rate"] == 3e-4


def test_a_zone_of_null_is_no_zone(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(GOOD_CLUSTER.replace("nicGbps: 100", "nicGbps: 100, zone: null"))
    proc = _hettrain(["plan", str(JOB), "--cluster", str(cluster)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_cluster_may_come_from_a_pipe(tmp_path: Path) -> None:
    """``--cluster -`` (stdin) and a FIFO are read like files (once planned, the same plan)."""
    want = _hettrain(["plan", str(JOB), "--cluster", str(CLUSTER), "--json"], tmp_path)
    piped = run_hettrain(["plan", JOB, "--cluster", "-", "--json"], tmp_path,
                         input=CLUSTER.read_text())
    assert piped.returncode == 0, piped.stderr[-2000:]
    assert json.loads(piped.stdout) == json.loads(want.stdout)


@pytest.mark.parametrize("flag", ["--cluster", "job"])
def test_a_file_name_too_long_is_refused(flag: str, tmp_path: Path) -> None:
    long = str(tmp_path / ("a" * 300 + ".yaml"))
    argv = (["plan", str(JOB), "--cluster", long] if flag == "--cluster" else
            ["plan", long, "--cluster", str(CLUSTER)])
    assert_clean_refusal(_hettrain(argv, tmp_path), "aaaa", "too long")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["plan", str(JOB), "--cluster", str(CLUSTER), "--out",
                                   "/dev/full"],
                                  ["plan", str(JOB), "--cluster", str(CLUSTER), "--json"],
                                  ["validate", str(JOB)]])
def test_a_full_disk_is_a_clean_refusal(argv: list[str], tmp_path: Path) -> None:
    with open("/dev/full", "w") as full:
        proc = run_hettrain(argv, tmp_path, stdout=full)
    assert_clean_refusal(proc, "cannot write", "No space left")
