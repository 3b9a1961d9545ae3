"""The heterogeneous planner: CP×DP×PP×TP, stage order over pools, non-uniform layers,
microbatches.

Search space (docs/planning.md): data-parallel degree ``dp`` (a divisor of the global batch), per
unit a tensor-parallel degree (a power of two within a node) and a number of stages ``k_u``, an
order of the used units along the pipeline, microbatch size, and schedule. Each candidate's layer
split is solved exactly (:mod:`hettrain.planning.layers`).

Fast mode (:func:`_search_fast`) is branch and bound. Units are device types (device × GPUs per
node × DC), never single nodes. ``(dp, mb)`` pairs are visited in ascending order of a root
bound; each pair first evaluates a few greedy layouts (:func:`_seed_incumbent`), then a
depth-first walk over units chooses "unused" or one ``(tp, k)`` per unit, pruned by
:func:`bounds.partial_lower_bound` and ``spec.placement.maxGPUs``; complete choices get the
tighter :func:`bounds.step_lower_bound` (whole layers, coupled bottleneck and bubble, DP
balance, boundary transfers, in-flight memory) and are evaluated best-bound first until the
bound reaches the incumbent, each stage order only if its stages can hold the layers
(:func:`_memory_fits`). Under ``schedule: auto`` with ``pp ≥ 2`` ZB-H1 is evaluated, and 1F1B
and interleaved only where their memory caps exceed ZB-H1's (elsewhere ZB-H1 dominates them;
:func:`_evaluate_order`). All of that is exact. Two heuristics apply only to large
instances: when the per-unit ``(tp, k)`` combinations exceed ``EXACT_LEAF_BUDGET`` the stage
counts are limited to full use (``K_FULL_WINDOW``, plus every count where layers per stage
step for single-unit layouts), and with more than ``MAX_PERMUTED_UNITS`` used units the stage
order is fixed (datacenter by datacenter, fastest devices first). ``exhaustive=True``
enumerates everything and brute-forces the layer splits: the reference the tests compare with.
Context parallelism: each degree of :func:`_cp_options` is searched in turn with one incumbent
(``_Search.use_cp``), ``dp`` then counting the DP×CP group (see "stage costs" below).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, replace

from hettrain.api.constants import REASON_PLAN_FAILED
from hettrain.api.limits import SPEC_MAXIMUMS
from hettrain.api.spec import (
    JobSpec,
    ModelSpec,
    chunked_schedule,
    recompute_options,
    sharding_options,
    splits_backward,
)
from hettrain.planning import context, cost, helix, interleaved_zb
from hettrain.planning.arith import divisors_up_to, uneven_dp_values
from hettrain.planning.bounds import (
    Choice,
    LeafBound,
    PartialSums,
    UnitStats,
    boundary_lower_bounds,
    order_caps_bound,
    ordered_boundaries,
    partial_bound_of_sums,
    partial_lower_bound,
)
from hettrain.planning.capsrows import CapsRows
from hettrain.planning.catalog import DeviceSpec
from hettrain.planning.errors import NotFaster, PlanningError, no_plan
from hettrain.planning.inventory import ClusterInventory
from hettrain.planning.layers import (
    StageCost,
    lower_bound,
    split_layers,
    split_layers_brute_force,
)
from hettrain.planning.placement import (
    moved_at_least,
    moved_ranks,
    place_ranks,
    replica_datacenters,
)
from hettrain.planning.plan import Plan, Prediction, RankPlan, StagePlan
from hettrain.planning.replica_groups import (
    plan_devices,
    plan_with_replica_group,
    plan_zb_div,
)
from hettrain.planning.support import uneven_dp_limits
from hettrain.planning.units import Unit, build_units, filter_pools, spans_datacenters

K_FULL_WINDOW = 1
# uneven data-parallel degrees are searched in steps of at least this share fewer
# microbatches per replica (_thinned): 512 sequences between dp 16 and 32 take 21 and 26
# (0.1 took 19, 22, 25, 29: re-planning llama3-70b on 1024 GPUs 1.03 s instead of 0.90 s)
UNEVEN_DP_STEP = 0.2
MAX_PERMUTED_UNITS = 4
EXACT_LEAF_BUDGET = 20_000  # above this many (tp, k) combinations the k window applies
MAX_MICRO_BATCH = 16
SEED_EVALUATIONS = 4  # greedy layouts evaluated per (dp, mb) pair before its branch and bound
MAX_INTERLEAVE_CHUNKS = 4  # schedule: interleaved: model chunks per stage searched in 2..4
AUTO_MAX_CHUNKS = 3  # schedule: auto: interleaved with 2..3 chunks (all dominated by ZB-H1)
REPLAN_TOLERANCE = 1.02  # a re-plan keeps the old structure if within 2% of the best
REPLAN_OPTIONS = 64  # distinct placements a re-plan compares by moved ranks
SCHEDULES = ("1f1b", "interleaved", "zb-h1", "interleaved-zb", "helix")
# crossDC.mode: auto; exact gradients first. DiLoCo changes the optimizer: opt-in only.
CROSS_DC_SEARCH = ("sync", "compress")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One fully evaluated layout."""

    step_time_s: float
    dp: int
    micro_batch: int
    schedule: str
    units: tuple[Unit, ...]  # per stage
    tps: tuple[int, ...]  # per stage
    split: tuple[int, ...]
    stage_s: tuple[float, ...]
    stage_dp_s: tuple[float, ...]
    boundary_s: tuple[float, ...]
    bubble_s: float
    memory: tuple[float, ...]
    grouping: str  # "split" or "merged"
    chunks: int = 1  # interleaved: model chunks per stage (virtual stages)
    cp: int = 1  # context-parallel degree; ``dp`` counts the dp·cp replicas of the DP×CP group
    helix_hop: float = 0.0  # helix: hop time in per-part cost units its order was built with
    helix_filo: bool = False  # helix: the first-in-last-out order (helix.FILO_VARIANTS)
    link_warmup: tuple[int, ...] = ()  # per stage, extra warm-up over datacenter links (or ())
    link_delay_s: float = 0.0  # the links' latency that warm-up hides, paid once per step

    @property
    def pp(self) -> int:
        """Pipeline stages."""
        return len(self.units)

    def sort_key(self) -> tuple:
        """Deterministic preference: faster, then fewer stages, then names."""
        return (round(self.step_time_s, 12), self.pp, self.dp, self.cp, self.micro_batch,
                self.schedule, self.chunks,
                tuple(u.key for u in self.units), self.tps, self.split, self.helix_filo)


class _Search:
    """State of one planning run (best so far, the reasons things did not fit)."""

    def __init__(self, spec: JobSpec, exhaustive: bool, slack: float = 1.0,
                 ceiling: float = math.inf, devices: Iterable[DeviceSpec] = ()) -> None:
        self.spec = spec
        # an outside incumbent (sharding: auto's faster variant): only layouts below it count
        self.ceiling = ceiling
        self.slack = slack  # prune only what is worse than best·slack (re-plans keep near ones)
        # at least ZB-H1's divisor of every layout on ``devices`` (measured B/W splits)
        self.zb_div = _zb_div_bound(spec, devices)
        # the largest bubble divisor among the schedules the search may pick (bounds.py)
        self.bubble_div = max(_bubble_divisor(s, v, self.zb_div)
                              for s, v in _schedule_options(spec, 2, None))
        self.exhaustive = exhaustive
        self.best: Candidate | None = None
        self.near: list[Candidate] = []  # within REPLAN_TOLERANCE of the best (for re-plans)
        # (need / usable of the limiting stage, a sentence naming it, state alone?) of the
        # closest miss
        self.memory_shortfall: tuple[float, str, bool] | None = None
        self.evaluated = 0
        self.max_gpus = spec.placement.max_gpus  # spec.placement.maxGPUs: a hard cap
        self.over_max_gpus = 0  # layouts skipped for using more GPUs than that
        self.stage_memo: dict[tuple, tuple[StageCost, tuple[cost.StageMemory, float]]] = {}
        self.boundary_memo: dict[tuple, float] = {}
        self.placeable_memo: dict[tuple, bool] = {}  # _placeable, by layout and cp
        self.pp_fits: dict[tuple[int, int], bool] = {}  # (pp, m): some schedule runs it
        self.caps_rows: dict[tuple[int, int], CapsRows] = {}  # (dp, mb): block layer caps
        self.leaf_bounds: dict[tuple[Choice, ...], LeafBound] = {}  # leaves of one pair
        self.pair_rows: CapsRows | None = None  # the block layer caps of the current pair
        self.between_memo: dict[tuple, tuple[float, float]] = {}  # boundary bounds, one pair
        # the current pair's link delay between two choices' units (_link_delay_s), and
        # whether every schedule searched pays it whole (_ordered_bounds)
        self.pair_delay: Callable[[Choice, Choice], float] = lambda x, y: 0.0
        self.delay_factor = 0.0 if spec.parallelism.schedule in ("helix",
                                                                 "interleaved-zb") else 1.0
        # a re-plan's previous (search dp, mb): that pair is searched first, so its layout (as
        # a rule nearly as fast on the smaller cluster) prunes the others from the start
        self.first_pair: tuple[int, int] | None = None

    def use_cp(self, spec: JobSpec) -> None:
        """Search the context-parallel degree ``spec.parallelism.cp`` next (a concrete spec);
        the incumbent carries over (its bound prunes the next degree), the memos do not."""
        self.spec = spec
        self.stage_memo.clear()
        self.boundary_memo.clear()
        self.caps_rows.clear()  # stage memory depends on cp
        self.leaf_bounds.clear()
        self.between_memo.clear()
        self.pair_rows = None

    def offer(self, cand: Candidate) -> None:
        if self.best is None or cand.sort_key() < self.best.sort_key():
            self.best = cand
        self.near.append(cand)
        limit = self.best.step_time_s * REPLAN_TOLERANCE
        if len(self.near) > 64:
            self.near = [c for c in self.near if c.step_time_s <= limit]

    def shortfall(self, ratio: float, clause: str, state_only: bool = False) -> None:
        """Keep the memory miss closest to fitting (for the refusal message); ``state_only``:
        the weights and optimizer state alone do not fit (activations are not the problem)."""
        if self.memory_shortfall is None or ratio < self.memory_shortfall[0]:
            self.memory_shortfall = (ratio, clause, state_only)

    def bound(self) -> float:
        own = math.inf if self.best is None else self.best.step_time_s * self.slack
        return min(own, self.ceiling)

    def hunting(self) -> bool:
        """Nothing found and no outside incumbent: near misses are still evaluated, so that a
        refusal names the closest one."""
        return self.best is None and self.ceiling == math.inf


# ---------------------------------------------------------------- stage costs
#
# Context parallelism: a search runs one concrete ``spec.parallelism.cp`` at a time
# (:func:`_cp`); its ``dp`` then counts the ``dp·cp`` replicas of the DP×CP gradient group (the
# runtime's ``context_parallel.comm_view``): GPUs, DP sync and ZeRO-1 follow it unchanged,
# while the microbatches per replica use the true ``dp`` (:func:`_microbatches`) and the stage
# costs the CP model (``planning/context.py``).


def _cp(spec: JobSpec) -> int:
    """The context-parallel degree this (concrete) spec is searched at."""
    return spec.parallelism.cp or 1


def _replica_batch(spec: JobSpec, dp: int) -> int:
    """Sequences per step of one true replica when ``dp`` counts the DP×CP group (a ``dp``
    that divides the global batch)."""
    return spec.training.global_batch // (dp // _cp(spec))


