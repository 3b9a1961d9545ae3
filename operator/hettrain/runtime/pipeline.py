"""Pipeline execution for one stage of one replica: 1F1B, GPipe, ZB-H1 (split backward),
interleaved 1F1B (virtual stages) and interleaved-zb (both), following the per-stage action
lists of :mod:`hettrain.runtime.schedules`; the helix schedule (one layer per chunk, attention
cores on idle stages) runs in :mod:`hettrain.runtime.helix`, its validation forward here.

For ZB-H1 and interleaved-zb a ``B`` runs the backward inside
:func:`~hettrain.runtime.model.defer_weight_grads` (input gradients only; sent upstream at
once) and the matching ``W`` later runs the stashed linear weight gradients (keyed by
microbatch and chunk). For the interleaved schedules the stage's model holds
``plan.virtual_stages`` chunks (global layer ranges from
:func:`hettrain.planning.layers.chunk_layer_ranges`) and every action names its chunk:
activations of chunk ``c`` go from stage ``s`` to ``s+1``, and from the last stage to stage 0's
chunk ``c+1``; gradients go the reverse way. :func:`executed_schedule`
says which schedule runs (the plan's; it raises for names this runtime does not know); the
trainer logs it and exports it as the ``schedule`` label of ``hettrain_runtime_schedule_info``.

Transfers (:mod:`hettrain.runtime.collectives.p2p`): each boundary activation, and its gradient
backwards, crosses ONCE per replica, cast to the plan's precision (``plan.training.precision``:
bf16/fp16 2 bytes, fp32 4) and cast back to the receiving side's dtype on arrival. Where stages
are TP-sharded the tensor travels as ``lcm(tp_send, tp_recv)`` pieces, one message per
(sender, receiver) pair with overlapping slices, and the receiver all-gathers its
``1/tp_recv`` slice in its stage's TP group. A pair of stages of one vendor uses the dedicated
stream group the communicator made for it (``comm.p2p_group``: nccl/hccl with device tensors on
an accelerator, gloo on a CPU host); pairs of different vendors use the gloo world group,
staged through host memory. Sends are non-blocking (``dist.isend``), receives are posted
ahead (``irecv``, ``recv_ahead`` per stream), which is deadlock-free for every schedule: a
receive only waits for work its peer has already been scheduled to do. Each message travels
on a stream ``(peer, tag)`` with ``tag = 2 * chunk + (0 activation | 1 gradient)`` of the
RECEIVING chunk; within a stream both sides go in microbatch order, so in-order matching pairs
them even when one peer sends both activations and gradients (pp=2 interleaved). Traffic is
accounted in the communicator's per-tier ``stats`` and per boundary in
:attr:`StageRunner.p2p_stats` (:class:`P2PStats`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hettrain.api.spec import chunked_schedule, splits_backward
from hettrain.planning.plan import Plan
from hettrain.runtime.collectives import Tier, tier_of
from hettrain.runtime.collectives.p2p import (  # noqa: F401 (stream_tag re-exported)
    ACTIVATION,
    GRADIENT,
    Piece,
    drain,
    plan_streams,
    stream_tag,
    to_device,
    to_host,
    wire_dtype,
)
from hettrain.runtime.helix import HelixRunner
from hettrain.runtime.model import (
    WeightGradStore,
    defer_weight_grads,
    set_weight_grad_deferral,
)
from hettrain.runtime.schedules import (  # noqa: F401 (re-exported)
    RUNTIME_SCHEDULES,
    SCHEDULES,
    chunk_actions,
    schedule_order,
    stage_actions,
    warmup_count,
)
from hettrain.runtime.stage_timing import LayerClock

KIND_NAMES = {ACTIVATION: "activation", GRADIENT: "gradient"}


def executed_schedule(planned: str) -> str:
    """The schedule this runtime runs for a plan's ``schedule`` (every known one as planned)."""
    if planned in RUNTIME_SCHEDULES:
        return planned
    raise ValueError(f"plan.schedule={planned!r}: must be one of {RUNTIME_SCHEDULES}")


