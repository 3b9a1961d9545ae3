"""What the runtime can honour: plan options it refuses, checked on both sides (pure).

The runtime calls :func:`unsupported` at start-up (``runtime.trainer.Trainer``) and exits with
the first error; ``hettrain plan`` / ``hettrain validate --cluster`` refuse the same plans, so
a plan the runtime would reject never reaches a cluster. Each error names the plan field and the
spec field that sets it.
"""

from __future__ import annotations

from hettrain.api.spec import LR_SCHEDULES, PRECISIONS, SHARDINGS, TrainingSpec, splits_backward
from hettrain.planning.cost import HIDES_LINK_LATENCY, reruns_layer, sharded_grads
from hettrain.planning.layers import chunk_layer_ranges
from hettrain.planning.plan import Plan, StagePlan


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
    if t.attention != "flash":
        out.append(f"plan.training.attention={t.attention!r}: the runtime's attention is "
                   "fused (torch SDPA, flash); eager attention is only priced, for published "
                   "runs that used it; set spec.training.attention: flash (or omit it)")
    if not isinstance(t.loss_chunk_tokens, int) or t.loss_chunk_tokens < 0:
        out.append(f"plan.training.loss_chunk_tokens={t.loss_chunk_tokens!r}: must be a whole "
                   "number >= 0 (0: the loss over the whole microbatch); the planner sets it, "
                   "so re-plan the job rather than editing the plan")
    out += mlp_chunk_errors(plan)
    mode = (plan.cross_dc or {}).get("mode", "sync")
    if t.sharding not in SHARDINGS:
        out.append(f"plan.training.sharding={t.sharding!r}: the runtime shards "
                   f"{', '.join(SHARDINGS)}; set spec.training.sharding to one of them (the "
                   "planner resolves auto)")
    if t.optimizer_sharding and mode == "diloco" and plan.dp > 1:
        out.append(f"plan.training.optimizer_sharding=true (sharding={t.sharding}) with "
                   "plan.cross_dc.mode=diloco: "
                   "ZeRO cannot combine with DiLoCo (each datacenter's replicas drift apart "
                   "between outer steps); set spec.training.sharding: none (or "
                   "optimizerSharding: false)")
    out += sharding_errors(plan)
    if not plan.data:
        out.append("plan.data is empty (a spec without spec.data): the runtime trains only on "
                   "named data; set spec.data.uri, spec.data.pvc + path, or "
                   "spec.data.synthetic: true")
    out += context_parallel_errors(plan)
    out += replica_group_errors(plan)
    out += helix_errors(plan)
    out += uneven_dp_errors(plan)
    out += link_warmup_errors(plan)
    return out


def link_warmup_errors(plan: Plan) -> list[str]:
    """``stages[].link_warmup`` (docs/planning.md §Link warm-up): whole numbers >= 0, only
    on the schedules whose order runs them (1F1B, ZB-H1: ``cost.HIDES_LINK_LATENCY``)."""
    stages = list(plan.stages) + [s for g in plan.groups for s in g.stages]
    out = []
    for st in stages:
        w = st.link_warmup
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            out.append(f"plan.stages[{st.index}].link_warmup={w!r}: must be a whole number "
                       ">= 0 (extra warm-up forwards); the planner sets it, so re-plan the job "
                       "rather than editing the plan")
        elif w and plan.schedule not in HIDES_LINK_LATENCY:
            out.append(f"plan.stages[{st.index}].link_warmup={w} with plan.schedule="
                       f"{plan.schedule}: only {', '.join(HIDES_LINK_LATENCY)} run extra "
                       "warm-up; re-plan the job (the planner sets it)")
    return out


def mlp_chunk_errors(plan: Plan) -> list[str]:
    """The chunked MLP (``plan.training.mlp_chunk_tokens``, ``runtime.model._ChunkedMLP``):
    a whole number of tokens; only with a layer re-run in the backward, whose re-run it skips
    (the cost model prices it so), and never beside a deferred W pass (its weight gradients
    are made in the backward)."""
    t = plan.training
    chunk = t.mlp_chunk_tokens
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
        return [f"plan.training.mlp_chunk_tokens={chunk!r}: must be a whole number >= 0 (0: "
                "the MLP over the whole microbatch); the planner sets it, so re-plan the job "
                "rather than editing the plan"]
    if not chunk:
        return []
    out = []
    if not reruns_layer(t.recompute):
        out.append(f"plan.training.mlp_chunk_tokens={chunk} with plan.training.recompute="
                   f"{t.recompute}: the chunked MLP runs with full or attention-free recompute "
                   "only; re-plan the job (the planner sets it)")
    if splits_backward(plan.schedule):
        out.append(f"plan.training.mlp_chunk_tokens={chunk} with plan.schedule="
                   f"{plan.schedule}: the chunked MLP has no deferred weight-gradient pass; "
                   "re-plan the job (the planner sets it) or set spec.parallelism.schedule to "
                   "1f1b, interleaved or helix")
    return out


