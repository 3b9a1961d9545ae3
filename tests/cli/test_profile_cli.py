"""``hettrain profile`` for real: the runtime's block runs on this machine's device and two local
ranks time their transfers, the profile it writes parses, and ``hettrain plan --profile`` uses
it; bad input exits 2 with one line."""

from __future__ import annotations

import json

import yaml

from hettrain.cli import main
from hettrain.planning.profiles import load_profile

JOB = """apiVersion: hettrain.dev/v1alpha1
kind: HetTrainingJob
metadata: {name: p}
spec:
  model: {preset: gpt-tiny}
  training: {globalBatch: 8, steps: 1, precision: fp32, recompute: none}
  data: {synthetic: true}
"""
CLUSTER = "examples/clusters/local-cpu.yaml"
CPU_CLUSTER = """apiVersion: hettrain.dev/v1alpha1
kind: Cluster
metadata: {name: one-host}
datacenters: [{name: dc}]
pools: [{name: cpu, datacenter: dc, device: CPU, nodes: 1, gpusPerNode: 2, nicGbps: 10}]
"""


def test_profile_writes_a_profile_the_planner_uses(tmp_path, capsys) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    out = tmp_path / "cpu.yaml"
    assert main(["profile", str(job), "--device-name", "CPU", "--out", str(out),
                 "--micro-batches", "1,2", "--repeats", "1"]) == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["kind"] == "DeviceProfile" and doc["version"] == 2 and doc["device"] == "CPU"
    assert doc["precision"] == "fp32"  # the job's
    assert [r["microBatch"] for r in doc["layer"]] == [1, 2]
    assert [r["microBatch"] for r in doc["stage"]] == [1, 2]  # the runtime's stage
    assert all(r[k] > 0 for r in doc["layer"]
               for k in ("forwardS", "backwardS", "selectiveS", "fullS", "bS", "wS"))
    assert doc["software"]["torch"]
    # two local ranks timed the runtime's p2p and gloo's all-reduce, small to large messages
    comm = doc["comm"]
    assert comm["ranks"] == 2 and comm["backend"] == "gloo"
    for kind in ("p2p", "allReduce"):
        sizes = [r["bytes"] for r in comm[kind]]
        assert sizes == sorted(sizes) and sizes[0] == 4096 and len(sizes) >= 3
        assert all(r["seconds"] > 0 for r in comm[kind])
    prof = load_profile(out)
    assert prof.beta > 0 and prof.alpha >= 0
    assert prof.precision == "fp32" and [m for m, _, _ in prof.recompute] == ["selective", "full"]
    assert prof.weight_grad is not None and prof.zb_bubble_ratio(1, "none") is not None
    # the two ranks also timed the block sharded at tp 2 (runtime/tp_profile.py)
    assert doc["tp"][0]["tp"] == 2 and [r["microBatch"] for r in doc["tp"][0]["layer"]] == [1, 2]
    assert prof.measured_tp(2) is not None
    assert prof.comm is not None and prof.comm.p2p_bytes_per_s > 0
    assert prof.comm.bus_bytes_per_s > 0 and prof.comm.ring_step_latency_s >= 0
    # the planner takes it (the CPU pool's layer times and links are now the measured ones)
    plan_json = tmp_path / "plan.json"
    assert main(["plan", str(job), "--cluster", CLUSTER, "--profile", str(out), "--json",
                 "--out", str(plan_json)]) == 0
    assert plan_json.read_text().startswith("{")
    cpu_only = tmp_path / "cpu-cluster.yaml"
    cpu_only.write_text(CPU_CLUSTER)
    assert main(["plan", str(job), "--cluster", str(cpu_only), "--profile", str(out), "--json",
                 "--out", str(plan_json)]) == 0
    notes = json.loads(plan_json.read_text())["notes"]
    assert any("collectives inside a node of CPU from device profiles" in n for n in notes)
    assert any("stage machinery of CPU" in n for n in notes)


def _profile_without_comm(tmp_path, job_text: str, micro_batches: str):
    """``hettrain profile --no-comm`` of ``job_text``: (the job file, the profile file)."""
    job = tmp_path / "job.yaml"
    job.write_text(job_text)
    out = tmp_path / "cpu.yaml"
    assert main(["profile", str(job), "--device-name", "CPU", "--out", str(out),
                 "--micro-batches", micro_batches, "--repeats", "1", "--no-comm"]) == 0
    return job, out


def test_profile_without_comm(tmp_path) -> None:
    _, out = _profile_without_comm(tmp_path, JOB, "1")
    assert "comm" not in yaml.safe_load(out.read_text())
    assert load_profile(out).comm is None
    assert load_profile(out).tp_layers == ()  # no ranks: no sharded layer either


def test_profile_bad_input_exits_2(tmp_path, capsys) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: DeviceProfile\nversion: 1\n")
    code = main(["plan", str(job), "--cluster", CLUSTER, "--profile", str(bad)])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --profile {bad}.device: is required") and "\n" not in err
    code = main(["profile", str(job), "--device-name", "CPU", "--out", str(tmp_path / "x"),
                 "--micro-batches", "0"])
    assert code == 2  # argparse's error: one line, exit 2 (cli.main)
    err = capsys.readouterr().err.strip()
    assert "give positive integers" in err and "\n" not in err


BF16_JOB = JOB.replace("precision: fp32", "precision: bf16")


def test_a_profile_serves_plans_of_its_own_precision_only(tmp_path) -> None:
    """A bf16 job is profiled in bf16, and only a 2-byte plan takes its layer times."""
    job, out = _profile_without_comm(tmp_path, BF16_JOB, "1,2")
    assert yaml.safe_load(out.read_text())["precision"] == "bf16"
    cpu_only = tmp_path / "cpu-cluster.yaml"
    cpu_only.write_text(CPU_CLUSTER)
    fp32_job = tmp_path / "fp32.yaml"
    fp32_job.write_text(JOB)
    notes = {}
    for name, path in (("bf16", job), ("fp32", fp32_job)):
        plan_json = tmp_path / f"{name}.json"
        assert main(["plan", str(path), "--cluster", str(cpu_only), "--profile", str(out),
                     "--json", "--out", str(plan_json)]) == 0
        notes[name] = " ".join(json.loads(plan_json.read_text())["notes"])
    assert "layer times of CPU from device profiles" in notes["bf16"]
    assert "layer times of CPU from device profiles" not in notes["fp32"]
