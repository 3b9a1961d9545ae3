"""Two-level all-reduce on explicit groups: hierarchical (RS → AR → AG) and leader-based.

``inter_op(shard, group)`` performs the inter-block sum in place (default ``dist.all_reduce``;
the communicator passes the host-staged bridge or the compressed exchange).

Blocks of different sizes: all blocks use the common shard count ``k = min block size``; member
``j < k`` of each block owns shard ``j`` (intra reduce to the owner, inter all-reduce among the
``k`` owner groups, intra broadcast back). With equal blocks, ``k`` equals the block size and the
bandwidth-optimal reduce-scatter (as ``all_to_all`` + local sum) / all-gather (one broadcast
per shard) pair is used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

InterOp = Callable[[torch.Tensor, dist.ProcessGroup], None]


def _default_inter(shard: torch.Tensor, group: dist.ProcessGroup) -> None:
    dist.all_reduce(shard, group=group)


def flat_all_reduce_(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Plain ``dist.all_reduce`` (sum) over ``group``: the reference algorithm."""
    dist.all_reduce(tensor, group=group)


def shard_bounds(n: int, shards: int) -> list[tuple[int, int]]:
    """Split ``n`` elements into ``shards`` contiguous ranges (first ones one longer)."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    base, extra = divmod(n, shards)
    out, start = [], 0
    for j in range(shards):
        end = start + base + (1 if j < extra else 0)
        out.append((start, end))
        start = end
    return out


def hierarchical_all_reduce_(
    tensor: torch.Tensor,
    intra_group: dist.ProcessGroup,
    inter_group: dist.ProcessGroup | None,
    *,
    intra_ranks: Sequence[int] | None = None,
    shards: int | None = None,
    inter_op: InterOp | None = None,
) -> None:
    """Sum ``tensor`` in place over all blocks: intra reduce-scatter, inter AR, intra all-gather.

    ``intra_ranks`` (global ranks of this rank's block, in order) and ``shards`` (common shard
    count) are needed only when blocks differ in size; ``inter_group`` is the group of this
    rank's shard owners, or ``None`` when this rank owns no shard (uneven blocks only).
    """
    op = inter_op or _default_inter
    n_intra = dist.get_world_size(intra_group)
    k = n_intra if shards is None else shards
    flat = tensor.reshape(-1)
    if not flat.is_contiguous():
        raise ValueError("tensor must be contiguous")
    if k == n_intra:
        _rs_ar_ag(flat, intra_group, inter_group, n_intra, op)
    else:
        if intra_ranks is None:
            raise ValueError("intra_ranks is required when shards != intra group size")
        _owner_path(flat, intra_group, inter_group, list(intra_ranks), k, op)


_WORKSPACE: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def _workspace(tag: str, numel: int, like: torch.Tensor) -> torch.Tensor:
    """A reusable scratch buffer (fresh 64 MiB allocations cost page faults on every call)."""
    key = (tag, like.dtype, like.device)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=like.dtype, device=like.device)
        _WORKSPACE[key] = buf
    return buf[:numel]


def _rs_ar_ag(flat, intra_group, inter_group, n, op) -> None:
    # gloo's reduce_scatter_tensor / all_gather_into_tensor are several times slower than its
    # all_reduce (measured, torch 2.9); the same bytes move as all_to_all + local sum and one
    # broadcast per shard, which gloo runs at full speed.
    per = -(-flat.numel() // n)
    if per * n == flat.numel():
        padded = flat
    else:
        padded = _workspace("pad", per * n, flat)
        padded[: flat.numel()] = flat
        padded[flat.numel():] = 0
    pieces = _workspace("pieces", per * n, flat)
    dist.all_to_all_single(pieces, padded, group=intra_group)
    members = dist.get_process_group_ranks(intra_group)
    mine = members.index(dist.get_rank())
    shard = padded[mine * per: (mine + 1) * per]
    torch.sum(pieces.view(n, per), dim=0, out=shard)
    if inter_group is not None:
        op(shard, inter_group)
    for j, src in enumerate(members):
        dist.broadcast(padded[j * per: (j + 1) * per], src=src, group=intra_group)
    if padded is not flat:
        flat.copy_(padded[: flat.numel()])


def _owner_path(flat, intra_group, inter_group, intra_ranks, k, op) -> None:
    me = dist.get_rank()
    bounds = shard_bounds(flat.numel(), k)
    for j, (a, b) in enumerate(bounds):
        dist.reduce(flat[a:b], dst=intra_ranks[j], group=intra_group)
    local = intra_ranks.index(me)
    if local < k and inter_group is not None:
        a, b = bounds[local]
        shard = flat[a:b].clone()
        op(shard, inter_group)
        flat[a:b] = shard
    for j, (a, b) in enumerate(bounds):
        view = flat[a:b].clone()
        dist.broadcast(view, src=intra_ranks[j], group=intra_group)
        flat[a:b] = view


def leader_all_reduce_(
    tensor: torch.Tensor,
    intra_group: dist.ProcessGroup,
    leader_group: dist.ProcessGroup | None,
    *,
    leader: int,
    inter_op: InterOp | None = None,
) -> None:
    """Sum in place: intra reduce to ``leader`` (global rank), leaders all-reduce, broadcast.

    ``leader_group`` is the group of block leaders on leaders, ``None`` elsewhere.
    """
    op = inter_op or _default_inter
    flat = tensor.reshape(-1)
    dist.reduce(flat, dst=leader, group=intra_group)
    if dist.get_rank() == leader and leader_group is not None:
        op(flat, leader_group)
    dist.broadcast(flat, src=leader, group=intra_group)
