"""Memory of a context-parallel stage, measured on the CPU (``runtime.memory.measure_stage``):
per-token terms shrink with cp, weights do not, ZeRO-1 shards over DP×CP. The numbers are for
fitting the cost model later (docs/runtime.md §Context parallelism)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tests.runtime.cp.plans import with_cp
from tests.runtime.training.plans import TINY, tiny_plan

from hettrain.api.spec import RECOMPUTE_MODES
from hettrain.runtime.memory import measure_stage

# sequence-dominated: seq 512 against hidden 64, GQA 4/2, SwiGLU, bf16
MODEL = replace(TINY, layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=256, seq_len=512,
                vocab=512, gated_mlp=True)


@pytest.mark.parametrize("recompute", RECOMPUTE_MODES)
def test_cp2_stage_holds_about_half_the_activations(recompute):
    base = tiny_plan([(0, 2, "a"), (2, 4, "b")], dp=1, model=MODEL, micro_batch=1,
                     num_microbatches=4, precision="bf16", recompute=recompute)
    for stage in (0, 1):
        one, two = measure_stage(base, stage), measure_stage(with_cp(base, 2), stage)
        assert (two.params, two.grads) == (one.params, one.grads)  # weights are replicated
        assert two.optimizer * 2 == one.optimizer  # ZeRO-1 over the DP×CP group (1×2)
        assert two.loss_buffers * 2 == one.loss_buffers  # logits of half the tokens
        # token-local activations halve; the gathered full-sequence K/V kept for the
        # attention backward adds the rest (measured 0.52-0.73; the most with recompute none,
        # whose GQA-repeated K/V copy is the largest next to the lean token-local part)
        ratio = two.activations / one.activations
        assert 0.5 < ratio < 0.75, (recompute, stage, ratio)
