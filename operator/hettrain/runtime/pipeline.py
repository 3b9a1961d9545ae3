"""Pipeline execution for one stage of one replica: 1F1B, GPipe and ZB-H1 (split backward),
following the per-stage action lists of :mod:`hettrain.runtime.schedules`.

For ZB-H1 a ``B`` runs the backward inside :func:`~hettrain.runtime.model.defer_weight_grads`
(input gradients only; sent upstream at once) and the matching ``W`` later runs the stashed
linear weight gradients. The planner may also choose ``interleaved`` (virtual stages); this
runtime does NOT implement it: such plans execute 1F1B on the same contiguous layer ranges
(same numerics, a larger bubble than the plan predicted). :func:`executed_schedule`
says which one runs; the trainer logs it and exports it as the ``schedule`` label of
``hettrain_runtime_schedule_info``.

Activations go forward and gradients backward with non-blocking sends (``dist.isend``) and
blocking receives, which is deadlock-free for every schedule: a receive only waits for work its
peer has already been scheduled to do. Traffic is accounted in the communicator's ``stats``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from hettrain.planning.plan import Plan
from hettrain.runtime.collectives import Tier, peer_rank
from hettrain.runtime.model import WeightGradStore, defer_weight_grads, lm_loss
from hettrain.runtime.schedules import (  # noqa: F401 (re-exported)
    SCHEDULES,
    schedule_order,
    stage_actions,
    warmup_count,
)

FALLBACK = {"interleaved": "1f1b"}  # planned but not implemented here


def executed_schedule(planned: str) -> str:
    """The schedule this runtime runs for a plan's ``schedule``."""
    if planned in SCHEDULES:
        return planned
    if planned in FALLBACK:
        return FALLBACK[planned]
    raise ValueError(f"plan.schedule={planned!r}: must be one of "
                     f"{SCHEDULES + tuple(FALLBACK)}")


def send_peers(plan: Plan, rank: int, to_stage: int) -> list[int]:
    """Ranks of ``to_stage`` (same replica) whose :func:`peer_rank` towards us is ``rank``."""
    me = plan.ranks[rank]
    my_tp = plan.stages[me.stage].tp
    return [r.rank for r in plan.ranks
            if r.stage == to_stage and r.dp == me.dp and r.tp % my_tp == me.tp]


class StageRunner:
    """Runs one stage's share of a step; the last stage returns the summed microbatch loss."""

    def __init__(self, plan: Plan, rank: int, model: torch.nn.Module, stats=None,
                 schedule: str | None = None, recv_ahead: int = 1) -> None:
        self.plan, self.rank, self.model = plan, rank, model
        self.me = plan.ranks[rank]
        self.stage, self.pp = self.me.stage, plan.pp
        self.first, self.last = self.stage == 0, self.stage == plan.pp - 1
        self.stats = stats
        self.planned = schedule or plan.schedule
        self.schedule = executed_schedule(self.planned)
        # receive from one peer; send to every peer that receives from us (stages may differ in
        # TP degree: a TP rank of stage b receives from TP index ``tp_b % tp_a`` of stage a)
        self.next_peer = None if self.last else peer_rank(plan, rank, self.stage + 1)
        self.prev_peer = None if self.first else peer_rank(plan, rank, self.stage - 1)
        self.next_sends = [] if self.last else send_peers(plan, rank, self.stage + 1)
        self.prev_sends = [] if self.first else send_peers(plan, rank, self.stage - 1)
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        # receives posted before they are needed (``irecv``), per peer: the sender's data can
        # then move while this rank computes instead of after it asks (gloo matches messages
        # from one source in order, and every stage receives a fixed sequence per step)
        if recv_ahead < 0:
            raise ValueError(f"recv_ahead must be >= 0, got {recv_ahead}")
        self.recv_ahead = recv_ahead
        self._posted: dict[int, deque[tuple[torch.Tensor, dist.Work]]] = {}
        self._to_post: dict[int, int] = {}

    def _tier(self, peer: int) -> Tier:
        other = self.plan.ranks[peer]
        if other.datacenter != self.me.datacenter:
            return Tier.CROSS_DC
        return Tier.INTER_POOL if other.pool != self.me.pool else Tier.INTRA_POOL

    def _send(self, t: torch.Tensor, peer: int) -> None:
        buf = t.detach().contiguous()
        t0 = time.perf_counter()
        self._pending.append((dist.isend(buf, dst=peer), buf))
        if self.stats is not None:
            self.stats.add(self._tier(peer), buf.numel() * buf.element_size(),
                           time.perf_counter() - t0)

    def _expect(self, peer: int | None, count: int, shape: Sequence[int]) -> None:
        """This step receives ``count`` tensors of ``shape`` from ``peer``; post the first."""
        if peer is None:
            return
        self._posted[peer] = deque()
        self._to_post[peer] = count
        self._top_up(peer, shape)

    def _top_up(self, peer: int, shape: Sequence[int]) -> None:
        q = self._posted[peer]
        while self._to_post[peer] > 0 and len(q) < self.recv_ahead:
            buf = torch.empty(tuple(shape), dtype=torch.float32)
            q.append((buf, dist.irecv(buf, src=peer)))
            self._to_post[peer] -= 1

    def _recv(self, shape: Sequence[int], peer: int) -> torch.Tensor:
        t0 = time.perf_counter()
        q = self._posted[peer]
        if q:
            buf, work = q.popleft()
            work.wait()
        else:  # recv_ahead == 0
            self._to_post[peer] -= 1
            buf = torch.empty(tuple(shape), dtype=torch.float32)
            dist.recv(buf, src=peer)
        if self.stats is not None:
            self.stats.add(self._tier(peer), 0, time.perf_counter() - t0)
        self._top_up(peer, shape)
        return buf

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
            loss_scale: float) -> float:
        """Forward+backward every microbatch; gradients accumulate in the model's ``.grad``.

        Each microbatch loss is multiplied by ``loss_scale`` before backward (1/M for a mean
        over microbatches). Returns the sum of unscaled microbatch losses (last stage; else 0).
        """
        m = len(batches)
        spec = self.plan.model
        act_shape = (batches[0][0].shape[0], batches[0][0].shape[1], spec.hidden)
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        deferred: dict[int, WeightGradStore] = {}
        split = self.schedule == "zb-h1"
        total = 0.0
        self._expect(self.prev_peer, m, act_shape)  # activations, in forward order
        self._expect(self.next_peer, m, act_shape)  # gradients, in backward order

        def forward(i: int) -> None:
            nonlocal total
            if self.first:
                x_in = None
                out = self.model(batches[i][0])
            else:
                x_in = self._recv(act_shape, self.prev_peer).requires_grad_()
                out = self.model(x_in)
            if self.last:
                loss = lm_loss(out, batches[i][1])
                total += loss.item()
                out = loss * loss_scale
            else:
                for peer in self.next_sends:
                    self._send(out, peer)
            saved[i] = (x_in, out)

        def backward(i: int) -> None:
            x_in, out = saved.pop(i)
            grad = None if self.last else self._recv(out.shape, self.next_peer)
            if split:  # B: input gradients now, the linear weight gradients in W
                with defer_weight_grads() as deferred[i]:
                    out.backward(grad)
            else:
                out.backward(grad)
            if x_in is not None:
                for peer in self.prev_sends:
                    self._send(x_in.grad, peer)

        def weights(i: int) -> None:
            if split:
                deferred.pop(i).flush()

        ops: dict[str, Callable[[int], None]] = {"F": forward, "B": backward, "W": weights}
        for kind, i in stage_actions(self.schedule, self.stage, self.pp, m):
            ops[kind](i)
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        return total
