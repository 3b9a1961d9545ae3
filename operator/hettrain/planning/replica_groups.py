"""An extra replica group on idle nodes (``Plan.groups``), added after the uniform search (pure).

:func:`add_replica_group` takes the plan the existing search chose and the cluster, and looks
at the nodes it leaves idle: for each pool with idle whole nodes, a second replica group of
``R`` pipelines of ``pp`` stages on that pool's device (TP equal to the plan's, which the runtime
requires per layer: ``support.replica_group_errors``), layers split evenly, each stage checked
against the device memory (``cost.stage_memory``, the search's headroom). The step's
microbatches ``N`` are then split between the groups: group ``g``'s pipeline time for ``M``
microbatches per replica is affine in ``M`` (``cost.pipeline_time_s``: ``a_g + b_g·M``), so the
step time ``max(a_0 + b_0·M_0, a_1 + b_1·M_1)`` under ``dp_0·M_0 + R·M_1 = N`` is convex in
``M_1`` and minimal at the two lines' crossing -- shares proportional to the groups' speeds
``R/b`` (microbatches per second), shifted by their bubbles -- so only the feasible integers
next to the crossing are evaluated (:func:`best_split`; tests compare with every split). The
group is added when the modelled step gets faster; the plan's other step-time parts (DP, TP,
pipeline transfers: ``predicted.step_time_s`` minus its modelled pipeline time) are kept as
they are; the cross-group gradient sum is charged only where it crosses a datacenter link
(:func:`cross_dc_sync_s`, not overlapped), inside a datacenter it is taken as covered by the
plan's DP sync -- an approximation.

Group 0 is the plan as searched (its stage ``time_ms`` are the search's); the new group's stage
times come from ``cost.layer_time_s`` / ``cost.head_time_s`` on its device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hettrain.api.spec import JobSpec
from hettrain.planning import cost
from hettrain.planning.arith import shard_bounds
from hettrain.planning.catalog import DeviceSpec
from hettrain.planning.inventory import ClusterInventory, Pool
from hettrain.planning.plan import Plan, RankPlan, ReplicaGroup, StagePlan
from hettrain.planning.support import replica_group_errors
from hettrain.planning.units import filter_pools

# deepest pipeline an extra group is given: each depth costs one memory and time evaluation
# per stage, so the work stays bounded for hostile layer counts (issue #16); real jobs use
# far fewer stages than this
MAX_GROUP_STAGES = 64


@dataclass(frozen=True, slots=True)
class GroupOption:
    """A candidate extra replica group: ``dp`` pipelines of ``len(stage_s)`` stages."""

    pool: Pool
    nodes: tuple[str, ...]
    tps: tuple[int, ...]  # TP degree per stage (the plan's, layer by layer)
    dp: int
    splits: tuple[tuple[int, int], ...]
    stage_s: tuple[float, ...]  # forward+backward seconds of one microbatch per stage
    memory_gib: tuple[float, ...]

    @property
    def pp(self) -> int:
        """Stages per replica."""
        return len(self.splits)


def affine(stage_s: list[float] | tuple[float, ...], schedule: str) -> tuple[float, float]:
    """``(a, b)`` with pipeline time ``a + b·M`` for ``M`` microbatches (cost.pipeline_time_s)."""
    one, _ = cost.pipeline_time_s(list(stage_s), [], 1, schedule)
    two, _ = cost.pipeline_time_s(list(stage_s), [], 2, schedule)
    return one - (two - one), two - one


def split_time(lines: tuple[tuple[float, float], tuple[float, float]], m0: int,
               m1: int) -> float:
    """Pipelined seconds of a step with ``m0`` / ``m1`` microbatches per replica."""
    (a0, b0), (a1, b1) = lines
    return max(a0 + b0 * m0, a1 + b1 * m1)


def feasible_splits(total: int, dp0: int, dp1: int) -> list[tuple[int, int]]:
    """Every ``(M_0, M_1) >= 1`` with ``dp0·M_0 + dp1·M_1 = total`` (enumerated: the
    reference :func:`best_split` is tested against; it never enumerates)."""
    return [((total - dp1 * m1) // dp0, m1) for m1 in range(1, total // dp1 + 1)
            if total - dp1 * m1 >= dp0 and (total - dp1 * m1) % dp0 == 0]


def feasible_progression(total: int, dp0: int, dp1: int) -> tuple[int, int, int] | None:
    """``(first, step, last)``: the feasible ``M_1`` of :func:`feasible_splits` form the
    arithmetic progression ``first, first + step, ..., last`` (None: no feasible split).
    ``dp1·M_1 ≡ total (mod dp0)`` is solvable iff ``g = gcd(dp0, dp1)`` divides ``total``,
    with solutions spaced ``dp0/g``; ``M_0 >= 1`` caps ``M_1`` at ``(total − dp0)/dp1``."""
    g = math.gcd(dp0, dp1)
    if total % g:
        return None
    step = dp0 // g
    first = (total // g) * pow(dp1 // g, -1, step) % step if step > 1 else 0
    if first < 1:
        first += step
    top = (total - dp0) // dp1
    if top < first:
        return None
    return first, step, first + (top - first) // step * step


def best_split(lines: tuple[tuple[float, float], tuple[float, float]], total: int, dp0: int,
               dp1: int) -> tuple[int, int] | None:
    """The fastest feasible split, from the crossing of the two affine lines (module doc):
    the step time is convex in ``M_1``, so the feasible values next to the crossing are the
    only candidates (found by arithmetic: the work does not grow with ``total``)."""
    prog = feasible_progression(total, dp0, dp1)
    if prog is None:
        return None
    first, step, last = prog
    (a0, b0), (a1, b1) = lines
    # a0 + b0·(total − dp1·x)/dp0 = a1 + b1·x
    x = (a0 + b0 * total / dp0 - a1) / (b1 + b0 * dp1 / dp0)
    k = math.floor((x - first) / step) if math.isfinite(x) else 0
    # the progression's points around the crossing (one extra each side absorbs rounding)
    near = {min(last, max(first, first + (k + d) * step)) for d in (-1, 0, 1, 2)}
    splits = [((total - dp1 * m1) // dp0, m1) for m1 in near]
    return min(splits, key=lambda s: (split_time(lines, *s), s[1]))


def _idle_pools(plan: Plan, inv: ClusterInventory) -> list[tuple[Pool, tuple[str, ...]]]:
    used = set(plan.nodes())
    out = []
    for p in inv.pools:
        idle = tuple(n for n in p.nodes if n not in used)
        if idle:
            out.append((p, idle))
    return out


def tp_runs(plan: Plan) -> list[tuple[int, int, int]]:
    """``(tp, layer_start, layer_end)`` of the plan's maximal runs of consecutive stages with
    one TP degree: an extra group's stages stay inside one run each, so every layer (and the
    embedding on the first stage, the head on the last) has the same TP in both groups, as the
    runtime's per-shard gradient sum needs (``support.replica_group_errors``)."""
    runs: list[tuple[int, int, int]] = []
    for st in plan.stages:
        if runs and runs[-1][0] == st.tp:
            runs[-1] = (st.tp, runs[-1][1], st.layer_end)
        else:
            runs.append((st.tp, st.layer_start, st.layer_end))
    return runs


