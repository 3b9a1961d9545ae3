"""Training on the shipped corpus: the loss falls from ln(vocab), a multi-process pipelined
run on prepared data equals the single-process reference, and a resume on another layout
continues with exactly the tokens the reference saw."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from tests.runtime.training.plans import tiny_plan

from hettrain.api.spec import ModelSpec
from hettrain.runtime.launch import launch_local, wait_all
from hettrain.runtime.trainer import reference_losses

pytestmark = pytest.mark.slow
RTOL = 1e-5  # fp32 on CPU: only the summation order of the DP all-reduce differs
MODEL = ModelSpec(layers=2, hidden=32, heads=4, seq_len=32, vocab=2048, ffn_hidden=64,
                  kv_heads=2, name="opticks-test", gated_mlp=True)


def _plan(opticks_set, splits, dp, steps, **kw):
    plan = tiny_plan(splits, dp, steps=steps, model=MODEL, lr=1e-2, lr_schedule="constant", **kw)
    return replace(plan, data={"uri": str(opticks_set)})


def _losses(path):
    return {d["step"]: d["loss"] for d in map(json.loads, path.read_text().splitlines())}


def _logs(workdir):
    return "\n".join(p.read_text()[-2000:] for p in sorted(workdir.glob("rank-*.log")))


def test_pipelined_run_on_real_tokens_matches_the_reference_and_resumes_on_another_layout(
        opticks_set, tmp_path):
    steps = 6
    ref = reference_losses(_plan(opticks_set, [(0, 1, "a"), (1, 2, "b")], 2, steps,
                                 micro_batch=2, num_microbatches=2), steps)
    assert ref[0] == pytest.approx(math.log(MODEL.vocab), rel=0.05)  # untrained: uniform
    assert ref[-1] < ref[0] - 0.5  # it learns the text

    # 2 stages x 2 replicas, 2 microbatches of 2 per replica; checkpoint after step 3
    ck = tmp_path / "ckpt"
    first = _plan(opticks_set, [(0, 1, "a"), (1, 2, "b")], 2, 3, micro_batch=2,
                  num_microbatches=2)
    env = {"HETTRAIN_CHECKPOINT_URI": f"file://{ck}", "HETTRAIN_CHECKPOINT_INTERVAL": "3",
           "HETTRAIN_METRICS_PORT": "0", "HETTRAIN_LOSS_LOG": str(tmp_path / "first.jsonl")}
    assert wait_all(launch_local(first, tmp_path / "run1", env), 180) == [0] * 4, \
        _logs(tmp_path / "run1")
    got = _losses(tmp_path / "first.jsonl")
    assert sorted(got) == [0, 1, 2]
    for step in range(3):
        assert got[step] == pytest.approx(ref[step], rel=RTOL), step

    # resume on 1 replica of 2 stages with 8 microbatches of 1: the same global batch of 8
    second = _plan(opticks_set, [(0, 1, "a"), (1, 2, "b")], 1, steps, micro_batch=1,
                   num_microbatches=8)
    env.update({"HETTRAIN_RESUME": "1", "HETTRAIN_LOSS_LOG": str(tmp_path / "second.jsonl")})
    assert wait_all(launch_local(second, tmp_path / "run2", env), 180) == [0, 0], \
        _logs(tmp_path / "run2")
    got = _losses(tmp_path / "second.jsonl")
    assert sorted(got) == [3, 4, 5]
    for step in range(3, steps):
        assert got[step] == pytest.approx(ref[step], rel=RTOL), step
