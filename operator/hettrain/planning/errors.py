"""Planning errors: each names the limiting resource or the input field, and the fix."""

from __future__ import annotations

from hettrain.api.constants import REASON_INVALID_SPEC, REASON_PLAN_FAILED


class PlanningError(Exception):
    """No plan fits. ``reason`` is an ``api.constants.REASON_*`` value for conditions/events."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class PlanningInputError(PlanningError):
    """The cluster description or inventory input is invalid (a field path is named)."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(REASON_INVALID_SPEC, f"{field_path}: {message}")
        self.field = field_path


class NotFaster(PlanningError):
    """``plan_job(..., ceiling_s=...)`` found no layout faster than the ceiling (it may or may
    not fit at all: the search stopped looking)."""


def no_plan(message: str) -> PlanningError:
    """The common case: the job is valid but nothing fits."""
    return PlanningError(REASON_PLAN_FAILED, message)
