"""Per-block layer caps of stage orders, memoised (the fast search's memory checks).

A stage order of the fast search (``planner._search_fast``) lays each used unit's ``k`` stages
out as one block of consecutive positions. A stage's layer cap under a schedule depends only on
its unit, TP degree, position and the pipeline's depth (``cost.schedule_memory_args``), so the
caps of a block are a slice of its unit's row of caps over every position of a ``pp``-stage
pipeline under a schedule: the many orders of one leaf, and the leaves sharing units, reuse the
same few rows. :class:`CapsRows` keeps each row with the prefix sums the feasibility test needs,
so testing an order costs one lookup and one slice per unit instead of one stage-cost lookup
per stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hettrain.api.spec import chunked_schedule

Block = tuple[int, int, int]  # (unit index, tp, k): one unit's stages, consecutive
StageCap = Callable[[int, int, int, int, str, int], int]


class CapsRows:
    """Layer caps of the blocks of stage orders at one ``(dp, micro_batch)``.

    ``stage_cap(unit, tp, position, pp, schedule, v)``: the layers the stage at ``position``
    of a ``pp``-stage pipeline can hold (its ``max_layers``). ``layers``: the model's layers.
    One row per ``(unit, tp, pp, schedule, v)`` holds every position's cap and the prefix sums
    of the clamped caps, so a block at any offset is a slice.
    """

    __slots__ = ("_best", "_rows", "layers", "stage_cap")

    def __init__(self, layers: int, stage_cap: StageCap) -> None:
        self.layers = layers
        self.stage_cap = stage_cap
        self._rows: dict[tuple, tuple[list[int], list[int], list[int]]] = {}
        self._best: dict[tuple, int] = {}  # best_offset

    def row(self, unit: int, tp: int, pp: int, schedule: str, v: int
            ) -> tuple[list[int], list[int], list[int]]:
        """``(caps, hard, prefix)`` of ``unit`` at every position of a ``pp``-stage pipeline:
        ``hard = min(cap, layers − lo·(pp − 1))`` (``lo = v`` for interleaved, else 1: a stage
        cannot take more layers than the others leave it) and ``prefix[i] = Σ hard[:i]``."""
        key = (unit, tp, pp, schedule, v)
        out = self._rows.get(key)
        if out is None:
            caps = [self.stage_cap(unit, tp, i, pp, schedule, v) for i in range(pp)]
            top = self.layers - lo_layers(schedule, v) * (pp - 1)
            hard = [c if c < top else top for c in caps]
            prefix = [0]
            for h in hard:
                prefix.append(prefix[-1] + h)
            out = self._rows[key] = (caps, hard, prefix)
        return out

    def fits(self, blocks: Sequence[Block], schedule: str, v: int) -> bool:
        """Whether the stages of ``blocks`` (in pipeline order) can hold every layer, at least
        ``lo`` each, under ``schedule``'s caps: ``min(hard) ≥ lo`` and ``Σ hard ≥ layers``
        (the same test as on the full list of caps, block by block)."""
        pp = 0
        for b in blocks:
            pp += b[2]
        lo = lo_layers(schedule, v)
        total, offset = 0, 0
        for unit, tp, k in blocks:
            _, hard, prefix = self.row(unit, tp, pp, schedule, v)
            end = offset + k
            if min(hard[offset:end]) < lo:
                return False
            total += prefix[end] - prefix[offset]
            offset = end
        return total >= self.layers

    def may_fit(self, blocks: Sequence[Block], schedule: str, v: int) -> bool:
        """A relaxation of :meth:`fits` over every order of ``blocks``: False only when no
        order of them can hold the layers under ``schedule``'s caps. Each block is placed
        at its own best offset (the one with the most layers among those where each stage
        holds ``lo``), independently of the others; every real order places each block at
        one of those offsets, so its ``Σ hard`` is at most the sum of the bests."""
        pp = 0
        for b in blocks:
            pp += b[2]
        total = 0
        for unit, tp, k in blocks:
            best = self.best_offset(unit, tp, k, pp, schedule, v)
            if best < 0:
                return False
            total += best
        return total >= self.layers

    def best_offset(self, unit: int, tp: int, k: int, pp: int, schedule: str, v: int) -> int:
        """Most layers (``Σ hard``) a block of ``k`` stages of ``unit`` holds at any offset of
        a ``pp``-stage pipeline where each of its stages holds ``lo``; −1 when none."""
        key = (unit, tp, k, pp, schedule, v)
        best = self._best.get(key)
        if best is None:
            _, hard, prefix = self.row(unit, tp, pp, schedule, v)
            lo = lo_layers(schedule, v)
            best = max((prefix[o + k] - prefix[o] for o in range(pp - k + 1)
                        if min(hard[o:o + k]) >= lo), default=-1)
            self._best[key] = best
        return best

    def caps(self, blocks: Sequence[Block], schedule: str, v: int) -> list[int]:
        """Every stage's cap, in pipeline order."""
        pp = sum(b[2] for b in blocks)
        out: list[int] = []
        offset = 0
        for unit, tp, k in blocks:
            out.extend(self.row(unit, tp, pp, schedule, v)[0][offset:offset + k])
            offset += k
        return out


def lo_layers(schedule: str, v: int) -> int:
    """Fewest layers a stage holds: one per model chunk (``v`` for the interleaved
    schedules), else 1."""
    return v if chunked_schedule(schedule) else 1
