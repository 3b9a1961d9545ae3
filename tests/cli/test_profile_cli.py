"""``hettrain profile`` for real: the runtime's block runs on this machine's device, the profile
it writes parses, and ``hettrain plan --profile`` uses it; bad input exits 2 with one line."""

from __future__ import annotations

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


def test_profile_writes_a_profile_the_planner_uses(tmp_path, capsys) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    out = tmp_path / "cpu.yaml"
    assert main(["profile", str(job), "--device-name", "CPU", "--out", str(out),
                 "--micro-batches", "1,2", "--repeats", "1"]) == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["kind"] == "DeviceProfile" and doc["version"] == 1 and doc["device"] == "CPU"
    assert [r["microBatch"] for r in doc["layer"]] == [1, 2]
    assert all(r["forwardS"] > 0 and r["backwardS"] > 0 for r in doc["layer"])
    assert doc["software"]["torch"]
    prof = load_profile(out)
    assert prof.beta > 0 and prof.alpha >= 0
    # the planner takes it (the CPU pool's layer times are now the measured ones)
    plan_json = tmp_path / "plan.json"
    assert main(["plan", str(job), "--cluster", CLUSTER, "--profile", str(out), "--json",
                 "--out", str(plan_json)]) == 0
    assert plan_json.read_text().startswith("{")


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