@dataclass
class BoundaryStats:
    """One rank's traffic on one boundary and direction."""

    bytes: int = 0  # sent across the boundary by this rank
    messages: int = 0
    gather_bytes: int = 0  # this rank's TP all-gather traffic after receiving (ring: (g-1)/g)
    route: str = ""  # sends: "world" (gloo world group, host-staged) or "stream:<backend>"


class P2PStats(dict):
    """``{(boundary, kind): BoundaryStats}`` of one rank; ``boundary`` ``k`` joins virtual
    stages ``k`` and ``k+1`` in chunk-major order (``p2p.chunk_boundaries``)."""

    def get_stats(self, boundary: int, kind: int) -> BoundaryStats:
        """The entry of ``(boundary, kind)``, created empty."""
        return self.setdefault((boundary, kind), BoundaryStats())

    def as_json(self) -> list[dict]:
        """JSON rows ``{boundary, kind: activation|gradient, bytes, messages, gather_bytes,
        route}``."""
        return [{"boundary": b, "kind": KIND_NAMES[k], "bytes": st.bytes,
                 "messages": st.messages, "gather_bytes": st.gather_bytes, "route": st.route}
                for (b, k), st in sorted(self.items())]


@dataclass
class _Link:
    """This rank's end of one stream: its pieces (with their groups) on one boundary."""

    boundary: int
    kind: int
    tag: int
    pieces: list[tuple[Piece, dist.ProcessGroup | None]] = field(default_factory=list)


