"""``spec.training.attention``: flash (default, what the runtime trains) or eager (the s×s
scores materialised, as Megatron-LM 2021 ran Table 1): parsed and validated, priced as the
scores' memory traffic at the HBM bandwidth, refused by the runtime."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest
from tests.cli.test_cli import write_job

from hettrain import cli
from hettrain.api.spec import SpecError, parse_job_spec
from hettrain.planning import cost
from hettrain.planning.catalog import CATALOG
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import plan_job
from hettrain.planning.support import unsupported

ROOT = Path(__file__).resolve().parents[2]
BASE = {"model": {"layers": 2, "hidden": 1024, "heads": 16, "seqLen": 512, "vocab": 1000},
        "training": {"globalBatch": 8, "steps": 1}, "data": {"synthetic": True}}


def _spec(**training):
    return parse_job_spec({**BASE, "training": {**BASE["training"], **training}})


def test_attention_defaults_to_flash_and_names_its_field() -> None:
    assert _spec().training.attention == "flash"
    assert _spec(attention="eager").training.attention == "eager"
    with pytest.raises(SpecError) as err:
        _spec(attention="sdpa")
    assert err.value.field == "spec.training.attention"
    assert "flash, eager" in str(err.value)


def test_eager_attention_refuses_attention_free_and_auto_skips_it() -> None:
    """Eager attention produces no log-sum-exp for attention-free recompute to keep: pinned,
    the spec is refused naming the field; under auto that mode is not searched."""
    with pytest.raises(SpecError) as err:
        _spec(attention="eager", recompute="attention-free")
    assert err.value.field == "spec.training.recompute" and "attention: flash" in str(err.value)
    inv = load_cluster(ROOT / "examples/clusters/local-cpu.yaml")
    plan = plan_job("j", _spec(attention="eager", recompute="auto"), inv)
    assert plan.training.recompute != "attention-free"
    assert not any("attention-free" in n for n in plan.notes)


def _job_file(tmp_path: Path, attention: str) -> Path:
    """A tiny job manifest with ``spec.training.attention: attention``."""
    return write_job(tmp_path, f"{{globalBatch: 8, steps: 10, attention: {attention}}}")


def test_a_bad_attention_exits_2_naming_the_field(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = _job_file(tmp_path, "fused")
    code = cli.main(["validate", str(path)], out=io.StringIO())
    err = capsys.readouterr().err
    assert code == 2
    assert "spec.training.attention" in err and "flash, eager" in err


def test_planning_an_eager_job_in_the_cli_exits_2_naming_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``hettrain plan`` refuses what the runtime would refuse at start-up."""
    path = _job_file(tmp_path, "eager")
    code = cli.main(["plan", str(path), "--cluster",
                     str(ROOT / "examples/clusters/local-cpu.yaml")], out=io.StringIO())
    err = capsys.readouterr().err
    assert code == 2
    assert "plan.training.attention='eager'" in err and "spec.training.attention" in err


@pytest.mark.parametrize("recompute,forwards", [("none", 1), ("selective", 2), ("full", 2)])
def test_eager_score_bytes_hand_count(recompute: str, forwards: int) -> None:
    m = _spec().model  # 16 heads, s 512
    scores = 2 * 16 / 4 * 512 * 512  # microbatch 2, tp 4
    # fp16: forward 6 element accesses + 1 mask byte, backward 9 + 1 mask byte
    want = scores * (forwards * (6 * 2 + 1) + 9 * 2 + 1)
    assert cost.eager_score_bytes(m, 2, 4, recompute, 2) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("device", ["A100-80GB", "H200"])
def test_eager_adds_the_score_traffic_at_the_hbm_bandwidth(device: str) -> None:
    dev = CATALOG[device]
    flash, eager = _spec(recompute="full"), _spec(recompute="full", attention="eager")
    gap = (cost.layer_time_s(eager.model, eager.training, 2, 2, dev)
           - cost.layer_time_s(flash.model, flash.training, 2, 2, dev))
    assert gap == pytest.approx(cost.eager_score_bytes(flash.model, 2, 2, "full", 2)
                                / (dev.hbm_tbps * 1e12), rel=1e-9)
    # the root bound of the search stays a bound: eager only adds time
    assert gap > 0


def test_the_runtime_refuses_an_eager_plan_and_plans_the_same_layout_slower() -> None:
    inv = load_cluster(ROOT / "examples/clusters/local-cpu.yaml")
    pinned = {"parallelism": {"tp": 1, "pp": 1, "dp": 1}}
    flash = plan_job("j", parse_job_spec({**BASE, **pinned}), inv)
    eager = plan_job("j", parse_job_spec({**BASE, **pinned, "training": {
        **BASE["training"], "attention": "eager"}}), inv)
    assert eager.training.attention == "eager"
    assert eager.predicted.step_time_s > flash.predicted.step_time_s
    assert not any("attention" in e for e in unsupported(flash))
    refused = [e for e in unsupported(eager) if "attention" in e]
    assert refused and refused[0].startswith("plan.training.attention='eager'")
    # a plan written before the field loads as flash
    doc = dataclasses.asdict(flash.training)
    del doc["attention"]
    assert type(flash.training)(**doc).attention == "flash"
