"""Admissible lower bounds on a layout's step time, from per-unit aggregates only.

The fast search (``planner._search_fast``) fixes ``(dp, micro_batch)`` and picks, unit by unit, a
tensor-parallel degree ``tp`` and a stage count ``k``. Every stage of one unit has the same
per-layer time ``a``, per-layer gradient time ``c`` and latency ``e`` (first/last stages only add
to these), so a candidate's bound needs one :class:`UnitStats` per ``(unit, tp)``, not per stage.

For any stage order, split and schedule the step time is ``T = (m − 1/r)·X' + Σ'/r + D`` with
``r = 1`` (1F1B), ``v`` (interleaved) or ``3`` (ZB-H1), ``X' ≥ max(X, P)`` and
``Σ' ≥ Σt + Σp`` (``X``: slowest stage, ``Σt``: sum of stage times, ``P``/``Σp``: slowest/sum of
boundary transfers, ``D``: slowest DP all-reduce). Since ``Σ' ≥ X'``, a smaller ``r`` only makes
``T`` larger, so the largest ``r`` the schedule choice allows gives a bound for all of them.
Terms are bounded as follows:

- ``X``: the smallest ``X`` with ``Σ_u k_u·min(cap_u, ⌊X/a_u⌋) ≥ L`` (whole layers), at least
  every used ``a_u`` (one layer each) and the cheapest possible last stage ``a_u + head_u``;
- ``Σt`` given ``X``: every stage holds ``≥ 1`` and ``≤ ⌊X/a⌋`` layers, the rest go to the
  cheapest stages first; ``(X, Σt)`` are coupled on a geometric grid of ``X`` (``Σt_min`` is
  non-increasing in ``X``);
- ``D ≥ c_u + e_u`` for every used unit, and ``Σ k_u·(D − e_u)/c_u ≥ L``;
- ``P``, ``Σp``: :func:`boundary_lower_bounds` (any order) or :func:`ordered_boundaries`.

``cap_u`` is the layers one stage can hold with a single microbatch in flight and no embedding or
head: a relaxation of the real per-position caps, so the bound stays valid. The ``k`` stages of a
unit together hold at most ``kcap_u`` (:func:`stage_capacity`: the ``j``-th of them has at least
``min(j, m)`` microbatches in flight, whatever the order and schedule), which the bottleneck,
``Σt`` and the feasibility checks use as the unit's total.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

GRID_RATIO = 1.04  # geometric grid over the bottleneck X in step_lower_bound
GRID_STEPS = 12


@dataclass(frozen=True, slots=True)
class UnitStats:
    """Per-stage aggregates of one unit at one ``(tp, dp, micro_batch)``."""

    a: float  # seconds per layer per microbatch (compute + TP comm)
    head: float  # seconds of the LM head when this unit hosts the last stage
    dp_c: float  # DP all-reduce seconds per layer (0 when dp == 1)
    dp_e: float  # DP all-reduce latency of a middle stage (0 when dp == 1)
    cap: int  # layers one stage can hold (relaxed: 1 microbatch in flight, no embedding)
    fixed_bytes: float  # per-device bytes independent of the layer count (relaxed)
    layer_bytes: float  # per-device bytes per layer (relaxed)
    # for :func:`stage_capacity`: activation bytes per layer per further microbatch in flight,
    # usable bytes per device, microbatches per step (0: ignore in-flight microbatches)
    act_bytes: float = 0.0
    usable_bytes: float = 0.0
    microbatches: int = 0


IN_FLIGHT_TERMS = 256  # stage_capacity sums this many distinct in-flight counts, then repeats


def stage_capacity(stats: UnitStats, k: int) -> int:
    """Layers ``k`` stages of one unit can hold together, in any pipeline and schedule.

    The unit's stages sit at ``k`` distinct positions, so (1F1B / ZB-H1: ``min(pp − i, m)``
    microbatches in flight at position ``i``; interleaved and GPipe hold at least as many,
    ``cost.in_flight_microbatches``) the ``j``-th of them holds at least ``min(j, m)``
    microbatches' activations: its cap is at most ``⌊(usable − fixed)/(layer_bytes +
    (min(j, m) − 1)·act_bytes)⌋`` (fixed and per-layer bytes of the one-in-flight relaxation).
    Past ``IN_FLIGHT_TERMS`` the last term repeats (caps only shrink with ``j``), so the work
    does not grow with ``k``. 0 when the deepest stage cannot hold a single layer (then no
    layout gives the unit ``k`` stages)."""
    if stats.microbatches < 1 or stats.act_bytes <= 0:
        return k * stats.cap
    want = min(k, stats.microbatches, IN_FLIGHT_TERMS)
    prefix = _capacity_prefix(stats, want)
    if len(prefix) - 1 < want:
        return 0  # a stage at depth len(prefix) ≤ k cannot hold a layer
    last = prefix[want] - prefix[want - 1]
    return prefix[want] + (k - want) * last


_PREFIXES: dict[UnitStats, list[int]] = {}


def _capacity_prefix(stats: UnitStats, want: int) -> list[int]:
    """``[0, c_1, c_1 + c_2, …]`` over the in-flight counts ``j`` of :func:`stage_capacity`, at
    least ``want`` terms unless some ``c_j`` is below one layer (the list ends before it);
    memoised and extended on demand."""
    out = _PREFIXES.get(stats)
    if out is None:
        if len(_PREFIXES) > 8192:
            _PREFIXES.clear()
        out = _PREFIXES[stats] = [0]
    room = stats.usable_bytes - stats.fixed_bytes
    while len(out) <= want:
        j = len(out)
        c = min(stats.cap, int(room // (stats.layer_bytes + (j - 1) * stats.act_bytes)))
        if c < 1:
            break
        out.append(out[-1] + c)
    return out


@dataclass(frozen=True, slots=True)
class Choice:
    """One unit's choice in a candidate: ``k`` stages of ``tp`` GPUs each."""

    unit: int  # index into the search's unit tuple
    tp: int
    k: int
    stats: UnitStats
    # a further limit on the layers the k stages hold together (a schedule's memory caps at
    # the block's best position; None: only stage_capacity's)
    limit: int | None = None
    # derived once (the bounds run on every leaf of the search)
    a: float = field(init=False)
    cap: int = field(init=False)
    kcap: int = field(init=False)  # layers the k stages can hold
    rate: float = field(init=False)  # k / a
    ka: float = field(init=False)  # k · a

    def __post_init__(self) -> None:
        kcap = stage_capacity(self.stats, self.k)
        if self.limit is not None and self.limit < kcap:
            kcap = self.limit
        for name, value in (("a", self.stats.a), ("cap", self.stats.cap), ("kcap", kcap),
                            ("rate", self.k / self.stats.a),
                            ("ka", self.k * self.stats.a)):
            object.__setattr__(self, name, value)


