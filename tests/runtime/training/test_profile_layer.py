"""``hettrain profile`` times the block as the runtime runs it: parameters and activations in
the job's precision, and each recompute mode really recomputing (counted block and attention
core forwards), so the profile's ``selectiveS``/``fullS`` are what a stage executes; and the
ZB-H1 backward split: the B pass really defers every linear's weight gradient to the W pass
(inspected), and B + W is the plain backward it splits (within a generous factor)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from hettrain.api.spec import parse_job_spec
from hettrain.runtime import model as runtime_model
from hettrain.runtime import profile as runtime_profile
from hettrain.runtime.profile import (
    MAX_RUNS,
    MIN_TIMED_S,
    WARMUP,
    enough,
    measure_layer,
    measure_split,
)

MODEL = parse_job_spec({"model": {"preset": "gpt-tiny"},
                        "training": {"globalBatch": 1, "steps": 1}}).model


class _Counting(runtime_model.LlamaDecoderLayer):
    """The runtime's block, counting its block forwards and the dtypes it ran in."""

    calls: ClassVar[list[str]] = []
    dtypes: ClassVar[set[torch.dtype]] = set()

    def _block(self, x, cos, sin):
        _Counting.calls.append("block")
        _Counting.dtypes.update({x.dtype, *(p.dtype for p in self.parameters())})
        return super()._block(x, cos, sin)


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
@pytest.mark.parametrize("recompute,per_run", [("none", 1), ("selective", 1), ("full", 2)])
def test_the_profile_runs_the_block_in_the_plan_precision_and_mode(
        monkeypatch: pytest.MonkeyPatch, precision: str, dtype: torch.dtype, recompute: str,
        per_run: int) -> None:
    cores: list[int] = []
    real_core = runtime_model._attention_core

    def counting_core(q, k, v):
        cores.append(1)
        return real_core(q, k, v)

    monkeypatch.setattr(runtime_profile, "LlamaDecoderLayer", _Counting)
    monkeypatch.setattr(runtime_model, "_attention_core", counting_core)
    _Counting.calls, _Counting.dtypes = [], set()
    repeats = 2
    fwd, bwd = measure_layer(MODEL, 1, repeats, torch.device("cpu"), precision, recompute,
                             min_seconds=0.0, chain=1)  # exactly ``repeats`` timed runs
    assert fwd > 0 and bwd > 0
    runs = repeats + WARMUP
    assert _Counting.dtypes == {dtype}
    # full recompute re-runs the whole block in the backward; selective only the core
    assert len(_Counting.calls) == per_run * runs
    assert len(cores) == (1 if recompute == "none" else 2) * runs


def test_short_measurements_get_more_runs() -> None:
    """At least ``repeats`` runs and MIN_TIMED_S of them, at most MAX_RUNS."""
    assert not enough([0.01] * 4, 5) and not enough([0.01] * 5, 5)  # 50 ms: not enough
    assert enough([0.1] * 5, 5) and enough([0.01] * MAX_RUNS, 5)
    assert enough([MIN_TIMED_S], 1) and not enough([MIN_TIMED_S], 2)


def test_a_cpu_layer_is_timed_in_a_chain_of_distinct_layers(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """As a stage runs them: each run goes through ``chain`` different blocks (not one block
    again and again, whose weights a CPU's caches keep), the time reported per block."""
    monkeypatch.setattr(runtime_profile, "LlamaDecoderLayer", _Counting)
    _Counting.calls, _Counting.dtypes = [], set()
    seen: set[int] = set()
    real = _Counting._block

    def record(self, x, cos, sin):
        seen.add(id(self))
        return real(self, x, cos, sin)

    monkeypatch.setattr(_Counting, "_block", record)
    k = runtime_profile.chain_length(MODEL, torch.device("cpu"))
    assert k == min(MODEL.layers, runtime_profile.CPU_CHAIN) > 1
    assert runtime_profile.chain_length(MODEL, torch.device("meta")) == 1  # not a CPU
    measure_layer(MODEL, 1, 2, torch.device("cpu"), min_seconds=0.0)
    assert len(seen) == k


def _linears(block: torch.nn.Module) -> list[runtime_model.Linear]:
    return [m for m in block.modules() if isinstance(m, runtime_model.Linear)]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_b_pass_defers_every_linear_weight_gradient(monkeypatch: pytest.MonkeyPatch,
                                                        precision: str) -> None:
    """Each timed run's B pass leaves every linear weight without a gradient (the norms' are
    there) and stashes one item per linear; its W pass (``flush``) then gives every linear
    its gradient, in the job's precision, once per run."""
    n_linear = len(_linears(runtime_model.LlamaDecoderLayer(MODEL)))
    assert n_linear == (7 if MODEL.gated_mlp else 6)
    flushes: list[int] = []
    real_flush = runtime_model.WeightGradStore.flush

    def inspecting_flush(store: runtime_model.WeightGradStore) -> None:
        weights = [w for w, _, _ in store.items]
        assert len(weights) == n_linear  # one chain of one block: every linear deferred
        assert all(w.grad is None for w in weights)  # B computed no weight gradient
        real_flush(store)
        assert all(w.grad is not None and w.grad.dtype == w.dtype for w in weights)
        flushes.append(len(weights))

    made: list[runtime_model.LlamaDecoderLayer] = []

    class _Kept(runtime_model.LlamaDecoderLayer):
        def __init__(self, spec):
            super().__init__(spec)
            made.append(self)

    monkeypatch.setattr(runtime_model.WeightGradStore, "flush", inspecting_flush)
    monkeypatch.setattr(runtime_profile, "LlamaDecoderLayer", _Kept)
    repeats = 2
    split = measure_split(MODEL, 1, repeats, torch.device("cpu"), precision, min_seconds=0.0,
                          chain=1)
    assert split.deferred == n_linear
    assert flushes == [n_linear] * (repeats + WARMUP)
    assert split.forward > 0 and split.b > 0 and split.w > 0
    assert all(m.deferrable for m in _linears(made[0]))  # as the pipeline sets it for ZB-H1


def test_b_plus_w_is_the_backward_it_splits() -> None:
    """The same block, microbatch and precision: the split backward's B + W matches the plain
    backward within a factor of 2 either way (a noisy, shared host: a relation, not a speed;
    each the smaller of two interleaved measurements, so one disturbed run does not decide),
    and W is a part of it."""
    cpu = torch.device("cpu")
    plain, split = [], []
    for _ in range(2):
        plain.append(measure_layer(MODEL, 2, 5, cpu)[1])
        s = measure_split(MODEL, 2, 5, cpu)
        split.append(s.b + s.w)
        assert 0 < s.w < s.b + s.w
    assert 0.5 < min(split) / min(plain) < 2.0
