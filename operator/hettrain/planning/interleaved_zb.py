"""The ``interleaved-zb`` pipeline schedule: virtual stages with a zero-bubble B/W split.

Megatron's interleaved schedule (``v`` model chunks per stage, round-robin placement: virtual
stage ``k = c·pp + s`` is chunk ``c`` of stage ``s``) divides the 1F1B bubble by ``v``; ZB-H1
(Qi et al., ICLR'24) splits each backward into ``B`` (input gradients, on the critical path)
and ``W`` (linear weight gradients, which can wait) and divides it by about 3. This schedule
does both, as Qi et al.'s automatic scheduler does: the order of each stage's
``(kind, microbatch, chunk)`` actions comes from a list scheduler replayed with unit costs
(every F, B and W one tick, as the planner's catalog rule ``F = B = W``). Each tick every stage
runs, in this priority,

1. a ``W`` when it holds :func:`pending_w_cap` deferred weight gradients (bounds their stash);
2. the next ``B`` of the latest chunk whose input is ready (the critical path);
3. the next ``F`` of the latest chunk whose input is ready, while its in-flight chunk
   activations stay within :func:`activation_cap` (Megatron's interleaved peak), keeping a
   slot free for each later chunk (so the chunks that lead to a backward can always start);
4. else a pending ``W`` (filling what would be bubble).

Replayed with ``F = B = W``, the bubble is ``(pp − 1)`` forwards of one chunk: 1F1B's divided by
``3·v`` (``cost.pipeline_time_s``; tests/planning/test_interleaved_zb.py checks it on a grid).
Microbatches run through every virtual stage in order, so every point-to-point stream carries
its messages in microbatch order, and the order is deadlock-free for any real costs: it was
realised once, and dependencies do not depend on durations. Pure Python (no torch): the
planner costs it, the renderer draws it and the runtime (``runtime/schedules.py``) runs it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from functools import lru_cache

from hettrain.planning.replay import replay

ChunkAction = tuple[str, int, int]  # ("F" | "B" | "W", microbatch, chunk)


def activation_cap(stage: int, pp: int, v: int, m: int) -> int:
    """Most chunk activation sets (F run, B not yet) ``stage`` may hold: Megatron's
    interleaved peak (its warm-up plus one) and one chunk more, ``2·(pp − stage − 1) +
    (v − 1)·pp + 2``, at most ``m·v``. (Without the extra chunk the list scheduler leaves up
    to two chunk-forwards of bubble at some ``pp``, ``m``; with it the bubble is exactly
    ``(pp − 1)`` chunk-forwards on the tested grid.)"""
    return min(2 * (pp - stage - 1) + (v - 1) * pp + 2, m * v)


def pending_w_cap(pp: int, v: int) -> int:
    """Most chunks whose weight gradient (W) is pending a stage holds: ``pp·v`` chunks, i.e.
    ``pp`` whole-stage stashes (ZB-H1 holds up to ``pp − 1``)."""
    return pp * v


def _check(pp: int, m: int, v: int) -> None:
    if pp < 1:
        raise ValueError(f"plan.pp={pp}: must be >= 1")
    if v < 1:
        raise ValueError(f"plan.virtual_stages={v}: must be >= 1")
    if m < 1:
        raise ValueError(f"plan.num_microbatches={m}: must be >= 1")


def interleaved_zb_orders(pp: int, m: int, v: int) -> tuple[tuple[ChunkAction, ...], ...]:
    """Every stage's ordered ``(kind, microbatch, chunk)`` actions for one step of ``m``
    microbatches through ``pp`` stages of ``v`` chunks (see the module doc). Raises
    ``ValueError`` naming a bad argument."""
    return _orders_and_ticks(pp, m, v)[0]


def bubble_divisor(pp: int, m: int, v: int) -> float:
    """What the order divides 1F1B's bubble by when ``F = B = W``: ``3·(pp − 1)`` stage-passes
    over its own replayed bubble, ``ticks/v − 3·m`` (``3·v`` where the list scheduler is
    optimal; less at some ``pp``, ``m``; ``inf`` for one stage)."""
    ticks = _ticks(pp, m, v)
    bubble = ticks / v - 3 * m
    return math.inf if bubble <= 1e-12 else 3 * (pp - 1) / bubble


def _ticks(pp: int, m: int, v: int) -> int:
    """The order's length in ticks (its unit-cost makespan)."""
    return _summary(pp, m, v)[0]


