"""Two-level all-reduce on explicit groups: hierarchical (RS → AR → AG) and leader-based.

``inter_op(shard, group)`` performs the inter-block sum in place (default ``dist.all_reduce``;
the communicator passes the host-staged bridge or the compressed exchange). It may return an
object with ``wait()`` (e.g. a ``dist.Work``): the sum is then complete only after ``wait()``,
and the pipelined hierarchical path keeps two pieces in flight on the inter group.

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

from hettrain.planning.arith import shard_bounds
from hettrain.runtime.collectives.choice import INFLIGHT, PIPELINE_BYTES, piece_bytes

InterOp = Callable[[torch.Tensor, dist.ProcessGroup], object]


def _default_inter(shard: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    return dist.all_reduce(shard, group=group, async_op=True)


def _finish(handle: object) -> None:
    """Wait for an inter op's result when it returned a handle (async); no-op otherwise."""
    wait = getattr(handle, "wait", None)
    if wait is not None:
        wait()


def flat_all_reduce_(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Plain ``dist.all_reduce`` (sum) over ``group``: the reference algorithm."""
    dist.all_reduce(tensor, group=group)




def hierarchical_all_reduce_(
    tensor: torch.Tensor,
    intra_group: dist.ProcessGroup,
    inter_group: dist.ProcessGroup | None,
    *,
    intra_ranks: Sequence[int] | None = None,
    shards: int | None = None,
    inter_op: InterOp | None = None,
    pipeline_bytes: int | None = PIPELINE_BYTES,
    pieces: int | None = None,
) -> None:
    """Sum ``tensor`` in place over all blocks: intra reduce-scatter, inter AR, intra all-gather.

    ``intra_ranks`` (global ranks of this rank's block, in order) and ``shards`` (common shard
    count) are needed only when blocks differ in size; ``inter_group`` is the group of this
    rank's shard owners, or ``None`` when this rank owns no shard (uneven blocks only).

    Equal blocks: the tensor is cut into pieces (``choice.piece_bytes``: at least 4 of at least
    1 MiB, at most ``pipeline_bytes`` each; ``None``: one piece; or exactly ``pieces`` pieces,
    as the communicator passes from ``choice.best_pieces``) that flow through the three
    phases as a pipeline: piece ``i+1``'s reduce-scatter and older pieces' all-gathers run
    asynchronously on the intra group while two pieces cross the inter group, so the slow hop
    is busy for nearly the whole call.
    """
    op = inter_op or _default_inter
    n_intra = dist.get_world_size(intra_group)
    k = n_intra if shards is None else shards
    flat = tensor.reshape(-1)
    if not flat.is_contiguous():
        raise ValueError("tensor must be contiguous")
    if pipeline_bytes is not None and pipeline_bytes < 1:
        raise ValueError(f"pipeline_bytes must be >= 1 or None, got {pipeline_bytes}")
    if k == n_intra:
        _rs_ar_ag(flat, intra_group, inter_group, n_intra, op, pipeline_bytes, pieces)
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


def pipeline_pieces(numel: int, elem_bytes: int, n: int, pipeline_bytes: int | None,
                    pieces: int | None = None) -> list[tuple[int, int]]:
    """Element ranges ``[a, b)`` of the pipelined pieces; each a multiple of ``n`` but the last.

    ``pieces``: cut into (at most) that many instead of by ``choice.piece_bytes``."""
    if pieces is not None:
        if pieces < 1:
            raise ValueError(f"pieces must be >= 1, got {pieces}")
        per = -(-numel // pieces)
        step = max(n, -(-per // n) * n)
        return [(a, min(a + step, numel)) for a in range(0, numel, step)] or [(0, numel)]
    size = piece_bytes(numel * elem_bytes, pipeline_bytes)
    if numel * elem_bytes <= size:
        return [(0, numel)]
    step = max(n, (size // elem_bytes) // n * n)
    return [(a, min(a + step, numel)) for a in range(0, numel, step)]


def _rs_ar_ag(flat, intra_group, inter_group, n, op, pipeline_bytes, n_pieces=None) -> None:
    # gloo's reduce_scatter_tensor / all_gather_into_tensor are several times slower than its
    # all_reduce (measured, torch 2.9); the same bytes move as all_to_all + local sum and one
    # broadcast per shard, which gloo runs at full speed.
    members = dist.get_process_group_ranks(intra_group)
    mine = members.index(dist.get_rank())
    pieces = pipeline_pieces(flat.numel(), flat.element_size(), n, pipeline_bytes, n_pieces)
    a_last, b_last = pieces[-1]
    per_last = -(-(b_last - a_last) // n)
    tail = None  # only the last piece may need padding to a multiple of n
    if per_last * n != b_last - a_last:
        tail = _workspace("pad", per_last * n, flat)
        tail[: b_last - a_last] = flat[a_last:b_last]
        tail[b_last - a_last:] = 0
    recv = _workspace("pieces", max(-(-(b - a) // n) * n for a, b in pieces) * 2, flat)
    half = recv.numel() // 2

    def src_of(i: int) -> torch.Tensor:
        a, b = pieces[i]
        return tail if (i == len(pieces) - 1 and tail is not None) else flat[a:b]

    def rs(i: int):
        buf = src_of(i)
        out = recv[(i % 2) * half: (i % 2) * half + buf.numel()]
        return out, dist.all_to_all_single(out, buf, group=intra_group, async_op=True)

    gathers: list[dist.Work] = []
    flying: list[tuple[int, object]] = []  # pieces whose inter all-reduce may still run

    def gather(i: int, handle: object) -> None:
        _finish(handle)
        buf = src_of(i)
        per = buf.numel() // n
        gathers.extend(dist.broadcast(buf[j * per: (j + 1) * per], src=src, group=intra_group,
                                      async_op=True) for j, src in enumerate(members))

    pending = rs(0)
    for i in range(len(pieces)):
        out, work = pending
        work.wait()
        if i + 1 < len(pieces):
            # the next piece's reduce-scatter flies while this one crosses the inter group; the
            # two receive halves alternate, and this piece's half is free again once summed
            pending = rs(i + 1)
        buf = src_of(i)
        per = buf.numel() // n
        shard = buf[mine * per: (mine + 1) * per]
        torch.sum(out.view(n, per), dim=0, out=shard)
        flying.append((i, op(shard, inter_group) if inter_group is not None else None))
        if len(flying) >= INFLIGHT:  # INFLIGHT pieces on the inter group: gather the oldest
            gather(*flying.pop(0))
    for item in flying:
        gather(*item)
    for w in gathers:
        w.wait()
    if tail is not None:
        flat[a_last:b_last] = tail[: b_last - a_last]


def _owner_path(flat, intra_group, inter_group, intra_ranks, k, op) -> None:
    me = dist.get_rank()
    bounds = shard_bounds(flat.numel(), k)
    for j, (a, b) in enumerate(bounds):
        dist.reduce(flat[a:b], dst=intra_ranks[j], group=intra_group)
    local = intra_ranks.index(me)
    if local < k and inter_group is not None:
        a, b = bounds[local]
        shard = flat[a:b].clone()
        _finish(op(shard, inter_group))
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
        _finish(op(flat, leader_group))
    dist.broadcast(flat, src=leader, group=intra_group)
