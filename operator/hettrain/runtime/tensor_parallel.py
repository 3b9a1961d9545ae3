"""Megatron-style tensor parallelism within a pool for the Llama model.

Per block: ``q_proj``, ``k_proj`` and ``v_proj`` are column-parallel (each TP rank owns
``heads/tp`` query heads and ``kv_heads/tp`` key/value heads), ``o_proj`` is row-parallel; in
the MLP ``gate_proj``/``up_proj`` are column-parallel and ``down_proj`` row-parallel. The two
conjugate ops are ``copy_to_tp`` (identity forward, all-reduce of the input gradient backward)
before a column-parallel group and ``reduce_from_tp`` (all-reduce forward, identity backward)
after a row-parallel layer. The RMSNorms are REPLICATED: their gradients are identical on every
TP rank because the residual stream and its gradient are, so no extra TP all-reduce is needed
for them. The token embedding and the LM head are VOCABULARY-parallel (rows ``r·V/tp ..
(r+1)·V/tp`` on TP rank ``r``: the embedding sums its partial lookups forward, the head's
input gets ``copy_to_tp``, the loss is the vocab-parallel cross-entropy of
``runtime.model``) when ``vocab`` divides by ``tp`` (:func:`hettrain.planning.cost.
vocab_shards`, the rule the planner's memory model uses); otherwise they stay replicated.

A sharded parameter keeps its global name; :class:`TPShards` records, per name, the dimension
and the index set each TP rank owns, so checkpoints can store FULL tensors (gathered in the TP
group) and load into any TP degree by slicing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from hettrain.api.spec import ModelSpec
from hettrain.planning.cost import sequence_shards, vocab_shards
from hettrain.runtime.collectives import CommStats, Tier


def _all_reduce(t: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The sum of ``t`` over the TP group, in a new tensor (:func:`all_reduce_in_tp`)."""
    out = t.contiguous().clone()
    all_reduce_in_tp(out, tp)
    return out


def all_reduce_in_tp(t: torch.Tensor, tp: TPGroup | None, op=dist.ReduceOp.SUM) -> None:
    """In-place all-reduce of ``t`` over the TP group (accounted in ``tp.stats``);
    nothing when ``tp`` or its group is None (a lone shard, as ``runtime.memory`` measures)."""
    if tp is None or tp.group is None:
        return
    g = dist.get_world_size(tp.group)
    t0 = time.perf_counter()
    dist.all_reduce(t, op=op, group=tp.group)
    # ring all-reduce cost: 2(g-1)/g of the tensor per rank
    tp.account(int(2 * (g - 1) / g * t.numel() * t.element_size()), t0)


@dataclass(frozen=True)
class TPGroup:
    """The TP process group of a layer and where its traffic is accounted.

    ``group`` None is a stand-in (``runtime.memory`` measures one shard alone): collectives
    then keep the shapes they would have and move nothing (an all-gather repeats this rank's
    part). ``size``, ``index`` and ``members`` (the TP index of each group member, in
    group-rank order) place this rank's sequence shard under sequence parallelism."""

    group: dist.ProcessGroup | None
    stats: CommStats | None = None
    size: int = 1
    index: int = 0
    members: tuple[int, ...] = (0,)

    def account(self, nbytes: int, t0: float) -> None:
        """Count ``nbytes`` sent since ``t0`` (tier ``intra_pool``)."""
        if self.stats is not None:
            self.stats.add(Tier.INTRA_POOL, nbytes, time.perf_counter() - t0)


# ------------------------------------------------------------------ sequence parallelism
#
# Megatron's sequence parallelism (Korthikanti et al. 2023): between a block's row-parallel
# output and the next column-parallel input, the residual stream and the RMSNorms work on
# this rank's 1/tp of the tokens (dim 1 of ``(batch, seq, hidden)``) instead of a replica of
# all of them. The all-reduce after a row-parallel layer becomes a reduce-scatter over the
# sequence, the identity before a column-parallel group an all-gather (the same bytes).