def _stage_caps(choices: Sequence[Choice], x: float) -> list[int]:
    """Layers each unit's stages can hold when no stage may take longer than ``x``."""
    return [n if (n := int(x / ch.a + 1e-9)) < ch.cap else ch.cap for ch in choices]


def bottleneck_lower_bound(choices: Sequence[Choice], layers: int, whole: bool = True,
                           start: float | None = None) -> float:
    """Smallest ``X`` with ``Σ k·min(cap, ⌊X/a⌋) ≥ layers`` (inf when the caps cannot hold them).

    Starts at the continuous relaxation ``Σ k·min(cap, X/a) = layers`` (returned when not
    ``whole``; ``start``: that value, already computed by a call with ``whole=False``) and
    steps to the next value where some unit's stages fit one more whole layer.
    """
    if sum(ch.kcap for ch in choices) < layers:
        return math.inf
    if start is not None:
        return _whole_bottleneck(choices, layers, start)
    # a unit's k stages hold at most min(kcap, k·X/a) layers: it saturates at X = kcap·a/k
    items = sorted(((ch.kcap * ch.a / ch.k, ch) for ch in choices), key=lambda x: x[0])
    rate = sum(ch.rate for ch in choices)
    held = 0.0
    x = items[-1][0]
    for brk, ch in items:
        x = (layers - held) / rate
        if x <= brk:
            break
        held += ch.kcap
        rate -= ch.rate
    x = min(x, items[-1][0])
    return _whole_bottleneck(choices, layers, x) if whole else x