UNEVEN_DP_SCHEDULES = ("1f1b", "zb-h1")  # whose order suits any microbatch count


def uneven_dp_errors(plan: Plan) -> list[str]:
    """Why the runtime cannot run this plan's uneven data parallelism (``short_replicas``:
    the last replicas run one microbatch fewer; empty: it can, or the plan is even): fewer
    short replicas than ``dp``, at least one microbatch on each, no replica groups, and
    :func:`uneven_dp_limits`."""
    r = plan.short_replicas
    if r == 0:
        return []
    out = []
    if not 0 < r < plan.dp:
        out.append(f"plan.short_replicas={r}: must be in [0, dp={plan.dp}) (the replicas that "
                   "run one microbatch fewer)")
    if plan.num_microbatches < 2:
        out.append(f"plan.short_replicas={r} with num_microbatches={plan.num_microbatches}: "
                   "a short replica would run no microbatch")
    if plan.groups:
        out.append(f"plan.short_replicas={r} with replica groups: set each group's "
                   "plan.groups[].short_replicas instead")
    return out + uneven_dp_limits(r, plan.schedule, plan.training,
                                  (plan.cross_dc or {}).get("mode", "sync"))


def uneven_dp_limits(short: int, schedule: str, training: TrainingSpec,
                     cross_dc_mode: str) -> list[str]:
    """Why ``short`` uneven replicas cannot run with these options (empty: they can; the
    planner searches uneven degrees only there): a schedule of :data:`UNEVEN_DP_SCHEDULES`,
    not ZeRO-2/3 (they reduce, and ZeRO-3 gathers, per unit and microbatch: a short replica
    would issue fewer collectives than its DP peers and the step would hang) and not DiLoCo
    (its DP average is per datacenter, the runtime's weights are the job's)."""
    out = []
    if schedule not in UNEVEN_DP_SCHEDULES:
        out.append(f"plan.short_replicas={short} with schedule {schedule}: uneven replicas "
                   f"run {' or '.join(UNEVEN_DP_SCHEDULES)}")
    if sharded_grads(training):
        out.append(f"plan.short_replicas={short} with plan.training.sharding="
                   f"{training.sharding}: ZeRO-2/3 reduce per microbatch, so every "
                   "replica must run as many; use spec.training.sharding optimizer or none, "
                   "or a global batch dp divides")
    if cross_dc_mode == "diloco":
        out.append(f"plan.short_replicas={short} with plan.cross_dc.mode=diloco: each "
                   "datacenter averages its own replicas; use a global batch dp divides")
    return out


def helix_errors(plan: Plan) -> list[str]:
    """Why the runtime cannot run this plan's helix schedule (empty: it can, or another
    schedule): ``pp ≥ 2``, one layer per model chunk (``layers`` a multiple of ``pp``,
    ``layers / pp`` on every stage, ``virtual_stages = layers / pp``), stages without TP or
    CP, no replica groups (``runtime/helix.py``; ZeRO-2/3: :func:`sharding_errors`); its
    first-in-last-out order (``plan.helix_filo``) on no other schedule."""
    if plan.schedule != "helix":
        if plan.helix_filo:
            return [f"plan.helix_filo=true with plan.schedule={plan.schedule}: only the helix "
                    "schedule has that order; set it false or plan with schedule: helix"]
        return []
    out = []
    layers, pp = plan.model.layers, plan.pp
    if pp < 2:
        out.append("plan.schedule=helix with plan.pp=1: it pipelines layers over stages; set "
                   "spec.parallelism.pp >= 2 or another schedule")
        return out
    per = layers // pp
    if layers % pp or any(s.layer_end - s.layer_start != per for s in plan.stages) \
            or plan.virtual_stages != per:
        out.append(f"plan.schedule=helix needs model.layers ({layers}) a multiple of plan.pp "
                   f"({pp}), that many layers on every stage and plan.virtual_stages = "
                   f"{per}; plan it with spec.parallelism.schedule: helix")
    if any(s.tp != 1 or s.cp != 1 for s in plan.stages):
        out.append("plan.schedule=helix with plan.stages[*].tp or cp > 1: its stages run "
                   "without tensor or context parallelism; set spec.parallelism.tp/cp to 1")
    if plan.groups:
        out.append("plan.schedule=helix with plan.groups: set spec.parallelism.replicaGroups: "
                   "false")
    return out


