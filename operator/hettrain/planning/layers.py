"""Non-uniform layer split across heterogeneous pipeline stages.

Stage ``i`` with ``n`` layers has compute time ``t_i(n) = a_i·n + b_i``, data-parallel
all-reduce time ``d_i(n) = c_i·n + e_i`` and memory ``mem_i(n) = f_i + g_i·n ≤ cap_i``. The step
time to minimise is ``T(n) = (m−1)·max(max_i t_i, P) + Σ_i t_i + max_i d_i`` with ``Σ n_i = L``,
``n_i ≥ lo`` (``P`` is the slowest boundary transfer, a constant here).

:func:`split_layers` is exact: the optimum has some bottleneck values ``(C, D) = (max t, max d)``;
for a candidate pair the layer caps are ``n_i ≤ min(mem, t⁻¹(C), d⁻¹(D))`` and, with caps fixed,
``Σ a_i n_i`` is minimised greedily (fill the cheapest stages first). Enumerating candidate pairs in
ascending order with a lower bound ``(m−1)·max(C, P) + Σ_min + D`` prunes almost all of them.
:func:`split_layers_brute_force` enumerates every composition; tests check both agree.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hettrain.api.spec import chunked_schedule


@dataclass(frozen=True, slots=True)
class StageCost:
    """Affine costs of one stage as functions of its layer count."""

    a: float  # seconds per layer (per microbatch, fwd+bwd)
    b: float  # fixed seconds (embedding / head)
    c: float  # DP all-reduce seconds per layer
    e: float  # fixed DP seconds
    max_layers: int  # memory cap (layers that fit)

    def time(self, n: int) -> float:
        """Compute time with ``n`` layers."""
        return self.a * n + self.b

    def dp(self, n: int) -> float:
        """Gradient all-reduce time with ``n`` layers."""
        return self.c * n + self.e


def step_time(stages: Sequence[StageCost], split: Sequence[int], m: float,
              boundary: float) -> float:
    """The objective ``T`` for one split."""
    times = [s.time(n) for s, n in zip(stages, split, strict=True)]
    dps = [s.dp(n) for s, n in zip(stages, split, strict=True)]
    return (m - 1) * max(max(times), boundary) + sum(times) + max(dps)


def _greedy(stages: Sequence[StageCost], caps: Sequence[int], total: int,
            lo: int, order: Sequence[int]) -> list[int] | None:
    if sum(caps) < total or min(caps) < lo:
        return None
    split = [lo] * len(stages)
    left = total - lo * len(stages)
    for i in order:
        take = min(left, caps[i] - lo)
        split[i] += take
        left -= take
        if not left:
            break
    return split


def _cap(slope: float, fixed: float, limit: float, hard: int) -> int:
    if slope <= 0:
        return hard if fixed <= limit + 1e-15 else 0
    return min(hard, int((limit - fixed) / slope + 1e-9))


def lower_bound(stages: Sequence[StageCost], total: int, m: float, boundary: float = 0.0,
                lo: int = 1) -> float:
    """A valid lower bound on the optimal ``T`` (inf when memory cannot hold the layers).

    The bottleneck ``X`` satisfies ``Σ (X − b_i)/a_i ≥ total``; ``Σ t`` is at least its
    minimum under the memory caps; ``max d`` is at least every stage's ``d(lo)``.
    """
    k = len(stages)
    hard = [min(s.max_layers, total - lo * (k - 1)) for s in stages]
    if any(h < lo for h in hard) or sum(hard) < total:
        return math.inf
    order = sorted(range(k), key=lambda i: (stages[i].a, i))
    base = _greedy(stages, hard, total, lo, order)
    assert base is not None
    sigma_min = sum(s.time(n) for s, n in zip(stages, base, strict=True))
    if all(s.a > 0 for s in stages):
        x_lb = (total + sum(s.b / s.a for s in stages)) / sum(1 / s.a for s in stages)
    else:
        x_lb = 0.0
    x_lb = max(x_lb, max(s.time(lo) for s in stages))
    return (m - 1) * max(x_lb, boundary) + sigma_min + max(s.dp(lo) for s in stages)


@dataclass(frozen=True, slots=True)
class _Kind:
    """Identical stages (same costs and cap); ``members`` are their stage indices."""

    a: float
    b: float
    c: float
    e: float
    hard: int
    members: tuple[int, ...]
    count: int  # len(members)


def _kinds(stages: Sequence[StageCost], hard: Sequence[int]) -> list[_Kind]:
    """Stages grouped by identical costs, in greedy fill order (cheapest per layer first)."""
    groups: dict[tuple[float, float, float, float, int], list[int]] = {}
    for i, (s, h) in enumerate(zip(stages, hard, strict=True)):
        groups.setdefault((s.a, s.b, s.c, s.e, h), []).append(i)
    kinds = [_Kind(*key, members=tuple(ix), count=len(ix)) for key, ix in groups.items()]
    return sorted(kinds, key=lambda q: (q.a, q.members[0]))


class _Candidates:
    """The values ``slope·n + intercept`` (``lo ≤ n ≤ top``, one line per kind of stage),
    navigated by arithmetic: the next value above ``x`` or the last one below it costs
    ``O(lines)``, whatever the number of layers, so no list of every value is ever built."""

    def __init__(self, lines: Sequence[tuple[float, float, int]], lo: int) -> None:
        self.lo = lo
        self.lines = [(sl, ic, top if sl > 0 else lo) for sl, ic, top in lines if top >= lo]

    def _n_at_least(self, sl: float, ic: float, top: int, x: float) -> int:
        """Smallest ``n`` in [lo, top] with ``sl·n + ic ≥ x`` (top + 1 when none)."""
        if sl <= 0:
            return self.lo if ic >= x else top + 1
        q = (x - ic) / sl
        n = top + 1 if q > top else self.lo if q < self.lo else math.ceil(q)
        while n > self.lo and sl * (n - 1) + ic >= x:
            n -= 1
        while n <= top and sl * n + ic < x:
            n += 1
        return n

    def at_least(self, x: float, strict: bool = False) -> float | None:
        """Smallest value ``≥ x`` (``> x`` when ``strict``), None when there is none."""
        out = None
        for sl, ic, top in self.lines:
            n = self._n_at_least(sl, ic, top, x)
            while n <= top and strict and sl * n + ic <= x:
                n += 1
            if n <= top:
                v = sl * n + ic
                out = v if out is None or v < out else out
        return out

    def at_most(self, x: float) -> float | None:
        """Largest value ``≤ x``, None when there is none."""
        out = None
        for sl, ic, top in self.lines:
            n = self._n_at_least(sl, ic, top, x)
            if n <= top and sl * n + ic <= x:
                v = sl * n + ic
            elif n - 1 >= self.lo:
                v = sl * (n - 1) + ic
            else:
                continue
            out = v if out is None or v > out else out
        return out

    def first(self, accept: Callable[[float], bool]) -> float | None:
        """Smallest value ``accept`` takes (``accept`` monotone: false, then true)."""
        out = None
        for sl, ic, top in self.lines:
            n = bisect.bisect_left(range(self.lo, top + 1), True,
                                   key=lambda x, sl=sl, ic=ic: accept(sl * x + ic)) + self.lo
            if n <= top:
                v = sl * n + ic
                out = v if out is None or v < out else out
        return out


SCAN_CANDIDATES = 4096  # up to this many bottleneck candidates a plain scan is fastest


def split_layers(stages: Sequence[StageCost], total: int, m: float, boundary: float = 0.0,
                 lo: int = 1, bound: float = math.inf) -> tuple[float, list[int]] | None:
    """Optimal split of ``total`` layers; None when memory cannot hold them, or when no split
    beats ``bound`` (an incumbent from elsewhere in a search).

    Two exact methods: a scan over every candidate bottleneck value (:func:`_split_layers_scan`,
    fastest for real layer counts) and, above ``SCAN_CANDIDATES`` candidates, a bisection over
    them whose cost does not grow with ``total`` (:func:`_split_layers_kinds`).
    """
    k = len(stages)
    hard = [min(s.max_layers, total - lo * (k - 1)) for s in stages]
    if any(h < lo for h in hard) or sum(hard) < total:
        return None
    distinct = {(s.a, s.b, s.c, s.e, h) for s, h in zip(stages, hard, strict=True)}
    if sum(h - lo + 1 for *_, h in distinct) <= SCAN_CANDIDATES:
        return _split_layers_scan(stages, total, m, boundary, lo, bound)
    return _split_layers_kinds(stages, total, m, boundary, lo, bound)


def _split_layers_scan(stages: Sequence[StageCost], total: int, m: float, boundary: float,
                       lo: int, bound: float) -> tuple[float, list[int]] | None:
    """:func:`split_layers` by a scan over every candidate bottleneck (fastest when there are
    few: real layer counts)."""
    k = len(stages)
    hard = [min(s.max_layers, total - lo * (k - 1)) for s in stages]
    if any(h < lo for h in hard) or sum(hard) < total:
        return None
    order = sorted(range(k), key=lambda i: (stages[i].a, i))
    base = _greedy(stages, hard, total, lo, order)
    assert base is not None
    sigma_min = sum(s.time(n) for s, n in zip(stages, base, strict=True))
    d_min = max(s.dp(lo) for s in stages)
    # identical stages (same unit, same position class) contribute the same candidate values
    distinct = {(s.a, s.b, s.c, s.e, h) for s, h in zip(stages, hard, strict=True)}
    c_values = sorted({a * n + b for a, b, _, _, h in distinct for n in range(lo, h + 1)})
    d_values = sorted({c * n + e for _, _, c, e, h in distinct for n in range(lo, h + 1)})
    best: tuple[float, list[int]] | None = None
    incumbent = bound

    def caps_for(cap_c: float) -> list[int]:
        return [_cap(s.a, s.b, cap_c, h) for s, h in zip(stages, hard, strict=True)]

    def feasible(caps: list[int]) -> bool:
        return sum(caps) >= total and min(caps) >= lo

    # Feasibility is monotone in the cap: bisect to the smallest feasible bottleneck.
    first = bisect.bisect_left(range(len(c_values)), True,
                               key=lambda j: feasible(caps_for(c_values[j])))
    for cap_c in c_values[first:]:
        lower = (m - 1) * max(cap_c, boundary) + sigma_min + d_min
        if lower >= incumbent - 1e-15:
            break
        caps_c = caps_for(cap_c)
        if not feasible(caps_c):
            continue
        # every split with max t ≤ cap_c has Σt at least the greedy fill under these caps
        fill = _greedy(stages, caps_c, total, lo, order)
        if fill is not None and (m - 1) * max(cap_c, boundary) + d_min + sum(
                s.time(n) for s, n in zip(stages, fill, strict=True)) >= incumbent - 1e-15:
            continue

        def caps_cd(cap_d: float, caps_c: list[int] = caps_c) -> list[int]:
            return [min(cc, _cap(s.c, s.e, cap_d, cc)) for s, cc in zip(stages, caps_c,
                                                                        strict=True)]

        first_d = bisect.bisect_left(range(len(d_values)), True,
                                     key=lambda j: feasible(caps_cd(d_values[j])))
        for cap_d in d_values[first_d:]:
            if (m - 1) * max(cap_c, boundary) + sigma_min + cap_d >= incumbent - 1e-15:
                break
            split = _greedy(stages, caps_cd(cap_d), total, lo, order)
            if split is None:
                continue
            t = step_time(stages, split, m, boundary)
            if t < incumbent - 1e-15:
                best, incumbent = (t, split), t
    return best


def _split_layers_kinds(stages: Sequence[StageCost], total: int, m: float, boundary: float,
                        lo: int, bound: float) -> tuple[float, list[int]] | None:
    """:func:`split_layers` with work independent of ``total``.

    Identical stages are handled as one kind with a multiplicity (for a fixed number of layers
    on a kind, spreading them evenly over its stages minimises both its ``max t`` and its
    ``max d`` at the same ``Σ t``). The bottleneck candidates ``C`` (and, per ``C``, ``D``)
    are navigated by arithmetic (:class:`_Candidates`) and bisected with monotone bounds
    (:func:`_min_over_window`): the work grows with the number of kinds and the logarithm of
    the candidates, not with ``total``.
    """
    k = len(stages)
    hard = [min(s.max_layers, total - lo * (k - 1)) for s in stages]
    if any(h < lo for h in hard) or sum(hard) < total:
        return None
    kinds = _kinds(stages, hard)
    left0 = total - lo * k

    def fill(caps: Sequence[int]) -> list[int] | None:
        """Layers per kind: the cheapest kinds first, each stage up to its cap."""
        left = left0
        out = []
        for q, cap in zip(kinds, caps, strict=True):
            take = min(left, q.count * (cap - lo))
            out.append(q.count * lo + take)
            left -= take
        return None if left else out

    def sum_t(per_kind: Sequence[int]) -> float:
        return sum(q.a * n + q.count * q.b for q, n in zip(kinds, per_kind, strict=True))

    def feasible(caps: Sequence[int]) -> bool:
        return min(caps) >= lo and sum(q.count * c for q, c in zip(kinds, caps,
                                                                     strict=True)) >= total

    def caps_for(cap_c: float) -> list[int]:
        return [_cap(q.a, q.b, cap_c, q.hard) for q in kinds]

    base = fill([q.hard for q in kinds])
    assert base is not None
    sigma_min = sum_t(base)
    d_min = max(q.c * lo + q.e for q in kinds)
    best: tuple[float, list[int]] | None = None
    incumbent = bound
    # W = min over all splits of Σt + max d (the bottleneck term left out): every split with
    # max t = C costs at least (m−1)·max(C, P) + W, which ends the ascending scan over C
    w_min = math.inf
    d_lines = [(q.c, q.e, q.hard) for q in kinds]

    def caps_d(cap_d: float) -> list[int]:
        return [_cap(q.c, q.e, cap_d, q.hard) for q in kinds]

    def sigma_at(cap_d: float) -> float:
        nonlocal w_min
        per_kind = fill(caps_d(cap_d))
        if per_kind is None:
            return math.inf
        sigma = sum_t(per_kind)
        w_min = min(w_min, sigma + cap_d)
        return sigma

    _min_over_window(_Candidates(d_lines, lo), lambda v: feasible(caps_d(v)),
                     (1.0, -math.inf), sigma_at, lambda: w_min, sigma_min)
    w_min = max(w_min, sigma_min + d_min) if w_min < math.inf else sigma_min + d_min
    c_lines = [(q.a, q.b, q.hard) for q in kinds]

    def head_of(cap_c: float) -> float:
        return (m - 1) * max(cap_c, boundary)

    def scan_d(cap_c: float) -> float:
        """Best splits with max t ≤ ``cap_c`` (offered to the incumbent); returns a lower
        bound on ``Σt + max d`` over all of them (nonincreasing in ``cap_c``)."""
        nonlocal best, incumbent
        head = head_of(cap_c)
        caps_c = caps_for(cap_c)
        per_kind = fill(caps_c)
        if per_kind is None:
            return math.inf
        # every split with max t ≤ cap_c has Σt at least the greedy fill under these caps
        sigma_c = sum_t(per_kind)
        if head + d_min + sigma_c >= incumbent - 1e-15:
            return sigma_c + d_min

        def caps_cd(cap_d: float) -> list[int]:
            return [min(cc, _cap(q.c, q.e, cap_d, cc)) for q, cc in zip(kinds, caps_c,
                                                                       strict=True)]

        found = math.inf

        def sigma_cd(cap_d: float) -> float:
            """Σt of the greedy fill under both caps; its split is offered."""
            nonlocal best, incumbent, found
            per_kind = fill(caps_cd(cap_d))
            if per_kind is None:
                return math.inf
            sigma = sum_t(per_kind)
            found = min(found, sigma + cap_d)
            split = _spread(kinds, per_kind, k)
            t = step_time(stages, split, m, boundary)
            if t < incumbent - 1e-15:
                best, incumbent = (t, split), t
            return sigma

        cd_lines = [(q.c, q.e, cc) for q, cc in zip(kinds, caps_c, strict=True)]
        _min_over_window(_Candidates(cd_lines, lo), lambda v: feasible(caps_cd(v)),
                         (1.0, -math.inf), sigma_cd, lambda: incumbent - 1e-15 - head, sigma_c)
        # what was not visited costs at least the incumbent: Σt + max d ≥ incumbent − head
        return min(found, incumbent - head)

    # Candidates C ascending; R(C) = min Σt + max d over splits with max t ≤ C is
    # nonincreasing, so the bisection of _min_over_window applies
    _min_over_window(_Candidates(c_lines, lo), lambda v: feasible(caps_for(v)),
                     (m - 1, boundary), scan_d, lambda: incumbent - 1e-15, w_min)
    return best


def _min_over_window(cands: _Candidates, accept: Callable[[float], bool],
                     head: tuple[float, float], evaluate: Callable[[float], float],
                     incumbent: Callable[[], float], floor: float) -> None:
    """Minimise ``h·max(x, P) + R(x)`` (``head = (h, P)``, ``h ≥ 0``) over the candidates
    ``x`` that ``accept`` takes, with ``R`` nonincreasing; ``evaluate(x)`` records the solutions
    at ``x`` (lowering ``incumbent()``) and returns a lower bound on ``R(x)``; ``floor`` bounds
    every ``R`` from below.

    On ``x_i ≤ x ≤ x_j`` every solution costs at least ``head(x_i) + R(x_j)``: such an
    interval is refused whole when that reaches the incumbent, else halved (in value, snapped
    to candidates). Candidates past ``head(x) + floor ≥ incumbent`` are never visited.
    """
    h, p = head

    def cost(x: float) -> float:
        return h * max(x, p)

    first = cands.first(accept)
    if first is None:
        return
    bound_at = {first: evaluate(first)}
    if h > 0:
        end = cands.at_most(max((incumbent() - floor) / h, first))
        while end is not None and end > first and cost(end) + floor >= incumbent():
            end = cands.at_most(end - abs(end) * 1e-12 - 1e-300)
    else:
        end = cands.at_most(math.inf)
    start = cands.at_least(first, strict=True)
    if end is None or start is None or start > end:
        return
    todo = [(start, end)]
    while todo:
        i, j = todo.pop()
        if j not in bound_at:
            bound_at[j] = evaluate(j)
        if i >= j or cost(i) + max(bound_at[j], floor) >= incumbent():
            continue
        left_end = cands.at_most((i + j) / 2)
        if left_end is None or left_end < i:
            left_end = i
        right_start = cands.at_least(left_end, strict=True)
        if right_start is not None and right_start <= j:
            todo.append((right_start, j))
        if left_end < j:
            todo.append((i, left_end))


def _spread(kinds: Sequence[_Kind], per_kind: Sequence[int], k: int) -> list[int]:
    """Stage layer counts: each kind's layers spread evenly over its stages (in stage order,
    the larger shares first)."""
    split = [0] * k
    for q, n in zip(kinds, per_kind, strict=True):
        for r, i in enumerate(q.members):
            split[i] = n // q.count + (1 if r < n % q.count else 0)
    return split


def split_layers_brute_force(stages: Sequence[StageCost], total: int, m: float,
                             boundary: float = 0.0, lo: int = 1) -> tuple[float, list[int]] | None:
    """Every composition of ``total`` into ``len(stages)`` parts ≥ ``lo``: the reference."""
    k = len(stages)
    best: tuple[float, list[int]] | None = None
    if total < k * lo:
        return None
    for cuts in itertools.combinations(range(1, total - k * (lo - 1)), k - 1):
        parts = [b - a for a, b in zip((0, *cuts), (*cuts, total - k * (lo - 1)), strict=True)]
        split = [p + lo - 1 for p in parts]
        if any(n > s.max_layers for n, s in zip(split, stages, strict=True)):
            continue
        t = step_time(stages, split, m, boundary)
        if best is None or t < best[0] - 1e-15:
            best = (t, split)
    return best


def chunk_counts(n: int, v: int) -> list[int]:
    """``n`` layers split into ``v`` near-equal contiguous counts (the larger ones first)."""
    return [n // v + (1 if c < n % v else 0) for c in range(v)]


def chunk_layer_ranges(plan) -> list[list[tuple[int, int]]]:
    """Global layer range ``(start, end)`` of every model chunk, per stage: ``out[s][c]``.

    The one mapping the planner side, the renderer and the runtime share. Stage ``s`` holds
    ``n_s = layer_end - layer_start`` layers (from the plan). Without virtual stages
    (``plan.schedule`` not interleaved or interleaved-zb, or ``virtual_stages == 1``) that is
    the plan's own
    contiguous range. With ``v`` virtual stages stage ``s`` holds ``v`` chunks; chunk ``(c, s)``
    gets the ``c``-th of :func:`chunk_counts` ``(n_s, v)`` and the global layer order is
    chunk-major: ``(0,0), (0,1), ..., (0,p-1), (1,0), ..., (v-1,p-1)``. The embedding lives
    in chunk ``(0, 0)``, the head in chunk ``(v-1, p-1)``.

    Raises ``ValueError`` naming the field when a stage has fewer layers than chunks or the
    stages do not cover the model's layers.
    """
    v = plan.virtual_stages if chunked_schedule(plan.schedule) else 1
    if v < 1:
        raise ValueError(f"plan.virtual_stages={v}: must be >= 1")
    counts = [st.layer_end - st.layer_start for st in plan.stages]
    for st, n in zip(plan.stages, counts, strict=True):
        if n < v:
            raise ValueError(
                f"plan.stages[{st.index}] has {n} layers (layer_start={st.layer_start}, "
                f"layer_end={st.layer_end}) < plan.virtual_stages={v}: every stage needs at "
                "least one layer per model chunk; lower virtual_stages or move layers")
    if sum(counts) != plan.model.layers:
        raise ValueError(f"plan.stages hold {sum(counts)} layers in all, the model has "
                         f"{plan.model.layers} (model.layers): fix the stage layer ranges")
    if v == 1:
        return [[(st.layer_start, st.layer_end)] for st in plan.stages]
    per_stage = [chunk_counts(n, v) for n in counts]
    out: list[list[tuple[int, int]]] = [[] for _ in plan.stages]
    start = 0
    for c in range(v):
        for s, split in enumerate(per_stage):
            out[s].append((start, start + split[c]))
            start += split[c]
    return out
