"""Why a plan leaves a pool wholly idle: one short note per such pool (``plan.notes``).

Computed once per plan, after the search (``planner.plan_job``), so the search itself does not
change. Each reason is a cheap exact check or comes from layouts evaluated exactly (the
search's own ``planner._evaluate``: exact layer split, memory caps, ``maxGPUs``), never a guess:

- ``excluded by spec.placement``: the pool is filtered out before the search;
- ``spec.parallelism.pp`` pins the stage count: any use of the pool adds stages;
- its device group (``units.Unit``) is used, but the plan's stages need fewer of its GPUs than
  the group has (placement fills the group's pools in order);
- otherwise the chosen layout with the pool's group inserted as ``k`` more stages (each TP
  option, ``k`` in ``1..MAX_TRIED_STAGES`` and the most it can host, at every position between
  the chosen stage blocks; the plan's dp, microbatch and schedule, or 1F1B under
  ``schedule: auto`` where that fits memory better) is evaluated, and the note says what
  that found: the model does not fit its memory (the closest miss), ``maxGPUs`` excludes
  every such layout, its GPUs cannot host one stage's ``dp`` replicas, or it is slower (the
  best one's step time vs the plan's, and when the slowest pipeline step is the transfer over
  its datacenter link, that link). A faster one is taken by a first plan
  (:func:`with_idle_groups`: the search's large-instance heuristics, the fixed stage order
  and the stage-count window, can leave it out); a re-plan keeps its structure, and its note
  says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hettrain.api.spec import JobSpec
from hettrain.planning import cost, planner
from hettrain.planning.inventory import ClusterInventory
from hettrain.planning.plan import Plan
from hettrain.planning.units import Unit, build_units, filter_pools

MAX_TRIED_STAGES = 4  # stage counts tried per TP degree: 1..4 and the most the group can host


# what :func:`_try_additions` found for one device group: its search (memory misses, maxGPUs),
# the fastest layout (or None) and how many layouts it tried
Trial = tuple[planner._Search, "planner.Candidate | None", int]


def idle_pool_notes(plan: Plan, chosen: planner.Candidate, spec: JobSpec,
                    inventory: ClusterInventory, replan: bool = False,
                    trials: dict[str, Trial] | None = None) -> list[str]:
    """One note per pool of ``inventory`` without a rank in ``plan``: ``pool NAME idle: WHY``.

    ``chosen`` is the search's candidate behind ``plan`` (group 0 with replica groups),
    ``spec`` the concrete spec it was searched with (its ``cp``), ``replan``: ``plan`` is a
    re-plan (which may keep a slower structure); ``trials``: :func:`with_idle_groups`' last
    pass over ``chosen``, by device group (reused, not tried again)."""
    used = {r.pool for r in plan.ranks}
    allowed = filter_pools(inventory, spec.placement)
    units = build_units(allowed, merged=chosen.grouping == "merged")
    notes = []
    reasons: dict[str, str] = {}  # per device group: its idle pools share the reason
    for pool in sorted(inventory.pools, key=lambda p: p.name):  # independent of file order
        if pool.name in used:
            continue
        if pool not in allowed:
            notes.append(f"pool {pool.name} idle: excluded by spec.placement")
            continue
        unit = next(u for u in units if pool in u.pools)
        if unit.key not in reasons:
            reasons[unit.key] = _reason(unit, units, chosen, spec, inventory, replan,
                                        (trials or {}).get(unit.key))
        notes.append(f"pool {pool.name} idle: {reasons[unit.key]}")
    return notes


def with_idle_groups(chosen: planner.Candidate, spec: JobSpec, inventory: ClusterInventory
                     ) -> tuple[planner.Candidate, list[str], dict[str, Trial]]:
    """``chosen``, extended while that makes it faster by the fastest layout that inserts the
    stages of a device group it leaves unused (:func:`_try_additions`: every TP, stage count
    and position tried, evaluated exactly), a note for each group so added, and the last
    pass's trials over the returned layout (:func:`idle_pool_notes` reuses them). The search's
    large-instance heuristics (the fixed stage order, the stage-count window) can leave such a
    layout out; this check runs once after the search (``planner.plan_job``, first plans only:
    a re-plan keeps its structure) and keeps the faster plan instead of only naming it."""
    if spec.parallelism.pp is not None:  # pinned: every addition is more stages
        return chosen, [], {}
    units = build_units(filter_pools(inventory, spec.placement),
                        merged=chosen.grouping == "merged")
    notes: list[str] = []
    while True:
        used = {u.key for u in chosen.units}
        best: tuple[planner.Candidate, Unit] | None = None
        trials: dict[str, Trial] = {}
        for unit in units:
            if unit.key in used:
                continue
            trials[unit.key] = _trial(unit, chosen, spec, inventory)
            cand = trials[unit.key][1]
            if (cand is not None and cand.step_time_s < chosen.step_time_s * (1 - 1e-9)
                    and (best is None or cand.sort_key() < best[0].sort_key())):
                best = (cand, unit)
        if best is None:
            return chosen, notes, trials
        cand, unit = best
        ks = sum(1 for u in cand.units if u.key == unit.key)
        tp = next(t for u, t in zip(cand.units, cand.tps, strict=True) if u.key == unit.key)
        notes.append(f"device group {unit.key} added after the search (+{ks} stage"
                     f"{'s' if ks > 1 else ''} at tp={tp}): {chosen.step_time_s:.3f}s -> "
                     f"{cand.step_time_s:.3f}s per step; "
                     f"{_missed_by(cand, units, spec).replace('skip it', 'skip that layout')}")
        chosen = cand


def _reason(unit: Unit, units: Sequence[Unit], chosen: planner.Candidate, spec: JobSpec,
            inventory: ClusterInventory, replan: bool, trial: Trial | None = None) -> str:
    """Why a pool of device group ``unit`` (one of ``units``) has no rank in ``chosen``."""
    if unit.key in {u.key for u in chosen.units}:
        need = chosen.dp * sum(tp for u, tp in zip(chosen.units, chosen.tps, strict=True)
                               if u.key == unit.key)
        return (f"its device group {unit.key} is used, but the plan's stages need {need} of "
                f"its {unit.gpus} GPUs")
    tps = planner._tp_options(unit, spec)
    least = _least_stage_bytes(unit, spec, tps)
    usable = unit.device.hbm_bytes * cost.MEMORY_HEADROOM
    if least > usable:
        return (f"the model does not fit: a one-layer stage needs >= {least / cost.GIB:.1f} GiB "
                f"per {unit.device.name} at every TP ({'/'.join(map(str, tps))}), "
                f"{usable / cost.GIB:.1f} GiB usable")
    dp = chosen.dp
    if spec.parallelism.pp is not None:
        return (f"spec.parallelism.pp={spec.parallelism.pp} pins the stage count; its GPUs "
                "would add stages")
    if all(unit.tp_groups(tp) < dp for tp in tps):
        gpus = f"{unit.gpus} GPU{'s' if unit.gpus > 1 else ''}"
        return (f"its {gpus} cannot host a stage of the chosen {planner._dp_words(spec, dp)} "
                "replicas (a stage's replicas share one device group)")
    if all(unit.stage_slots(tp, dp, planner._cp(spec)) < 1 for tp in tps):
        return (f"it spans {len(unit.datacenters)} datacenters; a stage's "
                f"{planner._dp_words(spec, dp)} replicas split equally over them do not fit "
                "its nodes in each (as the DP sync across them is priced)")
    search, best, tried = trial or _trial(unit, chosen, spec, inventory)
    if best is not None:
        return _compare(best, tried, unit, chosen, inventory, replan, units, spec)
    if search.memory_shortfall is not None:
        return f"does not fit: {search.memory_shortfall[1]}"
    if search.over_max_gpus:
        return (f"spec.placement.maxGPUs={spec.placement.max_gpus}: the plan uses "
                f"{dp * sum(chosen.tps)} GPUs, a stage on it adds >= {dp * min(tps)}")
    return f"no layout with it runs ({tried} tried: no schedule fits)"


def _trial(unit: Unit, chosen: planner.Candidate, spec: JobSpec, inventory: ClusterInventory
           ) -> Trial:
    """:func:`_try_additions` of ``unit`` into ``chosen`` on a fresh search, with that
    search."""
    search = planner._Search(spec, exhaustive=False)
    best, tried = _try_additions(search, unit, chosen, inventory)
    return search, best, tried


def _least_stage_bytes(unit: Unit, spec: JobSpec, tps: Sequence[int]) -> float:
    """The least per-device bytes of any stage on ``unit`` (inf without a TP option): one
    layer, one microbatch of one sequence in flight, no embedding or head, ZeRO-1 over every
    replica the unit can host (``cost.stage_memory`` only grows with each of those)."""
    cp = planner._cp(spec)
    least = math.inf
    for tp in tps:
        replicas = max(1, unit.tp_groups(tp) // cp)
        mem = cost.stage_memory(spec.model, spec.training, tp=tp, dp=replicas, cp=cp,
                                micro_batch=1, in_flight=1, first=False, last=False,
                                cp_masks=not cost.skips_masked_tiles(unit.device))
        least = min(least, mem.bytes_for(1))
    return least


def _try_additions(search: planner._Search, unit: Unit, chosen: planner.Candidate,
                   inventory: ClusterInventory) -> tuple[planner.Candidate | None, int]:
    """The fastest of the chosen layout with ``unit`` inserted as ``k`` more stages (module
    docstring) and how many layouts were tried. The fastest so far is the search's incumbent,
    so ``planner._evaluate``'s bounds skip what cannot beat it (exact)."""
    spec = search.spec
    blocks = _block_starts(chosen.units)
    schedules = [(chosen.schedule, chosen.chunks)]
    if chosen.schedule != "1f1b" and spec.parallelism.schedule == "auto":
        schedules.append(("1f1b", 1))  # holds less memory than ZB-H1 and interleaved
    for tp in planner._tp_options(unit, spec):
        most = planner._max_stages(unit, tp, chosen.dp, spec)
        if most < planner._stage_room(unit, tp, chosen.dp, spec):
            search.over_max_gpus += 1  # maxGPUs removed some stage counts
        for k in sorted({*range(1, min(most, MAX_TRIED_STAGES) + 1), most} - {0}):
            for at in blocks:
                units = (*chosen.units[:at], *[unit] * k, *chosen.units[at:])
                tps = (*chosen.tps[:at], *[tp] * k, *chosen.tps[at:])
                for schedule, v in schedules:
                    planner._evaluate(search, units, tps, chosen.dp, chosen.micro_batch,
                                      schedule, inventory, chosen.grouping, v)
    return search.best, search.evaluated


