"""Pure checks of the per-stage action lists (hettrain.runtime.schedules): completeness,
dependencies (via a replay that would deadlock otherwise), memory bounds, and that ZB-H1's
executed order leaves the bubble the planner's cost model assumes."""

from __future__ import annotations

import pytest

from hettrain.planning.cost import pipeline_time_s
from hettrain.runtime.schedules import schedule_order, simulate, stage_actions

CASES = [(1, 4), (2, 4), (3, 4), (4, 3), (3, 8), (4, 8), (8, 16), (5, 1)]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
@pytest.mark.parametrize("pp,m", CASES)
def test_every_microbatch_gets_one_f_b_w_in_dependency_order(schedule, pp, m):
    every = [stage_actions(schedule, s, pp, m) for s in range(pp)]
    for acts in every:
        assert sorted(acts) == sorted((k, i) for k in "FBW" for i in range(m))
        pos = {a: n for n, a in enumerate(acts)}
        assert all(pos[("F", i)] < pos[("B", i)] < pos[("W", i)] for i in range(m))
        assert [i for k, i in acts if k == "B"] == list(range(m))
        assert [i for k, i in acts if k == "F"] == list(range(m))
    # cross-stage dependencies: the replay raises if some action waits on one never reached
    assert simulate(every, {"F": 1.0, "B": 1.0, "W": 1.0}) >= 3 * m


def _peaks(acts):
    """(max F-done-B-not, max F-done-W-not) over the action list."""
    f = b = w = pb = pw = 0
    for kind, _ in acts:
        f, b, w = f + (kind == "F"), b + (kind == "B"), w + (kind == "W")
        pb, pw = max(pb, f - b), max(pw, f - w)
    return pb, pw


@pytest.mark.parametrize("pp,m", CASES)
def test_zb_h1_keeps_1f1b_activation_bounds(pp, m):
    for s in range(pp):
        full, pending = _peaks(stage_actions("zb-h1", s, pp, m))
        one_f_one_b, _ = _peaks(stage_actions("1f1b", s, pp, m))
        assert one_f_one_b == min(pp - s, m)
        assert full <= one_f_one_b  # full activation graphs: the stage's own 1F1B bound
        assert pending <= min(pp, m)  # stashed linear inputs: 1F1B's peak (stage 0)
    # same warm-up as 1F1B
    for s in range(pp):
        z, o = stage_actions("zb-h1", s, pp, m), stage_actions("1f1b", s, pp, m)
        first_b = next(n for n, a in enumerate(o) if a[0] == "B")
        assert z[:first_b] == o[:first_b]


def test_1f1b_and_gpipe_run_w_right_after_b_and_zb_h1_defers_it_by_the_stage_index():
    for schedule in ("1f1b", "gpipe"):
        for s in range(3):
            acts = stage_actions(schedule, s, 3, 6)
            assert all(acts[n + 1] == ("W", i) for n, (k, i) in enumerate(acts) if k == "B")
            assert schedule_order(schedule, s, 3, 6) == [a for a in acts if a[0] != "W"]
    assert stage_actions("zb-h1", 1, 3, 4) == [
        ("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("W", 0), ("F", 3), ("B", 2),
        ("W", 1), ("B", 3), ("W", 2), ("W", 3)]
    last = stage_actions("zb-h1", 2, 3, 4)
    assert last[:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]  # W's of the last stage wait


@pytest.mark.parametrize("pp,m", [(2, 4), (3, 4), (4, 8), (8, 16), (4, 32)])
def test_zb_h1_bubble_is_a_third_of_1f1b_as_the_planner_models(pp, m):
    # unit costs F = B = W; 1F1B runs B+W as one backward before sending the gradient upstream
    one = simulate([stage_actions("1f1b", s, pp, m) for s in range(pp)],
                   {"F": 1.0, "B": 2.0, "W": 0.0})
    zb = simulate([stage_actions("zb-h1", s, pp, m) for s in range(pp)],
                  {"F": 1.0, "B": 1.0, "W": 1.0})
    work = 3.0 * m
    assert one - work == pytest.approx(3.0 * (pp - 1))  # (p-1)(F+B+W)
    assert zb - work == pytest.approx(1.0 * (pp - 1))  # Qi et al.: (p-1)(F+B-W)
    stages = [3.0] * pp
    for sched, got in (("1f1b", one), ("zb-h1", zb)):
        total, _ = pipeline_time_s(stages, [0.0] * (pp - 1), m, sched)
        assert total == pytest.approx(got)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="schedule must be one of"):
        stage_actions("zigzag", 0, 2, 4)
    with pytest.raises(ValueError, match=r"stage=2 must lie in \[0, pp=2\)"):
        stage_actions("zb-h1", 2, 2, 4)
    with pytest.raises(ValueError, match="num_microbatches=0"):
        stage_actions("1f1b", 0, 2, 0)
