"""Llama-family decoder that can be built whole or as a pipeline slice / TP shard / model chunk.

The block is Llama's (Touvron et al. 2023; Llama 3, Dubey et al. 2024): pre-norm RMSNorm,
rotary position embeddings (RoPE) with optional Llama 3.1 frequency scaling, grouped-query
attention (``kv_heads < heads``), a SwiGLU MLP (``down(silu(gate(x)) * up(x))``; a plain GELU MLP
``down(gelu(up(x)))`` when ``spec.gated_mlp`` is false, for GPT-shaped presets), no biases,
untied or tied (``spec.tie_embeddings``) input/output embeddings. The numerics follow
Hugging Face's ``LlamaForCausalLM`` (tested against it: same weights, same logits and loss).

Parameter names are Hugging Face's with GLOBAL layer indices
(``model.embed_tokens.weight``, ``model.layers.7.self_attn.q_proj.weight``,
``model.layers.7.mlp.down_proj.weight``, ``model.layers.7.input_layernorm.weight``,
``model.norm.weight``, ``lm_head.weight``), which is what lets a checkpoint be resharded onto a
different pipeline layout and a Hugging Face checkpoint be read by name. Initialisation is
seeded per global layer index (``seed * 1000 + layer``; embedding and head have their own
seeds), so a model built in slices holds exactly the weights of the whole model. A stage of the
interleaved schedule holds several model chunks (global layer ranges, ``StageModel(...,
chunks=...)``) in one module, so the names, the DP sync and the checkpoints are the same as for
a contiguous slice.

Tied embeddings: in a stage holding both ends the output layer IS the embedding parameter
(one tensor, listed once by ``named_parameters`` as ``model.embed_tokens.weight``). A last stage
without the embedding holds a COPY initialised to the same seeded values; keeping the copies
equal would need their gradients summed across the first and last stage, which the runtime
does not do, so :func:`check_layout` refuses tied embeddings with ``pp > 1``.

Activation recompute (``recompute=``, the plan's ``training.recompute``): ``none`` keeps every
activation for the backward; ``selective`` recomputes the attention core (scores, softmax,
weighted values: the ``s²`` terms, Korthikanti et al. 2023) in the backward; ``full`` keeps only
each block's input and re-runs the whole block (``torch.utils.checkpoint``, non-reentrant);
``attention-free`` (HelixPipe's attention-free recompute, Zhang et al. 2025) re-runs the whole
block too but keeps the attention kernel's outputs (its output and log-sum-exp: selective
activation checkpointing, :func:`keep_attention_outputs`), so the backward re-runs norms,
projections and MLP but never the ``s²`` attention. Gradients are identical in every mode.

Vocabulary-parallel TP (Megatron's ``VocabParallelEmbedding`` / parallel cross-entropy): when
the stage is TP-sharded and ``vocab`` divides by ``tp`` (:func:`hettrain.planning.cost.
vocab_shards`), each TP rank holds ``vocab/tp`` rows of the token embedding and of the output
layer. The embedding looks up the ids in its range, zeroes the others and sums the partial
embeddings over the TP group; the output layer produces this rank's slice of the logits and
:meth:`StageModel.loss` computes the cross-entropy from the slices (max, sum of exponentials and
the target logit reduced over the TP group) without ever gathering the logits.

Every projection is a :class:`Linear` whose weight gradient can be DEFERRED for ZB-H1: inside
``with defer_weight_grads() as store`` a backward computes only input gradients (and the small
norm/embedding gradients) and stashes ``(input, grad_output)`` per linear; ``store.flush()``
later adds ``grad_outputᵀ · input`` to each weight's ``.grad`` (the ``W`` pass). Outside the
context the backward is the ordinary one. Recompute works inside the context too (the
recomputed forward runs in the backward, whose linears then stash as usual).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from hettrain.api.spec import RECOMPUTE_MODES, ModelSpec
from hettrain.runtime.tensor_parallel import (
    TPGroup,
    all_reduce_in_tp,
    copy_to_tp,
    gather_sequence,
    reduce_from_tp,
    scatter_sequence,
    start_seq_gather,
    start_seq_reduce_scatter,
)

log = logging.getLogger("hettrain.runtime.model")

EMBED_SEED_OFFSET = 997
HEAD_SEED_OFFSET = 998
INIT_STD = 0.02


class WeightGradStore:
    """Deferred weight-gradient work of one backward: ``(weight, input, grad_output)`` items."""

    def __init__(self) -> None:
        self.items: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []

    def flush(self) -> None:
        """Run the W pass: accumulate every stashed ``grad_outputᵀ · input`` into ``.grad``."""
        with torch.no_grad():
            for weight, x, g in self.items:
                gw = _weight_grad_gemm(x, g)
                main = getattr(weight, "main_grad", None)  # runtime.optim's fp32 accumulator
                if main is not None:
                    main.add_(gw)
                    ready = getattr(weight, "main_grad_ready", None)  # overlapped DP sync
                    if ready is not None:
                        ready(weight)
                elif weight.grad is None:
                    weight.grad = gw
                else:
                    weight.grad.add_(gw)
        self.items.clear()


_STORE: list[WeightGradStore] = []  # innermost active deferral context last


def _weight_grad_gemm(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A linear's weight gradient ``grad_outputᵀ · input`` over every token."""
    return g.reshape(-1, g.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


def _weight_grad(param: nn.Parameter, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    """The weight gradient of ``param`` from its input ``x`` and output gradient ``g``; None
    inside :class:`defer_weight_grads`, which stashes the pair for the W pass instead."""
    if _STORE:
        _STORE[-1].items.append((param, x.detach(), g.detach()))
        return None
    return _weight_grad_gemm(x, g)


class defer_weight_grads:
    """Context in which :class:`Linear` backwards stash their weight gradient in a new
    :class:`WeightGradStore` (returned by ``__enter__``) instead of computing it."""

    def __enter__(self) -> WeightGradStore:
        self.store = WeightGradStore()
        _STORE.append(self.store)
        return self.store

    def __exit__(self, *exc) -> None:
        _STORE.remove(self.store)


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        # the Parameter itself, for the W pass: a saved tensor unpacked after a recompute
        # (torch.utils.checkpoint) is another tensor object whose .grad nobody reads
        ctx.param = weight
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        gx = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        return gx, (_weight_grad(ctx.param, x, grad) if ctx.needs_input_grad[1] else None)


class Linear(nn.Linear):
    """Bias-free ``nn.Linear`` (same parameters and init) whose weight gradient can be
    deferred to a W pass (:func:`defer_weight_grads`). With ``deferrable`` off (schedules
    without a W pass, :func:`set_weight_grad_deferral`) it is torch's own linear: the custom
    autograd function costs ~5 % of a CPU step."""

    deferrable = True

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        # sequence parallelism: x is a token shard, gathered here (:class:`_GatherLinears`)
        self.gather: TPGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather is not None:
            return _GatherLinears.apply(x, self.gather, self.weight)[0]
        if self.deferrable:
            return _SplitLinear.apply(x, self.weight)
        return F.linear(x, self.weight)


def set_weight_grad_deferral(model: nn.Module, on: bool) -> None:
    """Whether ``model``'s :class:`Linear` layers can defer weight gradients (ZB-H1 needs it;
    every other schedule runs faster without)."""
    for mod in model.modules():
        if isinstance(mod, Linear):
            mod.deferrable = on


class _GatherLinears(torch.autograd.Function):
    """Sequence parallelism's column-parallel group: all-gather the sequence shard ``x`` over
    the TP group and apply each weight to the whole sequence. Keeps only the shard for the
    backward and gathers it again there (Megatron's choice: a second all-gather instead of
    a replica of the input per layer) while the input gradient's GEMMs run; the input
    gradient's reduce-scatter then runs during the weight gradients' GEMMs. So the backward
    exposes at most what plain TP's does: the output gradient's all-gather and the input
    gradient's reduce-scatter, one all-reduce's bytes. Weight gradients are deferred to the
    W pass inside :func:`defer_weight_grads`, as :class:`Linear`'s."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup, *weights: torch.Tensor):
        ctx.save_for_backward(x, *weights)
        ctx.tp, ctx.params = tp, weights  # the Parameters themselves (see _SplitLinear)
        full = start_seq_gather(x, tp).wait()
        return tuple(F.linear(full, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        x, *weights = ctx.saved_tensors
        gathering = start_seq_gather(x, ctx.tp)  # overlaps the input gradient's GEMMs
        gx = None
        for g, w in zip(grads, weights, strict=True):
            if g is not None:
                part = g.matmul(w)
                gx = part if gx is None else gx.add_(part)
        # the input gradient leaves while the weight gradients' GEMMs run
        scattering = None if gx is None else start_seq_reduce_scatter(gx, ctx.tp)
        full = gathering.wait()
        gws = [None if g is None or not ctx.needs_input_grad[2 + i]
               else _weight_grad(ctx.params[i], full, g) for i, g in enumerate(grads)]
        return (None if scattering is None else scattering.wait(), None, *gws)


def gather_linears(x: torch.Tensor, tp: TPGroup, linears: Sequence[nn.Linear]
                   ) -> tuple[torch.Tensor, ...]:
    """Each linear applied to the whole sequence gathered from the shards ``x``
    (:class:`_GatherLinears`)."""
    return _GatherLinears.apply(x, tp, *(lin.weight for lin in linears))


class Embedding(nn.Embedding):
    """Token embedding (``nn.Embedding``: same parameter and init); after
    :func:`hettrain.runtime.tensor_parallel.shard_stage_` shards the vocabulary it holds rows
    ``[vocab_start, vocab_start + num_embeddings)`` and sums the TP ranks' partial lookups."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__(vocab, hidden)
        self.vocab_start = 0
        self.vocab_sharded = False
        self.tp_group = None  # set by tensor_parallel.shard_stage_ with the vocabulary shard

    def forward(self, ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The embeddings of ``ids``; vocabulary-parallel with ``reduce`` off: this rank's
        partial lookup, for the caller to sum (sequence parallelism reduce-scatters it)."""
        if not self.vocab_sharded:
            return super().forward(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp_group) if reduce else out


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from this rank's logit columns ``[start, start + V/tp)``; the row
    max, the sum of exponentials and the target logit are all-reduced over the TP group ``tp``
    (None: this shard alone, as ``runtime.memory`` measures it). Keeps the fp32 softmax slice,
    the local target index and its in-range mask for the backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int,
                tp) -> torch.Tensor:
        x = logits.float()
        mx = x.amax(dim=-1, keepdim=True)
        all_reduce_in_tp(mx, tp, torch.distributed.ReduceOp.MAX)
        x = x - mx
        n_local = x.shape[-1]
        local = targets - start
        inside = (local >= 0) & (local < n_local)
        idx = local.clamp(0, n_local - 1)
        picked = x.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * inside
        soft = x.exp_()
        total = soft.sum(dim=-1)
        all_reduce_in_tp(total, tp)
        all_reduce_in_tp(picked, tp)
        loss = (total.log() - picked).mean()
        soft.div_(total.unsqueeze(-1))
        ctx.save_for_backward(soft, idx, inside)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        soft, idx, inside = ctx.saved_tensors
        g = soft.scatter_add(-1, idx.unsqueeze(-1), -inside.unsqueeze(-1).to(soft.dtype))
        g.mul_(grad / idx.numel())
        return g.to(ctx.dtype), None, None, None


class _ChunkedHeadLoss(torch.autograd.Function):
    """Mean cross-entropy of the LM head's logits ``x · weightᵀ`` that never holds more than
    ``chunk`` tokens' logits (the plan's ``training.loss_chunk_tokens``). The forward computes
    each chunk's logits, its log-sum-exp and target logit and drops them, keeping one fp32
    log-sum-exp per token; the backward recomputes each chunk's logits (one more head GEMM),
    forms the softmax gradient from the kept log-sum-exp and adds the chunk's input and weight
    gradients. The weight gradient is summed over the chunks in fp32 and returned by the
    backward itself, also inside :class:`defer_weight_grads`: deferring it to the W pass would
    stash every chunk's logit gradient, the memory this saves.

    Vocabulary-parallel (``tp``: the head holds rows ``[start, start + V/tp)``): each chunk's
    row max, sum of exponentials and target logit are all-reduced over the TP group, as
    :class:`_VocabParallelCrossEntropy` does for the whole sequence; the input gradient is then
    this rank's part of the sum, which ``copy_to_tp``'s backward all-reduces, or (``sp``:
    sequence parallel, ``x`` a token shard gathered here) the gradient's reduce-scatter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk: int, start: int, tp, sp) -> torch.Tensor:
        full = start_seq_gather(x, sp).wait() if sp is not None else x
        xs, t = full.reshape(-1, full.shape[-1]), targets.reshape(-1)
        n, rows = xs.shape[0], weight.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for a in range(0, n, chunk):
            logits = F.linear(xs[a:a + chunk], weight).float()
            mx = logits.amax(dim=-1)
            all_reduce_in_tp(mx, tp, torch.distributed.ReduceOp.MAX)
            logits.sub_(mx.unsqueeze(-1))
            local = t[a:a + chunk] - start
            inside = (local >= 0) & (local < rows)
            picked = logits.gather(-1, local.clamp(0, rows - 1).unsqueeze(-1)).squeeze(-1)
            picked = picked * inside
            sums = logits.exp_().sum(dim=-1)
            del logits
            all_reduce_in_tp(sums, tp)
            all_reduce_in_tp(picked, tp)
            log_sums = sums.log()
            lse[a:a + chunk] = log_sums + mx
            total += (log_sums - picked).sum()
        ctx.save_for_backward(x, weight, targets, lse)
        ctx.chunk, ctx.start, ctx.tp, ctx.sp = chunk, start, tp, sp
        return total / n

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, targets, lse = ctx.saved_tensors
        sp, chunk, start = ctx.sp, ctx.chunk, ctx.start
        full = start_seq_gather(x, sp).wait() if sp is not None else x
        xs, t = full.reshape(-1, full.shape[-1]), targets.reshape(-1)
        n, rows = xs.shape[0], weight.shape[0]
        scale = grad.float() / n
        gx = torch.empty_like(xs)
        gw = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
              if ctx.needs_input_grad[1] else None)
        for a in range(0, n, chunk):
            xc = xs[a:a + chunk]
            p = F.linear(xc, weight).float().sub_(lse[a:a + chunk].unsqueeze(-1)).exp_()
            local = t[a:a + chunk] - start
            inside = (local >= 0) & (local < rows)
            p.scatter_add_(-1, local.clamp(0, rows - 1).unsqueeze(-1),
                           -inside.unsqueeze(-1).to(p.dtype))
            g = p.mul_(scale).to(x.dtype)
            del p
            gx[a:a + chunk] = g.matmul(weight)
            if gw is not None:
                gw.add_(_weight_grad_gemm(xc, g))
            del g
        gx = gx.view(full.shape)
        if sp is not None:  # each rank's part of the sum, summed into its token shard
            gx = start_seq_reduce_scatter(gx, sp).wait()
        if gw is not None and weight.dtype != torch.float32:
            gw = gw.to(weight.dtype)
        return gx, gw, None, None, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm (as HF): normalised in fp32, cast back, then scaled."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class _LeanRMSNorm(torch.autograd.Function):
    """:func:`rms_norm` that keeps only its input for the backward (the fp32 copy, the
    normalised tensor and the statistic are recomputed there: elementwise work, the same ops,
    so the same gradients as autograd's)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xr = x.detach().requires_grad_(ctx.needs_input_grad[0])
            wr = weight.detach().requires_grad_(ctx.needs_input_grad[1])
            out = rms_norm(xr, wr, ctx.eps)
            wanted = [t for t in (xr, wr) if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        gx = next(grads) if xr.requires_grad else None
        gw = next(grads) if wr.requires_grad else None
        return gx, gw, None


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in fp32 (as Llama / HF); keeps
    only its input for the backward (:class:`_LeanRMSNorm`)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps
        # sequence parallelism (tensor_parallel.shard_stage_): this rank normalises its shard
        # of the tokens, so its weight gradient is partial: summed over the TP group
        self.tp_group: TPGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.tp_group is None else copy_to_tp(self.weight, self.tp_group)
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return _LeanRMSNorm.apply(x, w, self.eps)
        return rms_norm(x, w, self.eps)


def _mlp_act(gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
    """The MLP's down-projection input: ``silu(gate) * up`` (SwiGLU) or ``gelu(up)``."""
    return F.gelu(up) if gate is None else F.silu(gate) * up


class _ActDown(torch.autograd.Function):
    """``down(act(gate, up))`` keeping only the projections' outputs (``gate`` and ``up``;
    ``up`` alone for GELU) for the backward: the activation and the down projection's input are
    recomputed there (elementwise), as Megatron's fused bias-SwiGLU does. The down weight's
    gradient is deferred to the W pass inside :func:`defer_weight_grads` (ZB-H1), like
    :class:`Linear`'s."""

    @staticmethod
    def forward(ctx, up: torch.Tensor, weight: torch.Tensor,
                gate: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(up, weight, gate)
        ctx.param = weight  # the Parameter itself, for the W pass (see _SplitLinear)
        return F.linear(_mlp_act(gate, up), weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        up, weight, gate = ctx.saved_tensors
        with torch.enable_grad():
            ur = up.detach().requires_grad_()
            gr = None if gate is None else gate.detach().requires_grad_()
            act = _mlp_act(gr, ur)
        gact = grad.matmul(weight)
        inputs = (ur,) if gr is None else (ur, gr)
        grads = torch.autograd.grad(act, inputs, gact)
        gw = _weight_grad(ctx.param, act.detach(), grad) if ctx.needs_input_grad[1] else None
        return grads[0], gw, (grads[1] if gr is not None else None)


_rerunning = 0  # > 0 while a layer checkpoint re-runs its forward in the backward


class rerun_contexts:
    """Checkpoint contexts (``torch.utils.checkpoint``'s ``context_fn``) of a layer re-run in
    the backward: ``inner`` (attention-free's selective-checkpoint modes) if given, and
    during the re-run a flag :class:`_ChunkedMLP` reads to skip its output, which nothing
    reads there (its backward recomputes each chunk itself)."""

    def __init__(self, inner: Callable[[], tuple[Any, Any]] | None = None) -> None:
        self.inner = inner

    def __call__(self) -> tuple[Any, Any]:
        forward, recompute = self.inner() if self.inner is not None else (nullcontext(),
                                                                           nullcontext())
        return forward, _Rerun(recompute)


class _Rerun:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __enter__(self) -> Any:
        global _rerunning
        _rerunning += 1
        return self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        global _rerunning
        _rerunning -= 1
        return self.inner.__exit__(*exc)


class _ChunkedMLP(torch.autograd.Function):
    """The MLP ``down(act(gate(x), up(x)))`` computed ``chunk`` tokens at a time, keeping only
    its input ``x`` for the backward (HelixPipe's chunked MLP; the plan's
    ``training.mlp_chunk_tokens``, used with a layer re-run in the backward). The forward
    writes each chunk's output into one tensor; the backward recomputes each chunk's gate and
    up projections and activation, and adds its weight gradients into fp32 sums, so no
    ffn-wide tensor ever spans more than one chunk. Inside a layer's re-run
    (:class:`rerun_contexts`) the forward only saves ``x``: the checkpoint discards the re-run's
    output, and the backward recomputes the chunks' gate and up projections anyway, so a
    re-run layer runs one GEMM fewer than with the whole MLP (the re-run's down projection).

    Sequence parallelism (``tp``): ``x`` is this rank's token shard, gathered over the TP
    group in the forward and again in the backward (like :class:`_GatherLinears`), whose input
    gradient is reduce-scattered. Weight gradients are never deferred (no W pass: the planner
    chunks only schedules without one)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, chunk: int, tp: TPGroup | None,
                gate_w: torch.Tensor | None, up_w: torch.Tensor,
                down_w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, gate_w, up_w, down_w)
        ctx.chunk, ctx.tp = chunk, tp
        b, t = x.shape[0], x.shape[1] * (tp.size if tp is not None else 1)
        if _rerunning:
            return x.new_empty((b, t, down_w.shape[0]))
        full = x if tp is None else start_seq_gather(x, tp).wait()
        flat = full.reshape(b * t, full.shape[-1])
        out = flat.new_empty((b * t, down_w.shape[0]))
        for a in range(0, b * t, chunk):
            xc = flat[a:a + chunk]
            gate = None if gate_w is None else F.linear(xc, gate_w)
            out[a:a + chunk] = F.linear(_mlp_act(gate, F.linear(xc, up_w)), down_w)
        return out.view(b, t, -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if _STORE:
            raise RuntimeError("plan.training.mlp_chunk_tokens with a deferred W pass: the "
                               "chunked MLP computes its weight gradients in the backward")
        x, gate_w, up_w, down_w = ctx.saved_tensors
        tp, chunk = ctx.tp, ctx.chunk
        full = x if tp is None else start_seq_gather(x, tp).wait()
        b, t, h = full.shape
        flat, g = full.reshape(b * t, h), grad.reshape(b * t, -1)
        gx = torch.empty_like(flat)
        sums = [None if w is None else torch.zeros(  # fp32 (fp64 stays fp64)
                    w.shape, dtype=torch.promote_types(w.dtype, torch.float32), device=w.device)
                for w in (gate_w, up_w, down_w)]
        for a in range(0, b * t, chunk):
            xc, gc = flat[a:a + chunk], g[a:a + chunk]
            up = F.linear(xc, up_w).requires_grad_()
            gate = None if gate_w is None else F.linear(xc, gate_w).requires_grad_()
            with torch.enable_grad():
                act = _mlp_act(gate, up)
            gact = gc.matmul(down_w)
            sums[2].add_(gc.t().mm(act.detach()))
            inputs = (up,) if gate is None else (gate, up)
            *g_gate, g_up = torch.autograd.grad(act, inputs, gact)
            del act, gact
            part = g_up.matmul(up_w)
            sums[1].add_(g_up.t().mm(xc))
            if g_gate:
                part.addmm_(g_gate[0], gate_w)
                sums[0].add_(g_gate[0].t().mm(xc))
            gx[a:a + chunk] = part
            del up, gate, g_gate, g_up, part
        gx = gx.view(b, t, h)
        if tp is not None:
            gx = start_seq_reduce_scatter(gx, tp).wait()
        need = ctx.needs_input_grad
        grads = [None if s is None or not need[3 + i] else s.to(w.dtype)
                 for i, (s, w) in enumerate(zip(sums, (gate_w, up_w, down_w), strict=True))]
        return gx if need[0] else None, None, None, *grads


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """RoPE inverse frequencies (fp32, ``head_dim/2``), with Llama 3.1 scaling when
    ``spec.rope_factor > 1``: wavelengths above ``original/low_freq_factor`` are divided by the
    factor, those below ``original/high_freq_factor`` kept, the band between interpolated."""
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if spec.rope_factor == 1.0:
        return inv
    factor, lo, hi = spec.rope_factor, spec.rope_low_freq_factor, spec.rope_high_freq_factor
    old = spec.rope_original_max_positions
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(spec: ModelSpec, seq_len: int,
                 device: torch.device | None = None,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape ``(seq_len, head_dim)`` in fp32 for positions ``0..seq_len-1``
    (or, given, for ``positions``: a context-parallel shard's true token positions)."""
    inv = rope_inv_freq(spec).to(device)
    pos = (torch.arange(seq_len, device=device, dtype=torch.float32) if positions is None
           else positions.to(device=device, dtype=torch.float32))
    freqs = torch.outer(pos, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (batch, heads, seq, head_dim) by the position angles."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def _attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention; k/v heads repeated for GQA (``repeat_kv`` order)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class LlamaAttention(nn.Module):
    """Causal self-attention with RoPE and grouped-query heads; ``q/k/v/o_proj`` as in HF."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
            raise ValueError(f"model: hidden ({spec.hidden}) must divide by heads ({spec.heads})"
                             f" and heads by kv_heads ({spec.kv_heads})")
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        self.q_proj = Linear(spec.hidden, spec.heads * spec.head_dim)
        self.k_proj = Linear(spec.hidden, spec.kv_heads * spec.head_dim)
        self.v_proj = Linear(spec.hidden, spec.kv_heads * spec.head_dim)
        self.o_proj = Linear(spec.heads * spec.head_dim, spec.hidden)
        self.tp_group = None  # set by tensor_parallel.shard_stage_ (heads are then local)
        self.sp = False  # sequence parallelism: x is this rank's shard of the tokens
        self.recompute_core = False  # selective recompute: redo the attention core in backward
        self.cp = None  # context_parallel.ContextParallel: the sequence is sharded (enable_)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if self.sp:
            q, k, v = gather_linears(x, self.tp_group, (self.q_proj, self.k_proj, self.v_proj))
            t *= self.tp_group.size
        else:
            x = copy_to_tp(x, self.tp_group)
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.cp is not None:  # keys/values of the whole sequence gathered over the CP group
            y = self.cp.attention(q, k, v, self.recompute_core and torch.is_grad_enabled())
        elif self.recompute_core and torch.is_grad_enabled():
            y = checkpoint(_attention_core, q, k, v, use_reentrant=False)
        else:
            y = _attention_core(q, k, v)
        y = self.o_proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        if self.sp:
            return scatter_sequence(y, self.tp_group, summed=True)
        return reduce_from_tp(y, self.tp_group)


class LlamaMLP(nn.Module):
    """SwiGLU (``gate_proj``, ``up_proj``, ``down_proj``), or GELU (``up_proj``, ``down_proj``)
    when ``spec.gated_mlp`` is false."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gated = spec.gated_mlp
        if self.gated:
            self.gate_proj = Linear(spec.hidden, spec.ffn_hidden)
        self.up_proj = Linear(spec.hidden, spec.ffn_hidden)
        self.down_proj = Linear(spec.ffn_hidden, spec.hidden)
        self.tp_group = None  # set by tensor_parallel.shard_stage_ (ffn columns are then local)
        self.sp = False  # sequence parallelism: x is this rank's shard of the tokens
        self.chunk_tokens = 0  # > 0: _ChunkedMLP, that many tokens at a time

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunked = self.chunk_tokens and torch.is_grad_enabled()
        y = self._chunked(x) if chunked else self._whole(x)
        if self.sp:
            return scatter_sequence(y, self.tp_group, summed=True)
        return reduce_from_tp(y, self.tp_group)

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP over every token at once, before the row-parallel reduction."""
        if self.sp:
            *gate, up = gather_linears(x, self.tp_group, ((self.gate_proj, self.up_proj)
                                                          if self.gated else (self.up_proj,)))
            gate = gate[0] if gate else None
        else:
            x = copy_to_tp(x, self.tp_group)
            gate = self.gate_proj(x) if self.gated else None
            up = self.up_proj(x)
        if torch.is_grad_enabled():
            return _ActDown.apply(up, self.down_proj.weight, gate)
        return self.down_proj(_mlp_act(gate, up))

    def _chunked(self, x: torch.Tensor) -> torch.Tensor:
        """:class:`_ChunkedMLP`, before the row-parallel reduction."""
        if not self.sp:
            x = copy_to_tp(x, self.tp_group)
        return _ChunkedMLP.apply(x, self.chunk_tokens, self.tp_group if self.sp else None,
                                 self.gate_proj.weight if self.gated else None,
                                 self.up_proj.weight, self.down_proj.weight)


# The fused attention kernels scaled_dot_product_attention dispatches to (CPU flash; CUDA/ROCm
# flash, memory-efficient and cuDNN; the hook other accelerator backends register; and the
# memory-efficient forward a lower-right causal bias calls directly, context parallelism's):
# what attention-free recompute keeps instead of re-running.
ATTENTION_KERNELS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention",
                 "_efficient_attention_forward",
                 "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_fused_attention_overrideable")
    if hasattr(torch.ops.aten, name))
_attention_saves = 0  # attention kernel outputs kept by attention-free forwards (a count)
_warned_unsaved = False


def keep_attention_outputs(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective-checkpoint policy of attention-free recompute: the attention kernels' outputs
    (the attention output and its log-sum-exp) are saved in the forward and reused by the
    backward's re-run; every other op is recomputed."""
    global _attention_saves
    if op not in ATTENTION_KERNELS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute:
        _attention_saves += 1
    return CheckpointPolicy.MUST_SAVE


class AttentionKernelRuns(TorchDispatchMode):
    """``with AttentionKernelRuns() as runs:`` counts executions of the fused attention
    kernels (``runs.count``); a cached output handed back by attention-free's re-run is not
    one. A diagnostic for tests and ``bench/gpu_check.py``."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in ATTENTION_KERNELS
        return func(*args, **(kwargs or {}))


def _warn_if_attention_unsaved(saves_before: int, device: torch.device) -> None:
    """Log once when an attention-free forward kept no attention kernel output: attention ran
    unfused (torch's math fallback, e.g. an unsupported head size), so the backward re-runs
    the whole layer as full recompute does (same gradients, full's time, fewer bytes)."""
    global _warned_unsaved
    if _attention_saves == saves_before and not _warned_unsaved:
        _warned_unsaved = True
        log.warning("recompute attention-free: no fused attention kernel ran on %s, so the "
                    "backward re-runs the attention too (full recompute's time)", device)


def attention_free_contexts() -> tuple[Any, Any]:
    """The forward and recompute dispatch modes of one attention-free checkpoint."""
    return create_selective_checkpoint_contexts(keep_attention_outputs)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden, spec.norm_eps)
        self.self_attn = LlamaAttention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden, spec.norm_eps)
        self.mlp = LlamaMLP(spec)
        self.recompute = "none"
        # attention-free recompute's checkpoint contexts (runtime.memory counts what they keep)
        self.checkpoint_contexts: Callable[[], tuple[Any, Any]] = attention_free_contexts

    def _block(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self._block, x, cos, sin, use_reentrant=False,
                              context_fn=rerun_contexts())
        if self.recompute == "attention-free" and torch.is_grad_enabled():
            before = _attention_saves
            out = checkpoint(self._block, x, cos, sin, use_reentrant=False,
                             context_fn=rerun_contexts(self.checkpoint_contexts))
            _warn_if_attention_unsaved(before, x.device)
            return out
        return self._block(x, cos, sin)

    def set_recompute(self, mode: str) -> None:
        """``none`` | ``selective`` (attention core) | ``attention-free`` (the whole block but
        the attention kernel, whose outputs are kept) | ``full`` (whole block)."""
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"plan.training.recompute={mode!r}: must be one of "
                             f"{', '.join(RECOMPUTE_MODES)}")
        self.recompute = mode
        self.self_attn.recompute_core = mode == "selective"


def _seeded_init(module: nn.Module, seed: int, n_layers: int) -> None:
    """Deterministic init from one generator: norms 1, weights N(0, 0.02), residual outputs
    (``o_proj``, ``down_proj``) scaled by ``1/sqrt(2·layers)`` (GPT-2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if isinstance(module.get_submodule(name.rpartition(".")[0]), RMSNorm):
                p.fill_(1.0)
                continue
            std = INIT_STD
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std = INIT_STD / math.sqrt(2 * n_layers)
            p.copy_(torch.randn(p.shape, generator=gen) * std)


class LlamaBody(nn.Module):
    """The ``model.`` part of HF's ``LlamaForCausalLM`` for one stage: ``embed_tokens`` (first
    stage), ``layers`` keyed by GLOBAL index, ``norm`` (last stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens: Embedding | None = None
        self.layers = nn.ModuleDict()
        self.norm: RMSNorm | None = None


class StageModel(nn.Module):
    """Layers ``[layer_start, layer_end)`` of the Llama, plus embedding/head when asked.

    ``chunks`` (interleaved schedule) replaces the one range by several global layer ranges,
    one per model chunk (see :func:`hettrain.planning.layers.chunk_layer_ranges`); the
    embedding then belongs to chunk 0 and the head (final norm + ``lm_head``) to the last
    chunk, and :meth:`forward_chunk` runs one of them. Parameter names stay global either way.
    ``recompute`` is the plan's activation recompute mode (see the module docstring).
    """

    def __init__(self, spec: ModelSpec, layer_start: int, layer_end: int, *,
                 has_embedding: bool, has_head: bool, seed: int,
                 chunks: Sequence[tuple[int, int]] | None = None,
                 recompute: str = "none", loss_chunk_tokens: int = 0,
                 mlp_chunk_tokens: int = 0) -> None:
        super().__init__()
        if loss_chunk_tokens < 0:
            raise ValueError(f"plan.training.loss_chunk_tokens={loss_chunk_tokens}: must be >= 0 "
                             "(0: the loss over the whole microbatch at once)")
        if mlp_chunk_tokens < 0:
            raise ValueError(f"plan.training.mlp_chunk_tokens={mlp_chunk_tokens}: must be >= 0 "
                             "(0: the MLP over the whole microbatch at once)")
        ranges = list(chunks) if chunks is not None else [(layer_start, layer_end)]
        if not ranges:
            raise ValueError("stage chunks: need at least one (layer_start, layer_end) range")
        for a, b in ranges:
            if not 0 <= a < b <= spec.layers:
                raise ValueError(f"stage layers [{a}, {b}) must lie within "
                                 f"[0, {spec.layers}) and be non-empty")
        self.spec, self.chunks = spec, ranges
        self.layer_start, self.layer_end = ranges[0][0], ranges[-1][1]
        self.model = LlamaBody()
        if has_embedding:
            self.model.embed_tokens = Embedding(spec.vocab, spec.hidden)
            _seeded_init(self.model.embed_tokens, seed * 1000 + EMBED_SEED_OFFSET, spec.layers)
        for a, b in ranges:
            for i in range(a, b):
                if str(i) in self.model.layers:
                    raise ValueError(f"stage chunks {ranges} overlap at layer {i}")
                blk = LlamaDecoderLayer(spec)
                _seeded_init(blk, seed * 1000 + i, spec.layers)
                blk.mlp.chunk_tokens = mlp_chunk_tokens
                self.model.layers[str(i)] = blk
        self.lm_head: Linear | None = None
        if has_head:
            self.model.norm = RMSNorm(spec.hidden, spec.norm_eps)
            self.lm_head = Linear(spec.hidden, spec.vocab)
            if spec.tie_embeddings and self.model.embed_tokens is not None:
                self.lm_head.weight = self.model.embed_tokens.weight  # one tensor
            else:  # tied without the embedding here: a copy of the same seeded values
                off = EMBED_SEED_OFFSET if spec.tie_embeddings else HEAD_SEED_OFFSET
                _seeded_init(self.lm_head, seed * 1000 + off, spec.layers)
        self.vocab_start = 0  # first vocabulary row of this rank's lm_head shard
        self.vocab_sharded = False
        self.tp_group = None  # the head's TP group (vocabulary-parallel output layer)
        self.sp: TPGroup | None = None  # sequence parallelism: the layers see a token shard
        self.set_recompute(recompute)
        self._rope: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.positions: torch.Tensor | None = None  # context parallel: this shard's positions
        self.layer_clock: Any = None  # runtime.stage_timing.LayerClock: layer times measured
        # > 0: the head and loss run chunked (_ChunkedHeadLoss): forward_chunk's last chunk then
        # returns the head's input and loss() applies the head, that many tokens at a time
        self.loss_chunk_tokens = loss_chunk_tokens

    @property
    def layers(self) -> nn.ModuleDict:
        """This stage's decoder layers keyed by global index (``model.layers``)."""
        return self.model.layers

    def set_recompute(self, mode: str) -> None:
        """Set the activation recompute mode of every layer (``api.spec.RECOMPUTE_MODES``)."""
        for blk in self.model.layers.values():
            blk.set_recompute(mode)
        self.recompute = mode

    def _cos_sin(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (str(x.device), x.shape[1])
        if key not in self._rope:  # fp32, kept out of the state dict and of .to(dtype)
            self._rope[key] = rope_cos_sin(self.spec, x.shape[1], x.device, self.positions)
        return self._rope[key]

    def forward_chunk(self, chunk: int, x: torch.Tensor) -> torch.Tensor:
        """Run model chunk ``chunk`` only (embedding first if chunk 0, head last if last)."""
        a, b = self.chunks[chunk]
        sp = self.sp
        cos, sin = self._cos_sin(x)  # the whole (CP-local) sequence: attention gathers it
        emb = self.model.embed_tokens if chunk == 0 else None
        # sequence parallel: a vocabulary-parallel embedding's partial lookups are summed by
        # the reduce-scatter to this rank's shard; any other input is sliced to it
        partial_lookup = emb is not None and sp is not None and emb.vocab_sharded
        if emb is not None:
            x = emb(x, reduce=not partial_lookup)
        if sp is not None:
            x = scatter_sequence(x, sp, summed=partial_lookup)
        clock = self.layer_clock if torch.is_grad_enabled() else None
        if clock is not None:
            x, t0 = clock.enter(x), time.perf_counter()
        for i in range(a, b):
            x = self.model.layers[str(i)](x, cos, sin)
        if clock is not None:
            clock.forward_s += time.perf_counter() - t0
            x = clock.leave(x)
        if chunk == len(self.chunks) - 1 and self.lm_head is not None:
            x = self.model.norm(x)
            if sp is not None and self.vocab_sharded:  # the head gathers (Linear.gather)
                return self.head_output(x)
            if sp is not None:  # a replicated head: every rank computes the same loss
                x = gather_sequence(x, sp)
            elif self.vocab_sharded:
                x = copy_to_tp(x, self.tp_group)
            return self.head_output(x)
        if sp is not None:  # the stage's output, whole, for the next stage or chunk
            x = gather_sequence(x, sp)
        return x

    def head_output(self, x: torch.Tensor) -> torch.Tensor:
        """What the last chunk hands to :meth:`loss` from the head's input ``x`` (normed; whole
        sequence or, vocabulary-parallel, entering the TP region): the logits, or with
        ``loss_chunk_tokens`` ``x`` itself (the loss applies the head chunk by chunk)."""
        return x if self.loss_chunk_tokens else self.lm_head(x)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of this stage's (last stage) logits: :func:`lm_loss`,
        or the vocabulary-parallel cross-entropy over the TP group when the head is sharded.
        With ``loss_chunk_tokens`` the argument is the head's input (:meth:`head_output`) and
        the head runs inside the loss, that many tokens at a time (:class:`_ChunkedHeadLoss`;
        sequence parallel with a sharded head: the token shard, gathered there)."""
        if self.loss_chunk_tokens:
            sharded = self.vocab_sharded
            sp = self.sp if sharded and self.sp is not None else None
            return _ChunkedHeadLoss.apply(logits, self.lm_head.weight, targets,
                                          self.loss_chunk_tokens,
                                          self.vocab_start if sharded else 0,
                                          self.tp_group if sharded else None, sp)
        if not self.vocab_sharded:
            return lm_loss(logits, targets)
        return _VocabParallelCrossEntropy.apply(logits, targets, self.vocab_start,
                                                self.tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states or logits out (every
        chunk in turn: for contiguous chunks the whole stage)."""
        for c in range(len(self.chunks)):
            x = self.forward_chunk(c, x)
        return x


def whole_model(spec: ModelSpec, seed: int, recompute: str = "none") -> StageModel:
    """The full model in one module (the single-process reference)."""
    return StageModel(spec, 0, spec.layers, has_embedding=True, has_head=True, seed=seed,
                      recompute=recompute)


def check_layout(spec: ModelSpec, pp: int) -> None:
    """Raise a clear error for a plan this model cannot train as planned."""
    if spec.tie_embeddings and pp > 1:
        raise ValueError(
            f"plan.model.tie_embeddings with plan.pp={pp}: tied input/output embeddings need "
            "the first and last stage in one process; plan pp=1 or set "
            "spec.model.tieEmbeddings: false")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
