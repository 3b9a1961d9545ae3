"""``hettrain profile``'s tensor-parallel side for real: two local gloo ranks shard the runtime's
block as the runtime does, check it against the unsharded block (numerically) and time it; a
model that does not shard two ways is not measured."""

from __future__ import annotations

import dataclasses

import pytest

from hettrain.api.spec import parse_job_spec
from hettrain.runtime.tp_profile import CHECK_TOLERANCE, measure_tp_layer, shardable

MODEL = parse_job_spec({"model": {"preset": "gpt-tiny"},
                        "training": {"globalBatch": 1, "steps": 1}}).model


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_two_ranks_time_the_sharded_block(precision: str) -> None:
    got = measure_tp_layer(MODEL, [1, 2], 2, precision)
    assert got is not None
    assert got["tp"] == 2 and got["backend"] == "gloo"
    # what was timed is the layer: the sharded stage's output is the unsharded one's
    assert got["maxAbsDiff"] <= CHECK_TOLERANCE[precision]
    assert [b for b, _, _ in got["layer"]] == [1, 2]
    assert all(f > 0 and bw > 0 for _, f, bw in got["layer"])


def test_a_model_that_does_not_shard_is_not_measured() -> None:
    odd = dataclasses.replace(MODEL, heads=3, kv_heads=3, hidden=63)
    assert not shardable(odd) and shardable(MODEL)
    assert measure_tp_layer(odd, [1], 2) is None