def _whole_bottleneck(choices: Sequence[Choice], layers: int, x: float) -> float:
    """:func:`bottleneck_lower_bound` from its continuous relaxation ``x``."""
    for _ in range(4 * layers):
        # one pass per step: Σ k·min(cap, ⌊x/a⌋) (capped by kcap), and the next x at which
        # some unsaturated unit's stages fit one more layer (as _stage_caps rounds)
        held, nxt = 0, math.inf
        for ch in choices:
            n = int(x / ch.a + 1e-9)
            if n > ch.cap:
                n = ch.cap
            kn = ch.k * n
            if kn < ch.kcap:
                held += kn
                if n < ch.cap:
                    step = ch.a * (n + 1)
                    if step < nxt:
                        nxt = step
            else:
                held += ch.kcap
        if held >= layers:
            return x
        x = nxt
    return x


def sum_lower_bound(choices: Sequence[Choice], layers: int, x: float = math.inf,
                    by_a: Sequence[Choice] | None = None) -> float:
    """Minimum of ``Σ a_i·n_i`` with ``1 ≤ n_i ≤ cap``, ``a_i·n_i ≤ x`` per stage and
    ``Σ n_i = layers`` (cheapest stages filled first); inf when infeasible. ``by_a``: the
    choices sorted by ``a`` (stable), when the caller keeps them."""
    pp = sum(ch.k for ch in choices)
    left = layers - pp
    if left < 0:
        return math.inf
    if by_a is None:
        by_a = sorted(choices, key=lambda ch: ch.a)
    caps = _stage_caps(by_a, x) if x < math.inf else [ch.cap for ch in by_a]
    if min(caps) < 1:
        return math.inf
    total = sum(ch.ka for ch in choices)
    for ch, n in zip(by_a, caps, strict=True):
        take = min(left, ch.k * (n - 1), ch.kcap - ch.k)
        total += take * ch.a
        left -= take
        if not left:
            break
    return total if left == 0 else math.inf


def dp_lower_bound(choices: Sequence[Choice], layers: int) -> float:
    """Slowest DP all-reduce ``D``: every stage has ``c·n + e ≤ D`` and ``Σ n = layers``."""
    d = max(ch.stats.dp_c + ch.stats.dp_e for ch in choices)
    if all(ch.stats.dp_c > 0 for ch in choices):
        rate = sum(ch.k / ch.stats.dp_c for ch in choices)
        d = max(d, (layers + sum(ch.k * ch.stats.dp_e / ch.stats.dp_c for ch in choices)) / rate)
    return d


def boundary_lower_bounds(choices: Sequence[Choice],
                          cost_of: Callable[[Choice, Choice], float],
                          memo: dict | None = None) -> tuple[float, float]:
    """Lower bounds on (slowest, sum of) boundary transfers over every stage order.

    A unit's ``k`` stages are consecutive, so ``k − 1`` boundaries stay inside it; the ``n``
    units' blocks are joined by ``n − 1`` boundaries between different units, each at least the
    cheapest pair; every unit borders at least one other, so the slowest boundary is at least
    each unit's cheapest neighbour. ``memo``: a dict kept across calls whose ``cost_of``
    depends on the choices' ``(unit, tp)`` only (the between-unit terms are kept by them).
    """
    slowest, total = _inside_boundaries(choices, cost_of)
    if len(choices) > 1:
        key = tuple((c.unit, c.tp) for c in choices) if memo is not None else None
        between = memo.get(key) if memo is not None else None
        if between is None:
            pair = [[cost_of(x, y) for y in choices if y is not x] for x in choices]
            between = (min(min(row) for row in pair), max(min(row) for row in pair))
            if memo is not None:
                memo[key] = between
        total += (len(choices) - 1) * between[0]
        slowest = max(slowest, between[1])
    return slowest, total


