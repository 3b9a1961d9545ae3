"""Pipeline execution for one stage of one replica: 1F1B, GPipe, ZB-H1 (split backward) and
interleaved 1F1B (virtual stages), following the per-stage action lists of
:mod:`hettrain.runtime.schedules`.

For ZB-H1 a ``B`` runs the backward inside :func:`~hettrain.runtime.model.defer_weight_grads`
(input gradients only; sent upstream at once) and the matching ``W`` later runs the stashed
linear weight gradients. For ``interleaved`` the stage's model holds ``plan.virtual_stages``
chunks (global layer ranges from :func:`hettrain.planning.layers.chunk_layer_ranges`) and every
action names its chunk: activations of chunk ``c`` go from stage ``s`` to ``s+1``, and from the
last stage to stage 0's chunk ``c+1``; gradients go the reverse way. :func:`executed_schedule`
says which schedule runs (the plan's; it raises for names this runtime does not know); the
trainer logs it and exports it as the ``schedule`` label of ``hettrain_runtime_schedule_info``.

Activations go forward and gradients backward over the gloo world group, staged through host
memory when the stage runs on an accelerator (pools of different vendors share no device
library), with non-blocking sends (``dist.isend``) and blocking receives, which is
deadlock-free for every schedule: a receive only waits for work its peer has already been
scheduled to do. Each message travels on a stream ``(peer, tag)`` with
``tag = 2 * chunk + (0 activation | 1 gradient)`` of the RECEIVING chunk; within a stream both
sides go in microbatch order, so gloo's in-order matching per (source, tag) pairs them even when
one peer sends both activations and gradients (pp=2 interleaved). Traffic is accounted in the
communicator's ``stats``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from hettrain.planning.plan import Plan
from hettrain.runtime.collectives import Tier, peer_rank
from hettrain.runtime.collectives.p2p import to_device, to_host
from hettrain.runtime.model import WeightGradStore, defer_weight_grads, lm_loss
from hettrain.runtime.schedules import (  # noqa: F401 (re-exported)
    RUNTIME_SCHEDULES,
    SCHEDULES,
    chunk_actions,
    schedule_order,
    stage_actions,
    warmup_count,
)

ACTIVATION, GRADIENT = 0, 1


def executed_schedule(planned: str) -> str:
    """The schedule this runtime runs for a plan's ``schedule`` (every known one as planned)."""
    if planned in RUNTIME_SCHEDULES:
        return planned
    raise ValueError(f"plan.schedule={planned!r}: must be one of {RUNTIME_SCHEDULES}")


def stream_tag(chunk: int, kind: int) -> int:
    """p2p tag of the messages received by model chunk ``chunk`` (``ACTIVATION``/``GRADIENT``)."""
    return 2 * chunk + kind


def send_peers(plan: Plan, rank: int, to_stage: int) -> list[int]:
    """Ranks of ``to_stage`` (same replica) whose :func:`peer_rank` towards us is ``rank``."""
    me = plan.ranks[rank]
    my_tp = plan.stages[me.stage].tp
    return [r.rank for r in plan.ranks
            if r.stage == to_stage and r.dp == me.dp and r.tp % my_tp == me.tp]