def _run_splits(runs: list[tuple[int, int, int]], per_run: int
                ) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """Each run cut evenly into ``min(per_run, its layers)`` stages: (layer ranges, TPs)."""
    splits: list[tuple[int, int]] = []
    tps: list[int] = []
    for tp, a, b in runs:
        for lo, hi in shard_bounds(b - a, min(per_run, b - a)):
            splits.append((a + lo, a + hi))
            tps.append(tp)
    return tuple(splits), tuple(tps)


def group_options(plan: Plan, inv: ClusterInventory) -> list[GroupOption]:
    """Every extra group that fits memory on one pool's idle nodes (all of them): ``R``
    pipelines whose stages follow the plan's TP runs (:func:`tp_runs`), each run cut into
    1, 2, ... stages, at most :data:`MAX_GROUP_STAGES` stages deep."""
    if plan.groups:
        return []
    runs = tp_runs(plan)
    model, t = plan.model, plan.training
    longest = max(b - a for _, a, b in runs)
    out = []
    for pool, idle in _idle_pools(plan, inv):
        if any(pool.gpus_per_node % tp or tp & (tp - 1) for tp, _, _ in runs):
            continue  # TP blocks of powers of two dividing the node pack without straddling
        gpus = len(idle) * pool.gpus_per_node
        for per_run in range(1, longest + 1):
            splits, tps = _run_splits(runs, per_run)
            pp = len(splits)
            dp = gpus // sum(tps)
            if dp < 1 or pp > MAX_GROUP_STAGES:
                break
            times, mems = group_stage_s(plan, splits, tps, pool.device), []
            for s, ((a, b), tp) in enumerate(zip(splits, tps, strict=True)):
                mem = cost.stage_memory(model, t, tp=tp, dp=dp, micro_batch=plan.micro_batch,
                                        first=s == 0, last=s == pp - 1,
                                        **cost.schedule_memory_args(
                                            s, pp, plan.num_microbatches, plan.schedule))
                mems.append(mem.bytes_for(b - a))
            if max(mems) > pool.device.hbm_bytes * cost.MEMORY_HEADROOM:
                continue
            out.append(GroupOption(pool, idle, tps, dp, splits, tuple(times),
                                   tuple(m / cost.GIB for m in mems)))
    return out