def ordered_boundaries(order: Sequence[Choice],
                       cost_of: Callable[[Choice, Choice], float]) -> tuple[float, float]:
    """Exact (slowest, sum of) boundary transfers when the units' order is fixed."""
    slowest, total = _inside_boundaries(order, cost_of)
    for x, y in itertools.pairwise(order):
        b = cost_of(x, y)
        total += b
        if b > slowest:
            slowest = b
    return slowest, total


def _inside_boundaries(choices: Sequence[Choice], cost_of: Callable[[Choice, Choice], float]
                       ) -> tuple[float, float]:
    """(slowest, sum of) the ``k − 1`` boundaries inside each unit's block of stages (0.0
    when there are none; summed left to right, as ``sum`` does)."""
    slowest, total = 0.0, 0
    for c in choices:
        if c.k > 1:
            b = cost_of(c, c)
            total += b * (c.k - 1)
            if b > slowest:
                slowest = b
    return slowest, total


def step_lower_bound(choices: Sequence[Choice], layers: int, m: int,
                     boundary: tuple[float, float] | Callable[[], tuple[float, float]]
                     = (0.0, 0.0), last: Choice | None = None, bubble_div: float = 3.0,
                     cutoff: float = math.inf) -> float:
    """Admissible bound on the step time of every layout built from ``choices`` (module doc).

    ``boundary``: lower bounds on the slowest and the sum of the boundary transfers (or a function
    computing them, called only when cheaper bounds do not reach ``cutoff``); ``last``: the
    unit of the last stage when the order is fixed; ``bubble_div``: the schedules' smallest
    bubble divisor (3 for ZB-H1, 2 for interleaved, 1 for 1F1B); ``cutoff``: stop refining once
    the bound reaches it (the caller discards such layouts). The bottleneck ``X`` and ``Σt``
    are coupled: for ``X`` in ``[x_j, x_{j+1})``, ``Σt ≥ Σt_min(x_{j+1})`` on a geometric grid.
    :class:`LeafBound` computes the same value, keeping what does not depend on the order.
    """
    return LeafBound(choices, layers, m).bound(boundary, last, bubble_div, cutoff)


