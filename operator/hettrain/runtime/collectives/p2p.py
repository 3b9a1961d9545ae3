"""Point-to-point transfers between pipeline stages.

Pure part (no process group needed): which rank sends which slice of a boundary tensor to
which rank. Every TP rank of a stage holds the same full boundary tensor (the residual stream
and its gradient are replicated in Megatron TP), so one replica's boundary needs only ONE copy
on the wire: the flattened tensor is cut into ``L = lcm(tp_send, tp_recv)`` equal pieces;
sending TP rank ``i`` owns pieces ``[i·L/tp_send, (i+1)·L/tp_send)``, receiving TP rank ``r``
needs pieces ``[r·L/tp_recv, (r+1)·L/tp_recv)``, and every (sender, receiver) pair whose ranges
overlap exchanges that overlap as one message (:func:`boundary_pieces`). The receiver then
all-gathers its ``1/tp_recv`` slice in its stage's TP group. Bytes on the wire per boundary,
microbatch and direction: ``s·b·h·elem_bytes`` (``planning.cost.activation_bytes``); the busiest
rank sends or receives ``1/min(tp_send, tp_recv)`` of that.

Streams: the messages received by model chunk ``c`` of a rank travel on tag
``2·c + (ACTIVATION 0 | GRADIENT 1)`` (:func:`stream_tag`); :func:`plan_streams` lists every
(sender, receiver, tag) stream of a plan in one deterministic order, which is the order in
which the communicator creates the dedicated groups of same-vendor pairs.

Host staging (:func:`to_host` / :func:`to_device`) is used where a transfer runs on gloo.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hettrain.api.spec import chunked_schedule
from hettrain.planning.plan import Plan

ACTIVATION, GRADIENT = 0, 1
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def wire_dtype(precision: str) -> torch.dtype:
    """dtype of boundary tensors on the wire for ``plan.training.precision``."""
    try:
        return WIRE_DTYPES[precision]
    except KeyError:
        raise ValueError(f"plan.training.precision={precision!r}: must be one of "
                         f"{sorted(WIRE_DTYPES)}") from None


def stream_tag(chunk: int, kind: int) -> int:
    """p2p tag of the messages received by model chunk ``chunk`` (``ACTIVATION``/``GRADIENT``)."""
    return 2 * chunk + kind


def chunk_boundaries(pp: int, v: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Boundaries of one replica in chunk-major order: boundary ``k`` joins virtual stage ``k``
    to ``k+1``, as ``((stage, chunk), (stage, chunk))``; ``pp·v − 1`` of them (with ``v > 1``
    they include the ``v − 1`` hops from the last stage back to stage 0)."""
    order = [(s, c) for c in range(v) for s in range(pp)]
    return list(itertools.pairwise(order))


@dataclass(frozen=True, slots=True)
class Piece:
    """One message of a boundary tensor: elements ``[lo·N/parts, hi·N/parts)`` of the
    flattened tensor (``N`` elements) go from global rank ``sender`` to ``receiver``."""

    sender: int
    receiver: int
    lo: int
    hi: int
    parts: int

    def span(self, numel: int) -> tuple[int, int]:
        """Element range ``[start, end)`` for a tensor of ``numel`` elements."""
        if numel % self.parts:
            raise ValueError(f"a boundary tensor of {numel} elements does not split into "
                             f"lcm(tp_send, tp_recv)={self.parts} pieces")
        unit = numel // self.parts
        return self.lo * unit, self.hi * unit


def _stage_ranks(plan: Plan, stage: int, dp: int) -> list[int]:
    """Global ranks of ``stage`` in replica ``dp``, by TP index."""
    found = {r.tp: r.rank for r in plan.ranks if r.stage == stage and r.dp == dp}
    tp = plan.stages[stage].tp
    if sorted(found) != list(range(tp)):
        raise ValueError(f"plan.ranks: stage {stage} replica {dp} has TP indices "
                         f"{sorted(found)}, expected 0..{tp - 1}")
    return [found[t] for t in range(tp)]


def boundary_pieces(plan: Plan, from_stage: int, to_stage: int, dp: int) -> list[Piece]:
    """The messages that move one boundary tensor of replica ``dp`` from ``from_stage`` to
    ``to_stage``: one per (sender, receiver) pair with overlapping slices, together exactly
    one copy of the tensor (see the module docstring)."""
    senders = _stage_ranks(plan, from_stage, dp)
    receivers = _stage_ranks(plan, to_stage, dp)
    ts, tr = len(senders), len(receivers)
    parts = math.lcm(ts, tr)
    out = []
    for i, s in enumerate(senders):
        a, b = i * parts // ts, (i + 1) * parts // ts
        for r, d in enumerate(receivers):
            lo, hi = max(a, r * parts // tr), min(b, (r + 1) * parts // tr)
            if lo < hi:
                out.append(Piece(s, d, lo, hi, parts))
    return out


@dataclass(frozen=True, slots=True)
class Stream:
    """Every piece one replica moves across boundary ``boundary`` in one direction."""

    boundary: int
    kind: int  # ACTIVATION (forward) or GRADIENT (backward)
    from_stage: int
    from_chunk: int  # the sending model chunk (its output, or its input's gradient)
    to_stage: int
    to_chunk: int  # the receiving model chunk
    pieces: tuple[Piece, ...]

    @property
    def tag(self) -> int:
        """p2p tag: :func:`stream_tag` of the receiving chunk."""
        return stream_tag(self.to_chunk, self.kind)


def plan_streams(plan: Plan, v: int | None = None) -> list[Stream]:
    """All p2p streams of ``plan`` (every replica, boundary and direction), in a deterministic
    order. ``v``: model chunks per stage (default: ``plan.virtual_stages`` for the interleaved
    schedule, else 1)."""
    if v is None:
        v = plan.virtual_stages if chunked_schedule(plan.schedule) else 1
    out = []
    for dp in range(plan.dp):
        for k, ((sa, ca), (sb, cb)) in enumerate(chunk_boundaries(plan.pp, v)):
            out.append(Stream(k, ACTIVATION, sa, ca, sb, cb,
                              tuple(boundary_pieces(plan, sa, sb, dp))))
            out.append(Stream(k, GRADIENT, sb, cb, sa, ca,
                              tuple(boundary_pieces(plan, sb, sa, dp))))
    return out


# ----------------------------------------------------------------- host staging, blocking helpers


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached and contiguous in host memory (a copy only when it is on a device)."""
    host = t.detach().contiguous()
    return host if host.device.type == "cpu" else host.cpu()


def to_device(host: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A received host tensor on ``device`` (``None`` or the CPU: as it is)."""
    return host if device is None or device.type == "cpu" else host.to(device)


def drain(pending: list[tuple[dist.Work, torch.Tensor]]) -> float:
    """Wait for every pending send (``(work, buffer)`` pairs, buffers kept alive until then),
    empty the list; returns the seconds waited."""
    t0 = time.perf_counter()
    for work, _ in pending:
        work.wait()
    pending.clear()
    return time.perf_counter() - t0


def send_tensor(t: torch.Tensor, peer: int, group: dist.ProcessGroup | None = None) -> None:
    """Blocking send of ``t`` (copied to host when on an accelerator) to global rank ``peer``."""
    dist.send(to_host(t), dst=peer, group=group)


def recv_tensor(shape: Sequence[int], dtype: torch.dtype, peer: int,
                device: torch.device | None = None,
                group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Blocking receive from global rank ``peer``; the result lands on ``device``."""
    host = torch.empty(tuple(shape), dtype=dtype)
    dist.recv(host, src=peer, group=group)
    return to_device(host, device)
