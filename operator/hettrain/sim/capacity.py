"""Throughput of the job on a set of surviving nodes, from the real planner, memoised.

A state of the cluster is the number of up nodes per pool; the plan of a state is
``plan_job`` on the inventory without that many nodes of each pool (which nodes does not change
the plan: nodes of a pool are identical). Plans are memoised by that tuple, optionally
quantised (``quantum`` nodes: the down count of a pool is rounded *up* to a multiple, so the
answer is conservative), so a 54-day run at 16k GPUs plans a few dozen times.

Fallback for clusters where planning is too slow (``scale=k``): plan a cluster with every
pool's node count divided by ``k`` and the global batch divided by ``k`` (same pool ratios, same
per-replica work) and multiply tokens/s by ``k`` — linear scaling in data parallelism, which
ignores the slower DP all-reduce of the larger ring (a few per cent optimistic). The output
names the mode used. The wall time actually spent inside ``plan_job`` is measured and reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from hettrain.api.spec import JobSpec
from hettrain.deadline import PlanningTimeout, deadline
from hettrain.planning.errors import PlanningError
from hettrain.planning.inventory import ClusterInventory
from hettrain.planning.planner import plan_job
from hettrain.sim.cluster import Topology
from hettrain.sim.model import SimInputError


@dataclass(frozen=True, slots=True)
class Capacity:
    """What the job achieves on one cluster state."""

    tokens_per_s: float
    world_size: int
    nodes_used: tuple[int, ...]  # per pool
    layout: str  # "DPxPPxTP", and " cp=N" with context parallelism
    step_time_s: float

    def fits(self, up: tuple[int, ...]) -> bool:
        """True when ``up`` nodes per pool still hold every node this plan uses."""
        return all(u >= n for u, n in zip(up, self.nodes_used, strict=True))


def checkpoint_bytes(spec: JobSpec) -> float:
    """Bytes of one checkpoint: weights plus optimizer state (ZeRO §3 bytes per parameter).

    Mixed precision saves bf16/fp16 weights (2 B) + fp32 master, Adam m and v (12 B); fp32
    training saves weights (4 B) + m and v (8 B). Gradients are not saved.
    """
    per_param = 12.0 if spec.training.precision == "fp32" else 14.0
    return spec.model.parameters() * per_param


class CapacityOracle:
    """Memoised ``state → Capacity`` (``None`` when nothing fits) for one job on one cluster."""

    def __init__(self, name: str, spec: JobSpec, topo: Topology, *, quantum: int = 1,
                 scale: int = 1, plan_timeout_s: float = 0.0) -> None:
        if quantum < 1:
            raise SimInputError("--quantum", f"must be an integer >= 1 (got {quantum})")
        if scale < 1:
            raise SimInputError("--throughput", f"scale factor must be >= 1 (got {scale})")
        if scale > 1 and spec.training.global_batch % scale:
            raise SimInputError("--throughput", f"scaled:{scale} needs spec.training.globalBatch "
                                                f"({spec.training.global_batch}) divisible by "
                                                f"{scale}")
        self.name, self.spec, self.topo = name, spec, topo
        self.quantum, self.scale = quantum, scale
        self.plan_timeout_s = plan_timeout_s  # per plan_job call, 0: none (hettrain.deadline)
        self.memo: dict[tuple[int, ...], Capacity | None] = {}
        self.plan_calls = 0
        self.plan_seconds = 0.0
        self._small_spec = spec if scale == 1 else replace(
            spec, training=replace(spec.training, global_batch=spec.training.global_batch // scale))

    @property
    def mode(self) -> str:
        """``planner`` or ``scaled:<k>`` (which throughput model produced the numbers)."""
        return "planner" if self.scale == 1 else f"scaled:{self.scale}"

    def key(self, up: tuple[int, ...]) -> tuple[int, ...]:
        """Plannable nodes (spares held out), then per pool the down count rounded up to a
        multiple of ``quantum``."""
        up = self.topo.plannable(up)
        if self.quantum == 1:
            return up
        out = []
        for n, u in zip(self.topo.plannable(self.topo.pool_nodes), up, strict=True):
            down = -(-(n - u) // self.quantum) * self.quantum
            out.append(max(0, n - down))
        return tuple(out)

    def _inventory(self, up: tuple[int, ...]) -> ClusterInventory:
        pools = []
        for pool, u in zip(self.topo.inventory.pools, up, strict=True):
            keep = u // self.scale
            if keep > 0:
                pools.append(replace(pool, nodes=pool.nodes[:keep]))
        return replace(self.topo.inventory, pools=tuple(pools))

    def capacity(self, up: tuple[int, ...]) -> Capacity | None:
        """The job's capacity when ``up[p]`` nodes of pool ``p`` are up."""
        k = self.key(up)
        if k in self.memo:
            return self.memo[k]
        inv = self._inventory(k)
        result: Capacity | None = None
        if inv.pools:
            t0 = time.perf_counter()
            try:
                with deadline(self.plan_timeout_s):
                    plan = plan_job(self.name, self._small_spec, inv)
            except PlanningError:
                plan = None
            except PlanningTimeout:
                raise SimInputError(
                    "--timeout-s", f"planning the job on {inv.gpus} GPUs took longer than "
                    f"{self.plan_timeout_s:g}s and was stopped; make the job smaller, pin "
                    "spec.parallelism, or raise --timeout-s (0: no limit)") from None
            finally:
                self.plan_seconds += time.perf_counter() - t0
                self.plan_calls += 1
            if plan is not None:
                per_pool: dict[str, set[str]] = {}
                for r in plan.ranks:
                    per_pool.setdefault(r.pool, set()).add(r.node)
                used = tuple(len(per_pool.get(p.name, ())) * self.scale
                             for p in self.topo.inventory.pools)
                tps = {s.tp for s in plan.stages}
                cp = plan.stages[0].cp
                result = Capacity(
                    tokens_per_s=plan.predicted.tokens_per_s * self.scale,
                    world_size=plan.world_size * self.scale,
                    nodes_used=used,
                    layout=f"{plan.dp * self.scale}x{plan.pp}x{'/'.join(map(str, sorted(tps)))}"
                    + (f" cp={cp}" if cp > 1 else ""),
                    step_time_s=plan.predicted.step_time_s,
                )
        self.memo[k] = result
        return result