class LeafBound:
    """:func:`step_lower_bound` of one set of choices, for many stage orders.

    The stage orders of one leaf of the search differ only in their boundary transfers, their
    last unit and (through the schedules their memory admits) their bubble divisor; the
    bottleneck, ``Σt``, DP and grid terms are computed once, on first use, and kept. Every
    value equals :func:`step_lower_bound`'s with the same arguments (same arithmetic)."""

    __slots__ = ("_base", "_by_a", "_grids", "_tails", "_whole", "choices", "div", "layers",
                 "m")

    def __init__(self, choices: Sequence[Choice], layers: int, m: int) -> None:
        self.choices = choices
        self.layers = layers
        self.m = m
        self._by_a = sorted(choices, key=lambda ch: ch.a)  # sum_lower_bound's fill order
        self.div = math.inf  # the largest bubble divisor a caller found its orders may use
        # (xc, σ∞, d, max a), or None when infinite
        self._base: tuple[float, float, float, float] | bool | None = False
        self._whole: tuple[float, float] | None = None  # (whole-layer bottleneck, x_top)
        self._tails: dict[int | None, tuple[float, float]] | None = None  # last -> (head, floor)
        self._grids: dict[float, list[float]] | None = None  # x0 -> Σt_min at x0·r, x0·r², …

    def _order_free(self) -> tuple[float, float, float, float] | None:
        """The terms of the cheap first bound (the rest, :meth:`_whole_terms`, on demand)."""
        base = self._base
        if base is False:
            choices, layers = self.choices, self.layers
            base = None
            if choices and sum(ch.k for ch in choices) <= layers:
                xc = bottleneck_lower_bound(choices, layers, whole=False)
                if xc != math.inf:
                    sigma_inf = sum_lower_bound(choices, layers, by_a=self._by_a)
                    if sigma_inf != math.inf:
                        base = (xc, sigma_inf, dp_lower_bound(choices, layers),
                                max(ch.a for ch in choices))
            self._base = base
        return base

    def _whole_terms(self) -> tuple[float, float]:
        """(whole-layer bottleneck, top of the grid)."""
        out = self._whole
        if out is None:
            choices = self.choices
            base = self._order_free()
            out = self._whole = (bottleneck_lower_bound(
                choices, self.layers, start=None if base is None else base[0]),
                max(ch.a * ch.cap for ch in choices))
        return out

    def _tail(self, last: Choice | None, max_a: float) -> tuple[float, float]:
        key = None if last is None else id(last)
        if self._tails is None:
            self._tails = {}
        out = self._tails.get(key)
        if out is None:
            tails = self.choices if last is None else (last,)
            head = min(ch.stats.head for ch in tails)
            floor = max(max_a,  # every stage holds at least one layer
                        min(ch.a + ch.stats.head for ch in tails))
            out = self._tails[key] = (head, floor)
        return out

    def _sigma(self, x0: float, j: int) -> float:
        """``sum_lower_bound`` at the ``j``-th grid point above ``x0`` (memoised)."""
        if self._grids is None:
            self._grids = {}
        grid = self._grids.get(x0)
        if grid is None:
            grid = self._grids[x0] = []
        while len(grid) <= j:
            x = x0
            for _ in range(len(grid) + 1):
                x = x * GRID_RATIO
            grid.append(sum_lower_bound(self.choices, self.layers, x, self._by_a))
        return grid[j]

    def dp_bound(self) -> float:
        """:func:`dp_lower_bound` of these choices (inf when they cannot hold the layers)."""
        base = self._order_free()
        return math.inf if base is None else base[2]

    def bound(self, boundary: tuple[float, ...] | Callable[[], tuple[float, ...]]
              = (0.0, 0.0), last: Choice | None = None, bubble_div: float = 3.0,
              cutoff: float = math.inf) -> float:
        """:func:`step_lower_bound` of these choices with these arguments. ``boundary``:
        ``(slowest, sum)`` of the boundary transfers, or ``(slowest, sum, delay)`` with a
        ``delay`` every layout pays whole, whatever its schedule (a datacenter link's
        latency: ``planner._ordered_bounds``), added undivided."""
        base = self._order_free()
        if base is None:
            return math.inf
        xc, sigma_inf, d, max_a = base
        head, floor = self._tail(last, max_a)
        slope = self.m - 1.0 / bubble_div
        best = slope * max(xc, floor) + (sigma_inf + head) / bubble_div + d  # cheap first
        if best >= cutoff:
            return best
        p_max, p_sum, *delay = boundary() if callable(boundary) else boundary
        x_whole, x_top = self._whole_terms()
        x0 = max(x_whole, floor)
        rest = (sigma_inf + head + p_sum) / bubble_div + d + (delay[0] if delay else 0.0)
        best = slope * max(x0, p_max) + rest  # whole layers and boundaries, X and Σt uncoupled
        if best >= cutoff:
            return best
        coupled = math.inf
        x = x0
        for j in range(GRID_STEPS):
            if x >= x_top or slope * max(x, p_max) + rest >= coupled:
                break
            nxt = x * GRID_RATIO
            sigma = self._sigma(x0, j)
            if sigma < math.inf:
                coupled = min(coupled, slope * max(x, p_max) + rest
                              + (sigma - sigma_inf) / bubble_div)
            x = nxt
        return max(best, min(coupled, slope * max(x, p_max) + rest))


