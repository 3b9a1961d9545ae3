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
from hettrain.planning.cost import vocab_shards
from hettrain.runtime.collectives import CommStats, Tier


def _all_reduce(t: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    out = t.contiguous().clone()
    g = dist.get_world_size(tp.group)
    t0 = time.perf_counter()
    dist.all_reduce(out, group=tp.group)
    if tp.stats is not None:  # ring all-reduce cost: 2(g-1)/g of the tensor per rank
        tp.stats.add(Tier.INTRA_POOL, int(2 * (g - 1) / g * out.numel() * out.element_size()),
                     time.perf_counter() - t0)
    return out


def all_reduce_in_tp(t: torch.Tensor, tp: TPGroup | None, op=dist.ReduceOp.SUM) -> None:
    """In-place all-reduce of a small tensor over the TP group (accounted like the others);
    nothing when ``tp`` or its group is None (a lone shard, as ``runtime.memory`` measures)."""
    if tp is None or tp.group is None:
        return
    g = dist.get_world_size(tp.group)
    t0 = time.perf_counter()
    dist.all_reduce(t, op=op, group=tp.group)
    if tp.stats is not None:
        tp.stats.add(Tier.INTRA_POOL, int(2 * (g - 1) / g * t.numel() * t.element_size()),
                     time.perf_counter() - t0)


@dataclass(frozen=True)
class TPGroup:
    """The TP process group of a layer and where its traffic is accounted."""

    group: dist.ProcessGroup
    stats: CommStats | None = None


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
                 stats: CommStats | None = None) -> TPShards:
    """Replace each block's weights by TP rank ``index``'s slice (in place); returns the map.

    The model must have been built full-size (seeded init), so slices equal the reference.
    TP all-reduces are accounted in ``stats`` (tier ``intra_pool``).
    """
    info = TPShards(tp=tp, index=index, group=group, member_index=tuple(member_index))
    if tp == 1:
        return info
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
        blk.self_attn.tp_group = blk.mlp.tp_group = TPGroup(group, stats)
    if vocab_shards(spec, tp) == tp:
        _shard_vocabulary_(model, spec, tp, index, TPGroup(group, stats), info)
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