def sharding_errors(plan: Plan) -> list[str]:
    """Why the runtime cannot run this plan's ZeRO-2/3 (``training.sharding`` gradients or
    full; empty: it can, or another sharding): not with the ZB-H1 schedule (its deferred
    weight gradients) or helix (its layer parts bypass the unit hooks), not with replica
    groups (they sum whole gradients after the backward), and full not with tied embeddings
    (one parameter in two units)."""
    s = plan.training.sharding
    if s not in ("gradients", "full"):
        return []
    out = []
    if splits_backward(plan.schedule):
        out.append(f"plan.training.sharding={s} with plan.schedule={plan.schedule}: ZeRO-2/3 "
                   "sync each unit's gradients after its backward, which the schedule splits; set "
                   "spec.training.sharding: optimizer or spec.parallelism.schedule: 1f1b")
    if plan.schedule == "helix":
        out.append(f"plan.training.sharding={s} with plan.schedule=helix: its layer parts run "
                   "outside the layer's forward, where ZeRO-2/3 hook each unit; set "
                   "spec.training.sharding: optimizer")
    if plan.groups:
        out.append(f"plan.training.sharding={s} with plan.groups: replica groups sum whole "
                   "gradients after the backward; set spec.training.sharding: optimizer or "
                   "spec.parallelism.replicaGroups: false")
    if s == "full" and plan.model.tie_embeddings:
        out.append("plan.training.sharding=full with plan.model.tie_embeddings: FSDP shards the "
                   "shared embedding/output parameter in two units; set spec.training.sharding: "
                   "gradients or spec.model.tieEmbeddings: false")
    return out


def context_parallel_degree(plan: Plan) -> int:
    """The plan's context-parallel degree (``stages[i].cp``, equal on every stage; 1: none;
    with replica groups: group 0's)."""
    return group_cp(plan.stages)


def context_parallel_errors(plan: Plan) -> list[str]:
    """Why the runtime cannot run this plan's context parallelism (empty: it can, or cp = 1).

    The planner writes ``cp`` from ``spec.parallelism.cp`` (pinned or searched); any plan
    with ``cp > 1`` is checked here: one degree on every stage (pipeline peers pair by CP
    index), ``seq_len`` a multiple of ``2·cp`` (the load-balanced chunks), and every
    ``(stage, dp, tp, cp)`` coordinate present exactly once. Replica groups (``plan.groups``)
    are checked one by one (:meth:`Plan.group_plan`): each runs its own world, so each group
    has its own degree (``runtime/replica_sync.py`` weights its CP ranks by it)."""
    if plan.groups:
        return [f"plan.groups[{i}]: {e}" for i in range(len(plan.groups))
                for e in _cp_errors(plan.group_plan(i))]
    return _cp_errors(plan)


def group_cp(stages: tuple[StagePlan, ...]) -> int:
    """The context-parallel degree of a pipeline's ``stages`` (1: none)."""
    return max((s.cp for s in stages), default=1)


def _cp_errors(plan: Plan) -> list[str]:
    """:func:`context_parallel_errors` of a plan without replica groups."""
    cps = {s.cp for s in plan.stages}
    if cps == {1}:
        if any(r.cp for r in plan.ranks):
            return ["plan.ranks[].cp: set on a plan whose stages all have cp=1; remove it"]
        return []
    n = max(cps)
    if len(cps) > 1 or n < 1:
        return [f"plan.stages[].cp={sorted(cps)}: every stage needs the same context-parallel "
                "degree >= 1 (pipeline peers pair by CP index)"]
    if plan.model.seq_len % (2 * n):
        return [f"plan.stages[].cp={n}: plan.model.seq_len={plan.model.seq_len} must be a "
                f"multiple of 2·cp={2 * n} (two load-balanced chunks per CP rank)"]
    want = {(s.index, d, t, c) for s in plan.stages for d in range(plan.dp)
            for t in range(s.tp) for c in range(n)}
    have = [(r.stage, r.dp, r.tp, r.cp) for r in plan.ranks]
    if len(set(have)) != len(have) or set(have) != want:
        return [f"plan.ranks: with cp={n} every (stage, dp, tp, cp) coordinate must appear "
                "exactly once (cp in 0..cp-1)"]
    return []


