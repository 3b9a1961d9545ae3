"""Tiny GPT (nanoGPT-style, pre-LN) that can be built whole or as a pipeline slice of layers.

Initialisation is seeded per global layer index (``seed * 1000 + layer``; embedding and head
have their own seeds), so a model built in slices holds exactly the weights of the whole model.
Parameter names use GLOBAL layer indices (``layers.7.attn.q.weight``), which is what lets a
checkpoint be resharded onto a different pipeline layout. A stage of the interleaved schedule
holds several model chunks (global layer ranges, ``StageModel(..., chunks=...)``) in one module,
so the names, the DP sync and the checkpoints are the same as for a contiguous slice.

Every projection is a :class:`Linear` whose weight gradient can be DEFERRED for ZB-H1: inside
``with defer_weight_grads() as store`` a backward computes only input gradients (and the small
LayerNorm/embedding gradients) and stashes ``(input, grad_output)`` per linear; ``store.flush()``
later adds ``grad_outputᵀ · input`` to each weight's ``.grad`` (the ``W`` pass). Outside the
context the backward is the ordinary one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hettrain.api.spec import ModelSpec
from hettrain.runtime.tensor_parallel import copy_to_tp, reduce_from_tp

EMBED_SEED_OFFSET = 997
HEAD_SEED_OFFSET = 998


class WeightGradStore:
    """Deferred weight-gradient work of one backward: ``(weight, input, grad_output)`` items."""

    def __init__(self) -> None:
        self.items: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []

    def flush(self) -> None:
        """Run the W pass: accumulate every stashed ``grad_outputᵀ · input`` into ``.grad``."""
        with torch.no_grad():
            for weight, x, g in self.items:
                gw = g.reshape(-1, g.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
                main = getattr(weight, "main_grad", None)  # runtime.optim's fp32 accumulator
                if main is not None:
                    main.add_(gw)
                elif weight.grad is None:
                    weight.grad = gw
                else:
                    weight.grad.add_(gw)
        self.items.clear()


_STORE: list[WeightGradStore] = []  # innermost active deferral context last


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
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        gx = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return gx, None
        if _STORE:
            _STORE[-1].items.append((weight, x.detach(), grad.detach()))
            return gx, None
        return gx, grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class Linear(nn.Linear):
    """Bias-free ``nn.Linear`` (same parameters and init) whose weight gradient can be
    deferred to a W pass (:func:`defer_weight_grads`)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SplitLinear.apply(x, self.weight)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with optional grouped-query (``kv_heads < heads``)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
            raise ValueError(f"model: hidden ({spec.hidden}) must divide by heads ({spec.heads})"
                             f" and heads by kv_heads ({spec.kv_heads})")
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        self.q = Linear(spec.hidden, spec.hidden)
        self.kv = Linear(spec.hidden, 2 * spec.kv_heads * spec.head_dim)
        self.o = Linear(spec.hidden, spec.hidden)
        self.tp_group = None  # set by tensor_parallel.shard_stage_ (heads are then local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        x = copy_to_tp(x, self.tp_group)
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        rep = self.heads // self.kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = self.o(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        return reduce_from_tp(y, self.tp_group)


