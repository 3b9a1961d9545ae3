"""Measure the bytes one pipeline stage really holds, on the CPU, for the memory-honesty test.

:func:`measure_stage` builds stage ``s`` of a plan exactly as a rank does (its layers or model
chunks, its TP shard of the weights, the stage optimizer with the plan's precision and ZeRO-1
degree) and runs one step of the stage's schedule single-process, with random boundary
activations and gradients standing in for its pipeline peers. It reports:

- ``params``: the parameter buffer (plan precision; ZeRO-3: the own chunks);
- ``grads``: the fp32 main-grad buffer (ZeRO-2/3: the own chunks);
- ``optimizer``: the fp32 master slice (when it is not the parameters) and the AdamW moments;
- ``transient`` (ZeRO-2/3): the peak of what the per-unit sync holds at once -- each unit's
  fp32 gradient bucket until its reduction has completed (overlapped: the ones in flight
  too) and, ZeRO-3, the gathered units' parameters (overlapped: with the prefetched one);
- ``activations``: the PEAK bytes kept for the backward pass over the step, from
  ``torch.autograd.graph.saved_tensors_hooks`` (each storage counted once, parameters excluded)
  and, for attention-free recompute, the attention outputs its checkpoints cache (counted
  from the forward that saves them to the re-run that takes them, :func:`_counted_contexts`),
  plus the backward's working set: the larger peak of what one MLP backward and one
  attention half's backward allocate (the gradients and products the saved-tensor hooks
  cannot see: counted by ``runtime.live_bytes.LiveBytes``, every allocation until it is
  freed) and, for full and
  attention-free recompute, one layer's forward re-run in the backward; plus what the runner
  itself keeps alive per in-flight microbatch (the stage output it will call ``backward``
  on) and, for ZB-H1, the ``(input, grad_output)`` stash of deferred weight gradients;
- ``loss_buffers`` (last stage): the logits, their gradient and (below fp32) their fp32 copy,
  alive together while the loss and its backward run (the saved log-softmax is part of
  ``activations``): counted from the logits' size, as the CPU has no allocator peak; the CUDA
  peak of ``bench/gpu_check.py`` on an H200 showed this sum. With the chunked loss
  (``plan.training.loss_chunk_tokens``) its backward's chunk-sized buffers and fp32
  weight-gradient sum (``cost.chunked_loss_transient_bytes``; its saved log-sum-exp is part
  of ``activations``).

TP is measured on the local shard with a stand-in TP group: its collectives move nothing but
keep their shapes (a sequence-parallel all-gather repeats the shard), as their buffers are
transient and their saved tensors are the same as with real peers. Context parallelism
(``stages[s].cp > 1``) is measured on CP rank 1's ``seq_len / cp`` tokens (a rank holding
the most: rank 0's first chunk is the square causal block, for which SDPA keeps no mask), the
other ranks' keys/values stand-ins (``context_parallel.StandInContextParallel``), ZeRO over
the DP×CP group (a stand-in group: the other ranks' chunks of a gathered unit are zeros,
nothing is reduced).
Nothing here talks to other processes.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, SupportsIndex

import torch
from torch.utils._pytree import tree_leaves

from hettrain.api.spec import chunked_schedule, splits_backward
from hettrain.planning import cost
from hettrain.planning.layers import chunk_layer_ranges
from hettrain.planning.plan import Plan
from hettrain.runtime.context_parallel import StandInContextParallel, enable_
from hettrain.runtime.grad_sync import Completed
from hettrain.runtime.helix import HelixRunner
from hettrain.runtime.live_bytes import LiveBytes
from hettrain.runtime.model import (
    StageModel,
    WeightGradStore,
    attention_free_contexts,
    defer_weight_grads,
)
from hettrain.runtime.optim import ShardGroup, StageOptimizer, sharding_of
from hettrain.runtime.schedules import chunk_actions
from hettrain.runtime.tensor_parallel import TPGroup, shard_stage_


@dataclass(frozen=True, slots=True)
class StageBytes:
    """Measured bytes of one stage (one rank)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    loss_buffers: int
    working: int = 0  # the backward's working set (_backward_working_set), in ``activations``
    transient: int = 0  # ZeRO-2/3: gradient buckets and gathered units at their peak

    @property
    def total(self) -> int:
        """Everything measured (what the plan's prediction minus its fixed overhead covers).
        The loss buffers and the backward's working set are never alive together (the loss's
        backward ends before the first layer's backward starts): the larger of the two
        counts."""
        return (self.params + self.grads + self.optimizer + self.activations - self.working
                + max(self.working, self.loss_buffers) + self.transient)


