"""The optimizer of one stage: mixed precision, fp32 main grads, flat AdamW, ZeRO-1/2/3.

Byte layout per parameter (what ``planning.cost.state_bytes_per_param`` counts):

- **model parameters** in the plan's precision (``bf16``/``fp16``: 2 bytes; ``fp32``: 4), all
  views into one flat buffer ``params_flat``;
- **main grads**: one flat fp32 buffer (4 bytes) the gradients are accumulated into over the
  microbatches of a step. A ``register_post_accumulate_grad_hook`` folds each low-precision
  ``.grad`` into its ``main_grad`` view as soon as autograd has produced it and frees it, so at
  most one parameter's low-precision gradient is alive at a time (ZB-H1's deferred weight
  gradients are added to ``main_grad`` directly, see ``model.WeightGradStore.flush``);
- **fp32 master weights** (4 bytes; for an fp32 plan the parameters ARE the master, no copy) and
  **AdamW moments** (8 bytes). With ``plan.training.optimizer_sharding`` (ZeRO-1) both live only
  for this rank's ``1/dp`` slice of the flat buffer: 12/dp (bf16) or 8/dp (fp32) bytes.

A step: average the main grads over the stage's DP group (the caller's ``reduce_grads``: the
HetCommunicator's hierarchical / compressed all-reduce), unscale (fp16), the GLOBAL gradient norm
over every stage and TP shard (TP-replicated parameters counted once; one small all-reduce over
the world group), clip, AdamW on the owned slice, cast the slice into the parameters and, with
ZeRO-1, all-gather the updated slices over the DP group (across datacenters through
``ShardGroup.gather``: the communicator's all-gather that crosses the DC link once per byte).

ZeRO-1 reduces the gradients with an all-reduce and keeps its own slice rather than a
reduce-scatter: the communicator's hierarchical (pool / datacenter) and compressed paths exist
for all-reduce only, and gloo's reduce-scatter (CPU, host-staged cross-vendor groups) measured
slower than its all-reduce. The all-reduce moves twice the bytes of a reduce-scatter; the
planner charges it (``planner._dp_rates``). ZeRO-2/3's overlapped per-unit reduction inside one
pool is a reduce-scatter on NCCL/HCCL (``HetCommunicator.dp_reduce_scatter_async``).

Checkpoints (:meth:`StageOptimizer.checkpoint_state`): each rank saves and loads views of its
own slice, as boxes of the global (unsharded, TP-gathered) per-parameter tensors; nothing is
gathered, so a ZeRO-1 rank writes ``1/dp`` of the optimizer state and a checkpoint reshards
onto any tp/pp/dp layout.

``plan.training.sharding`` picks how much is sharded over the stage's DP (×CP) group of ``d``
ranks (:data:`SHARDINGS`): ``none``; ``optimizer`` (ZeRO-1, above); ``gradients`` (ZeRO-2) and
``full`` (ZeRO-3, FSDP). The last two lay the flat buffers out per **unit** (:func:`unit_key`:
the embedding, each decoder layer, the final norm, the LM head), each unit padded to a multiple
of ``d`` and split into ``d`` equal chunks; a rank owns chunk ``index`` of every unit, and its
master weights, moments and fp32 main grads exist for those chunks only (``(4 + 12) / d`` bytes
per parameter). Every microbatch's backward sums each unit's low-precision gradients into a
transient fp32 bucket; when the unit's last gradient has arrived the bucket is averaged over
the group and the rank adds its own chunk into its main grads, then frees the bucket. So the DP
sync runs once per microbatch, not once per step -- the price of never holding a full fp32
gradient (the planner charges it). Overlapped (:meth:`StageOptimizer.enable_overlap`, a DP
group in one pool) the reduction is launched asynchronously and completed later, one in flight
(``grad_sync.UnitGradSync``), and ``full`` prefetches the all-gather of the unit that runs next
(forward: the next unit of the model chunk; backward: the one before); else it is averaged
synchronously right there (``reduce_grads``: the communicator's hierarchical / compressed
all-reduce, as for ZeRO-1). ``gradients`` keeps the full parameters (``p`` bytes) and
all-gathers the updated chunks after the step, unit by unit. ``full`` keeps only its chunk of
the parameters too: a unit's parameters are all-gathered (into a buffer whose storage is freed
between uses, so the parameters stay views of it and autograd's saved references stay valid)
before its forward (a forward pre-hook) and again before its backward (a hook on the unit's
output gradient), and freed after its forward and after its gradients were reduced; the
forward that full recompute re-runs inside the backward finds the unit already gathered.
Checkpoints under ``full`` save and load the parameters as pieces of each rank's chunks too.

fp16 uses dynamic loss scaling: the loss is multiplied by :attr:`StageOptimizer.loss_scale`
before backward; a step whose gradients overflow anywhere is skipped on every rank and the scale
halved; after ``FP16_GROWTH_INTERVAL`` good steps it doubles.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from hettrain.api.spec import TrainingSpec
from hettrain.planning.cost import SHARDING_REDUCES_IN_FLIGHT
from hettrain.runtime.checkpoint_format import ShardedTensor, local_range_pieces
from hettrain.runtime.grad_sync import (
    DEFAULT_BUCKET_BYTES,
    BucketedGradSync,
    Completed,
    UnitGradSync,
    Work,
)
from hettrain.runtime.lr_schedule import lr_at
from hettrain.runtime.tensor_parallel import TPShards

log = logging.getLogger("hettrain.runtime")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OPTIMIZER_KINDS = ("adamw", "sgd")
FP16_INITIAL_SCALE = 2.0 ** 16
FP16_GROWTH_INTERVAL = 1000
CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_
UPDATE_CHUNK = 1 << 24  # elements of the AdamW denominator computed at a time (64 MiB fp32)
SHARDINGS = ("none", "optimizer", "gradients", "full")  # nothing, ZeRO-1, ZeRO-2, ZeRO-3
PER_UNIT = ("gradients", "full")  # the shardings laid out, reduced (and gathered) per unit


@dataclass(frozen=True, slots=True)
class Segment:
    """One parameter's place in the flat buffers."""

    name: str
    start: int
    end: int
    kind: str  # weights | norms | biases | embeddings
    decay: bool
    replicated: bool  # identical on every TP rank: counted once in the global norm