def group_stage_s(plan: Plan, splits: Sequence[tuple[int, int]], tps: Sequence[int],
                  device: DeviceSpec) -> list[float]:
    """Forward+backward seconds of one microbatch on each stage of an extra group on
    ``device``: its layers (``cost.layer_time_s``), the last stage also the LM head, and what
    a device profile measured of the runtime's stage (``cost.stage_overhead_s``)."""
    model, t = plan.model, plan.training
    out = []
    for s, ((a, b), tp) in enumerate(zip(splits, tps, strict=True)):
        sec = (b - a) * cost.layer_time_s(model, t, plan.micro_batch, tp, device)
        sec += cost.stage_overhead_s(model, plan.micro_batch, tp, device, s == 0,
                                     cost.precision_bytes(t))
        if s == len(splits) - 1:
            sec += cost.head_time_s(model, plan.micro_batch, tp, device,
                                    cost.precision_bytes(t))
        out.append(sec)
    return out


def cross_dc_sync_s(plan: Plan, inv: ClusterInventory, option: GroupOption) -> float:
    """Seconds of the gradient sum between the groups over the datacenter link, when the
    new group's pool is in a datacenter the plan does not use: every fp32 gradient byte once
    each way between the two DCs' leaders (runtime/replica_sync.py's hierarchical sum), on the
    slowest link from the plan's datacenters; 0 inside the plan's datacenters (the plan's own
    DP sync time stands for it)."""
    return _sync_to(plan, inv, option.pool.datacenter)


def _sync_to(plan: Plan, inv: ClusterInventory, dc: str) -> float:
    """:func:`cross_dc_sync_s` for an extra group in datacenter ``dc``."""
    if dc in plan.datacenters:
        return 0.0
    link = min((inv.link(d, dc) for d in plan.datacenters), key=lambda k: k.gbytes)
    nbytes = plan.model.parameters() * 4.0
    return cost.ring_all_reduce_s(nbytes, 2, link.gbytes, link.latency_ms / 1000)


def evaluate(plan: Plan, option: GroupOption, inv: ClusterInventory | None = None
             ) -> tuple[float, tuple[int, int]] | None:
    """``(predicted step seconds, (M_0, M_1))`` of ``plan`` plus ``option`` at its best split
    (plus :func:`cross_dc_sync_s` when ``inv`` is given)."""
    lines = (affine([s.time_ms / 1000 for s in plan.stages], plan.schedule),
             affine(option.stage_s, plan.schedule))
    total = plan.dp * plan.num_microbatches
    split = best_split(lines, total, plan.dp, option.dp)
    if split is None:
        return None
    a0, b0 = lines[0]
    rest = plan.predicted.step_time_s - (a0 + b0 * plan.num_microbatches)
    sync = cross_dc_sync_s(plan, inv, option) if inv is not None else 0.0
    return rest + sync + split_time(lines, *split), split


