"""Tensor parallelism: shard maps (pure), tp=2 x pp=2 training vs the single-process reference
on real gloo processes, and a resume on a different TP/PP layout from the tp=2 checkpoint."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from tests.runtime.checkpoints import rewind
from tests.runtime.training.plans import TINY, tiny_plan

from hettrain.api.spec import TrainingSpec
from hettrain.planning import cost
from hettrain.runtime.collectives.p2p import boundary_pieces
from hettrain.runtime.launch import launch_local, wait_all
from hettrain.runtime.model import whole_model
from hettrain.runtime.tensor_parallel import check_tp, shard_layout, shard_stage_
from hettrain.runtime.trainer import reference_losses

# fp32: TP changes only the summation order of o/down (partial sums all-reduced)
RTOL = 1e-5


@pytest.mark.parametrize("spec", [TINY, dataclasses.replace(TINY, kv_heads=4, gated_mlp=True)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_partition_every_weight_and_compute_the_block(spec, tp):
    if spec.kv_heads % tp:
        pytest.skip("kv_heads not divisible")
    blk = whole_model(spec, seed=2).layers["1"]
    x = torch.randn(2, 5, spec.hidden)
    normed = blk.post_attention_layernorm(x)
    want = blk.mlp(normed)
    got = torch.zeros_like(want)
    for r in range(tp):  # row-parallel partial sums of the column-parallel MLP halves
        _, up = shard_layout(spec, tp)["mlp.up_proj.weight"]
        _, down = shard_layout(spec, tp)["mlp.down_proj.weight"]
        h = normed @ blk.mlp.up_proj.weight[up[r]].T
        if spec.gated_mlp:
            h = torch.nn.functional.silu(normed @ blk.mlp.gate_proj.weight[up[r]].T) * h
        else:
            h = torch.nn.functional.gelu(h)
        got += h @ blk.mlp.down_proj.weight[:, down[r]].T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for suffix, (dim, idx) in shard_layout(spec, tp).items():
        size = blk.get_parameter(suffix).shape[dim]
        assert sorted(torch.cat(idx).tolist()) == list(range(size)), suffix


@pytest.mark.parametrize("vocab", [256, 255])
def test_vocabulary_is_sharded_exactly_when_the_cost_model_divides_it(vocab):
    """The runtime shards embedding and head rows iff ``cost.vocab_shards`` says so, and the
    partial lookups of the shards sum to the whole embedding (what the TP all-reduce does)."""
    spec = dataclasses.replace(TINY, vocab=vocab)
    ids = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(0))
    whole = whole_model(spec, seed=2)
    want = whole.model.embed_tokens(ids)
    ways = cost.vocab_shards(spec, 2)
    assert ways == (2 if vocab % 2 == 0 else 1)
    total = torch.zeros_like(want)
    for r in range(2):
        model = whole_model(spec, seed=2)
        info = shard_stage_(model, spec, 2, r, None, [0, 1])
        rows = model.model.embed_tokens.weight.shape[0]
        assert rows == model.lm_head.weight.shape[0] == vocab // ways
        assert ("model.embed_tokens.weight" in info.shards) == (ways == 2)
        assert ("lm_head.weight" in info.shards) == (ways == 2)
        model.model.embed_tokens.tp_group = None  # the local partial lookup, no all-reduce
        total += model.model.embed_tokens(ids)
    torch.testing.assert_close(total, want * (1 if ways == 2 else 2), rtol=0, atol=0)
    # the planner's memory model counts the same rows: 1/ways of the table per TP rank (and,
    # sharded, a 1-byte out-of-range mask per token)
    train = TrainingSpec(global_batch=8, steps=1, precision="fp32", recompute="none")
    one = cost.stage_memory(spec, train, tp=2, dp=1, micro_batch=1, in_flight=1, first=True,
                            last=False)
    rep = cost.stage_memory(spec, train, tp=1, dp=1, micro_batch=1, in_flight=1, first=True,
                            last=False)
    state = cost.state_bytes_per_param(train, 1) * cost.embedding_params(spec)
    # (and the backward's MLP working set, ffn-wide tensors sharded over TP)
    mlp = (cost.mlp_backward_transient_bytes(spec, 1, 1, 4)
           - cost.mlp_backward_transient_bytes(spec, 1, 2, 4))
    assert rep.fixed - one.fixed == pytest.approx(
        state * (1 - 1 / ways) - spec.seq_len * (ways - 1) + mlp, rel=1e-9, abs=1e-6)


def test_bad_tp_degree_names_the_field():
    with pytest.raises(ValueError, match=r"plan.stages\[1\].tp=4: model kv_heads=2"):
        check_tp(TINY, 4, "plan.stages[1]")


def test_boundary_pieces_connect_stages_of_different_tp_degrees():
    plan = tiny_plan([(0, 1, "a"), (1, 4, "b")], dp=1, tp=(1, 2))
    # ranks: 0 = stage 0 tp0; 1, 2 = stage 1 tp0/tp1
    fwd = boundary_pieces(plan, 0, 1, dp=0)  # the single TP rank sends each one half
    assert [(p.sender, p.receiver, p.lo, p.hi, p.parts) for p in fwd] == [(0, 1, 0, 1, 2),
                                                                         (0, 2, 1, 2, 2)]
    back = boundary_pieces(plan, 1, 0, dp=0)  # each TP rank sends its half of the gradient
    assert [(p.sender, p.receiver, p.lo, p.hi) for p in back] == [(1, 0, 0, 1), (2, 0, 1, 2)]


def _run(work, plan, env):
    env = {"HETTRAIN_LOSS_LOG": str(work / "loss.jsonl"), "HETTRAIN_METRICS_PORT": "0", **env}
    codes = wait_all(launch_local(plan, work, env), 150)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(work.glob("rank-*.log")))
    assert codes == [0] * plan.world_size, logs
    return {d["step"]: d["loss"]
            for d in map(json.loads, (work / "loss.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_tp2_pp2_matches_reference_and_resumes_on_another_tp_layout(tmp_path):
    steps = 6
    first = tiny_plan([(0, 2, "pool-a"), (2, 4, "pool-b")], dp=1, steps=steps, tp=2,
                      num_microbatches=4)
    ck = tmp_path / "ckpt"
    summary = tmp_path / "summary"
    got = _run(tmp_path / "tp2", first, {"HETTRAIN_CHECKPOINT_URI": str(ck),
                                         "HETTRAIN_CHECKPOINT_INTERVAL": "3",
                                         "HETTRAIN_SUMMARY_DIR": str(summary)})
    sums = [json.loads((summary / f"rank-{r}.json").read_text()) for r in range(4)]
    whole = sum(p.numel() for p in whole_model(TINY, 3).parameters())
    # stage 0 = embedding + 2 blocks, stage 1 = 2 blocks + head; blocks split 2 ways
    assert sum(s["param_elements"] for s in sums) < 2 * whole
    assert sums[0]["param_elements"] == sums[1]["param_elements"]
    # sequence parallel (seq divides by tp). Per block and microbatch 12 TP collectives: the
    # attention's and the MLP's all-gather + reduce-scatter forward (4), backward the
    # reduce-scatter's all-gather, the input's re-gather and the input gradient's
    # reduce-scatter (6), the two norms' weight-gradient all-reduces (2). Per microbatch: one
    # all-gather of the received 1/tp slice (activation or gradient). Stage 0: the
    # vocab-parallel embedding's reduce-scatter and its backward's all-gather (2), the stage
    # output's all-gather (1). Stage 1: the input shard's backward all-gather (1), the final
    # norm's weight gradient (1), the head's gather, re-gather and reduce-scatter (3) and the
    # cross-entropy's max, exponential sums and target logit (3)
    assert TINY.vocab % 2 == 0 and TINY.seq_len % 2 == 0
    assert [s["ops"]["intra_pool"] for s in sums] == [
        (12 * 2 + 1 + 2 + 1) * 4 * steps] * 2 + [(12 * 2 + 1 + 1 + 1 + 3 + 3) * 4 * steps] * 2
    ref = reference_losses(first, steps)
    assert sorted(got) == list(range(steps))
    for step, want in enumerate(ref):
        assert got[step] == pytest.approx(want, rel=RTOL), step
    # as if the run had died after step 3: resume on 3 ranks, layers 1+3, TP 1 then 2
    rewind(ck, 3)
    second = tiny_plan([(0, 1, "pool-a"), (1, 4, "pool-b")], dp=1, steps=steps, tp=(1, 2),
                       num_microbatches=4)
    after = _run(tmp_path / "mixed", second, {"HETTRAIN_CHECKPOINT_URI": str(ck),
                                              "HETTRAIN_RESUME": "1"})
    assert sorted(after) == list(range(3, steps))
    for step in range(3, steps):
        assert after[step] == pytest.approx(ref[step], rel=1e-4), step


@pytest.mark.slow
@pytest.mark.parametrize("seq_len", [32, 31])
def test_tp2_times_dp2_matches_reference(tmp_path, seq_len):
    """DP all-reduces per TP index ((stage, tp) groups); replicated weights stay identical.
    Sequence parallel at seq 32, plain TP (replicated norms) at 31, which 2 does not divide."""
    steps = 4
    model = dataclasses.replace(TINY, seq_len=seq_len)
    assert cost.sequence_shards(model, 2) == (2 if seq_len % 2 == 0 else 1)
    plan = tiny_plan([(0, 4, "pool-a")], dp=2, steps=steps, tp=2, num_microbatches=2,
                     model=model)
    summary = tmp_path / "summary"
    got = _run(tmp_path / "run", plan, {"HETTRAIN_SUMMARY_DIR": str(summary)})
    for step, want in enumerate(reference_losses(plan, steps)):
        assert got[step] == pytest.approx(want, rel=RTOL), step
    sums = [json.loads((summary / f"rank-{r}.json").read_text()) for r in range(4)]
    by_tp = {t: {s["param_checksum"] for s in sums if s["tp"] == t} for t in (0, 1)}
    assert all(len(v) == 1 for v in by_tp.values())  # the two replicas of each TP shard agree
