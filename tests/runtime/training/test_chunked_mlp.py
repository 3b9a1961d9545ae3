"""The chunked MLP (``plan.training.mlp_chunk_tokens``, HelixPipe's chunked MLP, with a layer
re-run in the backward): the same loss and gradients as the whole MLP, never an ffn-wide tensor
over more than one chunk, a re-run that skips the MLP (exactly the GEMMs the cost model
prices), a backward whose live bytes the cost model bounds, the same losses as the
single-process reference on multi-process layouts, and the planner's choice."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

import pytest
import torch
from tests.runtime.training.plans import TINY, single_pool_cluster, tiny_plan
from tests.runtime.training.runs import run_losses
from torch.utils._python_dispatch import TorchDispatchMode

from hettrain.api.spec import RECOMPUTE_MODES, parse_job_spec
from hettrain.planning import cost
from hettrain.planning.catalog import CATALOG
from hettrain.planning.support import unsupported
from hettrain.runtime.memory import _mlp_backward_transient, build_stage
from hettrain.runtime.model import StageModel
from hettrain.runtime.trainer import reference_losses

RTOL = 2e-4  # as the other fp32 multi-process reference tests
GELU = replace(TINY, gated_mlp=False)


def _pair(chunk: int, mode: str, model=TINY, dtype=torch.float64):
    return [StageModel(model, 0, model.layers, has_embedding=True, has_head=True, seed=3,
                       recompute=mode, mlp_chunk_tokens=c).to(dtype) for c in (0, chunk)]


@pytest.mark.parametrize("model", [TINY, GELU], ids=["swiglu", "gelu"])
@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_mlp_loss_and_gradients_equal_the_whole_mlp(model, mode, chunk):
    """Batch 2 × 32 tokens in chunks of 1, of 7 (the last one short), of 64 (the batch) and of
    more: in fp64 the loss and every gradient equal the whole MLP's to rounding."""
    whole, chunked = _pair(chunk, mode, model)
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(0, model.vocab, (2, model.seq_len), generator=gen)
    y = torch.randint(0, model.vocab, (2, model.seq_len), generator=gen)
    want, got = whole.loss(whole(x), y), chunked.loss(chunked(x), y)
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    want.backward()
    got.backward()
    for (name, p), (_, q) in zip(whole.named_parameters(), chunked.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_bf16_gradients_stay_within_rounding():
    """bf16, full recompute, chunks of 7: every gradient within bf16's rounding of its
    largest element (the chunks' weight gradients are summed in fp32)."""
    whole, chunked = _pair(7, "full", dtype=torch.bfloat16)
    x = torch.randint(0, TINY.vocab, (2, TINY.seq_len), generator=torch.Generator().manual_seed(1))
    for net in (whole, chunked):
        net.loss(net(x), x).backward()
    for (name, p), (_, q) in zip(whole.named_parameters(), chunked.named_parameters(),
                                 strict=True):
        a, b = p.grad.float(), q.grad.float()
        assert (a - b).abs().max().item() <= 2e-2 * a.abs().max().item() + 1e-8, name


class _FfnShapes(TorchDispatchMode):
    """Token counts of every tensor an op makes that is ``ffn`` wide (but the weights)."""

    def __init__(self, ffn: int) -> None:
        super().__init__()
        self.ffn, self.tokens = ffn, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.ffn:
                self.tokens.append(t.numel() // self.ffn)
        return out


@pytest.mark.parametrize("mode", ["full", "attention-free"])
def test_no_op_ever_makes_an_ffn_wide_tensor_over_more_than_one_chunk(mode):
    """Forward and backward of a re-run model over 2 × 128 tokens with the MLP in chunks of
    16: every ffn-wide tensor holds at most 16 tokens; the whole MLP makes 256-token ones.
    (The down projection's weight, its gradient and fp32 sum are ``hidden`` = 8 rows of ffn.)"""
    model = replace(TINY, seq_len=128, hidden=8, heads=2, kv_heads=1, ffn_hidden=96)
    whole, chunked = _pair(16, mode, model, torch.float32)
    x = torch.randint(0, model.vocab, (2, model.seq_len))
    for net, most in ((chunked, 16), (whole, 256)):
        with _FfnShapes(model.ffn_hidden) as seen:
            net.loss(net(x), x).backward()
        assert max(seen.tokens) == most


class _Gemms(TorchDispatchMode):
    """FLOPs of the matrix products (``mm``, ``addmm``, in place too, ``bmm``)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.ops = {torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm,
                    torch.ops.aten.addmm_}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func._overloadpacket
        if packet in self.ops:
            a, b = (args[0], args[1]) if packet in (torch.ops.aten.mm, torch.ops.aten.bmm) \
                else (args[1], args[2])
            self.flops += 2 * a.numel() * b.shape[-1]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_the_chunked_mlp_runs_the_gemms_the_cost_model_prices(mode):
    """Counted GEMM FLOPs of one forward + backward, chunked minus whole, per layer: a re-run
    layer skips its MLP and the backward recomputes the input projections, so the down
    projection's re-run forward is saved (``2·T·h·f``); without a re-run the input
    projections are recomputed (``2·T·mlp_input_params``) -- exactly the change of
    ``cost.modelled_layer_s``'s GEMM term."""
    counted = []
    for net in _pair(24, mode, dtype=torch.float32):
        x = torch.randint(0, TINY.vocab, (2, TINY.seq_len),
                          generator=torch.Generator().manual_seed(0))
        with _Gemms() as gemms:
            net.loss(net(x), x).backward()
        counted.append(gemms.flops)
    tokens = 2 * TINY.seq_len
    mlp = cost.mlp_input_params(TINY) + TINY.hidden * TINY.ffn_hidden
    passes = cost.compute_passes(mode)
    per_layer = 2 * tokens * ((3 - passes) * mlp + cost.mlp_input_params(TINY))
    assert counted[1] - counted[0] == TINY.layers * per_layer
    if cost.reruns_layer(mode):
        assert per_layer == -2 * tokens * TINY.hidden * TINY.ffn_hidden


def _mlp_case(gated: bool, tp: int, chunk: int, hidden: int, ffn: int, mb: int):
    model = replace(TINY, layers=4, hidden=hidden, ffn_hidden=ffn, heads=4, seq_len=64,
                    kv_heads=4 if gated else 2, gated_mlp=gated)
    return tiny_plan([(0, 2, "a"), (2, 4, "b")], dp=1, tp=tp, micro_batch=mb,
                     num_microbatches=4, model=model, recompute="full", mlp_chunk_tokens=chunk)


@pytest.mark.parametrize("gated", [True, False], ids=["swiglu", "gelu"])
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2-sp"])
@pytest.mark.parametrize("chunk", [0, 32], ids=["whole", "chunked"])
@pytest.mark.parametrize("hidden,ffn", [(64, 256), (256, 64), (128, 128), (64, 1024)])
@pytest.mark.parametrize("mb", [1, 2])
def test_the_mlp_backward_transient_is_bounded_by_the_cost_model(gated, tp, chunk, hidden, ffn,
                                                                 mb):
    """What one MLP backward allocates at its peak (``runtime.memory``'s live count, the
    weight gradients folded as the optimizer does) against
    ``cost.mlp_backward_transient_bytes``: never above, within 1.5x on these small shapes
    (where ``h·f`` rivals ``T·f`` and the phases blur), exact where the ffn-wide tensors
    dominate without TP (ffn 1024: the whole MLP's activation phase, the chunked MLP's loop)."""
    plan = _mlp_case(gated, tp, chunk, hidden, ffn, mb)
    model, _ = build_stage(plan, 0)
    layer = next(iter(model.layers.values()))
    seq = plan.model.seq_len // (model.sp.size if model.sp is not None else 1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((mb, seq, hidden), generator=gen)
    got = _mlp_backward_transient(layer, x, gen)
    want = cost.mlp_backward_transient_bytes(plan.model, mb, tp, 4, chunk)
    assert got <= want <= 1.5 * got
    if ffn == 1024 and tp == 1:
        assert want == got


def _stage_args(model, tp=1, mb=1):
    return dict(tp=tp, dp=1, micro_batch=mb, first=False, last=False,
                **cost.schedule_memory_args(0, 2, 4, "1f1b"))


def test_the_chunked_mlp_is_priced_exactly():
    """The chunk the planner tries (``cost.mlp_chunk_tokens``): only for a re-run layer, from
    16k tokens. Its price for llama3-8b at 32k, full recompute, TP 1: the stage's memory drops
    by the whole MLP's saved gate and up and its backward transient (5 ffn-wide tensors of
    the sequence) less the larger of the chunked one's (7 of a chunk, the fp32 sums, the input
    gradient) and the attention backward's, exactly; a layer's time drops by the re-run's down
    projection and rises by the chunks' kernel launches."""
    def job(seq, recompute):
        return parse_job_spec({"model": {"preset": "llama3-8b", "seqLen": seq},
                               "training": {"globalBatch": 8, "steps": 1,
                                            "recompute": recompute}})
    assert [cost.mlp_chunk_tokens(s.model, s.training) for s in (
        job(8192, "full"), job(16384, "full"), job(131072, "attention-free"),
        job(131072, "selective"), job(131072, "none"))] == [0, 4096, 4096, 0, 0]
    spec = job(32768, "full")
    model, whole = spec.model, spec.training
    chunked = replace(whole, mlp_chunk_tokens=4096)
    before = cost.stage_memory(model, whole, **_stage_args(model)).bytes_for(4)
    after = cost.stage_memory(model, chunked, **_stage_args(model)).bytes_for(4)
    s, h, f = model.seq_len, model.hidden, model.ffn_hidden
    saved = s * 2 * f * 2.0  # gate and up, bf16
    whole_peak = 5 * s * f * 2.0
    chunk_peak = 7 * 4096 * f * 2.0 + 3 * h * f * 4.0 + h * f * 2.0 + s * h * 2.0
    attention = 7 * s * h * 4.0 + 4 * h * h * 2.0  # fp32 gradients; four weight gradients
    # the backward's peak is the larger of the MLP's and the attention's: the chunked MLP's
    # falls below the attention's, which then bounds the saving
    assert chunk_peak < attention < whole_peak
    assert before - after == pytest.approx(saved + whole_peak - attention, rel=1e-12)
    assert before - after > 2.5e9  # 32k tokens × 14336 ffn: gigabytes
    dev = CATALOG["H100-SXM"]
    t_whole = cost.modelled_layer_s(model, 1, 1, dev, "full")
    t_chunk = cost.modelled_layer_s(model, 1, 1, dev, "full", mlp_chunk_tokens=4096)
    down = 2.0 * s * h * f / dev.matmul_flops(2)
    elementwise = s * cost.ELEMENTWISE_BYTES_PER_FFN * f / (dev.hbm_tbps * 1e12)
    launches = (s // 4096 - 1) * cost.MLP_CHUNK_KERNELS * cost.KERNEL_FIXED_S
    assert t_whole - t_chunk == pytest.approx(down + elementwise - launches, rel=1e-9)


@pytest.mark.parametrize("device,nodes,seq,recompute,schedule,chunked", [
    ("H100-SXM", 2, 32768, "full", "auto", True),
    ("L40S", 2, 65536, "attention-free", "auto", True),
    ("H100-SXM", 2, 32768, "full", "zb-h1", False),  # no W pass beside the chunked MLP
    ("H100-SXM", 2, 32768, "selective", "auto", False),  # no re-run: never tried
    ("H100-SXM", 2, 8192, "full", "auto", False),  # below 16k tokens: never tried
])
def test_the_planner_keeps_the_faster_of_the_whole_and_the_chunked_mlp(device, nodes, seq,
                                                                       recompute, schedule,
                                                                       chunked):
    """With a re-run layer from 16k tokens plan_job plans the chunked MLP (without ZB-H1) and
    the whole one and keeps the faster, with a note naming both; a pinned ZB-H1 keeps the
    whole MLP; the plan carries the choice (its JSON round-trips it) and the runtime's check
    accepts it."""
    from hettrain.planning import planner
    from hettrain.planning.inventory import load_cluster
    from hettrain.planning.plan import Plan

    inv = load_cluster(single_pool_cluster(device, nodes))
    spec = parse_job_spec({"model": {"preset": "llama3-8b", "seqLen": seq},
                           "training": {"globalBatch": max(1, 2**18 // seq), "steps": 1,
                                        "recompute": recompute},
                           "parallelism": {"schedule": schedule}})
    plan = planner.plan_job("j", spec, inv)
    assert plan.training.mlp_chunk_tokens == (4096 if chunked else 0)
    if chunked:
        assert plan.schedule not in ("zb-h1", "interleaved-zb")
        with planner.mlp_as_given():  # each variant alone, as plan_job plans them
            times = [planner.plan_job("j", replace(spec, training=replace(
                spec.training, mlp_chunk_tokens=c)), inv).predicted.step_time_s
                for c in (0, 4096)]
        assert plan.predicted.step_time_s == pytest.approx(min(times), rel=1e-12)
        assert times[1] < times[0]
        assert any(n.startswith("mlp=auto chose") for n in plan.notes)
    assert not [e for e in unsupported(plan) if "mlp_chunk_tokens" in e]
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.training.mlp_chunk_tokens == plan.training.mlp_chunk_tokens


def test_a_chunk_the_runtime_cannot_honour_is_refused_by_name():
    """``support.unsupported`` (the runtime's start-up check, ``hettrain plan``'s too) names a
    negative or non-integer chunk, a chunk without a re-run layer and one beside a W pass; a
    plan written before the field loads with 0."""
    plan = tiny_plan([(0, 2, "a"), (2, 4, "b")], dp=1, recompute="full")
    assert plan.training.mlp_chunk_tokens == 0
    assert not any("mlp_chunk_tokens" in e for e in unsupported(plan))

    def errors(p, **training):
        return [e for e in unsupported(replace(p, training=replace(p.training, **training)))
                if e.startswith("plan.training.mlp_chunk_tokens")]
    for bad in (-1, 2.5, True):
        assert errors(plan, mlp_chunk_tokens=bad)
    assert not errors(plan, mlp_chunk_tokens=16)
    assert "recompute=selective" in errors(plan, mlp_chunk_tokens=16, recompute="selective")[0]
    zb = replace(plan, schedule="zb-h1")
    assert "plan.schedule=zb-h1" in errors(zb, mlp_chunk_tokens=16)[0]
    doc = dataclasses.asdict(plan.training)
    del doc["mlp_chunk_tokens"]
    assert type(plan.training)(**doc).mlp_chunk_tokens == 0
    with pytest.raises(ValueError, match="mlp_chunk_tokens=-3"):
        StageModel(TINY, 0, 4, has_embedding=True, has_head=True, seed=1, mlp_chunk_tokens=-3)


@pytest.mark.slow
@pytest.mark.parametrize("seq_len,tp,schedule,recompute", [
    (32, 2, "1f1b", "full"),  # sequence parallel: the chunks run on the gathered sequence
    (31, 2, "1f1b", "attention-free"),  # plain TP (2 does not divide 31)
    (32, 1, "interleaved", "full"),
])
def test_chunked_mlp_runs_match_the_single_process_reference(tmp_path, seq_len, tp, schedule,
                                                             recompute):
    """Two pipeline stages, every MLP in chunks of 5 tokens (micro batch 2: 64 or 62 tokens,
    the last chunk short): TP 2 with and without sequence parallelism, and the interleaved
    schedule; losses equal the single-process reference with the whole MLP."""
    steps = 4
    model = dataclasses.replace(TINY, seq_len=seq_len)
    splits = [(0, 2, "pool-a"), (2, 4, "pool-b")]
    plan = tiny_plan(splits, dp=1, steps=steps, tp=tp, num_microbatches=4, model=model,
                     schedule=schedule, recompute=recompute, mlp_chunk_tokens=5)
    if schedule == "interleaved":
        plan = replace(plan, virtual_stages=2)
    assert not unsupported(plan)
    got = run_losses(plan, tmp_path / "run", {"HETTRAIN_METRICS_PORT": "0"},
                     tmp_path / "loss.jsonl")
    whole = replace(plan, training=replace(plan.training, mlp_chunk_tokens=0))
    ref = reference_losses(whole, steps)
    assert sorted(got) == list(range(steps))
    for step, want in enumerate(ref):
        assert got[step] == pytest.approx(want, rel=RTOL), step
    for r in plan.ranks:
        assert "MLP in chunks of 5 tokens" in (tmp_path / "run" / f"rank-{r.rank}.log").read_text()