class _Tracker:
    """Live bytes of tensors kept for the backward, each storage counted once; tracks the peak."""

    def __init__(self, exclude: Callable[[int], bool]) -> None:
        self.exclude = exclude  # storages not to count (the parameters)
        self.live: dict[int, list[int]] = {}  # storage ptr -> [references, bytes]
        self.bytes = 0
        self.peak = 0

    def hold(self, t: torch.Tensor) -> _Held:
        """Count ``t`` until the returned handle is dropped."""
        return _Held(self, t)

    def _add(self, ptr: int, nbytes: int) -> None:
        if nbytes == 0 or self.exclude(ptr):
            return
        entry = self.live.get(ptr)
        if entry is None:
            self.live[ptr] = [1, nbytes]
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)
        else:
            entry[0] += 1

    def _drop(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.bytes -= entry[1]
            del self.live[ptr]


class _Held:
    """A tensor counted by a :class:`_Tracker` while this object lives."""

    __slots__ = ("ptr", "t", "tracker")

    def __init__(self, tracker: _Tracker, t: torch.Tensor) -> None:
        self.t, self.tracker = t, tracker
        storage = t.untyped_storage()
        self.ptr = storage.data_ptr()
        tracker._add(self.ptr, storage.nbytes())

    def __del__(self) -> None:
        self.tracker._drop(self.ptr)


@contextmanager
def _saved_tensors(tracker: _Tracker) -> Iterator[None]:
    with torch.autograd.graph.saved_tensors_hooks(tracker.hold, lambda held: held.t):
        yield


class _CountedCache(list):
    """One op's list in a selective checkpoint's cache (``torch.utils.checkpoint``: the
    forward appends each saved output, the backward's re-run pops it), its tensors counted by
    a :class:`_Tracker` while they are cached."""

    def __init__(self, tracker: _Tracker) -> None:
        super().__init__()
        self.tracker = tracker
        self.holds: list[list[_Held]] = []

    def append(self, entry: Any) -> None:
        """Cache ``entry`` (the op's outputs, each wrapped) and count its tensors."""
        super().append(entry)
        values = (getattr(leaf, "val", None) for leaf in tree_leaves(entry))
        self.holds.append([self.tracker.hold(t) for t in values
                           if isinstance(t, torch.Tensor)])

    def pop(self, index: SupportsIndex = -1) -> Any:
        """Hand an entry to the re-run; its tensors stop counting here (the re-run layer's
        working set counts them from now on)."""
        self.holds.pop(index)
        return super().pop(index)


def _counted_contexts(tracker: _Tracker) -> Callable[[], tuple[Any, Any]]:
    """Attention-free recompute's checkpoint contexts (``model.attention_free_contexts``)
    with their cache counted by ``tracker``."""
    def contexts() -> tuple[Any, Any]:
        caching, cached = attention_free_contexts()
        caching.storage = cached.storage = defaultdict(lambda: _CountedCache(tracker))
        return caching, cached
    return contexts


def build_stage(plan: Plan, stage: int, tp_index: int = 0) -> tuple[StageModel, set[str]]:
    """Stage ``stage``'s model as a rank builds it (TP shard ``tp_index``, without the TP
    process group); returns it and the names of its TP-sharded parameters."""
    st = plan.stages[stage]
    kwargs = {}
    if "recompute" in inspect.signature(StageModel).parameters:
        kwargs["recompute"] = plan.training.recompute
    if "loss_chunk_tokens" in inspect.signature(StageModel).parameters:
        kwargs["loss_chunk_tokens"] = plan.training.loss_chunk_tokens
    if "mlp_chunk_tokens" in inspect.signature(StageModel).parameters:
        kwargs["mlp_chunk_tokens"] = plan.training.mlp_chunk_tokens
    model = StageModel(plan.model, st.layer_start, st.layer_end, has_embedding=stage == 0,
                       has_head=stage == plan.pp - 1, seed=plan.training.seed,
                       chunks=chunk_layer_ranges(plan)[stage], **kwargs)
    tp = shard_stage_(model, plan.model, st.tp, tp_index, None, list(range(st.tp)), cp=st.cp)
    # local shard only: a stand-in TP group moves nothing (collectives keep their shapes)
    stand_in = TPGroup(None, None, st.tp, tp_index, tuple(range(st.tp)))
    for mod in model.modules():
        if getattr(mod, "tp_group", None) is not None:
            mod.tp_group = stand_in
        if getattr(mod, "gather", None) is not None:
            mod.gather = stand_in
    if model.sp is not None:
        model.sp = stand_in
    return model, set(tp.shards)


def predicted_stage_bytes(plan: Plan, stage: int) -> float:
    """The planner's per-device prediction for ``stage`` minus its fixed framework overhead
    (``cost.stage_memory`` with the plan's layout and schedule): what :func:`measure_stage`
    must match. CP's causal masks are counted whatever the plan's device, as the CPU that
    measures materialises them (an NVIDIA GPU's fused kernels do not:
    ``cost.skips_masked_tiles``)."""
    st = plan.stages[stage]
    mem = cost.stage_memory(plan.model, plan.training, tp=st.tp, dp=plan.dp, cp=st.cp,
                            micro_batch=plan.micro_batch, first=stage == 0,
                            last=stage == plan.pp - 1,
                            **cost.schedule_memory_args(stage, plan.pp, plan.num_microbatches,
                                                        plan.schedule, plan.virtual_stages,
                                                        plan.helix_filo, st.link_warmup,
                                                        plan.link_recv_ahead(stage)))
    return mem.bytes_for(st.layers) - cost.FRAMEWORK_OVERHEAD_BYTES


def measure_stage(plan: Plan, stage: int) -> StageBytes:
    """Run one step of stage ``stage``'s schedule on the CPU and measure its bytes."""
    st = plan.stages[stage]
    model, sharded = build_stage(plan, stage)
    if st.cp > 1:  # CP rank 1: its 2 chunks of the sequence, stand-in peers' keys/values
        enable_(model, StandInContextParallel(st.cp, 1, plan.model.seq_len))
    zero = plan.dp * st.cp  # ZeRO shards over the DP×CP gradient group
    shard = (ShardGroup(None, 0, zero, torch.device("cpu"), stand_in=True)
             if sharding_of(plan.training) != "none" and zero > 1 else None)
    opt = StageOptimizer(model, plan.training, shard=shard, tp_sharded=sharded, tp=st.tp)
    if shard is not None and opt.units and plan.training.overlap_grad_reduce:
        # ZeRO-2/3 as an overlapping rank: reductions in flight, ZeRO-3's prefetched unit
        # (stand-in collectives complete at once; the buffers live as long as on a rank)
        opt.enable_overlap(lambda view: Completed(), zero)
        opt.begin_step(plan.num_microbatches)
    params, grads, optim = opt.state_bytes()
    tracker = _Tracker(_parameter_storages(opt))
    for layer in model.layers.values():
        layer.checkpoint_contexts = _counted_contexts(tracker)
    run = _run_helix if plan.schedule == "helix" else _run_schedule
    loss_buffers = run(plan, stage, model, opt, tracker)
    transient = opt.peak_transient_bytes
    working = _backward_working_set(plan, model, opt)
    return StageBytes(params, grads, optim, tracker.peak + working, loss_buffers, working,
                      transient)


def _parameter_storages(opt: StageOptimizer) -> Callable[[int], bool]:
    """Whether a storage holds parameters (the flat buffer, or a ZeRO-3 unit gathered now:
    its storage moves with every gather)."""
    def check(ptr: int) -> bool:
        if opt.params_flat is not None and ptr == opt.params_flat.untyped_storage().data_ptr():
            return True
        return any(u.full is not None and u.gathered
                   and ptr == u.full.untyped_storage().data_ptr() for u in opt.units)
    return check


def _backward_working_set(plan: Plan, model: StageModel, opt: StageOptimizer) -> int:
    """The backward's working set, added to the stage's peak (it runs on top of what is held):
    the larger of what one MLP backward and one attention half's backward allocate at their
    peaks (:func:`_mlp_backward_transient`, :func:`_attention_backward_transient`, one
    microbatch) and, with full and attention-free recompute, what the backward of one layer
    keeps while it re-runs the layer's forward (``torch.utils.checkpoint`` re-runs ``_block``
    and saves what it saves; attention-free takes the attention kernel's cached outputs
    instead of re-running it, which then count here), measured by running that block forward
    under the saved-tensor hooks for one microbatch."""
    key, layer = next(iter(model.layers.items()))
    spec = plan.model
    gen = torch.Generator().manual_seed(1)
    seq = spec.seq_len // plan.stages[0].cp  # context parallel: this rank's tokens
    cos, sin = model._cos_sin(torch.empty((plan.micro_batch, seq)))
    if model.sp is not None:  # sequence parallel: the layer's input is a token shard
        seq //= model.sp.size
    x = torch.randn((plan.micro_batch, seq, spec.hidden), generator=gen)
    x = x.to(opt.dtype).requires_grad_()
    with opt.gathered([f"model.layers.{key}"]):  # ZeRO-3: as the re-run finds it
        transient = max(_mlp_backward_transient(layer, x.detach(), gen),
                        _attention_backward_transient(layer, x.detach(), cos, sin, gen))
        if not cost.reruns_layer(plan.training.recompute):
            return transient
        tracker = _Tracker(_parameter_storages(opt))
        with _saved_tensors(tracker):
            out = layer._block(x, cos, sin)
        del out
    return tracker.peak + transient


def _mlp_backward_transient(layer: torch.nn.Module, x: torch.Tensor,
                            gen: torch.Generator) -> int:
    """The peak of what one MLP backward of ``layer`` allocates (:class:`LiveBytes`), on input
    ``x`` (the layer input's shape) and a random output gradient: a layer's backward starts
    with it, on top of what the stage holds."""
    return _backward_peak(layer.mlp, x, gen)


class _AttentionHalf(torch.nn.Module):
    """``x + attn(norm(x))`` of a decoder layer (its modules, not copies)."""

    def __init__(self, layer: torch.nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = layer.input_layernorm, layer.self_attn
        self.cos, self.sin = cos, sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.self_attn(self.input_layernorm(x), self.cos, self.sin)


def _attention_backward_transient(layer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor,
                                  sin: torch.Tensor, gen: torch.Generator) -> int:
    """The peak of what one attention half's backward of ``layer`` allocates: a layer's
    backward runs it after its MLP's."""
    return _backward_peak(_AttentionHalf(layer, cos, sin), x, gen)


def _backward_peak(module: torch.nn.Module, x: torch.Tensor, gen: torch.Generator) -> int:
    """Run ``module`` on a copy of ``x`` and measure the peak of what its backward allocates
    (:class:`LiveBytes`) for a random output gradient."""
    inp = x.clone().requires_grad_()
    # the weights as leaves whose gradient is dropped once accumulated, as the optimizer's
    # hooks fold it into the fp32 main grads (allocated once, counted as ``grads``) and free
    # it; ZeRO-2/3's unit buckets are counted as ``transient``
    weights = {name: p.detach().requires_grad_() for name, p in module.named_parameters()}
    for w in weights.values():
        w.register_post_accumulate_grad_hook(_drop_grad)
    out = torch.func.functional_call(module, weights, (inp,))
    grad = torch.randn(out.shape, generator=gen).to(out.dtype)
    live = LiveBytes()
    with live:
        out.backward(grad)
    return live.peak


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


class _HeldState(dict):
    """The helix runner's per-part state, its tensors counted while they are held."""

    def __init__(self, tracker: _Tracker) -> None:
        super().__init__()
        self.tracker = tracker
        self.holds: dict[Any, list[_Held]] = {}

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self.holds[key] = [self.tracker.hold(t) for t in value if isinstance(t, torch.Tensor)]

    def pop(self, key: Any, *default: Any) -> Any:
        """Release the key's tensors (as the runner drops them) and return its value."""
        self.holds.pop(key, None)
        return super().pop(key, *default)


class _StandInHelix(HelixRunner):
    """The helix runner of one stage with stand-in peers: sends go nowhere, receives are
    random tensors of the message's shape; its state is counted."""

    def __init__(self, plan: Plan, stage: int, model: StageModel, tracker: _Tracker) -> None:
        rank = next(r.rank for r in plan.ranks if r.stage == stage and r.dp == 0 and r.tp == 0)
        super().__init__(plan, rank, model)
        self.tracker = tracker
        self.gen = torch.Generator().manual_seed(0)

    def _new_state(self) -> dict:
        return _HeldState(self.tracker)

    def _send(self, t: torch.Tensor, stage: int, tag: int, layer: int, kind: int) -> None:
        return None

    def _recv(self, shape: tuple[int, ...], stage: int, tag: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen).to(self.act_dtype)


def _run_helix(plan: Plan, stage: int, model: StageModel, opt: StageOptimizer,
               tracker: _Tracker) -> int:
    """One step of the stage's helix order (``runtime/helix.py``) with stand-in peers;
    returns the loss-buffer bytes (the head's stage)."""
    gen = torch.Generator().manual_seed(0)
    spec, b, m = plan.model, plan.micro_batch, plan.num_microbatches
    batches = [(torch.randint(0, spec.vocab, (b, spec.seq_len), generator=gen),
                torch.randint(0, spec.vocab, (b, spec.seq_len), generator=gen))
               for _ in range(m)]
    with _saved_tensors(tracker):
        _StandInHelix(plan, stage, model, tracker).run(batches, 1.0 / m)
    if opt.grad_sync is not None:
        opt.grad_sync.finish()
    opt.zero_grad()
    if stage != plan.pp - 1:
        return 0
    return _loss_buffer_bytes(plan, stage, b * spec.seq_len * spec.vocab, opt.dtype)


def _loss_buffer_bytes(plan: Plan, stage: int, logits: int, dtype: torch.dtype) -> int:
    """What the loss holds while it and its backward run: ``logits`` logits and their
    gradient in ``dtype`` and, below fp32, their fp32 copy; with the chunked loss
    (``plan.training.loss_chunk_tokens``) its backward's chunk-sized buffers instead
    (``cost.chunked_loss_transient_bytes`` on the rank's tokens and vocabulary rows)."""
    chunk = plan.training.loss_chunk_tokens
    if not chunk:
        return 2 * logits * dtype.itemsize + (0 if dtype == torch.float32 else logits * 4)
    st = plan.stages[stage]
    local = cost.cp_local_model(plan.model, st.cp)
    return int(cost.chunked_loss_transient_bytes(local, plan.micro_batch, st.tp,
                                                 dtype.itemsize, chunk))


def _run_schedule(plan: Plan, stage: int, model: StageModel, opt: StageOptimizer,
                  tracker: _Tracker) -> int:
    """One step of the stage's actions with stand-in peers; returns the loss-buffer bytes."""
    gen = torch.Generator().manual_seed(0)
    spec, b = plan.model, plan.micro_batch
    v = len(model.chunks)
    chunked = chunked_schedule(plan.schedule)
    first, last = stage == 0, stage == plan.pp - 1
    dtype = opt.dtype
    seq = spec.seq_len // plan.stages[stage].cp  # context parallel: this rank's tokens
    shape = (b, seq, spec.hidden)
    held: dict[tuple[int, int], tuple[torch.Tensor, _Held]] = {}
    stash: dict[tuple[int, int], tuple[WeightGradStore, list[_Held]]] = {}
    loss_buffers = 0
    m = plan.num_microbatches
    for kind, i, c in chunk_actions(plan.schedule, stage, plan.pp, m, v,
                                    plan.stages[stage].link_warmup):
        if kind == "F":
            if first and c == 0:
                x = torch.randint(0, spec.vocab, (b, seq), generator=gen)
            else:
                x = torch.randn(shape, generator=gen).to(dtype).requires_grad_()
            with _saved_tensors(tracker):
                out = model.forward_chunk(c, x) if chunked else model(x)
                if last and c == v - 1:
                    loss_buffers = max(loss_buffers, _loss_buffer_bytes(
                        plan, stage, out.numel(), out.dtype))
                    y = torch.randint(0, spec.vocab, (b, seq), generator=gen)
                    out = model.loss(out, y)
            held[(i, c)] = (out, tracker.hold(out))  # the runner keeps it for backward
        elif kind == "B":
            out = held.pop((i, c))[0]  # its holder is released here, as the runner does
            grad = None if out.dim() == 0 else torch.randn(out.shape, generator=gen).to(dtype)
            if splits_backward(plan.schedule):
                with defer_weight_grads() as store:
                    out.backward(grad)
                stash[(i, c)] = (store, [tracker.hold(t) for _, xin, g in store.items
                                         for t in (xin, g)])
            else:
                out.backward(grad)
            del out
        elif kind == "W" and (i, c) in stash:  # zero-bubble only: 1F1B's W is in its B
            store, holds = stash.pop((i, c))
            store.flush()
            del holds
    if opt.grad_sync is not None:
        opt.grad_sync.finish()  # the step waits on the reductions still in flight
    opt.zero_grad()
    return loss_buffers
