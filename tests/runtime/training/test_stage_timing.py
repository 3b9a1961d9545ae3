"""Measured stage times (runtime/stage_timing.py): the layer clock's marks leave the gradients
exactly as they are, time both passes of the layers only, and the rolling medians skip the
warm-up step."""

from __future__ import annotations

import pytest
import torch
from tests.runtime.training.plans import TINY

from hettrain.runtime.model import StageModel
from hettrain.runtime.stage_timing import LayerClock, StageTimer


def _grads(clock: LayerClock | None, recompute: str) -> list[torch.Tensor]:
    model = StageModel(TINY, 0, TINY.layers, has_embedding=True, has_head=True, seed=3,
                       recompute=recompute)
    model.layer_clock = clock
    x = torch.randint(0, TINY.vocab, (2, TINY.seq_len), generator=torch.Generator().manual_seed(1))
    model(x).float().pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_clock_changes_no_gradient_and_times_both_passes(recompute: str) -> None:
    clock = LayerClock()
    timed = _grads(clock, recompute)
    plain = _grads(None, recompute)
    assert all(torch.equal(a, b) for a, b in zip(timed, plain, strict=True))
    assert clock.forward_s > 0 and clock.backward_s > 0
    total = clock.forward_s + clock.backward_s
    assert clock.reset() == pytest.approx(total) and clock.reset() == 0.0


def test_no_clock_work_without_grad() -> None:
    clock = LayerClock()
    model = StageModel(TINY, 0, 2, has_embedding=True, has_head=False, seed=3)
    model.layer_clock = clock
    with torch.no_grad():
        model(torch.zeros(1, TINY.seq_len, dtype=torch.long))
    assert clock.forward_s == 0.0 and clock.backward_s == 0.0  # validation is not measured


def test_timer_medians_skip_the_warmup_step() -> None:
    t = StageTimer(window=3, warmup=1)
    t.add(100.0, 100.0, 100.0)  # warm-up: not counted
    assert t.measured == 0 and t.compute_s == 0.0
    for v in (1.0, 5.0, 3.0, 2.0):
        t.add(v, v / 10, v / 2)
    assert t.measured == 4
    assert t.compute_s == 3.0  # median of the last 3: 5, 3, 2
    assert t.comm_s == pytest.approx(0.3) and t.layers_s == pytest.approx(1.5)
    assert t.as_json() == {"compute_s": 3.0, "layers_s": 1.5, "comm_s": pytest.approx(0.3),
                           "steps": 4}
