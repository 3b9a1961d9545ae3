"""The chunked LM head and loss (``plan.training.loss_chunk_tokens``, long sequences): the same
loss and gradients as the whole-sequence head, never a whole sequence's logits, the same
losses as the single-process reference on multi-process layouts (TP with and without sequence
parallelism, a zero-bubble schedule), and the planner's memory and time for it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

import pytest
import torch
from tests.runtime.training.plans import TINY, single_pool_cluster, tiny_plan
from tests.runtime.training.runs import run_losses
from torch.utils._python_dispatch import TorchDispatchMode

from hettrain.api.spec import parse_job_spec
from hettrain.planning import cost
from hettrain.planning.catalog import CATALOG
from hettrain.runtime.model import StageModel
from hettrain.runtime.trainer import reference_losses

RTOL = 2e-4  # as the other fp32 multi-process reference tests


def _pair(chunk: int, dtype: torch.dtype, model=TINY) -> tuple[StageModel, StageModel]:
    whole = StageModel(model, 0, model.layers, has_embedding=True, has_head=True, seed=3)
    chunked = StageModel(model, 0, model.layers, has_embedding=True, has_head=True, seed=3,
                         loss_chunk_tokens=chunk)
    return whole.to(dtype), chunked.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_loss_and_gradients_equal_the_whole_sequence_head(dtype, chunk):
    """Batch 2 × 32 tokens: chunks of 1 token, of 7 (the last one short), exactly the batch's
    64 tokens, and more than it. fp32: equal to 1e-6; bf16: the same loss to 1e-4 and every
    gradient within bf16's rounding of the largest element."""
    whole, chunked = _pair(chunk, dtype)
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(0, TINY.vocab, (2, TINY.seq_len), generator=gen)
    y = torch.randint(0, TINY.vocab, (2, TINY.seq_len), generator=gen)
    want = whole.loss(whole(x), y)
    got = chunked.loss(chunked(x), y)
    assert got.dtype == want.dtype == torch.float32
    assert got.item() == pytest.approx(want.item(), rel=1e-6 if dtype == torch.float32 else 1e-4)
    want.backward()
    got.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for (name, p), (_, q) in zip(whole.named_parameters(), chunked.named_parameters(),
                                 strict=True):
        a, b = p.grad.float(), q.grad.float()
        assert (a - b).abs().max().item() <= tol * a.abs().max().item() + 1e-8, name