@dataclass(frozen=True, slots=True)
class ShardGroup:
    """The DP group the optimizer state is sharded over (ZeRO-1)."""

    group: dist.ProcessGroup | None
    index: int  # this rank's position in ``group``
    size: int
    staging: torch.device  # where the all-gather's buffers must live (host for gloo)
    account: Callable[[int, float], None] | None = None  # (bytes, seconds) → comm stats
    # (slices, own index) → fills every slice in place, accounting its own bytes: replaces the
    # flat all-gather (the communicator's DC-aware one when the group spans datacenters)
    gather: Callable[[list[torch.Tensor], int], None] | None = None
    stand_in: bool = False  # no peers (runtime/memory.py): gathers fill only the own chunk


def sharding_of(training: TrainingSpec) -> str:
    """The plan's sharding (:data:`SHARDINGS`; ``TrainingSpec`` resolves an unset one from
    ``optimizer_sharding``), refused with the field named when the runtime has no such mode."""
    mode = training.sharding
    if mode not in SHARDINGS:
        raise ValueError(f"plan.training.sharding={mode!r}: must be one of {SHARDINGS}")
    return mode


def unit_key(name: str) -> str:
    """The unit parameter ``name`` is sharded, reduced and gathered with under ZeRO-2/3: its
    decoder layer (``model.layers.<i>``), else its module (embedding, final norm, LM head)."""
    parts = name.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"]:
        return ".".join(parts[:3])
    return ".".join(parts[:-1])


@dataclass(slots=True)
class Unit:
    """One unit's place in the per-unit layout and its transient buffers (ZeRO-2/3)."""

    key: str
    first: int  # its segments: ``segments[first:last]``
    last: int
    start: int  # global offset of its padded block
    padded: int  # its elements, padded to a multiple of the group size
    chunk: int  # elements each rank owns: ``padded / d``
    local: int  # offset of this rank's chunk in the owned buffers
    full: torch.Tensor | None = None  # ZeRO-3: the gathered parameters (storage freed between)
    gathered: bool = True
    bucket: torch.Tensor | None = None  # this microbatch's fp32 gradient sum
    arrived: int = 0
    chunk_id: int = 0  # the model chunk it runs in (interleaved schedules: several)
    pending: Callable[[], None] | None = None  # ZeRO-3 prefetch: completes the async gather