def _block_starts(units: Sequence[Unit]) -> list[int]:
    """Stage indices where a run of one device group starts, and the end: where a new
    group's stages can be inserted without splitting a run."""
    return [i for i in range(len(units) + 1)
            if i in (0, len(units)) or units[i].key != units[i - 1].key]


def _compare(best: planner.Candidate, tried: int, unit: Unit, chosen: planner.Candidate,
             inventory: ClusterInventory, replan: bool, units: Sequence[Unit],
             spec: JobSpec) -> str:
    """The note for a pool some layout could use: slower (and, where the slowest pipeline
    step is its link, that link) or faster (and why the plan does not take it)."""
    ks = sum(1 for u in best.units if u.key == unit.key)
    tp = next(t for u, t in zip(best.units, best.tps, strict=True) if u.key == unit.key)
    times = f"{best.step_time_s:.3f}s vs {chosen.step_time_s:.3f}s per step"
    stages = f"+{ks} stage{'s' if ks > 1 else ''} at tp={tp}"
    if best.step_time_s < chosen.step_time_s:
        why = "the re-plan keeps its structure" if replan else _missed_by(best, units, spec)
        return f"faster with it: {times} ({stages}); {why}"
    link = _slow_link(best, unit, inventory)
    if link:
        return f"{link}: {times} with it ({tried} layouts tried)"
    return f"slower with it: {times} (best of {tried} layouts tried, {stages})"


