"""A wall-clock limit on a block of pure-Python work, for the command line's planning.

The operator plans in worker processes it can kill (:mod:`hettrain.planguard`). A command-line
run has one process and nothing to kill, so ``hettrain plan``, ``validate --cluster`` and
``simulate`` bound each plan with :func:`deadline` instead: a real-time interval timer whose
signal raises :class:`PlanningTimeout` inside the planner, wherever it is.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class PlanningTimeout(BaseException):
    """The :func:`deadline` passed. A BaseException, so no ``except Exception`` in the
    interrupted code can swallow it."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`PlanningTimeout` in the body after ``seconds`` of wall time (``0``: no
    limit). Works on the main thread of a POSIX process, where the ``hettrain`` script runs;
    elsewhere (another thread, no ``setitimer``) the body runs without a limit."""
    if (seconds <= 0 or not hasattr(signal, "setitimer")
            or threading.current_thread() is not threading.main_thread()):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise PlanningTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def plan_timeout_default(flag: float | None = None) -> float:
    """The command line's planning limit: ``flag`` (``--timeout-s``) when given, else the
    operator's budget (``HETTRAIN_PLAN_TIMEOUT_SECONDS``, default 30 s), so the CLI refuses
    what the operator would. A bad value of that variable raises ValueError naming it (the
    operator's other budget variables are not read)."""
    if flag is not None:
        return float(flag)
    from hettrain.planguard import Budget

    return Budget.timeout_from_env()
