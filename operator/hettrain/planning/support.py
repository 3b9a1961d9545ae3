"""What the runtime can honour: plan options it refuses, checked on both sides (pure).

The runtime calls :func:`unsupported` at start-up (``runtime.trainer.Trainer``) and exits with
the first error; ``hettrain plan`` / ``hettrain validate --cluster`` refuse the same plans, so
a plan the runtime would reject never reaches a cluster. Each error names the plan field and the
spec field that sets it.
"""

from __future__ import annotations

from hettrain.api.spec import LR_SCHEDULES, PRECISIONS
from hettrain.planning.plan import Plan


def unsupported(plan: Plan) -> list[str]:
    """One-line errors for every option of ``plan`` the runtime cannot honour (empty: none)."""
    t = plan.training
    out = []
    if t.precision not in PRECISIONS:
        out.append(f"plan.training.precision={t.precision!r}: the runtime trains "
                   f"{', '.join(PRECISIONS)}; set spec.training.precision to one of them")
    if t.lr_schedule not in LR_SCHEDULES:
        out.append(f"plan.training.lr_schedule={t.lr_schedule!r}: must be one of "
                   f"{', '.join(LR_SCHEDULES)} (spec.training.lrSchedule)")
    mode = (plan.cross_dc or {}).get("mode", "sync")
    if t.optimizer_sharding and mode == "diloco" and plan.dp > 1:
        out.append("plan.training.optimizer_sharding=true with plan.cross_dc.mode=diloco: "
                   "ZeRO-1 cannot combine with DiLoCo (each datacenter's replicas drift apart "
                   "between outer steps); set spec.training.optimizerSharding: false")
    return out