def grouped_step_s(spec: JobSpec, inv: ClusterInventory, plan: Plan) -> float | None:
    """The predicted step time of the grouped ``plan`` (its layouts and batch split unchanged)
    on ``inv``, e.g. with refined device profiles: what :func:`with_group` predicted, every
    stage re-timed. Group 0 is priced as the search priced the plan before the group was
    added (its stages, boundaries and DP sync at ``M = (dp_0·M_0 + dp_1·M_1)/dp_0``
    microbatches: ``planner.split_costs``), group 1 by :func:`group_stage_s`; the step is
    group 0's time outside its pipelined stages, the gradient sum over a datacenter link, and
    the later of the two groups' pipelines. None when group 0's stages no longer fit."""
    from hettrain.planning.planner import split_costs  # the planner imports this module

    g0, g1 = plan.groups
    m_orig, rem = divmod(g0.microbatches + g1.microbatches, g0.dp)
    if rem:
        return None
    base = replace(plan, groups=(), num_microbatches=m_orig,
                   ranks=tuple(r for r in plan.ranks if r.group == 0))
    costs = split_costs(spec, inv, base, [s.layer_end - s.layer_start for s in g0.stages])
    if costs is None:
        return None
    stage_s0, boundaries, dp_s = costs
    pipe, _ = cost.pipeline_time_s(stage_s0, boundaries, m_orig, plan.schedule,
                                   plan.virtual_stages)
    line0 = affine(stage_s0, plan.schedule)
    device = inv.pool(g1.stages[0].pools[0]).device
    line1 = affine(group_stage_s(plan, [(s.layer_start, s.layer_end) for s in g1.stages],
                                 [s.tp for s in g1.stages], device), plan.schedule)
    rest = pipe + dp_s - (line0[0] + line0[1] * m_orig)
    sync = _sync_to(base, inv, g1.stages[0].datacenters[0])
    return rest + sync + split_time((line0, line1), g0.num_microbatches, g1.num_microbatches)


def add_replica_group(plan: Plan, inv: ClusterInventory) -> Plan:
    """``plan`` with the extra replica group that makes the modelled step fastest, or ``plan``
    itself when none makes it faster (or it already has groups)."""
    best = _fastest(plan, inv, group_options(plan, inv))
    return plan if best is None else with_group(plan, inv, best[1], best[2], best[0])


def _fastest(plan: Plan, inv: ClusterInventory, options: list[GroupOption]
             ) -> tuple[float, GroupOption, tuple[int, int]] | None:
    """``(step seconds, option, split)`` of the option that makes the modelled step fastest,
    or None when none makes it faster than ``plan``'s."""
    best: tuple[float, GroupOption, tuple[int, int]] | None = None
    for option in options:
        got = evaluate(plan, option, inv)
        if got is not None and (best is None or got[0] < best[0]):
            best = (got[0], option, got[1])
    if best is None or not best[0] < plan.predicted.step_time_s * (1 - 1e-9):
        return None
    return best


