"""Operator Prometheus metrics (names per docs/contracts.md §5), served on :8080/metrics."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from hettrain.api.constants import PHASES

JOBS = Gauge("hettrain_jobs", "HetTrainingJobs by phase", ["phase"])
PLAN_DURATION = Histogram("hettrain_plan_duration_seconds", "Time to compute one plan",
                          buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
REPAIRS = Counter("hettrain_repairs_total", "Repairs after failures",
                  ["namespace", "job", "cause"])
TOKENS = Gauge("hettrain_job_predicted_tokens_per_second", "Predicted tokens/s",
               ["namespace", "job"])
MFU = Gauge("hettrain_job_predicted_mfu", "Predicted MFU", ["namespace", "job"])
WORLD = Gauge("hettrain_job_world_size", "Ranks (GPUs) of the current plan", ["namespace", "job"])
PHASE = Gauge("hettrain_job_phase", "1 for the job's current phase", ["namespace", "job", "phase"])
PLAN_FAILURES = Counter("hettrain_plan_failures_total", "Plans that failed",
                        ["namespace", "job", "reason"])
RECONCILE_ERRORS = Counter("hettrain_reconcile_errors_total", "Errors in handlers", ["handler"])
STAGE_PREDICTED = Gauge("hettrain_job_stage_predicted_seconds",
                        "Predicted forward+backward seconds of one microbatch per stage",
                        ["namespace", "job", "group", "stage", "device"])
STAGE_MEASURED = Gauge("hettrain_job_stage_measured_seconds",
                       "Measured (runtime) forward+backward compute seconds of one microbatch "
                       "per stage", ["namespace", "job", "group", "stage", "device"])
CALIBRATION_REPLANS = Counter("hettrain_calibration_replans_total",
                              "Re-plans after calibration found a faster plan",
                              ["namespace", "job"])
RECONCILE_HANDLERS = ("reconcile", "gang-create")
for _handler in RECONCILE_HANDLERS:  # exported at 0 from the start, so rate() works at once
    RECONCILE_ERRORS.labels(_handler)

_phases: dict[tuple[str, str], str] = {}
_stage_labels: dict[tuple[str, str], set[tuple[str, str, str]]] = {}


def serve(port: int = 8080, addr: str = "0.0.0.0") -> None:
    """Start the /metrics HTTP server (a daemon thread) on ``addr:port``."""
    start_http_server(port, addr=addr)


def set_phase(namespace: str, job: str, phase: str | None) -> None:
    """Record a job's phase (None: the job is gone) and refresh hettrain_jobs{phase}."""
    key = (namespace, job)
    if phase is None:
        _phases.pop(key, None)
        for p in PHASES:
            with contextlib.suppress(KeyError):
                PHASE.remove(namespace, job, p)
        for g in (TOKENS, MFU, WORLD):
            with contextlib.suppress(KeyError):
                g.remove(namespace, job)
        set_calibration(namespace, job, [])
    else:
        _phases[key] = phase
        for p in PHASES:
            PHASE.labels(namespace, job, p).set(1.0 if p == phase else 0.0)
    for p in PHASES:
        JOBS.labels(p).set(sum(1 for v in _phases.values() if v == p))


def set_plan(namespace: str, job: str, world: int, tokens: float, mfu: float,
             seconds: float | None = None) -> None:
    """Record the current plan's predictions (and, if given, its planning time)."""
    WORLD.labels(namespace, job).set(world)
    TOKENS.labels(namespace, job).set(tokens)
    MFU.labels(namespace, job).set(mfu)
    if seconds is not None:
        PLAN_DURATION.observe(seconds)


def set_calibration(namespace: str, job: str, rows: list) -> None:
    """Record predicted vs measured seconds per stage (``planning.calibration.StageComparison``
    rows); an empty list removes the job's series."""
    key = (namespace, job)
    fresh = {(str(r.group or 0), str(r.stage), r.device) for r in rows}
    for group, stage, device in _stage_labels.get(key, set()) - fresh:
        for g in (STAGE_PREDICTED, STAGE_MEASURED):
            with contextlib.suppress(KeyError):
                g.remove(namespace, job, group, stage, device)
    for r in rows:
        lab = (namespace, job, str(r.group or 0), str(r.stage), r.device)
        STAGE_PREDICTED.labels(*lab).set(r.predicted_s)
        STAGE_MEASURED.labels(*lab).set(r.measured_s)
    if fresh:
        _stage_labels[key] = fresh
    else:
        _stage_labels.pop(key, None)
