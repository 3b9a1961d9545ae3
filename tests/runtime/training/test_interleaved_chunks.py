"""The planner searches the interleaved chunk count (2..4, ``spec.parallelism.virtualStages``):
the runtime must execute more than 2 chunks per stage. A pp=2 v=3 pipeline over real gloo
processes reproduces the single-process reference losses and moves exactly the chunk
boundary traffic."""

from __future__ import annotations

import pytest
from tests.runtime.training.test_interleaved import (
    SEVEN,
    _assert_matches,
    _assert_ran,
    _interleaved,
    _p2p_bytes,
    _run,
)

from hettrain.runtime.trainer import reference_losses


@pytest.mark.slow
def test_interleaved_three_chunks_matches_reference(tmp_path):
    steps = 3
    plan = _interleaved([(0, 3, "pool-a"), (3, 7, "pool-b")], dp=1, v=3, steps=steps,
                        num_microbatches=4, model=SEVEN)
    assert plan.virtual_stages == 3
    got, logs, sums, _ = _run(tmp_path, plan)
    _assert_ran(logs, sums, plan, "interleaved")
    _assert_matches(got, reference_losses(plan, steps), range(steps))
    assert sum(b for s in sums for b in s["bytes"].values()) == _p2p_bytes(plan, steps)