def _microbatches(spec: JobSpec, dp: int, mb: int) -> int:
    """Microbatches of ``mb`` sequences per step of the fullest true replica when ``dp``
    counts the DP×CP group: ``ceil(globalBatch / (mb·dp))`` (exact when ``dp`` divides the
    batch; an uneven ``dp``'s last replicas run one fewer: :func:`_uneven`)."""
    return -(-spec.training.global_batch // (mb * (dp // _cp(spec))))


def _uneven(spec: JobSpec, dp: int) -> bool:
    """Whether ``dp`` (the DP×CP group) does not divide the global batch ``B``: with
    microbatches of ``mb`` sequences (``mb`` divides ``B``) its replicas then run
    ``m = ceil(B / (mb·dp))`` or ``m − 1`` of them (``Plan.short_replicas``: the last
    ``dp·m − B/mb``; ``planning/support.uneven_dp_errors``)."""
    return spec.training.global_batch % (dp // _cp(spec)) != 0


def _short_replicas(spec: JobSpec, dp: int, mb: int) -> int:
    """The replicas that run one microbatch fewer (``Plan.short_replicas``; 0 when ``dp``
    divides the batch): ``dp·m − B/mb`` with ``dp`` the true replicas."""
    return (dp // _cp(spec)) * _microbatches(spec, dp, mb) - spec.training.global_batch // mb


def _mb_options(spec: JobSpec, dp: int) -> list[int]:
    """Microbatch sizes searched at ``dp``: divisors of the replica's share; for an uneven
    ``dp``, divisors of the global batch that leave every replica a microbatch (more than
    ``dp`` of them: ``m ≥ 2``); the pinned one (``spec.training.microBatch``) if it is one."""
    pinned, gb = spec.training.micro_batch, spec.training.global_batch
    if _uneven(spec, dp):
        return [b for b in _micro_batches(gb, pinned) if gb // b > dp // _cp(spec)]
    return _micro_batches(_replica_batch(spec, dp), pinned)


def _dp_words(spec: JobSpec, dp: int) -> str:
    """``dp=N`` (true replicas) and, with context parallelism, ``cp=C``: for messages."""
    cp = _cp(spec)
    return f"dp={dp // cp}" + (f", cp={cp}" if cp > 1 else "")


def _layer_s(spec: JobSpec, unit: Unit, mb: int, tp: int) -> float:
    """Seconds of one layer per microbatch on ``unit`` at ``tp`` (and the spec's CP)."""
    cp = _cp(spec)
    if cp == 1:
        return cost.layer_time_s(spec.model, spec.training, mb, tp, unit.device)
    link = context.cp_link(unit.device, unit.gpus_per_node, unit.nic_gbytes_per_gpu, tp, cp)
    return context.cp_layer_time_s(spec.model, spec.training, mb, tp, cp, unit.device, link)


def _head_s(spec: JobSpec, unit: Unit, mb: int, tp: int) -> float:
    """Seconds of the LM head per microbatch on ``unit`` at ``tp`` (and the spec's CP)."""
    return context.cp_head_time_s(spec.model, mb, tp, _cp(spec), unit.device,
                                  cost.precision_bytes(spec.training),
                                  spec.training.loss_chunk_tokens)


def _stage_fixed_s(spec: JobSpec, unit: Unit, mb: int, tp: int, first: bool, last: bool
                   ) -> float:
    """Seconds per microbatch of a stage besides its layers: the LM head on the last stage and
    what the device profile measured of the runtime's stage (:func:`cost.stage_overhead_s`;
    with context parallelism a CP rank's shorter sequence matches no profile)."""
    fixed = cost.stage_overhead_s(cost.cp_local_model(spec.model, _cp(spec)), mb, tp,
                                  unit.device, first, cost.precision_bytes(spec.training))
    return fixed + (_head_s(spec, unit, mb, tp) if last else 0.0)


def _dp_rates(unit: Unit, dp: int, tp: int, inv: ClusterInventory, spec: JobSpec
              ) -> tuple[float, float, float, float, float]:
    """``(latency seconds, all-reduce seconds per byte, all-gather seconds per byte, cross-DC
    bytes per byte of each)`` of a stage's DP sync, per byte of its fp32 gradients: the
    gradient all-reduce, and one all-gather of the parameters at the training precision
    (ZeRO's: ``eb`` bytes vs the all-reduce's ``2·4`` per element, so ``eb/8`` of an
    all-reduce), whatever ``spec.training.sharding`` (:func:`_dp_sync_coeffs` counts them).

    Inside a datacenter the all-reduce is hierarchical over nodes
    (:func:`cost.node_hierarchical_all_reduce`): with ``g`` members of the group per node
    (:func:`cost.dp_members_per_node`) the intra-node link reduce-scatters and all-gathers,
    and only ``1/g`` of each rank's bytes crosses the node boundary, over each GPU's NIC
    share side by side (a flat ring charged at one GPU's NIC share was ``g×`` too slow)."""
    if dp <= 1:
        return 0.0, 0.0, 0.0, 0.0, 0.0
    dcs = unit.datacenters
    # the runtime reduces its fp32 main grads with an all-reduce (the hierarchical and
    # compressed paths are all-reduce only); ZeRO all-gathers parameters at the training
    # precision
    eb = cost.precision_bytes(spec.training)
    intra_bw, intra_lat = unit.device.intra_node_gbps, cost.COLLECTIVE_LATENCY_S
    nic_bw, nic_lat = unit.nic_gbytes_per_gpu, cost.COLLECTIVE_LATENCY_S
    if cost.measured_comm(unit.device) is not None:
        # measured inside a node (hettrain profile); no path between nodes beats it
        node_bw, node_lat = cost.node_ring_link(unit.device)
        intra_bw, intra_lat = node_bw, node_lat
        nic_bw, nic_lat = min(nic_bw, node_bw), max(nic_lat, node_lat)
    k = len(dcs)
    local = dp if k == 1 else max(1, dp // k)
    per_node = cost.dp_members_per_node(local, tp, unit.gpus_per_node)
    lat, intra = cost.node_hierarchical_all_reduce(local, per_node, intra_bw, intra_lat,
                                                   nic_bw, nic_lat)
    if k == 1:
        return lat, intra, eb / 8.0 * intra, 0.0, 0.0
    # hierarchical: intra-DC reduce-scatter, inter-DC all-reduce of shards, intra-DC all-gather
    # (the intra-DC part itself hierarchical over the DC's nodes, as above)
    link = min((inv.link(a, b) for a, b in itertools.combinations(dcs, 2)),
               key=lambda lk: lk.gbytes)
    cross = 2 * (k - 1) / k  # bytes crossing per byte of one DC's gradient
    mode = spec.cross_dc
    codec = {"none": 1.0, "bf16": 0.5, "int8": 0.25}[mode.compression]  # bytes vs fp32
    shrink = {"sync": 1.0, "compress": codec,
              "diloco": codec / max(1, mode.outer_steps)}[mode.mode]
    # the parameter all-gather is never compressed and crosses the link once per byte per
    # receiving DC (HetCommunicator.dp_all_gather_): eb/8 of the all-reduce's bytes
    gather = eb / 8.0
    # every TP rank's shard owners share the link: tp·(1/tp of the grads) = the whole stage
    inter = tp / (link.gbytes * 1e9)
    lat += 2 * (k - 1) * link.latency_ms / 1e3
    return (lat, intra + cross * shrink * inter, gather * intra + cross * gather * inter,
            cross * shrink * tp, cross * gather * tp)


def _dp_sync_coeffs(unit: Unit, dp: int, tp: int, inv: ClusterInventory, spec: JobSpec,
                    m: int, layer_s: float, head_s: float, first: bool, last: bool
                    ) -> tuple[float, float]:
    """``(c, e)``: a stage's EXPOSED DP seconds per step, per layer and fixed, under
    ``spec.training.sharding`` with ``m`` microbatches per replica.

    One all-reduce of the stage's fp32 gradients (the layers', and the embedding's and head's
    on the first and last stage) costs ``R = c_r·n + e_r`` (:func:`_dp_rates`, one latency),
    one all-gather of its parameters ``G = c_g·n + e_g`` (no latency: ZeRO-1's model).
    :func:`cost.dp_sync_counts` says how many of each a step runs: none and optimizer one
    all-reduce, overlapped with the last microbatch's backward as the runtime does
    (:func:`_dp_exposed`), optimizer then one exposed all-gather; gradients ``m`` all-reduces
    (one per microbatch's backward) and one all-gather after the step; full ``m`` all-reduces
    and ``2·m`` all-gathers (each unit before its forward and its backward); these two run
    them unit by unit, a latency per unit and collective, overlapped with each microbatch's
    forward and backward where the runtime overlaps them (:func:`_per_unit_exposed`). ``dp``
    is the gradient group (``dp·cp``)."""
    if dp <= 1:
        return 0.0, 0.0
    model = spec.model
    lat, red, gat, _, _ = _dp_rates(unit, dp, tp, inv, spec)
    grad_layer, fixed_grad = _grad_bytes(model, tp, first, last)
    c_red, e_red = grad_layer * red, lat + fixed_grad * red
    c_gat, e_gat = grad_layer * gat, fixed_grad * gat
    if cost.sharded_grads(spec.training):
        # ZeRO-2/3 run one collective per unit (each layer; the embedding, the final norm and
        # the head), each paying its latency; a ring all-gather has half an all-reduce's steps.
        # Where the runtime overlaps the reductions on NCCL/HCCL it reduce-scatters them
        # (each rank keeps one chunk): half an all-reduce's bytes and steps
        # (runtime/trainer.py; gloo keeps the all-reduce, its reduce-scatter is slower)
        overlapped = spec.training.overlap_grad_reduce and len(unit.pools) == 1
        half = 0.5 if overlapped and unit.device.backend != "gloo" else 1.0
        c_red, e_red, lat_red = c_red * half, lat * half + fixed_grad * red * half, lat * half
        fixed_units = int(first) + 2 * int(last)
        c_red, e_red = c_red + lat_red, e_red + (fixed_units - 1) * lat_red
        c_gat, e_gat = c_gat + lat / 2, e_gat + fixed_units * lat / 2
        table = fixed_grad / max(1, int(first) + int(last))  # the embedding's or head's
        table_red, table_gat = (lat + table * red) * half, lat / 2 + table * gat
        comm = cost.measured_comm(unit.device)
        if comm is not None and dp * tp <= unit.gpus_per_node:
            # inside a node, the measured all-reduce of each unit's size where it is slower
            # (a reduce-scatter: half of it)
            c_red = max(c_red, half * comm.all_reduce_s(grad_layer, dp))
            e_red = max(e_red, half * ((int(first) + int(last)) * comm.all_reduce_s(table, dp)
                                       + int(last) * comm.all_reduce_s(4.0 * model.hidden,
                                                                       dp)))
            table_red = max(table_red, half * comm.all_reduce_s(table, dp))
            if comm.measures_all_gather:
                # ... and its measured all-gather of each unit's parameters (plan precision;
                # gloo's all-gather costs about its all-reduce at these sizes, not half)
                eb = cost.precision_bytes(spec.training)
                layer_p, table_p = grad_layer * eb / 4.0, table * eb / 4.0
                c_gat = max(c_gat, comm.all_gather_s(layer_p, dp))
                e_gat = max(e_gat, (int(first) + int(last)) * comm.all_gather_s(table_p, dp)
                            + int(last) * comm.all_gather_s(eb * model.hidden, dp))
                table_gat = max(table_gat, comm.all_gather_s(table_p, dp))
        if overlapped and cost.dp_overlap_share(unit.device) > 0.0:
            # (seconds, whether it is a layer's) of the collectives that stay exposed
            return _per_unit_exposed(spec, m, cost.dp_overlap_share(unit.device),
                                     (c_red, e_red), (c_gat, e_gat),
                                     (table_red, False) if first else (c_red, True),
                                     (table_gat, False) if first else (c_gat, True),
                                     (table_gat, False) if last else (c_gat, True),
                                     layer_s, head_s)
    reduces, gathers = cost.dp_sync_counts(spec.training.sharding, m)
    if not cost.sharded_grads(spec.training):
        c_red, e_red = _dp_exposed(unit, dp, tp, spec, c_red, e_red, lat, red, layer_s,
                                   head_s, first)
    return reduces * c_red + gathers * c_gat, reduces * e_red + gathers * e_gat


def _per_unit_exposed(spec: JobSpec, m: int, share: float, reduce: tuple[float, float],
                      gather: tuple[float, float], first_red: tuple[float, bool],
                      first_gat: tuple[float, bool], last_gat: tuple[float, bool],
                      layer_s: float, head_s: float) -> tuple[float, float]:
    """``(c, e)``: the EXPOSED seconds per step of ZeRO-2/3's per-unit sync as the runtime
    overlaps it (``grad_sync.UnitGradSync``, ``optim.StageOptimizer`` prefetch) -- on a DP
    group inside one pool with ``overlapGradReduce`` (else :func:`_dp_sync_coeffs` charges
    it all).

    ``reduce = (c_r, e_r)``: a stage's per-unit all-reduces of one microbatch, ``gather``
    its per-unit all-gathers (per layer, fixed). Every microbatch's backward launches each
    unit's reduction as its gradients are complete, one in flight while the next unit's
    backward computes; ZeRO-3 also prefetches the next-to-run unit's gather there. So per
    microbatch the backward's comm ``R (+ G)`` runs in its window (the backward share of the
    layers' time, ``cost.backward_fraction``, and 2/3 of the head's), except what can only
    start when the backward ends or must precede it: the reduction of the unit whose
    backward ends last (``first_red``: the embedding's on the first stage, else a layer's)
    and, full, the gather of the unit whose backward starts first (``last_gat``: the head's
    on the last stage, else a layer's): :func:`cost.dp_exposed_coeffs` with those as its
    exposed ``last`` (``share``: :func:`cost.dp_overlap_share`, none on a CPU). ZeRO-3's
    forward gathers ``G`` run in the forward's window in the same
    way, the first unit's (``first_gat``) exposed. ZeRO-2's all-gather after the step stays
    exposed.

    Each exposed collective is ``(seconds, is a layer's)``: a fixed unit's is the exposed
    ``last`` of :func:`cost.dp_exposed_coeffs`; a layer's is one of the ``n`` layers, of which
    ``c'`` already charges the part the window does not hide, so the fixed part adds the rest,
    ``min(seconds, share·window)``: ``(n − 1)·c' + seconds`` for a stage whose exposed
    collectives are all its layers', never more than the synchronous ``n·c + e`` for
    ``n >= 1``."""
    c_r, e_r = reduce
    c_g, e_g = gather
    back = cost.backward_fraction(spec.training.recompute)

    def exposed(c: float, e: float, w: float, wf: float,
                last: list[tuple[float, bool]]) -> tuple[float, float]:
        fixed = sum(x for x, layer in last if not layer)
        cc, ee = cost.dp_exposed_coeffs(c, e, w, wf, fixed, share)
        return cc, ee + min(sum(x for x, layer in last if layer), share * w)

    if spec.training.sharding == "full":
        bc, be = exposed(c_r + c_g, e_r + e_g, layer_s * back, head_s * 2.0 / 3.0,
                         [first_red, last_gat])
        fc, fe = exposed(c_g, e_g, layer_s * (1.0 - back), head_s / 3.0, [first_gat])
        return m * (bc + fc), m * (be + fe)
    bc, be = exposed(c_r, e_r, layer_s * back, head_s * 2.0 / 3.0, [first_red])
    return m * bc + c_g, m * be + e_g


def _dp_exposed(unit: Unit, dp: int, tp: int, spec: JobSpec, c: float, e: float, lat: float,
                per_byte: float, layer_s: float, head_s: float, first: bool
                ) -> tuple[float, float]:
    """``(c', e')``: the EXPOSED seconds per layer and fixed of a stage's gradient
    all-reduce ``c·n + e`` (``per_byte``: :func:`_dp_rates`), as the runtime overlaps it
    (runtime/grad_sync.py).

    The runtime overlaps only a DP group inside one pool (``HetCommunicator.dp_overlappable``);
    a unit of several pools may place a stage's replicas in more than one, so there (and across
    datacenters, and with ``overlapGradReduce: false``) the sync stays fully exposed; on a CPU
    too (:func:`cost.dp_overlap_share`: gloo's work shares the ranks' cores). Else the
    gradient all-reduce runs in buckets during the last microbatch's backward
    (:func:`cost.dp_exposed_coeffs`): the window is the backward share of the layers' time
    (plus the head's on the last stage); the last bucket, at most ``cost.DP_BUCKET_BYTES`` (or
    the embedding's gradient on the first stage) and at most the model's, is exposed. ZeRO-1's
    parameter all-gather follows the optimizer step: always exposed (the caller adds it).
    ``dp`` is the gradient group: ``dp·cp`` with context parallelism, so cp > 1 syncs even at
    dp = 1."""
    if (dp <= 1 or not spec.training.overlap_grad_reduce or len(unit.pools) != 1
            or cost.dp_overlap_share(unit.device) == 0.0):  # a CPU hides nothing
        return c, e
    model, training = spec.model, spec.training
    embed = cost.embedding_params(model) * 4.0 / cost.vocab_shards(model, tp)
    # fp32 gradient bytes, as ``embed`` (the layers' count was parameters, not bytes: a model
    # under one bucket had its exposed last bucket priced at about a quarter of its bytes)
    whole = (cost.layer_params(model) * 4.0 * model.layers / tp + 2 * embed)
    last_bytes = min(max(cost.DP_BUCKET_BYTES, embed if first else 0.0), whole)
    last_s = lat + last_bytes * per_byte
    back = cost.backward_fraction(training.recompute)
    return cost.dp_exposed_coeffs(c, e, layer_s * back, head_s * 2.0 / 3.0, last_s,
                                  cost.dp_overlap_share(unit.device))


def _optimizer_coeffs(unit: Unit, tp: int, dp: int, spec: JobSpec, first: bool,
                      last: bool) -> tuple[float, float]:
    """``(per layer, fixed)`` seconds of a stage's optimizer step (:func:`cost.
    optimizer_step_s`): its layers' parameters, and the embedding (first) and head (last)."""
    model = spec.model
    per_layer = cost.optimizer_step_s(cost.layer_params(model) / tp, spec.training, dp,
                                      unit.device)
    embed = cost.embedding_params(model) / cost.vocab_shards(model, tp)
    fixed = (cost.optimizer_step_s(embed * (int(first) + int(last)), spec.training, dp,
                                   unit.device) if first or last else 0.0)
    return per_layer, fixed


def _boundary_s(src: Unit, dst: Unit, tp_src: int, tp_dst: int, dp: int, micro_batch: int,
                inv: ClusterInventory, spec: JobSpec, hidden: bool = False) -> float:
    """Forward + backward transfer time of one microbatch across a stage boundary.
    ``hidden``: a datacenter link's latency is hidden by the schedule's extra warm-up
    (:func:`_link_delay_s`, paid once per step instead), so the hop pays an ordinary
    transfer's latency."""
    eb = cost.precision_bytes(spec.training)
    tp = max(1, min(tp_src, tp_dst))
    nbytes = cost.boundary_link_bytes(cost.cp_local_model(spec.model, _cp(spec)), micro_batch,
                                      eb, tp_src, tp_dst)
    nic = min(src.nic_gbytes_per_gpu, dst.nic_gbytes_per_gpu)
    lat = cost.COLLECTIVE_LATENCY_S
    shared_dcs = set(src.datacenters) & set(dst.datacenters)
    if not shared_dcs:
        link = inv.slowest_link(src.datacenters, dst.datacenters)
        nic = min(nic, link.gbytes / (dp * tp))
        if not hidden:
            lat = link.latency_ms / 1e3
    if src.device.vendor != dst.device.vendor:
        bw = cost.host_staged_gbytes(src.device, dst.device, nic)
        lat += cost.HOST_STAGING_LATENCY_S
    else:  # the pair's own stream group (nccl/hccl, or gloo on a CPU host), as profiled
        bw, lat = cost.p2p_link(dst.device, *cost.p2p_link(src.device, nic, lat))
    return 2 * cost.transfer_s(nbytes, bw, lat)


def _link_delay_s(src: Unit, dst: Unit, inv: ClusterInventory) -> float:
    """The round trip a datacenter link's latency adds to a hop beyond an ordinary transfer's
    (forward activation and backward gradient): ``2·(latency − COLLECTIVE_LATENCY_S)`` where
    the two stages share no datacenter, else 0."""
    if set(src.datacenters) & set(dst.datacenters):
        return 0.0
    link = inv.slowest_link(src.datacenters, dst.datacenters)
    return 2 * max(0.0, link.latency_ms / 1e3 - cost.COLLECTIVE_LATENCY_S)


def link_delays(units: Sequence[Unit], inv: ClusterInventory, schedule: str) -> list[float]:
    """Per hop ``i → i + 1`` of a pipeline on ``units``, the link latency ``schedule`` hides
    with extra warm-up (:func:`_link_delay_s`; all 0 for the schedules that do not:
    ``cost.HIDES_LINK_LATENCY``)."""
    if schedule not in cost.HIDES_LINK_LATENCY:
        return [0.0] * max(0, len(units) - 1)
    return [_link_delay_s(units[i], units[i + 1], inv) for i in range(len(units) - 1)]


def warmup_period_s(layers: int, stages: Sequence[StageCost], hops: Sequence[float]) -> float:
    """A lower bound on a pipeline's steady-state seconds per microbatch before its layer
    split is known: its slowest stage, whatever the split: with stage ``i`` taking
    ``n_i·a_i + b_i ≤ X`` (``a`` per layer, ``b`` fixed) and ``Σ n_i = layers``,
    ``X ≥ (layers + Σ b_i/a_i) / Σ 1/a_i``; and at least its slowest hop's transfer
    (``hops``, the latency hidden). :func:`cost.link_warmups` divides the links' delays by
    it, so the warm-up it gives is never too short."""
    rate = sum(1.0 / s.a for s in stages)
    balanced = (layers + sum(s.b / s.a for s in stages)) / rate
    return max(balanced, max(hops, default=0.0))




def _bubble_divisor(schedule: str, v: int, zb_div: float = cost.ZB_CATALOG_DIVISOR,
                    pp: int | None = None, m: int | None = None,
                    model: ModelSpec | None = None, hop: float = 0.0,
                    filo: bool = False) -> float:
    """What a schedule divides the 1F1B bubble by (:func:`cost.pipeline_time_s`); ZB-H1's is
    ``zb_div`` (:func:`_zb_div` of a layout, or a bound on it: :attr:`_Search.zb_div`);
    interleaved-zb's its replayed order's for ``pp`` stages of ``m`` microbatches scaled by
    ``zb_div/3``, or (``pp=None``) its bound ``v·zb_div`` (the order's is at most ``3·v``);
    helix's its replayed order's for ``model`` (:func:`helix.bubble_divisor`; ``filo``: the
    first-in-last-out one), or (no ``pp``) ``inf``: a bound may only assume its bubble is not
    negative."""
    if schedule == "helix":
        if pp is None or m is None or model is None:
            return math.inf
        return helix.bubble_divisor(pp, model.layers, m, helix.costs_for(model), hop, filo)
    if schedule == "interleaved-zb":
        if pp is None or m is None:
            return v * zb_div
        return (interleaved_zb.bubble_divisor(pp, m, v) * zb_div
                / cost.ZB_CATALOG_DIVISOR)
    return {"1f1b": 1.0, "zb-h1": zb_div}.get(schedule, float(v))


def _zb_div(spec: JobSpec, devices: Iterable[DeviceSpec], mb: int) -> float:
    """ZB-H1's bubble divisor for a pipeline of ``devices`` at microbatch ``mb``
    (:func:`cost.zb_bubble_divisor`: the devices' measured B/W split, else 3); with context
    parallelism a CP rank's shorter sequence matches no profile: the catalog's."""
    if _cp(spec) > 1:
        return cost.ZB_CATALOG_DIVISOR
    return cost.zb_bubble_divisor(list(devices), spec.model, spec.training, mb)


def _zb_div_bound(spec: JobSpec, devices: Iterable[DeviceSpec]) -> float:
    """At least every layout's ZB-H1 divisor over ``devices`` (the inventory's): a layout's is
    the smallest of its devices' (:func:`cost.zb_bubble_divisor`), so the largest of one
    device's over the microbatch sizes the search may take, and never below the catalog's 3
    (a CP rank's). A measured divisor is ``1/(1 − 2·W(b)/t(b))``, both lines affine and
    positive in ``b``: monotone, every size up to ``MAX_MICRO_BATCH`` (and a pinned one) is
    taken anyway."""
    top = max(MAX_MICRO_BATCH, spec.training.micro_batch or 0)
    return max([cost.ZB_CATALOG_DIVISOR] + [
        cost.zb_bubble_divisor([d], spec.model, spec.training, b)
        for d in devices for b in range(1, top + 1)])


def _schedule_options(spec: JobSpec, pp: int, layers: int | None,
                      exhaustive: bool = True) -> list[tuple[str, int]]:
    """(schedule, model chunks per stage) pairs to evaluate for a ``pp``-stage pipeline.

    Interleaved takes ``v`` in ``2..MAX_INTERLEAVE_CHUNKS`` (or the pinned
    ``spec.parallelism.virtualStages``), each stage holding at least ``v`` layers. Under
    ``schedule: auto`` the space is 1F1B, ZB-H1 and interleaved with ``v ≤ AUTO_MAX_CHUNKS``;
    with ``exhaustive=False`` they are listed ZB-H1 first (it dominates the others on every
    split it fits; :func:`_evaluate_order` skips a dominated one by comparing memory caps);
    1F1B only for ``pp = 1``. (More chunks could beat ZB-H1 in this model at ``v``× the
    boundary traffic; searching them under auto loosens every bound from ``bubble/3`` to
    ``bubble/v``, so they are left to an explicit ``schedule: interleaved``.) ``layers=None``
    skips the layer check (for the bubble divisor).
    """
    par = spec.parallelism
    if par.schedule == "helix":  # one layer per chunk: layers / pp chunks, equal stages
        if layers is None:
            return [("helix", 1)]
        return [("helix", layers // pp)] if layers % pp == 0 else []
    pinned_v = par.virtual_stages
    top = MAX_INTERLEAVE_CHUNKS if chunked_schedule(par.schedule) else AUTO_MAX_CHUNKS
    chunks = [pinned_v] if pinned_v is not None else list(range(2, top + 1))
    if layers is not None:
        chunks = [v for v in chunks if layers >= pp * v]
    if chunked_schedule(par.schedule):
        return [(par.schedule, v) for v in chunks]
    inter = [("interleaved", v) for v in chunks]
    if par.schedule != "auto":
        return [(par.schedule, 1)]
    if cost.sharded_grads(spec.training) or spec.training.mlp_chunk_tokens:
        # ZeRO-2/3 and the chunked MLP do not run ZB-H1 (planning/support.py)
        return [("1f1b", 1), *inter]
    if exhaustive:
        return [("1f1b", 1), *inter, ("zb-h1", 1)]
    # ZB-H1 is never slower than 1F1B or interleaved on one split, but its stash of deferred
    # weight-gradient inputs (cost.zb_pending_weight_grads) can make it hold more memory:
    # where that caps a stage, the others may fit a split (or a layout) that ZB-H1 cannot.
    # (interleaved-zb is not in auto's search: its order is priced at F = B = W, and at other
    # ratios it can run slower than 1F1B: docs/planning.md §Search; it is opt-in)
    return [("1f1b", 1)] if pp == 1 else [("zb-h1", 1), ("1f1b", 1), *inter]


def search_time_hint(spec: JobSpec) -> str:
    """A clause for a "planning took too long" message (``hettrain.planguard``), or "":
    ``schedule: interleaved-zb`` with ``pp`` free is the slowest search there is (its order is
    replayed at every pipeline depth whose memory the search checks; docs/planning.md
    §Search), and pinning ``pp`` brings it to seconds."""
    par = spec.parallelism
    if par.schedule == "interleaved-zb" and par.pp is None:
        return ("; schedule interleaved-zb searches every pipeline depth: set "
                "spec.parallelism.pp too")
    return ""


def _schedule_fits(schedule: str, v: int, pp: int, m: int, layers: int) -> bool:
    """Whether ``schedule`` can run a ``pp``-stage pipeline of ``m`` microbatches: ZB-H1 and
    interleaved need ``pp ≥ 2``; interleaved also ``m`` a multiple of ``pp`` and at least
    ``v`` layers per stage (the runtime's schedule); interleaved-zb any ``m``."""
    if schedule == "interleaved":
        return pp >= 2 and m % pp == 0 and layers >= pp * v
    if schedule == "interleaved-zb":
        return pp >= 2 and layers >= pp * v
    if schedule == "helix":
        return (pp >= 2 and layers % pp == 0 and v == layers // pp
                and m <= helix.MAX_MICROBATCHES_PER_STAGE * pp)
    if schedule == "zb-h1":
        return pp >= 2
    return True


def _any_schedule_fits(search: _Search, pp: int, m: int) -> bool:
    """Whether some schedule the search may pick runs ``pp`` stages (memoised): a leaf with
    none has no layout, exactly."""
    key = (pp, m)
    fits = search.pp_fits.get(key)
    if fits is None:
        layers = search.spec.model.layers
        fits = search.pp_fits[key] = any(
            _schedule_fits(sched, v, pp, m, layers)
            for sched, v in _schedule_options(search.spec, pp, layers, exhaustive=False))
    return fits


def _stage_costs(units: Sequence[Unit], tps: Sequence[int], dp: int, mb: int, m: int,
                 schedule: str, inv: ClusterInventory, spec: JobSpec, memo: dict | None = None,
                 v: int = 1, filo: bool = False, warm: Sequence[int] = ()
                 ) -> tuple[list[StageCost], list[tuple[cost.StageMemory, float]]]:
    """Per-stage cost coefficients and memory (``filo``: of helix's first-in-last-out order;
    ``warm``: each stage's extra warm-up over datacenter links, :func:`cost.link_warmups`, or
    none); identical stages are memoised in ``memo``. Each stage's compute is slowed by
    :func:`_crowding` where its node runs several ranks."""
    links = [(warm[i], max(0, warm[i - 1] - warm[i]) if i else 0) if warm else (0, 0)
             for i in range(len(units))]
    if memo is not None:
        pp = len(units)
        out, mems = [], []
        for i, (u, tp) in enumerate(zip(units, tps, strict=True)):
            hit = _stage_cost_at(memo, u, tp, dp, mb, i, pp, m, schedule, v, inv, spec, filo,
                                 links[i])
            out.append(hit[0])
            mems.append(hit[1])
    else:
        out, mems = _stage_costs_raw(units, tps, dp, mb, m, schedule, inv, spec, None, None, v,
                                     filo, links)
    slow = _crowding(units, tps, dp, mb, spec)
    if slow:  # a layer measured sharded ran with its node's TP ranks busy: not slowed again
        out = [StageCost(s.a if _measured_tp(spec, u, tp) else s.a * f, s.b * f, s.c, s.e,
                         s.max_layers) if f != 1.0 else s
               for s, f, u, tp in zip(out, slow, units, tps, strict=True)]
    return out, mems


def _measured_tp(spec: JobSpec, unit: Unit, tp: int) -> bool:
    """Whether ``unit``'s layer time at ``tp`` is its profile's layer measured sharded
    (``cost.measured_tp_line``; not with CP: a CP rank's shorter sequence matches no
    profile)."""
    return _cp(spec) == 1 and cost.measured_tp_line(spec.model, spec.training, tp,
                                                    unit.device) is not None


def _crowding(units: Sequence[Unit], tps: Sequence[int], dp: int, mb: int, spec: JobSpec
              ) -> list[float] | None:
    """Per stage, the factor on its compute (layers and fixed part) from its device profile's
    measured concurrent layer (``LayerProfile.slowdown``: a CPU node's ranks share one host)
    where the layout keeps more busy ranks on the stage's unit (``dp`` times the TP of each of
    its stages there) than the unit has nodes, so some node runs several at once; None when
    no stage is slowed. Never below 1, so the search's bounds (single-rank) stay admissible."""
    ranks: dict = {}
    for u, tp in zip(units, tps, strict=True):
        ranks[u.key] = ranks.get(u.key, 0) + dp * tp
    out = []
    for u in units:
        prof = u.device.profile
        crowded = (prof is not None and prof.concurrent is not None
                   and prof.matches(spec.model, cost.precision_bytes(spec.training))
                   and ranks[u.key] > u.nodes)
        out.append(prof.slowdown(mb) if crowded else 1.0)
    return out if any(f != 1.0 for f in out) else None


def _stage_cost_at(memo: dict, u: Unit, tp: int, dp: int, mb: int, i: int, pp: int, m: int,
                   schedule: str, v: int, inv: ClusterInventory, spec: JobSpec,
                   filo: bool = False, link: tuple[int, int] = (0, 0)
                   ) -> tuple[StageCost, tuple[cost.StageMemory, float]]:
    """Cost and memory of the stage at position ``i`` of ``pp`` (memoised in ``memo``;
    ``link``: its extra warm-up and receives ahead over datacenter links)."""
    # by position first (cheap key), then by what the costs depend on (shared)
    where = ("at", u.key, tp, dp, mb, i, pp, m, schedule, v, filo, link)
    hit = memo.get(where)
    if hit is None:
        key = (u.key, tp, dp, mb, i == 0, i == pp - 1,
               *cost.schedule_memory_args(i, pp, m, schedule, v, filo, *link).values())
        hit = memo.get(key)
        if hit is None and link != (0, 0):  # the same times; only the memory differs
            base, _ = _stage_cost_at(memo, u, tp, dp, mb, i, pp, m, schedule, v, inv, spec,
                                     filo)
            mem, usable, max_layers = _stage_memory(u, tp, dp, mb, i, pp, m, schedule, spec, v,
                                                    filo, link)
            hit = memo[key] = (replace(base, max_layers=max_layers), (mem, usable))
        elif hit is None:
            hit = memo[key] = _stage_costs_raw([u], [tp], dp, mb, m, schedule, inv,
                                               spec, i, pp, v, filo)
        memo[where] = hit
    return hit


def _stage_memory(u: Unit, tp: int, dp: int, mb: int, i: int, pp: int, m: int, schedule: str,
                  spec: JobSpec, v: int = 1, filo: bool = False, link: tuple[int, int] = (0, 0)
                  ) -> tuple[cost.StageMemory, float, int]:
    """``(memory, usable bytes, layers that fit)`` of the stage at position ``i`` of ``pp``
    (``link``: its extra warm-up and receives ahead over datacenter links)."""
    mem = cost.stage_memory(spec.model, spec.training, tp=tp, dp=dp // _cp(spec), cp=_cp(spec),
                            micro_batch=mb, first=i == 0, last=i == pp - 1,
                            cp_masks=not cost.skips_masked_tiles(u.device),
                            **cost.schedule_memory_args(i, pp, m, schedule, v, filo, *link))
    usable = u.device.hbm_bytes * cost.MEMORY_HEADROOM
    max_layers = int((usable - mem.fixed) // mem.per_layer) if usable > mem.fixed else 0
    return mem, usable, max_layers


def _stage_costs_raw(units: Sequence[Unit], tps: Sequence[int], dp: int, mb: int, m: int,
                     schedule: str, inv: ClusterInventory, spec: JobSpec, only: int | None,
                     pp_real: int | None, v: int = 1, filo: bool = False,
                     links: Sequence[tuple[int, int]] = ()):
    """Costs of all stages, or (``only``) of stage ``only`` of a ``pp_real``-stage pipeline
    (``links``: per stage given, its extra warm-up and receives ahead over datacenter
    links)."""
    pp = len(units)
    out, mems = [], []
    indices = list(enumerate(zip(units, tps, strict=True)))
    if only is not None:
        pp = pp_real
        indices = [(only, (units[0], tps[0]))]
    for j, (i, (u, tp)) in enumerate(indices):
        first, last = i == 0, i == pp - 1
        link = links[j] if links else (0, 0)
        a = _layer_s(spec, u, mb, tp)
        b = _stage_fixed_s(spec, u, mb, tp, first, last)
        c, e = _dp_sync_coeffs(u, dp, tp, inv, spec, m, a, b, first, last)
        # the optimizer step follows the gradient sync on every stage: per layer and fixed
        opt_c, opt_e = _optimizer_coeffs(u, tp, dp, spec, first, last)
        c, e = c + opt_c, e + opt_e
        mem, usable, max_layers = _stage_memory(u, tp, dp, mb, i, pp, m, schedule, spec, v,
                                                filo, link)
        out.append(StageCost(a, b, c, e, max_layers))
        mems.append((mem, usable))
    if only is not None:
        return out[0], mems[0]
    return out, mems


# ---------------------------------------------------------------- enumeration


def _dp_values(spec: JobSpec, units: Sequence[Unit]) -> list[int]:
    """Data-parallel degrees worth searching: divisors of the global batch (by factorisation,
    :mod:`hettrain.planning.arith`) and, unless ``spec.parallelism.dp`` is pinned, the
    uneven degrees ``ceil(B / m)`` for ``m ≥ 2`` microbatches per replica (:func:`_uneven`:
    the fewest replicas that run at most ``m`` each; any other ``dp`` runs as many microbatches
    on more GPUs), up to the GPUs of the largest unit (a stage takes all its replicas from one
    unit) and ``spec.placement.maxGPUs``; the pinned one if pinned. Exact: a larger ``dp``
    leaves every unit without a stage. With context parallelism each value counts the
    ``dp·cp`` replicas (``_cp``)."""
    cap = max((u.gpus for u in units), default=0)
    if spec.placement.max_gpus is not None:
        cap = min(cap, spec.placement.max_gpus)
    cp = _cp(spec)
    cap //= cp
    pinned = spec.parallelism.dp
    gb = spec.training.global_batch
    if pinned is not None:
        return [pinned * cp] if pinned <= cap and gb % pinned == 0 else []
    even = divisors_up_to(gb, cap)
    if _EVEN_ONLY.get():
        return [d * cp for d in even]
    return [d * cp for d in _thinned(gb, even, uneven_dp_values(gb, cap))]


def _thinned(gb: int, even: Sequence[int], uneven: Sequence[int]) -> list[int]:
    """Every divisor in ``even`` and, in ascending order, each uneven degree of ``uneven``
    whose replicas run at most ``1 − UNEVEN_DP_STEP`` of the microbatches of the last degree
    kept (a heuristic: the search's cost grows with the degrees it visits, and neighbouring
    uneven degrees differ by a microbatch or two)."""
    out: list[int] = []
    m_last = math.inf
    for d in sorted({*even, *uneven}):
        m = -(-gb // d)
        if gb % d == 0 or m <= (1 - UNEVEN_DP_STEP) * m_last:
            out.append(d)
            m_last = m
    return out


def _micro_batches(per_replica: int, pinned: int | None) -> list[int]:
    """Microbatch sizes for one replica's share: divisors up to ``MAX_MICRO_BATCH``, or the
    pinned one when it divides the share."""
    if pinned is not None:
        return [pinned] if per_replica % pinned == 0 else []
    return [b for b in range(1, min(per_replica, MAX_MICRO_BATCH) + 1) if per_replica % b == 0]


def _tp_options(unit: Unit, spec: JobSpec) -> list[int]:
    if spec.parallelism.schedule == "helix":  # its stages run without TP
        return [1]
    pinned = spec.parallelism.tp
    opts = []
    tp = 1
    while tp <= unit.gpus_per_node:
        ok = (unit.gpus_per_node % tp == 0 and spec.model.heads % tp == 0
              and (spec.model.kv_heads % tp == 0 or tp % spec.model.kv_heads == 0))
        if ok and (pinned is None or tp == pinned):
            opts.append(tp)
        tp *= 2
    return opts


def _k_options(max_k: int, exhaustive: bool) -> list[int]:
    if exhaustive or max_k <= K_FULL_WINDOW + 1:
        return list(range(max_k + 1))
    return [0, *range(max_k - K_FULL_WINDOW, max_k + 1)]


def _orders(units: Sequence[Unit], counts: Sequence[int], exhaustive: bool
            ) -> Iterator[tuple[int, ...]]:
    used = [i for i, k in enumerate(counts) if k]
    if exhaustive or len(used) <= MAX_PERMUTED_UNITS:
        yield from itertools.permutations(used)
        return
    yield _fixed_order(units, used)


def _fixed_order(units: Sequence[Unit], used: Sequence[int]) -> tuple[int, ...]:
    """Stage order beyond ``MAX_PERMUTED_UNITS`` units: DC by DC, fastest device first."""
    return tuple(sorted(used, key=lambda i: (units[i].datacenters, -units[i].device.flops,
                                             units[i].key)))


Outer = tuple[float, int, tuple[int, ...], tuple[int, ...]]


def _candidates_outer(units: Sequence[Unit], spec: JobSpec, dp_values: Sequence[int],
                      exhaustive: bool, dropped: list[float] | None = None) -> list[Outer]:
    """(lower bound, dp, tp per unit, stages per unit), sorted by bound.

    Candidates whose replica cannot even hold the layers' weights and optimizer state in its
    combined usable HBM are dropped (a necessary condition, so nothing feasible is lost).
    """
    model, gb = spec.model, spec.training.global_batch
    layer_state = cost.layer_params(model) * model.layers
    work = cost.model_flops_per_step(model, gb)
    eb = cost.precision_bytes(spec.training)
    pinned_pp = spec.parallelism.pp
    out = []
    tp_opts = [_tp_options(u, spec) or [0] for u in units]
    for dp in dp_values:
        for tps in itertools.product(*tp_opts):
            if 0 in tps:
                continue
            maxk = [_stage_room(u, tp, dp, spec) for u, tp in zip(units, tps, strict=True)]
            for ks in itertools.product(*(_k_options(k, exhaustive) for k in maxk)):
                pp = sum(ks)
                if pp < 1 or pp > model.layers or (pinned_pp is not None and pp != pinned_pp):
                    continue
                hbm = sum(k * tp * u.device.hbm_bytes * cost.MEMORY_HEADROOM
                          for k, tp, u in zip(ks, tps, units, strict=True))
                need = layer_state * cost.state_bytes_per_param(spec.training, dp)
                if hbm < need:
                    if dropped is not None:
                        gpus = sum(k * tp for k, tp in zip(ks, tps, strict=True))
                        dropped.append(need / gpus / cost.MEMORY_HEADROOM / cost.GIB)
                    continue
                rate = sum(k * tp / cost.min_seconds_per_flop(u.device, model, eb)
                           for k, tp, u in zip(ks, tps, units, strict=True))
                out.append((work / dp / rate, dp, tps, ks))
    out.sort()
    return out


def _boundary_memo(search: _Search, src: Unit, dst: Unit, tp_src: int, tp_dst: int, dp: int,
                   mb: int, inv: ClusterInventory, hidden: bool = True) -> float:
    """:func:`_boundary_s`, memoised per search. The bounds use the default ``hidden``
    charge, the smaller one (a link's latency paid once per step where a schedule hides it:
    a lower bound for every schedule)."""
    key = (src.key, dst.key, tp_src, tp_dst, dp, mb, hidden)
    b = search.boundary_memo.get(key)
    if b is None:
        b = search.boundary_memo[key] = _boundary_s(src, dst, tp_src, tp_dst, dp, mb, inv,
                                                    search.spec, hidden)
    return b


def _evaluate(search: _Search, units: Sequence[Unit], tps: Sequence[int], dp: int, mb: int,
              schedule: str, inv: ClusterInventory, grouping: str, v: int = 1) -> None:
    """Offer the best layer split of one layout (``units``, ``tps``, ``dp``, ``mb``) under
    ``schedule``; helix under both its orders (capped, then first-in-last-out: more memory,
    often less bubble), each with its own memory."""
    both = schedule == "helix" and not _HELIX_CAPPED.get()
    for filo in (False, True) if both else (False,):
        _evaluate_one(search, units, tps, dp, mb, schedule, inv, grouping, v, filo)


def _placeable(search: _Search, units: Sequence[Unit], tps: Sequence[int], dp: int) -> bool:
    """Whether :func:`placement.replica_datacenters` can hold each replica of the layout in
    one datacenter along every run of hops priced inside one (memoised per search): else some
    hop the search prices inside a datacenter would cross a link once placed. The search's
    stage counts already respect each unit's room (:meth:`Unit.stage_slots`); what this adds
    is that a run's units span the same datacenters. Always true where no unit spans
    datacenters."""
    if all(len(u.datacenters) == 1 for u in units):
        return True
    cp = _cp(search.spec)
    key = (tuple(u.key for u in units), tuple(tps), dp, cp)
    ok = search.placeable_memo.get(key)
    if ok is None:
        ok = search.placeable_memo[key] = replica_datacenters(units, tps, dp, cp) is not None
    return ok


def _evaluate_one(search: _Search, units: Sequence[Unit], tps: Sequence[int], dp: int,
                  mb: int, schedule: str, inv: ClusterInventory, grouping: str, v: int,
                  filo: bool) -> None:
    spec = search.spec
    model = spec.model
    m = _microbatches(spec, dp, mb)
    pp = len(units)
    if search.max_gpus is not None and dp * sum(tps) > search.max_gpus:
        search.over_max_gpus += 1  # exact: only removes layouts, every bound stays valid
        return
    if grouping == "merged" and not _placeable(search, units, tps, dp):
        return  # exact as well: only removes layouts
    if not chunked_schedule(schedule):
        v = 1
    if not _schedule_fits(schedule, v, pp, m, model.layers):
        return
    if _uneven(spec, dp) and uneven_dp_limits(_short_replicas(spec, dp, mb), schedule,
                                              spec.training, spec.cross_dc.mode):
        return
    stages, mems = _stage_costs(units, tps, dp, mb, m, schedule, inv, spec, search.stage_memo,
                                v, filo)
    # a schedule that hides the datacenter links' latency runs the warm-up that does it (its
    # memory; the hops' transfers alone, the latency once). Without it every microbatch
    # would wait on the links' round trip, which the per-hop charge of the other schedules
    # under-prices (docs/planning.md, §Link warm-up)
    delays = link_delays(units, inv, schedule)
    if not any(delays):
        _offer_split(search, units, tps, dp, mb, m, schedule, inv, grouping, v, filo, stages,
                     mems)
        return
    hidden = [_boundary_memo(search, units[a], units[b], tps[a], tps[b], dp, mb, inv)
              for a, b in hop_pairs(pp, v)]
    if not search.exhaustive:  # its bound with the caps without warm-up (larger) first
        boundaries = cost.boundary_charges(hidden, pp, schedule, v)
        f = _bubble_divisor(schedule, v, _zb_div(spec, (u.device for u in units), mb)
                            if splits_backward(schedule) else cost.ZB_CATALOG_DIVISOR)
        scaled = [StageCost(s.a, s.b, s.c * f, s.e * f, s.max_layers) for s in stages]
        lb = lower_bound(scaled, model.layers, f * m, max(boundaries, default=0.0), v)
        if math.inf > lb >= search.bound() * f - sum(boundaries) - f * sum(delays):
            return
    warm = cost.link_warmups(delays, warmup_period_s(model.layers, stages, hidden), m)
    stages, mems = _stage_costs(units, tps, dp, mb, m, schedule, inv, spec, search.stage_memo,
                                v, filo, warm)
    _offer_split(search, units, tps, dp, mb, m, schedule, inv, grouping, v, filo, stages, mems,
                 warm, sum(delays))


def _offer_split(search: _Search, units: Sequence[Unit], tps: Sequence[int], dp: int, mb: int,
                 m: int, schedule: str, inv: ClusterInventory, grouping: str, v: int,
                 filo: bool, stages: list[StageCost],
                 mems: list[tuple[cost.StageMemory, float]], warm: tuple[int, ...] = (),
                 delay: float = 0.0) -> None:
    """Offer the best layer split of one layout with its stages' costs and memory; ``warm``,
    ``delay``: the warm-up over datacenter links and the latency it pays once (the hops then
    carry their transfers alone), or none."""
    spec = search.spec
    model = spec.model
    pp = len(units)
    hops = [_boundary_memo(search, units[a], units[b], tps[a], tps[b], dp, mb, inv,
                           hidden=bool(warm)) for a, b in hop_pairs(pp, v)]
    boundaries = cost.boundary_charges(hops, pp, schedule, v)
    zb_div = (_zb_div(spec, (u.device for u in units), mb) if splits_backward(schedule)
              else cost.ZB_CATALOG_DIVISOR)
    hop = helix_hop_units(stages, hops) if schedule == "helix" else 0.0
    f = _bubble_divisor(schedule, v, zb_div, pp, m, model, hop, filo)
    scaled = [StageCost(s.a, s.b, s.c * f, s.e * f, s.max_layers) for s in stages]
    p_max, p_sum = max(boundaries, default=0.0), sum(boundaries)
    search.evaluated += 1
    if search.exhaustive or schedule == "helix":  # helix: one split (layers/pp each)
        result = split_layers_brute_force(scaled, model.layers, f * m, p_max, v)
    else:
        # scaled objective: f·T = (f·m − 1)·X + Σt + f·max d, plus the boundaries' Σ and
        # the links' delay (not divided: f·delay)
        incumbent = search.bound() * f - p_sum - f * delay
        lb = lower_bound(scaled, model.layers, f * m, p_max, v)
        if lb >= incumbent and lb < math.inf:
            return
        result = split_layers(scaled, model.layers, f * m, p_max, v, bound=incumbent + 1e-12)
        if result is None and lb < math.inf:
            return
    if result is None:
        per = math.ceil(model.layers / pp)
        ratio, i = max((mem.bytes_for(per) / usable, i) for i, (mem, usable) in enumerate(mems))
        mem, usable = mems[i]
        search.shortfall(ratio, (
            f"stage {i} of {pp} ({units[i].device.name}, tp={tps[i]}, {_dp_words(spec, dp)}, "
            f"microBatch {mb}, "
            f"{schedule}) needs {mem.bytes_for(per) / cost.GIB:.1f} GiB per device for {per} "
            f"layers; it has {usable / cost.GIB:.1f} GiB usable "
            f"({cost.MEMORY_HEADROOM:.0%} of {units[i].device.hbm_gib:.0f} GiB)"))
        return
    _, split = result
    stage_s = [s.time(n) for s, n in zip(stages, split, strict=True)]
    stage_dp = [s.dp(n) for s, n in zip(stages, split, strict=True)]
    pipe, bubble = cost.pipeline_time_s(stage_s, hops, m, schedule, v, zb_div, model, hop,
                                        filo, delay)
    t = pipe + max(stage_dp)
    memory = tuple(mem.bytes_for(n) / cost.GIB for (mem, _), n in zip(mems, split, strict=True))
    search.offer(Candidate(t, dp, mb, schedule, tuple(units), tuple(tps), tuple(split),
                           tuple(stage_s), tuple(stage_dp), tuple(boundaries), bubble, memory,
                           grouping, v, _cp(spec), hop, filo, warm, delay))


def helix_hop_units(stages: Sequence[StageCost], hops: Sequence[float]) -> float:
    """The helix order's hop: one transfer (half the slowest hop's activation+gradient pair)
    in units of its per-part costs (a layer's forward is 1, forward+backward 3, on the
    slowest stage), quantized (:func:`helix.quantize_hop`)."""
    unit = max((s.a for s in stages), default=0.0) / 3.0
    if unit <= 0 or not hops:
        return 0.0
    return helix.quantize_hop(max(hops) / 2.0 / unit)


def _search_exhaustive(search: _Search, units: tuple[Unit, ...], inv: ClusterInventory,
                     grouping: str) -> None:
    spec = search.spec
    dp_values = _dp_values(spec, units)
    dropped: list[float] = []
    outer = _candidates_outer(units, spec, dp_values, search.exhaustive, dropped)
    if dropped:
        _state_shortfall(search, units, min(dropped))
    for bound, dp, tps_u, ks in outer:
        if not search.exhaustive and bound >= search.bound():
            break
        mbs = _mb_options(spec, dp)
        for order in _orders(units, ks, search.exhaustive):
            stage_units = tuple(units[i] for i in order for _ in range(ks[i]))
            stage_tps = tuple(tps_u[i] for i in order for _ in range(ks[i]))
            for mb in mbs:
                for schedule, v in _schedule_options(spec, len(stage_units), spec.model.layers):
                    _evaluate(search, stage_units, stage_tps, dp, mb, schedule, inv, grouping, v)


def _unit_stats(unit: Unit, tp: int, dp: int, mb: int, inv: ClusterInventory,
                spec: JobSpec) -> UnitStats:
    """Per-stage aggregates of ``unit`` (:mod:`hettrain.planning.bounds`), relaxed memory."""
    model, training = spec.model, spec.training
    a = _layer_s(spec, unit, mb, tp)
    head = _head_s(spec, unit, mb, tp)
    # a middle stage's exposed DP time: no stage's is lower (the bounds stay valid)
    dp_c, dp_e = _dp_sync_coeffs(unit, dp, tp, inv, spec, _microbatches(spec, dp, mb), a,
                                 0.0, False, False)
    dp_c += _optimizer_coeffs(unit, tp, dp, spec, False, False)[0]  # a middle stage's too
    cp = _cp(spec)
    masks = not cost.skips_masked_tiles(unit.device)
    mem = cost.stage_memory(model, training, tp=tp, dp=dp // cp, cp=cp, micro_batch=mb,
                            in_flight=1, first=False, last=False, cp_masks=masks)
    usable = unit.device.hbm_bytes * cost.MEMORY_HEADROOM
    cap = int((usable - mem.fixed) // mem.per_layer) if usable > mem.fixed else 0
    eb = cost.precision_bytes(training)
    act = (cost.activation_bytes_per_layer(cost.cp_local_model(model, cp), mb, tp,
                                           training.recompute, eb)
           + cost.cp_attention_extra_bytes_per_layer(model, mb, tp, cp, training.recompute, eb,
                                                     masks=masks))
    return UnitStats(a, head, dp_c, dp_e, min(cap, model.layers), mem.fixed, mem.per_layer,
                     act, usable, _microbatches(spec, dp, mb))


def _stage_room(unit: Unit, tp: int, dp: int, spec: JobSpec) -> int:
    """Most stages of ``tp`` GPUs ``unit`` can host at ``dp`` as placed
    (:meth:`Unit.stage_slots`), at most the layers."""
    return min(unit.stage_slots(tp, dp, _cp(spec)), spec.model.layers)


def _max_stages(unit: Unit, tp: int, dp: int, spec: JobSpec) -> int:
    """Most stages of ``tp`` GPUs ``unit`` can host at ``dp``: :func:`_stage_room` and
    ``spec.placement.maxGPUs`` (a unit alone using more than the cap has no layout;
    exact)."""
    k = _stage_room(unit, tp, dp, spec)
    cap = spec.placement.max_gpus
    return k if cap is None else min(k, cap // (dp * tp))


def _windowed(units: Sequence[Unit], spec: JobSpec, tp_opts: Sequence[Sequence[int]]) -> bool:
    """True when enumerating every stage count (at dp = 1) would exceed ``EXACT_LEAF_BUDGET``."""
    count = 1
    for u, tps in zip(units, tp_opts, strict=True):
        # (every TP group a stage of its own, wherever its datacenter: the placement's
        # equal split does not apply at one replica)
        cap = spec.placement.max_gpus
        count *= 1 + sum(min(u.tp_groups(tp), spec.model.layers,
                             *(() if cap is None else (cap // tp,))) for tp in tps)
        if count > EXACT_LEAF_BUDGET:
            return True
    return False


def _k_rich(max_k: int, layers: int) -> list[int]:
    """Stage counts worth trying on one unit alone: near full use, and every count where the
    layers per stage ``⌈L/k⌉`` steps (and one more stage, for the head)."""
    ks = {max_k, max_k - 1}
    # distinct values of ⌈L/q⌉ only (at most 2·√L, and only those ≤ max_k + 1): jump from
    # one value to the next instead of looping over every q
    q = max(1, layers // (max_k + 1))
    while q <= layers:
        base = -(-layers // q)
        ks.update((base, base + 1))
        if base == 1:
            break
        q = (layers - 1) // (base - 1) + 1  # the first q with a smaller ⌈L/q⌉
    return sorted(k for k in ks if 1 <= k <= max_k)


def _unit_choices(units: Sequence[Unit], tp_opts: Sequence[Sequence[int]], dp: int, mb: int,
                  inv: ClusterInventory, spec: JobSpec, window: bool, search: _Search
                  ) -> tuple[list[list[Choice]], list[Choice]]:
    """Per unit, every (tp, k ≥ 1) it can host at this (dp, mb) within
    ``spec.placement.maxGPUs`` and whose stage holds a layer (k near full use when ``window``);
    plus, when ``window``, the further single-unit layouts of :func:`_k_rich`. Stage counts
    the cap removes are counted in ``search.over_max_gpus`` (for the refusal message)."""
    out, singles = [], []
    for i, (u, tps) in enumerate(zip(units, tp_opts, strict=True)):
        opts = []
        for tp in tps:
            maxk = _max_stages(u, tp, dp, spec)
            if maxk < _stage_room(u, tp, dp, spec):
                search.over_max_gpus += 1
            if maxk < 1:
                continue
            stats = _unit_stats(u, tp, dp, mb, inv, spec)
            if stats.cap < 1:
                continue
            ks = [k for k in _k_options(maxk, not window) if k]
            # a unit whose deepest stage cannot hold a layer (bounds.stage_capacity) has no
            # layout with that many stages: exact
            opts.extend(c for k in ks if (c := Choice(i, tp, k, stats)).kcap >= k)
            if window:
                singles.extend(c for k in _k_rich(maxk, spec.model.layers)
                               if k not in ks and (c := Choice(i, tp, k, stats)).kcap >= k)
        out.append(opts)
    return out, singles


def _search_fast(search: _Search, units: tuple[Unit, ...], inv: ClusterInventory,
                 grouping: str) -> None:
    """Branch and bound over (dp, mb) pairs and per-unit (tp, k) choices (module docstring)."""
    spec = search.spec
    pinned_pp = spec.parallelism.pp
    dp_values = _dp_values(spec, units)
    tp_opts = [_tp_options(u, spec) for u in units]
    window = _windowed(units, spec, tp_opts)
    layer_s: dict[tuple[int, int, int], float] = {}  # (unit, tp, mb): cost.layer_time_s
    cheap = []
    for dp in dp_values:
        for mb in _mb_options(spec, dp):
            m = _microbatches(spec, dp, mb)
            cheap.append((_cheap_root(search, units, tp_opts, dp, mb, m, layer_s), dp, mb, m))
    # best root bound first; a re-plan's previous pair before all (the order decides only how
    # early the incumbent prunes, not which layout wins: Candidate.sort_key does)
    cheap.sort(key=lambda c: (c[1:3] != search.first_pair, c))
    pairs = []
    for root_lb, dp, mb, m in cheap:
        if root_lb >= search.bound():
            if (dp, mb) == search.first_pair:
                continue  # out of order: the rest are sorted by their bound
            break
        pair = _pair(search, units, tp_opts, dp, mb, m, inv, window)
        pairs.append(pair)
        if pair[0] < search.bound():
            _run_pair(search, units, inv, grouping, pair, pinned_pp)
    if search.hunting():
        built = {(p[1], p[2]) for p in pairs}
        pairs += [_pair(search, units, tp_opts, dp, mb, m, inv, window)
                  for _, dp, mb, m in cheap if (dp, mb) not in built]
        _record_shortfall(search, units, spec, dp_values, pairs, inv)


def _grouping_ceiling(ceiling_s: float | None, best_by: dict[str, Candidate], slack: float,
                      exhaustive: bool) -> float:
    """The bound a grouping's search starts from: ``ceiling_s`` and, in fast mode, the best
    layout of the groupings searched before it (times the re-plan slack, so a re-plan's
    near-best layouts stay; a hair above it, so a layout of equal time is still found and
    :meth:`Candidate.sort_key` still breaks the tie): the merged grouping then prunes
    against the split one's best from the start. Which layout wins does not change; the note
    comparing the groupings then says only that the other had none as fast."""
    found = [c.step_time_s for c in best_by.values()] if not exhaustive else []
    return min([math.inf if ceiling_s is None else ceiling_s,
                *(t * slack * (1 + 1e-9) for t in found)])


def _previous_pair(previous: Plan | None, cp: int) -> tuple[int, int] | None:
    """The search's ``(dp, mb)`` of ``previous`` (its dp times its CP degree, as
    :func:`_dp_values` counts replicas) when it ran context-parallel degree ``cp``, else None."""
    if previous is None or previous.stages[0].cp != cp:
        return None
    return previous.dp * cp, previous.micro_batch


def _cheap_root(search: _Search, units: Sequence[Unit], tp_opts: Sequence[Sequence[int]],
                dp: int, mb: int, m: int, layer_s: dict[tuple[int, int, int], float]) -> float:
    """A lower bound on a (dp, mb) pair's root bound (:func:`_pair`) from the layer times
    alone (they do not depend on ``dp``; memoised in ``layer_s``): every unit at its most
    stages, no memory caps. Pairs are visited in its order and only built (unit statistics,
    choices) when it beats the incumbent, so the pairs' cost does not grow with the number of
    divisors of the global batch that the bounds rule out."""
    spec = search.spec
    rate, min_a = 0.0, math.inf
    for u, tps in zip(units, tp_opts, strict=True):
        best = 0.0
        for tp in tps:
            maxk = _max_stages(u, tp, dp, spec)
            if maxk < _stage_room(u, tp, dp, spec):
                search.over_max_gpus += 1  # as _unit_choices counts it (refusal message)
            if maxk < 1:
                continue
            key = (id(u), tp, mb)
            a = layer_s.get(key)
            if a is None:
                a = layer_s[key] = _layer_s(spec, u, mb, tp)
            best = max(best, maxk / a)
            min_a = min(min_a, a)
        rate += best
    if rate <= 0:
        return math.inf
    layers = spec.model.layers
    return ((m - 1.0 / search.bubble_div) * layers / rate
            + layers * min_a / search.bubble_div)


def _pair(search: _Search, units: tuple[Unit, ...], tp_opts: Sequence[Sequence[int]], dp: int,
          mb: int, m: int, inv: ClusterInventory, window: bool) -> tuple:
    """One (dp, mb) pair: (root bound, dp, mb, m, choices per unit, what the units after each
    one can add at best, single-unit extras)."""
    layers = search.spec.model.layers
    opts, singles = _unit_choices(units, tp_opts, dp, mb, inv, search.spec, window, search)
    rest = _rest_sums(opts)
    # the root bounds every layout of the pair: the single-unit extras too (window mode)
    top = rest if not singles else _rest_sums(
        [[*o, *(c for c in singles if c.unit == i)] for i, o in enumerate(opts)])
    root = partial_lower_bound((), top[0][0], top[1][0], top[2][0], layers, m,
                               search.bubble_div, (0.0, 0.0), top[3][0], top[4][0])
    return (root, dp, mb, m, opts, rest, singles)


def _rest_sums(opts: Sequence[Sequence[Choice]]) -> tuple[list, ...]:
    """What the units from each index on can add at best (:func:`_pair`): layers per second,
    layer capacity, and the cheapest layer, LM head and layer + head, as suffix lists."""
    rest_rate, rest_cap, rest_a = [0.0], [0], [math.inf]
    rest_head, rest_a_head = [math.inf], [math.inf]
    for unit_opts in reversed(opts):
        rest_rate.append(rest_rate[-1] + max((c.k / c.stats.a for c in unit_opts),
                                             default=0.0))
        rest_cap.append(rest_cap[-1] + max((c.kcap for c in unit_opts), default=0))
        rest_a.append(min([rest_a[-1], *(c.stats.a for c in unit_opts)]))
        rest_head.append(min([rest_head[-1], *(c.stats.head for c in unit_opts)]))
        rest_a_head.append(min([rest_a_head[-1], *(c.a + c.stats.head for c in unit_opts)]))
    return (rest_rate[::-1], rest_cap[::-1], rest_a[::-1], rest_head[::-1], rest_a_head[::-1])


def _run_pair(search: _Search, units: tuple[Unit, ...], inv: ClusterInventory, grouping: str,
              pair: tuple, pinned_pp: int | None) -> None:
    """Collect one (dp, mb) pair's leaves under the incumbent; evaluate them best bound first."""
    _, dp, mb, m, opts, rest, singles = pair
    layers = search.spec.model.layers
    leaves: list[tuple[float, tuple[Choice, ...]]] = []
    search.leaf_bounds.clear()  # keyed by choices, which embed this pair's unit statistics
    search.pair_rows = _caps_rows(search, units, dp, mb, inv)
    search.between_memo.clear()  # boundary costs depend on (dp, mb)

    pair_costs: dict[tuple[int, int, int, int], float] = {}  # this pair's boundary costs

    def boundary_cost(x: Choice, y: Choice) -> float:
        key = (x.unit, x.tp, y.unit, y.tp)
        b = pair_costs.get(key)
        if b is None:
            b = pair_costs[key] = _boundary_memo(search, units[x.unit], units[y.unit], x.tp,
                                                 y.tp, dp, mb, inv)
        return b

    delays: dict[tuple[int, int], float] = {}

    def pair_delay(x: Choice, y: Choice) -> float:
        d = delays.get((x.unit, y.unit))
        if d is None:
            d = delays[(x.unit, y.unit)] = _link_delay_s(units[x.unit], units[y.unit], inv)
        return d

    search.pair_delay = pair_delay

    _seed_incumbent(search, units, inv, grouping, pair, pinned_pp, boundary_cost)
    _collect(search, opts, rest, 0, (), layers, m, dp, pinned_pp, leaves, boundary_cost, units)
    for choice in singles:
        if _single_may_beat(search, choice, layers, m, boundary_cost):
            _leaf(search, (choice,), layers, m, pinned_pp, leaves, boundary_cost, units)
    # one best-first queue over leaves and, once a leaf reaches the front, its stage orders:
    # an order is evaluated only if its own bound still beats the incumbent when it comes up.
    # Orders enter with a bound that ignores memory (the leaf's bubble divisor); when one
    # comes up it is bounded schedule by schedule under its memory caps (:func:`_refine_order`)
    # and goes back in if that raised its bound
    heap = [(lb, i, choices, None, 0) for i, (lb, choices) in enumerate(
        sorted(leaves, key=lambda x: (x[0], tuple((c.unit, c.tp, c.k) for c in x[1]))))]
    heapq.heapify(heap)
    seq = len(heap)
    while heap:
        lb, _, choices, order, stage = heapq.heappop(heap)
        if lb >= search.bound():
            break
        if order is not None:
            if stage == 0:  # an order's memory caps, once it comes up
                order_lb = _refine_order(search, units, choices, order, m, boundary_cost, dp,
                                         mb, inv)
                if order_lb > lb:  # back in the queue with the tighter bound (or dropped)
                    if order_lb < search.bound():
                        heapq.heappush(heap, (order_lb, seq, choices, order, 1))
                        seq += 1
                    continue
            _evaluate_order(search, units, choices, order, dp, mb, inv, grouping)
            continue
        if stage == 0:  # a leaf's memory-aware divisor, once it comes up
            stage = 1
            leaf_lb = _refine_leaf(search, choices, m, units, boundary_cost)
            if leaf_lb > lb:
                if leaf_lb < search.bound():
                    heapq.heappush(heap, (leaf_lb, seq, choices, None, stage))
                    seq += 1
                continue
        for order_lb, o in sorted(_order_bounds(search, units, choices, m, boundary_cost)):
            if order_lb < search.bound():
                heapq.heappush(heap, (max(lb, order_lb), seq, choices, o, 0))
                seq += 1


def _seed_incumbent(search: _Search, units: tuple[Unit, ...], inv: ClusterInventory,
                    grouping: str, pair: tuple, pinned_pp: int | None,
                    boundary_cost: Callable[[Choice, Choice], float]) -> None:
    """Evaluate a few greedy layouts of one (dp, mb) pair before its branch and bound, so the
    bounds prune from the start instead of after every leaf is collected: each unit alone
    (every choice, best bound first), every unit at its fastest choice together (units
    added fastest first while ``spec.placement.maxGPUs`` allows) and, while nothing has been
    found yet, that layout improved unit by unit (:func:`_descend`); each in its stage order
    with the best memory-aware bound. Up to ``SEED_EVALUATIONS`` of them, best bound first,
    each only while its bound beats the incumbent. Only adds evaluations, so the search stays
    exact."""
    _, dp, mb, m, opts, _rest, singles = pair
    layers = search.spec.model.layers
    seeds: list[tuple[float, tuple[Choice, ...]]] = []
    for choice in (*itertools.chain.from_iterable(opts), *singles):
        if _single_may_beat(search, choice, layers, m, boundary_cost):
            _leaf(search, (choice,), layers, m, pinned_pp, seeds, boundary_cost, units)
    fastest = sorted((max(o, key=lambda c: (c.rate, -c.tp * c.k)) for o in opts if o),
                     key=lambda c: -c.rate)
    together: list[Choice] = []
    for c in fastest:
        gpus = dp * (c.tp * c.k + sum(x.tp * x.k for x in together))
        if search.max_gpus is None or gpus <= search.max_gpus:
            together.append(c)
    together_leaf = tuple(sorted(together, key=lambda c: c.unit))
    if len(together) > 1:
        _leaf(search, together_leaf, layers, m, pinned_pp, seeds, boundary_cost, units)
    if search.best is None:  # the first layout found bounds the whole first pair's walk
        descended = _descend(search, opts, together, dp, m, units, boundary_cost)
        if len(descended) > 1 and descended != together_leaf:
            _leaf(search, descended, layers, m, pinned_pp, seeds, boundary_cost, units)
    seeds.sort(key=lambda x: (x[0], tuple((c.unit, c.tp, c.k) for c in x[1])))
    for lb, choices in seeds[:SEED_EVALUATIONS]:
        if lb >= search.bound():
            break
        # its stage order with the best memory-aware bound (:func:`_refine_order`)
        bounds = [(max(order_lb, _refine_order(search, units, choices, order, m,
                                               boundary_cost, dp, mb, inv)), order)
                  for order_lb, order in _order_bounds(search, units, choices, m, boundary_cost)
                  if order_lb < search.bound()]
        if not bounds:
            continue
        order_lb, order = min(bounds)
        if order_lb < search.bound():
            _evaluate_order(search, units, choices, order, dp, mb, inv, grouping)


def _descend(search: _Search, opts: list[list[Choice]], start: Sequence[Choice], dp: int,
             m: int, units: tuple[Unit, ...], boundary_cost: Callable[[Choice, Choice], float]
             ) -> tuple[Choice, ...]:
    """A seed layout (:func:`_seed_incumbent`): from ``start``, each unit in turn takes the
    choice (or none) that gives the lowest leaf bound with the others kept, until a pass
    changes nothing. The bound sees memory capacity and boundary costs, which the fastest
    choices alone ignore. Only picks a layout to evaluate: exactness does not depend on it."""
    current: dict[int, Choice] = {c.unit: c for c in start}

    def bound_of(chosen: dict[int, Choice]) -> float:
        leaf = tuple(chosen[u] for u in sorted(chosen))
        if not leaf or (search.max_gpus is not None
                        and dp * sum(c.tp * c.k for c in leaf) > search.max_gpus):
            return math.inf
        bounds, last = _leaf_boundaries(search, leaf, units, boundary_cost)
        return LeafBound(leaf, search.spec.model.layers, m).bound(bounds, last,
                                                                   search.bubble_div)

    best = bound_of(current)
    for _ in range(len(opts)):
        changed = False
        for i, unit_opts in enumerate(opts):
            for choice in (None, *unit_opts):
                trial = dict(current)
                if choice is None:
                    trial.pop(i, None)
                else:
                    trial[i] = choice
                lb = bound_of(trial)
                if lb < best:
                    best, current, changed = lb, trial, True
        if not changed:
            break
    return tuple(current[u] for u in sorted(current))


NO_CHOICES = PartialSums()


def _single_may_beat(search: _Search, choice: Choice, layers: int, m: int,
                     boundary_cost: Callable[[Choice, Choice], float]) -> bool:
    """Whether the one-unit layout ``choice`` passes the partial bound (nothing left to add;
    :func:`_collect` applies the same to its leaves) before its full bound is computed."""
    inside = (0.0, 0.0)
    if choice.k > 1:
        b = boundary_cost(choice, choice)
        inside = (max(0.0, b), 0.0 + b * (choice.k - 1))
    lb = partial_bound_of_sums(NO_CHOICES.add(choice), 0.0, 0, math.inf, layers, m,
                               search.bubble_div, inside)
    return lb < search.bound() and lb != math.inf


def _collect(search: _Search, opts: list[list[Choice]], rest: tuple, i: int,
             chosen: tuple[Choice, ...], layers: int, m: int, dp: int, pinned_pp: int | None,
             out: list, boundary_cost: Callable[[Choice, Choice], float],
             units: tuple[Unit, ...], inside: tuple[float, float] = (0.0, 0.0),
             sums: PartialSums = NO_CHOICES) -> None:
    """Depth-first over units: skip a unit or take one of its choices; keep leaves under bound.
    ``inside``: slowest and sum of the boundaries inside the chosen units (partial bound);
    ``sums``: the chosen units' :class:`bounds.PartialSums`."""
    if i == len(opts):
        _leaf(search, chosen, layers, m, pinned_pp, out, boundary_cost, units)
        return
    cap = search.max_gpus
    for choice in (None, *opts[i]):
        nxt, nxt_inside, nxt_sums = chosen, inside, sums
        if choice is not None:
            nxt = (*chosen, choice)
            nxt_sums = sums.add(choice)
            if cap is not None and dp * nxt_sums.gpus > cap:
                search.over_max_gpus += 1  # the world size only grows deeper down: exact
                continue
            if choice.k > 1:
                b = boundary_cost(choice, choice)
                nxt_inside = (max(inside[0], b), inside[1] + b * (choice.k - 1))
        # also at a complete leaf (nothing left to add: its own stages' rate and capacity,
        # cheaper than its full bound), and inf (no layout) prunes before any incumbent
        lb = partial_bound_of_sums(nxt_sums, rest[0][i + 1], rest[1][i + 1], rest[2][i + 1],
                                   layers, m, search.bubble_div, nxt_inside, rest[3][i + 1],
                                   rest[4][i + 1])
        if lb >= search.bound() or lb == math.inf:
            continue
        _collect(search, opts, rest, i + 1, nxt, layers, m, dp, pinned_pp, out, boundary_cost,
                 units, nxt_inside, nxt_sums)


def _leaf(search: _Search, chosen: tuple[Choice, ...], layers: int, m: int,
          pinned_pp: int | None, out: list, boundary_cost: Callable[[Choice, Choice], float],
          units: tuple[Unit, ...]) -> None:
    """Append ``(bound, chosen)`` to ``out`` when its full bound is under the incumbent (with
    the search's largest bubble divisor: :func:`_refine_leaf` adds the memory caps)."""
    if not chosen or (pinned_pp is not None and sum(c.k for c in chosen) != pinned_pp):
        return
    if sum(c.kcap for c in chosen) < layers:  # no layout (its bound would be inf)
        return
    if not _any_schedule_fits(search, sum(c.k for c in chosen), m):
        return
    bounds, last = _leaf_boundaries(search, chosen, units, boundary_cost)
    leaf = LeafBound(chosen, layers, m)
    leaf.div = search.bubble_div
    lb = leaf.bound(bounds, last, search.bubble_div, search.bound())
    if lb < search.bound():
        out.append((lb, chosen))
        search.leaf_bounds[chosen] = leaf  # its orders' bounds reuse the order-free terms


def _ordered_bounds(search: _Search, ordered: Sequence[Choice],
                    boundary_cost: Callable[[Choice, Choice], float]
                    ) -> tuple[float, float, float]:
    """``bounds.ordered_boundaries`` of a fixed order with the hops' transfers alone (the
    links' latency hidden: ``_boundary_memo``'s default), and the datacenter links' delay
    between consecutive units (``search.pair_delay``) that every layout of the order pays
    whole (``LeafBound.bound`` adds it undivided): 1F1B and ZB-H1 once per step (their
    warm-up), interleaved in each of its ``v`` hops per microbatch, which its bubble divides
    by ``v`` (or, where a hop is the slowest, on every microbatch). Not for helix and
    interleaved-zb (``search.delay_factor`` 0), whose hops may sit under their stages."""
    p_max, p_sum = ordered_boundaries(ordered, boundary_cost)
    delay = sum(search.pair_delay(x, y) for x, y in itertools.pairwise(ordered))
    return p_max, p_sum, delay * search.delay_factor


def _leaf_boundaries(search: _Search, chosen: tuple[Choice, ...], units: tuple[Unit, ...],
                     boundary_cost: Callable[[Choice, Choice], float]
                     ) -> tuple[Callable[[], tuple[float, ...]], Choice | None]:
    """The leaf's boundary bounds (a function: ``LeafBound.bound`` calls it at most once, and
    only past its cheap bound) and its last unit when its order is fixed (more than
    ``MAX_PERMUTED_UNITS`` units: that order's exact boundaries)."""
    if len(chosen) > MAX_PERMUTED_UNITS:  # one order only: its exact boundaries
        by_unit = {c.unit: c for c in chosen}
        ordered = [by_unit[u] for u in _fixed_order(units, list(by_unit))]

        def exact() -> tuple[float, ...]:
            return _ordered_bounds(search, ordered, boundary_cost)
        return exact, ordered[-1]

    def any_order() -> tuple[float, float, float]:
        p_max, p_sum = boundary_lower_bounds(chosen, boundary_cost, search.between_memo)
        return p_max, p_sum, _crossings_delay_bound(search, chosen, units)
    return any_order, None


def _crossings_delay_bound(search: _Search, chosen: Sequence[Choice],
                           units: Sequence[Unit]) -> float:
    """A lower bound on the datacenter links' delay (``search.pair_delay``) summed over the
    hops of any order of ``chosen`` (:func:`_ordered_bounds`' third term): units in ``k``
    datacenters are crossed between at least ``k − 1`` times, each crossing at least the
    smallest delay between two of them (0 where a unit spans datacenters: merged units share
    them). Memoised per set of units (``search.between_memo``)."""
    if not search.delay_factor:
        return 0.0
    key = ("delay", *sorted({c.unit for c in chosen}))
    got = search.between_memo.get(key)
    if got is not None:
        return got[0]
    dcs = {units[c.unit].datacenters for c in chosen}
    out = 0.0
    if len(dcs) > 1 and all(len(d) == 1 for d in dcs):
        out = (len(dcs) - 1) * min(
            search.pair_delay(x, y) for x, y in itertools.combinations(chosen, 2)
            if units[x.unit].datacenters != units[y.unit].datacenters)
    search.between_memo[key] = (out, out)
    return out


def _refine_leaf(search: _Search, chosen: tuple[Choice, ...], m: int, units: tuple[Unit, ...],
                 boundary_cost: Callable[[Choice, Choice], float]) -> float:
    """The leaf's bound from its memory caps (inf: no order of its stages holds the layers).

    The smallest, over the schedules that can run its stages (:func:`_schedule_fits`) and
    that some stage order may run within memory (:meth:`CapsRows.may_fit`: each unit's block
    at its own best offset), of the leaf's bound with that schedule's bubble divisor and each
    unit's stages holding at most what its block holds at that best offset (``Choice.limit``).
    Admissible: every layout runs one of those schedules, and in every order each unit's
    block sits at some offset, where it holds at most its best offset's layers, so that
    schedule's layouts are among those the limited choices bound. A schedule whose unlimited
    bound already reaches the best so far (or the incumbent) counts with that bound, fitting
    or not (a lower term only loosens the minimum), and its caps are not built. The largest
    divisor among the schedules counted is kept as the leaf's ``div`` (its orders' first
    bounds: each order runs one of them). While nothing has
    been found, a leaf whose 1F1B caps may hold the layers but whose schedules' may not is
    still expanded (``-inf``: its queued bound stands), so a refusal names the closest miss."""
    leaf = _leaf_bound(search, chosen, m)
    rows = search.pair_rows
    if rows is None:
        return -math.inf
    layers = search.spec.model.layers
    pp = sum(c.k for c in chosen)
    bounds, last = _leaf_boundaries(search, chosen, units, boundary_cost)
    best, top = math.inf, 0.0
    for schedule, v in _schedule_options(search.spec, pp, layers, exhaustive=False):
        if not _schedule_fits(schedule, v, pp, m, layers):
            continue
        div = _bubble_divisor(schedule, v, search.zb_div)
        cutoff = min(best, search.bound())
        lb = leaf.bound(bounds, last, div, cutoff)
        if lb < cutoff:  # else its term is at least lb whether it fits or not: skip the caps
            held = [rows.best_offset(c.unit, c.tp, c.k, pp, schedule, v) for c in chosen]
            if min(held) < 0 or sum(held) < layers:  # not rows.may_fit
                continue
            limited = tuple(c if h >= c.kcap else Choice(c.unit, c.tp, c.k, c.stats, h)
                            for c, h in zip(chosen, held, strict=True))
            if limited != chosen:
                lb = LeafBound(limited, layers, m).bound(bounds, last, div, cutoff)
        top = max(top, div)
        best = min(best, lb)
    if best == math.inf:
        blocks = [(c.unit, c.tp, c.k) for c in chosen]
        return -math.inf if search.hunting() and rows.may_fit(blocks, "1f1b", 1) else best
    leaf.div = top
    return best


def _order_bounds(search: _Search, units: tuple[Unit, ...], choices: tuple[Choice, ...], m: int,
                  boundary_cost: Callable[[Choice, Choice], float]
                  ) -> list[tuple[float, tuple[int, ...]]]:
    """Every stage order of ``choices`` with its own bound (exact boundaries, known last unit)
    at the leaf's divisor (:func:`_refine_leaf`; valid for all its orders):
    :func:`_refine_order` adds each order's memory caps."""
    ks = [0] * len(units)
    for c in choices:
        ks[c.unit] = c.k
    by_unit = {c.unit: c for c in choices}
    leaf = _leaf_bound(search, choices, m)
    out = []
    cutoff = search.bound()
    for order in _orders(units, ks, False):
        ordered = [by_unit[i] for i in order]
        boundaries = _lazy(lambda ordered=ordered: _ordered_bounds(search, ordered,
                                                                   boundary_cost))
        out.append((leaf.bound(boundaries, ordered[-1], leaf.div, cutoff), order))
    return out


def _refine_order(search: _Search, units: tuple[Unit, ...], choices: tuple[Choice, ...],
                  order: tuple[int, ...], m: int,
                  boundary_cost: Callable[[Choice, Choice], float], dp: int, mb: int,
                  inv: ClusterInventory) -> float:
    """A tighter bound of one stage order, from its memory caps (inf: no layout).

    The smallest, over the schedules that can run the order (:func:`_schedule_fits`) and
    whose caps let it hold the layers (``CapsRows.fits``), of that schedule's own bound: the
    larger of the leaf's bound with the schedule's bubble divisor and
    :func:`bounds.order_caps_bound` with every stage's exact layer cap under that schedule at
    its position and its divisor (interleaved's ``v`` layers per stage and ``v``-fold
    boundaries relaxed to 1 and 1×, which only lowers it). Admissible: every layout of the
    order runs one of those schedules, and both terms bound its step time under that schedule
    (a schedule that cannot hold the layers has no layout at all). A schedule whose leaf bound
    already reaches the best so far (or the incumbent) skips its caps bound: its term is then
    at least that value anyway. While nothing has been found, an order whose 1F1B caps hold
    the layers but whose schedules' do not is still evaluated (``-inf``: its queued bound
    stands), so a refusal names the closest miss as before."""
    by_unit = {c.unit: c for c in choices}
    blocks = _blocks(by_unit, order)
    rows = _caps_rows(search, units, dp, mb, inv)
    ordered = [by_unit[i] for i in order]
    leaf = _leaf_bound(search, choices, m)
    layers = search.spec.model.layers
    pp = sum(c.k for c in choices)
    p_max, p_sum = ordered_boundaries(ordered, boundary_cost)
    delay = sum(search.pair_delay(x, y) for x, y in itertools.pairwise(ordered))
    if delay > 0:  # the other schedules' hops pay the links' latency themselves

        def full_cost(x: Choice, y: Choice) -> float:
            return _boundary_memo(search, units[x.unit], units[y.unit], x.tp, y.tp, dp, mb,
                                  inv, hidden=False)
        paying = ordered_boundaries(ordered, full_cost)
    cutoff = search.bound()
    best = math.inf
    for schedule, v in _schedule_options(search.spec, pp, layers, exhaustive=False):
        if not (_schedule_fits(schedule, v, pp, m, layers) and rows.fits(blocks, schedule, v)):
            continue
        div = _bubble_divisor(schedule, v, search.zb_div)
        # the links' delay: whole where the schedule hides it with warm-up (the bound
        # divides the sum by div); elsewhere in every hop across a link
        boundaries = (p_max, p_sum) if delay == 0 else (
            (p_max, p_sum + delay * div) if schedule in cost.HIDES_LINK_LATENCY else paying)
        lb = leaf.bound(boundaries, ordered[-1], div, min(best, cutoff))
        if lb < best and lb < cutoff:
            groups = _caps_groups(ordered, rows.caps(blocks, schedule, v), layers - (pp - 1))
            lb = max(lb, order_caps_bound(groups, layers, m, div, boundaries, leaf.dp_bound()))
        best = min(best, lb)
    if best == math.inf and search.hunting() and _memory_fits(rows, blocks):
        return -math.inf
    return best


def _caps_groups(ordered: Sequence[Choice], caps: Sequence[int], top: int
                 ) -> list[tuple[float, float, list[int]]]:
    """The stages of an order as :func:`bounds.order_caps_bound`'s groups ``(a, b, caps)``
    (one per unit, the last stage on its own for its LM head), caps clamped at ``top``."""
    groups, start = [], 0
    for c in ordered:
        block = [x if x < top else top for x in caps[start:start + c.k]]
        start += c.k
        if c is ordered[-1]:  # the last stage also runs the LM head
            if len(block) > 1:
                groups.append((c.a, 0.0, block[:-1]))
            groups.append((c.a, c.stats.head, block[-1:]))
        else:
            groups.append((c.a, 0.0, block))
    return groups


def _leaf_bound(search: _Search, choices: tuple[Choice, ...], m: int) -> LeafBound:
    """The leaf's :class:`LeafBound` (kept by :func:`_leaf`, else a new one)."""
    leaf = search.leaf_bounds.get(choices)
    if leaf is None:
        leaf = search.leaf_bounds[choices] = LeafBound(choices, search.spec.model.layers, m)
        leaf.div = search.bubble_div
    return leaf


def _blocks(by_unit: dict[int, Choice], order: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """The stage order as blocks ``(unit, tp, k)`` (:mod:`hettrain.planning.capsrows`)."""
    return [(i, by_unit[i].tp, by_unit[i].k) for i in order]


def _lazy(fn: Callable[[], tuple[float, ...]]) -> Callable[[], tuple[float, ...]]:
    """``fn``, called at most once (its result kept)."""
    kept: list[tuple[float, ...]] = []

    def once() -> tuple[float, ...]:
        if not kept:
            kept.append(fn())
        return kept[0]
    return once


def _caps_rows(search: _Search, units: tuple[Unit, ...], dp: int, mb: int,
               inv: ClusterInventory) -> CapsRows:
    """The search's memoised block layer caps (:mod:`hettrain.planning.capsrows`) at
    ``(dp, mb)``: each stage's ``max_layers`` as :func:`_stage_costs_raw` computes it (from
    its memory alone), shared by every position with the same memory arguments."""
    rows = search.caps_rows.get((dp, mb))
    if rows is None:
        spec = search.spec
        model, training = spec.model, spec.training
        m = _microbatches(spec, dp, mb)  # dp counts the dp·cp replicas
        cp = _cp(spec)
        usable = [u.device.hbm_bytes * cost.MEMORY_HEADROOM for u in units]
        caps: dict[tuple, int] = {}  # (unit, tp, position key): layer cap
        # (tp, position key, CP masks materialised): independent of the device otherwise
        mems: dict[tuple, cost.StageMemory] = {}
        masks = [not cost.skips_masked_tiles(u.device) for u in units]

        def position_key(i: int, pp: int, schedule: str, v: int) -> tuple:
            """What the memory of the stage at ``i`` of ``pp`` depends on besides its unit
            and TP degree (the arguments of ``cost.schedule_memory_args``, without building
            them): 1F1B's and ZB-H1's through the microbatches in flight (and ZB-H1's pending
            W passes), interleaved's through the chunk-forwards in flight (and the first
            stage's token ids), so rows of different depths share their entries."""
            if schedule == "1f1b" or schedule == "zb-h1":
                depth = pp - i
                return (schedule, i == 0, depth == 1, depth if depth < m else m,
                        cost.zb_pending_weight_grads(i, pp, m) if schedule == "zb-h1" else 0)
            if schedule == "interleaved" and v > 1:
                chunks = 2 * (pp - i - 1) + (v - 1) * pp + 1
                return (schedule, v, i == pp - 1, chunks if chunks < m * v else m * v,
                        min(pp * v, m) if i == 0 else -1)
            return (schedule, i == 0, i == pp - 1,
                    *cost.schedule_memory_args(i, pp, m, schedule, v).values())

        def stage_cap(unit: int, tp: int, i: int, pp: int, schedule: str, v: int) -> int:
            pos = position_key(i, pp, schedule, v)
            cap = caps.get((unit, tp, pos))
            if cap is None:
                key = (tp, pos, masks[unit])
                mem = mems.get(key)
                if mem is None:
                    mem = mems[key] = cost.stage_memory(
                        model, training, tp=tp, dp=dp // cp, cp=cp, micro_batch=mb,
                        first=i == 0, last=i == pp - 1, cp_masks=masks[unit],
                        **cost.schedule_memory_args(i, pp, m, schedule, v))
                room = usable[unit]
                cap = caps[(unit, tp, pos)] = (int((room - mem.fixed) // mem.per_layer)
                                               if room > mem.fixed else 0)
            return cap

        rows = search.caps_rows[(dp, mb)] = CapsRows(spec.model.layers, stage_cap)
    return rows


def _memory_fits(rows: CapsRows, blocks: Sequence[tuple[int, int, int]]) -> bool:
    """Whether the stages of an order (as blocks) can hold every layer, one or more each,
    under 1F1B's memory caps (embedding and head included). Exact for every schedule: at each
    position 1F1B holds the fewest microbatches in flight (interleaved and GPipe hold at least
    as many, ZB-H1 as many plus its stash; ``cost.schedule_memory_args``), so its caps are the
    largest."""
    return rows.fits(blocks, "1f1b", 1)


def _evaluate_order(search: _Search, units: tuple[Unit, ...], choices: tuple[Choice, ...],
                    order: tuple[int, ...], dp: int, mb: int, inv: ClusterInventory,
                    grouping: str) -> None:
    """One stage order of ``choices`` under the schedules that can win.

    Dominance (exact in this cost model): with ``X`` the slowest of stages and boundaries and
    ``Σ`` their sum, 1F1B costs ``m·X + (Σ − X)`` and ZB-H1 ``m·X + (Σ − X)/z``, ``z ≥ 1`` its
    divisor on this layout (3, or from measured B/W splits: :func:`_zb_div`), so ZB-H1 ≤
    1F1B on every split both fit. Interleaved with ``v`` chunks multiplies boundary traffic by
    ``v`` (``X_v ≥ X``, ``Σ_v ≥ Σ``) and costs ``(m − 1/v)·X_v + Σ_v/v ≥ m·X + (Σ − X)/z +
    (Σ − X)·(1/v − 1/z)``, the last term ≥ 0 where ``v ≤ z`` (``v ≤ AUTO_MAX_CHUNKS = 3``
    with the catalog's ``z = 3``), so ZB-H1 ≤ interleaved on every split both fit. Only those
    (divisor ``≤ z``) are skipped. The stage times do not depend on the
    schedule; memory does, and only through each stage's layer cap (``max_layers``). So a
    schedule whose caps are all ≤ ZB-H1's (and whose splits need ≥ 1 layer per stage, as ZB-H1's
    do) fits only splits ZB-H1 fits and never wins: it is skipped. Any other (1F1B, or
    interleaved, when ZB-H1's stash caps a stage harder than their activations do) is
    evaluated, so under ``schedule: auto`` with ``pp ≥ 2`` the search equals the exhaustive
    one over 1F1B, ZB-H1 and interleaved ``v ≤ 3``; for ``pp = 1`` only 1F1B exists.
    """
    spec = search.spec
    ks = [0] * len(units)
    tps = [0] * len(units)
    for c in choices:
        ks[c.unit], tps[c.unit] = c.k, c.tp
    pp = sum(ks)
    schedules = _schedule_options(spec, pp, spec.model.layers, exhaustive=False)
    stage_units = tuple(units[i] for i in order for _ in range(ks[i]))
    stage_tps = tuple(tps[i] for i in order for _ in range(ks[i]))
    zb_caps: list[int] | None = None
    zb_div = 0.0  # ZB-H1's divisor of this layout, once it ran
    for schedule, v in schedules:
        if zb_caps is not None and _bubble_divisor(
                schedule, v, zb_div, pp, _microbatches(spec, dp, mb)) <= zb_div and all(
                c <= z for c, z in zip(_layer_caps(search, stage_units, stage_tps, dp, mb,
                                                   schedule, v, inv), zb_caps, strict=True)):
            continue  # dominated by ZB-H1 (docstring)
        _evaluate(search, stage_units, stage_tps, dp, mb, schedule, inv, grouping, v)
        if schedule == "zb-h1" and spec.parallelism.schedule == "auto":
            zb_caps = _layer_caps(search, stage_units, stage_tps, dp, mb, "zb-h1", 1, inv)
            zb_div = _zb_div(spec, (u.device for u in stage_units), mb)


def _layer_caps(search: _Search, units: Sequence[Unit], tps: Sequence[int], dp: int, mb: int,
                schedule: str, v: int, inv: ClusterInventory) -> list[int]:
    """Layers each stage can hold under ``schedule`` (memoised stage costs)."""
    m = _microbatches(search.spec, dp, mb)
    stages, _ = _stage_costs(units, tps, dp, mb, m, schedule, inv, search.spec,
                             search.stage_memo, v)
    return [s.max_layers for s in stages]


def _state_shortfall(search: _Search, units: Sequence[Unit], need_gib: float) -> None:
    """Record that the weights, gradients and optimizer state alone exceed every layout."""
    dev = max(units, key=lambda u: u.device.hbm_gib).device
    usable = dev.hbm_gib * cost.MEMORY_HEADROOM
    need = need_gib * cost.MEMORY_HEADROOM  # need_gib is HBM with headroom; this is bytes
    search.shortfall(need / usable, (
        f"the weights, gradients and optimizer state alone need {need:.1f} GiB per device "
        f"on the widest layout; the largest device ({dev.name}) has {usable:.1f} GiB usable "
        f"({cost.MEMORY_HEADROOM:.0%} of {dev.hbm_gib:.0f} GiB)"), state_only=True)


def _record_shortfall(search: _Search, units: tuple[Unit, ...], spec: JobSpec,
                      dp_values: Sequence[int], pairs: Sequence, inv: ClusterInventory) -> None:
    """When nothing fits: the real per-device peak of the most spread-out layout of each
    ``(dp, mb)`` pair (:func:`_widest_shortfall`), or that the state alone does not fit."""
    if search.memory_shortfall is not None:
        return
    dropped: list[float] = []
    _candidates_outer(units, spec, dp_values, False, dropped)
    if dropped:
        _state_shortfall(search, units, min(dropped))
    for _, dp, mb, m, *_ in pairs:
        _widest_shortfall(search, units, dp, mb, m, inv)


def _widest_shortfall(search: _Search, units: tuple[Unit, ...], dp: int, mb: int, m: int,
                      inv: ClusterInventory) -> None:
    """Record the memory miss of the most spread-out layout at ``(dp, mb)``: every unit at the
    TP and stage count using most of its GPUs (``spec.parallelism`` pins and ``maxGPUs``
    kept; a pinned ``pp`` takes the first stages of the fixed order, none when fewer stages
    fit), layers split evenly,
    under the schedule needing the least memory. The need named is the real peak of the stage
    furthest over its memory (embedding, head, in-flight microbatches and the schedule's
    stash included, :func:`cost.stage_memory`), as :func:`_evaluate` reports it; nothing is
    recorded when that layout fits (its miss was not memory)."""
    spec = search.spec
    layers = spec.model.layers
    widest: dict[int, tuple[int, int]] = {}
    for i, u in enumerate(units):
        for tp in _tp_options(u, spec):
            k = _max_stages(u, tp, dp, spec)
            if k >= 1 and (i not in widest or (k * tp, tp) > (widest[i][1] * widest[i][0],
                                                               widest[i][0])):
                widest[i] = (tp, k)
    if not widest:
        return
    order = _fixed_order(units, sorted(widest))
    stage_units = [units[i] for i in order for _ in range(widest[i][1])]
    stage_tps = [widest[i][0] for i in order for _ in range(widest[i][1])]
    if len(stage_units) < (spec.parallelism.pp or 0):
        return  # the pinned depth does not fit these GPUs at this dp (e.g. with CP's ranks)
    pp = min(len(stage_units), spec.parallelism.pp or layers, layers)
    stage_units, stage_tps = stage_units[:pp], stage_tps[:pp]
    per = math.ceil(layers / pp)
    worst = None
    for schedule, v in _schedule_options(spec, pp, layers):
        if not _schedule_fits(schedule, v, pp, m, layers):
            continue
        _, mems = _stage_costs(stage_units, stage_tps, dp, mb, m, schedule, inv, spec,
                               search.stage_memo, v)
        ratio, i = max((mem.bytes_for(per) / usable, i) for i, (mem, usable) in enumerate(mems))
        if worst is None or ratio < worst[0]:
            worst = (ratio, i, schedule, mems[i])
    if worst is None or worst[0] <= 1.0:
        return
    ratio, i, schedule, (mem, usable) = worst
    search.shortfall(ratio, (
        f"stage {i} of {pp} ({stage_units[i].device.name}, tp={stage_tps[i]}, "
        f"{_dp_words(spec, dp)}, microBatch {mb}, {schedule}) needs "
        f"{mem.bytes_for(per) / cost.GIB:.1f} GiB per device for {per} layers; it has "
        f"{usable / cost.GIB:.1f} GiB usable ({cost.MEMORY_HEADROOM:.0%} of "
        f"{stage_units[i].device.hbm_gib:.0f} GiB)"))


# ---------------------------------------------------------------- public API


def _izb_note(best: Candidate, spec: JobSpec) -> str:
    """What interleaved-zb's replayed order divides 1F1B's bubble by (with F = B = W)."""
    m = _microbatches(spec, best.dp, best.micro_batch)
    div = interleaved_zb.bubble_divisor(best.pp, m, best.chunks)
    return (f"interleaved-zb order ({best.chunks} chunks, {m} microbatches): 1F1B's bubble / "
            f"{div:.2f} at F = B = W (at best / {3 * best.chunks})")


def _helix_note(best: Candidate, spec: JobSpec) -> str:
    """Which helix order the plan runs and what its replay divides 1F1B's bubble by."""
    m = _microbatches(spec, best.dp, best.micro_batch)
    div = helix.bubble_divisor(best.pp, spec.model.layers, m, helix.costs_for(spec.model),
                               best.helix_hop, best.helix_filo)
    order = ("first in, last out (all microbatches in flight)" if best.helix_filo
             else f"at most {min(best.pp, m)} microbatches in flight")
    return (f"helix order: {order}, {m} microbatches, hop {best.helix_hop:g} layer-forwards: "
            f"1F1B's bubble / {div:.2f}")


def _zb_note(best: Candidate, spec: JobSpec) -> str:
    """Where a zero-bubble schedule's bubble came from: the measured B/W split of the devices
    whose profile has one (:func:`_zb_div`), or the catalog rule."""
    eb = cost.precision_bytes(spec.training)
    split = sorted({u.device.name for u in best.units if u.device.profile is not None
                    and u.device.profile.weight_grad is not None
                    and u.device.profile.matches(spec.model, eb)})
    if best.cp > 1 or not split:
        return ("ZB-H1 bubble from the catalog rule: a third of 1F1B's (no measured B/W "
                "split of this layer)")
    rest = ("" if len(split) == len({u.device.name for u in best.units})
            else "; other devices from the catalog rule (a third)")
    div = cost.zb_bubble_divisor([u.device for u in best.units], spec.model, spec.training,
                                 best.micro_batch)
    return (f"ZB-H1 bubble from the measured B/W split of {', '.join(split)} (device profiles: "
            f"(F + B - W)/(F + B + W) = {1 / div:.3f} of 1F1B's at microBatch "
            f"{best.micro_batch}{rest})")


def _notes(best: Candidate, search: _Search, alt: Candidate | None, inv: ClusterInventory,
           spec: JobSpec, merged_slower: bool = False) -> list[str]:
    notes = [
        f"searched {search.evaluated} layouts ({'exhaustive' if search.exhaustive else 'fast'})",
        f"chose dp={best.dp // best.cp} pp={best.pp} tp={'/'.join(map(str, best.tps))} "
        + (f"cp={best.cp} " if best.cp > 1 else "") +
        f"mb={best.micro_batch} schedule={best.schedule}"
        + (f" chunks={best.chunks}" if chunked_schedule(best.schedule) else ""),
    ]
    if _uneven(spec, best.dp):
        true_dp, m = best.dp // best.cp, _microbatches(spec, best.dp, best.micro_batch)
        short = _short_replicas(spec, best.dp, best.micro_batch)
        notes.append(f"uneven data parallelism: globalBatch {spec.training.global_batch} over "
                     f"dp={true_dp}, {true_dp - short} replicas run {m} microbatches and "
                     f"{short} run {m - 1} (the step waits for the {m}; gradients weighted "
                     "by each replica's share)")
    crossings = [i for i in range(best.pp - 1)
                 if not set(best.units[i].datacenters) & set(best.units[i + 1].datacenters)]
    if crossings:
        notes.append(f"pipeline boundaries after stage(s) {crossings} cross a datacenter link")
    if best.link_delay_s > 0:
        notes.append(f"link warm-up: stages run {'/'.join(map(str, best.link_warmup))} extra "
                     "forwards before their first backward, so the links' latency is paid "
                     f"once per step ({best.link_delay_s * 1e3:.1f} ms), not per microbatch")
    if merged_slower:
        notes.append(f"PP across datacenters beats DP across them: no DP-across layout "
                     f"within {best.step_time_s:.3f}s per step")
    elif alt is not None:
        better, worse = ("PP", "DP") if best.grouping == "split" else ("DP", "PP")
        notes.append(
            f"{better} across datacenters beats {worse} across them: "
            f"{best.step_time_s:.3f}s vs {alt.step_time_s:.3f}s per step"
        )
    eb = cost.precision_bytes(spec.training)
    measured = sorted({u.device.name for u in best.units if u.device.profile is not None
                       and u.device.profile.matches(spec.model, eb)})
    comm = sorted({u.device.name for u in best.units
                   if cost.measured_comm(u.device) is not None})
    local = cost.cp_local_model(spec.model, best.cp)
    staged = sorted({u.device.name for u in best.units
                     if u.device.profile is not None
                     and u.device.profile.stage_matches(local, eb)})
    if measured:
        notes.append(f"layer times of {', '.join(measured)} from device profiles (measured); "
                     "other devices" + ("" if staged else ", the LM head")
                     + ("" if comm else " and communication") + " from the catalog model")
    slow = _crowding(best.units, best.tps, best.dp, best.micro_batch, spec)
    if slow:
        crowded = sorted({(u.device.name, f, u.device.profile.concurrent_ranks)
                          for u, f in zip(best.units, slow, strict=True) if f != 1.0})
        notes.append("compute of " + ", ".join(
            f"{name} x{f:.3f}" for name, f, _ in crowded) + " (device profiles: the layer "
            "measured with " + ", ".join(sorted({str(r) for _, _, r in crowded}))
            + " ranks of one node at once): the plan keeps several busy ranks on one node")
    if staged:
        notes.append(f"the runtime's stage machinery of {', '.join(staged)} per microbatch "
                     "from device profiles (measured: every stage's overhead around its "
                     "layers, the first stage's embedding, the last stage's head and loss)")
    if best.schedule == "interleaved-zb":
        notes.append(_izb_note(best, spec))
    if best.schedule == "helix":
        notes.append(_helix_note(best, spec))
    if splits_backward(best.schedule):
        notes.append(_zb_note(best, spec))
    sharded = sorted({(u.device.name, tp) for u, tp in zip(best.units, best.tps, strict=True)
                      if best.cp == 1 and cost.measured_tp_line(spec.model, spec.training, tp,
                                                                u.device) is not None})
    if sharded:
        notes.append("layer times of " + ", ".join(f"{n} at tp={t}" for n, t in sharded)
                     + " measured sharded (device profiles: compute and TP all-reduces as "
                     "the runtime runs them); other TP degrees derived from tp 1")
    if comm:
        notes.append(f"collectives inside a node of {', '.join(comm)} from device profiles "
                     "(measured all-reduce and p2p); links between nodes from the catalog "
                     "model, no faster than measured")
    used = best.dp * sum(best.tps)
    total = sum(u.gpus for u in set(best.units))
    if used < total:
        notes.append(f"uses {used} of {total} GPUs in the chosen pools")
    return notes


def plan_job(name: str, spec: JobSpec, inventory: ClusterInventory, *, exhaustive: bool = False,
             previous: Plan | None = None, ceiling_s: float | None = None) -> Plan:
    """Best plan for ``spec`` on ``inventory``; raises :class:`PlanningError` when nothing fits.

    With ``previous`` (a re-plan after failures) the global batch is kept (gradient
    accumulation absorbs a smaller ``dp``) and, among layouts within 2% of the best, the one
    that moves the fewest surviving ranks to another stage wins. ``recompute: auto``,
    ``crossDC.mode: auto`` and ``sharding: auto`` plan each option and keep the fastest
    (:func:`_plan_auto`). ``ceiling_s``: only a layout faster than this counts; none raises
    :class:`~hettrain.planning.errors.NotFaster` (``sharding: auto``'s later variants).
    """
    if spec.model.tie_embeddings:  # the runtime trains tied embeddings only without PP
        spec = replace(spec, parallelism=replace(spec.parallelism, pp=1))
    if spec.training.recompute == "auto":
        return _plan_auto(name, inventory, exhaustive, previous, "recompute", [
            (mode, replace(spec, training=replace(spec.training, recompute=mode)))
            for mode in recompute_options("auto", spec.training.attention)])
    if spec.cross_dc.mode == "auto":
        modes = CROSS_DC_SEARCH if spec.cross_dc.compression != "none" else ("sync",)
        return _plan_auto(name, inventory, exhaustive, previous, "crossDC.mode", [
            (mode, replace(spec, cross_dc=replace(spec.cross_dc, mode=mode))) for mode in modes])
    if spec.training.sharding == "auto":
        # each option the rules allow (api.spec.sharding_options), least sharded first: the
        # fastest that fits wins, ties the least sharded (exact: each search is). A variant's
        # refusal does not try the stronger shardings (_sharding_that_fits): auto does
        with _raised(_PROBING):
            return _plan_auto(name, inventory, exhaustive, previous, "sharding", [
                (mode, replace(spec, training=replace(spec.training, sharding=mode)))
                for mode in sharding_options("auto", spec.model, spec.parallelism)],
                prune=True)
    chunk = cost.loss_chunk_tokens(spec.model)
    if chunk and not _LOSS_CHOSEN.get():
        # long sequences: the whole-sequence loss and the chunked one (less memory on the
        # last stage, one more head GEMM), the faster wins (ties: whole); the chunked search
        # only looks below the whole one's step (docs/planning.md §Chunked loss)
        with loss_as_given():
            return _plan_auto(name, inventory, exhaustive, previous, "loss", [
                (mode, replace(spec, training=replace(spec.training, loss_chunk_tokens=c)))
                for mode, c in (("whole", 0), (f"{chunk}-token chunks", chunk))],
                prune=True, ceiling_s=ceiling_s)
    if not chunk and spec.training.loss_chunk_tokens:
        spec = replace(spec, training=replace(spec.training, loss_chunk_tokens=0))
    mlp_chunk = (0 if splits_backward(spec.parallelism.schedule)
                 else cost.mlp_chunk_tokens(spec.model, spec.training))
    if mlp_chunk and not _MLP_CHOSEN.get():
        # a re-run layer at long sequences: the chunked MLP (less memory, and the re-run
        # skips its down projection; no ZB-H1 beside it) and the whole one, the faster wins
        # (ties: chunked, searched first so the whole one's search prunes below it;
        # docs/planning.md §Chunked MLP)
        with mlp_as_given():
            return _plan_auto(name, inventory, exhaustive, previous, "mlp", [
                (mode, replace(spec, training=replace(spec.training, mlp_chunk_tokens=c)))
                for mode, c in ((f"{mlp_chunk}-token chunks", mlp_chunk), ("whole", 0))],
                prune=True, ceiling_s=ceiling_s)
    if not mlp_chunk and spec.training.mlp_chunk_tokens:
        spec = replace(spec, training=replace(spec.training, mlp_chunk_tokens=0))
    if spec.parallelism.replica_groups and ceiling_s is not None:
        # extra replica groups can bring a layout slower than the ceiling below it (an auto
        # option's later variant against the earlier one's grouped plan): search without the
        # ceiling, then hold the grouped plan to it
        plan = plan_job(name, spec, inventory, exhaustive=exhaustive, previous=previous)
        if plan.predicted.step_time_s >= ceiling_s:
            raise NotFaster(REASON_PLAN_FAILED, f"no layout faster than {ceiling_s:.4g}s")
        return plan
    pools = filter_pools(inventory, spec.placement)
    if not pools:
        pl = spec.placement
        raise no_plan(
            "no pools match spec.placement "
            f"(vendors={list(pl.vendors)}, datacenters={list(pl.datacenters)}, "
            f"pools={list(pl.pools)}); the cluster has "
            + ", ".join(f"{p.name} ({p.vendor}, {p.datacenter})" for p in inventory.pools)
        )
    groupings = [("split", build_units(pools, merged=False))]
    if spans_datacenters(pools):
        groupings.append(("merged", build_units(pools, merged=True)))
    best_by: dict[str, Candidate] = {}
    searches: list[_Search] = []
    slack = REPLAN_TOLERANCE if previous is not None else 1.0
    for order in _cp_orders(_cp_options(spec, pools), previous):
        best_by, searches = {}, []
        for grouping, units in groupings:
            search = _Search(spec, exhaustive, slack,
                             _grouping_ceiling(ceiling_s, best_by, slack, exhaustive),
                             [p.device for p in pools])
            for cp in order:  # one incumbent over every CP degree, which prunes the next
                search.use_cp(replace(spec, parallelism=replace(spec.parallelism, cp=cp)))
                search.first_pair = _previous_pair(previous, cp)
                if exhaustive:
                    _search_exhaustive(search, units, inventory, grouping)
                else:
                    _search_fast(search, units, inventory, grouping)
            search.use_cp(spec)
            searches.append(search)
            if search.best is not None:
                best_by[grouping] = search.best
        if best_by:
            break
    if not best_by:
        if ceiling_s is not None:
            raise NotFaster(REASON_PLAN_FAILED, f"no layout faster than {ceiling_s:.4g}s")
        raise _explain_failure(spec, pools, searches, inventory)
    ranked = sorted(best_by.values(), key=Candidate.sort_key)
    best = ranked[0]
    alt = ranked[1] if len(ranked) > 1 else None
    # the merged grouping (searched under the split one's best) had no layout as fast
    merged_slower = alt is None and len(groupings) > 1 and best.grouping == "split"
    near = [c for s in searches for c in s.near]
    added: list[str] = []
    trials: dict = {}  # the idle check's trials over ``chosen``, reused by its notes
    if previous is None:
        chosen = best
        if not exhaustive:  # what the search's large-instance heuristics left out
            from hettrain.planning.idle_pools import with_idle_groups  # it imports this module

            chosen, added, trials = with_idle_groups(
                best, replace(spec, parallelism=replace(spec.parallelism, cp=best.cp)),
                inventory)
        ranks = _place(chosen, None)
    else:
        chosen, ranks = _fewest_moves(best, near, previous)
    concrete = replace(spec, parallelism=replace(spec.parallelism, cp=chosen.cp))
    notes = [*_notes(chosen, searches[0], alt, inventory, concrete, merged_slower), *added]
    searched = len(notes)  # the idle-pool notes go here, before the later decisions' notes
    if previous is not None:
        notes.append(f"re-plan: {moved_ranks(previous, ranks)} of {len(ranks)} ranks change stage")
    plan = _to_plan(name, concrete, chosen, ranks, notes, inventory)
    if spec.parallelism.replica_groups:
        plan = plan_with_replica_group(plan, spec, inventory, previous,
                                       per_pool=not _PER_POOL_DONE.get())
    plan = _with_idle_notes(plan, chosen, concrete, inventory, previous is not None, searched,
                            trials)
    if spec.parallelism.replica_groups and _uneven(concrete, chosen.dp):
        # the best even layout with its groups may still beat the uneven one with its own
        # (searched again without the uneven degrees)
        try:
            with _raised(_PER_POOL_DONE), even_data_parallel():
                even = plan_job(name, spec, inventory, exhaustive=exhaustive,
                                previous=previous, ceiling_s=ceiling_s)
        except PlanningError:
            return plan
        if even.predicted.step_time_s < plan.predicted.step_time_s * (1 - 1e-9):
            return even
    return plan


def _with_idle_notes(plan: Plan, chosen: Candidate, spec: JobSpec, inventory: ClusterInventory,
                     replan: bool, at: int, trials: dict) -> Plan:
    """``plan`` with a note naming each pool it leaves wholly idle and why
    (:mod:`hettrain.planning.idle_pools`: once per plan, after the search; ``trials``: what the
    idle check already tried over ``chosen``), inserted at note ``at``: after the search's
    notes, before those of later decisions (re-plan, replica groups), which stay last."""
    from hettrain.planning.idle_pools import idle_pool_notes  # it imports this module

    idle = idle_pool_notes(plan, chosen, spec, inventory, replan, trials)
    if not idle:
        return plan
    return replace(plan, notes=(*plan.notes[:at], *idle, *plan.notes[at:]))


# where the planner searches cp > 1 (a pinned cp is exempt): each CP rank keeps at least
# CP_MIN_LOCAL_TOKENS of the sequence. Below, the rank's GEMMs shrink while the K/V exchange
# does not. At 8k tokens CP wins by 1-10% on bench/cp_crossover.py's clusters, most as the
# memory lever that replaces wide TP or deep pipelines (bench/plan_quality.py, 2026-12-07:
# llama3-70b at 8k, median 0.709 -> 0.767 of the ideal; 16k tokens was the floor before).
CP_MIN_LOCAL_TOKENS = 2048


def _cp_orders(cps: Sequence[int], previous: Plan | None) -> list[list[int]]:
    """The CP degrees ``cps`` (ascending) to search, in order, under one incumbent: for a
    re-plan whose previous plan ran one of them, that degree alone, then (only when it finds
    no layout) all of them; else all of them in one order. A re-plan keeps the CP degree:
    another degree moves nearly every rank, and searching the others within the re-plan's
    slack costs more than the whole first plan (llama3-70b on bench/plan_scale.py's 1,024
    GPUs: 1.7 s, or 20 s without the previous degree's incumbent first, against 0.6 s).

    The order: of three or more degrees the second widest, the widest, then the narrower
    ones down; of two the widest first. The first degree's search runs with no incumbent,
    so it should be the cheap one with a good plan: the widest is where CP wins at long
    sequences (2-8x less planning than narrowest first at 32k/128k), the second widest is
    as good a bound and prunes more at 8k (the same llama3-70b plan: 0.72 s against 0.96 s
    widest first)."""
    order = list(reversed(cps)) if len(cps) < 3 else [cps[-2], cps[-1], *reversed(cps[:-2])]
    if previous is not None and len(cps) > 1 and previous.stages[0].cp in cps:
        return [[previous.stages[0].cp], order]
    return [order]


def _cp_options(spec: JobSpec, pools: Sequence) -> list[int]:
    """Context-parallel degrees to search: the pinned ``spec.parallelism.cp``, else the powers
    of two ``cp`` with ``seq_len`` a multiple of ``2·cp`` (the runtime's load-balanced chunks,
    ``planning/support.py``), ``seq_len / cp ≥ CP_MIN_LOCAL_TOKENS``, at most the pools'
    GPUs and at most the largest degree a spec may pin (``api.limits``: 64); ascending. A
    group wider than a node runs over the NIC (``context.cp_link``), its exchange partly
    under the attention (``context.exposed_s``); at 128k tokens the planner picks cp 16 or 32
    on about half of bench/plan_quality.py's clusters."""
    if spec.parallelism.cp is not None:
        return [spec.parallelism.cp]
    if spec.parallelism.schedule == "helix":  # its stages run without CP
        return [1]
    top = min(sum(p.gpus for p in pools), SPEC_MAXIMUMS["spec.parallelism.cp"])
    out, cp = [1], 2
    seq = spec.model.seq_len
    while cp <= top and seq % (2 * cp) == 0 and seq // cp >= CP_MIN_LOCAL_TOKENS:
        out.append(cp)
        cp *= 2
    return out


def _place(c: Candidate, previous: Plan | None) -> tuple[RankPlan, ...]:
    """Ranks of candidate ``c``: its ``dp·cp`` replicas placed as plain DP replicas (a
    ``(stage, dp)``'s ``cp`` ranks get consecutive ``tp``-GPU blocks, one node where the group
    fits, ``context.cp_link``), then renumbered back to ``(dp, cp)`` coordinates: the inverse of
    the runtime's ``context_parallel.comm_view``."""
    return _cp_coordinates(c, place_ranks(c.units, c.tps, c.dp, previous, c.cp))


def _cp_coordinates(c: Candidate, ranks: tuple[RankPlan, ...]) -> tuple[RankPlan, ...]:
    """:func:`_place`'s renumbering of plain DP replicas ``ranks`` to ``(dp, cp)``."""
    if c.cp == 1:
        return ranks
    return tuple(RankPlan(r.rank, r.node, r.pool, r.datacenter, r.local_rank, r.stage,
                          r.dp // c.cp, r.tp, r.dp % c.cp, r.group) for r in ranks)


def _plan_auto(name: str, inventory: ClusterInventory, exhaustive: bool,
               previous: Plan | None, field: str, variants: Sequence[tuple[str, JobSpec]],
               prune: bool = False, ceiling_s: float | None = None) -> Plan:
    """An ``auto`` spec option (``recompute``, ``crossDC.mode``, ``sharding``): the best plan
    over ``variants``, each a concrete spec.

    Exact: each variant's search is exact, and the fastest wins (ties: the first variant, the
    least recomputation / exact gradients / least sharding). With ``prune`` (sharding) a
    variant after a found plan searches only below the fastest so far (``ceiling_s``, times
    ``REPLAN_TOLERANCE`` for a re-plan): its incumbent from the start, so it stops where its
    bounds reach that (bench/plan_scale.py's llama3-70b at 1k GPUs: 17 s without, 1.3 s with);
    one that finds nothing is "not faster". The note names the choice, why (the fastest, the
    fastest that fits, the only one that fits) and every variant's time, or that it was not
    faster, or that no layout fit it. A re-plan takes, among the variants' plans within
    ``REPLAN_TOLERANCE`` of the fastest, the one moving the fewest ranks. The plan carries the
    chosen mode: the runtime never sees ``auto``. ``ceiling_s`` (the caller's, see
    :func:`plan_job`) bounds every variant; none faster raises :class:`NotFaster`.
    """
    plans: list[tuple[str, Plan]] = []
    failures: list[PlanningError] = []
    failed: list[str] = []
    slower: list[str] = []
    for mode, concrete in variants:
        ceiling = ceiling_s
        if prune and plans:  # later variants search only below the fastest so far
            ceiling = min(p.predicted.step_time_s for _, p in plans) * (
                REPLAN_TOLERANCE if previous is not None else 1.0)
            if ceiling_s is not None:
                ceiling = min(ceiling, ceiling_s)
        try:
            plans.append((mode, plan_job(name, concrete, inventory, exhaustive=exhaustive,
                                         previous=previous, ceiling_s=ceiling)))
        except NotFaster:
            slower.append(mode)
        except PlanningError as exc:
            failures.append(exc)
            failed.append(mode)
    if not plans:
        if not failures:
            raise NotFaster(REASON_PLAN_FAILED, f"no layout faster than {ceiling_s:.4g}s")
        raise failures[-1]  # the last variant needs the least memory: the most telling refusal
    fastest = min(p.predicted.step_time_s for _, p in plans)
    chosen, best = next((m, p) for m, p in plans if p.predicted.step_time_s == fastest)
    if previous is not None:
        near = [(m, p) for m, p in plans if p.predicted.step_time_s <= fastest * REPLAN_TOLERANCE]
        chosen, best = min(near, key=lambda mp: moved_ranks(previous, mp[1].ranks))
    tried = ", ".join([f"{m} {p.predicted.step_time_s:.4g}s" for m, p in plans]
                      + [f"{m}: not faster" for m in slower]
                      + [f"{m}: no layout fits" for m in failed])
    why = ("the only one that fits" if len(plans) == 1 and failed and not slower else
           "the fastest that fits" if failed else "the fastest")
    return replace(best, notes=(*best.notes, f"{field}=auto chose {chosen}, {why} ({tried})"))


def _fewest_moves(best: Candidate, near: Sequence[Candidate], previous: Plan
                  ) -> tuple[Candidate, tuple]:
    """Among layouts within ``REPLAN_TOLERANCE`` of ``best`` (the fastest of each distinct
    placement, at most ``REPLAN_OPTIONS``), the one moving the fewest ranks; ties: faster. One
    whose lower bound on moves (:func:`placement.moved_at_least`) is no better than a faster
    one's moves is not placed."""
    limit = best.step_time_s * REPLAN_TOLERANCE
    by_layout: dict[tuple, Candidate] = {}
    for c in sorted((c for c in near if c.step_time_s <= limit), key=Candidate.sort_key):
        by_layout.setdefault((tuple(u.key for u in c.units), c.tps, c.dp, c.cp), c)
    scored = []
    fewest = math.inf
    for c in list(by_layout.values())[:REPLAN_OPTIONS]:
        # in sort-key order: one that cannot move fewer ranks than an earlier one loses to it
        if moved_at_least(previous, c.units, c.tps, c.dp) >= fewest:
            continue
        # (moved ranks count stages per GPU: the CP renumbering waits for the chosen one)
        r = place_ranks(c.units, c.tps, c.dp, previous, c.cp)
        moved = moved_ranks(previous, r)
        fewest = min(fewest, moved)
        scored.append((moved, c.sort_key(), c, r))
    if not scored:  # best itself is always within the tolerance; defensive
        return best, _place(best, previous)
    _, _, chosen, ranks = min(scored, key=lambda x: (x[0], x[1]))
    return chosen, _cp_coordinates(chosen, ranks)


def step_time_for_split(spec: JobSpec, inventory: ClusterInventory, plan: Plan,
                        split: Sequence[int]) -> float | None:
    """Predicted step time of ``plan``'s layout (same stages, TP, DP, microbatches, schedule)
    with the layer counts ``split``; None when a stage would exceed its memory or hold no layer.

    Used by ``bench/plan_scale.py`` to price the uniform split of the same layout.
    """
    costs = split_costs(spec, inventory, plan, split)
    if costs is None:
        return None
    stage_s, boundaries, dp_s = costs
    pipe, _ = cost.pipeline_time_s(stage_s, boundaries, plan.num_microbatches, plan.schedule,
                                   plan.virtual_stages,
                                   plan_zb_div(plan, plan_devices(plan, inventory)), plan.model,
                                   plan.helix_hop, plan.helix_filo,
                                   plan_link_delay_s(spec, inventory, plan))
    return pipe + dp_s


def _plan_spec_units(spec: JobSpec, inventory: ClusterInventory, plan: Plan
                     ) -> tuple[JobSpec, list[Unit]]:
    """The job as ``plan`` was planned (its own training, cross-DC mode and CP degree) and the
    unit of each of its stages (group 0's with replica groups)."""
    # the plan's own settings, not the job's (``recompute: auto``, ``crossDC.mode: auto``)
    modes = {k: v for k, v in (plan.cross_dc or {}).items()
             if k in ("mode", "compression", "outer_steps", "outer_lr", "outer_momentum")}
    spec = replace(spec, training=plan.training, cross_dc=replace(spec.cross_dc, **modes))
    pools = filter_pools(inventory, spec.placement)
    units = build_units(pools, merged=plan.cross_dc.get("grouping") == "merged")
    by_pool = {p.name: u for u in units for p in u.pools}
    spec = replace(spec, parallelism=replace(spec.parallelism, cp=plan.stages[0].cp))
    return spec, [by_pool[s.pools[0]] for s in plan.stages]


def plan_link_delay_s(spec: JobSpec, inventory: ClusterInventory, plan: Plan) -> float:
    """The datacenter links' latency ``plan``'s pipeline (group 0's) pays once per step
    because its schedule hides it with extra warm-up (:func:`link_delays`; 0 where no hop
    crosses a link or the schedule does not hide it): what
    :func:`cost.pipeline_time_s` takes as ``link_delay_s`` beside :func:`split_costs`'
    boundaries."""
    _, units = _plan_spec_units(spec, inventory, plan)
    return plan_link_warmup(plan, units, inventory)[1]


def plan_link_warmup(plan: Plan, units: Sequence[Unit], inventory: ClusterInventory
                     ) -> tuple[tuple[int, ...], float]:
    """``(each stage's link warm-up, the links' latency paid once)`` of ``plan``'s pipeline
    (group 0's) on its stage ``units``, as the search priced it: the plan's
    ``stages[].link_warmup`` where its schedule hides a crossing hop's latency
    (:func:`link_delays`), else ``((), 0.0)`` (the hops then pay it themselves)."""
    delays = link_delays(units, inventory, plan.schedule)
    if not any(delays):
        return (), 0.0
    return tuple(s.link_warmup for s in plan.stages), sum(delays)


def split_costs(spec: JobSpec, inventory: ClusterInventory, plan: Plan, split: Sequence[int],
                *, summed_elsewhere: bool = False
                ) -> tuple[list[float], list[float], float] | None:
    """``(stage seconds per microbatch, boundary seconds, slowest DP sync)`` of ``plan``'s
    layout (its ``plan.stages``: group 0's with replica groups) with the layer counts ``split``
    on ``inventory``; None when a stage would exceed its memory or hold no layer.

    ``summed_elsewhere``: the stages' gradients are summed by something else (replica groups:
    ``runtime/replica_sync.py`` replaces the group's DP all-reduce, priced by
    ``replica_groups.groups_grad_sum_s``), so the DP part is only what still follows that sum
    on each stage: the optimizer step and, under ZeRO-1, the parameter all-gather
    (:func:`_after_sum_dp_s`)."""
    got = _split_costs_both(spec, inventory, plan, split)
    if got is None:
        return None
    stage_s, boundaries, full, after = got
    return stage_s, boundaries, after if summed_elsewhere else full


def _split_costs_both(spec: JobSpec, inventory: ClusterInventory, plan: Plan,
                      split: Sequence[int]
                      ) -> tuple[list[float], list[float], float, float] | None:
    """:func:`split_costs` with both DP parts: ``(stage seconds, boundary seconds, slowest DP
    sync, slowest DP part after a sum elsewhere)``."""
    if len(split) != plan.pp or sum(split) != spec.model.layers:
        raise ValueError(f"split must have {plan.pp} parts summing to {spec.model.layers}")
    spec, stage_units = _plan_spec_units(spec, inventory, plan)
    tps = [s.tp for s in plan.stages]
    m, v = plan.num_microbatches, plan.virtual_stages
    dp = plan.dp * plan.stages[0].cp  # the DP×CP group, as the search counts it
    warm, _ = plan_link_warmup(plan, stage_units, inventory)
    stages, _ = _stage_costs(stage_units, tps, dp, plan.micro_batch, m, plan.schedule,
                             inventory, spec, v=v, filo=plan.helix_filo, warm=warm)
    if any(n < 1 or n > s.max_layers for s, n in zip(stages, split, strict=True)):
        return None
    boundaries = pipeline_hops(stage_units, tps, dp, plan.micro_batch, inventory, spec,
                               v if chunked_schedule(plan.schedule) else 1, bool(warm))
    stage_s = [s.time(n) for s, n in zip(stages, split, strict=True)]
    tails = [_after_sum_dp_s(u, tp, dp, inventory, spec, i == 0, i == plan.pp - 1, n)
             for i, (u, tp, n) in enumerate(zip(stage_units, tps, split, strict=True))]
    full = max(s.dp(n) for s, n in zip(stages, split, strict=True))
    return stage_s, boundaries, full, max(tails)


def _after_sum_dp_s(unit: Unit, tp: int, dp: int, inv: ClusterInventory, spec: JobSpec,
                    first: bool, last: bool, layers: int) -> float:
    """Seconds of a stage's DP part of the step when its gradients are summed elsewhere
    (:func:`split_costs`' ``summed_elsewhere``): the optimizer step, then under ZeRO-1
    (sharding ``optimizer``) the exposed all-gather of the updated parameters over the
    ``dp`` group, as :func:`_dp_sync_coeffs` prices it. Replica groups run no other
    sharding (``support.sharding_errors``)."""
    opt_c, opt_e = _optimizer_coeffs(unit, tp, dp, spec, first, last)
    seconds = opt_c * layers + opt_e
    if spec.training.sharding == "optimizer" and dp > 1:
        _, _, gat, _, _ = _dp_rates(unit, dp, tp, inv, spec)
        grad_layer, fixed_grad = _grad_bytes(spec.model, tp, first, last)
        seconds += (grad_layer * layers + fixed_grad) * gat
    return seconds


def _grad_bytes(model: ModelSpec, tp: int, first: bool, last: bool) -> tuple[float, float]:
    """``(per layer, fixed)`` fp32 gradient bytes of a stage on one TP rank: a layer's, and
    the embedding's (first) and head's (last) tables (the rates of :func:`_dp_rates` are per
    byte of these)."""
    grad_layer = cost.layer_params(model) * 4.0 / tp
    fixed_grad = (cost.embedding_params(model) * 4.0 * (int(first) + int(last))
                  / cost.vocab_shards(model, tp))
    return grad_layer, fixed_grad


def own_grad_sync_s(spec: JobSpec, inventory: ClusterInventory, plan: Plan) -> float:
    """Seconds of ``plan``'s predicted step that are its own DP gradient sync (exposed), which
    replica groups do not run: :func:`split_costs` with and without ``summed_elsewhere``, at
    the plan's layer split (0 where the split no longer fits)."""
    got = _split_costs_both(spec, inventory, plan,
                            [s.layer_end - s.layer_start for s in plan.stages])
    return 0.0 if got is None else max(0.0, got[2] - got[3])


def hop_pairs(pp: int, v: int = 1) -> list[tuple[int, int]]:
    """The ``(from, to)`` stages of a pipeline's boundary hops, in the order
    :func:`cost.boundary_charges` prices them: stage ``i`` to ``i + 1``, and with ``v > 1``
    model chunks (the interleaved schedules) the hop from the last stage back to stage 0
    that each chunk but the last takes."""
    return [(i, i + 1) for i in range(pp - 1)] + ([(pp - 1, 0)] if v > 1 and pp > 1 else [])


def pipeline_hops(units: Sequence[Unit], tps: Sequence[int], dp: int, mb: int,
                  inventory: ClusterInventory, spec: JobSpec, v: int = 1,
                  hidden: bool = False) -> list[float]:
    """Seconds of each boundary hop of a pipeline (activation and gradient), in
    :func:`hop_pairs` order (the arguments :func:`cost.pipeline_time_s` charges);
    ``hidden``: the links' latency is hidden by warm-up (:func:`link_delays`)."""
    return [_boundary_s(units[a], units[b], tps[a], tps[b], dp, mb, inventory, spec, hidden)
            for a, b in hop_pairs(len(units), v)]


_PROBING: ContextVar[bool] = ContextVar("hettrain_planner_probing", default=False)
# set while plan_job plans the loss variants of a long-sequence job (whole, chunked)
_LOSS_CHOSEN: ContextVar[bool] = ContextVar("hettrain_planner_loss_chosen", default=False)
# set while plan_job plans the MLP variants of a re-run layer at long sequences (chunked, whole)
_MLP_CHOSEN: ContextVar[bool] = ContextVar("hettrain_planner_mlp_chosen", default=False)
# set while planning the even alternative of an uneven plan for replica groups (plan_job):
# only divisors of the global batch are searched (_dp_values)
_EVEN_ONLY: ContextVar[bool] = ContextVar("hettrain_planner_even_only", default=False)


# set while plan_job plans that even alternative: the per-pool layouts (replica_groups.
# per_pool_plans, searched even already) were compared with the uneven plan, so the even one
# only needs its groups on idle nodes
_PER_POOL_DONE: ContextVar[bool] = ContextVar("hettrain_planner_per_pool_done", default=False)


@contextlib.contextmanager
def _raised(flag: ContextVar[bool]) -> Iterator[None]:
    """``flag`` true inside it, its previous value restored on the way out."""
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


def even_data_parallel() -> contextlib.AbstractContextManager[None]:
    """Plan, inside it, with only the data-parallel degrees that divide the global batch (no
    uneven replicas): what :func:`plan_job` plans replica groups on when the best plain
    layout is uneven, and the layouts before uneven data parallelism, for comparisons."""
    return _raised(_EVEN_ONLY)


# set while planning helix with its capped orders only (helix_capped_only)
_HELIX_CAPPED: ContextVar[bool] = ContextVar("hettrain_planner_helix_capped", default=False)


def helix_capped_only() -> contextlib.AbstractContextManager[None]:
    """Plan, inside it, ``schedule: helix`` with its capped orders only (at most ``pp``
    microbatches in flight), not also the first-in-last-out one: the planner before that
    order, for comparisons (``bench/helix_crossover.py``)."""
    return _raised(_HELIX_CAPPED)


def loss_as_given() -> contextlib.AbstractContextManager[None]:
    """Plan, inside it, with ``spec.training.loss_chunk_tokens`` as given (0: the
    whole-sequence loss) instead of planning both losses of a long-sequence job and keeping
    the faster: how :func:`plan_job` plans each of the two, and the planner before the chunked
    loss, for comparisons."""
    return _raised(_LOSS_CHOSEN)


def mlp_as_given() -> contextlib.AbstractContextManager[None]:
    """Plan, inside it, with ``spec.training.mlp_chunk_tokens`` as given (0: the whole MLP)
    instead of planning both MLPs of a long-sequence job with a re-run layer and keeping the
    faster: how :func:`plan_job` plans each of the two, and the planner before the chunked
    MLP, for comparisons."""
    return _raised(_MLP_CHOSEN)


SHARDING_ORDER = ("none", "optimizer", "gradients", "full")  # least to most sharded


def _sharding_that_fits(spec: JobSpec, inventory: ClusterInventory) -> str | None:
    """The least sharded ``spec.training.sharding`` beyond the spec's own that the rules allow
    (``api.spec.sharding_options``; none with DiLoCo) and with which a plan is found (the fast
    search, everything else unchanged), or None: a refusal suggests a sharding only where it
    would help. Not from within another such probe (one level)."""
    current = spec.training.sharding
    if _PROBING.get() or current == "auto" or spec.cross_dc.mode == "diloco":
        return None
    allowed = sharding_options("auto", spec.model, spec.parallelism)
    with _raised(_PROBING):
        for alt in SHARDING_ORDER[SHARDING_ORDER.index(current) + 1:]:
            if alt not in allowed:
                continue
            try:
                plan_job("probe", replace(spec, training=replace(spec.training, sharding=alt)),
                         inventory)
            except PlanningError:
                continue
            return alt
    return None


def _explain_failure(spec: JobSpec, pools: Sequence, searches: Sequence[_Search],
                     inventory: ClusterInventory) -> PlanningError:
    gb = spec.training.global_batch
    capped = sum(s.over_max_gpus for s in searches)
    if capped and spec.placement.max_gpus is not None:
        return no_plan(
            f"no feasible layout within spec.placement.maxGPUs={spec.placement.max_gpus} "
            "(the cap excluded the larger layouts); raise maxGPUs or pin a smaller "
            "spec.parallelism"
        )
    shortfall = min((s.memory_shortfall for s in searches if s.memory_shortfall),
                    default=None)
    if shortfall is not None:
        helps = _sharding_that_fits(spec, inventory)
        return no_plan(f"model does not fit: in the closest layout tried, {shortfall[1]}; "
                       + "; or ".join(_memory_suggestions(spec, shortfall[2], helps)))
    if spec.training.micro_batch is not None:
        return no_plan(
            f"spec.training.microBatch={spec.training.micro_batch} does not divide globalBatch "
            f"{gb} / dp for any feasible dp; omit microBatch to let the planner choose"
        )
    gpus = sum(p.gpus for p in pools)
    return no_plan(
        f"no feasible layout on {gpus} GPUs for globalBatch {gb} and {spec.model.layers} layers "
        f"with the pins in spec.parallelism ({spec.parallelism}); relax the pins"
    )


def _memory_suggestions(spec: JobSpec, state_only: bool, sharding: str | None = None
                        ) -> list[str]:
    """Only the changes that would lower per-device memory and are not already in effect
    (activation options only when activations, not the state alone, are the problem);
    ``sharding``: the least sharding with which a plan fits (:func:`_sharding_that_fits`),
    suggested only then."""
    t, par, pl = spec.training, spec.parallelism, spec.placement
    out = []
    if t.recompute not in ("full", "auto") and not state_only:
        out.append(f"set spec.training.recompute: full (now {t.recompute})")
    if sharding is not None:
        zero = {"optimizer": "ZeRO-1", "gradients": "ZeRO-2", "full": "ZeRO-3/FSDP"}[sharding]
        out.append(f"set spec.training.sharding: {sharding} ({zero}; now {t.sharding}: a "
                   "layout then fits)")
    if t.micro_batch is not None and t.micro_batch > 1 and not state_only:
        out.append(f"lower spec.training.microBatch (now {t.micro_batch}) or omit it")
    pins = [f"{k}={v}" for k, v in (("tp", par.tp), ("pp", par.pp), ("dp", par.dp),
                                    ("cp", par.cp)) if v is not None]
    if pins:
        out.append(f"unpin spec.parallelism ({', '.join(pins)}) so TP/PP/CP can spread the "
                   "model")
    if pl.max_gpus is not None:
        out.append(f"raise spec.placement.maxGPUs (now {pl.max_gpus})")
    if pl.vendors or pl.datacenters or pl.pools:
        out.append("allow more pools in spec.placement")
    out.append("add nodes with more device memory")
    return out


def _tp_comm_s(c: Candidate, spec: JobSpec, i: int) -> float:
    """Exposed TP comm of stage ``i`` per microbatch (part of its stage time)."""
    eb = cost.precision_bytes(spec.training)
    local = cost.cp_local_model(spec.model, c.cp)  # a CP rank's TP collectives: its tokens
    return c.split[i] * cost.tp_comm_per_layer_s(local, c.micro_batch, c.tps[i],
                                                 c.units[i].device, eb, spec.training.recompute)


def _to_plan(name: str, spec: JobSpec, c: Candidate, ranks: tuple, notes: list[str],
             inv: ClusterInventory) -> Plan:
    model = spec.model
    gb = spec.training.global_batch
    dp = c.dp // c.cp  # c.dp counts the DP×CP group
    m = _microbatches(spec, c.dp, c.micro_batch)  # the fullest replica's (uneven dp)
    stages = []
    start = 0
    for i, (u, tp, n) in enumerate(zip(c.units, c.tps, c.split, strict=True)):
        pools_used = tuple(sorted({r.pool for r in ranks if r.stage == i}))
        dcs = tuple(sorted({r.datacenter for r in ranks if r.stage == i}))
        stages.append(StagePlan(
            index=i, device=u.device.name, vendor=u.device.vendor, backend=u.device.backend,
            pools=pools_used, datacenters=dcs, layer_start=start, layer_end=start + n, tp=tp,
            memory_gib=round(c.memory[i], 3), capacity_gib=round(u.device.hbm_gib, 3),
            time_ms=round(c.stage_s[i] * 1e3, 6), has_embedding=i == 0,
            has_head=i == len(c.units) - 1, cp=c.cp,
            link_warmup=c.link_warmup[i] if c.link_warmup else 0,
        ))
        start += n
    eb = cost.precision_bytes(spec.training)
    peak = sum(u.device.peak_matmul_flops(eb) * tp * c.dp
               for u, tp in zip(c.units, c.tps, strict=True))
    tokens = gb * model.seq_len
    cross_bytes = 0.0
    reduces, gathers = cost.dp_sync_counts(spec.training.sharding, m)
    for i, (u, tp) in enumerate(zip(c.units, c.tps, strict=True)):
        _, _, _, x_red, x_gat = _dp_rates(u, c.dp, tp, inv, spec)
        cross_bytes += ((reduces * x_red + gathers * x_gat)
                        * (cost.layer_params(model) * c.split[i] / tp * 4.0))
    opt_s = []  # each stage's optimizer step (part of its stage_dp_s)
    for i, (u, tp) in enumerate(zip(c.units, c.tps, strict=True)):
        oc, oe = _optimizer_coeffs(u, tp, c.dp, spec, i == 0, i == c.pp - 1)
        opt_s.append(oc * c.split[i] + oe)
    pred = Prediction(
        step_time_s=c.step_time_s,
        tokens_per_s=tokens / c.step_time_s,
        mfu=cost.model_flops_per_step(model, gb) / (c.step_time_s * peak),
        compute_s=m * max(c.stage_s),
        bubble_s=c.bubble_s,
        tp_comm_s=m * _tp_comm_s(c, spec, c.stage_s.index(max(c.stage_s))),
        pp_comm_s=m * sum(c.boundary_s),
        dp_comm_s=max(d - o for d, o in zip(c.stage_dp_s, opt_s, strict=True)),
        optimizer_s=max(opt_s),
        cross_dc_bytes_per_step=cross_bytes,
        # (uneven dp: the short replicas send one microbatch fewer; gb / (dp·m·mb) of it)
        pp_bytes_per_step=c.dp * gb / (dp * m * c.micro_batch) * (
            cost.helix_bytes_per_step(model, c.micro_batch, cost.precision_bytes(spec.training),
                                      m, c.pp, c.helix_hop, c.helix_filo)
            if c.schedule == "helix" else
            cost.pipeline_bytes_per_step(
                cost.cp_local_model(model, c.cp), c.micro_batch,
                cost.precision_bytes(spec.training), m, c.pp,
                c.chunks if chunked_schedule(c.schedule) else 1)),
    )
    cross = {"mode": spec.cross_dc.mode, "compression": spec.cross_dc.compression,
             "outer_steps": spec.cross_dc.outer_steps, "outer_lr": spec.cross_dc.outer_lr,
             "outer_momentum": spec.cross_dc.outer_momentum, "grouping": c.grouping}
    return Plan(
        job=name, model=model, training=spec.training, dp=dp, pp=c.pp,
        micro_batch=c.micro_batch, num_microbatches=m, schedule=c.schedule,
        stages=tuple(stages), ranks=ranks, predicted=pred, cross_dc=cross, notes=tuple(notes),
        virtual_stages=c.chunks if chunked_schedule(c.schedule) else 1,
        data=spec.data.to_plan(), helix_hop=c.helix_hop, helix_filo=c.helix_filo,
        short_replicas=_short_replicas(spec, c.dp, c.micro_batch),
    )