@lru_cache(maxsize=4096)
def _summary(pp: int, m: int, v: int) -> tuple[int, tuple[tuple[tuple[int, int], ...], ...]]:
    """The order's length in ticks and, per stage, the ``(in_flight, pending_w)`` chunk counts
    it passes through that no other dominates in both, from one pass of the list scheduler
    that keeps no actions (what the planner asks for at every ``(pp, m, v)`` it prices; the
    orders themselves are built only for the runtime and the renderer). Only the fronts are
    kept: a few states per stage, where a stage passes through up to thousands."""
    _, ticks, fronts = _schedule(pp, m, v, keep_orders=False)
    return ticks, fronts


@lru_cache(maxsize=8)  # the orders themselves are large (3·m·pp·v actions): few are kept
def _orders_and_ticks(pp: int, m: int, v: int
                      ) -> tuple[tuple[tuple[ChunkAction, ...], ...], int]:
    orders, ticks, _ = _schedule(pp, m, v, keep_orders=True)
    return orders, ticks


def _schedule(pp: int, m: int, v: int, keep_orders: bool
              ) -> tuple[tuple[tuple[ChunkAction, ...], ...], int,
                         tuple[tuple[tuple[int, int], ...], ...]]:
    """Run the list scheduler (module doc): every stage's actions (empty unless
    ``keep_orders``), the length in ticks, and per stage the undominated ``(live, pending)``
    chunk counts (:func:`_front`) among those after each action and during each B (its
    chunk's activations still held, its stash already made). Within a tick the stages decide
    independently: an action's result is ready one tick later."""
    _check(pp, m, v)
    last_k = pp * v - 1
    never = 1 << 62
    f_end = [[never] * m for _ in range(pp * v)]  # [virtual stage][microbatch] -> end tick
    b_end = [[never] * m for _ in range(pp * v)]
    next_f = [[0] * v for _ in range(pp)]
    next_b = [[0] * v for _ in range(pp)]
    live = [0] * pp  # chunk activation sets held (F done, B not)
    pending: list[deque[tuple[int, int]]] = [deque() for _ in range(pp)]  # (microbatch, chunk)
    caps = [activation_cap(s, pp, v, m) for s in range(pp)]
    w_cap = pending_w_cap(pp, v)
    out: list[list[ChunkAction]] = [[] for _ in range(pp)]
    seen: list[set[tuple[int, int]]] = [set() for _ in range(pp)]
    # per stage, its chunks latest first with their virtual stage k = c·pp + s
    chunks = [[(c, c * pp + s) for c in range(v - 1, -1, -1)] for s in range(pp)]
    remaining = 3 * m * pp * v
    tick = 0
    while remaining:
        acted = False
        for s in range(pp):
            pend, states = pending[s], seen[s]
            action: ChunkAction | None = None
            if len(pend) >= w_cap:
                action = ("W", *pend.popleft())
            else:
                nb = next_b[s]
                for c, k in chunks[s]:
                    i = nb[c]
                    if i < m and f_end[k][i] <= tick and (k == last_k
                                                          or b_end[k + 1][i] <= tick):
                        nb[c] = i + 1
                        pend.append((i, c))
                        b_end[k][i] = tick + 1
                        states.add((live[s], len(pend)))  # during B: both held
                        live[s] -= 1
                        action = ("B", i, c)
                        break
                if action is None:
                    nf = next_f[s]
                    room = caps[s] - live[s] - v  # chunk c may start while room + c >= 0
                    for c, k in chunks[s]:
                        i = nf[c]
                        if i < m and room + c >= 0 and (k == 0 or f_end[k - 1][i] <= tick):
                            nf[c] = i + 1
                            live[s] += 1
                            f_end[k][i] = tick + 1
                            action = ("F", i, c)
                            break
                if action is None and pend:
                    action = ("W", *pend.popleft())
            if action is not None:
                states.add((live[s], len(pend)))
                if keep_orders:
                    out[s].append(action)
                remaining -= 1
                acted = True
        if not acted:  # every action ends one tick later: nothing left can ever start
            raise RuntimeError(f"interleaved-zb order deadlocks for pp={pp}, m={m}, v={v} "
                               f"at tick {tick}")
        tick += 1
    return tuple(tuple(a) for a in out), tick, tuple(_front(states) for states in seen)