class MLP(nn.Module):
    """GELU MLP, or SwiGLU when ``spec.gated_mlp``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gated = spec.gated_mlp
        self.up = Linear(spec.hidden, spec.ffn_hidden)
        if self.gated:
            self.gate = Linear(spec.hidden, spec.ffn_hidden)
        self.down = Linear(spec.ffn_hidden, spec.hidden)
        self.tp_group = None  # set by tensor_parallel.shard_stage_ (ffn columns are then local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.tp_group)
        if self.gated:
            y = self.down(F.silu(self.gate(x)) * self.up(x))
        else:
            y = self.down(F.gelu(self.up(x)))
        return reduce_from_tp(y, self.tp_group)


class Block(nn.Module):
    """Pre-LN transformer block."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(spec.hidden)
        self.attn = CausalSelfAttention(spec)
        self.ln2 = nn.LayerNorm(spec.hidden)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _seeded_init(module: nn.Module, seed: int, n_layers: int) -> None:
    """Deterministic init from one generator: N(0, 0.02) weights, residual outputs scaled."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.split(".")[-2].startswith("ln"):
                p.fill_(1.0 if name.endswith("weight") else 0.0)
                continue
            std = 0.02
            if name.endswith(("o.weight", "down.weight")):
                std = 0.02 / math.sqrt(2 * n_layers)
            p.copy_(torch.randn(p.shape, generator=gen) * std)


class Embedding(nn.Module):
    """Token + learned position embedding (first stage only)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.wte = nn.Embedding(spec.vocab, spec.hidden)
        self.wpe = nn.Embedding(spec.seq_len, spec.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.wte(tokens) + self.wpe(pos)


class Head(nn.Module):
    """Final LayerNorm + untied output projection (last stage only)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(spec.hidden)
        self.lm_head = Linear(spec.hidden, spec.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class StageModel(nn.Module):
    """Layers ``[layer_start, layer_end)`` of the GPT, plus embedding/head when asked.

    ``chunks`` (interleaved schedule) replaces the one range by several global layer ranges,
    one per model chunk (see :func:`hettrain.planning.layers.chunk_layer_ranges`); the
    embedding then belongs to chunk 0 and the head to the last chunk, and
    :meth:`forward_chunk` runs one of them. Parameter names stay global either way.
    """

    def __init__(self, spec: ModelSpec, layer_start: int, layer_end: int, *,
                 has_embedding: bool, has_head: bool, seed: int,
                 chunks: Sequence[tuple[int, int]] | None = None) -> None:
        super().__init__()
        ranges = list(chunks) if chunks is not None else [(layer_start, layer_end)]
        if not ranges:
            raise ValueError("stage chunks: need at least one (layer_start, layer_end) range")
        for a, b in ranges:
            if not 0 <= a < b <= spec.layers:
                raise ValueError(f"stage layers [{a}, {b}) must lie within "
                                 f"[0, {spec.layers}) and be non-empty")
        self.spec, self.chunks = spec, ranges
        self.layer_start, self.layer_end = ranges[0][0], ranges[-1][1]
        self.embed = Embedding(spec) if has_embedding else None
        if self.embed is not None:
            _seeded_init(self.embed, seed * 1000 + EMBED_SEED_OFFSET, spec.layers)
        self.layers = nn.ModuleDict()
        for a, b in ranges:
            for i in range(a, b):
                if str(i) in self.layers:
                    raise ValueError(f"stage chunks {ranges} overlap at layer {i}")
                blk = Block(spec)
                _seeded_init(blk, seed * 1000 + i, spec.layers)
                self.layers[str(i)] = blk
        self.head = Head(spec) if has_head else None
        if self.head is not None:
            _seeded_init(self.head, seed * 1000 + HEAD_SEED_OFFSET, spec.layers)

    def forward_chunk(self, chunk: int, x: torch.Tensor) -> torch.Tensor:
        """Run model chunk ``chunk`` only (embedding first if chunk 0, head last if last)."""
        a, b = self.chunks[chunk]
        if chunk == 0 and self.embed is not None:
            x = self.embed(x)
        for i in range(a, b):
            x = self.layers[str(i)](x)
        if chunk == len(self.chunks) - 1 and self.head is not None:
            x = self.head(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states or logits out (every
        chunk in turn: for contiguous chunks the whole stage)."""
        for c in range(len(self.chunks)):
            x = self.forward_chunk(c, x)
        return x


def whole_model(spec: ModelSpec, seed: int) -> StageModel:
    """The full GPT in one module (the single-process reference)."""
    return StageModel(spec, 0, spec.layers, has_embedding=True, has_head=True, seed=seed)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
