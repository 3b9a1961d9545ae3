"""Hand-built context-parallel plans: a ``tiny_plan`` whose every rank becomes ``cp`` ranks."""

from __future__ import annotations

import dataclasses

from tests.runtime.training.plans import tiny_plan

from hettrain.planning.plan import Plan


def with_cp(plan: Plan, cp: int) -> Plan:
    """``plan`` with context parallelism ``cp`` on every stage: each rank of the plan is
    replaced by ``cp`` consecutive ranks (CP index 0..cp-1) on the same node."""
    ranks = []
    for r in plan.ranks:
        for c in range(cp):
            ranks.append(dataclasses.replace(r, rank=len(ranks), cp=c,
                                             local_rank=r.local_rank * cp + c))
    stages = tuple(dataclasses.replace(s, cp=cp) for s in plan.stages)
    return dataclasses.replace(plan, ranks=tuple(ranks), stages=stages)


def cp_plan(splits, dp: int, cp: int, **kw) -> Plan:
    """:func:`tiny_plan` (same arguments) with context parallelism ``cp``."""
    return with_cp(tiny_plan(splits, dp, **kw), cp)