class StageRunner:
    """Runs one stage's share of a step; the last stage returns the summed microbatch loss.

    ``model`` is a :class:`~hettrain.runtime.model.StageModel`; with ``v > 1`` chunks
    (``model.chunks``) the schedule must be ``interleaved``.
    """

    def __init__(self, plan: Plan, rank: int, model: torch.nn.Module, stats=None,
                 schedule: str | None = None, recv_ahead: int = 1) -> None:
        self.plan, self.rank, self.model = plan, rank, model
        self.me = plan.ranks[rank]
        self.stage, self.pp = self.me.stage, plan.pp
        self.first, self.last = self.stage == 0, self.stage == plan.pp - 1
        self.stats = stats
        self.device = next(model.parameters()).device  # receives land here (host-staged)
        self.dtype = next(model.parameters()).dtype  # activations travel in the plan precision
        self.planned = schedule or plan.schedule
        self.schedule = executed_schedule(self.planned)
        self.v = len(getattr(model, "chunks", [None]))
        if self.schedule == "interleaved":
            if self.pp < 2:
                raise ValueError(f"plan.pp={self.pp}: the interleaved schedule needs pp >= 2 "
                                 "(use schedule 1f1b on one stage)")
            if plan.num_microbatches % self.pp:
                raise ValueError(f"plan.num_microbatches={plan.num_microbatches}: the "
                                 f"interleaved schedule needs a multiple of pp={self.pp}")
            if self.v != plan.virtual_stages:
                raise ValueError(f"stage model has {self.v} chunks, plan.virtual_stages="
                                 f"{plan.virtual_stages}: build it from chunk_layer_ranges(plan)")
        elif self.v != 1:
            raise ValueError(f"plan.schedule={self.schedule!r} runs one chunk per stage; the "
                             f"stage model has {self.v} (set schedule: interleaved)")
        # receive from one peer; send to every peer that receives from us (stages may differ in
        # TP degree: a TP rank of stage b receives from TP index ``tp_b % tp_a`` of stage a)
        self._peer = {s: peer_rank(plan, rank, s) for s in {self._src(0)[0], self._dst(0)[0],
                                                             self._src(self.v - 1)[0],
                                                             self._dst(self.v - 1)[0]}
                      if s is not None}
        self._sends = {s: send_peers(plan, rank, s) for s in self._peer}
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        # receives posted before they are needed (``irecv``), per stream: the sender's data can
        # then move while this rank computes instead of after it asks (gloo matches messages
        # from one source and tag in order, and every stream carries a fixed sequence per step)
        if recv_ahead < 0:
            raise ValueError(f"recv_ahead must be >= 0, got {recv_ahead}")
        self.recv_ahead = recv_ahead
        self._posted: dict[tuple[int, int], deque[tuple[torch.Tensor, dist.Work]]] = {}
        self._to_post: dict[tuple[int, int], int] = {}

    def _src(self, c: int) -> tuple[int | None, int]:
        """(stage, chunk) that feeds chunk ``c`` of this stage its input (None: tokens)."""
        if self.stage > 0:
            return self.stage - 1, c
        return (self.pp - 1, c - 1) if c > 0 else (None, 0)

    def _dst(self, c: int) -> tuple[int | None, int]:
        """(stage, chunk) that consumes chunk ``c``'s output (None: the loss)."""
        if not self.last:
            return self.stage + 1, c
        return (0, c + 1) if c < self.v - 1 else (None, 0)

    def _tier(self, peer: int) -> Tier:
        other = self.plan.ranks[peer]
        if other.datacenter != self.me.datacenter:
            return Tier.CROSS_DC
        return Tier.INTER_POOL if other.pool != self.me.pool else Tier.INTRA_POOL

    def _send(self, t: torch.Tensor, peer: int, tag: int) -> None:
        buf = to_host(t)  # the world group is gloo: host-staged across vendors
        t0 = time.perf_counter()
        self._pending.append((dist.isend(buf, dst=peer, tag=tag), buf))
        if self.stats is not None:
            self.stats.add(self._tier(peer), buf.numel() * buf.element_size(),
                           time.perf_counter() - t0)

    def _expect(self, stream: tuple[int, int], count: int, shape: Sequence[int]) -> None:
        """This step receives ``count`` tensors of ``shape`` on ``(peer, tag)``; post the first."""
        self._posted[stream] = deque()
        self._to_post[stream] = count
        self._top_up(stream, shape)

    def _top_up(self, stream: tuple[int, int], shape: Sequence[int]) -> None:
        q = self._posted[stream]
        peer, tag = stream
        while self._to_post[stream] > 0 and len(q) < self.recv_ahead:
            buf = torch.empty(tuple(shape), dtype=self.dtype)
            q.append((buf, dist.irecv(buf, src=peer, tag=tag)))
            self._to_post[stream] -= 1

    def _recv(self, shape: Sequence[int], stream: tuple[int, int]) -> torch.Tensor:
        t0 = time.perf_counter()
        q = self._posted[stream]
        peer, tag = stream
        if q:
            buf, work = q.popleft()
            work.wait()
        else:  # recv_ahead == 0
            self._to_post[stream] -= 1
            buf = torch.empty(tuple(shape), dtype=self.dtype)
            dist.recv(buf, src=peer, tag=tag)
        if self.stats is not None:
            self.stats.add(self._tier(peer), 0, time.perf_counter() - t0)
        self._top_up(stream, shape)
        return to_device(buf, self.device)

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
            loss_scale: float) -> float:
        """Forward+backward every microbatch; gradients accumulate in the model's ``.grad``.

        Each microbatch loss is multiplied by ``loss_scale`` before backward (1/M for a mean
        over microbatches). Returns the sum of unscaled microbatch losses (last stage; else 0).
        """
        m = len(batches)
        spec = self.plan.model
        act_shape = (batches[0][0].shape[0], batches[0][0].shape[1], spec.hidden)
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        deferred: dict[int, WeightGradStore] = {}
        split = self.schedule == "zb-h1"
        chunked = self.schedule == "interleaved"
        total = 0.0
        for c in range(self.v):  # activations in forward order, gradients in backward order
            src, dst = self._src(c)[0], self._dst(c)[0]
            if src is not None:
                self._expect((self._peer[src], stream_tag(c, ACTIVATION)), m, act_shape)
            if dst is not None:
                self._expect((self._peer[dst], stream_tag(c, GRADIENT)), m, act_shape)

        def forward(i: int, c: int) -> None:
            nonlocal total
            src, dst = self._src(c), self._dst(c)
            if src[0] is None:
                x_in = None
                x = batches[i][0]
            else:
                x_in = self._recv(act_shape, (self._peer[src[0]], stream_tag(c, ACTIVATION)))
                x = x_in.requires_grad_()
            out = self.model.forward_chunk(c, x) if chunked else self.model(x)
            if dst[0] is None:
                loss = lm_loss(out, batches[i][1])
                total += loss.item()
                out = loss * loss_scale
            else:
                for peer in self._sends[dst[0]]:
                    self._send(out, peer, stream_tag(dst[1], ACTIVATION))
            saved[(i, c)] = (x_in, out)

        def backward(i: int, c: int) -> None:
            x_in, out = saved.pop((i, c))
            src, dst = self._src(c), self._dst(c)
            grad = (None if dst[0] is None else
                    self._recv(out.shape, (self._peer[dst[0]], stream_tag(c, GRADIENT))))
            if split:  # B: input gradients now, the linear weight gradients in W
                with defer_weight_grads() as deferred[i]:
                    out.backward(grad)
            else:
                out.backward(grad)
            if x_in is not None:
                for peer in self._sends[src[0]]:
                    self._send(x_in.grad, peer, stream_tag(src[1], GRADIENT))

        def weights(i: int, c: int) -> None:
            if split:
                deferred.pop(i).flush()

        ops: dict[str, Callable[[int, int], None]] = {"F": forward, "B": backward, "W": weights}
        for kind, i, c in chunk_actions(self.schedule, self.stage, self.pp, m, self.v):
            ops[kind](i, c)
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        return total

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Forward only (validation): every microbatch through this stage, chunk by chunk;
        returns the sum of microbatch losses on the last stage (else 0). Sends never block, so
        the chunk-major order is deadlock-free for every schedule."""
        m = len(batches)
        act_shape = (batches[0][0].shape[0], batches[0][0].shape[1], self.plan.model.hidden)
        chunked = self.schedule == "interleaved"
        for c in range(self.v):
            src = self._src(c)[0]
            if src is not None:
                self._expect((self._peer[src], stream_tag(c, ACTIVATION)), m, act_shape)
        total = 0.0
        for c in range(self.v):
            src, dst = self._src(c), self._dst(c)
            for i in range(m):
                x = (batches[i][0] if src[0] is None else
                     self._recv(act_shape, (self._peer[src[0]], stream_tag(c, ACTIVATION))))
                out = self.model.forward_chunk(c, x) if chunked else self.model(x)
                if dst[0] is None:
                    total += lm_loss(out, batches[i][1]).item()
                else:
                    for peer in self._sends[dst[0]]:
                        self._send(out, peer, stream_tag(dst[1], ACTIVATION))
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        return total
