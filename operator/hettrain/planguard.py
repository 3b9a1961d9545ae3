"""Planning out of the operator's threads: worker processes with a time and memory budget.

A hostile or huge spec must never stall the operator for everyone. Every plan the live
operator computes runs in one of a few worker processes (:class:`PlanWorkers`); the calling
reconcile thread waits at most ``timeout_s`` for the answer. A plan that runs longer is
abandoned by killing its worker (a fresh one replaces it) and fails with
:class:`PlanBudgetError` (reason ``PlanFailed``, message naming the budget and its knob). A
worker's address space is capped (``RLIMIT_AS``) at ``memory_mb``, so a plan that allocates
too much fails the same way instead of swapping the node. Deleting a job kills its in-flight
plan (:meth:`PlanWorkers.abandon`).

:class:`PassWatchdog` tracks how long each job's reconcile pass has been running; the
operator's liveness probe reports unhealthy when one exceeds its limit (a stuck worker).

Environment: ``HETTRAIN_PLAN_TIMEOUT_SECONDS`` (30), ``HETTRAIN_PLAN_MEMORY_MB`` (1024),
``HETTRAIN_PLAN_WORKERS`` (2).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import resource
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from hettrain.api import constants as c
from hettrain.api.spec import JobSpec
from hettrain.planning.errors import PlanningError
from hettrain.planning.inventory import ClusterInventory
from hettrain.planning.plan import Plan
from hettrain.planning.planner import search_time_hint

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MEMORY_MB = 1024
DEFAULT_WORKERS = 2
#: a plan still "in flight" this long after its deadline means the watchdog itself failed
STUCK_GRACE_S = 10.0

PlanFn = Callable[..., Plan]


class PlanBudgetError(PlanningError):
    """Planning exceeded its time or memory budget (reason ``PlanFailed``)."""

    budget_exceeded = True  # the job fails at once: no wait, no second try on fresh nodes

    def __init__(self, message: str) -> None:
        super().__init__(c.REASON_PLAN_FAILED, message)


class PlanAbandoned(RuntimeError):
    """The plan's worker was killed because its job was deleted (or the operator stops)."""


