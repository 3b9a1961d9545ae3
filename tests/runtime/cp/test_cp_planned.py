"""A context-parallel plan written by the PLANNER (``spec.parallelism.cp: 2``) runs in the runtime
on real gloo processes and matches the single-process reference loss: the plan's ``cp``
coordinates (``planner._place``) are what ``context_parallel.comm_view`` expects."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from tests.runtime.cp.test_cp_training import RTOL, _run, _same_weights_across_cp

from hettrain.api.spec import parse_job_manifest
from hettrain.planning.inventory import load_cluster
from hettrain.planning.planner import plan_job
from hettrain.planning.support import unsupported
from hettrain.runtime.trainer import reference_losses

ROOT = Path(__file__).resolve().parents[3]


def _planned(cp: int, steps: int):
    doc = yaml.safe_load((ROOT / "examples/jobs/gpt-tiny-local.yaml").read_text())
    doc["spec"]["parallelism"] = {"cp": cp}
    doc["spec"]["placement"] = {"pools": ["cpu-a"]}  # two one-GPU nodes: dp=1 × cp=2
    name, spec = parse_job_manifest(doc)
    spec = replace(spec, training=replace(spec.training, steps=steps))
    return plan_job(name, spec, load_cluster(ROOT / "examples/clusters/local-cpu.yaml"))


def test_planned_cp2_plan_has_the_runtimes_coordinates():
    plan = _planned(2, 4)
    assert [s.cp for s in plan.stages] == [2] * plan.pp
    assert plan.world_size == plan.dp * sum(s.tp * s.cp for s in plan.stages) == 2
    assert sorted((r.stage, r.dp, r.tp, r.cp) for r in plan.ranks) == [(0, 0, 0, 0),
                                                                         (0, 0, 0, 1)]
    assert unsupported(plan) == []
    assert any("cp=2" in n for n in plan.notes)


@pytest.mark.slow
def test_planned_cp2_plan_trains_like_the_reference(tmp_path):
    steps = 4
    plan = _planned(2, steps)
    got, sums = _run(tmp_path, plan)
    ref = reference_losses(plan, steps)
    assert sorted(got) == list(range(steps))
    for step, want in enumerate(ref):
        assert got[step] == pytest.approx(want, rel=RTOL), step
    _same_weights_across_cp(plan, sums)