def replica_group_errors(plan: Plan) -> list[str]:
    """Why the runtime cannot run this plan's replica groups (empty: it can, or no groups).

    Every group is a complete pipeline (stages ``0..pp-1`` covering layers ``[0, layers)``
    once each, in order), its ranks hold every ``(stage, dp, tp)`` coordinate exactly once,
    a node hosts ranks of one group only, the groups' batch shares sum to
    ``training.global_batch`` and the top-level ``dp/pp/num_microbatches/stages`` repeat
    group 0 (a group's short replicas, ``short_replicas``, are checked as a plain plan's:
    :func:`uneven_dp_errors` of its :meth:`Plan.group_plan`). A layer may have different TP
    degrees in different groups: the runtime sums each piece of a parameter between the
    ranks that hold it (``runtime/replica_sync.py``), and
    each group its own context-parallel degree (:func:`context_parallel_errors` checks it).
    Model, precision and optimizer are the plan's, shared by every group by construction."""
    if not plan.groups:
        if any(r.group for r in plan.ranks):
            return ["plan.ranks[].group: set on a plan without plan.groups; remove it"]
        return []
    out: list[str] = []
    n = plan.model.layers
    for i, g in enumerate(plan.groups):
        where = f"plan.groups[{i}]"
        if g.index != i:
            out.append(f"{where}.index={g.index}: groups must be numbered 0..{len(plan.groups) - 1}"
                       " in order")
        if g.dp < 1 or g.num_microbatches < 1:
            out.append(f"{where}: dp={g.dp} and num_microbatches={g.num_microbatches} must be "
                       ">= 1")
        elif g.short_replicas:
            out += [f"{where}: {e}" for e in uneven_dp_errors(plan.group_plan(i))]
        if len(g.stages) != g.pp or [s.index for s in g.stages] != list(range(g.pp)):
            out.append(f"{where}.stages: need stages 0..pp-1 (pp={g.pp}) in order")
            continue
        bounds = [(s.layer_start, s.layer_end) for s in g.stages]
        chain = all(a < b for a, b in bounds) and all(
            bounds[k][1] == bounds[k + 1][0] for k in range(len(bounds) - 1))
        if not (chain and bounds[0][0] == 0 and bounds[-1][1] == n):
            out.append(f"{where}.stages: layer ranges {bounds} must cover every layer [0, {n}) "
                       "exactly once, in stage order")
        cp = group_cp(g.stages)
        want = {(s.index, d, t, c) for s in g.stages for d in range(g.dp) for t in range(s.tp)
                for c in range(cp)}
        have = [(r.stage, r.dp, r.tp, r.cp) for r in plan.group_ranks(i)]
        if len(set(have)) != len(have) or set(have) != want:
            out.append(f"plan.ranks: group {i} must hold every (stage, dp, tp, cp) coordinate "
                       f"of {where} exactly once")
    if out:
        return out
    if any(not 0 <= r.group < len(plan.groups) for r in plan.ranks):
        out.append(f"plan.ranks[].group: must lie in 0..{len(plan.groups) - 1}")
    node_groups: dict[str, set[int]] = {}
    for r in plan.ranks:
        node_groups.setdefault(r.node, set()).add(r.group)
    mixed = sorted(node for node, gs in node_groups.items() if len(gs) > 1)
    if mixed:
        out.append(f"plan.ranks: node {mixed[0]!r} hosts ranks of several replica groups; "
                   "a node belongs to one group")
    if plan.global_batch != plan.training.global_batch:
        shares = [g.microbatches * plan.micro_batch for g in plan.groups]
        out.append(f"plan.groups: batch shares {shares} (dp * num_microbatches * micro_batch) "
                   f"sum to {plan.global_batch}, not plan.training.global_batch="
                   f"{plan.training.global_batch}")
    g0 = plan.groups[0]
    if (plan.dp, plan.pp, plan.num_microbatches, plan.stages) != (
            g0.dp, g0.pp, g0.num_microbatches, g0.stages):
        out.append("plan.dp/pp/num_microbatches/stages must repeat plan.groups[0]'s")
    mode = (plan.cross_dc or {}).get("mode", "sync")
    if mode != "sync":
        out.append(f"plan.cross_dc.mode={mode!r} with plan.groups: replica groups sync "
                   "gradients every step; set spec.training.crossDC.mode: sync")
    return out


def group_stage_units(plan: Plan) -> dict[tuple[int, int], list[str]]:
    """``{(group, stage): units}``: the parameter units each stage of each replica group
    holds -- ``"embedding"`` (stage 0), ``"layer i"`` (its chunks' layers), ``"head"`` (the
    final norm and output layer, last stage). The runtime syncs gradients between the holders
    of each unit (runtime/replica_sync.py)."""
    out: dict[tuple[int, int], list[str]] = {}
    for g in plan.groups:
        chunks = chunk_layer_ranges(plan.group_plan(g.index))
        for s in g.stages:
            units = ["embedding"] * (s.index == 0)
            units += [f"layer {i}" for a, b in chunks[s.index] for i in range(a, b)]
            units += ["head"] * (s.index == g.pp - 1)
            out[(g.index, s.index)] = units
    return out

