"""Hand-built context-parallel plans: a ``tiny_plan`` whose every rank becomes ``cp`` ranks."""

from __future__ import annotations

from tests.runtime.training.plans import tiny_plan, with_cp

from hettrain.planning.plan import Plan

__all__ = ["cp_plan", "with_cp"]


def cp_plan(splits, dp: int, cp: int, **kw) -> Plan:
    """:func:`tiny_plan` (same arguments) with context parallelism ``cp``."""
    return with_cp(tiny_plan(splits, dp, **kw), cp)
