"""Planning a job twice on single-pool clusters, side by side: with one of the planner's
variant choices held as given (the planner before that variant) and as ``plan_job`` plans it.
Shared by ``bench/chunked_loss.py --plans`` and ``bench/chunked_mlp.py --plans``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any


def single_pool(device: str, nodes: int) -> Any:
    """A cluster of one pool of ``nodes`` nodes with 8 ``device`` GPUs each, in one
    datacenter."""
    from hettrain.planning.inventory import load_cluster

    return load_cluster({"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
                         "metadata": {"name": "x"}, "datacenters": [{"name": "a"}],
                         "pools": [{"name": "p", "datacenter": "a", "device": device,
                                    "nodes": nodes, "gpusPerNode": 8}]})


def plan_both(spec: Any, inventory: Any, as_given: Callable[[], AbstractContextManager[None]]
              ) -> tuple[Any, Any]:
    """``(before, after)``: the plan inside ``as_given()`` and as ``plan_job`` plans it, each
    None where no layout fits."""
    from hettrain.planning import planner
    from hettrain.planning.errors import PlanningError

    out = []
    for given in (True, False):
        try:
            with as_given() if given else contextlib.nullcontext():
                out.append(planner.plan_job("x", spec, inventory))
        except PlanningError:
            out.append(None)
    return out[0], out[1]


def layout(plan: Any, *extra: str) -> str:
    """A plan's layout in one line: pipeline depth, TP degrees, CP, DP and ``extra``."""
    st = plan.stages
    return " ".join([f"pp={plan.pp} tp={'/'.join(str(s.tp) for s in st)} cp={st[0].cp} "
                     f"dp={plan.dp}", *extra])


def row(head: str, before: Any, after: Any, detail: Callable[[Any], str],
        show: Callable[[Any], str]) -> str:
    """One table row: tokens/s before -> after with the gain, ``detail(after)`` and the
    layout ``show(after)`` (with the one before where it differs)."""
    if before is None and after is None:
        return f"{head} no layout fits either way"
    if after is None:
        return f"{head} {before.predicted.tokens_per_s:9.0f} -> none"
    tps = after.predicted.tokens_per_s
    b = f"{before.predicted.tokens_per_s:9.0f}" if before else f"{'-':>9}"
    gain = f"{tps / before.predicted.tokens_per_s - 1:+6.1%}" if before else "   new"
    was = (f"  (was {show(before)})" if before is not None and show(before) != show(after)
           else "")
    return f"{head} {b} -> {tps:9.0f} {gain}  {detail(after)}  {show(after)}{was}"
