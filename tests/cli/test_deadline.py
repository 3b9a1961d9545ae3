"""hettrain.deadline: the command line's wall-clock limit on planning."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from hettrain.deadline import PlanningTimeout, deadline, plan_timeout_default


def _spin(seconds: float) -> None:
    """Pure-Python work, like the planner's search (no sleeping in C)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_the_body_is_interrupted_at_the_deadline_even_inside_except_exception() -> None:
    t0 = time.monotonic()
    with pytest.raises(PlanningTimeout), deadline(0.2):
        try:
            _spin(10)
        except Exception:  # what a careless planner might do
            pytest.fail("PlanningTimeout must not be an Exception")
    assert time.monotonic() - t0 < 5


def test_a_body_inside_its_deadline_leaves_no_timer_and_the_old_handler() -> None:
    before = signal.getsignal(signal.SIGALRM)
    with deadline(5):
        _spin(0.01)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before


def test_zero_and_other_threads_mean_no_limit() -> None:
    with deadline(0):
        _spin(0.05)
    done: list[bool] = []

    def other() -> None:
        with deadline(0.01):
            _spin(0.1)
        done.append(True)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(10)
    assert done == [True]


def test_the_default_is_the_operators_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HETTRAIN_PLAN_TIMEOUT_SECONDS", raising=False)
    assert plan_timeout_default() == 30.0
    monkeypatch.setenv("HETTRAIN_PLAN_TIMEOUT_SECONDS", "7.5")
    assert plan_timeout_default() == 7.5
    monkeypatch.setenv("HETTRAIN_PLAN_TIMEOUT_SECONDS", "nan")
    with pytest.raises(ValueError, match="HETTRAIN_PLAN_TIMEOUT_SECONDS"):
        plan_timeout_default()
    assert plan_timeout_default(4) == 4.0  # the flag wins, the variable is not read


def test_the_default_reads_only_the_timeout_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator's other budget variables do not concern the command line: a bad one in
    the user's shell does not stop ``hettrain plan`` (the operator still refuses it)."""
    from hettrain.planguard import Budget

    monkeypatch.setenv("HETTRAIN_PLAN_WORKERS", "many")
    monkeypatch.setenv("HETTRAIN_PLAN_MEMORY_MB", "-1")
    monkeypatch.setenv("HETTRAIN_PLAN_TIMEOUT_SECONDS", "12")
    assert plan_timeout_default() == 12.0
    with pytest.raises(ValueError, match="HETTRAIN_PLAN_MEMORY_MB"):
        Budget.from_env()
    monkeypatch.delenv("HETTRAIN_PLAN_TIMEOUT_SECONDS")
    assert plan_timeout_default() == Budget().timeout_s
