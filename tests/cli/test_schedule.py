"""Pipeline schedule timing: textbook makespans, an independent recursive reference, invariants."""

from __future__ import annotations

import functools
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hettrain.render.schedule import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Timeline,
    _dependency,
    build_timeline,
    interleaved_order,
    one_f_one_b_order,
    zero_bubble_order,
)

T = 3.0  # forward+backward of one microbatch; F = 1, B = 2 (or B = W = 1 for ZB-H1)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 16])
def test_1f1b_makespan_is_m_plus_p_minus_1_slots(p: int, m: int) -> None:
    assert build_timeline([T] * p, m, "1f1b").makespan_ms == pytest.approx((m + p - 1) * T)


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [8, 12, 16, 32])
def test_zb_h1_bubble_is_a_third_of_1f1b(p: int, m: int) -> None:
    # Zero Bubble paper, equal F/B/W: bubble (p-1)(F+B-W) = (p-1)·T/3 vs 1F1B's (p-1)·T.
    zb = build_timeline([T] * p, m, "zb-h1")
    assert zb.makespan_ms == pytest.approx(m * T + (p - 1) * T / 3)


@pytest.mark.parametrize(("p", "v"), [(2, 2), (4, 2), (4, 4), (8, 3)])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_interleaved_bubble_shrinks_by_v(p: int, v: int, groups: int) -> None:
    m = groups * p
    t = build_timeline([T] * p, m, "interleaved", chunks=v)
    assert t.makespan_ms == pytest.approx(m * T + (p - 1) * T / v)


def _reference_times(orders: list[list[tuple]], durations: list[dict[str, float]],
                     p: int, v: int, p2p: float) -> dict[tuple, tuple[float, float]]:
    """Start/end by recursion: an op starts when the previous op of its stage and its input
    are done. Independent of the simulator's event loop."""
    prev = {}
    for order in orders:
        for before, after in itertools.pairwise(order):
            prev[after] = before

    @functools.cache
    def end(key: tuple) -> float:
        start = 0.0
        if key in prev:
            start = end(prev[key])
        dep = _dependency(key, p, v)
        if dep is not None:
            start = max(start, end(dep) + (0.0 if dep[1] == key[1] else p2p))
        return start + durations[key[1]][key[0]]

    return {k: (end(k) - durations[k[1]][k[0]], end(k)) for order in orders for k in order}


def _check_invariants(t: Timeline, times: list[float], p2p: float) -> None:
    by_key = {(o.kind, o.stage, o.microbatch, o.chunk): o for o in t.ops}
    assert len(by_key) == len(t.ops), "an operation ran twice"
    for s in range(t.stages):
        ops = t.on_stage(s)
        for a, b in itertools.pairwise(ops):
            assert a.end_ms <= b.start_ms + 1e-9, f"overlap on stage {s}: {a} {b}"
        assert sum(o.duration_ms for o in ops) == pytest.approx(times[s])  # all work, once
    for key, op in by_key.items():
        dep = _dependency(key, t.stages, t.chunks)
        if dep is not None:
            hop = 0.0 if dep[1] == key[1] else p2p
            assert by_key[dep].end_ms + hop <= op.start_ms + 1e-9, f"{key} before its input"


