"""The optimizer of one stage: mixed precision, fp32 main grads, flat AdamW, ZeRO-1.

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
for all-reduce only, and gloo (CPU, host-staged cross-vendor groups) has no reduce-scatter. The
all-reduce moves twice the bytes of a reduce-scatter; the planner charges it (``planner.
_dp_time_per_byte``).

Checkpoints (:meth:`StageOptimizer.checkpoint_state`): each rank saves and loads views of its
own slice, as boxes of the global (unsharded, TP-gathered) per-parameter tensors; nothing is
gathered, so a ZeRO-1 rank writes ``1/dp`` of the optimizer state and a checkpoint reshards
onto any tp/pp/dp layout.

fp16 uses dynamic loss scaling: the loss is multiplied by :attr:`StageOptimizer.loss_scale`
before backward; a step whose gradients overflow anywhere is skipped on every rank and the scale
halved; after ``FP16_GROWTH_INTERVAL`` good steps it doubles.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hettrain.api.spec import TrainingSpec
from hettrain.runtime.checkpoint_format import ShardedTensor, local_range_pieces
from hettrain.runtime.grad_sync import DEFAULT_BUCKET_BYTES, BucketedGradSync, Work
from hettrain.runtime.lr_schedule import lr_at
from hettrain.runtime.tensor_parallel import TPShards

log = logging.getLogger("hettrain.runtime")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OPTIMIZER_KINDS = ("adamw", "sgd")
FP16_INITIAL_SCALE = 2.0 ** 16
FP16_GROWTH_INTERVAL = 1000
CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_
UPDATE_CHUNK = 1 << 24  # elements of the AdamW denominator computed at a time (64 MiB fp32)


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
    TP-replicated parameters.
    """

    def __init__(self, model: nn.Module, training: TrainingSpec, *, kind: str = "adamw",
                 shard: ShardGroup | None = None,
                 reduce_grads: Callable[[torch.Tensor], None] | None = None,
                 norm_reduce: Callable[[torch.Tensor], None] | None = None,
                 tp_sharded: frozenset[str] | set[str] = frozenset(), tp: int = 1,
                 tp_index: int = 0, norm_slot: tuple[int, int] = (0, 1),
                 counts_norm: bool = True) -> None:
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
        self.segments = layout(model, training, tp_sharded, tp)
        device = self.params[0].device
        n = self.segments[-1].end if self.segments else 0
        k = self.shard.size if self.shard else 1
        self.numel, self.padded = n, -(-n // k) * k
        size = self.padded // k
        self.lo = (self.shard.index if self.shard else 0) * size
        self.hi = self.lo + size
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
        del full
        self.exp_avg = torch.zeros_like(self.master) if kind == "adamw" else None
        self.exp_avg_sq = torch.zeros_like(self.master) if kind == "adamw" else None
        self.step_count = 0
        self.loss_scale = FP16_INITIAL_SCALE if training.precision == "fp16" else 1.0
        self._good_steps = 0
        self._master_in: torch.Tensor | None = None  # load targets (checkpoint_state)
        self._steps_in: list[torch.Tensor] = []
        local = [(max(s.start, self.lo) - self.lo, min(s.end, self.hi) - self.lo, s)
                 for s in self.segments if s.start < self.hi and s.end > self.lo]
        self._decay = [(a, b) for a, b, s in local if s.decay]
        self._norm = [(a, b) for a, b, s in local if not (s.replicated and tp_index != 0)]
        if self.shard is None and not counts_norm:
            self._norm = []
        self._norm = _merge_ranges(self._norm)  # one reduction per contiguous run, not per param
        self.grad_sync: BucketedGradSync | None = None  # enable_overlap()

    def enable_overlap(self, launch: Callable[[torch.Tensor], Work], group_size: int,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                       account: Callable[[int, float], None] | None = None,
                       wire_bytes: Callable[[int], int] | None = None) -> BucketedGradSync:
        """Sync the main grads in buckets during the backward instead of ``reduce_grads``
        after it (``grad_sync`` module doc): ``launch(view)`` starts one bucket's sum
        all-reduce over the DP group. Call :meth:`begin_step` after :meth:`zero_grad`."""
        self.grad_sync = BucketedGradSync(
            self.params, [(s.start, s.end) for s in self.segments], self.main_grad, launch,
            group_size, bucket_bytes, account, wire_bytes)
        return self.grad_sync

    def begin_step(self, microbatches: int) -> None:
        """Arm the overlapped sync for a step of ``microbatches`` backwards (no-op without)."""
        if self.grad_sync is not None:
            self.grad_sync.begin(microbatches)

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
        elif self.reduce_grads is not None:
            self.reduce_grads(self.main_grad)
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
        """Cast the updated master slice into the parameters; ZeRO-1: all-gather the slices."""
        if self.master.data_ptr() != self.params_flat[self.lo:self.hi].data_ptr():
            self.params_flat[self.lo:self.hi].copy_(self.master)
        if self.shard is not None:
            self._all_gather(self.params_flat)

    def _all_gather(self, flat: torch.Tensor) -> None:
        """Fill every DP rank's slice of ``flat`` from its owner (in place)."""
        sh = self.shard
        assert sh is not None
        staged = flat if flat.device == sh.staging else flat.to(sh.staging)
        parts = list(staged.split(self.hi - self.lo))
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
        or copied, so with ZeRO-1 a rank saves (and loads) ``1/dp`` of the state. ``tp``: how
        the stage's parameters are TP-sharded (pieces are placed in the unsharded tensors).

        ``for_save``: only what this rank writes -- with ZeRO-1 every DP replica its slice,
        unsharded only replica ``dp_index`` 0; TP-replicated parameters only from TP index 0;
        each parameter's scalar ``step`` once, by the TP-index-0 rank owning its first
        element. Otherwise the load targets of the whole slice (then :meth:`load_finish`)."""
        shards = tp.shards if tp is not None else {}
        tp_index = tp.index if tp is not None else 0
        if for_save and self.shard is None and dp_index != 0:
            return []
        sources: list[tuple[str, torch.Tensor]] = []
        if self.exp_avg is not None and self.exp_avg_sq is not None:
            sources += [("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)]
        if self.dtype != torch.float32:
            if not for_save:  # NaN: not in the checkpoint -> taken from the loaded parameters
                self._master_in = torch.full_like(self.master, math.nan)
            sources.append(("master", self.master if for_save or self._master_in is None
                            else self._master_in))
        if not for_save:
            self._steps_in = []
        out = []
        for s, p in zip(self.segments, self.params, strict=True):
            a, b = max(s.start, self.lo), min(s.end, self.hi)
            if a >= b or (for_save and s.replicated and tp_index != 0):
                continue
            dim, idx = shards.get(s.name, (None, None))
            shape = tuple(p.shape) if dim is None or tp is None else tp.full_shape(s.name, p)
            index = idx[tp_index].tolist() if idx is not None else None
            for kind, buf in sources:
                pieces = local_range_pieces(buf[a - self.lo:b - self.lo], p.shape, a - s.start,
                                            dim=dim, index=index)
                out.append(ShardedTensor(f"optim.{s.name}.{kind}", shape, pieces))
            if self.kind == "adamw" and (not for_save or (s.start >= self.lo and tp_index == 0)):
                step = torch.tensor(float(self.step_count) if for_save else -1.0)
                if not for_save:
                    self._steps_in.append(step)
                out.append(ShardedTensor.whole(f"optim.{s.name}.step", step))
        return out

    @torch.no_grad()
    def load_finish(self) -> None:
        """Adopt what a checkpoint load put into :meth:`checkpoint_state`'s targets (``for_save=
        False``); the parameters were loaded by the checkpoint, and master weights it lacks
        default to them. Collective over the DP group with ZeRO-1 (the parameter all-gather)."""
        if self.kind == "adamw":
            self.step_count = max(0, int(max((float(t) for t in self._steps_in), default=0.0)))
        if self._master_in is not None:
            current = self.params_flat[self.lo:self.hi].float()
            self.master.copy_(torch.where(torch.isnan(self._master_in), current,
                                          self._master_in))
            self._master_in = None
            self._publish()
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
