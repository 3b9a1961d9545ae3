"""``hettrain profile`` times the block as the runtime runs it: parameters and activations in
the job's precision, and each recompute mode really recomputing (counted block and attention
core forwards), so the profile's ``selectiveS``/``fullS`` are what a stage executes."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from hettrain.api.spec import parse_job_spec
from hettrain.runtime import model as runtime_model
from hettrain.runtime import profile as runtime_profile
from hettrain.runtime.profile import MAX_RUNS, MIN_TIMED_S, WARMUP, enough, measure_layer

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
