"""``hettrain profile`` times the block as the runtime runs it: parameters and activations in
the job's precision, and each recompute mode really recomputing (counted block and attention
core forwards), so the profile's ``selectiveS``/``fullS`` are what a stage executes."""

from __future__ import annotations

import pytest
import torch

from hettrain.api.spec import parse_job_spec
from hettrain.runtime import model as runtime_model
from hettrain.runtime import profile as runtime_profile
from hettrain.runtime.profile import WARMUP, measure_layer

MODEL = parse_job_spec({"model": {"preset": "gpt-tiny"},
                        "training": {"globalBatch": 1, "steps": 1}}).model


class _Counting(runtime_model.LlamaDecoderLayer):
    """The runtime's block, counting its block forwards and the dtypes it ran in."""

    calls: list[str] = []
    dtypes: set[torch.dtype] = set()

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
    fwd, bwd = measure_layer(MODEL, 1, repeats, torch.device("cpu"), precision, recompute)
    assert fwd > 0 and bwd > 0
    runs = repeats + WARMUP
    assert _Counting.dtypes == {dtype}
    # full recompute re-runs the whole block in the backward; selective only the core
    assert len(_Counting.calls) == per_run * runs
    assert len(cores) == (1 if recompute == "none" else 2) * runs