@dataclass(frozen=True, slots=True)
class Budget:
    """The per-plan budget: wall-clock seconds and worker address space (MiB)."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_mb: int = DEFAULT_MEMORY_MB
    workers: int = DEFAULT_WORKERS

    @classmethod
    def from_env(cls, env: Any = None) -> Budget:
        """Read ``HETTRAIN_PLAN_TIMEOUT_SECONDS``, ``HETTRAIN_PLAN_MEMORY_MB`` and
        ``HETTRAIN_PLAN_WORKERS``; a bad value raises ValueError naming the variable."""
        env = os.environ if env is None else env
        out: dict[str, Any] = {}
        for var, key, kind, low in _BUDGET_VARS:
            value = _env_value(env, var, kind, low)
            if value is not None:
                out[key] = value
        return cls(**out)

    @classmethod
    def timeout_from_env(cls, env: Any = None) -> float:
        """The per-plan seconds alone (``HETTRAIN_PLAN_TIMEOUT_SECONDS``, else the default):
        what the command line needs, so a bad value of the other two variables does not
        stop it; a bad value raises ValueError naming the variable."""
        var, _, kind, low = _BUDGET_VARS[0]
        value = _env_value(os.environ if env is None else env, var, kind, low)
        return DEFAULT_TIMEOUT_S if value is None else value


# (variable, Budget field, type, least value: a float must be > 0, an int >= it)
_BUDGET_VARS: tuple[tuple[str, str, type, int], ...] = (
    ("HETTRAIN_PLAN_TIMEOUT_SECONDS", "timeout_s", float, 0),
    ("HETTRAIN_PLAN_MEMORY_MB", "memory_mb", int, 64),
    ("HETTRAIN_PLAN_WORKERS", "workers", int, 1))


def _env_value(env: Any, var: str, kind: type, low: int) -> Any:
    """``env[var]`` as ``kind`` (None when unset or empty); ValueError naming ``var`` when it
    is not a finite number in range."""
    raw = env.get(var)
    if raw is None or raw == "":
        return None
    try:
        value = kind(raw)
    except ValueError:
        value = None
    ok = value is not None and value == value and value < float("inf") and (
        value > 0 if kind is float else value >= low)
    if not ok:
        want = "a number of seconds > 0" if kind is float else f"an integer >= {low}"
        raise ValueError(f"{var}={raw!r}: must be {want}")
    return value


def _default_plan(name: str, spec: JobSpec, inv: ClusterInventory, previous: Plan | None
                  ) -> Plan:
    from hettrain.planning.planner import plan_job

    return plan_job(name, spec, inv, previous=previous)


def _worker_main(conn: Connection, memory_mb: int, plan_fn: PlanFn) -> None:
    """Worker process: cap the address space, then answer plan requests until EOF."""
    limit = memory_mb * 1024 * 1024
    with contextlib.suppress(ValueError, OSError):  # a platform without RLIMIT_AS
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", plan_fn(*args)))
        except PlanningError as err:
            conn.send(("planning", err.reason, err.message))
        except MemoryError:
            conn.send(("memory",))
        except Exception as err:  # a planner bug: report it, keep the worker
            conn.send(("error", f"{type(err).__name__}: {err}"))


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, ctx: Any, memory_mb: int, plan_fn: PlanFn) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, memory_mb, plan_fn),
                                name="hettrain-plan-worker", daemon=True)
        self.proc.start()
        child.close()

    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class PlanWorkers:
    """A few planning worker processes; :meth:`plan` has the :data:`Planner` shape plus a key.

    ``plan_fn`` (picklable, default :func:`hettrain.planning.planner.plan_job`) is what the
    workers run; tests pass slow or greedy ones.
    """

    def __init__(self, budget: Budget | None = None, plan_fn: PlanFn = _default_plan) -> None:
        self.budget = budget or Budget()
        self._plan_fn = plan_fn
        self._ctx = multiprocessing.get_context("spawn")  # never fork the threaded operator
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(self.budget.workers):
            self._idle.put(None)  # started lazily (or by warm())
        self._lock = threading.Lock()
        self._inflight: dict[Hashable, tuple[_Worker, float, set[Hashable]]] = {}
        self._abandoned: set[Hashable] = set()
        self._closed = False

    def warm(self) -> None:
        """Start every worker now (the operator does this at startup)."""
        workers = []
        while True:
            try:
                workers.append(self._idle.get_nowait())
            except queue.Empty:
                break
        for w in workers:
            self._idle.put(w if w is not None and w.alive() else self._spawn())

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self.budget.memory_mb, self._plan_fn)

    def plan(self, key: Hashable, name: str, spec: JobSpec, inv: ClusterInventory,
             previous: Plan | None) -> Plan:
        """Plan in a worker within the budget. Raises the planner's PlanningError,
        :class:`PlanBudgetError` (time or memory), or :class:`PlanAbandoned`."""
        if self._closed:
            raise PlanAbandoned("the operator is stopping")
        try:  # waiting for a worker is bounded too (all busy: other jobs' plans)
            worker = self._idle.get(timeout=2 * self.budget.timeout_s + STUCK_GRACE_S)
        except queue.Empty:
            raise RuntimeError(f"all {self.budget.workers} planning workers stayed busy; "
                               "retrying (HETTRAIN_PLAN_WORKERS)") from None
        if worker is None or not worker.alive():
            worker = self._spawn()
        started = time.monotonic()
        with self._lock:
            self._abandoned.discard(key)
            self._inflight[key] = (worker, started, set())
        healthy = False
        try:
            worker.conn.send((name, spec, inv, previous))
            if not worker.conn.poll(self.budget.timeout_s):
                raise PlanBudgetError(
                    f"planning took longer than {self.budget.timeout_s:g}s and was stopped; "
                    "make the job smaller or pin spec.parallelism (operator limit "
                    "HETTRAIN_PLAN_TIMEOUT_SECONDS)" + search_time_hint(spec))
            try:
                answer = worker.conn.recv()
            except (EOFError, OSError):
                with self._lock:
                    abandoned = key in self._abandoned
                if abandoned:
                    raise PlanAbandoned(f"planning of {name} abandoned (job deleted)") from None
                raise PlanBudgetError(
                    f"the planning worker died (likely out of its {self.budget.memory_mb} MiB "
                    "memory budget, HETTRAIN_PLAN_MEMORY_MB); make the job smaller") from None
            healthy = True
        finally:
            with self._lock:
                self._inflight.pop(key, None)
            if not healthy:
                worker.kill()
                worker = None  # type: ignore[assignment]
            self._idle.put(worker)
        kind = answer[0]
        if kind == "ok":
            return answer[1]  # type: ignore[no-any-return]
        if kind == "planning":
            raise PlanningError(answer[1], answer[2])
        if kind == "memory":
            raise PlanBudgetError(
                f"planning ran out of its {self.budget.memory_mb} MiB memory budget; make the "
                "job smaller or pin spec.parallelism (operator limit HETTRAIN_PLAN_MEMORY_MB)")
        raise RuntimeError(f"planner error: {answer[1]}")

    def planner(self, key: Hashable) -> Callable[[str, JobSpec, ClusterInventory, Plan | None],
                                                 Plan]:
        """A :data:`hettrain.reconcile.Planner` bound to one job's key."""
        return lambda name, spec, inv, prev: self.plan(key, name, spec, inv, prev)

    def abandon(self, key: Hashable) -> bool:
        """Kill the in-flight plan of ``key`` (its job was deleted); True if there was one."""
        with self._lock:
            entry = self._inflight.get(key)
            if entry is None:
                return False
            self._abandoned.add(key)
        entry[0].proc.kill()
        return True

    def stuck(self, now: float | None = None) -> list[str]:
        """In-flight plans past their deadline plus a grace: the watchdog did not stop them."""
        now = time.monotonic() if now is None else now
        limit = self.budget.timeout_s + STUCK_GRACE_S
        with self._lock:
            return [f"{key}: planning for {now - t:.0f}s" for key, (_, t, _) in
                    self._inflight.items() if now - t > limit]

    def close(self) -> None:
        """Kill every worker (operator shutdown)."""
        self._closed = True
        with self._lock:
            busy = [w for w, _, _ in self._inflight.values()]
        for w in busy:
            w.kill()
        while True:
            try:
                w = self._idle.get_nowait()
            except queue.Empty:
                break
            if w is not None:
                w.kill()


class PassWatchdog:
    """Start times of the reconcile passes in progress, per job; which ones are stuck."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._lock = threading.Lock()
        self._running: dict[Hashable, float] = {}

    def begin(self, key: Hashable, now: float | None = None) -> None:
        """A pass of ``key`` starts."""
        with self._lock:
            self._running[key] = time.monotonic() if now is None else now

    def end(self, key: Hashable) -> None:
        """The pass of ``key`` finished (or failed)."""
        with self._lock:
            self._running.pop(key, None)

    def stuck(self, now: float | None = None) -> list[str]:
        """Passes running longer than the limit, as ``"key: Ns"`` lines."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return [f"{key}: reconcile pass running for {now - t:.0f}s"
                    for key, t in sorted(self._running.items(), key=lambda kv: kv[1])
                    if now - t > self.limit_s]