@settings(max_examples=60, deadline=None)
@given(
    times=st.lists(st.floats(0.5, 50.0), min_size=1, max_size=6),
    m=st.integers(1, 12),
    schedule=st.sampled_from(["1f1b", "zb-h1", "interleaved"]),
    v=st.integers(1, 3),
    p2p=st.sampled_from([0.0, 0.7]),
)
def test_heterogeneous_stages_match_recursive_reference(times: list[float], m: int,
                                                        schedule: str, v: int,
                                                        p2p: float) -> None:
    p = len(times)
    if schedule == "interleaved":
        m = max(1, m // p) * p
    else:
        v = 1
    t = build_timeline(times, m, schedule, chunks=v, p2p_ms=p2p)
    n_kinds = 3 if schedule == "zb-h1" else 2
    assert len(t.ops) == n_kinds * p * m * v
    totals = [x * m for x in times]
    _check_invariants(t, totals, p2p)
    if schedule == "interleaved":
        orders = [interleaved_order(s, p, m, v) for s in range(p)]
        durations = [{FORWARD: x / v / 3, BACKWARD: 2 * x / v / 3} for x in times]
    elif schedule == "zb-h1":
        orders = [zero_bubble_order(s, p, m) for s in range(p)]
        durations = [{FORWARD: x / 3, BACKWARD: x / 3, WEIGHT: x / 3} for x in times]
    else:
        orders = [one_f_one_b_order(s, p, m) for s in range(p)]
        durations = [{FORWARD: x / 3, BACKWARD: 2 * x / 3} for x in times]
    ref = _reference_times(orders, durations, p, v, p2p)
    for o in t.ops:
        start, end = ref[(o.kind, o.stage, o.microbatch, o.chunk)]
        assert o.start_ms == pytest.approx(start) and o.end_ms == pytest.approx(end)
    # The slowest stage bounds the step from below.
    assert t.makespan_ms >= max(totals) - 1e-9


def test_1f1b_keeps_at_most_p_minus_s_microbatches_in_flight() -> None:
    p, m = 5, 12
    for s in range(p):
        in_flight = peak = 0
        for kind, *_ in one_f_one_b_order(s, p, m):
            in_flight += 1 if kind == FORWARD else -1
            peak = max(peak, in_flight)
        assert peak == min(p - s, m)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(stage_times_ms=[], microbatches=4), "stage_times_ms"),
        (dict(stage_times_ms=[1.0, -1.0], microbatches=4), "stage_times_ms"),
        (dict(stage_times_ms=[1.0], microbatches=0), "microbatches"),
        (dict(stage_times_ms=[1.0], microbatches=2, schedule="gpipe"), "schedule"),
        (dict(stage_times_ms=[1.0], microbatches=2, chunks=2), "chunks"),
        (dict(stage_times_ms=[1.0] * 4, microbatches=6, schedule="interleaved", chunks=2),
         "microbatches"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        build_timeline(**kwargs)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize(("p", "m", "warm"), [(3, 8, (2, 1, 0)), (4, 6, (3, 3, 1, 0)),
                                               (2, 3, (5, 0)), (5, 12, (1, 1, 1, 1, 0))])
def test_link_warmup_order_is_the_runtimes(schedule: str, p: int, m: int,
                                           warm: tuple[int, ...]) -> None:
    """The Gantt panel of a pipeline across a datacenter link runs the plan's extra warm-up
    forwards (``stages[].link_warmup``) in the runtime's order (``runtime/schedules``), and
    every stage still runs each microbatch's F, B (and W) once."""
    from hettrain.runtime.schedules import stage_actions

    t = build_timeline([T] * p, m, schedule, link_warmup=warm)
    for s in range(p):
        drawn = [(o.kind, o.microbatch) for o in sorted(t.on_stage(s), key=lambda o: o.start_ms)]
        want = stage_actions(schedule, s, p, m, link_warmup=warm[s])
        if schedule == "1f1b":  # the runtime's W runs inside its B
            want = [a for a in want if a[0] != "W"]
        assert drawn == want, s
    more = build_timeline([T] * p, m, schedule, link_warmup=warm)
    assert len(more.ops) == len(build_timeline([T] * p, m, schedule).ops)


def test_link_warmup_is_refused_where_no_schedule_runs_it() -> None:
    with pytest.raises(ValueError, match="link_warmup"):
        build_timeline([T] * 2, 4, "interleaved", chunks=2, link_warmup=(1, 0))
    with pytest.raises(ValueError, match="link_warmup"):
        build_timeline([T] * 2, 4, "1f1b", link_warmup=(1,))