def test_tied_embeddings_sum_both_gradients_into_the_one_tensor():
    """``tie_embeddings`` (pp = 1): the chunked loss's head gradient and the embedding's add
    up in the one shared weight, as with the whole-sequence head."""
    model = replace(TINY, tie_embeddings=True)
    whole, chunked = _pair(5, torch.float32, model)
    assert chunked.lm_head.weight is chunked.model.embed_tokens.weight
    x = torch.randint(0, model.vocab, (2, model.seq_len))
    y = torch.randint(0, model.vocab, (2, model.seq_len))
    whole.loss(whole(x), y).backward()
    chunked.loss(chunked(x), y).backward()
    for (name, p), (_, q) in zip(whole.named_parameters(), chunked.named_parameters(),
                                 strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name


class _LogitShapes(TorchDispatchMode):
    """Records the leading sizes of every op output whose last dimension is ``rows``, except
    views of ``weight`` (the head's transposed weight is ``hidden × rows``)."""

    def __init__(self, rows: int, weight: torch.Tensor) -> None:
        super().__init__()
        self.rows, self.tokens = rows, []
        self.weight = weight.untyped_storage().data_ptr()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.rows
                    and t.untyped_storage().data_ptr() != self.weight):
                self.tokens.append(t.numel() // self.rows)
        return out


def test_no_op_ever_makes_more_than_one_chunk_of_logits():
    """Forward and backward of the chunked head and loss over 2 × 128 tokens in chunks of 16:
    every tensor a vocabulary wide holds at most 16 tokens (the head's weight and its
    gradient, ``vocab × hidden``, are vocabulary tall, not wide); the whole-sequence head
    makes 256-token ones."""
    model = replace(TINY, seq_len=128, vocab=512)
    whole, chunked = _pair(16, torch.float32, model)
    y = torch.randint(0, model.vocab, (2, model.seq_len))
    for net, most in ((chunked, 16), (whole, 256)):
        h = net.model.norm(torch.randn(2, model.seq_len, model.hidden, requires_grad=True))
        with _LogitShapes(model.vocab, net.lm_head.weight) as seen:
            net.loss(net.head_output(h), y).backward()
        assert max(seen.tokens) == most


@pytest.mark.slow
@pytest.mark.parametrize("seq_len,tp,schedule", [(32, 2, "1f1b"), (31, 2, "1f1b"),
                                                 (32, 1, "zb-h1")])
def test_chunked_loss_runs_match_the_single_process_reference(tmp_path, seq_len, tp,
                                                              schedule):
    """Two pipeline stages, the last one's loss in chunks of 5 tokens (micro batch 2: 64 or
    62 tokens, the last chunk short): TP 2 with sequence parallelism and a vocabulary-parallel
    head (seq 32: the head's input is gathered inside the loss), plain TP 2 (seq 31, which 2
    does not divide), and ZB-H1 (the head's weight gradient is made in B, not deferred).
    Losses equal the single-process whole-sequence reference."""
    steps = 4
    model = dataclasses.replace(TINY, seq_len=seq_len)
    plan = tiny_plan([(0, 2, "pool-a"), (2, 4, "pool-b")], dp=1, steps=steps, tp=tp,
                     num_microbatches=4, model=model, schedule=schedule, loss_chunk_tokens=5)
    assert plan.training.loss_chunk_tokens == 5
    summary = tmp_path / "summary"
    got = run_losses(plan, tmp_path / "run", {"HETTRAIN_METRICS_PORT": "0",
                                              "HETTRAIN_SUMMARY_DIR": str(summary)},
                     tmp_path / "loss.jsonl")
    ref = reference_losses(plan, steps)  # one process, the whole-sequence head (lm_loss)
    assert sorted(got) == list(range(steps))
    for step, want in enumerate(ref):
        assert got[step] == pytest.approx(want, rel=RTOL), step
    last = [r.rank for r in plan.ranks if r.stage == 1]
    for r in last:  # the head's ranks ran the chunked loss
        assert "LM head and loss in chunks of 5 tokens" in (
            tmp_path / "run" / f"rank-{r}.log").read_text()
    if seq_len == 32 and tp == 2:
        # the TP collectives of a last-stage rank per microbatch, as in
        # test_tensor_parallel's sequence-parallel count, but the cross-entropy's three
        # all-reduces (max, exponential sums, target logit) run per chunk: 13 chunks of 64
        # tokens
        for r in last:
            ops = json.loads((summary / f"rank-{r}.json").read_text())["ops"]["intra_pool"]
            assert ops == (12 * 2 + 1 + 1 + 1 + 3 + 3 * 13) * 4 * steps


def _job(seq: int, recompute: str = "selective", gb: int = 8) -> dict:
    return {"model": {"preset": "llama3-8b", "seqLen": seq},
            "training": {"globalBatch": gb, "steps": 1, "recompute": recompute}}


def test_the_chunked_loss_is_priced_exactly():
    """The chunk the planner tries (``cost.loss_chunk_tokens``): none at 8k tokens, 2048 from
    16k. Its price: the last stage's memory at 32k tokens (one sequence, TP 1) drops by the
    saved log-softmax and the whole-sequence logit buffers, less the chunked backward's
    buffers (each the larger of it and the backward's MLP working set), exactly; its head
    time grows by one forward GEMM (a third of the head's three) and the chunks' kernel
    launches."""
    assert [cost.loss_chunk_tokens(parse_job_spec(_job(s)).model)
            for s in (8192, 16384, 131072)] == [0, 2048, 2048]
    spec = parse_job_spec(_job(32768))
    model, whole = spec.model, spec.training
    chunked = replace(whole, loss_chunk_tokens=2048)
    args = dict(tp=1, dp=1, micro_batch=1, first=False, last=True,
                **cost.schedule_memory_args(0, 1, 1, "1f1b"))
    before = cost.stage_memory(model, whole, **args).bytes_for(4)
    after = cost.stage_memory(model, chunked, **args).bytes_for(4)
    s, v, h = model.seq_len, model.vocab, model.hidden
    saved = s * v * 4.0 - s * 4.0  # fp32 log-softmax -> one fp32 log-sum-exp per token
    buffers = s * v * (2 * 2 + 4.0)  # logits, their gradient, their fp32 copy (bf16)
    chunk = 2048 * v * (2 + 4.0)  # one chunk's logits in bf16 and fp32
    sums = v * h * 4.0 + s * h * 2.0  # the fp32 weight-gradient sum, the input gradient
    # the loss's buffers and the backward's working set (an MLP backward) are never alive
    # together: the larger counts, and the chunked loss's hide under the MLP's here
    mlp = cost.mlp_backward_transient_bytes(model, 1, 1)
    assert mlp > chunk + sums
    assert before - after == pytest.approx(saved + max(buffers, mlp) - max(chunk + sums, mlp),
                                           rel=1e-12)
    assert before - after > 20e9  # 32k tokens × 128k vocabulary: tens of GB
    dev = CATALOG["H100-SXM"]
    head = cost.head_time_s(model, 1, 1, dev)
    gemm = cost.head_forward_flops(model, s) / dev.matmul_flops(2)
    assert cost.head_time_s(model, 1, 1, dev, loss_chunk_tokens=2048) == pytest.approx(
        head + gemm + (4 * 16 - 3) * cost.KERNEL_FIXED_S, rel=1e-12)


@pytest.mark.parametrize("device,nodes,seq,recompute,chunked", [
    ("L40S", 2, 65536, "selective", True),   # memory-bound: the chunked loss fits a faster layout
    ("H100-SXM", 1, 65536, "auto", True),
    ("H100-SXM", 2, 32768, "auto", False),   # memory to spare: the extra head GEMM only costs
    ("H100-SXM", 2, 8192, "selective", False),  # below 16k tokens only the whole loss is tried
])
def test_the_planner_keeps_the_faster_of_the_whole_and_the_chunked_loss(device, nodes, seq,
                                                                        recompute, chunked):
    """From 16k tokens plan_job plans the whole-sequence loss and the chunked one and keeps
    the faster (ties: whole), with a note naming both; the plan carries the choice to the
    runtime (its JSON round-trips it)."""
    from hettrain.planning import planner
    from hettrain.planning.inventory import load_cluster
    from hettrain.planning.plan import Plan

    inv = load_cluster(single_pool_cluster(device, nodes))
    spec = parse_job_spec(_job(seq, recompute, gb=max(1, 2**18 // seq)))
    plan = planner.plan_job("j", spec, inv)
    assert plan.training.loss_chunk_tokens == (2048 if chunked else 0)
    if seq >= cost.LOSS_CHUNK_MIN_SEQ_LEN:
        with planner.loss_as_given():  # each variant alone, as plan_job plans them
            times = [planner.plan_job("j", replace(spec, training=replace(
                spec.training, loss_chunk_tokens=c)), inv).predicted.step_time_s
                for c in (0, 2048)]
        assert plan.predicted.step_time_s == pytest.approx(min(times), rel=1e-12)
        assert (times[1] < times[0]) == chunked
        assert any(n.startswith("loss=auto chose") for n in plan.notes)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.training.loss_chunk_tokens == plan.training.loss_chunk_tokens


def test_a_bad_chunk_is_refused_by_name_and_an_old_plan_loads_whole():
    """``support.unsupported`` (the runtime's start-up check, ``hettrain plan``'s too) names
    a negative or non-integer chunk; a plan written before the field loads with 0."""
    from hettrain.planning.support import unsupported

    plan = tiny_plan([(0, 4, "pool-a")], dp=1)
    assert plan.training.loss_chunk_tokens == 0
    assert not any("loss_chunk_tokens" in e for e in unsupported(plan))
    for bad in (-1, 2.5):
        errors = unsupported(replace(plan, training=replace(plan.training,
                                                            loss_chunk_tokens=bad)))
        assert [e for e in errors if e.startswith(f"plan.training.loss_chunk_tokens={bad!r}")]
    doc = dataclasses.asdict(plan.training)
    del doc["loss_chunk_tokens"]
    assert type(plan.training)(**doc).loss_chunk_tokens == 0
    with pytest.raises(ValueError, match="loss_chunk_tokens=-3"):
        StageModel(TINY, 0, 4, has_embedding=True, has_head=True, seed=1, loss_chunk_tokens=-3)
