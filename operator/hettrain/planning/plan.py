"""The Plan: the one contract between the planner, the operator's manifests and the runtime.

A plan is JSON-serialisable and versioned (``PLAN_VERSION``). The operator stores it in the job's
plan ConfigMap under ``plan.json``; the runtime reads it back with :meth:`Plan.from_json`.

Layout model: every data-parallel replica is the same pipeline of ``pp`` stages. Stage ``s`` holds
layers ``[layer_start, layer_end)`` (for the interleaved schedules only their COUNT: the stage's
``virtual_stages`` model chunks come from ``planning.layers.chunk_layer_ranges``, chunk-major)
and runs on one device type with its own tensor-parallel
degree ``tp``; its ``dp`` replicas may come from several pools of that device type (then the
stage's DP all-reduce is hierarchical across pools or datacenters). Each rank is one GPU with
coordinates ``(stage, dp, tp)``; ranks are numbered so that a node hosts consecutive ranks.

Heterogeneous replicas (optional ``Plan.groups``): the data-parallel replicas form several
replica groups, each its own pipeline (devices, stage count, layer split, TP) with its own
number of replicas and microbatches per step (its share of the global batch). Each rank names
its group (``RankPlan.group``) and its ``stage``/``dp`` are coordinates inside that group. The
plan's top-level ``dp``/``pp``/``num_microbatches``/``stages`` then repeat group 0's, and
``global_batch`` is the sum over the groups. Without groups nothing changes (and the JSON omits
the new fields).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from hettrain.api.spec import ModelSpec, TrainingSpec

PLAN_VERSION = 1


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One pipeline stage: a contiguous layer range on one device type."""

    index: int
    device: str
    vendor: str
    backend: str  # pool-local collective backend: nccl (CUDA/ROCm), hccl, gloo
    pools: tuple[str, ...]  # pools contributing replicas of this stage
    datacenters: tuple[str, ...]
    layer_start: int  # interleaved plans: only end - start counts (see chunk_layer_ranges)
    layer_end: int  # exclusive
    tp: int
    memory_gib: float  # predicted peak per device
    capacity_gib: float  # device HBM
    time_ms: float  # forward+backward of one microbatch on this stage
    has_embedding: bool = False
    has_head: bool = False
    cp: int = 1  # context parallelism: ranks sharing each sequence (runtime/context_parallel)
    # 1F1B / ZB-H1: extra warm-up forwards that hide the latency of the datacenter links
    # after this stage (cost.link_warmups; runtime/schedules.warmup_count)
    link_warmup: int = 0

    @property
    def layers(self) -> int:
        """Number of transformer layers in this stage."""
        return self.layer_end - self.layer_start


@dataclass(frozen=True, slots=True)
class RankPlan:
    """One GPU: where it runs and which (stage, dp, tp) coordinate it owns."""

    rank: int
    node: str
    pool: str
    datacenter: str
    local_rank: int  # GPU index on the node
    stage: int
    dp: int
    tp: int
    cp: int = 0  # index in the stage's context-parallel group (0..stage.cp-1)
    group: int = 0  # replica group (Plan.groups); stage/dp are coordinates inside it


@dataclass(frozen=True, slots=True)
class ReplicaGroup:
    """One group of identical DP replicas: its own pipeline and its share of the batch.

    Its replicas each run ``num_microbatches`` microbatches of ``Plan.micro_batch`` sequences
    per step, the last ``short_replicas`` of them one fewer (uneven data parallelism inside
    the group, as ``Plan.short_replicas`` without groups), so the group's share of the global
    batch is ``(dp * num_microbatches - short_replicas) * micro_batch`` sequences
    (proportional to its speed when the planner sizes it)."""

    index: int
    dp: int  # replicas in this group
    pp: int
    num_microbatches: int  # per replica per optimizer step (the fullest replica's)
    stages: tuple[StagePlan, ...]
    short_replicas: int = 0  # the group's last replicas that run one microbatch fewer

    @property
    def microbatches(self) -> int:
        """Microbatches the whole group runs per step (``dp * num_microbatches -
        short_replicas``)."""
        return self.dp * self.num_microbatches - self.short_replicas


@dataclass(frozen=True, slots=True)
class Prediction:
    """Predicted performance of one optimizer step (seconds unless stated)."""

    step_time_s: float
    tokens_per_s: float
    mfu: float  # model FLOPs / (step time * peak FLOPs of all used devices)
    compute_s: float = 0.0
    bubble_s: float = 0.0
    tp_comm_s: float = 0.0
    pp_comm_s: float = 0.0
    dp_comm_s: float = 0.0  # the exposed DP gradient sync (and ZeRO-1 all-gather)
    cross_dc_bytes_per_step: float = 0.0
    pp_bytes_per_step: float = 0.0  # pipeline p2p, all replicas: cost.pipeline_bytes_per_step
    optimizer_s: float = 0.0  # the slowest stage's optimizer step (cost.optimizer_step_s)