class SeqGather:
    """An all-gather of sequence shards in flight (:func:`start_seq_gather`); :meth:`wait`
    gives the whole sequence."""

    def __init__(self, x: torch.Tensor, tp: TPGroup) -> None:
        self.shape, self.tp = x.shape, tp
        self.work = None
        if tp.group is None:
            self.parts = x.unsqueeze(0).expand(tp.size, *x.shape)
            return
        x = x.contiguous()
        self.nbytes = (tp.size - 1) * x.numel() * x.element_size()
        self.parts = torch.empty((tp.size, *x.shape), dtype=x.dtype, device=x.device)
        self.t0 = time.perf_counter()
        self.work = dist.all_gather_into_tensor(self.parts.view(-1), x.view(-1),
                                                group=tp.group, async_op=True)

    def wait(self) -> torch.Tensor:
        """The gathered ``(batch, tp·seq_shard, ...)`` tensor, in TP-index order."""
        tp, parts = self.tp, self.parts
        if self.work is not None:
            self.work.wait()
            tp.account(self.nbytes, self.t0)
            if list(tp.members) != list(range(tp.size)):
                parts = parts[[tp.members.index(i) for i in range(tp.size)]]
        b, n = self.shape[0], self.shape[1]
        return parts.movedim(0, 1).reshape(b, tp.size * n, *self.shape[2:])


def start_seq_gather(x: torch.Tensor, tp: TPGroup) -> SeqGather:
    """Start the all-gather of the sequence shards of ``x`` (dim 1); the caller may compute
    while it runs."""
    return SeqGather(x, tp)