class StageRunner:
    """Runs one stage's share of a step; the last stage returns the summed microbatch loss.

    ``model`` is a :class:`~hettrain.runtime.model.StageModel`; with ``v > 1`` chunks
    (``model.chunks``) the schedule must be ``interleaved``. ``comm`` (the rank's
    :class:`~hettrain.runtime.collectives.HetCommunicator`) gives the dedicated stream groups
    and the TP group for the all-gather on receipt; without it everything goes over the world
    group, which only works for stages without TP.
    """

    def __init__(self, plan: Plan, rank: int, model: torch.nn.Module, stats=None,
                 schedule: str | None = None, recv_ahead: int = 1, comm=None) -> None:
        self.plan, self.rank, self.model, self.comm = plan, rank, model, comm
        self.me = plan.ranks[rank]
        self.stage, self.pp = self.me.stage, plan.pp
        self.first, self.last = self.stage == 0, self.stage == plan.pp - 1
        self.stats = stats if stats is not None or comm is None else comm.stats
        param = next(model.parameters())
        self.device = param.device  # receives land here
        self.act_dtype = param.dtype  # received activations are cast back to this
        self.wire = wire_dtype(plan.training.precision)  # and travel in this
        self.planned = schedule or plan.schedule
        self.schedule = executed_schedule(self.planned)
        self.v = len(getattr(model, "chunks", [None]))
        if chunked_schedule(self.schedule):
            if self.pp < 2:
                raise ValueError(f"plan.pp={self.pp}: the {self.schedule} schedule needs "
                                 "pp >= 2 (use schedule 1f1b on one stage)")
            if self.schedule == "interleaved" and plan.num_microbatches % self.pp:
                raise ValueError(f"plan.num_microbatches={plan.num_microbatches}: the "
                                 f"interleaved schedule needs a multiple of pp={self.pp}")
            if self.v != plan.virtual_stages:
                raise ValueError(f"stage model has {self.v} chunks, plan.virtual_stages="
                                 f"{plan.virtual_stages}: build it from chunk_layer_ranges(plan)")
        elif self.v != 1:
            raise ValueError(f"plan.schedule={self.schedule!r} runs one chunk per stage; the "
                             f"stage model has {self.v} (set schedule: interleaved)")
        # only the zero-bubble schedules defer weight gradients; the others use torch's
        # linear (faster)
        set_weight_grad_deferral(model, splits_backward(self.schedule))
        self.tp = plan.stages[self.stage].tp
        self.tp_group = comm.tp_group if comm is not None else None
        self.p2p_stats = P2PStats()
        # helix: its own runner (checks the stage holds one layer per chunk, no TP or CP)
        self.helix = (HelixRunner(plan, rank, model, self.stats, self.p2p_stats)
                      if self.schedule == "helix" else None)
        if self.tp > 1 and self.pp > 1 and self.tp_group is None:
            raise ValueError(f"plan.stages[{self.stage}].tp={self.tp}: the pipeline needs the "
                             "communicator (StageRunner(..., comm=)) for the TP all-gather")
        # this rank's sends and receives, keyed by (its chunk, kind): a send of kind ACTIVATION
        # carries chunk c's output, of kind GRADIENT chunk c's input gradient; a receive of kind
        # ACTIVATION feeds chunk c's input, of kind GRADIENT the gradient of chunk c's output
        self._out: dict[tuple[int, int], _Link] = {}
        self._in: dict[tuple[int, int], _Link] = {}
        for st in plan_streams(plan, self.v):
            for piece in st.pieces:
                if rank not in (piece.sender, piece.receiver):
                    continue
                group = (comm.p2p_group(piece.sender, piece.receiver, st.tag)
                         if comm is not None else None)
                if piece.sender == rank:
                    table, key = self._out, (st.from_chunk, st.kind)
                else:
                    table, key = self._in, (st.to_chunk, st.kind)
                table.setdefault(key, _Link(st.boundary, st.kind, st.tag)).pieces.append(
                    (piece, group))
        self._tp_perm = self._gather_order()
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        # receives posted before they are needed (``irecv``), per stream: the sender's data can
        # then move while this rank computes instead of after it asks (messages of one stream
        # are matched in order, and every stream carries a fixed sequence per step)
        if recv_ahead < 0:
            raise ValueError(f"recv_ahead must be >= 0, got {recv_ahead}")
        self.recv_ahead = recv_ahead
        # over a datacenter link the previous stage runs ahead by its extra warm-up
        # (plan.stages[].link_warmup): receive that many more of its activations ahead, so
        # their transfers are in flight across the link's latency while this stage computes
        self.link_ahead = plan.link_recv_ahead(self.stage) if self.v == 1 else 0
        self._numel = 0
        self._posted: dict[tuple[int, int], deque[tuple[torch.Tensor, list]]] = {}
        self._to_post: dict[tuple[int, int], int] = {}
        # the last run(): forward+backward seconds of one microbatch spent computing (receives
        # and sends excluded) and the seconds spent in receives/sends (closed-loop calibration)
        self._p2p_s = 0.0
        self.last_compute_s = 0.0
        self.last_layers_s = 0.0  # the decoder layers only (stage_timing.LayerClock)
        self.last_p2p_s = 0.0
        self.clock = LayerClock()
        if hasattr(model, "layer_clock"):
            model.layer_clock = self.clock

    def _gather_order(self) -> list[int] | None:
        """Group-rank order of the TP all-gather's blocks by TP index (None: already in order)."""
        if self.tp_group is None or self.tp == 1:
            return None
        tps = [self.plan.ranks[g].tp for g in dist.get_process_group_ranks(self.tp_group)]
        return None if tps == list(range(self.tp)) else [tps.index(t) for t in range(self.tp)]

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
        return tier_of((self.me, self.plan.ranks[peer]))

    def _on_host(self, group: dist.ProcessGroup | None) -> bool:
        """Whether a transfer on ``group`` is staged through host memory (gloo)."""
        return group is None or self.comm is None or self.comm.backend(group) == "gloo"

    def _send(self, t: torch.Tensor, chunk: int, kind: int) -> None:
        """Send ``t`` (chunk ``chunk``'s output or input gradient) as this rank's pieces."""
        link = self._out.get((chunk, kind))
        if link is None:  # no receiver takes a piece from this TP rank
            return
        t_send = time.perf_counter()
        flat = t.detach().to(self.wire).contiguous().view(-1)
        entry = self.p2p_stats.get_stats(link.boundary, kind)
        for piece, group in link.pieces:
            lo, hi = piece.span(flat.numel())
            part = to_host(flat[lo:hi]) if self._on_host(group) else flat[lo:hi]
            t0 = time.perf_counter()
            self._pending.append((dist.isend(part, dst=piece.receiver, group=group,
                                             tag=link.tag), part))
            nbytes = part.numel() * part.element_size()
            entry.bytes += nbytes
            entry.messages += 1
            entry.route = "world" if group is None else f"stream:{self.comm.backend(group)}"
            if self.stats is not None:
                self.stats.add(self._tier(piece.receiver), nbytes, time.perf_counter() - t0)
        self._p2p_s += time.perf_counter() - t_send

    def _post(self, key: tuple[int, int]) -> tuple[torch.Tensor, list]:
        """Post the receives of this rank's ``1/tp`` slice of the next tensor on ``key``."""
        link = self._in[key]
        base, size = self.me.tp * self._numel // self.tp, self._numel // self.tp
        host = any(self._on_host(g) for _, g in link.pieces)
        buf = torch.empty(size, dtype=self.wire,
                          device=torch.device("cpu") if host else self.device)
        works = []
        for piece, group in link.pieces:
            lo, hi = piece.span(self._numel)
            works.append(dist.irecv(buf[lo - base: hi - base], src=piece.sender, group=group,
                                    tag=link.tag))
        return buf, works

    def _expect(self, key: tuple[int, int], count: int) -> None:
        """This step receives ``count`` tensors on ``key``; post the first ones."""
        if key not in self._in:
            raise RuntimeError(f"rank {self.rank}: no p2p stream for chunk/kind {key}")
        self._posted[key] = deque()
        self._to_post[key] = count
        self._top_up(key)

    def _top_up(self, key: tuple[int, int]) -> None:
        q = self._posted[key]
        ahead = self.recv_ahead + (self.link_ahead if key == (0, ACTIVATION) else 0)
        while self._to_post[key] > 0 and len(q) < ahead:
            q.append(self._post(key))
            self._to_post[key] -= 1

    def _recv(self, key: tuple[int, int], shape: Sequence[int],
              dtype: torch.dtype) -> torch.Tensor:
        """The next full tensor on ``key`` (pieces, then the TP all-gather), as ``dtype`` on
        this rank's device."""
        link = self._in[key]
        t0 = time.perf_counter()
        q = self._posted[key]
        if q:
            buf, works = q.popleft()
        else:  # recv_ahead == 0
            self._to_post[key] -= 1
            buf, works = self._post(key)
        for work in works:
            work.wait()
        peer = link.pieces[0][0].sender
        if self.stats is not None:
            self.stats.add(self._tier(peer), 0, time.perf_counter() - t0)
        self._top_up(key)
        full = buf
        if self.tp > 1:
            full = self._all_gather(buf, link)
        out = to_device(full.view(tuple(shape)), self.device).to(dtype)
        self._p2p_s += time.perf_counter() - t0
        return out

    def _all_gather(self, part: torch.Tensor, link: _Link) -> torch.Tensor:
        """The full flat tensor from every TP rank's received slice (in the wire dtype)."""
        dev = self.comm.staging_device(self.tp_group)
        part = part.to(dev)
        full = torch.empty(part.numel() * self.tp, dtype=part.dtype, device=dev)
        t0 = time.perf_counter()
        dist.all_gather_into_tensor(full, part, group=self.tp_group)
        if self._tp_perm is not None:
            full = full.view(self.tp, -1)[self._tp_perm].reshape(-1)
        nbytes = (self.tp - 1) * part.numel() * part.element_size()
        self.p2p_stats.get_stats(link.boundary, link.kind).gather_bytes += nbytes
        if self.stats is not None:
            self.stats.add(Tier.INTRA_POOL, nbytes, time.perf_counter() - t0)
        return full

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
            loss_scale: float) -> float:
        """Forward+backward every microbatch; gradients accumulate in the model's ``.grad``.

        Each microbatch loss is multiplied by ``loss_scale`` before backward (1/M for a mean
        over microbatches). Returns the sum of unscaled microbatch losses (last stage; else 0).
        The helix schedule runs in :class:`~hettrain.runtime.helix.HelixRunner`.
        """
        if self.helix is not None:
            total = self.helix.run(batches, loss_scale)
            self.last_compute_s = self.helix.last_compute_s
            self.last_layers_s = self.helix.last_layers_s
            self.last_p2p_s = self.helix.last_p2p_s
            return total
        m = len(batches)
        spec = self.plan.model
        act_shape = (batches[0][0].shape[0], batches[0][0].shape[1], spec.hidden)
        self._numel = math.prod(act_shape)
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        deferred: dict[tuple[int, int], WeightGradStore] = {}  # (microbatch, chunk)
        split = splits_backward(self.schedule)
        chunked = chunked_schedule(self.schedule)
        total = 0.0
        for c in range(self.v):  # activations in forward order, gradients in backward order
            if self._src(c)[0] is not None:
                self._expect((c, ACTIVATION), m)
            if self._dst(c)[0] is not None:
                self._expect((c, GRADIENT), m)

        def forward(i: int, c: int) -> None:
            nonlocal total
            if self._src(c)[0] is None:
                x_in = None
                x = batches[i][0]
            else:
                x_in = self._recv((c, ACTIVATION), act_shape, self.act_dtype)
                x = x_in.requires_grad_()
            out = self.model.forward_chunk(c, x) if chunked else self.model(x)
            if self._dst(c)[0] is None:
                loss = self.model.loss(out, batches[i][1])
                total += loss.item()
                out = loss * loss_scale
            else:
                self._send(out, c, ACTIVATION)
            saved[(i, c)] = (x_in, out)

        def backward(i: int, c: int) -> None:
            x_in, out = saved.pop((i, c))
            grad = (None if self._dst(c)[0] is None else
                    self._recv((c, GRADIENT), out.shape, out.dtype))
            if split:  # B: input gradients now, the linear weight gradients in W
                with defer_weight_grads() as deferred[(i, c)]:
                    out.backward(grad)
            else:
                out.backward(grad)
            if x_in is not None:
                self._send(x_in.grad, c, GRADIENT)

        def weights(i: int, c: int) -> None:
            if split:
                deferred.pop((i, c)).flush()

        ops: dict[str, Callable[[int, int], None]] = {"F": forward, "B": backward, "W": weights}
        self._p2p_s, busy, w_s = 0.0, 0.0, 0.0
        self.clock.reset()
        for kind, i, c in chunk_actions(self.schedule, self.stage, self.pp, m, self.v,
                                        self.plan.stages[self.stage].link_warmup):
            t0 = time.perf_counter()
            ops[kind](i, c)
            busy += time.perf_counter() - t0
            if kind == "W":  # deferred weight gradients (zero-bubble): the layers' (and head's)
                w_s += time.perf_counter() - t0
        self.last_compute_s = max(0.0, busy - self._p2p_s) / m
        self.last_layers_s = (self.clock.reset() + w_s) / m
        self.last_p2p_s = self._p2p_s + drain(self._pending)
        return total

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Forward only (validation): every microbatch through this stage, chunk by chunk;
        returns the sum of microbatch losses on the last stage (else 0). Sends never block, so
        the chunk-major order is deadlock-free for every schedule."""
        m = len(batches)
        act_shape = (batches[0][0].shape[0], batches[0][0].shape[1], self.plan.model.hidden)
        self._numel = math.prod(act_shape)
        chunked = chunked_schedule(self.schedule)
        for c in range(self.v):
            if self._src(c)[0] is not None:
                self._expect((c, ACTIVATION), m)
        total = 0.0
        for c in range(self.v):
            for i in range(m):
                x = (batches[i][0] if self._src(c)[0] is None else
                     self._recv((c, ACTIVATION), act_shape, self.act_dtype))
                out = self.model.forward_chunk(c, x) if chunked else self.model(x)
                if self._dst(c)[0] is None:
                    total += self.model.loss(out, batches[i][1]).item()
                else:
                    self._send(out, c, ACTIVATION)
        drain(self._pending)
        return total
