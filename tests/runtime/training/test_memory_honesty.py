"""Memory honesty: what a stage really holds (measured on the CPU by ``runtime.memory``) against
the planner's per-stage prediction (``planning.cost.stage_memory``) minus its fixed overhead,
over a grid of layouts: within 10% and never above it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tests.runtime.training.plans import TINY, tiny_plan

from hettrain.planning import cost
from hettrain.runtime.memory import measure_stage, predicted_stage_bytes

# wide enough that no term is negligible: vocab 8x seq, ffn 4x hidden, GQA
MODEL = replace(TINY, layers=6, hidden=64, heads=4, kv_heads=2, ffn_hidden=256, seq_len=64,
                vocab=512)
GATED = replace(MODEL, gated_mlp=True, kv_heads=4)
TOLERANCE = 0.10

SPLITS = {1: [(0, 6, "a")], 2: [(0, 4, "a"), (4, 6, "b")],
          3: [(0, 2, "a"), (2, 4, "b"), (4, 6, "c")]}

GRID = [
    # (pp, tp, dp, micro_batch, microbatches, schedule, precision, sharding, model[,
    #  recompute: none by default])
    (1, 1, 1, 2, 2, "1f1b", "bf16", False, MODEL),
    (2, 1, 2, 2, 4, "1f1b", "bf16", True, MODEL),
    (2, 2, 2, 1, 4, "1f1b", "bf16", True, MODEL),
    (2, 2, 1, 2, 4, "1f1b", "fp32", False, GATED),
    (3, 1, 4, 1, 6, "1f1b", "fp16", True, GATED),
    (3, 2, 2, 2, 3, "1f1b", "fp32", True, MODEL),
    (2, 1, 2, 2, 4, "interleaved", "bf16", True, MODEL),
    (3, 2, 1, 1, 6, "interleaved", "fp32", False, GATED),
    (2, 1, 2, 2, 4, "zb-h1", "bf16", False, MODEL),
    (3, 2, 2, 1, 6, "zb-h1", "bf16", True, GATED),
    (2, 1, 2, 2, 4, "interleaved-zb", "bf16", True, MODEL),
    (3, 2, 1, 1, 5, "interleaved-zb", "fp32", False, GATED),
    (2, 1, 1, 1, 4, "gpipe", "fp32", False, MODEL),
    # selective (attention core recomputed) and full (block input kept, one layer re-run)
    (1, 1, 1, 2, 2, "1f1b", "bf16", False, GATED, "selective"),
    (2, 2, 2, 1, 4, "1f1b", "fp16", True, MODEL, "selective"),
    (3, 2, 1, 1, 6, "interleaved", "fp32", False, MODEL, "selective"),
    (2, 1, 2, 2, 4, "zb-h1", "bf16", True, GATED, "selective"),
    (1, 1, 1, 2, 2, "1f1b", "bf16", False, GATED, "full"),
    (2, 2, 2, 2, 4, "1f1b", "fp32", True, MODEL, "full"),
    (3, 1, 2, 1, 6, "1f1b", "fp16", False, GATED, "full"),
    (2, 1, 2, 2, 4, "interleaved", "bf16", True, MODEL, "full"),
    (3, 2, 1, 1, 6, "zb-h1", "bf16", False, GATED, "full"),
    # attention-free (block re-run but the attention kernel, whose outputs are kept)
    (1, 1, 1, 2, 2, "1f1b", "bf16", False, GATED, "attention-free"),
    (2, 2, 2, 2, 4, "1f1b", "fp32", True, MODEL, "attention-free"),
    (3, 2, 1, 1, 6, "interleaved", "bf16", False, GATED, "attention-free"),
    (2, 1, 2, 2, 4, "zb-h1", "fp16", True, MODEL, "attention-free"),
    (3, 1, 2, 1, 6, "interleaved-zb", "bf16", True, GATED, "selective"),
    (2, 2, 1, 1, 4, "interleaved-zb", "bf16", False, MODEL, "attention-free"),
    (2, 1, 4, 2, 4, "1f1b", "bf16", "gradients", GATED, "attention-free"),
    (2, 2, 2, 1, 4, "1f1b", "bf16", "full", MODEL, "attention-free"),
    # ZeRO-2 / ZeRO-3 (FSDP): own chunks of the state, a unit's bucket and gathered weights
    (2, 1, 4, 2, 4, "1f1b", "bf16", "gradients", GATED),
    (2, 2, 2, 1, 4, "1f1b", "fp32", "gradients", MODEL, "selective"),
    (1, 1, 4, 2, 2, "1f1b", "bf16", "full", GATED),
    (2, 1, 4, 2, 4, "1f1b", "bf16", "full", MODEL, "full"),
    (3, 2, 2, 1, 6, "1f1b", "fp16", "full", GATED, "selective"),
    (2, 1, 2, 2, 4, "interleaved", "fp32", "full", MODEL),
]


def _plan(pp, tp, dp, mb, m, schedule, precision, sharding, model, recompute="none"):
    splits = SPLITS[pp]
    chunked = schedule in ("interleaved", "interleaved-zb")
    if chunked:  # v = 2 model chunks of one layer each per stage
        splits = [(2 * i, 2 * i + 2, p) for i, (_, _, p) in enumerate(SPLITS[3][:pp])]
        model = replace(model, layers=2 * pp)
    # sharding: True/False (ZeRO-1 or none) or a spec.training.sharding value
    mode = sharding if isinstance(sharding, str) else ("optimizer" if sharding else "none")
    plan = tiny_plan(splits, dp=dp, tp=tp, micro_batch=mb, num_microbatches=m, model=model,
                     schedule=schedule, precision=precision, sharding=mode,
                     recompute=recompute)
    return replace(plan, virtual_stages=2) if chunked else plan


def _case_id(case) -> str:
    return "-".join(map(str, case[:8] + case[9:]))


def _assert_every_stage_matches_the_plan(plan, label: str) -> list:
    """Measure every stage of ``plan``: within TOLERANCE of the planned bytes, never above;
    returns the measurements."""
    out = []
    for stage in range(plan.pp):
        got = measure_stage(plan, stage)
        want = predicted_stage_bytes(plan, stage)
        ratio = got.total / want
        print(f"{label} stage {stage}: measured {got.total} B, planned {want:.0f} B, "
              f"ratio {ratio:.4f} ({got})")
        assert ratio <= 1.0, (stage, got, want)
        assert ratio >= 1.0 - TOLERANCE, (stage, got, want)
        out.append(got)
    return out


@pytest.mark.parametrize("case", GRID, ids=_case_id)
def test_measured_stage_bytes_match_the_plan_and_never_exceed_it(case):
    for got in _assert_every_stage_matches_the_plan(_plan(*case), _case_id(case)):
        assert got.activations > 0 and got.params > 0


# the chunked loss (plan.training.loss_chunk_tokens): the last stage keeps one fp32
# log-sum-exp per token instead of the log-softmax, and its backward holds chunk-sized buffers
# plus an fp32 sum of the head's weight gradient. (GRID case, tokens per chunk, whether it
# saves): one sequence is 64 tokens, so 16 and 24 cut it and save; 200 covers the whole
# microbatch, yet the saved fp32 log-softmax outweighs the larger loss buffers; 48 of a
# 64-token fp32 microbatch at TP 2 saves too, but only because the loss's buffers hide under
# the backward's working set (an MLP backward): the fp32 weight-gradient sum of this small
# model's head (256 vocabulary rows × hidden 64) outweighs the logits it spares
CHUNKED = [((1, 1, 1, 2, 2, "1f1b", "bf16", False, MODEL), 16, True),
           ((2, 2, 2, 1, 4, "1f1b", "bf16", True, GATED, "selective"), 24, True),
           ((2, 1, 2, 2, 4, "zb-h1", "bf16", False, MODEL), 16, True),
           ((3, 2, 1, 1, 6, "interleaved", "fp32", False, GATED), 48, True),
           ((2, 1, 2, 2, 4, "1f1b", "fp16", True, MODEL, "full"), 200, True)]


@pytest.mark.parametrize("case,chunk,saves", CHUNKED,
                         ids=lambda c: "-".join(map(str, c[:8] + c[9:]))
                         if isinstance(c, tuple) else str(c))
def test_chunked_loss_stage_bytes_match_the_plan_and_never_exceed_it(case, chunk, saves):
    """Every stage of a plan with the chunked loss within 10% of its prediction and never
    above; where the chunks cut the sequence its last stage measures fewer bytes than with the
    whole-sequence loss, and the prediction says so too."""
    whole = _plan(*case)
    plan = replace(whole, training=replace(whole.training, loss_chunk_tokens=chunk))
    got = _assert_every_stage_matches_the_plan(plan, f"{_case_id(case)} chunk {chunk}")
    last = whole.pp - 1
    before = measure_stage(whole, last)
    predicted_saving = predicted_stage_bytes(whole, last) - predicted_stage_bytes(plan, last)
    assert (got[-1].total < before.total) == saves == (predicted_saving > 0)


# the chunked MLP (plan.training.mlp_chunk_tokens) with a re-run layer: the re-run keeps none
# of the MLP's ffn-wide tensors for the whole sequence, its backward holds one chunk's plus
# fp32 weight-gradient sums. (GRID case, tokens per chunk); a microbatch here is 64 or 128
# tokens, and this small model's fp32 sums (3 or 2 × hidden 64 × ffn 256) are the size of a
# 64-token ffn-wide tensor, so the stages measure a little more or less than the whole MLP's
MLP_CHUNKED = [((1, 1, 1, 2, 2, "1f1b", "bf16", False, GATED, "full"), 16),
               ((2, 2, 2, 2, 4, "1f1b", "fp32", True, MODEL, "attention-free"), 24),
               ((3, 1, 2, 1, 6, "1f1b", "fp16", False, GATED, "full"), 8),
               ((2, 1, 2, 2, 4, "interleaved", "bf16", True, MODEL, "full"), 32),
               ((2, 2, 2, 1, 4, "1f1b", "bf16", "full", MODEL, "attention-free"), 16)]


@pytest.mark.parametrize("case,chunk", MLP_CHUNKED,
                         ids=lambda c: "-".join(map(str, c[:8] + c[9:]))
                         if isinstance(c, tuple) else str(c))
def test_chunked_mlp_stage_bytes_match_the_plan_and_never_exceed_it(case, chunk):
    """Every stage of a plan with the chunked MLP within 10% of its prediction and never
    above."""
    whole = _plan(*case)
    plan = replace(whole, training=replace(whole.training, mlp_chunk_tokens=chunk))
    _assert_every_stage_matches_the_plan(plan, f"{_case_id(case)} mlp chunk {chunk}")


@pytest.mark.parametrize("recompute", ["full", "attention-free"])
def test_the_chunked_mlp_saves_what_the_plan_says_at_a_longer_sequence(recompute):
    """1024-token sequences, chunks of 64: the first stage's re-run working set measures less
    than the whole MLP's, by at least the planned saving (the chunked backward's count is a
    bound), and the plan is within 10% of the measurement and never below it."""
    model = replace(GATED, seq_len=1024)
    whole = _plan(2, 1, 1, 1, 4, "1f1b", "bf16", False, model, recompute)
    plan = replace(whole, training=replace(whole.training, mlp_chunk_tokens=64))
    got = _assert_every_stage_matches_the_plan(plan, f"seq 1024 {recompute} mlp chunk 64")
    before = measure_stage(whole, 0)
    planned = predicted_stage_bytes(whole, 0) - predicted_stage_bytes(plan, 0)
    assert before.total - got[0].total >= planned > 0.1 * before.total


# helix (runtime/helix.py): one layer per chunk, each layer's three parts differentiated
# apart; (pp, microbatches, micro_batch, precision, model, recompute)
HELIX = [(2, 4, 2, "bf16", MODEL, "none"), (3, 6, 1, "fp32", GATED, "none"),
         (3, 9, 1, "bf16", MODEL, "none"), (3, 3, 1, "bf16", MODEL, "selective"),
         (2, 3, 2, "bf16", GATED, "attention-free"), (3, 5, 2, "bf16", GATED, "attention-free"),
         (2, 4, 1, "fp16", GATED, "full"),
         # first in, last out (plan.helix_filo): every microbatch in flight
         (2, 4, 2, "bf16", MODEL, "none", True), (3, 6, 1, "fp32", GATED, "none", True),
         (3, 5, 2, "bf16", GATED, "attention-free", True),
         (2, 4, 1, "bf16", MODEL, "selective", True),
         # the chunked MLP in the re-run parts (plan.training.mlp_chunk_tokens = 16)
         (2, 4, 2, "bf16", GATED, "attention-free", True, 16), (2, 3, 1, "fp16", MODEL, "full",
                                                               False, 16)]
HELIX_TOLERANCE = 0.25  # the plan bounds the order by its caps (helix.in_flight_bound)


@pytest.mark.parametrize("case", HELIX, ids=lambda c: "-".join(map(str, c[:4] + c[5:])))
def test_helix_stage_bytes_never_exceed_the_plan(case):
    """The helix order holds at most its caps (pp microbatches of a stage's layers, one
    stage's worth of other stages' cores: ``helix.in_flight_bound``; first in, last out: all
    m of its own), which the plan charges whatever the order does: measured never above,
    within 25% below (a core the order keeps home, a stage that never reaches the cap)."""
    pp, m, mb, precision, model, recompute, *rest = case
    filo, chunk = [*rest, False, 0][:2]
    splits = [(2 * i, 2 * i + 2, p) for i, p in enumerate("abc"[:pp])]
    plan = replace(tiny_plan(splits, dp=1, micro_batch=mb, num_microbatches=m,
                             model=replace(model, layers=2 * pp), schedule="helix",
                             precision=precision, sharding="none", recompute=recompute,
                             mlp_chunk_tokens=chunk),
                   virtual_stages=2, helix_filo=filo)
    for stage in range(pp):
        got = measure_stage(plan, stage)
        want = predicted_stage_bytes(plan, stage)
        ratio = got.total / want
        print(f"helix {case[:4]} {recompute} stage {stage}: ratio {ratio:.4f} ({got})")
        assert got.activations > 0
        assert 1.0 - HELIX_TOLERANCE <= ratio <= 1.0, (stage, got, want)


@pytest.mark.parametrize("model", [MODEL, GATED], ids=["gqa", "mha"])
@pytest.mark.parametrize("recompute", ["none", "selective", "attention-free", "full"])
def test_each_helix_microbatch_holds_exactly_what_the_plan_charges(model, recompute):
    """What one more microbatch in flight adds to a helix stage (the first-in-last-out order
    holds all of them): measured exactly the plan's per-layer charge, the split parts'
    extra (``cost.split_layer_extra_bytes``: the packed q/k/v the core's views keep) and the
    layer outputs the stage keeps for other stages, on a first and a last stage."""
    splits = [(0, 2, "a"), (2, 4, "b")]
    rows = []
    for m in (3, 4):
        plan = replace(tiny_plan(splits, dp=1, micro_batch=2, num_microbatches=m,
                                 model=replace(model, layers=4), schedule="helix",
                                 precision="bf16", sharding="none", recompute=recompute),
                       virtual_stages=2, helix_filo=True)
        rows.append([(measure_stage(plan, s).total, predicted_stage_bytes(plan, s))
                     for s in range(2)])
    for (got3, want3), (got4, want4) in zip(*rows, strict=True):
        assert got4 - got3 == pytest.approx(want4 - want3, abs=1)
        assert got4 > got3


def test_state_bytes_are_exactly_the_cost_models_per_parameter_bytes():
    for precision, sharding, dp in (("bf16", True, 2), ("bf16", False, 2), ("fp32", True, 4),
                                    ("fp16", False, 1), ("bf16", "gradients", 4),
                                    ("fp32", "gradients", 2), ("bf16", "full", 4),
                                    ("fp32", "full", 3)):
        plan = _plan(2, 1, dp, 1, 2, "1f1b", precision, sharding, MODEL)
        got = measure_stage(plan, 1)  # the last stage: layers, final norm, head
        # main grads are fp32: one per parameter (ZeRO-2/3: one per owned parameter)
        n = got.grads / 4 * (dp if isinstance(sharding, str) else 1)
        per = cost.state_bytes_per_param(plan.training, dp)
        assert got.params + got.grads + got.optimizer == pytest.approx(n * per, rel=1e-3)


def test_activation_bytes_scale_with_microbatch_and_in_flight_count():
    """What the forwards keep (``activations`` without the backward's one-microbatch working
    set) doubles with the microbatch and with the microbatches in flight."""
    def kept(m):
        return m.activations - m.working
    one = measure_stage(_plan(2, 1, 1, 1, 4, "1f1b", "bf16", False, MODEL), 0)
    two = measure_stage(_plan(2, 1, 1, 2, 4, "1f1b", "bf16", False, MODEL), 0)
    # RoPE's cos/sin cast per layer and microbatch do not grow with the microbatch size
    rope = cost.ROPE_TABLE_BYTES * MODEL.seq_len * MODEL.head_dim * 4 * 2  # 4 layers, 2 in flight
    assert kept(two) - rope == pytest.approx(2 * (kept(one) - rope), rel=0.02)
    gpipe = measure_stage(_plan(2, 1, 1, 1, 4, "gpipe", "bf16", False, MODEL), 0)
    # 1F1B keeps pp - 0 = 2 microbatches on stage 0, GPipe all 4
    assert kept(gpipe) == pytest.approx(2 * kept(one), rel=0.02)
    assert gpipe.working == one.working > 0


# context parallelism (runtime/context_parallel.py): a sequence-dominated model, so the
# gathered full-sequence keys/values and the per-chunk masks are a visible share
LONG = replace(MODEL, seq_len=512)
LONG_GATED = replace(LONG, gated_mlp=True)
CP_GRID = [
    # (cp, pp, tp, dp, micro_batch, microbatches, schedule, precision, sharding, model,
    #  recompute)
    (2, 2, 1, 1, 1, 4, "1f1b", "bf16", False, LONG_GATED, "none"),
    (2, 2, 1, 2, 2, 4, "1f1b", "bf16", True, LONG, "none"),
    (4, 2, 1, 1, 1, 4, "1f1b", "bf16", True, LONG_GATED, "none"),
    (2, 2, 2, 1, 1, 4, "1f1b", "fp32", False, LONG, "none"),
    (2, 2, 1, 1, 1, 4, "zb-h1", "bf16", False, LONG_GATED, "none"),
    (2, 1, 1, 1, 2, 2, "1f1b", "fp16", True, LONG_GATED, "selective"),
    (4, 2, 2, 1, 1, 4, "1f1b", "bf16", False, LONG, "selective"),
    (2, 2, 1, 1, 1, 4, "1f1b", "bf16", False, LONG_GATED, "full"),
    (2, 2, 2, 1, 2, 4, "zb-h1", "bf16", True, LONG, "full"),
    (2, 2, 1, 1, 1, 4, "1f1b", "bf16", False, LONG_GATED, "attention-free"),
    (4, 2, 2, 1, 1, 4, "zb-h1", "bf16", True, LONG, "attention-free"),
]


@pytest.mark.parametrize("case", CP_GRID, ids=lambda c: "cp" + "-".join(map(str, c[:9] + c[10:])))
def test_context_parallel_stage_bytes_match_the_plan_and_never_exceed_it(case):
    from tests.runtime.cp.plans import with_cp
    cp, rest = case[0], case[1:]
    _assert_every_stage_matches_the_plan(with_cp(_plan(*rest), cp), f"cp={cp} {rest[:8]}")


@pytest.mark.parametrize("case,chunk", [(CP_GRID[1], 64), (CP_GRID[6], 100)],
                         ids=lambda c: "cp" + "-".join(map(str, c[:9] + c[10:]))
                         if isinstance(c, tuple) else str(c))
def test_context_parallel_chunked_loss_stage_bytes_match_the_plan(case, chunk):
    """The chunked loss on a CP rank's tokens (its share of the sequence, cut into chunks)."""
    from tests.runtime.cp.plans import with_cp
    cp, rest = case[0], case[1:]
    plan = with_cp(_plan(*rest), cp)
    plan = replace(plan, training=replace(plan.training, loss_chunk_tokens=chunk))
    _assert_every_stage_matches_the_plan(plan, f"cp={cp} {rest[:8]} chunk {chunk}")
