"""Uneven data parallelism (``Plan.short_replicas``): a global batch that ``dp`` does not divide.

The last ``short_replicas`` replicas run one microbatch fewer; each rank weights its
microbatches by ``dp / N`` so the DP average is the global batch's mean. Real gloo processes
must reproduce the single-process reference (losses, validation losses, the updated weights,
and after resuming an even layout's checkpoint), and the plan's rows must cover the global
batch exactly once.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from tests.runtime.checkpoints import rewind
from tests.runtime.training.plans import tiny_plan, with_cp
from tests.runtime.training.runs import run_losses, sgd_run_and_reference

from hettrain.api.spec import MODEL_PRESETS, ModelSpec
from hettrain.planning.plan import Plan
from hettrain.planning.support import uneven_dp_errors, unsupported
from hettrain.runtime import checkpoint as ckpt
from hettrain.runtime.dataset import open_data
from hettrain.runtime.model import whole_model
from hettrain.runtime.trainer import reference_losses, replica_block, validation_batches

RTOL = 1e-5  # fp32 on CPU: only summation orders differ (as the other parallel runtime tests)
LLAMA = ModelSpec(name="llama-tiny", **{**MODEL_PRESETS["llama-tiny"], "seq_len": 32})


def uneven(plan: Plan, short: int) -> Plan:
    """``plan`` with its last ``short`` replicas one microbatch short (global batch to match)."""
    gb = plan.micro_batch * (plan.dp * plan.num_microbatches - short)
    return replace(plan, short_replicas=short,
                   training=replace(plan.training, global_batch=gb))


def test_replica_shares_cover_the_global_batch_once():
    plan = uneven(tiny_plan([(0, 4, "a")], dp=3, micro_batch=1, num_microbatches=3), 1)
    assert plan.global_batch == plan.total_microbatches == 8
    assert [plan.replica_microbatches(d) for d in range(3)] == [3, 3, 2]
    assert [plan.replica_row_offset(d) for d in range(3)] == [0, 3, 6]
    even = tiny_plan([(0, 4, "a")], dp=3, micro_batch=2, num_microbatches=2)
    assert [even.replica_microbatches(d) for d in range(3)] == [2, 2, 2]
    assert [even.replica_row_offset(d) for d in range(3)] == [0, 4, 8]
    data = open_data(plan.data, seed=plan.training.seed, seq_len=plan.model.seq_len,
                     vocab=plan.model.vocab)
    x, y = data.global_batch(plan.training.seed, 5, plan.global_batch)
    rows = [b for d in range(plan.dp) for b in replica_block(plan, x, y, d)]
    assert len(rows) == 8
    torch.testing.assert_close(torch.cat([r[0] for r in rows]), x, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([r[1] for r in rows]), y, rtol=0, atol=0)
    val = [len(validation_batches(replace(plan, training=replace(
        plan.training, validation_batches=2)), data, d)) for d in range(3)]
    assert val == [6, 6, 4]
    with pytest.raises(ValueError, match="dp_index=3"):
        replica_block(plan, x, y, 3)


def test_plan_json_round_trip_and_runtime_rules():
    plan = uneven(tiny_plan([(0, 2, "a"), (2, 4, "b")], dp=3, micro_batch=1,
                            num_microbatches=3, schedule="zb-h1"), 2)
    assert Plan.from_json(plan.to_json()) == plan
    assert json.loads(plan.to_json())["short_replicas"] == 2
    assert "short_replicas" not in json.loads(replace(plan, short_replicas=0).to_json())
    assert uneven_dp_errors(plan) == [] and unsupported(plan) == []
    bad = {
        "must be in [0, dp=3)": replace(plan, short_replicas=3),
        "would run no microbatch": replace(plan, num_microbatches=1, short_replicas=1),
        "with schedule interleaved": replace(plan, schedule="interleaved", virtual_stages=2),
        "sharding=gradients": replace(plan, schedule="1f1b", training=replace(
            plan.training, sharding="gradients")),
        "sharding=full": replace(plan, schedule="1f1b", training=replace(
            plan.training, sharding="full")),
        "cross_dc.mode=diloco": replace(plan, cross_dc={"mode": "diloco"}, training=replace(
            plan.training, sharding="none", optimizer_sharding=False)),
    }
    for message, p in bad.items():
        errors = uneven_dp_errors(p)
        assert any(message in e and "plan.short_replicas" in e for e in errors), (message, errors)


CASES = {
    # 3 replicas of a 2-stage pipeline, 8 sequences: 3 + 3 + 2 microbatches, ZeRO-1
    "pp2-zb-h1": (dict(splits=[(0, 2, "a"), (2, 4, "b")], dp=3, num_microbatches=3,
                       schedule="zb-h1"), 1, 1),
    # 3 replicas, 7 sequences (3 + 2 + 2), 1F1B, validation on the uneven rows, grads clipped
    "pp2-1f1b-val": (dict(splits=[(0, 3, "a"), (3, 4, "b")], dp=3, num_microbatches=3,
                          validation_interval=2, validation_batches=2, grad_clip=0.05), 2, 1),
    # context parallelism 2 inside each of 3 replicas (5 sequences: 2 + 2 + 1), one stage
    "cp2": (dict(splits=[(0, 4, "a")], dp=3, num_microbatches=2), 1, 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_uneven_replicas_match_the_single_process_reference(tmp_path, case):
    kw, short, cp = CASES[case]
    plan = uneven(with_cp(tiny_plan(steps=4, micro_batch=1, model=LLAMA, lr=0.1, **kw), cp),
                  short)
    assert unsupported(plan) == []
    run = sgd_run_and_reference(plan, tmp_path)
    got, ref, final, validation, ck = run.got, run.ref, run.final, run.validation, run.ckpt
    assert sorted(got) == list(range(plan.training.steps))
    for step, want in enumerate(ref):
        assert got[step] == pytest.approx(want, rel=RTOL), (step, got, ref)
    if plan.training.grad_clip:
        norms = [json.loads(line)["grad_norm"]
                 for line in (tmp_path / "loss.jsonl").read_text().splitlines()]
        assert min(norms) > plan.training.grad_clip  # every step clipped by the global norm
    if plan.training.validation_interval:
        assert sorted(validation) == [2, 4]
        rec = json.loads((tmp_path / "summary" / "rank-0.json").read_text())
        for done, want in validation.items():
            assert rec["validation"][str(done)] == pytest.approx(want, rel=RTOL), done
    model = whole_model(LLAMA, seed=0)
    targets = ckpt.job_state(model, None, for_save=False)
    ckpt.load(ckpt.CheckpointStore.open(f"file://{ck}"), plan.training.steps, targets,
              model=ckpt.model_meta(LLAMA))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), final[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_a_checkpoint_resumes_onto_uneven_replicas(tmp_path):
    """What a repair may now plan: 2 even replicas (4 + 4 sequences, ZeRO-1 AdamW) write a
    checkpoint at step 2; 3 uneven replicas (3 + 3 + 2) resume from it, the optimizer state
    resharded from halves to thirds, and train on as the single-process reference does."""
    steps = 4
    first = tiny_plan([(0, 2, "a"), (2, 4, "b")], dp=2, steps=steps, micro_batch=1,
                      num_microbatches=4, model=LLAMA)
    second = uneven(tiny_plan([(0, 3, "a"), (3, 4, "b")], dp=3, steps=steps, micro_batch=1,
                              num_microbatches=3, model=LLAMA), 1)
    assert first.global_batch == second.global_batch == 8
    ck = tmp_path / "ckpt"
    env = {"HETTRAIN_CHECKPOINT_URI": f"file://{ck}", "HETTRAIN_CHECKPOINT_INTERVAL": "2",
           "HETTRAIN_METRICS_PORT": "0"}
    before = run_losses(first, tmp_path / "run1", env, tmp_path / "before.jsonl")
    rewind(ck, 2)  # as if the even job had died right after checkpoint 2
    after = run_losses(second, tmp_path / "run2", {**env, "HETTRAIN_RESUME": "1"},
                       tmp_path / "after.jsonl")
    ref = reference_losses(second, steps)
    assert sorted(before) == [0, 1, 2, 3] and sorted(after) == [2, 3]
    before = {k: v for k, v in before.items() if k < 2}
    for step, got in {**before, **after}.items():
        assert got == pytest.approx(ref[step], rel=1e-4), (step, before, after, ref)
