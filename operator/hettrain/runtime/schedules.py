"""Pipeline schedules as pure per-stage action lists (no torch): which of ``F`` (forward),
``B`` (backward) and ``W`` (weight-gradient pass) a stage runs for which microbatch, in order.

* ``gpipe``: every forward, then every backward.
* ``1f1b``: ``pp - stage - 1`` warm-up forwards, then alternating F/B, then the cool-down B's.
* ``zb-h1`` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24): the backward is split
  into ``B`` (gradient w.r.t. the stage input -- on the critical path, sent upstream at once)
  and ``W`` (gradients w.r.t. the linear weights -- off the critical path). Same warm-up as
  1F1B; in steady state stage ``s`` runs its ``W`` ``s`` microbatches late, so the later
  stages -- which in 1F1B finish early and idle in the tail -- fill that tail with pending
  W's (a stage runs W's in its cool-down between B's, and flushes the rest at the end).
  Stage ``s`` then holds at most ``pp - s`` full activation sets (F done, B not: the 1F1B
  bound) and at most ``min(pp, m)`` microbatches whose weight gradient is pending (F done, W
  not), which is stage 0's 1F1B peak: the pipeline's peak activation memory is 1F1B's.
* ``interleaved`` (Megatron-LM virtual pipeline, Narayanan et al. SC'21): each stage holds ``v``
  model chunks; forwards visit ``(microbatch, chunk)`` in groups of ``pp`` microbatches through
  chunk 0, 1, ..., v-1 (backwards through the chunks in reverse), warm-up is
  ``(pp - stage - 1) * 2 + (v - 1) * pp`` chunk-forwards, then one F / one B, then the
  cool-down B's. :func:`chunk_actions` gives ``(kind, microbatch, chunk)`` actions; the order
  equals :func:`hettrain.render.schedule.interleaved_order` (the plan figure's; tested).

For ``1f1b``/``gpipe`` every ``B`` is immediately followed by its ``W``; the runtime runs that
pair as one ordinary backward. :func:`simulate` replays action lists with per-action costs
(dependencies: F_s(m) after F_{s-1}(m); B_s(m) after B_{s+1}(m) and F_s(m); W_s(m) after
B_s(m)) and returns the step's makespan, which is how the tests check that ZB-H1 fills the
1F1B bubble.
"""

from __future__ import annotations

from collections.abc import Sequence

from hettrain.planning.interleaved_zb import interleaved_zb_actions, makespan

SCHEDULES = ("1f1b", "gpipe", "zb-h1")  # one model chunk per stage
# several model chunks (virtual stages) per stage; interleaved-zb's order comes from the
# planning side's list scheduler (hettrain.planning.interleaved_zb, pure Python)
CHUNKED_SCHEDULES = ("interleaved", "interleaved-zb")
# one layer per chunk, each layer in three parts, attention cores on idle stages: its own
# executor (runtime/helix.py) with the order of hettrain.planning.helix
PART_SCHEDULES = ("helix",)
RUNTIME_SCHEDULES = SCHEDULES + CHUNKED_SCHEDULES + PART_SCHEDULES

Action = tuple[str, int]  # ("F" | "B" | "W", microbatch)
ChunkAction = tuple[str, int, int]  # ("F" | "B" | "W", microbatch, chunk)


