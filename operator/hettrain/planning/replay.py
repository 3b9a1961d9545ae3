"""Replay fixed per-stage action orders with durations: when each action starts and ends.

A stage runs its actions in order; an action starts once its stage is free and every action it
depends on has ended (plus a transfer delay where that one ran elsewhere). The schedules whose
orders come from list schedulers (``interleaved_zb``, ``helix``) price, test and draw their
orders with this one loop. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

A = TypeVar("A", bound=Hashable)


def replay(orders: Sequence[Sequence[A]], deps: Callable[[A, int], Sequence[Hashable]],
           duration: Callable[[A, int], float],
           delay: Callable[[Hashable, int], float] | None = None,
           key: Callable[[A, int], Hashable] | None = None,
           ) -> dict[Hashable, tuple[int, float, float]]:
    """``{key: (stage, start, end)}`` of every action of ``orders`` (``orders[s]``: stage
    ``s``'s actions in order). ``deps(action, stage)``: the keys it waits for;
    ``duration(action, stage)``: its seconds; ``delay(dep_key, stage)``: the transfer time
    added when waiting on ``dep_key`` from ``stage`` (default none); ``key(action, stage)``:
    how dependencies name an action (default: the action itself). Raises ``RuntimeError`` when
    no stage can go on (a deadlock)."""
    pp = len(orders)
    key = key or (lambda a, s: a)
    done: dict[Hashable, tuple[int, float, float]] = {}
    pos, free = [0] * pp, [0.0] * pp
    remaining = sum(len(a) for a in orders)
    while remaining:
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                action = orders[s][pos[s]]
                waits = deps(action, s)
                if any(d not in done for d in waits):
                    break
                start = free[s]
                for d in waits:
                    start = max(start, done[d][2] + (delay(d, s) if delay else 0.0))
                free[s] = start + duration(action, s)
                done[key(action, s)] = (s, start, free[s])
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule deadlocks at positions {pos}")
    return done
