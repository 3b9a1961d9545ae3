"""Pipeline schedules for one data-parallel replica, timed with the plan's stage times.

This is what the Gantt panel draws. Each stage runs a fixed order of operations (the order real
pipeline engines use), and an operation starts when its stage is free and its inputs have arrived:

- ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021): stage ``s`` runs ``min(p-s-1, m)`` warm-up
  forwards (plus the plan's ``link_warmup`` of the stage in a pipeline across a datacenter
  link, as the runtime does), then alternates one forward / one backward, then drains the
  remaining backwards.
- ``interleaved`` (Megatron-LM virtual pipeline): each rank holds ``v`` model chunks; microbatches
  go through the chunks in groups of ``p``; warm-up is ``(p-s-1)*2 + (v-1)*p`` chunk-forwards.
- ``zb-h1`` (Zero Bubble, Qi et al. 2024): the backward splits into B (input gradient, on the
  critical path) and W (weight gradient, needed only by the optimizer). F/B follow 1F1B; stage
  ``s`` runs each W right after a B but holds its first ``s`` W's back and drains them at the end,
  where 1F1B would idle (the order of ``torch.distributed.pipelining``'s zero-bubble schedule
  with one chunk per rank).
- ``interleaved-zb``: ``v`` chunks per rank as interleaved, each backward split into B and W as
  ZB-H1, in the order of the planner's list scheduler (:mod:`hettrain.planning.interleaved_zb`).
- ``helix`` (:func:`helix_timeline`): one layer per chunk, each layer's parts in the order of
  :mod:`hettrain.planning.helix`; attention cores (``A``: forward, ``a``: backward) drawn on
  the stage that runs them, their owner's or an idle one.

A stage's ``time_ms`` (forward + backward of one microbatch) splits F:B = 1:2, and for ZB-H1 the
backward splits evenly into B and W (T_F = T_B = T_W, the paper's equal-time case). With equal
stage times this reproduces the textbook makespans: ``(m+p-1)(F+B)`` for 1F1B and
``m(F+B+W) + (p-1)(F+B-W)`` for ZB-H1 (when ``m >= p``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hettrain.api.spec import chunked_schedule, splits_backward
from hettrain.planning import helix
from hettrain.planning.interleaved_zb import interleaved_zb_orders

FORWARD = "F"
BACKWARD = "B"  # full backward (1F1B, interleaved) or input-gradient backward (ZB-H1)
WEIGHT = "W"  # weight-gradient backward (zb-h1, interleaved-zb)
CORE = "A"  # helix: an attention core's forward
CORE_BACKWARD = "a"  # helix: its backward
SCHEDULE_NAMES = ("1f1b", "interleaved", "zb-h1", "interleaved-zb")


@dataclass(frozen=True, slots=True)
class Op:
    """One timed pipeline operation on one stage."""

    stage: int
    kind: str  # F, B or W
    microbatch: int
    chunk: int  # model chunk (virtual stage) on this rank; 0 unless interleaved
    start_ms: float
    end_ms: float

    @property
    def duration_ms(self) -> float:
        """How long the operation runs."""
        return self.end_ms - self.start_ms


@dataclass(frozen=True, slots=True)
class Timeline:
    """A timed schedule: every operation of one replica for one optimizer step."""

    schedule: str
    stages: int
    microbatches: int
    chunks: int
    ops: tuple[Op, ...]

    @property
    def makespan_ms(self) -> float:
        """Time from the first forward to the last backward."""
        return max((o.end_ms for o in self.ops), default=0.0)

    def on_stage(self, stage: int) -> tuple[Op, ...]:
        """Operations of one stage in execution order."""
        return tuple(sorted((o for o in self.ops if o.stage == stage), key=lambda o: o.start_ms))

    def busy_fraction(self) -> float:
        """Fraction of stage-time spent computing (1 - bubble fraction)."""
        if not self.ops:
            return 0.0
        busy = sum(o.duration_ms for o in self.ops)
        return busy / (self.stages * self.makespan_ms)


# Key of an operation independent of its timing: (kind, stage, microbatch, chunk).
_Key = tuple[str, int, int, int]


def one_f_one_b_order(stage: int, stages: int, microbatches: int, link_warmup: int = 0
                      ) -> list[_Key]:
    """The 1F1B operation order of one stage (no timing); ``link_warmup``: the plan's extra
    warm-up forwards over a datacenter link (``stages[].link_warmup``), as the runtime runs
    them (``runtime/schedules.warmup_count``)."""
    warmup = min(stages - stage - 1 + link_warmup, microbatches)
    order: list[_Key] = [(FORWARD, stage, mb, 0) for mb in range(warmup)]
    next_f, next_b = warmup, 0
    while next_f < microbatches:
        order.append((FORWARD, stage, next_f, 0))
        order.append((BACKWARD, stage, next_b, 0))
        next_f += 1
        next_b += 1
    order.extend((BACKWARD, stage, mb, 0) for mb in range(next_b, microbatches))
    return order


def zero_bubble_order(stage: int, stages: int, microbatches: int, link_warmup: int = 0
                      ) -> list[_Key]:
    """The ZB-H1 operation order of one stage (no timing): 1F1B with split backwards (and
    ``link_warmup`` extra warm-up forwards), the first ``stage`` weight-gradient passes
    deferred to the end."""
    order: list[_Key] = []
    weights = 0
    for key in one_f_one_b_order(stage, stages, microbatches, link_warmup):
        order.append(key)
        if key[0] == BACKWARD and key[2] >= stage:
            order.append((WEIGHT, stage, weights, 0))
            weights += 1
    order.extend((WEIGHT, stage, mb, 0) for mb in range(weights, microbatches))
    return order


def _interleaved_sequence(stages: int, microbatches: int, chunks: int, backward: bool
                          ) -> list[tuple[int, int]]:
    """(microbatch, chunk) in Megatron's virtual-pipeline order: groups of ``stages`` microbatches
    go through every chunk before the next group starts (chunks reversed for backward)."""
    seq = []
    for group in range(0, microbatches, stages):
        members = range(group, min(group + stages, microbatches))
        for c in range(chunks):
            chunk = chunks - 1 - c if backward else c
            seq.extend((mb, chunk) for mb in members)
    return seq


def interleaved_order(stage: int, stages: int, microbatches: int, chunks: int) -> list[_Key]:
    """The interleaved-1F1B operation order of one stage (no timing)."""
    fwd = _interleaved_sequence(stages, microbatches, chunks, backward=False)
    bwd = _interleaved_sequence(stages, microbatches, chunks, backward=True)
    total = len(fwd)
    warmup = min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)
    order: list[_Key] = [(FORWARD, stage, mb, c) for mb, c in fwd[:warmup]]
    next_f, next_b = warmup, 0
    while next_f < total:
        order.append((FORWARD, stage, *fwd[next_f]))
        order.append((BACKWARD, stage, *bwd[next_b]))
        next_f += 1
        next_b += 1
    order.extend((BACKWARD, stage, mb, c) for mb, c in bwd[next_b:])
    return order


def _dependency(key: _Key, stages: int, chunks: int) -> _Key | None:
    """The operation whose output ``key`` consumes (None for the very first forward)."""
    kind, s, mb, c = key
    if kind == FORWARD:
        if s > 0:
            return (FORWARD, s - 1, mb, c)
        return (FORWARD, stages - 1, mb, c - 1) if c > 0 else None
    if kind == BACKWARD:
        if s < stages - 1:
            return (BACKWARD, s + 1, mb, c)
        if c < chunks - 1:
            return (BACKWARD, 0, mb, c + 1)
        return (FORWARD, s, mb, c)  # loss: the last chunk's backward follows its own forward
    return (BACKWARD, s, mb, c)  # W needs the B that produced its output gradient


def _durations(stage_times_ms: Sequence[float], schedule: str, chunks: int
               ) -> list[dict[str, float]]:
    out = []
    for t in stage_times_ms:
        per_chunk = t / chunks
        if splits_backward(schedule):
            third = per_chunk / 3
            out.append({FORWARD: third, BACKWARD: third, WEIGHT: third})
        else:
            out.append({FORWARD: per_chunk / 3, BACKWARD: 2 * per_chunk / 3})
    return out


def build_timeline(stage_times_ms: Sequence[float], microbatches: int, schedule: str = "1f1b",
                   chunks: int = 1, p2p_ms: float = 0.0,
                   link_warmup: Sequence[int] = ()) -> Timeline:
    """Time one replica's pipeline schedule.

    ``stage_times_ms[s]`` is forward+backward of one microbatch on stage ``s`` (all its chunks);
    ``p2p_ms`` is the activation/gradient hop between neighbouring stages; ``link_warmup[s]``
    the extra warm-up forwards of stage ``s`` of a 1F1B or ZB-H1 pipeline across a datacenter
    link (the plan's ``stages[].link_warmup``; empty: none).
    Raises ``ValueError`` naming the bad argument.
    """
    stages = len(stage_times_ms)
    extra = list(link_warmup) or [0] * stages
    if len(extra) != stages or any(w < 0 for w in extra):
        raise ValueError(f"link_warmup: one count >= 0 per stage (got {list(link_warmup)})")
    if any(extra) and schedule not in ("1f1b", "zb-h1"):
        raise ValueError(f"link_warmup: only 1f1b and zb-h1 run it (got {schedule!r})")
    if stages < 1:
        raise ValueError("stage_times_ms: need at least one stage")
    if any(t < 0 for t in stage_times_ms):
        raise ValueError(f"stage_times_ms: times must be >= 0 (got {list(stage_times_ms)})")
    if microbatches < 1:
        raise ValueError(f"microbatches: must be >= 1 (got {microbatches})")
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"schedule: must be one of {', '.join(SCHEDULE_NAMES)} (got {schedule!r})")
    if chunks < 1 or (chunks > 1 and not chunked_schedule(schedule)):
        raise ValueError(f"chunks: must be 1 unless schedule is interleaved or interleaved-zb "
                         f"(got {chunks})")
    if schedule == "interleaved" and stages > 1 and microbatches % stages:
        raise ValueError(
            f"microbatches: the interleaved schedule needs a multiple of the {stages} stages "
            f"(got {microbatches})"
        )
    if schedule == "interleaved":
        orders = [interleaved_order(s, stages, microbatches, chunks) for s in range(stages)]
    elif schedule == "zb-h1":
        orders = [zero_bubble_order(s, stages, microbatches, extra[s]) for s in range(stages)]
    elif schedule == "interleaved-zb":
        orders = [[(kind, s, mb, c) for kind, mb, c in actions] for s, actions in
                  enumerate(interleaved_zb_orders(stages, microbatches, chunks))]
    else:
        orders = [one_f_one_b_order(s, stages, microbatches, extra[s]) for s in range(stages)]
    durations = _durations(stage_times_ms, schedule, chunks)
    ops = _simulate(orders, durations, stages, chunks, p2p_ms)
    return Timeline(schedule, stages, microbatches, chunks, tuple(ops))


def _simulate(orders: list[list[_Key]], durations: list[dict[str, float]], stages: int,
              chunks: int, p2p_ms: float) -> list[Op]:
    """Run the static per-stage orders: an operation starts when its stage is free and its input
    has arrived. Always commits the earliest-starting operation next."""
    done: dict[_Key, float] = {}
    ops: list[Op] = []
    pos = [0] * stages
    free = [0.0] * stages
    while True:
        best: tuple[float, int] | None = None
        for s in range(stages):
            if pos[s] == len(orders[s]):
                continue
            key = orders[s][pos[s]]
            dep = _dependency(key, stages, chunks)
            if dep is None:
                ready = 0.0
            elif dep in done:
                ready = done[dep] + (0.0 if dep[1] == s else p2p_ms)
            else:
                continue
            start = max(ready, free[s])
            if best is None or start < best[0]:
                best = (start, s)
        if best is None:
            break
        start, s = best
        key = orders[s][pos[s]]
        end = start + durations[s][key[0]]
        done[key] = end
        free[s] = end
        pos[s] += 1
        ops.append(Op(s, key[0], key[2], key[3], start, end))
    if any(pos[s] < len(orders[s]) for s in range(stages)):
        stuck = {s: orders[s][pos[s]] for s in range(stages) if pos[s] < len(orders[s])}
        raise RuntimeError(f"pipeline schedule deadlocked; next operation per stage: {stuck}")
    return ops


def helix_timeline(stage_times_ms: Sequence[float], microbatches: int, layers: int,
                   costs: dict[str, float], hop: float = 0.0, p2p_ms: float = 0.0,
                   filo: bool = False) -> Timeline:
    """Time one replica of the ``helix`` schedule: the planner's order
    (:func:`hettrain.planning.helix.helix_orders` with ``costs``, ``hop`` and ``filo``, as the
    plan carries them), replayed with stage ``s``'s part times (its ``stage_times_ms[s]`` split over
    its ``layers / pp`` layers by ``costs``) and ``p2p_ms`` per transfer between stages. A
    core runs at the speed of the stage that runs it. Parameter parts are ``F``/``B`` ops,
    cores ``A``/``a``; ``chunk`` is the layer's chunk on its owner (``layer // pp``)."""
    pp = len(stage_times_ms)
    orders = helix.helix_orders(pp, layers, microbatches, costs, hop, filo)
    per_layer = sum(costs.values())
    unit = [t / (layers / pp) / per_layer for t in stage_times_ms]
    kinds = {"Fq": FORWARD, "Fo": FORWARD, "Fa": CORE, "Bo": BACKWARD, "Bq": BACKWARD,
             "Ba": CORE_BACKWARD}
    times = helix.timed(orders, layers, lambda a, s: costs[a[0]] * unit[s], p2p_ms)
    ops = sorted((Op(s, kinds[a[0]], a[1], a[2] // pp, start, end)
                  for a, (s, start, end) in times.items()), key=lambda o: (o.start_ms, o.stage))
    return Timeline("helix", pp, microbatches, layers // pp, tuple(ops))
