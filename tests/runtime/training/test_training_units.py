"""Single-process checks of the runtime pieces: model slicing, schedules, data, config."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.runtime.training.plans import TINY, tiny_plan

from hettrain.runtime import checkpoint as ckpt
from hettrain.runtime.config import RuntimeConfig
from hettrain.runtime.data import global_batch, microbatches
from hettrain.runtime.metrics import RuntimeMetrics
from hettrain.runtime.model import StageModel, whole_model
from hettrain.runtime.pipeline import StageRunner, executed_schedule, schedule_order, warmup_count

GQA_GATED = dataclasses.replace(TINY, kv_heads=1, gated_mlp=True)


@pytest.mark.parametrize("spec", [TINY, GQA_GATED], ids=["mha", "gqa-swiglu"])
def test_slices_hold_the_whole_models_weights_and_function(spec):
    whole = whole_model(spec, seed=5)
    parts = [StageModel(spec, 0, 1, has_embedding=True, has_head=False, seed=5),
             StageModel(spec, 1, 3, has_embedding=False, has_head=False, seed=5),
             StageModel(spec, 3, 4, has_embedding=False, has_head=True, seed=5)]
    merged = {k: v for p in parts for k, v in p.state_dict().items()}
    ref = whole.state_dict()
    assert merged.keys() == ref.keys()
    assert all(torch.equal(merged[k], ref[k]) for k in ref)
    x = torch.randint(0, spec.vocab, (3, spec.seq_len))
    h = x
    for p in parts:
        h = p(h)
    torch.testing.assert_close(h, whole(x), rtol=0, atol=1e-6)
    # causal: changing a later token leaves earlier logits unchanged
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1) % spec.vocab
    torch.testing.assert_close(whole(x2)[:, :-1], whole(x)[:, :-1])


def test_bad_layer_range_is_named():
    with pytest.raises(ValueError, match=r"stage layers \[3, 3\)"):
        StageModel(TINY, 3, 3, has_embedding=False, has_head=False, seed=1)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("pp,m", [(1, 4), (2, 4), (4, 3), (3, 8)])
def test_schedules_run_every_microbatch_once_and_forward_first(schedule, pp, m):
    for s in range(pp):
        order = schedule_order(schedule, s, pp, m)
        assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        pos = {op: k for k, op in enumerate(order)}
        assert all(pos[("F", i)] < pos[("B", i)] for i in range(m))
        assert [i for k, i in order if k == "B"] == list(range(m))  # backwards in order
        in_flight = peak = 0
        for kind, _ in order:
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
        # 1F1B bounds stored activations by the stages downstream; GPipe keeps all of them
        assert peak == (min(pp - s, m) if schedule == "1f1b" else m)


def test_unknown_schedule_is_named():
    with pytest.raises(ValueError, match="schedule must be one of"):
        warmup_count("zigzag", 0, 2, 4)


def test_global_batch_is_the_same_for_every_layout():
    x, y = global_batch(3, 7, 16, 32, 256)
    assert torch.equal(x[:, 1:], y[:, :-1])
    for dp, mb, m in [(1, 16, 1), (2, 2, 4), (4, 1, 4), (8, 2, 1)]:
        parts = [xb for d in range(dp) for xb, _ in microbatches(
            3, 7, dp=dp, dp_index=d, micro_batch=mb, num_microbatches=m, seq_len=32, vocab=256)]
        assert torch.equal(torch.cat(parts), x)
    assert not torch.equal(global_batch(3, 8, 16, 32, 256)[0], x)


def _env(tmp_path, **over):
    path = tmp_path / "plan.json"
    path.write_text(tiny_plan([(0, 4, "a")], dp=1).to_json())
    env = {"HETTRAIN_PLAN_PATH": str(path), "WORLD_SIZE": "1"}
    env.update(over)
    return env


def test_config_reads_the_env_contract(tmp_path):
    cfg = RuntimeConfig.from_env(_env(tmp_path, HETTRAIN_RESUME="1", MASTER_PORT="1234",
                                      HETTRAIN_CHECKPOINT_INTERVAL="7"))
    assert (cfg.resume, cfg.master_port, cfg.checkpoint_interval, cfg.metrics_port) == (
        True, 1234, 7, 9400)
    assert cfg.plan.model == TINY
    assert cfg.dp_bucket_bytes == 25 * 2**20  # planning.cost.DP_BUCKET_BYTES
    assert RuntimeConfig.from_env(_env(tmp_path, HETTRAIN_DP_BUCKET_MB="0.5")
                                  ).dp_bucket_bytes == 2**19
    assert cfg.dp_reduction == "auto"
    assert RuntimeConfig.from_env(_env(tmp_path, HETTRAIN_DP_REDUCTION="reduce_scatter")
                                  ).dp_reduction == "reduce_scatter"


@pytest.mark.parametrize("over,field", [
    ({"WORLD_SIZE": "3"}, "WORLD_SIZE"),
    ({"HETTRAIN_CHECKPOINT_INTERVAL": "often"}, "HETTRAIN_CHECKPOINT_INTERVAL"),
    ({"HETTRAIN_CHECKPOINT_INTERVAL": "0"}, "HETTRAIN_CHECKPOINT_INTERVAL"),
    ({"HETTRAIN_RANK_START": "5"}, "HETTRAIN_RANK_START"),
    ({"HETTRAIN_PLAN_PATH": ""}, "HETTRAIN_PLAN_PATH"),
    ({"HETTRAIN_DP_BUCKET_MB": "big"}, "HETTRAIN_DP_BUCKET_MB"),
    ({"HETTRAIN_DP_BUCKET_MB": "0"}, "HETTRAIN_DP_BUCKET_MB"),
    ({"HETTRAIN_DP_BUCKET_MB": "nan"}, "HETTRAIN_DP_BUCKET_MB"),
    ({"HETTRAIN_DP_REDUCTION": "ring"}, "HETTRAIN_DP_REDUCTION"),
])
def test_config_errors_name_the_variable(tmp_path, over, field):
    with pytest.raises(ValueError, match=field):
        RuntimeConfig.from_env(_env(tmp_path, **over))


def test_checkpoint_uri_forms(tmp_path):
    assert ckpt.CheckpointStore.open("file:///x/y").root == "/x/y"
    assert ckpt.CheckpointStore.open(str(tmp_path)).root == str(tmp_path)
    with pytest.raises(ckpt.CheckpointStorageError, match="scheme 'gs' unsupported"):
        ckpt.CheckpointStore.open("gs://bucket/x")
    store = ckpt.CheckpointStore.open(str(tmp_path))
    assert store.latest_step() is None
    (tmp_path / "latest").write_text("step-4")  # a pointer to an uncommitted directory
    (tmp_path / "step-4").mkdir()
    assert store.latest_step() is None
    (tmp_path / "step-4" / "COMMITTED").write_text("4")
    assert store.latest_step() == 4


@pytest.mark.parametrize("planned,executed", [("1f1b", "1f1b"), ("gpipe", "gpipe"),
                                              ("zb-h1", "zb-h1"), ("interleaved", "interleaved")])
def test_the_executed_schedule_is_explicit_and_exported(planned, executed):
    plan = tiny_plan([(0, 2, "a"), (2, 4, "b")], dp=1, schedule=planned)
    model = StageModel(TINY, 0, 2, has_embedding=True, has_head=False, seed=3)
    runner = StageRunner(plan, 0, model)
    assert (runner.planned, runner.schedule) == (planned, executed)
    m = RuntimeMetrics("j", 0, 0, "a", port=0)
    m.set_schedule(runner.schedule, runner.planned)
    labels = {"job": "j", "rank": "0", "stage": "0", "pool": "a", "schedule": executed,
              "planned": planned}
    assert m.registry.get_sample_value("hettrain_runtime_schedule_info", labels) == 1.0


def test_unknown_plan_schedule_is_named():
    with pytest.raises(ValueError, match=r"plan.schedule='zigzag'"):
        executed_schedule("zigzag")