def partial_lower_bound(chosen: Sequence[Choice], rest_rate: float, rest_cap: int,
                        rest_min_a: float, layers: int, m: int, bubble_div: float = 3.0,
                        inside: tuple[float, float] = (0.0, 0.0),
                        rest_min_head: float = math.inf,
                        rest_min_a_head: float = math.inf) -> float:
    """Bound over every completion of ``chosen`` by units that add at most ``rest_rate`` layers
    per second of bottleneck, ``rest_cap`` layers of memory, and no layer cheaper than
    ``rest_min_a``. ``inside``: the slowest and the sum of the boundaries inside the chosen
    units (``k − 1`` each, between a unit's consecutive stages; every completion keeps them).
    ``rest_min_head``, ``rest_min_a_head``: the smallest LM head time ``head`` and ``a + head``
    among the units that may be added (inf: none).

    The last stage runs the LM head on one layer at least, so ``Σt`` gains the smallest
    ``head`` and the bottleneck is at least the smallest ``a + head`` over the chosen units
    and those that may be added (the last stage is one of them), and at least every chosen
    unit's ``a`` (each of its stages holds a layer), as in :meth:`LeafBound.bound`."""
    return partial_bound_of_sums(PartialSums.of(chosen), rest_rate, rest_cap, rest_min_a,
                                 layers, m, bubble_div, inside, rest_min_head, rest_min_a_head)


class PartialSums(NamedTuple):
    """What :func:`partial_lower_bound` needs of the chosen units, kept as the search adds one
    choice at a time (:meth:`add`; the same left-to-right sums as over the whole list, so the
    bound is bit-identical): stages, their layer capacity, layers per second of bottleneck,
    ``Σ k·a``, the cheapest layer, the slowest DP sync, GPUs per replica, the slowest layer,
    the smallest LM head ``head`` and ``a + head``."""

    pp: int = 0
    kcap: int = 0
    rate: float = 0  # an int 0 as sum() starts: the sums stay bit-identical
    ka: float = 0
    min_a: float = math.inf
    d: float = 0.0
    gpus: int = 0
    max_a: float = 0.0
    min_head: float = math.inf
    min_a_head: float = math.inf

    def add(self, ch: Choice) -> PartialSums:
        """These sums with ``ch`` chosen too."""
        d = ch.stats.dp_c + ch.stats.dp_e
        head = ch.stats.head
        a_head = ch.a + head
        return PartialSums(self.pp + ch.k, self.kcap + ch.kcap, self.rate + ch.rate,
                           self.ka + ch.ka, ch.a if ch.a < self.min_a else self.min_a,
                           d if d > self.d else self.d, self.gpus + ch.tp * ch.k,
                           ch.a if ch.a > self.max_a else self.max_a,
                           head if head < self.min_head else self.min_head,
                           a_head if a_head < self.min_a_head else self.min_a_head)

    @staticmethod
    def of(chosen: Sequence[Choice]) -> PartialSums:
        """The sums of ``chosen``."""
        out = PartialSums()
        for ch in chosen:
            out = out.add(ch)
        return out


def partial_bound_of_sums(sums: PartialSums, rest_rate: float, rest_cap: int,
                          rest_min_a: float, layers: int, m: int, bubble_div: float = 3.0,
                          inside: tuple[float, float] = (0.0, 0.0),
                          rest_min_head: float = math.inf,
                          rest_min_a_head: float = math.inf) -> float:
    """:func:`partial_lower_bound` from the chosen units' :class:`PartialSums`."""
    pp = sums.pp
    if pp > layers:
        return math.inf
    if sums.kcap + rest_cap < layers:
        return math.inf
    rate = sums.rate + rest_rate
    if rate <= 0:
        return math.inf
    x = layers / rate
    min_a = rest_min_a if rest_min_a < sums.min_a else sums.min_a
    sigma = sums.ka + (layers - pp) * min_a
    head = rest_min_head if rest_min_head < sums.min_head else sums.min_head
    a_head = rest_min_a_head if rest_min_a_head < sums.min_a_head else sums.min_a_head
    if head < math.inf:  # the last stage's LM head (module doc of partial_lower_bound)
        sigma += head
        x = max(x, a_head)
    return ((m - 1.0 / bubble_div) * max(x, inside[0], sums.max_a)
            + (sigma + inside[1]) / bubble_div + sums.d)


def memory_need_gib(choices: Sequence[Choice], layers: int, gib: float, headroom: float) -> float:
    """GiB per device the best of ``choices`` would need for an even split (error messages)."""
    pp = max(1, sum(ch.k for ch in choices))
    per = math.ceil(layers / pp)
    return min((ch.stats.fixed_bytes + ch.stats.layer_bytes * per) / headroom / gib
               for ch in choices)