def _check(schedule: str, stage: int, pp: int, m: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if pp < 1 or not 0 <= stage < pp:
        raise ValueError(f"stage={stage} must lie in [0, pp={pp})")
    if m < 1:
        raise ValueError(f"num_microbatches={m}: must be >= 1")


def warmup_count(schedule: str, stage: int, pp: int, num_microbatches: int,
                 link_warmup: int = 0) -> int:
    """Forwards a stage runs before its first backward: ``pp − stage − 1`` plus
    ``link_warmup``, the plan's extra forwards over a datacenter link's latency
    (``plan.stages[stage].link_warmup``, :func:`hettrain.planning.cost.link_warmups`), at
    most every microbatch."""
    _check(schedule, stage, pp, num_microbatches)
    if link_warmup < 0:
        raise ValueError(f"plan.stages[{stage}].link_warmup={link_warmup}: must be >= 0")
    if schedule == "gpipe":
        return num_microbatches
    return min(pp - stage - 1 + link_warmup, num_microbatches)


def stage_actions(schedule: str, stage: int, pp: int, m: int,
                  link_warmup: int = 0) -> list[Action]:
    """The ordered ``(kind, microbatch)`` actions of ``stage`` for one step of ``m`` microbatches
    (``link_warmup``: extra warm-up forwards, :func:`warmup_count`).

    Every microbatch gets exactly one F, one B and one W, and B's run in microbatch order.
    """
    warm = warmup_count(schedule, stage, pp, m, link_warmup)
    delay = stage if schedule == "zb-h1" else 0
    out: list[Action] = [("F", i) for i in range(warm)]
    pending: list[int] = []  # microbatches whose B ran and W did not

    def backward(i: int, keep: int) -> None:
        out.append(("B", i))
        pending.append(i)
        while len(pending) > keep:
            out.append(("W", pending.pop(0)))

    for k in range(m - warm):  # steady state: one F, one B, W's ``delay`` microbatches late
        out.append(("F", warm + k))
        backward(k, delay)
    for k in range(m - warm, m):  # cool-down: a pending W after each B fills the wait
        backward(k, delay)
    out += [("W", i) for i in pending]
    return out


def schedule_order(schedule: str, stage: int, pp: int, m: int) -> list[tuple[str, int]]:
    """``("F"|"B", microbatch)`` order of a stage with each B+W pair as one backward ``B``
    (the 1F1B / GPipe view; for ``zb-h1`` use :func:`stage_actions`)."""
    return [a for a in stage_actions(schedule, stage, pp, m) if a[0] != "W"]


def simulate(actions: Sequence[Sequence[Action]], cost: dict[str, float]) -> float:
    """Makespan of per-stage action lists, each action taking ``cost[kind]`` and starting when
    its stage is free and its cross-stage dependencies are done (one chunk per stage:
    :func:`hettrain.planning.interleaved_zb.makespan`). Raises on a deadlock."""
    return makespan([[(kind, i, 0) for kind, i in a] for a in actions], 1, [cost] * len(actions))


def _virtual_sequence(pp: int, m: int, v: int, backward: bool) -> list[tuple[int, int]]:
    """``(microbatch, chunk)`` visits: groups of ``pp`` microbatches go through every chunk
    (in reverse for backward) before the next group starts."""
    seq: list[tuple[int, int]] = []
    for group in range(0, m, pp):
        for k in range(v):
            c = v - 1 - k if backward else k
            seq.extend((i, c) for i in range(group, min(group + pp, m)))
    return seq


def interleaved_actions(stage: int, pp: int, m: int, v: int) -> list[ChunkAction]:
    """Megatron's interleaved-1F1B ``(kind, microbatch, chunk)`` order of ``stage`` (each B is a
    full backward). Raises ``ValueError`` naming the bad value; ``m`` must be a multiple of
    ``pp`` (the plan's ``num_microbatches``)."""
    if pp < 1 or not 0 <= stage < pp:
        raise ValueError(f"stage={stage} must lie in [0, pp={pp})")
    if v < 1:
        raise ValueError(f"plan.virtual_stages={v}: must be >= 1")
    if m < 1 or m % pp:
        raise ValueError(f"plan.num_microbatches={m}: the interleaved schedule needs a "
                         f"positive multiple of pp={pp}")
    fwd = _virtual_sequence(pp, m, v, backward=False)
    bwd = _virtual_sequence(pp, m, v, backward=True)
    total = len(fwd)
    warm = min((pp - stage - 1) * 2 + (v - 1) * pp, total)
    out: list[ChunkAction] = [("F", i, c) for i, c in fwd[:warm]]
    for k in range(total - warm):
        out.append(("F", *fwd[warm + k]))
        out.append(("B", *bwd[k]))
    out += [("B", i, c) for i, c in bwd[total - warm:]]
    return out


def chunk_actions(schedule: str, stage: int, pp: int, m: int, v: int = 1,
                  link_warmup: int = 0) -> list[ChunkAction]:
    """The ordered ``(kind, microbatch, chunk)`` actions of ``stage`` for any runtime schedule
    (chunk 0 throughout unless ``interleaved`` or ``interleaved-zb``; ``link_warmup``: the
    stage's extra warm-up forwards, 1F1B and ZB-H1 only)."""
    if link_warmup and schedule not in SCHEDULES:
        raise ValueError(f"plan.stages[{stage}].link_warmup={link_warmup}: only the "
                         f"{SCHEDULES} schedules run extra warm-up forwards "
                         f"(plan.schedule={schedule!r}); set it to 0")
    if schedule == "interleaved":
        return interleaved_actions(stage, pp, m, v)
    if schedule == "interleaved-zb":
        return interleaved_zb_actions(stage, pp, m, v)
    if v != 1:
        raise ValueError(f"plan.virtual_stages={v}: only the interleaved schedules have "
                         f"virtual stages (plan.schedule={schedule!r}); set it to 1")
    return [(kind, i, 0) for kind, i in stage_actions(schedule, stage, pp, m, link_warmup)]