def interleaved_zb_actions(stage: int, pp: int, m: int, v: int) -> list[ChunkAction]:
    """``stage``'s ordered actions (:func:`interleaved_zb_orders`)."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} must lie in [0, pp={pp})")
    return list(interleaved_zb_orders(pp, m, v)[stage])


@lru_cache(maxsize=4096)
def stage_moments(pp: int, m: int, v: int) -> tuple[tuple[tuple[float, float], ...], ...]:
    """Per stage, the ``(in_flight, pending_w)`` states (whole-stage units) its order passes
    through that no other state dominates in both: after each action, and during each B (its
    chunk's activations still held, its stash already made). The stage's memory peaks at one
    of them whatever a layer's activation and stash bytes are (``cost.stage_memory``'s
    ``moments``)."""
    return tuple(tuple((a / v, b / v) for a, b in front) for front in _summary(pp, m, v)[1])


def _front(states: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The ``(live, pending)`` states no other dominates in both, sorted."""
    front, best_pend = [], -1  # by in-flight descending: keep what raises pending
    for a, b in sorted(states, reverse=True):
        if b > best_pend:
            front.append((a, b))
            best_pend = b
    return tuple(sorted(front))


@lru_cache(maxsize=4096)
def stage_peaks(pp: int, m: int, v: int) -> tuple[tuple[float, float], ...]:
    """Per stage, ``(in_flight, pending_w)`` in whole-stage units (chunks / ``v``): the most
    chunk activation sets it holds at once and the most chunks whose weight gradient is
    pending (the ``cost.stage_memory`` arguments; their sum bounds the peak from above). Each
    is the largest of its coordinate over :func:`stage_moments` (a Pareto front holds both)."""
    return tuple((max(a for a, _ in front), max(b for _, b in front))
                 for front in stage_moments(pp, m, v))


def makespan(orders: tuple[tuple[ChunkAction, ...], ...] | list[list[ChunkAction]],
             v: int, stage_costs: list[dict[str, float]]) -> float:
    """Replay per-stage chunk action lists (``orders[s]``) with ``stage_costs[s][kind]``
    seconds per action of one chunk; returns the step's makespan. Dependencies on the
    round-robin placement (virtual stage ``k = c·pp + s``): ``F(k, i)`` after ``F(k − 1, i)``;
    ``B(k, i)`` after ``F(k, i)`` and ``B(k + 1, i)``; ``W(k, i)`` after ``B(k, i)``. Raises
    ``RuntimeError`` on a deadlock."""
    pp = len(orders)
    last_k = pp * v - 1

    def deps(action: ChunkAction, s: int) -> list[tuple[str, int, int]]:
        kind, i, c = action
        k = c * pp + s
        return {"F": [("F", k - 1, i)] if k else [],
                "B": [("F", k, i)] + ([("B", k + 1, i)] if k < last_k else []),
                "W": [("B", k, i)]}[kind]

    times = replay(orders, deps, lambda a, s: stage_costs[s][a[0]],
                   key=lambda a, s: (a[0], a[2] * pp + s, a[1]))
    return max((end for _, _, end in times.values()), default=0.0)