def order_caps_bound(groups: Sequence[tuple[float, float, Sequence[int]]], layers: int, m: int,
                     bubble_div: float, boundaries: tuple[float, float], d: float) -> float:
    """Bound on the step time of one stage order from its stages' exact layer caps.

    ``groups``: ``(a, b, caps)`` for stages that share a per-layer time ``a`` and a fixed time
    ``b`` (the last stage's LM head), one cap per stage (already at most ``layers − (pp − 1)``);
    caps that hold for every schedule considered (1F1B's are the largest). ``boundaries``: the
    order's exact slowest and summed boundary transfers; ``d``: a bound on the slowest DP
    sync. With ``X`` the smallest bottleneck at which the stages can hold the layers, whole and
    at least one each (``Σ min(cap, ⌊(X − b)/a⌋) ≥ layers``), and ``Σt`` the cheapest fill under
    the caps, every split costs at least ``(m − 1/r)·max(X, P) + (Σt + Σp)/r + d`` (module
    doc; ``r = bubble_div`` the largest divisor of the schedules the order may run). Unlike
    :func:`step_lower_bound` it sees where the order puts each stage (the in-flight
    microbatches of its position), not the relaxed per-unit capacity. inf when the caps cannot
    hold the layers.
    """
    pp = sum(len(caps) for _, _, caps in groups)
    left = layers - pp
    if left < 0 or any(min(caps) < 1 for _, _, caps in groups):
        return math.inf
    sigma = sum((a + b) * len(caps) for a, b, caps in groups)
    for a, _, caps in sorted(groups, key=lambda g: g[0]):
        take = min(left, sum(caps) - len(caps))
        sigma += take * a
        left -= take
        if not left:
            break
    if left:
        return math.inf
    x = _caps_bottleneck(groups, layers)
    p_max, p_sum = boundaries
    bound = (m - 1.0 / bubble_div) * max(x, p_max) + (sigma + p_sum) / bubble_div + d
    return bound * (1.0 - 1e-9)  # the whole-layer test's tolerance: never above a real split


def _caps_bottleneck(groups: Sequence[tuple[float, float, Sequence[int]]], layers: int) -> float:
    """Smallest ``X ≥ max(a + b)`` with ``Σ min(cap, ⌊(X − b)/a⌋) ≥ layers`` over the stages
    of ``groups`` (:func:`order_caps_bound`): from the continuous relaxation, stepping to the
    next value where some group's stages fit one more whole layer."""
    floor = max(a + b for a, b, _ in groups)
    # continuous relaxation Σ min(cap, (X − b)/a) = layers, stages saturating in turn
    stages = sorted((a * c + b, a, b, c) for a, b, caps in groups for c in caps)
    rate = sum(1.0 / a for _, a, _, _ in stages)
    offset = sum(b / a for _, a, b, _ in stages)
    held = 0
    x = stages[-1][0]
    for sat, a, b, c in stages:
        x = (layers - held + offset) / rate
        if x <= sat:
            break
        held += c
        rate -= 1.0 / a
        offset -= b / a
    x = max(floor, min(x, stages[-1][0]))
    prepared = []
    for a, b, caps in groups:
        srt = sorted(caps)
        prefix = [0]
        for c in srt:
            prefix.append(prefix[-1] + c)
        prepared.append((a, b, srt, prefix))
    for _ in range(4 * layers + 4):
        held, nxt = 0, math.inf
        for a, b, srt, prefix in prepared:
            q = int((x - b) / a + 1e-9)
            if q <= 0:
                nxt = min(nxt, a + b)
                continue
            i = bisect.bisect_left(srt, q)  # stages with cap < q hold their cap
            held += prefix[i] + q * (len(srt) - i)
            if i < len(srt):
                nxt = min(nxt, a * (q + 1) + b)
        if held >= layers or nxt == math.inf:
            return x if held >= layers else math.inf
        x = nxt
    return x
