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
ZeRO-1, all-gather the updated slices over the DP group.

ZeRO-1 reduces the gradients with an all-reduce and keeps its own slice rather than a
reduce-scatter: the communicator's hierarchical (pool / datacenter) and compressed paths exist
for all-reduce only, and gloo (CPU, host-staged cross-vendor groups) has no reduce-scatter. The
all-reduce moves twice the bytes of a reduce-scatter; the planner charges it (``planner.
_dp_time_per_byte``).

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
from hettrain.runtime.lr_schedule import lr_at

log = logging.getLogger("hettrain.runtime")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OPTIMIZER_KINDS = ("adamw", "sgd")
FP16_INITIAL_SCALE = 2.0 ** 16
FP16_GROWTH_INTERVAL = 1000
CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


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
        local = [(max(s.start, self.lo) - self.lo, min(s.end, self.hi) - self.lo, s)
                 for s in self.segments if s.start < self.hi and s.end > self.lo]
        self._decay = [(a, b) for a, b, s in local if s.decay]
        self._norm = [(a, b) for a, b, s in local if not (s.replicated and tp_index != 0)]
        if self.shard is None and not counts_norm:
            self._norm = []

    # ------------------------------------------------------------ the step

    def zero_grad(self) -> None:
        """Clear the main grads (and any stray low-precision ``.grad``)."""
        self.main_grad.zero_()
        for p in self.params:
            p.grad = None

    def grad_norm_sq_local(self) -> float:
        """Sum of squares of this rank's countable share of the (reduced) gradients."""
        g = self.main_grad[self.lo:self.hi]
        return float(sum(g[a:b].double().pow(2).sum() for a, b in self._norm)) if self._norm \
            else 0.0

    @torch.no_grad()
    def step(self, step: int) -> dict[str, float]:
        """Reduce, unscale, clip and apply optimizer step ``step`` (0-based); returns
        ``{"lr", "grad_norm", "skipped", "loss_scale"}``. Collective over the job."""
        lr = lr_at(self.t, step)
        if self.reduce_grads is not None:
            self.reduce_grads(self.main_grad)
        g = self.main_grad[self.lo:self.hi]
        if self.loss_scale != 1.0:
            g.div_(self.loss_scale)
        slot, slots = self.norm_slot
        vec = torch.zeros(2 * slots, dtype=torch.float64)
        vec[2 * slot] = self.grad_norm_sq_local()
        vec[2 * slot + 1] = 0.0 if bool(torch.isfinite(g).all()) else 1.0
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
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(t.adam_eps)
        master.addcdiv_(self.exp_avg, denom, value=-lr / bc1)

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

    def _full(self, part: torch.Tensor | None, fill: float = 0.0) -> torch.Tensor:
        """The whole flat fp32 buffer of which ``part`` is this rank's slice (collective with
        ZeRO-1)."""
        if part is None:
            return torch.full((self.padded,), fill, dtype=torch.float32)
        if self.shard is None:
            return part
        full = torch.zeros(self.padded, dtype=torch.float32, device=part.device)
        full[self.lo:self.hi].copy_(part)
        self._all_gather(full)
        return full

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Optimizer state keyed by global parameter names, full (unsharded) tensors:
        ``optim.<name>.{step,exp_avg,exp_avg_sq}`` and, for low precision,
        ``optim.<name>.master``. Collective over the DP group with ZeRO-1."""
        out: dict[str, torch.Tensor] = {}
        m = self._full(self.exp_avg) if self.kind == "adamw" else None
        v = self._full(self.exp_avg_sq) if self.kind == "adamw" else None
        master = self._full(self.master) if self.dtype != torch.float32 else None
        for s, p in zip(self.segments, self.params, strict=True):
            if m is not None and v is not None:
                out[f"optim.{s.name}.step"] = torch.tensor(float(self.step_count))
                out[f"optim.{s.name}.exp_avg"] = m[s.start:s.end].view(p.shape)
                out[f"optim.{s.name}.exp_avg_sq"] = v[s.start:s.end].view(p.shape)
            if master is not None:
                out[f"optim.{s.name}.master"] = master[s.start:s.end].view(p.shape)
        return out

    def load_targets(self) -> dict[str, torch.Tensor]:
        """Fresh full tensors for :meth:`checkpoint_tensors`' keys to load into (a checkpoint
        may lack some); pass them back to :meth:`load_finish`."""
        out: dict[str, torch.Tensor] = {}
        m = torch.zeros(self.padded) if self.kind == "adamw" else None
        v = torch.zeros(self.padded) if self.kind == "adamw" else None
        master = torch.full((self.padded,), math.nan) if self.dtype != torch.float32 else None
        for s, p in zip(self.segments, self.params, strict=True):
            if m is not None and v is not None:
                out[f"optim.{s.name}.step"] = torch.tensor(-1.0)
                out[f"optim.{s.name}.exp_avg"] = m[s.start:s.end].view(p.shape)
                out[f"optim.{s.name}.exp_avg_sq"] = v[s.start:s.end].view(p.shape)
            if master is not None:
                out[f"optim.{s.name}.master"] = master[s.start:s.end].view(p.shape)
        self._targets = (m, v, master)
        return out

    @torch.no_grad()
    def load_finish(self, targets: dict[str, torch.Tensor]) -> None:
        """Adopt what a checkpoint load put into :meth:`load_targets`' tensors; the parameters
        themselves were loaded by the checkpoint (master weights default to them)."""
        m, v, master = self._targets
        lo, hi = self.lo, self.hi
        steps = [float(t) for k, t in targets.items() if k.endswith(".step")]
        if m is not None and v is not None and self.exp_avg is not None:
            assert self.exp_avg_sq is not None
            self.exp_avg.copy_(m[lo:hi])
            self.exp_avg_sq.copy_(v[lo:hi])
            self.step_count = int(max(steps, default=0.0)) if steps else 0
            self.step_count = max(self.step_count, 0)
        if master is not None:
            mine = master[lo:hi].to(self.master.device)
            current = self.params_flat[lo:hi].float()
            self.master.copy_(torch.where(torch.isnan(mine), current, mine))
            self._publish()
        del self._targets


def _fold_into_main_grad(p: torch.Tensor) -> None:
    """Post-accumulate hook: add the low-precision gradient into fp32 ``main_grad``, free it."""
    if p.grad is not None:
        p.main_grad.add_(p.grad)
        p.grad = None
