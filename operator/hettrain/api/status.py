"""HetTrainingJob status helpers: conditions, plan summary, repair history (pure, no I/O)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from hettrain.api.constants import CONDITION_TYPES

MAX_REPAIR_HISTORY = 20


def now_iso() -> str:
    """Current UTC time in RFC 3339 (seconds), as Kubernetes writes timestamps."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(conditions: Sequence[Mapping[str, Any]] | None, ctype: str, status: bool,
                  reason: str, message: str = "", generation: int | None = None,
                  now: str | None = None) -> list[dict[str, Any]]:
    """Return a new condition list with ``ctype`` set; lastTransitionTime moves only on change."""
    if ctype not in CONDITION_TYPES:
        raise ValueError(f"condition type {ctype!r} unknown; use one of {CONDITION_TYPES}")
    value = "True" if status else "False"
    out: list[dict[str, Any]] = []
    found = False
    for cond in conditions or ():
        c = dict(cond)
        if c.get("type") == ctype:
            found = True
            if c.get("status") != value:
                c["lastTransitionTime"] = now or now_iso()
            c.update(status=value, reason=reason, message=message)
            if generation is not None:
                c["observedGeneration"] = generation
        out.append(c)
    if not found:
        c = dict(type=ctype, status=value, reason=reason, message=message,
                 lastTransitionTime=now or now_iso())
        if generation is not None:
            c["observedGeneration"] = generation
        out.append(c)
    return out


def get_condition(status: Mapping[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    """The condition of that type in a status dict, or None."""
    for cond in (status or {}).get("conditions") or ():
        if cond.get("type") == ctype:
            return dict(cond)
    return None


def is_true(status: Mapping[str, Any] | None, ctype: str) -> bool:
    """Whether the condition ``ctype`` is present and True."""
    cond = get_condition(status, ctype)
    return bool(cond and cond.get("status") == "True")


def plan_summary(plan: Any, configmap: str, fingerprint: str | None = None) -> dict[str, Any]:
    """status.plan for a :class:`hettrain.planning.plan.Plan` (duck-typed to stay pure);
    ``fingerprint`` saves recomputing ``plan.fingerprint()`` when the caller has it.

    With replica groups (``plan.groups``) ``dp``/``pp``/``tpByStage``/``cp`` are group 0's
    (as in the plan JSON) and ``replicaGroups`` lists every group's."""
    out = {
        "hash": fingerprint or plan.fingerprint(),
        "worldSize": plan.world_size,
        "dp": plan.dp,
        "pp": plan.pp,
        "tpByStage": [s.tp for s in plan.stages],
        "cp": _cp_of(plan.stages),
        "pools": list(plan.pools),
        "poolsText": ",".join(plan.pools),
        "datacenters": list(plan.datacenters),
        "datacentersText": ",".join(plan.datacenters),
        "predictedTokensPerSecond": round(float(plan.predicted.tokens_per_s), 3),
        "predictedMFU": round(float(plan.predicted.mfu), 6),
        "stepTimeSeconds": round(float(plan.predicted.step_time_s), 6),
        "configMap": configmap,
        "nodes": list(plan.nodes()),
    }
    if getattr(plan, "groups", ()):
        out["replicaGroups"] = [
            {"group": g.index, "dp": g.dp, "pp": g.pp,
             "microbatchesPerReplica": g.num_microbatches, "tpByStage": [s.tp for s in g.stages],
             "cp": _cp_of(g.stages),
             "pools": list(dict.fromkeys(p for s in g.stages for p in s.pools))}
            for g in plan.groups]
    return out


def _cp_of(stages: Sequence[Any]) -> int:
    """The context-parallel degree of a pipeline's stages (1: none)."""
    return max((int(getattr(s, "cp", 1)) for s in stages), default=1)


def add_repair(repairs: Mapping[str, Any] | None, cause: str, nodes: Sequence[str],
               from_world: int, to_world: int, now: str | None = None) -> dict[str, Any]:
    """status.repairs with one more repair recorded; history keeps the last MAX_REPAIR_HISTORY."""
    t = now or now_iso()
    old = dict(repairs or {})
    history = list(old.get("history") or [])
    history.append(dict(time=t, cause=cause, nodes=sorted(nodes), fromWorldSize=from_world,
                        toWorldSize=to_world))
    return {
        "count": int(old.get("count") or 0) + 1,
        "lastCause": cause,
        "lastTime": t,
        "history": history[-MAX_REPAIR_HISTORY:],
    }
