"""``hettrain profile``'s stage rows: the runtime's StageModel around one layer, measured as a
middle, first and last stage, written as version 2 and read back by the planner."""

from __future__ import annotations

import torch

from hettrain.api.spec import parse_job_spec
from hettrain.planning import cost
from hettrain.planning.profiles import PROFILE_VERSION, profile_doc, profile_from_doc
from hettrain.runtime.concurrent_profile import measure_concurrent
from hettrain.runtime.profile import comm_sizes, measure_stage, profile

JOB = {"model": {"layers": 2, "hidden": 32, "heads": 2, "seqLen": 16, "vocab": 64},
       "training": {"globalBatch": 2, "steps": 1, "precision": "fp32", "recompute": "none"},
       "data": {"synthetic": True}}


def test_stage_rows_are_measured_and_read_back() -> None:
    spec = parse_job_spec(JOB)
    cpu = torch.device("cpu")
    middle, first, last = measure_stage(spec.model, 2, 2, cpu)
    assert middle > 0 and first > 0 and last > 0
    doc = profile(spec.model, "CPU", [1, 2], 2, cpu, spec.training)
    assert doc["version"] == PROFILE_VERSION == 2
    assert [r["microBatch"] for r in doc["stage"]] == [1, 2]
    assert doc["model"]["vocab"] == 64
    prof = profile_from_doc(doc, "p")
    assert prof.stage_matches(spec.model, 4) and not prof.stage_matches(spec.model, 2)
    assert all(prof.stage.part_s(p, 2) >= 0 for p in ("overhead", "embedding", "head"))
    assert doc["concurrent"]["ranks"] == 2  # a CPU: the layer with the node's ranks busy too
    assert [r["microBatch"] for r in doc["concurrent"]["layer"]] == [1, 2]


def test_comm_sizes_cover_the_whole_models_gradient() -> None:
    """The DP sync of a model under one bucket is one all-reduce of all its fp32 gradients:
    the communication rows measure that size too."""
    spec = parse_job_spec(JOB)
    m = spec.model
    whole = 4 * (cost.layer_params(m) * m.layers + 2 * cost.embedding_params(m))
    assert whole in comm_sizes(m, [1, 2], 4)


def test_concurrent_layer_rows_come_from_two_ranks_at_once() -> None:
    """Two spawned ranks time the block at once (real processes); the rows read back as the
    profile's concurrent line."""
    spec = parse_job_spec(JOB)
    rows = measure_concurrent(spec.model, [1, 2], 2, ranks=2)
    assert [b for b, _, _ in rows] == [1, 2]
    assert all(f > 0 and bw > 0 for _, f, bw in rows)
    solo = [(1, 1e-3, 2e-3), (2, 1.5e-3, 3e-3)]
    prof = profile_from_doc(profile_doc("CPU", {}, spec.model, solo,
                                        concurrent={"ranks": 2, "layer": rows}), "p")
    assert prof.concurrent_ranks == 2 and prof.slowdown(2) >= 1.0
