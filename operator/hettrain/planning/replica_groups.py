"""Extra replica groups on idle nodes (``Plan.groups``), added after the uniform search (pure).

:func:`add_replica_groups` takes the plan the existing search chose (group 0) and the cluster,
and looks at the whole nodes it leaves idle: for each pool with idle whole nodes, a candidate
replica group of ``R`` pipelines of ``pp`` stages on all of that pool's idle nodes and device,
either following the plan's TP runs (layers split evenly inside each run, every layer at its
group-0 TP) or at one TP degree throughout (the runtime sums each piece of a shard between
the ranks that hold it, whatever their TP: ``runtime/replica_sync.py``), each stage
checked against the device memory (``cost.stage_memory``, the search's headroom) at every
microbatch count the group may be given (:func:`max_microbatches`). Groups are added greedily:
each round adds the candidate that makes the modelled step fastest, on a pool no group uses
yet, and the rounds stop when no candidate makes the step faster (so at most one extra group
per pool; a 3-pool cluster whose search used one pool can get 3 groups).

Context parallelism: when group 0 has ``cp > 1`` (long sequences), an extra group may use
any power-of-two degree up to it, 1 included (:func:`group_cps`; each group runs its own
world, and ``runtime/replica_sync.py`` weights a CP rank's gradient by ``1/cp`` of its
group's share): its replicas take ``cp·tp`` GPUs per stage, the ``cp`` TP groups of a
``(dp, stage)`` side by side (:func:`_place_group`), its memory is ``cost.stage_memory(cp=)``
and its stage times the search's CP pricing (:func:`group_stage_s`: ``context.cp_layer_time_s``
over ``context.cp_link``, ``context.cp_head_time_s``).

The step's microbatches ``N`` are split between the groups: group ``g``'s pipeline time for
``M`` microbatches per replica is affine in ``M`` (``cost.pipeline_time_s``: ``a_g + b_g·M``),
so the step time ``max_g(a_g + b_g·M_g)`` under ``Σ dp_g·M_g = N``, ``1 <= M_g <= cap_g`` is
minimised by :func:`best_split_n`: from a lower bound on the step time ``T`` (the continuous
relaxation: shares proportional to the groups' speeds ``dp/b``, shifted by their bubbles), it
walks up the groups' breakpoints ``a_g + b_g·m`` in order; at each ``T`` every group may take
up to ``U_g = floor((T − a_g)/b_g)`` microbatches per replica, and ``T`` is feasible iff the
excess ``Σ dp_g·U_g − N`` is a sum of ``dp_g·r_g`` with ``0 <= r_g <= U_g − 1`` (an exact
bounded coin check on a bitset, :func:`_take_back`); the first feasible breakpoint is the
optimum (tests compare with every split). Two groups keep their arithmetic form
(:func:`best_split`, :func:`feasible_progression`).

The plan's other step-time parts (DP, TP, pipeline transfers: ``predicted.step_time_s``
minus its modelled pipeline time) are kept as they are. The gradient sum between the groups
is added as the runtime runs it (``runtime/replica_sync.py``), after the backward: in two
levels (a reduce-scatter in each group's own DP×CP group, each rank's slice between the
groups in gloo, an all-gather; :func:`groups_grad_sum_s`, the slowest rank's), and where the
rings cross a datacenter link, its latency on every ring step and its bandwidth for every gradient
byte (:func:`groups_link_s`). Group 0's own DP sync stays charged although the runtime
replaces its all-reduce with the sum (conservative: the all-reduce is mostly overlapped with the
backward); the extra groups' own parameter all-gather and optimizer step are not charged (an
approximation: group 0's stand in). The sum is not overlapped with the backward: most extra
groups do not pay for it (``docs/planning.md``).

Group 0 is the plan as searched (its stage ``time_ms`` are the search's); the extra groups'
stage times come from ``cost.layer_time_s`` / ``cost.head_time_s`` on their device. The
grouped plan's predicted step is :func:`grouped_step_s`'s (the search's unrounded stage times),
the value calibration re-prices.

``plan_job`` calls :func:`plan_with_replica_group` (``spec.parallelism.replicaGroups``): the
groups on the searched plan's idle nodes and, for a first plan, the per-pool layouts
(:func:`per_pool_plans`: the search on one pool alone as group 0, every other pool's nodes as
extra groups -- pools side by side instead of as stages of one pipeline); the fastest wins.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from hettrain.api.spec import JobSpec, ModelSpec, chunked_schedule, splits_backward
from hettrain.planning import context, cost
from hettrain.planning.arith import shard_bounds
from hettrain.planning.catalog import DeviceSpec
from hettrain.planning.inventory import ClusterInventory, Link, Pool
from hettrain.planning.placement import moved_ranks
from hettrain.planning.plan import Plan, RankPlan, ReplicaGroup, StagePlan
from hettrain.planning.support import (
    context_parallel_degree,
    group_cp,
    replica_group_errors,
    uneven_dp_limits,
)
from hettrain.planning.units import filter_pools

# deepest pipeline an extra group is given: each depth costs one memory and time evaluation
# per stage, so the work stays bounded for hostile layer counts (issue #16); real jobs use
# far fewer stages than this
MAX_GROUP_STAGES = 64
# pipeline depths tried per pool once one fits memory: deeper ones add bubble for the same GPUs,
# and each costs a memory check per stage (the per-pool layouts try many pools' options)
MAX_FITTING_DEPTHS = 4
# best_split_n's bounds for hostile inputs: breakpoints walked, and the excess microbatches
# the exact check handles (bits of its bitset); past either it reports no split (never on
# the planner's cases: the walk starts at most about one breakpoint per group below the
# optimum and any group with dp 1 absorbs every excess)
MAX_WALK = 4096
MAX_EXCESS = 1 << 20
# GB/s one rank's gloo ring moves at most (TCP, the reduction on the CPU): the runtime's own
# link model for gloo inside a datacenter (runtime/collectives/choice.py LinkModel.intra_gbps,
# 100 Gbit/s); NIC shares above it do not speed the sum between replica groups up
GLOO_RING_GBYTES = 12.5
# at most this many passes of swap_groups over the chosen groups (each pass tries every
# chosen group against every option; most plans stop after one without a swap)
SWAP_PASSES = 3
# per_pool_plans searches every CP degree on each pool from this many tokens; below, the
# degree of the plan over every pool (each degree is one more search per pool; at 8k the
# solo layouts gained nothing from the others on bench/plan_quality.py while llama-70b's
# grouped plan on bench/plan_scale.py's 1,024 GPUs took 1.0 s; at 128k three plans lost up
# to 11% at the one degree)
SOLO_CP_SEARCH_MIN_SEQ = 16384
# relative slack of evaluate_groups' relaxed lower bound (its float rounding)
BOUND_MARGIN = 1e-9

Line = tuple[float, float]


@dataclass(frozen=True, slots=True)
class GroupOption:
    """A candidate extra replica group: ``dp`` pipelines of ``len(stage_s)`` stages."""

    pool: Pool
    nodes: tuple[str, ...]
    tps: tuple[int, ...]  # TP degree per stage (the plan's, layer by layer)
    dp: int
    splits: tuple[tuple[int, int], ...]
    stage_s: tuple[float, ...]  # forward+backward seconds of one microbatch per stage
    max_m: int  # most microbatches per replica whose activations fit (max_microbatches)
    line: Line = (0.0, 0.0)  # affine(stage_s, the plan's schedule)
    cp: int = 1  # context-parallel degree: each replica is dp·cp·tp GPUs per stage

    @property
    def pp(self) -> int:
        """Stages per replica."""
        return len(self.splits)


def affine(stage_s: list[float] | tuple[float, ...], schedule: str,
           zb_div: float = cost.ZB_CATALOG_DIVISOR) -> Line:
    """``(a, b)`` with pipeline time ``a + b·M`` for ``M`` microbatches (cost.pipeline_time_s;
    ``zb_div``: ZB-H1's bubble divisor, :func:`plan_zb_div`)."""
    one, _ = cost.pipeline_time_s(list(stage_s), [], 1, schedule, zb_div=zb_div)
    two, _ = cost.pipeline_time_s(list(stage_s), [], 2, schedule, zb_div=zb_div)
    return one - (two - one), two - one


def plan_zb_div(plan: Plan, devices: Sequence[DeviceSpec], cp: int | None = None) -> float:
    """ZB-H1's bubble divisor of a pipeline of ``plan``'s model, training and microbatch on
    ``devices`` at context parallelism ``cp`` (None: the plan's) (:func:`cost.zb_bubble_divisor`:
    measured B/W splits, else the catalog's 3; a CP rank's shorter sequence matches no
    profile); the catalog's for other schedules."""
    cp = context_parallel_degree(plan) if cp is None else cp
    if not splits_backward(plan.schedule) or cp > 1:
        return cost.ZB_CATALOG_DIVISOR
    return cost.zb_bubble_divisor(devices, plan.model, plan.training, plan.micro_batch)


def plan_devices(plan: Plan, inv: ClusterInventory,
                 stages: Sequence[StagePlan] | None = None) -> list[DeviceSpec]:
    """The device of each of ``stages`` (default ``plan.stages``)."""
    return [inv.pool(s.pools[0]).device for s in (plan.stages if stages is None else stages)]


def split_time(lines: Sequence[Line], *ms: int) -> float:
    """Pipelined seconds of a step with ``ms[g]`` microbatches per replica of group ``g``."""
    return max(a + b * m for (a, b), m in zip(lines, ms, strict=True))


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


def best_split(lines: tuple[Line, Line], total: int, dp0: int,
               dp1: int) -> tuple[int, int] | None:
    """The fastest feasible split between two groups, from the crossing of their affine
    lines: the step time is convex in ``M_1``, so the feasible values next to the crossing
    are the only candidates (found by arithmetic: the work does not grow with ``total``)."""
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


def most_within(line: Line, t: float, cap: int) -> int:
    """The most microbatches ``m <= cap`` with ``a + b·m <= t`` (``floor((t − a)/b)``, made
    consistent with that float expression; 0 when not even one fits)."""
    a, b = line
    m = min(cap, max(0, math.floor((t - a) / b)))
    while m < cap and a + b * (m + 1) <= t:
        m += 1
    while m > 0 and a + b * m > t:
        m -= 1
    return m


def relaxed_time(lines: Sequence[Line], dps: Sequence[int], total: int,
                 caps: Sequence[int]) -> float:
    """A lower bound on the best step time: the continuous relaxation (real ``M_g >= 0``,
    ``Σ dp_g·M_g = total``, ``M_g <= cap_g``), where every uncapped group ends at the same
    ``T`` (water-filling: a group whose cap binds takes its cap, the rest share the remainder
    in proportion to their speeds ``dp/b``), and at least every group's one-microbatch time."""
    capped: set[int] = set()
    t = 0.0
    while True:
        free = [g for g in range(len(lines)) if g not in capped]
        left = total - sum(dps[g] * caps[g] for g in capped)
        if not free:
            t = max(lines[g][0] + lines[g][1] * caps[g] for g in capped)
            break
        speed = sum(dps[g] / lines[g][1] for g in free)
        t = (left + sum(dps[g] * lines[g][0] / lines[g][1] for g in free)) / speed
        over = [g for g in free if (t - lines[g][0]) / lines[g][1] > caps[g]]
        if not over:
            break
        capped.update(over)
    return max(t, *(a + b for a, b in lines))


def _take_back(excess: int, dps: Sequence[int], room: Sequence[int]) -> list[int] | None:
    """``r`` with ``Σ dps[g]·r[g] = excess`` and ``0 <= r[g] <= room[g]``, or None when there
    is none: an exact bounded coin check on a bitset (bit ``e`` set: ``e`` is reachable), each
    group's count split into powers of two (0/1 items), then walked back for the counts."""
    for g, (dp, top) in enumerate(zip(dps, room, strict=True)):  # one group absorbs it all
        if excess % dp == 0 and excess // dp <= top:
            return [excess // dp if h == g else 0 for h in range(len(dps))]
    mask = (1 << (excess + 1)) - 1
    reach = 1
    items: list[tuple[int, int, int]] = []  # (group, count, reach before the item)
    for g, (dp, top) in enumerate(zip(dps, room, strict=True)):
        left, chunk = min(top, excess // dp), 1
        while left > 0:
            take = min(chunk, left)
            items.append((g, take, reach))
            reach |= (reach << (take * dp)) & mask
            left, chunk = left - take, chunk * 2
    if not reach >> excess & 1:
        return None
    r, e = [0] * len(dps), excess
    for g, take, before in reversed(items):
        if not before >> e & 1:
            e -= take * dps[g]
            r[g] += take
    return r


def _split_at(dps: Sequence[int], total: int, us: Sequence[int]) -> tuple[int, ...] | None:
    """A split with ``1 <= M_g <= us[g]`` summing to ``total`` (``us``: the most each group
    takes at some step time), or None."""
    excess = sum(dp * u for dp, u in zip(dps, us, strict=True)) - total
    if min(us) < 1 or excess < 0:
        return None
    r = _take_back(excess, dps, [u - 1 for u in us])
    return None if r is None else tuple(u - k for u, k in zip(us, r, strict=True))


def _breakpoint_walk(lines: Sequence[Line], dps: Sequence[int], total: int,
                     caps: Sequence[int]) -> Iterator[list[int]]:
    """Per group, the most microbatches per replica (at most ``caps[g]``) within a step time
    ``T``, for ``T`` from the continuous bound (:func:`relaxed_time`) up the groups'
    breakpoints ``a_g + b_g·m`` in order (every group with a breakpoint at ``T`` moves up);
    ends when every group is at its cap. The yielded list is updated in place."""
    k = len(lines)
    t = relaxed_time(lines, dps, total, caps) * (1 - 1e-12)
    us = [most_within(line, t, c) for line, c in zip(lines, caps, strict=True)]
    ahead = [(lines[g][0] + lines[g][1] * (us[g] + 1), g) for g in range(k) if us[g] < caps[g]]
    heapq.heapify(ahead)
    while True:
        yield us
        if not ahead:
            return
        t = ahead[0][0]
        while ahead and ahead[0][0] <= t:
            _, g = heapq.heappop(ahead)
            us[g] = most_within(lines[g], t, caps[g])
            if us[g] < caps[g]:
                heapq.heappush(ahead, (lines[g][0] + lines[g][1] * (us[g] + 1), g))


def best_split_n(lines: Sequence[Line], dps: Sequence[int], total: int,
                 caps: Sequence[int] | None = None) -> tuple[int, ...] | None:
    """The fastest split ``M`` (microbatches per replica of each group, ``1 <= M_g <=
    caps[g]``, ``Σ dps[g]·M_g = total``), or None when there is none (module docstring):
    the breakpoints ``a_g + b_g·m`` from :func:`relaxed_time` up, in order
    (:func:`_breakpoint_walk`), the first whose per-group maxima admit an exact split
    (:func:`_split_at`)."""
    k = len(lines)
    caps = [min(c, max(1, (total - sum(dps) + dp) // dp))
            for c, dp in zip(caps or [total] * k, dps, strict=True)]
    if total < sum(dps) or total % math.gcd(*dps) or min(caps) < 1:
        return None
    for us in itertools.islice(_breakpoint_walk(lines, dps, total, caps), MAX_WALK):
        if sum(dp * u for dp, u in zip(dps, us, strict=True)) - total > MAX_EXCESS:
            return None
        got = _split_at(dps, total, us)
        if got is not None:
            return got
    return None


def best_uneven_split(lines: Sequence[Line], dps: Sequence[int], total: int,
                      caps: Sequence[int] | None = None) -> tuple[int, ...] | None:
    """The fastest split of ``total`` microbatches when a group's replicas may be uneven:
    group ``g`` runs ``N_g`` microbatches, ``dps[g] <= N_g``, its fullest replica
    ``M_g = ceil(N_g / dps[g]) <= caps[g]`` and its last ``dps[g]·M_g − N_g`` replicas one
    fewer (``ReplicaGroup.short_replicas``), so its pipeline takes ``a_g + b_g·M_g``.
    Returns the ``N_g`` (None: ``total`` is below ``Σ dps``, or above every cap).

    A step time ``T`` is feasible iff every ``U_g(T) >= 1`` and ``Σ dps[g]·U_g(T) >= total``
    (``U_g``: the most microbatches per replica group ``g`` runs within ``T``), so the
    optimum is the first breakpoint of :func:`_breakpoint_walk` where it holds; the
    excess is then taken back from the groups in order of their time, latest first, each
    keeping a microbatch per replica (tests compare with every split)."""
    k = len(lines)
    caps = list(caps or [total] * k)
    if total < sum(dps) or total > sum(dp * c for dp, c in zip(dps, caps, strict=True)):
        return None
    for us in _breakpoint_walk(lines, dps, total, caps):
        if min(us) >= 1 and sum(dp * u for dp, u in zip(dps, us, strict=True)) >= total:
            break
    else:  # (a cap below one microbatch: no group may be left without)
        return None
    taken = [dp * u for dp, u in zip(dps, us, strict=True)]
    excess = sum(taken) - total
    for g in sorted(range(k), key=lambda g: (-(lines[g][0] + lines[g][1] * us[g]), g)):
        back = min(excess, taken[g] - dps[g])
        taken[g] -= back
        excess -= back
    return tuple(taken)


def uneven_groups_ok(plan: Plan) -> bool:
    """Whether the runtime runs short replicas in ``plan``'s groups: the schedule, sharding
    and cross-DC mode allow uneven data parallelism (``support.uneven_dp_limits``)."""
    return not uneven_dp_limits(1, plan.schedule, plan.training,
                                (plan.cross_dc or {}).get("mode", "sync"))


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
    one TP degree: an extra group whose stages stay inside one run each gives every layer (and
    the embedding on the first stage, the head on the last) the TP it has in group 0, so the
    runtime sums whole shards between the groups."""
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


def stage_memory_bytes(plan: Plan, splits: Sequence[tuple[int, int]], tps: Sequence[int],
                       dp: int, m: int, cp: int = 1, cp_masks: bool = True) -> list[float]:
    """Peak bytes per device of each stage of an extra group of ``dp`` replicas at context
    parallelism ``cp`` running ``m`` microbatches per replica (``cost.stage_memory`` with the
    plan's schedule; ``cp_masks``: the device materialises CP's causal masks,
    ``not cost.skips_masked_tiles(device)``)."""
    pp = len(splits)
    return [cost.stage_memory(plan.model, plan.training, tp=tp, dp=dp, cp=cp,
                              micro_batch=plan.micro_batch, first=s == 0, last=s == pp - 1,
                              cp_masks=cp_masks,
                              **cost.schedule_memory_args(s, pp, m, plan.schedule)
                              ).bytes_for(b - a)
            for s, ((a, b), tp) in enumerate(zip(splits, tps, strict=True))]


def max_microbatches(plan: Plan, splits: Sequence[tuple[int, int]], tps: Sequence[int],
                     dp: int, device: DeviceSpec, top: int,
                     memo: dict[tuple, cost.StageMemory] | None = None, cp: int = 1) -> int:
    """The most microbatches per replica ``<= top`` with which every stage (at context
    parallelism ``cp``) fits ``device``'s memory (with the search's headroom); 0 when not even
    one does. A stage's memory does not
    decrease with ``m`` and stops growing at ``m = pp`` except under GPipe (every microbatch
    in flight), so checks at 1 and at ``pp`` (GPipe: ``top``) usually settle it; else
    bisection. ``memo``: stage memory models by their arguments, shared between calls (they
    depend on the plan's model and training only otherwise)."""
    limit = device.hbm_bytes * cost.MEMORY_HEADROOM
    pp = len(splits)
    memo = {} if memo is None else memo
    masks = not cost.skips_masked_tiles(device)

    def stage(s: int, tp: int, m: int) -> cost.StageMemory:
        args = cost.schedule_memory_args(s, pp, m, plan.schedule)
        key = (tp, dp, cp, masks, s == 0, s == pp - 1, *args.values())
        if key not in memo:
            memo[key] = cost.stage_memory(plan.model, plan.training, tp=tp, dp=dp, cp=cp,
                                          micro_batch=plan.micro_batch, first=s == 0,
                                          last=s == pp - 1, cp_masks=masks, **args)
        return memo[key]

    def fits(m: int) -> bool:  # every stage, the first that does not fit ends the check
        return all(stage(s, tp, m).bytes_for(b - a) <= limit
                   for s, ((a, b), tp) in enumerate(zip(splits, tps, strict=True)))

    if not fits(1):  # most shallow pipelines of a large model: one check
        return 0
    hi = top if plan.schedule == "gpipe" else min(top, pp)
    if fits(hi):
        return top
    lo = 1  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def group_options(plan: Plan, inv: ClusterInventory) -> list[GroupOption]:
    """Every extra group that fits memory on one pool's idle nodes (all of them): ``R``
    pipelines whose stages follow the plan's TP runs (:func:`tp_runs`, each run cut into 1, 2,
    ... stages) or have one TP degree throughout (:func:`pool_tps`; the runtime sums each piece
    of a parameter between the ranks holding it, whatever their TP), at each context-parallel
    degree of :func:`group_cps`, at most :data:`MAX_GROUP_STAGES` stages deep, per layout and
    degree the :data:`MAX_FITTING_DEPTHS` shallowest that fit."""
    if plan.groups:
        return []
    layouts = [tp_runs(plan)]
    layouts += [[(tp, 0, plan.model.layers)] for tp in pool_tps(plan, None)
                if layouts[0] != [(tp, 0, plan.model.layers)]]
    out = []
    memo: dict[tuple, cost.StageMemory] = {}
    for pool, idle in _idle_pools(plan, inv):
        for runs in layouts:
            if not all(tp in pool_tps(plan, pool) for tp, _, _ in runs):
                continue
            for cp in group_cps(plan):
                out += _layout_options(plan, pool, idle, runs, memo, cp)
    return out


def group_cps(plan: Plan) -> list[int]:
    """Context-parallel degrees an extra group may use: the powers of two up to group 0's
    (1 alone without CP), each group its own (the runtime weights a CP rank by ``1/cp`` of its
    group's share: ``runtime/replica_sync.py``); a smaller degree needs fewer GPUs per replica
    (more replicas on a small pool) where its longer sequence share still fits memory."""
    top = context_parallel_degree(plan)
    out, cp = [1], 2
    while cp <= top:
        if plan.model.seq_len % (2 * cp) == 0:  # two load-balanced chunks per CP rank
            out.append(cp)
        cp *= 2
    return out


def pool_tps(plan: Plan, pool: Pool | None) -> list[int]:
    """TP degrees an extra group may use (on ``pool``; None: any 8-GPU node): powers of two
    dividing the node size, so TP blocks pack without straddling a node, and dividing the
    attention heads (the KV heads divide them or them it), as the search's ``_tp_options``."""
    gpn = pool.gpus_per_node if pool is not None else 8
    m = plan.model
    return [tp for tp in (1, 2, 4, 8, 16, 32, 64) if tp <= gpn and gpn % tp == 0
            and m.heads % tp == 0 and (m.kv_heads % tp == 0 or tp % m.kv_heads == 0)]


def _layout_options(plan: Plan, pool: Pool, idle: tuple[str, ...],
                    runs: list[tuple[int, int, int]], memo: dict[tuple, cost.StageMemory],
                    cp: int = 1) -> list[GroupOption]:
    """The options of one TP layout at context parallelism ``cp`` on ``pool``'s idle nodes
    (:func:`group_options`)."""
    total = plan.dp * plan.num_microbatches
    gpus = len(idle) * pool.gpus_per_node
    out: list[GroupOption] = []
    for per_run in range(1, max(b - a for _, a, b in runs) + 1):
        splits, tps = _run_splits(runs, per_run)
        dp = gpus // (sum(tps) * cp)
        if dp < 1 or len(splits) > MAX_GROUP_STAGES or len(out) >= MAX_FITTING_DEPTHS:
            break
        top = (total - plan.dp) // dp  # group 0 keeps at least one microbatch
        most = (max_microbatches(plan, splits, tps, dp, pool.device, top, memo, cp)
                if top else 0)
        if most >= 1:
            stage_s = tuple(group_stage_s(plan, splits, tps, pool, cp))
            line = affine(stage_s, plan.schedule, plan_zb_div(plan, [pool.device], cp))
            out.append(GroupOption(pool, idle, tps, dp, splits, stage_s, most, line, cp))
    return out


def group_stage_s(plan: Plan, splits: Sequence[tuple[int, int]], tps: Sequence[int],
                  pool: Pool, cp: int = 1) -> list[float]:
    """Forward+backward seconds of one microbatch on each stage of an extra group on
    ``pool``'s device at context parallelism ``cp``, as the search prices a stage: its layers
    (``context.cp_layer_time_s``: ``cost.layer_time_s`` without CP; with it the rank's
    ``s/cp`` tokens and the K/V exchange over ``context.cp_link``), the last stage also the LM
    head (``context.cp_head_time_s``), and what a device profile measured of the runtime's
    stage (``cost.stage_overhead_s``; a CP rank's shorter sequence matches no profile)."""
    model, t, mb, device = plan.model, plan.training, plan.micro_batch, pool.device
    eb = cost.precision_bytes(t)
    local = cost.cp_local_model(model, cp)
    out = []
    for s, ((a, b), tp) in enumerate(zip(splits, tps, strict=True)):
        link = context.cp_link(device, pool.gpus_per_node, pool.nic_gbytes_per_gpu, tp, cp)
        sec = (b - a) * context.cp_layer_time_s(model, t, mb, tp, cp, device, link)
        sec += cost.stage_overhead_s(local, mb, tp, device, s == 0, eb)
        if s == len(splits) - 1:
            sec += context.cp_head_time_s(model, mb, tp, cp, device, eb, t.loss_chunk_tokens)
        out.append(sec)
    return out


# one group's pipeline for the cross-group gradient sum: (replicas, CP degree, stages as
# (layer start, layer end, TP, the pools that hold its replicas))
SumGroup = tuple[int, int, tuple[tuple[int, int, int, tuple[str, ...]], ...]]


def _sum_groups(plan: Plan, options: Sequence[GroupOption]) -> list[SumGroup]:
    """Group 0 (``plan``'s stages) and the extra ``options`` as :data:`SumGroup`s."""
    first = (plan.dp, context_parallel_degree(plan),
             tuple((s.layer_start, s.layer_end, s.tp, s.pools) for s in plan.stages))
    return [first, *((o.dp, o.cp, tuple((a, b, tp, (o.pool.name,))
                                        for (a, b), tp in zip(o.splits, o.tps, strict=True)))
                     for o in options)]


def _plan_sum_groups(plan: Plan) -> list[SumGroup]:
    """A grouped plan's groups as :data:`SumGroup`s."""
    return [(g.dp, group_cp(g.stages), tuple((s.layer_start, s.layer_end, s.tp, s.pools)
                                             for s in g.stages)) for g in plan.groups]


def stage_grad_bytes(model: ModelSpec, a: int, b: int, tp: int, first: bool, last: bool) -> float:
    """fp32 gradient bytes one TP rank of a stage holding layers ``[a, b)`` sums between the
    groups (``runtime/replica_sync.py``: every piece it holds): each layer's matmuls split
    ``tp`` ways and its two norms whole, the embedding (first stage) and the LM head (last,
    unless tied to the embedding) split :func:`cost.vocab_shards` ways, the final norm
    (last) whole."""
    layer = cost.layer_matmul_params(model) / tp + 2 * model.hidden
    vocab = cost.embedding_params(model) / cost.vocab_shards(model, tp)
    tables = int(first) + int(last and not model.tie_embeddings)
    return 4.0 * ((b - a) * layer + vocab * tables + model.hidden * int(last))


def groups_grad_sum_s(plan: Plan, inv: ClusterInventory, groups: Sequence[SumGroup]) -> float:
    """Seconds of the gradient sum between replica groups on the rank that takes longest,
    after the backward (not overlapped), as ``runtime/replica_sync.py`` runs it, plus the
    datacenter link's share (:func:`groups_link_s`).

    Each holder set is summed in two levels (:func:`_two_level_s`): inside each group over
    the rank's DP×CP group (``d = dp_g·cp_g`` ranks on the group's backend, priced as
    ``cost.node_hierarchical_all_reduce``) a reduce-scatter leaves each rank the group's sum
    of its ``1/d`` slice; each slice is summed with the other ``G − 1`` groups' owners of
    the same elements in host memory (gloo: PCIe both ways, ``2(G − 1)/G`` of the slice at
    the NIC share, at most :data:`GLOO_RING_GBYTES`; a slice another group cuts finer runs
    one ring per piece, side by side; the rings of all of a rank's sets run at once, so
    their latency is paid once per rank, not per set, except where the rank is alone in its
    DP×CP group: :func:`_ring_rounds`); an all-gather inside the group fills the slices back
    in. Where the group has no flat reduce-scatter (it spans pools, or runs gloo) both steps
    are all-reduces. Where a ring crosses a datacenter link, each of its
    ``2(G − 1)`` steps waits the link's latency too (:func:`_ring_rounds` times), and the
    link carries every ring's bytes
    (:func:`groups_link_s`). The sets whose holders do not pair one per replica take one
    gloo ring over every holder in the runtime (:func:`_one_ring_s`; across datacenters
    inside each and between their leaders): a vocabulary table one group replicates over
    its TP ranks beside another TP degree (:func:`_vocab_unpaired`, priced so) and the norms
    beside unequal TP degrees (small, priced with the rest)."""
    if len(groups) < 2:
        return 0.0
    model = plan.model
    pools = [pool for _, _, stages in groups for *_, ps in stages for pool in ps]
    cuts = {a for _, _, stages in groups for a, _, _, _ in stages}
    nic = min([inv.pool(p).nic_gbytes_per_gpu for p in pools] + [GLOO_RING_GBYTES])
    vocab = cost.embedding_params(model) * 4.0
    # the vocabulary tables' holders pair one per replica unless some group replicates the
    # table over its TP ranks and another holds it at another TP degree (runtime cell_sets)
    unpaired = [_vocab_unpaired(model, [stages[end][2] for _, _, stages in groups])
                for end in (0, -1)]
    spans = _stage_spans(inv, groups)
    crosses = _crosses_datacenters(spans)
    worst = 0.0
    for dp, cp, stages in groups:
        for i, (a, b, tp, ps) in enumerate(stages):
            first, last = i == 0, i == len(stages) - 1
            nbytes = stage_grad_bytes(model, a, b, tp, first, last)
            sets = _holder_sets(a, b, cuts)
            pcie = inv.pool(ps[0]).device.pcie_gbps
            tables = int(first and unpaired[0]) + int(
                last and unpaired[1] and not model.tie_embeddings)
            ring = tables * vocab / cost.vocab_shards(model, tp)
            sec = _two_level_s(inv, groups, dp * cp, tp, ps, nbytes - ring, sets, nic, pcie)
            if ring:
                sec += _one_ring_s(groups, ring, tables, nic, pcie)
            # every ring step that crosses a datacenter link waits for it: the two-level
            # sets' rings run at once (one round; a rank alone in its DP×CP group sums its
            # sets one by one), the one-ring tables' after them
            edges = _ring_edges(inv, _holder_datacenters(spans, a, b)) if crosses else []
            lat = max((k.latency_ms for k in edges), default=0.0) / 1000
            rounds = _ring_rounds(dp * cp, sets) + tables
            worst = max(worst, sec + rounds * 2 * (len(groups) - 1) * lat)
    return worst + (groups_link_s(plan, inv, groups, spans) if crosses else 0.0)


Span = tuple[int, int, frozenset[str]]  # a stage's layers [lo, hi) and its datacenters


def _stage_spans(inv: ClusterInventory, groups: Sequence[SumGroup]) -> list[list[Span]]:
    """Per group, each stage's layer range and datacenters; no datacenters at all when every
    stage is in one datacenter (no ring crosses a link: :func:`_ring_edges` finds none)."""
    dc = {p.name: p.datacenter for p in inv.pools}
    spans = [[(lo, hi, frozenset(dc[p] for p in ps)) for lo, hi, _, ps in stages]
             for _, _, stages in groups]
    if len(frozenset().union(*(d for stages in spans for _, _, d in stages))) < 2:
        return [[(lo, hi, frozenset()) for lo, hi, _ in stages] for stages in spans]
    return spans


def _crosses_datacenters(spans: Sequence[Sequence[Span]]) -> bool:
    """Whether any stage of :func:`_stage_spans` names datacenters: whether some ring may
    cross a link (none does when they are all empty: every stage in one datacenter)."""
    return any(d for stages in spans for _, _, d in stages)


def _holder_datacenters(spans: Sequence[Sequence[Span]], a: int,
                        b: int) -> list[frozenset[str]]:
    """Per group, the datacenters of its stages (:func:`_stage_spans`) that hold any of
    layers ``[a, b)``: where the holders of those layers' sets are."""
    return [frozenset().union(*(d for lo, hi, d in stages if lo < b and a < hi))
            for stages in spans]


def _ring_edges(inv: ClusterInventory, dcs: Sequence[frozenset[str]]) -> list[Link]:
    """The datacenter links the chunk ring of one holder set crosses (one per edge; members in
    group order, the ring closing from the last to the first: the runtime's gloo groups are
    sorted by rank, and the ranks by group): an edge between two groups not both wholly in one
    datacenter takes the slowest link between their datacenters."""
    out = []
    for i, here in enumerate(dcs):
        there = dcs[(i + 1) % len(dcs)]
        pairs = [(x, y) for x in here for y in there if x != y]
        if pairs and (here != there or len(here) > 1):
            out.append(min((inv.link(x, y) for x, y in pairs), key=lambda k: k.gbytes))
    return out


def groups_link_s(plan: Plan, inv: ClusterInventory, groups: Sequence[SumGroup],
                  spans: Sequence[Sequence[Span]] | None = None) -> float:
    """Seconds the datacenter links take to carry the chunk rings of the gradient sum between
    groups (:func:`groups_grad_sum_s`; 0 when no ring crosses one): for each of group 0's
    stages (each parameter piece once: every TP rank's fp32 gradient bytes), ``2(G − 1)/G`` of
    them per ring edge that crosses a link (:func:`_ring_edges`); each link carries what its
    edges send, half each way (the ring's edges run both ways between two datacenters), and
    the link that takes longest sets the time (concurrent rings share it). ``spans``: the
    groups' :func:`_stage_spans`, when the caller has them."""
    spans = _stage_spans(inv, groups) if spans is None else spans
    _, _, stages = groups[0]
    g, last = len(groups), len(stages) - 1
    sent: dict[tuple[str, str], float] = {}  # bytes per link (its two datacenters, sorted)
    for i, (a, b, tp, _) in enumerate(stages):
        nbytes = tp * stage_grad_bytes(plan.model, a, b, tp, i == 0, i == last)
        for link in _ring_edges(inv, _holder_datacenters(spans, a, b)):
            key = (min(link.a, link.b), max(link.a, link.b))
            sent[key] = sent.get(key, 0.0) + 2 * (g - 1) / g * nbytes
    return max((n / 2 / (inv.link(*key).gbytes * 1e9) for key, n in sent.items()), default=0.0)


def _vocab_unpaired(model: ModelSpec, tps: Sequence[int]) -> bool:
    """Whether the groups' holders of a vocabulary table (at TP degrees ``tps``, one per group)
    cannot pair one per replica: a TP group that does not split the vocabulary holds the whole
    table on each of its ``tp`` ranks, so the holders per replica differ between groups."""
    return len({tp if cost.vocab_shards(model, tp) == 1 else 1 for tp in tps}) > 1


def _one_ring_s(groups: Sequence[SumGroup], nbytes: float, sets: int, nic: float,
                pcie: float) -> float:
    """One rank's sum in one gloo ring per set over every holder, across datacenters (the
    local ring priced over every holder, at least its bytes, and the local broadcast of the
    leaders' sum once more): PCIe both ways, ``2(n − 1)/n + 1`` of its bytes at ``nic`` GB/s,
    ``2(n − 1)`` round trips per set (a gloo step waits for the receiver's buffer:
    ``docs/collectives.md``)."""
    n = sum(dp * cp for dp, cp, _ in groups)
    return (2 * nbytes / (pcie * 1e9) + (2.0 * (n - 1) / n + 1.0) * nbytes / (nic * 1e9)
            + sets * (4 * (n - 1) * cost.COLLECTIVE_LATENCY_S + cost.HOST_STAGING_LATENCY_S))


def _two_level_s(inv: ClusterInventory, groups: Sequence[SumGroup], d: int, tp: int,
                 pools: Sequence[str], nbytes: float, sets: int, nic: float,
                 pcie: float) -> float:
    """One rank's two-level sum (:func:`groups_grad_sum_s`) of ``nbytes`` in ``sets`` sets
    inside its group's DP×CP group of ``d`` ranks on ``pools`` (the slowest pool's links): a
    reduce-scatter and an all-gather (one all-reduce's bytes and steps) where the group is in
    one pool on a vendor backend, else two all-reduces (a group spanning pools goes through
    the host at gloo's rate; gloo's all-reduce beats its reduce-scatter), one collective's
    latency per set (they run set by set), and its ``1/d`` slice between the groups in host
    memory (the rings of every set and piece side by side: one ring's latency in all, or one
    per set alone in the group: :func:`_ring_rounds`)."""
    devs = [inv.pool(p) for p in pools]
    intra = min(p.device.intra_node_gbps for p in devs)
    nic_g = min(p.nic_gbytes_per_gpu for p in devs)
    if len(devs) > 1:  # between pools the communicator's hop goes through gloo on the host
        nic_g = min(nic_g, GLOO_RING_GBYTES, pcie)
    per_node = cost.dp_members_per_node(d, tp, min(p.gpus_per_node for p in devs))
    lat, per_byte = cost.node_hierarchical_all_reduce(d, per_node, intra,
                                                      cost.COLLECTIVE_LATENCY_S, nic_g,
                                                      cost.COLLECTIVE_LATENCY_S)
    g = len(groups)
    chunk = nbytes / d
    between = (2 * chunk / (pcie * 1e9) + 2.0 * (g - 1) / g * chunk / (nic * 1e9)
               + _ring_rounds(d, sets) * (4 * (g - 1) * cost.COLLECTIVE_LATENCY_S
                                          + cost.HOST_STAGING_LATENCY_S))
    flat = len(devs) == 1 and devs[0].device.backend != "gloo"
    return (1 if flat else 2) * (sets * lat + per_byte * nbytes) + between


def _ring_rounds(d: int, sets: int) -> int:
    """Ring latencies a rank of a DP×CP group of ``d`` with ``sets`` two-level sets waits
    between the groups (``runtime/replica_sync.py``): one (every set's rings at once), or
    ``sets`` when it is alone in its group (its slices are whole sets, summed one by one to
    hold one set's copy at a time)."""
    return sets if d == 1 else 1


def _holder_sets(a: int, b: int, cuts: set[int]) -> int:
    """Holder sets of a stage holding layers ``[a, b)`` (one all-reduce each) where every
    group gives a layer one TP degree: its layers cut where any group's stage starts (the
    embedding has the holders of layer 0, the head those of the last layer: the same sets).
    Unequal TP degrees pair the shards in more, smaller sets (``cell_sets``): the bytes are
    the same, a few latencies more."""
    return 1 + sum(1 for c in cuts if a < c < b)


Split = tuple[float, tuple[int, ...], tuple[int, ...]]  # step s, (M_g), (short replicas_g)


def group_split(plan: Plan, lines: Sequence[Line], dps: Sequence[int],
                caps: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``((M_g), (short_g))``: the fastest split of ``plan``'s microbatches between groups of
    ``dps`` replicas: every group even (:func:`best_split_n`), or, where the runtime runs
    short replicas (:func:`uneven_groups_ok`) and it is faster, some groups uneven
    (:func:`best_uneven_split`); None when no split gives every replica a microbatch."""
    total = plan.total_microbatches
    even = best_split_n(lines, dps, total, caps)
    uneven = best_uneven_split(lines, dps, total, caps) if uneven_groups_ok(plan) else None
    if uneven is not None:
        ms = tuple(-(-n // dp) for n, dp in zip(uneven, dps, strict=True))
        if even is None or split_time(lines, *ms) < split_time(lines, *even) * (1 - 1e-12):
            return ms, tuple(dp * m - n for dp, m, n in zip(dps, ms, uneven, strict=True))
    return None if even is None else (even, (0,) * len(dps))


def evaluate_groups(plan: Plan, options: Sequence[GroupOption],
                    inv: ClusterInventory | None = None, own_sync_s: float = 0.0,
                    below: float | None = None) -> Split | None:
    """``(predicted step seconds, (M_0, M_1, ...), (short replicas per group))`` of ``plan``
    (group 0; an uneven one's microbatches are split anew) plus ``options`` at their best
    split (:func:`group_split`), plus, when ``inv`` is given, the gradient sum between the
    groups (:func:`groups_grad_sum_s`), less ``own_sync_s``: the seconds of ``plan``'s step
    that are its own DP gradient sync, which that sum replaces
    (``planner.own_grad_sync_s``); None when no split gives every replica a microbatch.

    ``below``: the caller keeps only a step faster than ``below`` seconds, so None too when
    a lower bound shows the step is not: the relaxed split (:func:`relaxed_time`, before
    any split is searched), then the split without the gradient sum (the search's hot
    path: most trial groups lose on their pipeline alone)."""
    div = (plan_zb_div(plan, plan_devices(plan, inv)) if inv is not None
           else cost.ZB_CATALOG_DIVISOR)
    lines = [affine([s.time_ms / 1000 for s in plan.stages], plan.schedule, div),
             *(o.line for o in options)]
    dps = [plan.dp, *(o.dp for o in options)]
    caps = [plan.num_microbatches, *(o.max_m for o in options)]
    a0, b0 = lines[0]
    rest = plan.predicted.step_time_s - (a0 + b0 * plan.num_microbatches) - own_sync_s
    # (the relaxation's float may round above an exact split's: keep a margin)
    if below is not None and (rest + relaxed_time(lines, dps, plan.total_microbatches, caps)
                              >= below + BOUND_MARGIN * abs(below)):
        return None
    got = group_split(plan, lines, dps, caps)
    if got is None:
        return None
    split, shorts = got
    pipe = split_time(lines, *split)
    if below is not None and rest + pipe >= below:  # the sum only adds (float sums: monotone)
        return None
    sync = (groups_grad_sum_s(plan, inv, _sum_groups(plan, options))
            if inv is not None else 0.0)
    return rest + sync + pipe, split, shorts


def evaluate(plan: Plan, option: GroupOption, inv: ClusterInventory | None = None,
             own_sync_s: float = 0.0) -> Split | None:
    """:func:`evaluate_groups` with one extra group."""
    return evaluate_groups(plan, [option], inv, own_sync_s)


def grouped_step_s(spec: JobSpec, inv: ClusterInventory, plan: Plan) -> float | None:
    """The predicted step time of the grouped ``plan`` (its layouts and batch split unchanged)
    on ``inv``, e.g. with refined device profiles: what :func:`with_groups` predicted, every
    stage re-timed. Group 0 is priced as the search priced the plan before the groups were
    added (its stages, boundaries and DP sync at ``M = Σ_g dp_g·M_g / dp_0`` microbatches:
    ``planner.split_costs``), every other group by :func:`group_stage_s` on its pool's device;
    the step is group 0's time outside its pipelined stages, the gradient sum between the
    groups (:func:`groups_grad_sum_s`, datacenter links included) and
    the latest group's pipeline. None when group 0's stages no longer fit."""
    # the planner imports this module
    from hettrain.planning.planner import plan_link_delay_s, split_costs

    g0, extra = plan.groups[0], plan.groups[1:]
    total = sum(g.microbatches for g in plan.groups)
    m_orig = -(-total // g0.dp)  # (an uneven group 0: its last replicas one fewer)
    base = replace(plan, groups=(), num_microbatches=m_orig, short_replicas=g0.dp * m_orig - total,
                   ranks=tuple(r for r in plan.ranks if r.group == 0))
    costs = split_costs(spec, inv, base, [s.layer_end - s.layer_start for s in g0.stages],
                        summed_elsewhere=True)
    if costs is None:
        return None
    stage_s0, boundaries, dp_s = costs
    div = plan_zb_div(base, plan_devices(base, inv))
    pipe, _ = cost.pipeline_time_s(stage_s0, boundaries, m_orig, plan.schedule,
                                   plan.virtual_stages, div,
                                   link_delay_s=plan_link_delay_s(spec, inv, base))
    lines = [affine(stage_s0, plan.schedule, div)]
    for g in extra:
        pool, cp = inv.pool(g.stages[0].pools[0]), group_cp(g.stages)
        lines.append(affine(group_stage_s(plan, [(s.layer_start, s.layer_end) for s in g.stages],
                                          [s.tp for s in g.stages], pool, cp), plan.schedule,
                            plan_zb_div(plan, [pool.device], cp)))
    rest = pipe + dp_s - (lines[0][0] + lines[0][1] * m_orig)
    sync = groups_grad_sum_s(base, inv, _plan_sum_groups(plan))
    return rest + sync + split_time(lines, *(g.num_microbatches for g in plan.groups))


def _gpus(option: GroupOption) -> int:
    return option.dp * option.cp * sum(option.tps)


def greedy_groups(plan: Plan, inv: ClusterInventory, options: Sequence[GroupOption],
                  max_gpus: int | None = None, passes: int = SWAP_PASSES,
                  own_sync_s: float = 0.0) -> tuple[list[GroupOption], Split | None]:
    """The extra groups :func:`add_replica_groups` adds (module docstring): rounds that each
    add the option (on a pool no chosen group uses) making the modelled step fastest, while
    it gets faster and the job stays within ``max_gpus``, then up to ``passes`` passes of
    :func:`swap_groups`; with :func:`evaluate_groups`'s ``(step seconds, split, short
    replicas)`` of the result (None when no group is added). ``own_sync_s``: see
    :func:`evaluate_groups`."""
    chosen: list[GroupOption] = []
    best: Split | None = None
    gpus = plan.world_size
    while True:
        pools = {o.pool.name for o in chosen}
        found: tuple[Split, GroupOption] | None = None
        # a round keeps the fastest option if it beats the step so far
        goal = (plan.predicted.step_time_s if best is None else best[0]) * (1 - 1e-9)
        for option in options:
            if option.pool.name in pools or (
                    max_gpus is not None and gpus + _gpus(option) > max_gpus):
                continue
            got = evaluate_groups(plan, [*chosen, option], inv, own_sync_s,
                                  below=goal if found is None else min(goal, found[0][0]))
            if got is not None and (found is None or got[0] < found[0][0]):
                found = (got, option)
        if found is None or not found[0][0] < goal:
            break
        chosen.append(found[1])
        gpus += _gpus(found[1])
        best = found[0]
    if best is None:
        return chosen, best
    return swap_groups(plan, inv, options, chosen, best, max_gpus, passes, own_sync_s)


def swap_groups(plan: Plan, inv: ClusterInventory, options: Sequence[GroupOption],
                chosen: list[GroupOption], best: Split,
                max_gpus: int | None = None, passes: int = SWAP_PASSES,
                own_sync_s: float = 0.0) -> tuple[list[GroupOption], Split]:
    """``chosen`` improved by replacing one group at a time: each pass tries every chosen
    group against every option on a pool the others do not use (its own pool's other
    layouts included) and keeps each replacement that makes the step faster, within
    ``max_gpus``; it stops after a pass without one, or ``passes`` passes. The greedy rounds
    fix each group given the earlier ones, so a group picked first can be one a later pick
    makes a poor partner (``docs/planning.md`` §Extra replica groups). The first pass skips
    the last group: the last round picked it as the fastest with the others as they are (one
    group alone: no pass at all)."""
    cur, top = list(chosen), best
    gpus = plan.world_size + sum(_gpus(o) for o in cur)
    for n in range(passes):
        improved = False
        for i in range(len(cur) - 1 if n == 0 else len(cur)):
            used = {o.pool.name for j, o in enumerate(cur) if j != i}
            for option in options:
                extra = _gpus(option) - _gpus(cur[i])
                if option is cur[i] or option.pool.name in used or (
                        max_gpus is not None and gpus + extra > max_gpus):
                    continue
                trial = [*cur[:i], option, *cur[i + 1:]]
                got = evaluate_groups(plan, trial, inv, own_sync_s,
                                      below=top[0] * (1 - 1e-9))
                if got is not None and got[0] < top[0] * (1 - 1e-9):
                    cur, top, gpus, improved = trial, got, gpus + extra, True
        if not improved:
            break
    return cur, top


def add_replica_groups(plan: Plan, spec: JobSpec, inv: ClusterInventory,
                       max_gpus: int | None = None) -> Plan:
    """``plan`` (planned for ``spec``) with the extra replica groups :func:`greedy_groups`
    picks, or ``plan`` itself when none makes the modelled step faster (or its short replicas
    cannot run beside groups: :func:`uneven_groups_ok`). Group 0's own gradient sync is not
    charged: the groups' sum replaces it (``planner.own_grad_sync_s``)."""
    from hettrain.planning.planner import own_grad_sync_s  # the planner imports this module

    if plan.short_replicas and not uneven_groups_ok(plan):
        return plan
    chosen, best = greedy_groups(plan, inv, group_options(plan, inv), max_gpus,
                                 own_sync_s=own_grad_sync_s(spec, inv, plan))
    return plan if best is None else with_groups(plan, inv, chosen, best[1], best[0], best[2])


def _place_group(option: GroupOption) -> list[tuple[tuple[int, int, int, int], str, int]]:
    """``((dp, stage, tp index, cp index), node, local GPU)`` of every rank of the group, in
    node and GPU order (a node's ranks are consecutive: one pod each, ``manifests.build_pods``).
    Each ``(dp, stage)`` is a block of its ``cp`` TP groups side by side (the CP group on one
    node where it fits: ``context.cp_link``), the blocks packed onto the idle nodes widest
    first: the TP widths are powers of two dividing the node size and ``cp`` a power of two,
    so each TP group starts at a multiple of its width and never straddles a node (it stays
    on one node's fast links)."""
    cp = option.cp
    blocks = sorted(((tp, d, st) for d in range(option.dp)
                     for st, tp in enumerate(option.tps)), key=lambda b: -b[0])
    gpn = option.pool.gpus_per_node
    where: list[tuple[int, tuple[int, int, int, int]]] = []  # (GPU offset, coordinate)
    offset = 0
    for tp, d, st in blocks:
        where += [(offset + c * tp + t, (d, st, t, c)) for c in range(cp) for t in range(tp)]
        offset += tp * cp
    return [(key, option.nodes[at // gpn], at % gpn) for at, key in sorted(where)]


def _group_stages(plan: Plan, option: GroupOption, m: int) -> tuple[StagePlan, ...]:
    """The stages of ``option``'s pipeline, their memory at ``m`` microbatches per replica."""
    pool = option.pool
    mems = stage_memory_bytes(plan, option.splits, option.tps, option.dp, m, option.cp,
                              cp_masks=not cost.skips_masked_tiles(pool.device))
    return tuple(StagePlan(
        index=s, device=pool.device.name, vendor=pool.vendor, backend=pool.device.backend,
        pools=(pool.name,), datacenters=(pool.datacenter,), layer_start=a, layer_end=b,
        tp=option.tps[s], memory_gib=mems[s] / cost.GIB,
        capacity_gib=pool.device.hbm_gib, time_ms=option.stage_s[s] * 1000,
        has_embedding=s == 0, has_head=s == option.pp - 1, cp=option.cp)
        for s, (a, b) in enumerate(option.splits))


def with_groups(plan: Plan, inv: ClusterInventory, options: Sequence[GroupOption],
                split: Sequence[int], step_time_s: float, shorts: Sequence[int] = ()) -> Plan:
    """The grouped plan: group 0 = ``plan`` at ``split[0]`` microbatches per replica, group
    ``g >= 1`` = ``options[g - 1]`` at ``split[g]``, its ranks after the plan's; the last
    ``shorts[g]`` replicas of group ``g`` run one fewer (none without ``shorts``)."""
    shorts = tuple(shorts) or (0,) * len(split)
    ranks = list(plan.ranks)
    groups = [ReplicaGroup(0, plan.dp, plan.pp, split[0], plan.stages, shorts[0])]
    notes = []
    for g, (option, m) in enumerate(zip(options, split[1:], strict=True), start=1):
        first = len(ranks)
        for (d, st, t, c), node, local in _place_group(option):
            ranks.append(RankPlan(rank=len(ranks), node=node, pool=option.pool.name,
                                  datacenter=option.pool.datacenter, local_rank=local,
                                  stage=st, dp=d, tp=t, cp=c, group=g))
        groups.append(ReplicaGroup(g, option.dp, option.pp, m, _group_stages(plan, option, m),
                                   shorts[g]))
        notes.append(f"extra replica group {g} on {len({r.node for r in ranks[first:]})} idle "
                     f"node(s) of pool {option.pool.name}: {option.dp}x pp={option.pp} "
                     f"tp={'/'.join(map(str, option.tps))}"
                     + (f" cp={option.cp}" if option.cp > 1 else "")
                     + f", {m} microbatch(es) per replica")
    shares = " / ".join(f"{m} (group {gr.index}, {gr.dp} replicas"
                        + (f", the last {gr.short_replicas} run {m - 1}" if gr.short_replicas
                           else "") + ")"
                        for m, gr in zip(split, groups, strict=True))
    notes.append(f"replica groups: microbatches per replica {shares}; predicted step "
                 f"{plan.predicted.step_time_s:.3f}s -> {step_time_s:.3f}s")
    tokens = plan.global_batch * plan.model.seq_len
    eb = cost.precision_bytes(plan.training)
    peak = sum(inv.pool(r.pool).device.peak_matmul_flops(eb) for r in ranks)
    mfu = cost.model_flops_per_step(plan.model, plan.global_batch) / (step_time_s * peak)
    # compute and bubble of the group whose pipeline ends last (the step waits for it)
    divs = [plan_zb_div(plan, plan_devices(plan, inv)),
            *(plan_zb_div(plan, [o.pool.device], o.cp) for o in options)]
    timed = [(cost.pipeline_time_s(stage_s, [], m, plan.schedule, zb_div=d), m, stage_s)
             for m, stage_s, d in zip(split, [[st.time_ms / 1000 for st in plan.stages],
                                              *(list(o.stage_s) for o in options)], divs,
                                      strict=True)]
    (_, bubble), m, stage_s = max(timed, key=lambda g: g[0][0])
    predicted = replace(plan.predicted, step_time_s=step_time_s,
                        tokens_per_s=tokens / step_time_s, mfu=mfu,
                        compute_s=m * max(stage_s), bubble_s=bubble,
                        dp_comm_s=plan.predicted.dp_comm_s + groups_grad_sum_s(
                            plan, inv, _sum_groups(plan, options)))
    # the search's uneven-replica note no longer holds: the split note below says which
    # replicas of which group run one fewer
    kept = tuple(n for n in plan.notes if not n.startswith("uneven data parallelism:"))
    return replace(plan, num_microbatches=split[0], short_replicas=0, ranks=tuple(ranks),
                   groups=tuple(groups), predicted=predicted, notes=(*kept, *notes))


def _idle_reason(plan: Plan, inv: ClusterInventory, grouped: Plan,
                 chosen: Sequence[GroupOption], options: Sequence[GroupOption], pool: str,
                 cap: int | None, own_sync_s: float) -> str:
    """Why ``pool``'s idle nodes get no replica group in ``grouped``."""
    mine = [o for o in options if o.pool.name == pool]
    if not mine and plan.num_microbatches == 1:
        return (f"the step's {plan.dp} microbatches are one per replica of group 0: no "
                "microbatch is left for another group (a larger global batch would leave some)")
    if not mine:
        tps = "/".join(str(tp) for tp, _, _ in tp_runs(plan))
        cps = "/".join(map(str, group_cps(plan)))
        return (f"no pipeline (the plan's TP runs {tps}, or one TP degree; cp {cps}) fits "
                "their memory and node size with the step's microbatches left over")
    goal = grouped.predicted.step_time_s * (1 - 1e-9)
    faster = [] if cap is None else [  # without a cap the greedy took every faster one
        o for o in mine if (got := evaluate_groups(plan, [*chosen, o], inv, own_sync_s,
                                                    below=goal)) is not None
        and got[0] < goal]
    if faster and cap is not None:
        need = grouped.world_size + min(_gpus(o) for o in faster)
        return f"a faster grouped plan needs {need} GPUs > maxGPUs {cap}"
    return ("an extra group there would not make the modelled step faster (the gradient sum "
            "between the groups, host-staged in gloo after the backward, its bubble or a "
            "datacenter link cost more than it adds)")


def plan_with_replica_group(plan: Plan, spec: JobSpec, inventory: ClusterInventory,
                            previous: Plan | None = None, per_pool: bool = True) -> Plan:
    """``spec.parallelism.replicaGroups``: the faster of ``plan`` with extra groups on its
    idle nodes (:func:`groups_on_idle`) and the :func:`per_pool_plans` layouts (group 0
    searched on one pool alone, the other pools' nodes as extra groups): every pool for a
    first plan; for a re-plan after failures (``previous``), only the pool that held all of
    ``previous``'s group 0, if one did (its per-pool layout stays one, not a search over every
    pool). ``per_pool=False``: only the groups on idle nodes (the caller compared the per-pool
    layouts already)."""
    grouped = groups_on_idle(plan, spec, inventory)
    if not per_pool:
        return grouped
    only = None
    if previous is not None:
        home = {p for s in (previous.groups[0].stages if previous.groups else ()) for p in s.pools}
        if len(home) != 1:
            return grouped
        only = home.pop()
    for alt in per_pool_plans(plan, spec, inventory, only):
        if alt.predicted.step_time_s < grouped.predicted.step_time_s * (1 - 1e-9):
            grouped = alt
            if previous is not None:
                grouped = replace(grouped, notes=(
                    *grouped.notes, f"re-plan: {moved_ranks(previous, grouped.ranks)} of "
                    f"{len(grouped.ranks)} ranks change stage"))
    return grouped


def per_pool_plans(plan: Plan, spec: JobSpec, inventory: ClusterInventory,
                   only: str | None = None) -> list[Plan]:
    """For each pool ``spec.placement`` allows (``only``: that pool alone; not a pool ``plan``
    uses alone, unless ``plan`` is uneven: groups need an even layout): the search's plan on
    that pool alone (``planner.plan_job``, the spec's pins and caps; below
    :data:`SOLO_CP_SEARCH_MIN_SEQ` tokens at ``plan``'s CP degree) as group 0, with
    :func:`groups_on_idle` on every other pool's nodes -- one replica group per pool, shares by
    speed; only those that got a group. The search over all pools places pools as pipeline
    stages of one layout; this places them side by side."""
    from hettrain.planning.errors import PlanningError
    from hettrain.planning.planner import (  # the planner imports this module
        even_data_parallel,
        plan_job,
    )

    allowed = filter_pools(inventory, spec.placement)
    cp = spec.parallelism.cp
    if cp is None and spec.model.seq_len < SOLO_CP_SEARCH_MIN_SEQ:
        cp = plan.stages[0].cp
    solo = replace(spec, parallelism=replace(spec.parallelism, replica_groups=False, cp=cp))
    out = []
    for pool in allowed if len(allowed) > 1 else ():
        # (a pool an uneven plan uses alone gets its even layout with groups here)
        if (plan.pools == (pool.name,) and not plan.short_replicas) or only not in (
                None, pool.name):
            continue
        sub = replace(solo, placement=replace(spec.placement, pools=(pool.name,)))
        try:
            with even_data_parallel():  # groups split an even batch
                base = plan_job(plan.job, sub, inventory)
        except PlanningError:
            continue
        # the other pools are not idle for this layout: they get the groups
        base = replace(base, notes=tuple(n for n in base.notes
                                         if not (n.startswith("pool ") and " idle: " in n)))
        grouped = groups_on_idle(base, spec, inventory)
        if grouped.groups:
            out.append(replace(grouped, notes=(
                *grouped.notes, f"replica groups: group 0 searched on pool {pool.name} alone "
                f"({grouped.predicted.step_time_s:.3f}s; the search over every pool: "
                f"{plan.predicted.step_time_s:.3f}s)")))
    return out


def groups_on_idle(plan: Plan, spec: JobSpec, inventory: ClusterInventory) -> Plan:
    """:func:`add_replica_groups` on the pools ``spec.placement`` allows, within ``maxGPUs``,
    kept only when the runtime can run it (``support.replica_group_errors``), its predicted
    step :func:`grouped_step_s`'s; a note names the idle pools left and why they stay idle
    (with no group: the plan itself, with that note)."""
    mode = (plan.cross_dc or {}).get("mode", "sync")
    why = (f"the {plan.schedule} schedule" if chunked_schedule(plan.schedule)
           else f"crossDC.mode {mode}" if mode != "sync"
           else (f"uneven data parallelism ({plan.short_replicas} of {plan.dp} replicas run "
                 "one microbatch fewer; the runtime runs short replicas beside groups only "
                 "with schedule 1f1b or zb-h1 and sharding none or optimizer)")
           if plan.short_replicas and not uneven_groups_ok(plan) else "")
    allowed = replace(inventory, pools=filter_pools(inventory, spec.placement))
    idle = [p.name for p, _ in _idle_pools(plan, allowed)]
    if not idle:
        return plan
    if why:
        return _idle_note(plan, idle, why)
    cap = spec.placement.max_gpus
    options = group_options(plan, allowed)
    from hettrain.planning.planner import own_grad_sync_s  # the planner imports this module

    own = own_grad_sync_s(spec, allowed, plan)  # the groups' sum replaces it
    chosen, best = greedy_groups(plan, allowed, options, cap, own_sync_s=own)
    grouped = plan
    if best is not None:
        grouped = with_groups(plan, allowed, chosen, best[1], best[0], best[2])
        # the same step priced from the search's unrounded stage times (``time_ms`` keeps
        # 1 ns), so the plan's prediction is what calibration's grouped_step_s computes
        exact = grouped_step_s(spec, allowed, grouped)
        if exact is not None:
            grouped = with_groups(plan, allowed, chosen, best[1], exact, best[2])
    errors = replica_group_errors(grouped)
    if errors:
        return _idle_note(plan, idle, f"the runtime cannot run the grouped plan ({errors[0]})")
    used = {o.pool.name for o in chosen}
    by_why: dict[str, list[str]] = {}
    for pool in idle:
        if pool not in used:
            reason = _idle_reason(plan, allowed, grouped, chosen, options, pool, cap, own)
            by_why.setdefault(reason, []).append(pool)
    for reason, pools in by_why.items():
        grouped = _idle_note(grouped, pools, reason)
    return grouped


def _idle_note(plan: Plan, pools: Sequence[str], why: str) -> Plan:
    """``plan`` with the note that the idle nodes of ``pools`` stay idle, and why."""
    return replace(plan, notes=(*plan.notes, f"replicaGroups: idle nodes of pool(s) "
                                f"{', '.join(pools)} stay idle: {why}"))