def _place_group(option: GroupOption) -> list[tuple[tuple[int, int, int], str, int]]:
    """``((dp, stage, tp index), node, local GPU)`` of every rank of the group, in (replica,
    stage, TP) order. The stages' TP blocks are packed onto the idle nodes widest first: the
    widths are powers of two dividing the node size, so each block starts at a multiple of
    its width and never straddles a node (a TP group stays on one node's fast links)."""
    blocks = sorted(((tp, d, st) for d in range(option.dp)
                     for st, tp in enumerate(option.tps)), key=lambda b: -b[0])
    gpn = option.pool.gpus_per_node
    where: dict[tuple[int, int, int], tuple[str, int]] = {}
    offset = 0
    for tp, d, st in blocks:
        for t in range(tp):
            where[(d, st, t)] = (option.nodes[(offset + t) // gpn], (offset + t) % gpn)
        offset += tp
    return [(key, *where[key]) for key in sorted(where)]


def with_group(plan: Plan, inv: ClusterInventory, option: GroupOption,
               split: tuple[int, int], step_time_s: float) -> Plan:
    """The grouped plan: group 0 = ``plan`` at ``M_0``, group 1 = ``option`` at ``M_1``."""
    m0, m1 = split
    pool = option.pool
    stages = tuple(StagePlan(
        index=s, device=pool.device.name, vendor=pool.vendor, backend=pool.device.backend,
        pools=(pool.name,), datacenters=(pool.datacenter,), layer_start=a, layer_end=b,
        tp=option.tps[s], memory_gib=option.memory_gib[s],
        capacity_gib=pool.device.hbm_gib, time_ms=option.stage_s[s] * 1000,
        has_embedding=s == 0, has_head=s == option.pp - 1)
        for s, (a, b) in enumerate(option.splits))
    ranks = list(plan.ranks)
    for (d, st, t), node, local in _place_group(option):
        ranks.append(RankPlan(rank=len(ranks), node=node, pool=pool.name,
                              datacenter=pool.datacenter, local_rank=local, stage=st, dp=d,
                              tp=t, group=1))
    used = {r.node for r in ranks[plan.world_size:]}
    groups = (ReplicaGroup(0, plan.dp, plan.pp, m0, plan.stages),
              ReplicaGroup(1, option.dp, option.pp, m1, stages))
    tokens = plan.global_batch * plan.model.seq_len
    note = (f"extra replica group on {len(used)} idle node(s) of pool {pool.name}: "
            f"{option.dp}x pp={option.pp} tp={'/'.join(map(str, option.tps))}, "
            f"microbatches per replica "
            f"{m0} (group 0, {plan.dp} replicas) / {m1} (group 1); predicted step "
            f"{plan.predicted.step_time_s:.3f}s -> {step_time_s:.3f}s")
    eb = cost.precision_bytes(plan.training)
    peak = sum(inv.pool(r.pool).device.peak_matmul_flops(eb) for r in ranks)
    mfu = cost.model_flops_per_step(plan.model, plan.global_batch) / (step_time_s * peak)
    # compute and bubble of the group whose pipeline ends last (the step waits for it)
    timed = [(cost.pipeline_time_s(stage_s, [], m, plan.schedule), m, stage_s)
             for m, stage_s in ((m0, [st.time_ms / 1000 for st in plan.stages]),
                                (m1, list(option.stage_s)))]
    (_, bubble), m, stage_s = max(timed, key=lambda g: g[0][0])
    predicted = replace(plan.predicted, step_time_s=step_time_s,
                        tokens_per_s=tokens / step_time_s, mfu=mfu,
                        compute_s=m * max(stage_s), bubble_s=bubble)
    return replace(plan, num_microbatches=m0, ranks=tuple(ranks), groups=groups,
                   predicted=predicted, notes=(*plan.notes, note))


def plan_with_replica_group(plan: Plan, spec: JobSpec, inventory: ClusterInventory) -> Plan:
    """``spec.parallelism.replicaGroups``: :func:`add_replica_group` on the pools
    ``spec.placement`` allows, kept only when the runtime can run it
    (``support.replica_group_errors``) and it stays within ``maxGPUs``; otherwise ``plan``,
    with a note naming the idle pools and why they stay idle."""
    mode = (plan.cross_dc or {}).get("mode", "sync")
    why = ("the interleaved schedule" if plan.schedule == "interleaved"
           else "context parallelism" if any(s.cp > 1 for s in plan.stages)
           else f"crossDC.mode {mode}" if mode != "sync" else "")
    allowed = replace(inventory, pools=filter_pools(inventory, spec.placement))
    idle = [p.name for p, _ in _idle_pools(plan, allowed)]
    if not idle:
        return plan
    if not why:
        options = group_options(plan, allowed)
        best = _fastest(plan, allowed, options)
        grouped = None if best is None else with_group(plan, allowed, best[1], best[2], best[0])
        cap = spec.placement.max_gpus
        errors = replica_group_errors(grouped) if grouped is not None else []
        if not options:
            tps = "/".join(str(tp) for tp, _, _ in tp_runs(plan))
            why = (f"no pipeline with the plan's TP runs ({tps}) fits their memory and node "
                   "size")
        elif grouped is None:
            why = ("an extra group would not make the modelled step faster (its bubble, or "
                   "the gradient sum over a datacenter link, costs more than it adds)")
        elif cap is not None and grouped.world_size > cap:
            why = f"the faster grouped plan needs {grouped.world_size} GPUs > maxGPUs {cap}"
        elif errors:
            why = f"the runtime cannot run the grouped plan ({errors[0]})"
        else:
            return grouped
    return replace(plan, notes=(*plan.notes, f"replicaGroups: idle nodes of pool(s) "
                                f"{', '.join(idle)} stay idle: {why}"))
