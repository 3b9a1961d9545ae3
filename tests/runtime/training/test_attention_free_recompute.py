"""Attention-free recompute (``recompute: attention-free``): the backward re-runs every op of a
layer except the attention kernel, whose outputs the forward keeps.

Checked here: the attention kernel runs once per layer and microbatch (as without recompute;
``full`` and ``selective`` run it twice); the bytes a stage keeps are full recompute's plus
exactly the attention output and its fp32 log-sum-exp per layer and microbatch in flight
(measured by ``runtime.memory``); gradients are identical to ``none`` in
``test_llama_vs_hf.py`` (one process, TP over two) and ``tests/runtime/cp/test_cp_grads.py``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tests.runtime.training.plans import TINY, tiny_plan

from hettrain.api.spec import RECOMPUTE_MODES
from hettrain.runtime.memory import measure_stage
from hettrain.runtime.model import AttentionKernelRuns, whole_model

MODEL = replace(TINY, layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=256, seq_len=512,
                vocab=512, gated_mlp=True)


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_attention_runs_once_per_layer_unless_the_mode_recomputes_it(mode):
    model = whole_model(MODEL, seed=1, recompute=mode)
    tokens = torch.randint(0, MODEL.vocab, (2, 64), generator=torch.Generator().manual_seed(0))
    with AttentionKernelRuns() as runs:
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    runs_per_layer = 2 if mode in ("selective", "full") else 1
    assert runs.count == runs_per_layer * MODEL.layers


@pytest.mark.parametrize("tp", [1, 2])
def test_a_stage_keeps_full_recomputes_bytes_plus_the_attention_outputs(tp):
    """Stage 0 of a pp 2 1F1B plan holds 2 microbatches in flight, stage 1 one; each of its 2
    layers keeps (beyond full recompute's layer input) this TP rank's heads of the attention
    output (plan precision) and their fp32 log-sum-exp, for every token."""
    plans = {mode: tiny_plan([(0, 2, "a"), (2, 4, "b")], dp=1, model=MODEL, micro_batch=1,
                             num_microbatches=4, precision="bf16", recompute=mode, tp=tp)
             for mode in ("none", "attention-free", "full")}
    s, b, h, a = MODEL.seq_len, 1, MODEL.hidden, MODEL.heads
    per_layer = s * b * (2 * h + 4 * a) // tp
    for stage, in_flight in ((0, 2), (1, 1)):
        got = {mode: measure_stage(plan, stage) for mode, plan in plans.items()}
        free, full = got["attention-free"], got["full"]
        assert free.working == full.working > 0  # the re-run layer: the same forward
        assert free.activations - full.activations == 2 * in_flight * per_layer
        assert free.activations < got["none"].activations


def test_unfused_attention_is_rerun_with_a_warning_and_the_same_gradients(monkeypatch, caplog):
    """torch's math fallback (no fused kernel to keep): the backward re-runs the attention
    too, gradients are unchanged, and the runtime says so once."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hettrain.runtime import model as model_module
    monkeypatch.setattr(model_module, "_warned_unsaved", False)
    tokens = torch.randint(0, MODEL.vocab, (2, 65), generator=torch.Generator().manual_seed(0))
    grads = {}
    for mode in ("none", "attention-free"):
        model = whole_model(MODEL, seed=1, recompute=mode)
        with sdpa_kernel(SDPBackend.MATH), caplog.at_level("WARNING"):
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                              tokens[:, 1:].flatten()).backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
    for name, g in grads["none"].items():
        torch.testing.assert_close(grads["attention-free"][name], g, rtol=0, atol=0)
    warnings = [r for r in caplog.records if "no fused attention kernel" in r.getMessage()]
    assert len(warnings) == 1
