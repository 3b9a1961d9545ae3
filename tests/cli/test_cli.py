"""The ``hettrain`` CLI, in-process (``main(argv)``) and as the installed script."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from hettrain import cli
from hettrain.api.spec import parse_job_manifest
from hettrain.planning.inventory import load_cluster
from hettrain.planning.plan import Plan
from hettrain.planning.planner import plan_job

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "examples/jobs/gpt-tiny-local.yaml"
CLUSTER = ROOT / "examples/clusters/local-cpu.yaml"
SCRIPT = Path(sys.executable).with_name("hettrain")


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the CLI in-process; (exit code, stdout, stderr)."""
    buf = io.StringIO()
    code = cli.main([str(a) for a in argv], out=buf)
    captured = capsys.readouterr()
    return code, buf.getvalue() + captured.out, captured.err


def expected_plan(job: Path = JOB, cluster: Path = CLUSTER) -> Plan:
    name, spec = parse_job_manifest(yaml.safe_load(job.read_text()))
    return plan_job(name, spec, load_cluster(cluster))


def write_job(tmp_path: Path, training: str = "{globalBatch: 8, steps: 10}",
              extra: str = "", name: str = "job.yaml", data: str = "{synthetic: true}") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(f"""\
        apiVersion: hettrain.dev/v1alpha1
        kind: HetTrainingJob
        metadata: {{name: tiny}}
        spec:
          model: {{preset: gpt-tiny}}
          training: {training}
        """) + (f"  data: {data}\n" if data else "") + extra)
    return path


def test_plan_json_is_the_planners_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["plan", JOB, "--cluster", CLUSTER, "--json"], capsys)
    assert code == 0, err
    plan = Plan.from_json(out)
    assert plan == expected_plan()
    assert out == expected_plan().to_json(indent=2) + "\n"  # nothing but the JSON


def test_plan_table_lists_stages_summary_and_notes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["plan", JOB, "--cluster", CLUSTER], capsys)
    assert code == 0, err
    plan = expected_plan()
    assert f"Plan for {plan.job}" in out
    for s in plan.stages:
        assert s.device in out and s.pools[0] in out
    for key in ("world size", "DP×PP×TP", "microbatch", "schedule", "training", "step time",
                "tokens/s", "MFU", "cross-DC / step"):
        assert key in out
    assert plan.schedule in out and plan.fingerprint() in out
    assert f"sharding {plan.training.sharding}" in out
    for note in plan.notes:
        assert note in out