def _missed_by(c: planner.Candidate, units: Sequence[Unit], spec: JobSpec) -> str:
    """Which of the search's large-instance heuristics (``planner`` module docstring) leave
    out layout ``c``: the fixed stage order past ``MAX_PERMUTED_UNITS`` device groups, the
    stage-count window; or, if neither, that the search did not reach it."""
    keys = list(dict.fromkeys(u.key for u in c.units))
    index = {u.key: i for i, u in enumerate(units)}
    used = [index[k] for k in keys]
    out = []
    if (len(used) > planner.MAX_PERMUTED_UNITS
            and list(planner._fixed_order(units, used)) != used):
        out.append("fixed stage order")
    if planner._windowed(units, spec, [planner._tp_options(u, spec) for u in units]):
        for k in keys:
            unit = units[index[k]]
            tp = next(t for u, t in zip(c.units, c.tps, strict=True) if u.key == k)
            most = planner._max_stages(unit, tp, c.dp, spec)
            if sum(1 for u in c.units if u.key == k) not in planner._k_options(most, False):
                out.append("stage-count window")
                break
    if not out:
        return "the search did not reach it"
    return "the search's large-instance heuristics skip it (" + ", ".join(out) + ")"


def _slow_link(c: planner.Candidate, unit: Unit, inventory: ClusterInventory) -> str:
    """``its ... link ... is the slowest step (...)`` when the slowest step of ``c``'s
    pipeline is a transfer between ``unit``'s stages and another datacenter's, else empty."""
    slowest = max(c.stage_s)
    for (i, j), b in zip(planner.hop_pairs(c.pp, c.chunks), c.boundary_s, strict=True):
        a, z = c.units[i], c.units[j]
        if unit.key not in (a.key, z.key) or set(a.datacenters) & set(z.datacenters):
            continue
        if b >= slowest:
            link = inventory.slowest_link(a.datacenters, z.datacenters)
            return (f"its {link.bandwidth_gbps:g} Gb/s link {link.a}-{link.b} is the "
                    f"slowest step ({b * 1e3:.1f} vs "
                    f"{slowest * 1e3:.1f} ms)")
    return ""