def _seq_gather(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """All-gather the sequence shards of ``x`` (dim 1) in TP-index order."""
    return SeqGather(x, tp).wait()


def _seq_shard(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's sequence shard of ``x``: a copy (a view would keep all of ``x`` alive)."""
    n = x.shape[1] // tp.size
    return x[:, tp.index * n:(tp.index + 1) * n].clone(memory_format=torch.contiguous_format)


class SeqReduceScatter:
    """A reduce-scatter over the sequence in flight (:func:`start_seq_reduce_scatter`);
    :meth:`wait` gives this rank's summed shard."""

    def __init__(self, x: torch.Tensor, tp: TPGroup) -> None:
        self.tp, self.work = tp, None
        if tp.group is None:
            self.out = _seq_shard(x, tp)
            return
        b, n = x.shape[0], x.shape[1] // tp.size
        parts = x.reshape(b, tp.size, n, *x.shape[2:]).movedim(1, 0)
        self.parts = parts[list(tp.members)].contiguous()  # group-rank order
        self.out = torch.empty((b, n, *x.shape[2:]), dtype=x.dtype, device=x.device)
        self.t0 = time.perf_counter()
        self.work = dist.reduce_scatter_tensor(self.out.view(-1), self.parts.view(-1),
                                               group=tp.group, async_op=True)

    def wait(self) -> torch.Tensor:
        """This rank's shard of the sum."""
        if self.work is not None:
            self.work.wait()
            self.tp.account((self.tp.size - 1) * self.out.numel() * self.out.element_size(),
                            self.t0)
            self.work = self.parts = None
        return self.out


def start_seq_reduce_scatter(x: torch.Tensor, tp: TPGroup) -> SeqReduceScatter:
    """Start summing ``x`` over the TP group into this rank's sequence shard."""
    return SeqReduceScatter(x, tp)


def _seq_reduce_scatter(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum ``x`` over the TP group and keep this rank's sequence shard."""
    return SeqReduceScatter(x, tp).wait()


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return _seq_gather(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _seq_shard(grad, ctx.tp), None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup, summed: bool) -> torch.Tensor:
        ctx.tp = tp
        return _seq_reduce_scatter(x, tp) if summed else _seq_shard(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _seq_gather(grad, ctx.tp), None, None


def gather_sequence(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The whole sequence from every rank's shard, for a consumer every TP rank runs alike (a
    stage's output, a replicated head). Backward: this rank's shard of the gradient, which
    every rank holds whole and the same (a consumer that sees only part of the computation,
    a column-parallel group, gathers through ``model._GatherLinears`` instead, whose backward
    reduce-scatters)."""
    return _GatherSeq.apply(x, tp)


def scatter_sequence(x: torch.Tensor, tp: TPGroup, summed: bool) -> torch.Tensor:
    """This rank's sequence shard: of the sum over the TP group (``summed``: after a
    row-parallel layer, replacing its all-reduce) or of ``x`` itself (a replicated input).
    Backward: the gradient's all-gather."""
    return _ScatterSeq.apply(x, tp, summed)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """Identity forward; sums the input gradient over the TP group backward (None: identity)."""
    return x if tp is None else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """Sums partial outputs over the TP group forward; identity backward (None: identity)."""
    return x if tp is None else _ReduceFromTP.apply(x, tp)


def check_tp(spec: ModelSpec, tp: int, where: str) -> None:
    """Raise a clear error when ``spec`` cannot be split ``tp`` ways."""
    if tp < 1:
        raise ValueError(f"{where}.tp={tp}: must be >= 1")
    for what, n in (("heads", spec.heads), ("kv_heads", spec.kv_heads),
                    ("ffn_hidden", spec.ffn_hidden)):
        if n % tp:
            raise ValueError(f"{where}.tp={tp}: model {what}={n} must be divisible by the TP "
                             "degree; plan a TP degree dividing heads, kv_heads and ffn_hidden")


def _rows(start: int, count: int) -> torch.Tensor:
    return torch.arange(start, start + count)


def shard_layout(spec: ModelSpec, tp: int) -> dict[str, tuple[int, list[torch.Tensor]]]:
    """``{param suffix: (dim, [indices of TP rank r])}`` for one block's sharded weights
    (suffixes relative to ``model.layers.{i}.``)."""
    hd, h, kv, f = spec.head_dim, spec.heads, spec.kv_heads, spec.ffn_hidden
    q = [_rows(r * h // tp * hd, h // tp * hd) for r in range(tp)]
    kv_rows = [_rows(r * kv // tp * hd, kv // tp * hd) for r in range(tp)]
    ff = [_rows(r * f // tp, f // tp) for r in range(tp)]
    out = {"self_attn.q_proj.weight": (0, q), "self_attn.k_proj.weight": (0, kv_rows),
           "self_attn.v_proj.weight": (0, kv_rows), "self_attn.o_proj.weight": (1, q),
           "mlp.up_proj.weight": (0, ff), "mlp.down_proj.weight": (1, ff)}
    if spec.gated_mlp:
        out["mlp.gate_proj.weight"] = (0, ff)
    return out


@dataclass
class TPShards:
    """How this rank's parameters are sharded in its TP group (empty when tp == 1)."""

    tp: int = 1
    index: int = 0
    group: dist.ProcessGroup | None = None
    member_index: Sequence[int] = ()  # TP index of each group member, in group-rank order
    shards: dict[str, tuple[int, list[torch.Tensor]]] = field(default_factory=dict)

    def param_of(self, key: str) -> str | None:
        """The sharded parameter a state key belongs to (also ``optim.<name>.<moment>`` and
        ``outer.<name>.momentum``), or None."""
        name = key
        if key.startswith(("optim.", "outer.")):
            name, kind = key.split(".", 1)[1].rsplit(".", 1)
            if kind == "step":  # AdamW's scalar step count is not sharded
                return None
        return name if name in self.shards else None

    def full_shape(self, name: str, local: torch.Tensor) -> tuple[int, ...]:
        """Shape of the unsharded tensor of which ``local`` is this rank's shard."""
        dim, idx = self.shards[name]
        shape = list(local.shape)
        shape[dim] = sum(len(i) for i in idx)
        return tuple(shape)

    def gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """Collective in the TP group: the full tensor from every rank's shard."""
        dim, idx = self.shards[name]
        parts = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(parts, local.detach().contiguous(), group=self.group)
        full = torch.empty(self.full_shape(name, local), dtype=local.dtype, device=local.device)
        for g, part in enumerate(parts):
            full.index_copy_(dim, idx[self.member_index[g]].to(local.device), part)
        return full

    def local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full tensor."""
        dim, idx = self.shards[name]
        return full.index_select(dim, idx[self.index])


def shard_stage_(model: nn.Module, spec: ModelSpec, tp: int, index: int,
                 group: dist.ProcessGroup | None, member_index: Sequence[int],
                 stats: CommStats | None = None, cp: int = 1) -> TPShards:
    """Replace each block's weights by TP rank ``index``'s slice (in place); returns the map.

    The model must have been built full-size (seeded init), so slices equal the reference.
    TP collectives are accounted in ``stats`` (tier ``intra_pool``). Sequence parallelism is
    on when the rank's ``seq_len / cp`` tokens divide by ``tp``
    (:func:`hettrain.planning.cost.sequence_shards`, the rule the planner's memory model uses).
    """
    info = TPShards(tp=tp, index=index, group=group, member_index=tuple(member_index))
    if tp == 1:
        return info
    tp_group = TPGroup(group, stats, tp, index, tuple(member_index))
    sp = sequence_shards(spec, tp, cp) == tp
    if sp:
        model.sp = tp_group
        if model.model.norm is not None:
            model.model.norm.tp_group = tp_group
        if model.lm_head is not None and vocab_shards(spec, tp) == tp:
            model.lm_head.gather = tp_group
    layout = shard_layout(spec, tp)
    for li, blk in model.model.layers.items():
        for suffix, (dim, idx) in layout.items():
            mod_path, _ = suffix.rsplit(".", 1)
            lin = blk.get_submodule(mod_path)
            w = lin.weight.detach().index_select(dim, idx[index]).clone()
            lin.weight = nn.Parameter(w)
            lin.out_features, lin.in_features = w.shape
            info.shards[f"model.layers.{li}.{suffix}"] = (dim, idx)
        blk.self_attn.heads //= tp
        blk.self_attn.kv_heads //= tp
        blk.self_attn.tp_group = blk.mlp.tp_group = tp_group
        blk.self_attn.sp = blk.mlp.sp = sp
        if sp:
            blk.input_layernorm.tp_group = blk.post_attention_layernorm.tp_group = tp_group
    if vocab_shards(spec, tp) == tp:
        _shard_vocabulary_(model, spec, tp, index, tp_group, info)
    return info


def _shard_vocabulary_(model: nn.Module, spec: ModelSpec, tp: int, index: int, tp_group: TPGroup,
                       info: TPShards) -> None:
    """Keep TP rank ``index``'s ``vocab/tp`` rows of the embedding and of the output layer
    (one parameter when tied: the head then IS the sharded embedding)."""
    rows = [_rows(r * spec.vocab // tp, spec.vocab // tp) for r in range(tp)]
    start = index * spec.vocab // tp
    emb, head = model.model.embed_tokens, model.lm_head
    tied = emb is not None and head is not None and head.weight is emb.weight
    if emb is not None:
        emb.weight = nn.Parameter(emb.weight.detach().index_select(0, rows[index]).clone())
        emb.num_embeddings = spec.vocab // tp
        emb.vocab_start, emb.vocab_sharded, emb.tp_group = start, True, tp_group
        info.shards["model.embed_tokens.weight"] = (0, rows)
    if head is not None:
        if tied:
            head.weight = emb.weight
        else:
            head.weight = nn.Parameter(head.weight.detach().index_select(0, rows[index]).clone())
            info.shards["lm_head.weight"] = (0, rows)
        head.out_features = spec.vocab // tp
        model.vocab_start, model.vocab_sharded, model.tp_group = start, True, tp_group