def unit_layout(segments: list[Segment], size: int) -> tuple[list[Segment], list[Unit]]:
    """``segments`` moved into per-unit blocks, each padded to a multiple of ``size`` (the
    units' parameters are consecutive in ``named_parameters`` order), and the units."""
    out: list[Segment] = []
    units: list[Unit] = []
    offset = local = 0
    i = 0
    while i < len(segments):
        key, j = unit_key(segments[i].name), i
        while j < len(segments) and unit_key(segments[j].name) == key:
            j += 1
        if any(u.key == key for u in units):
            raise ValueError(f"parameters of {key} are not consecutive: cannot shard per unit")
        n = sum(s.end - s.start for s in segments[i:j])
        padded = -(-n // size) * size
        pos = offset
        for s in segments[i:j]:
            out.append(Segment(s.name, pos, pos + s.end - s.start, s.kind, s.decay,
                               s.replicated))
            pos += s.end - s.start
        units.append(Unit(key, i, j, offset, padded, padded // size, local))
        offset += padded
        local += padded // size
        i = j
    return out, units


def param_kinds(model: nn.Module) -> dict[str, str]:
    """``{parameter name: weights | norms | biases | embeddings}`` by owning module type."""
    kinds: dict[str, str] = {}
    for mname, mod in model.named_modules():
        is_norm = isinstance(mod, nn.LayerNorm) or "norm" in type(mod).__name__.lower()
        for pname, _ in mod.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if is_norm:
                kinds[full] = "norms"
            elif isinstance(mod, nn.Embedding):
                kinds[full] = "embeddings"
            elif pname == "bias":
                kinds[full] = "biases"
            else:
                kinds[full] = "weights"
    return kinds


def decays(kind: str, t: TrainingSpec) -> bool:
    """Whether parameters of ``kind`` get weight decay under ``t`` (weightDecayExclude)."""
    return {"weights": True, "norms": t.decay_norms, "biases": t.decay_biases,
            "embeddings": t.decay_embeddings}[kind]


def layout(model: nn.Module, t: TrainingSpec,
           tp_sharded: frozenset[str] | set[str] = frozenset(), tp: int = 1) -> list[Segment]:
    """The flat layout of ``model``'s parameters (in ``named_parameters`` order)."""
    kinds = param_kinds(model)
    out, offset = [], 0
    for name, p in model.named_parameters():
        kind = kinds[name]
        out.append(Segment(name, offset, offset + p.numel(), kind, decays(kind, t),
                           tp > 1 and name not in tp_sharded))
        offset += p.numel()
    return out


class StageOptimizer:
    """Mixed-precision AdamW (or plain SGD) over one stage's parameters; see the module doc.

    ``reduce_grads(flat)`` averages the flat fp32 main grads in place over the DP group (None:
    no DP). ``norm_reduce(vec)`` sums a small fp32 host vector over every rank of the job
    (None: single process). ``norm_slot = (slot, slots)``: which replica set this rank's norm
    belongs to (DiLoCo: one per datacenter); ``counts_norm`` whether this rank's (unsharded)
    gradients enter the norm (one DP replica per slot does). ``tp_index`` 0 counts the
    TP-replicated parameters. ``device``: where the buffers, and so the parameters, live
    (default: the parameters' device; ZeRO-3 copies a host-built model unit by unit).
    """

    def __init__(self, model: nn.Module, training: TrainingSpec, *, kind: str = "adamw",
                 shard: ShardGroup | None = None,
                 reduce_grads: Callable[[torch.Tensor], None] | None = None,
                 norm_reduce: Callable[[torch.Tensor], None] | None = None,
                 tp_sharded: frozenset[str] | set[str] = frozenset(), tp: int = 1,
                 tp_index: int = 0, norm_slot: tuple[int, int] = (0, 1),
                 counts_norm: bool = True, device: torch.device | None = None) -> None:
        if kind not in OPTIMIZER_KINDS:
            raise ValueError(f"optimizer {kind!r}: must be one of {OPTIMIZER_KINDS}")
        if training.precision not in DTYPES:
            raise ValueError(f"plan.training.precision={training.precision!r}: must be one of "
                             f"{tuple(DTYPES)}")
        self.t, self.kind, self.model = training, kind, model
        self.dtype = DTYPES[training.precision]
        self.shard = shard if shard is not None and shard.size > 1 else None
        self.reduce_grads, self.norm_reduce = reduce_grads, norm_reduce
        self.norm_slot, self.counts_norm = norm_slot, counts_norm
        self.state: dict = {}  # no per-parameter torch.optim state (checkpoint.py reads this)
        self.params = [p for _, p in model.named_parameters()]
        self.mode = sharding_of(training) if self.shard is not None else "none"
        segments = layout(model, training, tp_sharded, tp)
        # ``device``: where the buffers live; the model may still be on the host (ZeRO-3: each
        # unit is copied to the device chunk by chunk, the whole stage never is)
        device = device or self.params[0].device
        k = self.shard.size if self.shard else 1
        index = self.shard.index if self.shard else 0
        self.units: list[Unit] = []
        self.peak_transient_bytes = 0  # ZeRO-2/3: the most gathered units + buckets held
        self._transient = 0
        if self.mode in PER_UNIT:
            self.segments, self.units = unit_layout(segments, k)
            self.numel = sum(s.end - s.start for s in self.segments)
            self.padded = sum(u.padded for u in self.units)
            self.owned = [(u.start + index * u.chunk, u.start + (index + 1) * u.chunk, u.local)
                          for u in self.units]
            self.lo, self.hi = 0, sum(u.chunk for u in self.units)  # the owned buffers
            self._init_per_unit(device, index)
        else:
            self.segments = segments
            n = segments[-1].end if segments else 0
            self.numel, self.padded = n, -(-n // k) * k
            size = self.padded // k
            self.lo = index * size
            self.hi = self.lo + size
            self.owned = [(self.lo, self.hi, 0)]
            self._init_flat(device)
        self.exp_avg = torch.zeros_like(self.master) if kind == "adamw" else None
        self.exp_avg_sq = torch.zeros_like(self.master) if kind == "adamw" else None
        self.step_count = 0
        self.loss_scale = FP16_INITIAL_SCALE if training.precision == "fp16" else 1.0
        self._good_steps = 0
        self._master_in: torch.Tensor | None = None  # load targets (checkpoint_state)
        self._params_in: torch.Tensor | None = None  # ZeRO-3's parameter load targets
        self._steps_in: list[torch.Tensor] = []
        local = [(la, lb, s) for s in self.segments for _, _, la, lb in self._owned_parts(s)]
        self._decay = _merge_ranges(sorted((a, b) for a, b, s in local if s.decay))
        self._norm = [(a, b) for a, b, s in local if not (s.replicated and tp_index != 0)]
        if self.shard is None and not counts_norm:
            self._norm = []
        # one reduction per contiguous run, not per param
        self._norm = _merge_ranges(sorted(self._norm))
        self.grad_sync: BucketedGradSync | UnitGradSync | None = None  # enable_overlap()
        self.prefetch = False  # ZeRO-3: gather the next unit while this one computes
        self.prefetched = 0  # ZeRO-3: gathers launched ahead of their unit this step

    def _init_flat(self, device: torch.device) -> None:
        """No sharding or ZeRO-1: one flat buffer of every parameter, full main grads."""
        full = torch.zeros(self.padded, dtype=torch.float32, device=device)
        with torch.no_grad():
            for seg, p in zip(self.segments, self.params, strict=True):
                full[seg.start:seg.end].copy_(p.detach().reshape(-1))
        # the parameters become views of one flat buffer in the plan's precision
        self.params_flat = full if self.dtype == torch.float32 else full.to(self.dtype)
        self.main_grad = torch.zeros(self.padded, dtype=torch.float32, device=device)
        for seg, p in zip(self.segments, self.params, strict=True):
            p.data = self.params_flat[seg.start:seg.end].view(p.shape)
            p.grad = None
            p.main_grad = self.main_grad[seg.start:seg.end].view(p.shape)
            p.register_post_accumulate_grad_hook(_fold_into_main_grad)
        # fp32 master of the owned slice (for fp32 the parameters themselves)
        if self.dtype == torch.float32:
            self.master = self.params_flat[self.lo:self.hi]
        else:
            self.master = full[self.lo:self.hi].clone()
        self.param_shard: torch.Tensor | None = None

    def _init_per_unit(self, device: torch.device, index: int) -> None:
        """ZeRO-2/3: owned chunks of every unit; ZeRO-2 keeps the full parameters, ZeRO-3 a
        per-unit gather buffer (freed) and its own chunk of the parameters."""
        owned = self.hi
        self.master = torch.zeros(owned, dtype=torch.float32, device=device)
        self.main_grad = torch.zeros(owned, dtype=torch.float32, device=device)
        with torch.no_grad():
            for seg, p in zip(self.segments, self.params, strict=True):
                flat = p.detach().reshape(-1)
                for a, b, la, lb in self._owned_parts(seg):
                    self.master[la:lb].copy_(flat[a - seg.start:b - seg.start])
        if self.mode == "gradients":
            self.params_flat = torch.zeros(self.padded, dtype=self.dtype, device=device)
            self.param_shard = None
        else:  # the parameters' own chunks (fp32: the master itself)
            self.params_flat = None
            self.param_shard = (self.master if self.dtype == torch.float32
                                else self.master.to(self.dtype))
        owner = {id(p): u.key for u in self.units for p in self.params[u.first:u.last]}
        self._forward_order = self._run_order()
        self._position = {id(u): j for j, u in enumerate(self._forward_order)}
        for u in self.units:
            block = (self.params_flat[u.start:u.start + u.padded] if self.params_flat is not None
                     else torch.zeros(u.padded, dtype=self.dtype, device=device))
            with torch.no_grad():
                for seg, p in zip(self.segments[u.first:u.last], self.params[u.first:u.last],
                                  strict=True):
                    block[seg.start - u.start:seg.end - u.start].copy_(p.detach().reshape(-1))
            for seg, p in zip(self.segments[u.first:u.last], self.params[u.first:u.last],
                              strict=True):
                p.data = block[seg.start - u.start:seg.end - u.start].view(p.shape)
                p.grad = None
                p.register_post_accumulate_grad_hook(partial(self._unit_grad, u, seg))
            if self.mode == "full":
                u.full = block
                self._free(u)
                mod = self.model.get_submodule(u.key)
                if any(unit_key(name) != owner[id(q)] for name, q in
                       self.model.named_parameters(remove_duplicate=False)):
                    raise ValueError(
                        f"plan.training.sharding=full: {u.key} uses parameters of another unit "
                        "(tied input/output embeddings); set spec.model.tieEmbeddings: false "
                        "or spec.training.sharding: gradients")
                mod.register_forward_pre_hook(partial(self._before_forward, u))
                mod.register_forward_hook(partial(self._after_forward, u))
        self._transient = self.peak_transient_bytes = 0

    def _owned_parts(self, seg: Segment) -> Iterator[tuple[int, int, int, int]]:
        """``(global a, global b, local a, local b)`` of ``seg``'s elements this rank owns."""
        for a, b, local in self.owned:
            lo, hi = max(seg.start, a), min(seg.end, b)
            if lo < hi:
                yield lo, hi, local + lo - a, local + hi - a

    # ------------------------------------------------------------ ZeRO-2/3 per unit

    def _unit_grad(self, u: Unit, seg: Segment, p: torch.Tensor) -> None:
        """Post-accumulate hook (ZeRO-2/3): add ``p``'s gradient into its unit's bucket, free
        it, and reduce the bucket once the unit's last gradient has arrived."""
        if p.grad is None:
            return
        grad_bytes = p.grad.numel() * p.grad.element_size()
        self._hold(grad_bytes)  # autograd's low-precision gradient, alive until folded
        if u.bucket is None:
            u.bucket = torch.zeros(u.padded, dtype=torch.float32, device=p.grad.device)
            self._hold(u.bucket.numel() * 4)
        u.bucket[seg.start - u.start:seg.end - u.start].add_(p.grad.reshape(-1))
        p.grad = None
        self._hold(-grad_bytes)
        u.arrived += 1
        if u.arrived == u.last - u.first:
            self._reduce_unit(u)

    def _reduce_unit(self, u: Unit) -> None:
        """Average ``u``'s bucket over the group and keep the own chunk (ZeRO-3: free the
        gathered parameters first, the reduction does not read them): overlapped, launch it
        asynchronously (:class:`grad_sync.UnitGradSync`, :meth:`_reduced` once it has
        completed); else synchronously here."""
        bucket, u.bucket, u.arrived = u.bucket, None, 0
        assert bucket is not None and self.shard is not None
        if self.mode == "full":
            self._free(u)
        if isinstance(self.grad_sync, UnitGradSync):
            self.grad_sync.launch(bucket, partial(self._reduced, u,
                                                  divide=self.grad_sync.group_size))
            return
        if self.reduce_grads is not None and not self.shard.stand_in:
            self.reduce_grads(bucket)
        self._reduced(u, bucket)

    def _reduced(self, u: Unit, bucket: torch.Tensor, divide: int = 1) -> None:
        """``u``'s bucket summed (``divide``: over that many ranks) or averaged over the group:
        add this rank's chunk into the main grads and free the bucket."""
        assert self.shard is not None
        i = self.shard.index
        mine = bucket[i * u.chunk:(i + 1) * u.chunk]
        if divide > 1:
            mine.div_(divide)
        self.main_grad[u.local:u.local + u.chunk].add_(mine)
        self._hold(-bucket.numel() * 4)

    def _hold(self, nbytes: int) -> None:
        self._transient += nbytes
        self.peak_transient_bytes = max(self.peak_transient_bytes, self._transient)

    def _gather(self, u: Unit, wait: bool = True) -> None:
        """ZeRO-3: all-gather ``u``'s parameters over the group (no-op when they are; a
        prefetched gather still in flight is completed). ``wait=False`` (prefetch): start it
        asynchronously where the group allows (:meth:`enable_overlap`), complete it on use."""
        if u.gathered:
            if wait and u.pending is not None:
                self._complete_gather(u)
            return
        assert u.full is not None and self.param_shard is not None and self.shard is not None
        nbytes = u.padded * u.full.element_size()
        u.full.untyped_storage().resize_(nbytes)
        self._hold(nbytes)
        u.gathered = True
        i = self.shard.index
        with torch.no_grad():
            if self.shard.stand_in:  # no peers: their chunks are zeros
                u.full.zero_()
            u.full[i * u.chunk:(i + 1) * u.chunk].copy_(
                self.param_shard[u.local:u.local + u.chunk])
            if not wait:
                self.prefetched += 1
            if self.shard.stand_in:
                return
            if not wait and self.prefetch:
                u.pending = self._all_gather_async(u.full, u.chunk)
            else:
                self._all_gather(u.full, u.chunk)

    def _complete_gather(self, u: Unit) -> None:
        done, u.pending = u.pending, None
        assert done is not None
        done()

    def _free(self, u: Unit) -> None:
        """ZeRO-3: release ``u``'s gathered parameters (their views stay, storage empty)."""
        if not u.gathered:
            return
        assert u.full is not None
        if u.pending is not None:  # never free memory a collective still writes into
            self._complete_gather(u)
        if u.full.untyped_storage().nbytes():
            self._hold(-u.full.untyped_storage().nbytes())
            u.full.untyped_storage().resize_(0)
        u.gathered = False

    def _before_forward(self, u: Unit, module: nn.Module, args) -> None:
        self._gather(u)
        # prefetch the unit that runs next (not in full recompute's re-run inside the backward)
        if self.prefetch and torch._C._current_graph_task_id() == -1:
            nxt = self._neighbour(u, +1)
            if nxt is not None:
                self._gather(nxt, wait=False)

    def _after_forward(self, u: Unit, module: nn.Module, args, out) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # full recompute re-running it inside the backward: still needed there
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(partial(self._before_backward, u))
        self._free(u)

    def _before_backward(self, u: Unit, grad: torch.Tensor) -> None:
        self._gather(u)
        if self.prefetch:  # the unit whose backward runs next
            prev = self._neighbour(u, -1)
            if prev is not None:
                self._gather(prev, wait=False)

    def _run_order(self) -> list[Unit]:
        """The units in the order the stage's forward runs them (not the parameters' order:
        the decoder layers are registered before the embedding): per model chunk (decoder
        layer ``i`` in the chunk whose range holds it, the embedding in the first, the final
        norm and the head in the last), the embedding, the layers by index, the norm, the
        head. Sets each unit's ``chunk_id``."""
        chunks = list(getattr(self.model, "chunks", None) or [])
        rank: dict[str, tuple[int, int, int]] = {}
        for u in self.units:
            parts = u.key.split(".")
            if parts[:2] == ["model", "layers"] and len(parts) == 3 and parts[2].isdigit():
                i = int(parts[2])
                u.chunk_id = next((c for c, (a, b) in enumerate(chunks) if a <= i < b), 0)
                rank[u.key] = (u.chunk_id, 1, i)
            elif parts[-1] == "embed_tokens":
                rank[u.key] = (0, 0, 0)
            else:  # the final norm, then the head (and anything else) in the last chunk
                u.chunk_id = max(0, len(chunks) - 1)
                rank[u.key] = (u.chunk_id, 2 if parts[-1] == "norm" else 3, 0)
        return sorted(self.units, key=lambda u: rank[u.key])

    def _neighbour(self, u: Unit, step: int) -> Unit | None:
        """The unit after (``step`` +1, forward order) or before (-1) ``u`` in its model chunk:
        the one that runs next in the forward or the backward (None at a chunk's end: what
        runs next then depends on the schedule)."""
        order = self._forward_order
        j = self._position[id(u)] + step
        if 0 <= j < len(order) and order[j].chunk_id == u.chunk_id:
            return order[j]
        return None

    def _all_gather_async(self, flat: torch.Tensor, chunk: int) -> Callable[[], None]:
        """Start :meth:`_all_gather` asynchronously (``async_op``); the returned callable
        waits for it, copies host-staged data back and accounts the bytes and the wait."""
        sh = self.shard
        assert sh is not None and sh.gather is None
        staged = flat if flat.device == sh.staging else flat.to(sh.staging)
        parts = list(staged.split(chunk))
        mine = parts[sh.index].clone()
        work = dist.all_gather(parts, mine, group=sh.group, async_op=True)

        def complete() -> None:
            t0 = time.perf_counter()
            work.wait()
            if staged is not flat:
                flat.copy_(staged)
            if sh.account is not None:
                sh.account((sh.size - 1) * mine.numel() * mine.element_size(),
                           time.perf_counter() - t0)
        return complete

    @contextmanager
    def gathered(self, keys: Sequence[str] | None = None) -> Iterator[None]:
        """The parameters of the units ``keys`` (:func:`unit_key`; None: all) materialised
        for the block (ZeRO-3; a no-op otherwise), e.g. to read or run layers outside the
        stage's forward."""
        units = [u for u in self.units if u.full is not None and (keys is None or u.key in keys)]
        for u in units:
            self._gather(u)
        try:
            yield
        finally:
            for u in units:
                self._free(u)

    def state_bytes(self) -> tuple[int, int, int]:
        """``(parameters, main grads, optimizer)`` bytes this rank holds between steps; a
        master that IS the parameters (fp32) counts as parameters."""
        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()
        params = size(self.params_flat) + size(self.param_shard)
        optim = size(self.exp_avg) + size(self.exp_avg_sq)
        held = [t.untyped_storage().data_ptr() for t in (self.params_flat, self.param_shard)
                if t is not None]
        if self.master.untyped_storage().data_ptr() not in held:
            optim += size(self.master)
        return params, size(self.main_grad), optim

    def enable_overlap(self, launch: Callable[[torch.Tensor], Work], group_size: int,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                       account: Callable[[int, float], None] | None = None,
                       wire_bytes: Callable[[int], int] | None = None
                       ) -> BucketedGradSync | UnitGradSync:
        """Sync the main grads in buckets during the backward instead of ``reduce_grads``
        after it (``grad_sync`` module doc): ``launch(view)`` starts one bucket's sum
        all-reduce over the DP group. Call :meth:`begin_step` after :meth:`zero_grad`.

        ZeRO-2/3: each unit's per-microbatch reduction is launched with ``launch`` as its
        bucket fills and completed later (:class:`grad_sync.UnitGradSync`, at most
        ``cost.SHARDING_REDUCES_IN_FLIGHT`` in flight; ``bucket_bytes`` unused), and ZeRO-3
        prefetches the next unit's gather (an ``async_op`` all-gather; the DC-aware gather
        across datacenters stays synchronous). A stand-in group (``runtime/memory.py``) only
        keeps the same buffers alive as long."""
        if self.mode in PER_UNIT:
            assert self.shard is not None
            if self.shard.stand_in:
                def launch(view: torch.Tensor) -> Work:
                    return Completed()
            self.grad_sync = UnitGradSync(launch, group_size, SHARDING_REDUCES_IN_FLIGHT,
                                          account, wire_bytes)
            self.prefetch = self.mode == "full" and self.shard.gather is None
            return self.grad_sync
        self.grad_sync = BucketedGradSync(
            self.params, [(s.start, s.end) for s in self.segments], self.main_grad, launch,
            group_size, bucket_bytes, account, wire_bytes)
        return self.grad_sync

    def begin_step(self, microbatches: int) -> None:
        """Arm the overlapped sync for a step of ``microbatches`` backwards (no-op without)."""
        if self.grad_sync is not None:
            self.grad_sync.begin(microbatches)
        self.prefetched = 0

    # ------------------------------------------------------------ the step

    def zero_grad(self) -> None:
        """Clear the main grads (and any stray low-precision ``.grad``)."""
        self.main_grad.zero_()
        for p in self.params:
            p.grad = None

    def grad_norm_sq_local(self) -> float:
        """Sum of squares of this rank's countable share of the (reduced) gradients."""
        g = self.main_grad[self.lo:self.hi]
        # float64 accumulation, UPDATE_CHUNK elements at a time: vector_norm's dtype casts its
        # input, a float64 copy of the whole slice (8 bytes per parameter) at once otherwise
        return sum(float(torch.linalg.vector_norm(g[c:min(b, c + UPDATE_CHUNK)],
                                                  dtype=torch.float64)) ** 2
                   for a, b in self._norm for c in range(a, b, UPDATE_CHUNK))

    @torch.no_grad()
    def step(self, step: int) -> dict[str, float]:
        """Reduce, unscale, clip and apply optimizer step ``step`` (0-based); returns
        ``{"lr", "grad_norm", "skipped", "loss_scale"}``. Collective over the job."""
        lr = lr_at(self.t, step)
        if self.grad_sync is not None:  # overlapped: wait on every bucket's all-reduce
            self.grad_sync.finish()
        elif self.reduce_grads is not None and self.mode not in PER_UNIT:
            self.reduce_grads(self.main_grad)  # ZeRO-2/3 reduced each unit in the backward
        g = self.main_grad[self.lo:self.hi]
        if self.loss_scale != 1.0:
            g.div_(self.loss_scale)
        slot, slots = self.norm_slot
        vec = torch.zeros(2 * slots, dtype=torch.float64)
        # a non-finite gradient anywhere makes some rank's counted sum of squares non-finite
        # (uncounted elements are copies of counted ones): no separate isfinite pass
        local_sq = self.grad_norm_sq_local()
        vec[2 * slot] = local_sq
        vec[2 * slot + 1] = 0.0 if math.isfinite(local_sq) else 1.0
        if self.norm_reduce is not None:
            self.norm_reduce(vec)
        norm = math.sqrt(max(0.0, float(vec[2 * slot])))
        info = {"lr": lr, "grad_norm": norm, "skipped": 0.0, "loss_scale": self.loss_scale}
        if float(vec[1::2].sum()) > 0 or not math.isfinite(norm):
            info["skipped"] = 1.0
            if self.t.precision == "fp16":
                self.loss_scale = max(1.0, self.loss_scale / 2)
                self._good_steps = 0
            log.warning("step %d: non-finite gradients, update skipped (loss scale %g)", step,
                        self.loss_scale)
            self.zero_grad()
            return info
        if self.t.grad_clip > 0:
            coef = self.t.grad_clip / (norm + CLIP_EPS)
            if coef < 1.0:
                g.mul_(coef)
        self._update(g, lr)
        self._publish()
        if self.t.precision == "fp16":
            self._good_steps += 1
            if self._good_steps % FP16_GROWTH_INTERVAL == 0:
                self.loss_scale *= 2
        self.zero_grad()
        return info

    def _update(self, g: torch.Tensor, lr: float) -> None:
        master = self.master
        if self.kind == "sgd":
            master.add_(g, alpha=-lr)
            return
        t = self.t
        self.step_count += 1
        if t.weight_decay:
            for a, b in self._decay:
                master[a:b].mul_(1.0 - lr * t.weight_decay)
        b1, b2 = t.adam_beta1, t.adam_beta2
        assert self.exp_avg is not None and self.exp_avg_sq is not None
        self.exp_avg.lerp_(g, 1.0 - b1)
        self.exp_avg_sq.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        bc1 = 1.0 - b1 ** self.step_count
        bc2 = 1.0 - b2 ** self.step_count
        # the denominator in chunks into one reused buffer: the step's transient memory is
        # UPDATE_CHUNK elements, not two fp32 copies of the slice (8 bytes per parameter
        # on a bf16 H200 step, bench/gpu_check.py); same ops, same bits
        n = master.numel()
        buf = torch.empty(min(n, UPDATE_CHUNK), dtype=master.dtype, device=master.device)
        for a in range(0, n, UPDATE_CHUNK):
            b = min(n, a + UPDATE_CHUNK)
            denom = torch.sqrt(self.exp_avg_sq[a:b], out=buf[:b - a])
            denom.div_(math.sqrt(bc2)).add_(t.adam_eps)
            master[a:b].addcdiv_(self.exp_avg[a:b], denom, value=-lr / bc1)

    def _publish(self) -> None:
        """Cast the updated master slice into the parameters; ZeRO-1: all-gather the slices;
        ZeRO-2: all-gather each unit's chunks; ZeRO-3: only the own chunks (gathered on use)."""
        if self.mode == "full":
            assert self.param_shard is not None
            if self.param_shard.data_ptr() != self.master.data_ptr():
                self.param_shard.copy_(self.master)
            for u in self.units:  # a gathered copy (a prefetch nobody used) is stale now
                self._free(u)
            return
        if self.mode == "gradients":
            assert self.params_flat is not None and self.shard is not None
            i = self.shard.index
            for u in self.units:
                block = self.params_flat[u.start:u.start + u.padded]
                block[i * u.chunk:(i + 1) * u.chunk].copy_(
                    self.master[u.local:u.local + u.chunk])
                if not self.shard.stand_in:
                    self._all_gather(block, u.chunk)
            return
        if self.master.data_ptr() != self.params_flat[self.lo:self.hi].data_ptr():
            self.params_flat[self.lo:self.hi].copy_(self.master)
        if self.shard is not None and not self.shard.stand_in:
            self._all_gather(self.params_flat, self.hi - self.lo)

    def _all_gather(self, flat: torch.Tensor, chunk: int) -> None:
        """Fill every DP rank's ``chunk``-element slice of ``flat`` from its owner (in place)."""
        sh = self.shard
        assert sh is not None
        staged = flat if flat.device == sh.staging else flat.to(sh.staging)
        parts = list(staged.split(chunk))
        if sh.gather is not None:
            sh.gather(parts, sh.index)
            if staged is not flat:
                flat.copy_(staged)
            return
        mine = parts[sh.index].clone()
        t0 = time.perf_counter()
        dist.all_gather(parts, mine, group=sh.group)
        if sh.account is not None:
            nbytes = (sh.size - 1) * mine.numel() * mine.element_size()
            sh.account(nbytes, time.perf_counter() - t0)
        if staged is not flat:
            flat.copy_(staged)

    # ------------------------------------------------------------ DiLoCo, checkpoints

    def master_views(self) -> list[torch.Tensor]:
        """Per-parameter fp32 views of the master weights (unsharded optimizer only)."""
        if self.shard is not None:
            raise ValueError("plan.training.optimizer_sharding: per-parameter master views "
                             "need the unsharded optimizer")
        return [self.master[s.start:s.end].view(p.shape)
                for s, p in zip(self.segments, self.params, strict=True)]

    def params_from_master(self) -> None:
        """Copy the (changed) master weights into the parameters (after DiLoCo's outer step)."""
        with torch.no_grad():
            self._publish()

    def checkpoint_state(self, tp: TPShards | None = None, *, dp_index: int = 0,
                         for_save: bool = True) -> list[ShardedTensor]:
        """This rank's optimizer state as checkpoint pieces, keyed by global parameter names
        (``optim.<name>.{exp_avg,exp_avg_sq,step}`` and, for low precision,
        ``optim.<name>.master``), each piece a VIEW of this rank's slice: nothing is gathered
        or copied, so with ZeRO-1/2/3 a rank saves (and loads) ``1/dp`` of the state. Under
        ZeRO-3 the parameters themselves (``<name>``) are pieces of its chunks too (the
        caller leaves them out of ``checkpoint.job_state``). ``tp``: how the stage's
        parameters are TP-sharded (pieces are placed in the unsharded tensors).

        ``for_save``: only what this rank writes -- sharded, every DP replica its slice;
        unsharded only replica ``dp_index`` 0; TP-replicated parameters only from TP index 0;
        each parameter's scalar ``step`` once, by the TP-index-0 rank owning its first
        element. Otherwise the load targets of the whole slice (then :meth:`load_finish`)."""
        shards = tp.shards if tp is not None else {}
        tp_index = tp.index if tp is not None else 0
        if for_save and self.shard is None and dp_index != 0:
            return []
        sources: list[tuple[str, torch.Tensor]] = []
        if self.exp_avg is not None and self.exp_avg_sq is not None:
            sources += [("optim.{}.exp_avg", self.exp_avg),
                        ("optim.{}.exp_avg_sq", self.exp_avg_sq)]
        if self.param_shard is not None:  # ZeRO-3: the parameters are only here
            if not for_save:
                self._params_in = torch.full_like(self.param_shard, math.nan)
            sources.append(("{}", self.param_shard if for_save else self._params_in))
        if self.dtype != torch.float32:
            if not for_save:  # NaN: not in the checkpoint -> taken from the loaded parameters
                self._master_in = torch.full_like(self.master, math.nan)
            sources.append(("optim.{}.master", self.master if for_save or self._master_in is None
                            else self._master_in))
        if not for_save:
            self._steps_in = []
        out = []
        for s, p in zip(self.segments, self.params, strict=True):
            if for_save and s.replicated and tp_index != 0:
                continue
            parts = list(self._owned_parts(s))
            if not parts:
                continue
            dim, idx = shards.get(s.name, (None, None))
            shape = tuple(p.shape) if dim is None or tp is None else tp.full_shape(s.name, p)
            index = idx[tp_index].tolist() if idx is not None else None
            for key, buf in sources:
                pieces = [piece for a, b, la, lb in parts
                          for piece in local_range_pieces(buf[la:lb], p.shape, a - s.start,
                                                          dim=dim, index=index)]
                out.append(ShardedTensor(key.format(s.name), shape, pieces))
            owns_first = parts[0][0] == s.start
            if self.kind == "adamw" and (not for_save or (owns_first and tp_index == 0)):
                step = torch.tensor(float(self.step_count) if for_save else -1.0)
                if not for_save:
                    self._steps_in.append(step)
                out.append(ShardedTensor.whole(f"optim.{s.name}.step", step))
        return out

    def _owned_params(self) -> torch.Tensor:
        """This rank's owned parameter elements, as fp32, in the owned buffers' order."""
        if self.param_shard is not None:
            return self.param_shard.float()
        assert self.params_flat is not None
        return torch.cat([self.params_flat[a:b] for a, b, _ in self.owned]).float()

    @torch.no_grad()
    def load_finish(self) -> None:
        """Adopt what a checkpoint load put into :meth:`checkpoint_state`'s targets (``for_save=
        False``); the parameters were loaded by the checkpoint, and master weights it lacks
        default to them. Collective over the DP group with ZeRO-1/2 (the parameter
        all-gather)."""
        if self.kind == "adamw":
            self.step_count = max(0, int(max((float(t) for t in self._steps_in), default=0.0)))
        if self._params_in is not None:
            assert self.param_shard is not None
            self.param_shard.copy_(torch.where(torch.isnan(self._params_in), self.param_shard,
                                               self._params_in))
            self._params_in = None
        if self._master_in is not None:
            current = self._owned_params()
            self.master.copy_(torch.where(torch.isnan(self._master_in), current,
                                          self._master_in))
            self._master_in = None
            self._publish()
        elif self.mode == "gradients":  # fp32: the master is a copy of the owned parameters
            self.master.copy_(self._owned_params())
        self._steps_in = []


def _merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ascending ``[a, b)`` ranges with touching neighbours joined."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _fold_into_main_grad(p: torch.Tensor) -> None:
    """Post-accumulate hook: add the low-precision gradient into fp32 ``main_grad``, free it,
    and tell the overlapped DP sync (``grad_sync.BucketedGradSync``) when there is one."""
    if p.grad is not None:
        p.main_grad.add_(p.grad)
        p.grad = None
        ready = getattr(p, "main_grad_ready", None)
        if ready is not None:
            ready(p)