def test_plan_out_and_picture_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    svg, out_file = tmp_path / "plan.svg", tmp_path / "plan.json"
    code, out, err = run(["plan", JOB, "--cluster", CLUSTER, "--json", "--out", out_file,
                          "--svg", svg], capsys)
    assert code == 0, err
    assert out == ""
    plan = Plan.from_json(out_file.read_text())
    ids = [el.get("id", "") for el in ET.parse(svg).getroot().iter()]
    assert sum(i.startswith("gpu-r") for i in ids) == plan.world_size
    bars = sum(i.startswith("gantt-") for i in ids)
    # F and B per model chunk, and W where the schedule splits the backward (zero-bubble)
    split = plan.schedule in ("zb-h1", "interleaved-zb")
    per_microbatch_stage = (3 if split else 2) * plan.virtual_stages
    assert bars == per_microbatch_stage * plan.pp * plan.num_microbatches

    png = tmp_path / "plan.png"
    code, out, err = run(["plan", JOB, "--cluster", CLUSTER, "--png", png], capsys)
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"picture written to {png}" in out


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda t: ["plan", t / "nope.yaml", "--cluster", CLUSTER], "nope.yaml: no such file"),
        (lambda t: ["plan", JOB, "--cluster", t / "none.yaml"], "none.yaml: no such cluster"),
        (lambda t: ["plan", write_job(t, "{globalBatch: 8, steps: [1"), "--cluster", CLUSTER],
         "invalid YAML"),
        (lambda t: ["plan", write_job(t, "{globalBatch: 0, steps: 10}"), "--cluster", CLUSTER],
         "spec.training.globalBatch: must be an integer >= 1 (got 0)"),
        (lambda t: ["plan", write_job(t, "{globalBatch: 8, stpes: 10}"), "--cluster", CLUSTER],
         "spec.training.steps: is required"),
        (lambda t: ["plan", write_job(t, extra="  placement: {vendors: [huawei]}\n"),
                    "--cluster", CLUSTER], "no plan (PlanFailed)"),
        (lambda t: ["plan", write_job(t, extra="---\nkind: Other\n"), "--cluster", CLUSTER],
         "holds 2 YAML documents"),
        (lambda t: ["plan", JOB, "--cluster", JOB], "kind"),
        (lambda t: ["plan", write_job(t, data=""), "--cluster", CLUSTER],
         "spec.data: is required: name the training tokens with uri"),
        (lambda t: ["validate", write_job(t, data="")], "synthetic: true for generated tokens"),
    ],
    ids=["missing-job", "missing-cluster", "bad-yaml", "bad-field", "typo-field", "no-plan",
         "two-docs", "job-as-cluster", "no-data", "validate-no-data"],
)
def test_bad_input_is_one_clear_line_and_exit_2(tmp_path: Path, make_args, message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(make_args(tmp_path), capsys)
    assert code == 2
    assert message in err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and out == ""


def test_bad_yaml_names_line_and_column(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = write_job(tmp_path, "{globalBatch: 8, steps: [1")
    code, _, err = run(["validate", path], capsys)
    assert code == 2
    assert f"{path}:7:" in err  # the unclosed flow sequence is reported at the end of line 6


def test_validate_reports_every_bad_document(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    good = write_job(tmp_path, name="good.yaml").read_text()
    bad_batch = good.replace("globalBatch: 8", "globalBatch: -1")
    bad_kind = good.replace("kind: HetTrainingJob", "kind: Job")
    multi = tmp_path / "multi.yaml"
    second_good = good.replace("{name: tiny}", "{name: tiny2}")
    multi.write_text("---\n".join([good, bad_batch, second_good, bad_kind]))
    code, out, err = run(["validate", multi], capsys)
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 2
    assert f"{multi}[2]: spec.training.globalBatch:" in lines[0]
    assert f"{multi}[4]: kind: must be HetTrainingJob" in lines[1]
    assert out.splitlines() == [f"OK {multi}[1] tiny", f"OK {multi}[3] tiny2"]


def test_validate_with_cluster_also_plans(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["validate", JOB, "--cluster", CLUSTER], capsys)
    assert code == 0, err
    plan = expected_plan()
    assert out.startswith(f"OK {JOB}[1] {plan.job}: DP×PP×TP")
    assert f"on {plan.world_size} GPUs" in out

    unplannable = write_job(tmp_path, extra="  placement: {vendors: [huawei]}\n")
    code, out, err = run(["validate", unplannable, "--cluster", CLUSTER], capsys)
    assert code == 2
    assert "no plan (PlanFailed)" in err and "spec.placement" in err


@pytest.mark.parametrize("command", ["plan", "validate", "simulate", "demo", None])
def test_help_for_every_subcommand(command: str | None,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    argv = ([command] if command else []) + ["--help"]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hettrain")
    if command == "plan":
        for option in ("--cluster", "--json", "--exhaustive", "--svg", "--png", "--out"):
            assert option in out
    if command is None:
        for name in ("plan", "validate", *cli.EXTERNAL_COMMANDS):
            assert name in out


def test_hooked_subcommand_dispatches_to_its_module(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "hettrain_hook_probe.py").write_text(textwrap.dedent("""\
        def add_arguments(parser):
            parser.add_argument("--steps", type=int, required=True)

        def run(args):
            print(f"ran {args.steps} steps")
            return 3
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.EXTERNAL_COMMANDS, "probe",
                        cli.ExternalCommand("hettrain_hook_probe", "probe hook", "viz"))
    code, out, err = run(["probe", "--steps", "7"], capsys)
    assert (code, out) == (3, "ran 7 steps\n"), err


def test_missing_hook_module_is_a_clear_message(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(cli.EXTERNAL_COMMANDS, "later",
                        cli.ExternalCommand("hettrain.not_built_yet", "later", "viz"))
    code, _out, err = run(["later", "--anything"], capsys)
    assert code == 2
    assert err == ("error: 'hettrain later' is not available in this build "
                   "(module hettrain.not_built_yet is missing)\n")


def test_cli_import_pulls_no_kubernetes_client() -> None:
    code = ("import sys, hettrain.cli as c; c.build_parser(['plan']); "
            "bad = [m for m in ('kopf', 'kubernetes', 'torch') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_installed_script_plans_the_example(tmp_path: Path) -> None:
    assert SCRIPT.exists(), f"{SCRIPT} missing: run make venv"
    proc = subprocess.run([SCRIPT, "plan", JOB, "--cluster", CLUSTER, "--json"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert Plan.from_json(proc.stdout) == expected_plan()

    proc = subprocess.run([SCRIPT, "plan", tmp_path / "missing.yaml", "--cluster", CLUSTER],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == f"error: {tmp_path / 'missing.yaml'}: no such file; check the path\n"