@dataclass(frozen=True, slots=True)
class Plan:
    """A complete placement + parallelism plan for one job."""

    job: str
    model: ModelSpec
    training: TrainingSpec
    dp: int
    pp: int
    micro_batch: int  # sequences per microbatch
    num_microbatches: int  # per replica per optimizer step (gradient accumulation)
    schedule: str  # 1f1b | interleaved | zb-h1 | interleaved-zb | helix
    stages: tuple[StagePlan, ...]
    ranks: tuple[RankPlan, ...]
    predicted: Prediction
    cross_dc: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # why the planner chose this (and what it rejected)
    virtual_stages: int = 1  # interleaved schedules: model chunks per rank
    data: dict[str, Any] = field(default_factory=dict)  # spec.data.to_plan(): uri | synthetic
    version: int = PLAN_VERSION
    groups: tuple[ReplicaGroup, ...] = ()  # heterogeneous replica groups (module docstring)
    # helix: the hop time (per-part cost units, planning/helix.py) the planner built its order
    # with; the runtime builds the same order from it
    helix_hop: float = 0.0
    # helix: the first-in-last-out order (every microbatch in flight, helix.FILO_VARIANTS)
    # instead of the one with at most pp in flight
    helix_filo: bool = False
    # uneven data parallelism (a global batch ``dp`` does not divide): the last
    # ``short_replicas`` DP replicas run ``num_microbatches - 1`` microbatches per step, the
    # others ``num_microbatches`` (:meth:`replica_microbatches`); 0 without (never with groups)
    short_replicas: int = 0

    @property
    def world_size(self) -> int:
        """Number of ranks (GPUs)."""
        return len(self.ranks)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: dp * micro_batch * num_microbatches (with groups:
        micro_batch times the sum of every group's dp * num_microbatches)."""
        return self.micro_batch * self.total_microbatches

    @property
    def total_microbatches(self) -> int:
        """Microbatches per optimizer step over every replica (of every group)."""
        if self.groups:
            return sum(g.microbatches for g in self.groups)
        return self.dp * self.num_microbatches - self.short_replicas

    def replica_microbatches(self, dp_index: int) -> int:
        """Microbatches DP replica ``dp_index`` runs per step: ``num_microbatches``, one
        fewer for the last ``short_replicas`` replicas (every stage and CP rank of a replica
        runs the same count)."""
        return self.num_microbatches - int(dp_index >= self.dp - self.short_replicas)

    def replica_row_offset(self, dp_index: int) -> int:
        """First global-batch row of DP replica ``dp_index`` (without groups): the replicas
        take consecutive blocks of ``micro_batch * replica_microbatches`` rows in DP order."""
        full = self.dp - self.short_replicas
        return self.micro_batch * (dp_index * self.num_microbatches - max(0, dp_index - full))

    @property
    def all_stages(self) -> tuple[StagePlan, ...]:
        """Every stage of every replica group (the plan's stages without groups)."""
        if self.groups:
            return tuple(s for g in self.groups for s in g.stages)
        return self.stages

    @property
    def pools(self) -> tuple[str, ...]:
        """Distinct pools used, in stage order (groups in order)."""
        return tuple(dict.fromkeys(p for s in self.all_stages for p in s.pools))

    @property
    def datacenters(self) -> tuple[str, ...]:
        """Distinct datacenters used, in stage order (groups in order)."""
        return tuple(dict.fromkeys(d for s in self.all_stages for d in s.datacenters))

    def stage_of(self, rank: RankPlan) -> StagePlan:
        """The stage ``rank`` runs (in its replica group's pipeline when there are groups)."""
        return (self.groups[rank.group].stages if self.groups else self.stages)[rank.stage]

    def link_recv_ahead(self, stage: int) -> int:
        """Stage inputs ``stage`` receives ahead beyond the runtime's usual one: the extra
        warm-up its predecessor runs beyond its own (``StagePlan.link_warmup``), i.e. the
        microbatches in flight on the datacenter link between them (0 on other hops)."""
        if stage < 1:
            return 0
        return max(0, self.stages[stage - 1].link_warmup - self.stages[stage].link_warmup)

    def group_ranks(self, group: int) -> tuple[RankPlan, ...]:
        """Ranks of replica group ``group`` in rank order (every rank without groups)."""
        return tuple(r for r in self.ranks if r.group == group)

    def group_row_offset(self, group: int) -> int:
        """First global-batch row of replica group ``group`` (groups take consecutive rows,
        in group order; its replicas' blocks follow in DP order:
        ``group_plan(group).replica_row_offset``)."""
        return self.micro_batch * sum(g.microbatches for g in self.groups[:group])

    def group_plan(self, group: int) -> Plan:
        """Replica group ``group`` as a plain plan: its stages, replicas and microbatches, its
        ranks renumbered ``0..n-1`` in rank order. Everything else (model, training, data,
        schedule) is the job's; ``global_batch`` is the group's share."""
        g = self.groups[group]
        ranks = tuple(replace(r, rank=i, group=0) for i, r in enumerate(self.group_ranks(group)))
        return replace(self, dp=g.dp, pp=g.pp, num_microbatches=g.num_microbatches,
                       stages=g.stages, ranks=ranks, groups=(), short_replicas=g.short_replicas)

    def nodes(self) -> tuple[str, ...]:
        """Distinct nodes in rank order."""
        return tuple(dict.fromkeys(r.node for r in self.ranks))

    def ranks_on(self, node: str) -> tuple[RankPlan, ...]:
        """Ranks hosted by one node, in rank order."""
        return tuple(r for r in self.ranks if r.node == node)

    # ------------------------------------------------------------ serialisation

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (tuples become lists); ``cp`` and ``link_warmup`` fields at
        their defaults (no context parallelism, no link warm-up) are left out, so such plans
        serialise as before."""
        d = _jsonable(asdict(self))
        stages = d["stages"] + [s for g in d["groups"] for s in g["stages"]]
        for key, default, items in (("cp", 1, stages), ("cp", 0, d["ranks"]),
                                    ("group", 0, d["ranks"]), ("link_warmup", 0, stages)):
            for item in items:
                if item.get(key) == default:
                    del item[key]
        if not d["groups"]:
            del d["groups"]
        if not d["helix_hop"]:
            del d["helix_hop"]
        if not d["helix_filo"]:
            del d["helix_filo"]
        if not d["short_replicas"]:
            del d["short_replicas"]
        for g in d.get("groups", ()):
            if not g["short_replicas"]:
                del g["short_replicas"]
        return d

    def to_json(self, indent: int | None = None) -> str:
        """Canonical JSON (sorted keys)."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=indent)

    def fingerprint(self) -> str:
        """Short stable hash of the layout (not predictions or notes): same layout, same hash."""
        d = self.to_dict()
        for k in ("predicted", "notes"):
            d.pop(k, None)
        for s in d["stages"] + [s for g in d.get("groups", ()) for s in g["stages"]]:
            for k in ("memory_gib", "time_ms"):
                s.pop(k, None)
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """Inverse of :meth:`to_dict`; rejects other plan versions."""
        version = d.get("version")
        if version != PLAN_VERSION:
            raise ValueError(
                f"plan version {version!r} unsupported; this build reads {PLAN_VERSION}"
            )
        return cls(
            job=d["job"],
            model=ModelSpec(**d["model"]),
            training=TrainingSpec(**d["training"]),
            dp=d["dp"],
            pp=d["pp"],
            micro_batch=d["micro_batch"],
            num_microbatches=d["num_microbatches"],
            schedule=d["schedule"],
            stages=tuple(_build(StagePlan, s) for s in d["stages"]),
            ranks=tuple(RankPlan(**r) for r in d["ranks"]),
            predicted=Prediction(**d["predicted"]),
            cross_dc=dict(d.get("cross_dc", {})),
            notes=tuple(d.get("notes", ())),
            virtual_stages=d.get("virtual_stages", 1),
            data=dict(d.get("data", {})),
            version=version,
            groups=tuple(ReplicaGroup(index=g["index"], dp=g["dp"], pp=g["pp"],
                                      num_microbatches=g["num_microbatches"],
                                      stages=tuple(_build(StagePlan, s) for s in g["stages"]),
                                      short_replicas=int(g.get("short_replicas", 0)))
                         for g in d.get("groups", ())),
            helix_hop=float(d.get("helix_hop", 0.0)),
            helix_filo=_flag(d.get("helix_filo", False), "helix_filo"),
            short_replicas=int(d.get("short_replicas", 0)),
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Parse :meth:`to_json` output."""
        return cls.from_dict(json.loads(text))


def _flag(value: Any, name: str) -> bool:
    """A plan's boolean field, or ``ValueError`` naming it."""
    if not isinstance(value, bool):
        raise ValueError(f"plan.{name}={value!r}: must be true or false")
    return value


def _build(cls: type, d: dict[str, Any]) -> Any:
    kwargs = {}
    for f in fields(cls):
        if f.name in d:
            v = d[f.name]
            kwargs[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**kwargs)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    return obj
