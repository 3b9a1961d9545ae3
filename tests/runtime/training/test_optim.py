"""The stage optimizer and the training loop, single process: flat AdamW vs ``torch.optim.AdamW``
(with decay groups and global-norm clipping), the byte layout of each precision, bf16 / fp16 vs
the fp32 reference, fp16 overflow skipping, and the LR schedules vs their formulas."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from tests.runtime.training.plans import TINY, tiny_plan

from hettrain.api.spec import SpecError, TrainingSpec, parse_job_spec
from hettrain.runtime.data import microbatches
from hettrain.runtime.lr_schedule import lr_at
from hettrain.runtime.model import lm_loss, whole_model
from hettrain.runtime.optim import StageOptimizer, param_kinds
from hettrain.runtime.trainer import reference_losses

# bf16 keeps 8 mantissa bits: per-step losses of a 10-step run stay within 1% of fp32
BF16_RTOL = 1e-2


def _training(**kw) -> TrainingSpec:
    base = dict(global_batch=4, steps=6, precision="fp32", learning_rate=1e-2,
                lr_schedule="constant", grad_clip=0.0, weight_decay=0.05)
    return TrainingSpec(**{**base, **kw})


def _backward(model, step: int) -> None:
    for x, y in microbatches(3, step, dp=1, dp_index=0, micro_batch=2, num_microbatches=2,
                             seq_len=TINY.seq_len, vocab=TINY.vocab):
        (lm_loss(model(x), y) / 2).backward()


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_flat_adamw_equals_torch_adamw_with_decay_groups_and_clipping(clip):
    t = _training(grad_clip=clip)
    ours, ref = whole_model(TINY, 5), whole_model(TINY, 5)
    kinds = param_kinds(ref)
    decay = [p for n, p in ref.named_parameters() if kinds[n] in ("weights", "embeddings")]
    no_decay = [p for n, p in ref.named_parameters() if kinds[n] in ("norms", "biases")]
    assert decay and no_decay
    torch_opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2),
                                  eps=t.adam_eps, foreach=False)
    opt = StageOptimizer(ours, t)
    for step in range(t.steps):
        opt.zero_grad()
        torch_opt.zero_grad()
        _backward(ours, step)
        _backward(ref, step)
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip else math.inf)
        info = opt.step(step)
        torch_opt.step()
        assert info["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_chunked_adamw_update_is_bitwise_the_whole_slice_update(monkeypatch):
    """The denominator is computed UPDATE_CHUNK elements at a time (bounded transient memory):
    an odd chunk that splits parameters gives the same bits as one chunk over the slice."""
    import hettrain.runtime.optim as optim

    def train(chunk: int) -> list[torch.Tensor]:
        monkeypatch.setattr(optim, "UPDATE_CHUNK", chunk)
        model = whole_model(TINY, 5)
        opt = StageOptimizer(model, _training(grad_clip=0.5))
        for step in range(3):
            opt.zero_grad()
            _backward(model, step)
            opt.step(step)
        return [p.detach().clone() for p in model.parameters()]

    whole, chunked = train(1 << 30), train(7)
    init = [p.detach() for p in whole_model(TINY, 5).parameters()]
    assert all(not torch.equal(p, q) for p, q in zip(whole, init, strict=True))  # it trained
    for p, q in zip(whole, chunked, strict=True):
        assert torch.equal(p, q)


def test_norms_and_biases_excluded_embeddings_decayed_by_default():
    kinds = param_kinds(whole_model(TINY, 1))
    assert kinds["model.layers.0.input_layernorm.weight"] == "norms"
    assert kinds["model.layers.0.post_attention_layernorm.weight"] == "norms"
    assert kinds["model.norm.weight"] == "norms"
    assert kinds["model.embed_tokens.weight"] == "embeddings"
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "weights"
    assert "biases" not in kinds.values()  # the Llama block has none
    t = parse_job_spec({"model": {"preset": "gpt-tiny"},
                        "training": {"globalBatch": 8, "steps": 1}}).training
    assert (t.decay_norms, t.decay_biases, t.decay_embeddings) == (False, False, True)
    t = parse_job_spec({"model": {"preset": "gpt-tiny"}, "training": {
        "globalBatch": 8, "steps": 1, "weightDecayExclude": ["embeddings"]}}).training
    assert (t.decay_norms, t.decay_biases, t.decay_embeddings) == (True, True, False)


@pytest.mark.parametrize("precision,param_dtype,param_bytes", [
    ("fp32", torch.float32, 4), ("bf16", torch.bfloat16, 2), ("fp16", torch.float16, 2)])
def test_byte_layout_per_precision(precision, param_dtype, param_bytes):
    model = whole_model(TINY, 2)
    n = sum(p.numel() for p in model.parameters())
    opt = StageOptimizer(model, _training(precision=precision))
    assert {p.dtype for p in model.parameters()} == {param_dtype}
    assert opt.params_flat.numel() * opt.params_flat.element_size() == n * param_bytes
    assert opt.main_grad.dtype == torch.float32 and opt.main_grad.numel() == n
    assert opt.master.dtype == opt.exp_avg.dtype == opt.exp_avg_sq.dtype == torch.float32
    if precision == "fp32":  # the parameters are the master: no copy
        assert opt.master.data_ptr() == opt.params_flat.data_ptr()
    _backward(model, 0)
    # the post-accumulate hook folded every low-precision grad into main_grad and freed it
    assert all(p.grad is None for p in model.parameters())
    assert opt.main_grad.abs().sum() > 0


def test_bf16_and_fp16_track_the_fp32_reference():
    plan = tiny_plan([(0, 4, "a")], dp=2, steps=10)
    ref = reference_losses(plan, 10)
    assert ref[-1] < ref[0]
    for precision in ("bf16", "fp16"):
        low = replace(plan, training=replace(plan.training, precision=precision))
        got = reference_losses(low, 10)
        assert got != ref  # really a different precision
        for step, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert a == pytest.approx(b, rel=BF16_RTOL), (precision, step)


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    model = whole_model(TINY, 2)
    opt = StageOptimizer(model, _training(precision="fp16"))
    before = opt.params_flat.clone()
    scale = opt.loss_scale
    _backward(model, 0)
    opt.main_grad[3] = math.inf
    info = opt.step(0)
    assert info["skipped"] == 1.0 and opt.loss_scale == scale / 2
    assert torch.equal(opt.params_flat, before) and opt.step_count == 0
    _backward(model, 1)
    assert opt.step(1)["skipped"] == 0.0 and not torch.equal(opt.params_flat, before)


def test_lr_schedules_follow_their_formulas():
    t = _training(steps=100, learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1,
                  lr_schedule="cosine")
    assert [lr_at(t, s) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert lr_at(t, 10) == pytest.approx(1.0) and lr_at(t, 99) == pytest.approx(0.1)
    mid = 10 + 89 / 2
    assert lr_at(t, int(mid)) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (int(mid) - 10) / 89)))
    w = replace(t, lr_schedule="wsd", wsd_decay_fraction=0.2)  # 18 decay steps: 82..99
    assert lr_at(w, 50) == lr_at(w, 81) == 1.0
    assert lr_at(w, 82) == pytest.approx(1.0 - 0.9 / 18) and lr_at(w, 99) == pytest.approx(0.1)
    assert lr_at(replace(t, lr_schedule="constant"), 99) == 1.0


@pytest.mark.parametrize("training,field", [
    ({"minLrRatio": 2}, "minLrRatio"), ({"adamBetas": [0.9]}, "adamBetas"),
    ({"lrSchedule": "linear"}, "lrSchedule"), ({"validation": {"batches": 0}}, "batches"),
    ({"weightDecayExclude": ["layers"]}, "weightDecayExclude")])
def test_bad_loop_fields_name_the_field(training, field):
    with pytest.raises(SpecError, match=field):
        parse_job_spec({"model": {"preset": "gpt-tiny"},
                        "training": {"globalBatch": 8, "steps": 1, **training}})


def test_diloco_with_optimizer_sharding_is_refused_naming_the_field():
    with pytest.raises(SpecError, match=r"spec.training.optimizerSharding.*diloco"):
        parse_job_spec({"model": {"preset": "gpt-tiny"}, "crossDC": {"mode": "diloco"},
                        "training": {"globalBatch": 8, "steps": 1}})
    from hettrain.planning.support import unsupported
    plan = tiny_plan([(0, 4, "a")], dp=2, cross_dc={"mode": "diloco"},
                     optimizer_sharding=True)
    assert "plan.training.optimizer_sharding" in unsupported(plan)[0]
