"""``hettrain simulate`` through the real CLI entry point."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest

from hettrain.cli import main


def _run(argv: list[str]) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = main(["simulate", *argv])
    return code, buf.getvalue()


def test_llama3_scenario_json():
    code, out = _run(["--scenario", "llama3-16k", "--days", "10", "--json"])
    assert code == 0
    doc = json.loads(out)
    # full recompute; context parallelism at 8k tokens (4 ranks of 2,048 tokens, as NeMo's
    # Llama 3 70B recipe runs CP 2 at 8k) in place of TP 8: dp 16 x pp 64 x tp 4 x cp 4
    assert doc["gpus"] == 16640 and doc["full_plan"]["layout"] == "16x64x4 cp=4"
    assert doc["throughput_model"] == "planner"
    assert set(doc["policies"]) == {"restart", "replan", "wait-shrink"}
    for pol in doc["policies"].values():
        assert 0.8 < pol["ettr"] <= 1.0
        assert abs(sum(pol["hours"].values()) - 240.0) < 1e-6


def test_generate_with_job_table_and_png(tmp_path):
    png = tmp_path / "t.png"
    code, out = _run(["--generate", "1024:H100-SXM", "--job", "examples/jobs/llama3-405b-1k.yaml",
                      "--days", "3", "--policies", "restart,replan", "--seeds", "2",
                      "--repair-hours", "8", "--png", str(png)])
    assert code == 0, out
    assert "restart" in out and "replan" in out and "wait-shrink" not in out
    assert "hours by cause" in out and f"plot written to {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_replay_cli(tmp_path):
    code, out = _run(["--generate", "64:H100-SXM", "--job", "examples/jobs/llama3-8b-single-vendor"
                      ".yaml", "--trace", "examples/sim/trace-8-nodes.csv", "--days", "1",
                      "--json"])
    assert code == 0, out
    doc = json.loads(out)
    assert doc["trace"] == "examples/sim/trace-8-nodes.csv"
    assert doc["policies"]["restart"]["per_seed"][0]["interruptions"] == {"node": 2,
                                                                         "software": 1}


@pytest.mark.parametrize(("argv", "needle"), [
    (["--generate", "100:B200"], "--job"),
    (["--generate", "x:H100", "--job", "examples/jobs/llama3-405b-1k.yaml"], "--generate"),
    (["--generate", "1024:B200", "--job", "examples/jobs/llama3-405b-1k.yaml"], "catalog"),
    (["--scenario", "llama3-16k", "--policies", "restart,yolo"], "--policies"),
    (["--scenario", "llama3-16k", "--days", "0"], "--days"),
    (["--scenario", "llama3-16k", "--throughput", "fast"], "--throughput"),
    (["--scenario", "llama3-16k", "--failures", "nope.yaml"], "nope.yaml"),
    (["--cluster", "nope.yaml", "--job", "examples/jobs/llama3-405b-1k.yaml"], "nope.yaml"),
    (["--generate", "64:H100-SXM", "--job", "nope-job.yaml"], "nope-job.yaml"),
    (["--scenario", "llama3-16k", "--spare-nodes", "3"], "--spare-nodes"),
])
def test_bad_input_exits_2_with_one_line(argv, needle, capsys):
    code, _ = _run(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    out = capsys.readouterr().out
    for flag in ("--scenario", "--generate", "--trace", "--policies", "--seeds", "--png",
                 "--json", "--failures", "--throughput"):
        assert flag in out


def test_svg_and_scaled_throughput(tmp_path):
    svg = tmp_path / "t.svg"
    code, out = _run(["--generate", "1024:H100-SXM", "--job", "examples/jobs/llama3-405b-1k.yaml",
                      "--days", "2", "--policies", "replan", "--throughput", "scaled:2",
                      "--svg", str(svg)])
    assert code == 0, out
    assert "throughput model: scaled:2" in out
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and 'id="throughput-replan"' in text
