"""Cost model: FLOPs, memory and communication of a GPT training step. Pure arithmetic.

Notation: ``b`` microbatch (sequences), ``s`` sequence length, ``h`` hidden, ``a`` heads,
``f`` FFN hidden, ``V`` vocab, ``t`` tensor-parallel degree, ``p`` pipeline stages,
``m`` microbatches per step.

FLOPs (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC'21, §5.1): a matmul of (x, k)·(k, n) costs 2·x·k·n FLOPs; backward costs twice
forward. Per layer and token the forward pass costs ``2·P_matmul + 4·s·h`` where ``P_matmul`` are
the layer's matmul weights (q/k/v/o with GQA, 2 or 3 MLP matrices) and ``4·s·h`` are the attention
score and value products. For a plain GPT this is the paper's ``24·b·s·h²·(1 + s/6h)`` per layer
forward+backward/3 — :func:`layer_flops` reduces to it (tested). The LM head costs ``2·h·V`` per
token forward.

Activation memory: what the runtime really keeps for the backward, fitted to
``runtime.memory``'s measurement (``tests/runtime/training/test_memory_honesty.py``) rather
than Korthikanti et al.'s Megatron numbers (MLSys'23, Table 2: no flash attention, sequence
parallelism): per layer and token a replicated part (norm inputs/outputs) plus a TP-sharded part
(attention inputs/outputs, MLP), no ``s²`` score matrix (SDPA/flash attention), see
:func:`activation_bytes_per_layer`. In 1F1B stage ``i`` keeps ``p − i`` microbatches in flight
(Narayanan et al. §2.2.1); :func:`in_flight_microbatches` for the other schedules.

Model state bytes per parameter (Rajbhandari et al., ZeRO, SC'20, §3), as ``runtime.optim``
allocates them: bf16/fp16 mixed precision keeps 2 (weights) + 4 (fp32 main grads) + 12 (fp32
master, Adam m and v); ZeRO-1 shards the 12 over the stage's data-parallel ranks. fp32 training
keeps 4 + 4 + 8 (the weights are the master).

Context parallelism (``cp > 1``): :func:`stage_memory` counts a CP rank's ``s/cp`` tokens and
what its attention keeps of the whole sequence; the time of a CP layer is in
``planning/context.py``.

Communication uses the α–β model (Hockney; Thakur et al., "Optimization of Collective
Communication Operations in MPICH", 2005): a ring all-reduce of ``n`` bytes over ``k`` ranks costs
``2·(k−1)·α + 2·(k−1)/k · n/β``; reduce-scatter and all-gather cost half of that each.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hettrain.api.spec import ModelSpec, TrainingSpec, chunked_schedule
from hettrain.planning import helix, interleaved_zb
from hettrain.planning.catalog import DeviceSpec
from hettrain.planning.profiles import PRECISION_BYTES, CommProfile

GIB = 2**30
FRAMEWORK_OVERHEAD_BYTES = 3 * GIB  # CUDA/ROCm context, allocator, comm buffers
MEMORY_HEADROOM = 0.92  # fraction of HBM the planner is allowed to fill (fragmentation)
COLLECTIVE_LATENCY_S = 20e-6  # α for one ring step inside a datacenter
HOST_STAGING_LATENCY_S = 50e-6  # extra per transfer for device->host->device staging
ZB_CATALOG_DIVISOR = 3.0  # ZB-H1's bubble: a third of 1F1B's without a measured B/W split


def precision_bytes(training: TrainingSpec) -> int:
    """Bytes of one activation / weight element."""
    return PRECISION_BYTES[training.precision]


# ---------------------------------------------------------------- FLOPs


def layer_matmul_params(model: ModelSpec) -> int:
    """Matmul weights of one transformer layer (q, k, v, o projections and MLP)."""
    h = model.hidden
    kv = model.kv_heads * model.head_dim
    mlp = (3 if model.gated_mlp else 2) * h * model.ffn_hidden
    return 2 * h * h + 2 * h * kv + mlp


def layer_params(model: ModelSpec) -> int:
    """All parameters of one transformer layer (matmuls + 2 norms)."""
    return layer_matmul_params(model) + 2 * model.hidden


def layer_forward_flops(model: ModelSpec, tokens: int) -> float:
    """Forward FLOPs of one layer for ``tokens`` tokens (attention term counted in full)."""
    return tokens * (2.0 * layer_matmul_params(model) + 4.0 * model.seq_len * model.hidden)


def head_forward_flops(model: ModelSpec, tokens: int) -> float:
    """Forward FLOPs of the LM head (logits) for ``tokens`` tokens."""
    return 2.0 * tokens * model.hidden * model.vocab


LAYER_RECOMPUTE_MODES = ("attention-free", "full")  # checkpoint and re-run the whole layer


def reruns_layer(recompute: str) -> bool:
    """True when the backward re-runs each layer's forward (``attention-free``, ``full``):
    the layer keeps its input (attention-free also the attention kernel's outputs), the
    re-run repeats the forward's GEMMs, elementwise work and collectives."""
    return recompute in LAYER_RECOMPUTE_MODES


def attention_core_forward_flops(model: ModelSpec, tokens: int) -> float:
    """Forward FLOPs of one layer's attention core (score and value products) for ``tokens``."""
    return tokens * 4.0 * model.seq_len * model.hidden


def recompute_forward_flops(model: ModelSpec, tokens: int, mode: str) -> float:
    """Extra forward FLOPs per layer spent recomputing activations in the backward pass:
    full the whole layer, attention-free all of it but the attention core, selective only
    the attention core (Korthikanti §4.2)."""
    if mode == "full":
        return layer_forward_flops(model, tokens)
    if mode == "attention-free":
        return layer_forward_flops(model, tokens) - attention_core_forward_flops(model, tokens)
    if mode == "selective":
        return attention_core_forward_flops(model, tokens)
    return 0.0


def layer_flops(model: ModelSpec, tokens: int, recompute: str = "none") -> float:
    """Forward+backward FLOPs of one layer, including recomputation."""
    return 3.0 * layer_forward_flops(model, tokens) + recompute_forward_flops(
        model, tokens, recompute
    )


def model_flops_per_step(model: ModelSpec, global_batch: int) -> float:
    """Useful FLOPs of one optimizer step (no recomputation): the numerator of MFU."""
    tokens = global_batch * model.seq_len
    return 3.0 * (model.layers * layer_forward_flops(model, tokens) +
                  head_forward_flops(model, tokens))


# ---------------------------------------------------------------- compute time
#
# Time of one layer for one microbatch on one TP rank (forward + backward + recompute):
#
#   t = F_gemm / (peak·e) + F_attn / (peak·e·ATTENTION_EFFICIENCY)
#       + bytes_elementwise / HBM bandwidth + kernels · KERNEL_FIXED_S
#
# ``e`` is the device's ``efficiency`` (catalog.py): the fraction of peak a large GEMM reaches,
# the asymptote. The fixed time per kernel makes the achieved GEMM efficiency a saturating curve
# of the GEMM's size, ``e(x) = e·x / (x + peak·e·KERNEL_FIXED_S)``, and is also the
# per-microbatch overhead that keeps microbatch 1 from always winning. Attention (the score and
# value products with their softmax, FlashAttention-like: one fused kernel per pass) has its
# own efficiency. Normalisation, residual, dropout and activation functions are memory-bound:
# costed by the HBM bytes they move. Each constant says where it comes from and whether it was
# fitted (to Megatron-LM SC'21 Table 1, ``bench/fidelity.py``; A100 only).

KERNEL_FIXED_S = 8e-6  # launch latency (~5 us) + wave-quantisation tail per kernel; estimate
# attention core vs large GEMMs; FITTED (Table 1, whose eager attention's score traffic is
# priced apart: EAGER_SCORE_ACCESSES_*; 0.50 before that, when it absorbed that traffic)
ATTENTION_EFFICIENCY = 0.75
# fp32 attention (no flash kernel) vs the fp32 GEMMs: the 0.50 the fp32 rate
# (catalog.FP32_EFFICIENCY, one H200, docs/runtime.md) was fitted with; not refitted
FP32_ATTENTION_EFFICIENCY = 0.50
ELEMENTWISE_BYTES_PER_HIDDEN = 24.0  # counted: 2 norms, 2 bias+dropout+residual, bf16
ELEMENTWISE_BYTES_PER_FFN = 4.0  # counted: the MLP activation reads + writes f, bf16
KERNELS_PER_PASS = 14  # counted: 4-5 GEMMs, attention, ~8 elementwise per layer forward
MLP_CHUNK_KERNELS = 23  # counted: one chunk of runtime.model._ChunkedMLP, forward + backward
TP_BUS_EFFICIENCY = 0.75  # NCCL ring bus bandwidth / link bandwidth on NVLink; FITTED (Table 1)
TP_LATENCY_S = 5e-6  # α of one ring step over NVLink (NCCL small-message latency); estimate
# eager (unfused) attention, ``spec.training.attention: eager``: element reads + writes of the
# materialised s×s scores per query head, counted on Megatron-LM's 2021 core attention
# (baddbmm QKᵀ, fused scale-mask-softmax, dropout, bmm ·V): forward 6 (the scores written;
# read and written by the softmax; read and written by the dropout; read by ·V) plus the
# dropout's 1-byte mask written; backward 9 (the probabilities' gradient written, the dropped
# probabilities read for ·V's weight gradient; dropout backward read + write; softmax backward
# reads the gradient and its output, writes; QKᵀ's two gradients read it) plus the mask read.
# Memory-bound: at the HBM bandwidth. The GEMMs of QKᵀ and ·V stay in the attention term.
EAGER_SCORE_ACCESSES_FORWARD = 6
EAGER_SCORE_ACCESSES_BACKWARD = 9
EAGER_MASK_BYTES = 1  # dropout mask per score element, written forward, read backward


def compute_passes(recompute: str) -> int:
    """Forward-pass equivalents of a layer's GEMMs per microbatch: forward 1, backward 2
    (input and weight gradients), plus 1 when the layer's forward is re-run
    (:func:`reruns_layer`)."""
    return 3 + (1 if reruns_layer(recompute) else 0)


def attention_passes(recompute: str) -> int:
    """Forward-pass equivalents of the attention core: selective and full recompute redo it,
    attention-free keeps its outputs."""
    return 3 + (1 if recompute in ("full", "selective") else 0)


def attention_efficiency(device: DeviceSpec, elem_bytes: int = 2) -> float:
    """The attention core's rate relative to the GEMMs' (on the full ``s²`` pair count): the
    device's own (causal flash on Hopper; bf16/fp16 only, flash has no fp32 kernel) or the
    fitted ``ATTENTION_EFFICIENCY``; fp32 ``FP32_ATTENTION_EFFICIENCY``."""
    if elem_bytes == 4:
        return FP32_ATTENTION_EFFICIENCY
    return device.attention_efficiency or ATTENTION_EFFICIENCY


def eager_score_bytes(model: ModelSpec, micro_batch: int, tp: int, recompute: str,
                      elem_bytes: int = 2) -> float:
    """HBM bytes of one layer's materialised attention scores per microbatch on one TP rank
    with eager attention (forward and backward; the forward again where the recompute mode
    redoes the attention core): ``b·(a/t)·s²`` score elements per pass, the counted accesses
    of each (``EAGER_SCORE_ACCESSES_*``) at the plan precision plus the dropout mask."""
    scores = micro_batch * model.heads / tp * float(model.seq_len) ** 2
    forwards = attention_passes(recompute) - 2  # 1, or 2 when the core is recomputed
    per = (forwards * (EAGER_SCORE_ACCESSES_FORWARD * elem_bytes + EAGER_MASK_BYTES)
           + EAGER_SCORE_ACCESSES_BACKWARD * elem_bytes + EAGER_MASK_BYTES)
    return scores * per


def gemm_efficiency(device: DeviceSpec, gemm_flops: float) -> float:
    """Achieved fraction of peak of one GEMM of ``gemm_flops`` FLOPs: the saturating curve
    ``e·x / (x + peak·e·KERNEL_FIXED_S)`` implied by a fixed time per kernel."""
    e = device.efficiency
    return e * gemm_flops / (gemm_flops + device.flops * e * KERNEL_FIXED_S)


def layer_compute_s(model: ModelSpec, micro_batch: int, tp: int, device: DeviceSpec,
                    recompute: str, elem_bytes: int = 2, attention: str = "flash",
                    mlp_chunk_tokens: int = 0) -> float:
    """Compute seconds of one layer for one microbatch on one TP rank (no communication).

    A device profile that measured this layer shape in this precision
    (``planning/profiles.py``) replaces the model: its fitted seconds of the recompute mode
    (a version-1 profile without a measured selective mode: plus one modelled attention
    forward; attention-free, never measured: the full line scaled by the model's
    attention-free / full ratio, at least the ``none`` line: :func:`profiled_layer_s`);
    else :func:`modelled_layer_s`. ``mlp_chunk_tokens`` (:func:`mlp_chunk_tokens`): the
    chunked MLP's GEMMs and kernels (:func:`modelled_layer_s`; a profile's line scaled by
    the model's chunked / whole ratio). ``attention`` ``eager``
    adds the materialised scores' memory traffic (:func:`eager_score_bytes`) at the HBM
    bandwidth, on the model and on a profile (which measured the runtime's fused attention).
    """
    eager = (eager_score_bytes(model, micro_batch, tp, recompute, elem_bytes)
             / (device.hbm_tbps * 1e12) if attention == "eager" else 0.0)
    prof = device.profile
    if prof is not None and prof.matches(model, elem_bytes):
        t = profiled_layer_s(model, micro_batch, tp, device, recompute, elem_bytes)
        return t * mlp_chunk_time_ratio(model, micro_batch, tp, device, recompute, elem_bytes,
                                        mlp_chunk_tokens) + eager
    return modelled_layer_s(model, micro_batch, tp, device, recompute, elem_bytes,
                            mlp_chunk_tokens) + eager


def mlp_chunk_time_ratio(model: ModelSpec, micro_batch: int, tp: int, device: DeviceSpec,
                         recompute: str, elem_bytes: int, mlp_chunk_tokens: int) -> float:
    """The chunked MLP's layer time over the whole MLP's in the catalog model
    (:func:`modelled_layer_s`; 1 without chunks): what scales a device profile's measured
    whole-MLP line."""
    if not mlp_chunk_tokens:
        return 1.0
    return (modelled_layer_s(model, micro_batch, tp, device, recompute, elem_bytes,
                             mlp_chunk_tokens)
            / modelled_layer_s(model, micro_batch, tp, device, recompute, elem_bytes))


def mlp_input_params(model: ModelSpec) -> int:
    """Parameters of the MLP's input projections: gate and up (SwiGLU), or up (GELU)."""
    return (2 if model.gated_mlp else 1) * model.hidden * model.ffn_hidden


def modelled_layer_s(model: ModelSpec, micro_batch: int, tp: int, device: DeviceSpec,
                     recompute: str, elem_bytes: int = 2, mlp_chunk_tokens: int = 0) -> float:
    """:func:`layer_compute_s` from the catalog model alone (flash attention, no profile).

    The chunked MLP (``mlp_chunk_tokens``, ``runtime.model._ChunkedMLP``) runs its GEMMs in
    three passes plus its input projections once more (recomputed per chunk in the backward)
    whatever the recompute mode, as a re-run layer skips the MLP; its activation is made
    twice (forward and backward); each of its ``⌈tokens / chunk⌉`` chunks launches
    :data:`MLP_CHUNK_KERNELS` kernels, counted apart from the whole MLP's."""
    tokens = micro_batch * model.seq_len
    passes = compute_passes(recompute)
    gemm_params = passes * layer_matmul_params(model)
    ffn_passes, kernels = passes, passes * KERNELS_PER_PASS
    if mlp_chunk_tokens:
        mlp = mlp_input_params(model) + model.hidden * model.ffn_hidden
        gemm_params += (3 - passes) * mlp + mlp_input_params(model)
        ffn_passes = 3
        kernels += (-(-tokens // mlp_chunk_tokens) - 1) * MLP_CHUNK_KERNELS
    gemm = 2.0 * tokens * gemm_params / tp
    attn = attention_passes(recompute) * attention_core_forward_flops(model, tokens) / tp
    peak = device.matmul_flops(elem_bytes)
    elementwise = (tokens * (passes * ELEMENTWISE_BYTES_PER_HIDDEN * model.hidden
                             + ffn_passes * ELEMENTWISE_BYTES_PER_FFN * model.ffn_hidden)
                   / tp * elem_bytes / 2)
    return (gemm / peak + attn / (peak * attention_efficiency(device, elem_bytes))
            + elementwise / (device.hbm_tbps * 1e12)
            + kernels * KERNEL_FIXED_S)


def profiled_layer_s(model: ModelSpec, micro_batch: int, tp: int, device: DeviceSpec,
                     recompute: str, elem_bytes: int = 2) -> float:
    """Compute seconds of one layer and microbatch on one TP rank from the device profile
    (which matches the shape and precision): the mode's line; an unmeasured selective mode
    adds one modelled attention forward; attention-free (never measured) is the full line
    scaled by the model's attention-free / full ratio (so a calibration factor on the line
    scales it alike), floored at the ``none`` line."""
    prof = device.profile
    assert prof is not None
    if recompute == "attention-free":
        share = (modelled_layer_s(model, micro_batch, tp, device, recompute, elem_bytes)
                 / modelled_layer_s(model, micro_batch, tp, device, "full", elem_bytes))
        return max(prof.layer_s(micro_batch, tp, "none"),
                   prof.layer_s(micro_batch, tp, "full") * share)
    t = prof.layer_s(micro_batch, tp, recompute)
    if recompute == "selective" and prof.measured_mode(recompute) is None:
        t += (attention_core_forward_flops(model, micro_batch * model.seq_len) / tp
              / (device.matmul_flops(elem_bytes) * attention_efficiency(device, elem_bytes)))
    return t


def measured_tp_line(model: ModelSpec, training: TrainingSpec, tp: int, device: DeviceSpec
                     ) -> tuple[float, float] | None:
    """The device profile's line of this layer measured sharded at ``tp`` (compute and TP
    all-reduces, ``LayerProfile.measured_tp``) where the profile matches the shape and
    precision and the plan recomputes nothing (the measured mode); else None."""
    prof = device.profile
    if (tp < 2 or training.recompute != "none" or prof is None
            or not prof.matches(model, precision_bytes(training))):
        return None
    return prof.measured_tp(tp)


def layer_time_s(model: ModelSpec, training: TrainingSpec, micro_batch: int, tp: int,
                 device: DeviceSpec) -> float:
    """Seconds of one layer per microbatch on a stage: compute plus exposed TP comm, or the
    device profile's layer measured at this TP degree (:func:`measured_tp_line`)."""
    line = measured_tp_line(model, training, tp, device)
    if line is not None:
        return line[0] + line[1] * micro_batch
    eb = precision_bytes(training)
    return (layer_compute_s(model, micro_batch, tp, device, training.recompute, eb,
                            training.attention, training.mlp_chunk_tokens)
            + tp_comm_per_layer_s(model, micro_batch, tp, device, eb, training.recompute))


def head_time_s(model: ModelSpec, micro_batch: int, tp: int, device: DeviceSpec,
                elem_bytes: int = 2, loss_chunk_tokens: int = 0) -> float:
    """Seconds of the LM head (forward + 2 backward GEMMs) per microbatch on one TP rank: the
    logits are vocab-parallel where :func:`vocab_shards` splits them, else replicated. A
    vocab-parallel head also all-reduces its input gradient over the TP group (its
    cross-entropy's three ``s·b``-float all-reduces are left out: latency only). A device
    profile that measured this model's stage (``profiles.StageProfile``: shape and
    vocabulary) gives the head's compute instead: its measured final norm, head and loss.
    ``loss_chunk_tokens`` (:func:`loss_chunk_tokens`): the chunked loss's backward recomputes
    the logits, one more forward GEMM (a third of the measured head), in
    ``⌈s·b / chunk⌉`` chunks of four GEMMs each."""
    shards = vocab_shards(model, tp)
    prof = device.profile
    passes = 4 if loss_chunk_tokens else 3
    chunks = -(-micro_batch * model.seq_len // loss_chunk_tokens) if loss_chunk_tokens else 1
    if prof is not None and prof.stage_matches(model, elem_bytes):
        t = prof.stage.part_s("head", micro_batch) / shards * passes / 3
    else:
        flops = passes * head_forward_flops(model, micro_batch * model.seq_len) / shards
        t = flops / device.matmul_flops(elem_bytes) + passes * chunks * KERNEL_FIXED_S
    if shards > 1:
        nbytes = model.seq_len * micro_batch * model.hidden * elem_bytes
        t += ring_all_reduce_s(nbytes, tp, *node_ring_link(device))
    return t


def stage_overhead_s(model: ModelSpec, micro_batch: int, tp: int, device: DeviceSpec,
                     first: bool, elem_bytes: int = 2) -> float:
    """Seconds per microbatch of a stage besides its layers and LM head, as the device profile
    measured the runtime's stage for this model (``profiles.StageProfile``): the stage
    machinery around the layers on every stage, plus the token embedding on the first (split
    over the vocabulary shards like the head); 0 where nothing was measured (the catalog
    model has no such term)."""
    prof = device.profile
    if prof is None or not prof.stage_matches(model, elem_bytes):
        return 0.0
    t = prof.stage.part_s("overhead", micro_batch)
    if first:
        t += prof.stage.part_s("embedding", micro_batch) / vocab_shards(model, tp)
    return t


def min_seconds_per_flop(device: DeviceSpec, model: ModelSpec | None = None,
                         elem_bytes: int = 2) -> float:
    """A lower bound on seconds per model FLOP (fwd + bwd, no recompute) on ``device`` in a
    precision of ``elem_bytes``: every term of the model only adds to ``F/(peak·e)``, the
    attention core's FLOPs at up to ``attention_efficiency`` times that rate. Given the model,
    the attention core's share of a layer's FLOPs bounds that speed-up (the LM head's GEMMs
    only run at the GEMM rate); a matching profile's layer takes at least ``β·b/tp`` for
    ``3·F(b)/tp`` FLOPs (the smallest ``β`` of its measured recompute modes; a line measured
    sharded at ``t`` ranks, ``β_t·b`` for ``3·F(b)/t``: counted as ``t·β_t``)."""
    speedup = max(1.0, attention_efficiency(device, elem_bytes))
    attn_share = 1.0
    if model is not None:
        attn_share = 4.0 * model.seq_len * model.hidden / layer_forward_flops(model, 1)
    bound = (1.0 - attn_share + attn_share / speedup) / device.matmul_flops(elem_bytes)
    prof = device.profile
    if model is not None and prof is not None and prof.matches(model, elem_bytes):
        # any measured mode; a line measured at tp ranks does 3·F/tp per rank
        slope = min([prof.beta] + [b for _, _, b in prof.recompute]
                    + [tp * b for tp, _, b in prof.tp_layers])
        bound = min(bound, slope / (3.0 * layer_forward_flops(model, model.seq_len)))
    return bound


# ---------------------------------------------------------------- memory


def state_bytes_per_param(training: TrainingSpec, dp: int) -> float:
    """Weights + gradients + optimizer bytes per parameter on one rank, as ``runtime.optim``
    allocates them: parameters in the plan precision (``p``), fp32 main grads (4), fp32 master
    weights and AdamW moments (12; fp32: 8, the parameters are the master), by
    ``training.sharding`` over the stage's DP group ``d`` (``dp·cp``):

    - ``none``: ``p + 4 + 12``;
    - ``optimizer`` (ZeRO-1): ``p + 4 + 12/d``;
    - ``gradients`` (ZeRO-2): ``p + (4 + 12)/d`` (fp32 too: its master is a copy);
    - ``full`` (ZeRO-3/FSDP): ``(p + 4 + 12)/d``.

    The transient of one gathered unit (:func:`sharding_transient_bytes`) comes on top."""
    if training.precision == "fp32":
        weights, grads, optim = 4.0, 4.0, 8.0
    else:
        weights, grads, optim = 2.0, 4.0, 12.0
    sharding = training.sharding
    if sharding == "optimizer":
        return weights + grads + optim / dp
    if sharding == "gradients":
        # fp32 too keeps a master of its chunks: the parameters' own chunks are not contiguous
        return weights + (grads + max(optim, 12.0)) / dp
    if sharding == "full":
        return (weights + grads + optim) / dp
    return weights + grads + optim


# ZeRO-2/3 overlapped (runtime/grad_sync.UnitGradSync): per-unit gradient reductions in flight
# while the backward fills the next unit's bucket; one is double buffering (unit i reduces while
# unit i-1 computes its backward), the memory FSDP's reduce-scatter also holds
SHARDING_REDUCES_IN_FLIGHT = 1


def sharding_transient_bytes(training: TrainingSpec, unit_params: float) -> float:
    """Bytes ZeRO-2/3 hold beyond their sharded state while one unit (the embedding, one
    decoder layer or the head; ``unit_params``: the stage's largest, on one rank) is worked on:
    its full fp32 gradient bucket (4 per parameter) and autograd's gradient in the plan
    precision (``p``; at most one parameter's, the embedding's the whole unit) before it is
    folded in; ``full`` also the unit's gathered parameters (``p``). Synchronously
    (``overlapGradReduce: false``) one unit is gathered at a time: autograd runs a unit's
    gradient accumulations before the backward of the unit below it starts (and so its
    gather), and the unit is freed once they are reduced. Overlapped (the default; charged
    also where the stage's DP group spans pools and the runtime stays synchronous) add
    ``SHARDING_REDUCES_IN_FLIGHT`` buckets still being reduced (4 each) and, for ``full``,
    the next unit's prefetched parameters (``p``). ``runtime.memory`` measures this peak.
    None for none/optimizer (their gradients are part of the state)."""
    p = 4.0 if training.precision == "fp32" else 2.0
    overlap = training.overlap_grad_reduce
    in_flight = 4.0 * SHARDING_REDUCES_IN_FLIGHT if overlap else 0.0
    if training.sharding == "gradients":
        return (4.0 + p + in_flight) * unit_params
    if training.sharding == "full":
        return (4.0 + 2.0 * p + in_flight + (p if overlap else 0.0)) * unit_params
    return 0.0


def sharded_grads(training: TrainingSpec) -> bool:
    """Whether the fp32 main grads are sharded over the DP group (ZeRO-2 and ZeRO-3)."""
    return training.sharding in ("gradients", "full")


def dp_sync_counts(sharding: str, microbatches: int) -> tuple[int, int]:
    """``(gradient all-reduces, parameter all-gathers)`` per step of one stage's
    DP sync under ``sharding``, each counted in units of the stage's whole sync: one
    all-reduce of its fp32 gradients, one all-gather of its parameters in the plan precision
    (ZeRO-1's, same rate model).

    - ``none``: 1 all-reduce after the last microbatch (overlapped with its backward);
    - ``optimizer`` (ZeRO-1): that all-reduce, then 1 all-gather of the updated parameters
      (exposed);
    - ``gradients`` (ZeRO-2): the all-reduce in EVERY microbatch's backward, unit by unit
      (``microbatches``), then ZeRO-1's all-gather once (exposed);
    - ``full`` (ZeRO-3/FSDP): the all-reduce in every microbatch as ZeRO-2, no step-end
      all-gather, but each unit's parameters gathered twice per microbatch (before its forward
      and before its backward): ``2·microbatches`` all-gathers.

    Every sharding's may overlap compute: none and optimizer the all-reduce with the last
    microbatch's backward (``grad_sync.BucketedGradSync``), gradients and full each unit's
    reduction and (full) prefetched all-gather with every microbatch's backward and forward
    (``grad_sync.UnitGradSync``); the planner's ``_dp_sync_coeffs`` prices what stays
    exposed."""
    if sharding == "gradients":
        return microbatches, 1
    if sharding == "full":
        return microbatches, 2 * microbatches
    return 1, int(sharding == "optimizer")


# The optimizer step (runtime/optim.py) is elementwise and HBM-bound. Bytes it moves per
# parameter a rank OWNS (its ZeRO-1 slice): AdamW reads the gradient for the global norm (4),
# decays the master (r/w 8), updates exp_avg (lerp_: 12) and exp_avg_sq (mul_, addcmul_: 20),
# builds the denominator in chunks (sqrt, div_, add_: 24) and updates the master (addcdiv_: 16);
# below fp32 it casts the master into the parameters (4 + 2). Per parameter it HOLDS: zeroing
# the fp32 main grads (4).
OPTIMIZER_BYTES_OWNED = 84.0
OPTIMIZER_CAST_BYTES = 6.0
OPTIMIZER_BYTES_HELD = 4.0
OPTIMIZER_HBM_EFFICIENCY = 0.8  # of the datasheet bandwidth, for streaming elementwise kernels


def optimizer_step_bytes(params: float, training: TrainingSpec, dp: int) -> float:
    """Bytes the optimizer step streams over ``params`` parameters one rank holds (ZeRO-1: it
    updates its ``1/dp`` slice, ``dp`` the gradient group)."""
    owned = params / dp if training.optimizer_sharding and dp > 1 else params
    per = OPTIMIZER_BYTES_OWNED + (OPTIMIZER_CAST_BYTES if training.precision != "fp32" else 0.0)
    held = owned if sharded_grads(training) else params  # ZeRO-2/3 hold 1/dp of the grads
    return owned * per + held * OPTIMIZER_BYTES_HELD


def optimizer_step_s(params: float, training: TrainingSpec, dp: int,
                     device: DeviceSpec) -> float:
    """Seconds of :func:`optimizer_step_bytes` at the device profile's measured optimizer
    bandwidth (``hettrain profile``) or ``OPTIMIZER_HBM_EFFICIENCY`` of the HBM's."""
    prof = device.profile
    rate = (prof.optimizer_bytes_per_s if prof is not None and prof.optimizer_bytes_per_s
            else device.hbm_tbps * 1e12 * OPTIMIZER_HBM_EFFICIENCY)
    return optimizer_step_bytes(params, training, dp) / rate


# Bytes the runtime keeps for the backward of one layer, as counted by ``runtime.memory``
# (saved-tensor hooks, each storage once; SDPA/flash attention keeps no s x s score matrix, only
# its fp32 log-sum-exp per head). Fitted to the Llama block of ``runtime.model`` (measured with
# ``runtime.memory``, tests/runtime/training/test_memory_honesty.py). Per token, recompute
# ``none``, ``eb`` = bytes of the plan precision:
#   replicated on every TP rank, per RMSNorm (two per layer; it normalises in fp32 but keeps
#     only its input, eb·h, and recomputes the rest in the backward) and its output (eb·h, the
#     next linear's input); with sequence parallelism (:func:`sequence_shards`) both are a
#     1/tp token shard (the column-parallel group keeps its input's shard and gathers it again
#     in the backward);
#   TP-sharded (/tp), in the plan precision: q and k after RoPE and v as SDPA sees them (GQA
#     heads repeated: 3h), the attention output (h; flash/SDPA returns it token-major, so the
#     output projection's input is a view of it), and the MLP's ffn-wide projection outputs
#     (GELU: up, f; SwiGLU: gate and up, 2f; the activation and the down projection's input
#     are recomputed in the backward); plus the fp32 log-sum-exp (4 bytes per head);
#   per layer and microbatch, not per token: RoPE's cos and sin cast to the plan precision for
#     q and for k (4 tables of s x head_dim; fp32 keeps the 2 cached fp32 tables: as many bytes).
# ``selective`` recomputes the attention core but keeps its inputs q, k, v (before the GQA
# repeat: h + 2 kv_dim) and its output (h) instead of the repeated k, v and the log-sum-exp.
# ``full`` keeps only each layer's input (eb·h per token); the backward then re-runs ONE layer's
# forward at a time, whose working set (the ``none`` bytes of one layer and one microbatch) is
# counted once per stage in ``stage_memory``'s fixed part (:func:`recompute_working_set_bytes`).
# ``attention-free`` (HelixPipe's attention-free recompute; the runtime checkpoints the layer
# with selective activation checkpointing) keeps the layer's input like full plus what the
# attention kernel saves, which the re-run forward reuses instead of recomputing: its output
# (eb·h/tp per token: this rank's heads over the rank's whole sequence, not a sequence shard)
# and the fp32 log-sum-exp (4 bytes per head /tp); no per-layer RoPE tables (re-made by the
# re-run); its working set, the RoPE tables and its TP/CP collectives are full's.
FP32_BYTES = 4.0
NORMS_PER_LAYER = 2
LAYER_SHARDED_H = 4  # q, k, v (repeated) and the attention output, in units of h
GELU_FFN = 1  # ffn-wide tensors a GELU MLP keeps, in units of f (up)
SWIGLU_FFN = 2  # ... a SwiGLU MLP keeps (gate, up)
LSE_BYTES_PER_HEAD = 4.0  # fp32 log-sum-exp of the flash/SDPA kernel
ROPE_TABLE_BYTES = 8.0  # per position x head_dim per layer: cos, sin for q and k (2 bytes each)


def rms_norm_saved_bytes_per_token(hidden: int, elem_bytes: float) -> float:
    """Bytes one RMSNorm and the op after it keep per token: the norm's input and its output
    (the next linear's saved input), both in the plan precision (``runtime.model.RMSNorm``
    recomputes its fp32 work in the backward)."""
    return 2 * elem_bytes * hidden


def activation_bytes_per_layer(model: ModelSpec, micro_batch: int, tp: int, recompute: str,
                               elem_bytes: int = 2) -> float:
    """Bytes one layer keeps for the backward for one microbatch (see the table above);
    sequence parallelism (:func:`sequence_shards`) divides the replicated terms by ``tp``."""
    s, b, h, a = model.seq_len, micro_batch, model.hidden, model.heads
    eb = float(elem_bytes)
    sp = sequence_shards(model, tp)
    if reruns_layer(recompute):
        kept = h * eb / sp  # the layer's input
        if recompute == "attention-free":  # and the attention kernel's output and LSE
            kept += (h * eb + LSE_BYTES_PER_HEAD * a) / tp
        return s * b * kept
    ffn = (SWIGLU_FFN if model.gated_mlp else GELU_FFN) * model.ffn_hidden
    replicated = NORMS_PER_LAYER * rms_norm_saved_bytes_per_token(h, eb)
    if recompute == "selective":
        kv = model.kv_heads * model.head_dim
        sharded = ((h + 2 * kv) + h + ffn) * eb  # q, k, v; attention output; MLP
    else:
        sharded = (LAYER_SHARDED_H * h + ffn) * eb + LSE_BYTES_PER_HEAD * a
    rope = ROPE_TABLE_BYTES * s * model.head_dim
    return s * b * (replicated / sp + sharded / tp) + rope


def split_layer_extra_bytes(model: ModelSpec, micro_batch: int, recompute: str,
                            elem_bytes: int = 2) -> float:
    """The helix schedule (``runtime/helix.py``): what one layer keeps beyond
    :func:`activation_bytes_per_layer` because its three parts are differentiated apart and
    its q/k/v travel packed in one tensor (``runtime.helix.pre_attention``), whose storage
    the attention kernel's saved query (a view of it) keeps whole. Per token:

    * ``none``: with grouped-query attention (``kv_heads < heads``) the pack's k/v part,
      ``2·kv_heads·head_dim`` (the kernel keeps the repeated k/v, new tensors, as the whole
      layer does); with ``kv_heads == heads`` nothing (the kernel keeps the pack's own k/v);
    * ``selective``: nothing (the re-run core keeps its packed input, the whole layer's
      keeps the same q/k/v apart);
    * ``attention-free``: what the core keeps where a whole layer's re-run recomputes it:
      the pack, ``(heads + 2·kv_heads)·head_dim``, and with grouped-query attention the
      repeated k/v, ``2·heads·head_dim``;
    * ``full``: the pack and the core's output (the post-attention part's checkpointed
      input), ``(2·heads + 2·kv_heads)·head_dim``.

    Measured on the CPU: one more first-in-last-out microbatch adds exactly this beside a
    whole layer's bytes, in every mode with and without grouped-query attention
    (``test_memory_honesty.py``)."""
    s, b, d = model.seq_len, micro_batch, model.head_dim
    gqa = model.kv_heads < model.heads
    pack = (model.heads + 2 * model.kv_heads) * d
    per_token = {"none": 2 * model.kv_heads * d if gqa else 0,
                 "selective": 0,
                 "attention-free": pack + (2 * model.heads * d if gqa else 0),
                 "full": pack + model.heads * d}.get(recompute, 0)
    return s * b * per_token * float(elem_bytes)


def cp_local_model(model: ModelSpec, cp: int) -> ModelSpec:
    """``model`` as one context-parallel rank sees its token-local work: ``seq_len / cp``
    tokens per sequence (its two load-balanced chunks); ``model`` itself when ``cp == 1``."""
    return model if cp <= 1 else _cp_local(model, cp)


@functools.lru_cache(maxsize=256)
def _cp_local(model: ModelSpec, cp: int) -> ModelSpec:
    # (the planner asks for a few models many thousand times: a copy costs 25 µs, a hit 1)
    return replace(model, seq_len=model.seq_len // cp)


def skips_masked_tiles(device: DeviceSpec) -> bool:
    """Whether the runtime's CP attention on ``device`` runs a fused kernel that skips the
    masked tiles (and builds no mask): ``scaled_dot_product_attention`` with a lower-right
    causal bias dispatches to flash or memory-efficient attention on NVIDIA GPUs
    (``torch.nn.attention.bias.CausalBias``). Elsewhere the mask is materialised and every pair
    of the block computed: on the CPU, Gaudi and Ascend by SDPA itself, and on AMD by the
    runtime, because PyTorch does not test the lower-right variant on ROCm
    (``runtime/context_parallel.py``)."""
    return device.vendor == "nvidia"


def cp_attention_extra_bytes_per_layer(model: ModelSpec, micro_batch: int, tp: int, cp: int,
                                       recompute: str, elem_bytes: int = 2, *,
                                       masks: bool) -> float:
    """Bytes a CP rank's attention keeps per layer and microbatch beyond the token-local count
    of :func:`activation_bytes_per_layer` on ``seq_len / cp`` tokens, as
    ``runtime/context_parallel.py`` holds them (0 for ``cp == 1`` or a re-run layer,
    :func:`reruns_layer`, whose working set adds the ``none`` value once; attention-free's
    saved per-chunk outputs are the rank's own tokens, counted token-locally).

    ``none``: the gathered keys and values after the GQA repeat (the SDPA inputs, ``h/tp`` wide
    each) cover the whole sequence, not only the rank's tokens: ``2·(s − s/cp)·h/tp`` more;
    and the per-chunk SDPA outputs are kept by the kernels besides their concatenation
    (the output projection's input): ``(s/cp)·h/tp`` more; and each chunk's causal mask over
    its key prefix, which SDPA keeps converted to the plan precision: ``L·(j+1)·L`` elements
    for chunk ``j`` of ``L = s/2cp`` tokens, ``L²·(2cp+1)`` for the rank's two chunks (not per
    sequence: the mask broadcasts over the microbatch), where the mask is materialised:
    ``masks``, i.e. not where a fused kernel takes the runtime's lower-right causal bias
    (:func:`skips_masked_tiles`; the CPU that measures stages materialises it).
    ``selective`` keeps the checkpoint's
    inputs, the gathered keys and values before the repeat (``kv/tp`` each) over the whole
    sequence: ``2·(s − s/cp)·kv/tp`` more."""
    if cp <= 1 or reruns_layer(recompute):
        return 0.0
    s, b, h = model.seq_len, micro_batch, model.hidden
    local = s // cp
    eb = float(elem_bytes)
    if recompute == "selective":
        kv = model.kv_heads * model.head_dim
        return b * 2 * (s - local) * kv / tp * eb
    chunk = s // (2 * cp)
    mask_bytes = chunk * chunk * (2 * cp + 1) * eb if masks else 0.0
    return b * (2 * (s - local) + local) * h / tp * eb + mask_bytes


def recompute_working_set_bytes(model: ModelSpec, micro_batch: int, tp: int, recompute: str,
                                elem_bytes: int = 2, mlp_chunk_tokens: int = 0,
                                cp_gathered: int = 0) -> float:
    """A re-run layer (:func:`reruns_layer`): what the backward of one layer holds while it
    re-runs that layer's forward (everything the layer keeps without recompute, one
    microbatch, less what the chunked MLP does not keep: :func:`chunked_mlp_saved_bytes`) and
    then runs its backward (:func:`backward_transient_bytes`), plus the RoPE tables
    (:func:`recompute_rope_table_bytes`); 0 otherwise."""
    if not reruns_layer(recompute):
        return 0.0
    return (backward_working_set_bytes(model, micro_batch, tp, recompute, elem_bytes,
                                       mlp_chunk_tokens, cp_gathered)
            + recompute_rope_table_bytes(model, recompute))


def backward_working_set_bytes(model: ModelSpec, micro_batch: int, tp: int, recompute: str,
                               elem_bytes: int = 2, mlp_chunk_tokens: int = 0,
                               cp_gathered: int = 0) -> float:
    """What one layer's backward holds on top of the stage, once per stage in every mode: its
    transient (:func:`backward_transient_bytes`) and, for a re-run layer
    (:func:`reruns_layer`), what the re-run keeps: the ``none`` bytes of one microbatch less
    what the chunked MLP does not keep (:func:`chunked_mlp_saved_bytes`). Without the RoPE
    tables, which stay for the step."""
    working = backward_transient_bytes(model, micro_batch, tp, elem_bytes, mlp_chunk_tokens,
                                       cp_gathered)
    if reruns_layer(recompute):
        working += activation_bytes_per_layer(model, micro_batch, tp, "none", elem_bytes)
        if mlp_chunk_tokens:
            working -= chunked_mlp_saved_bytes(model, micro_batch, tp, elem_bytes)
    return working


# The chunked MLP (runtime.model._ChunkedMLP; HelixPipe's chunked MLP), with a re-run layer:
# the planner tries it beside the whole MLP from MLP_CHUNK_MIN_SEQ_LEN tokens per sequence
# (plan_job keeps the faster that fits). MLP_CHUNK_TOKENS: GEMMs of 4096 tokens stay large
# (4096 x hidden x ffn/tp); one chunk's backward holds 7 ffn-wide tensors of it.
MLP_CHUNK_TOKENS = 4096
MLP_CHUNK_MIN_SEQ_LEN = 16384
# live bytes at the peak of one MLP backward, in ffn-wide tensors of the plan precision over
# the microbatch's tokens (the whole MLP, runtime.model._ActDown: gated 5, GELU 3 and one
# weight gradient) or over one chunk (the chunked MLP: gated 7, GELU 4), measured on the CPU
# with runtime.memory.LiveBytes (test_memory_honesty.py)
MLP_BACKWARD_FFN = {True: 5, False: 3}
CHUNKED_MLP_BACKWARD_FFN = {True: 7, False: 4}
# the whole MLP's input-gradient phase, (gated, sequence parallel) -> tensors of T·h, T·F and
# h·F alive at its peak (the products with the weights, their sum, the gathered input and
# the reduce-scatter's buffers under SP; the gate and up gradients; the weight gradients before
# their fold into the fp32 main grads), the largest measured the same way
MLP_INPUT_GRAD_PHASE = {(True, False): (3, 2, 2), (False, False): (1, 1, 1),
                        (True, True): (4, 3, 2), (False, True): (2, 1, 3)}


def mlp_chunk_tokens(model: ModelSpec, training: TrainingSpec) -> int:
    """The chunk the planner tries for ``model`` beside the whole MLP (``plan_job`` keeps the
    faster as the plan's ``training.mlp_chunk_tokens``): :data:`MLP_CHUNK_TOKENS` where the
    recompute mode re-runs the layer (:func:`reruns_layer`: the chunked MLP then costs no
    extra GEMM, it saves the re-run's down projection) and a sequence has at least
    :data:`MLP_CHUNK_MIN_SEQ_LEN` tokens; else 0."""
    if reruns_layer(training.recompute) and model.seq_len >= MLP_CHUNK_MIN_SEQ_LEN:
        return MLP_CHUNK_TOKENS
    return 0


def mlp_backward_transient_bytes(model: ModelSpec, micro_batch: int, tp: int,
                                 elem_bytes: int = 2, chunk: int = 0) -> float:
    """What one layer's MLP backward allocates at its peak on one rank, ``model`` the rank's
    token-local view: the larger of its two phases, each counting what can be alive at once
    (``T`` tokens of the microbatch, ``F = ffn/tp``, ``h`` hidden; measured against
    ``runtime.memory``'s live count in ``test_memory_honesty.py``).

    The whole MLP: the activation phase (``runtime.model._ActDown``: the recomputed
    activation, its gradient, the gate and up gradients: :data:`MLP_BACKWARD_FFN` ``T·F``
    tensors, GELU also the down weight's gradient), then the input-gradient phase (the gate
    and up gradients ``T·F`` each, their products with the weights and their sum ``T·h``
    each, weight gradients ``h·F``: :data:`MLP_INPUT_GRAD_PHASE`). The chunked MLP: during
    its loop the fp32 weight-gradient sums, one weight-gradient product, the input gradient
    ``T·h`` and one chunk's :data:`CHUNKED_MLP_BACKWARD_FFN` ``chunk·F`` tensors; after it
    the input gradient (handed on: twice) and the sums cast to the plan precision.

    Sequence parallelism adds the gathered output gradient ``T·h`` to the activation phase
    (both MLPs' loops), and the input gathered again (the gather's buffer and its ordered
    copy) and the reduce-scatter's input to the input-gradient phase. The chunked MLP's
    counts are bounds: on small shapes whose ``h·F`` terms rival ``T·F`` (where the phases
    blur) they are up to 1.4× what was measured, exact where ``T·F`` dominates."""
    tokens = model.seq_len * micro_batch
    f, h, eb = model.ffn_hidden / tp, model.hidden, float(elem_bytes)
    gated = model.gated_mlp
    inputs = 2 if gated else 1  # gate and up, or up
    sp = 1.0 if sequence_shards(model, tp) > 1 else 0.0
    th = tokens * h * eb
    if not chunk:
        act = (tokens * f * eb * MLP_BACKWARD_FFN[gated] + (0.0 if gated else h * f * eb)
               + sp * th)
        th_n, tf_n, hf_n = MLP_INPUT_GRAD_PHASE[(gated, sp > 0)]
        grad = th_n * th + (tf_n * tokens * f + hf_n * h * f) * eb
        return max(act, grad)
    c = min(chunk, tokens)
    sums = (inputs + 1) * h * f * FP32_BYTES
    loop = (sums + h * f * eb + th + CHUNKED_MLP_BACKWARD_FFN[gated] * c * f * eb
            + sp * 2 * th)
    after = 2 * th + (inputs + 1) * h * f * eb + sums + sp * 3 * th
    return max(loop, after)


ATTENTION_BACKWARD_TH = 4.0  # T·h tensors of the attention backward's peak, plus 3/tp more


def attention_backward_transient_bytes(model: ModelSpec, micro_batch: int, tp: int,
                                       elem_bytes: int = 2, cp_gathered: int = 0) -> float:
    """A bound on what one attention half's backward (the input norm, q/k/v/o projections,
    RoPE and the attention kernel's backward) allocates at its peak on one rank, ``model``
    the rank's token-local view: ``(4 + 3/tp)·T·h`` fp32 values (the query, key and value
    gradients, the repeated keys' and values', the output gradient: the kernel's backward
    and the norm work in fp32 whatever the plan precision; under sequence parallelism the
    gathered input and gradient are whole-sequence) plus the four projections' weight
    gradients, at most ``h²/tp`` each. Context parallelism (``cp_gathered``: the other ranks'
    tokens of a sequence) adds the gradients of the gathered keys and values,
    ``2·cp_gathered·h/tp`` per sequence. Measured on the CPU (``runtime.memory``'s live
    count): 7.00-7.02·T·h fp32 values at TP 1 in fp32 and in bf16, below the bound at TP 2
    with sequence parallelism and with CP (``test_memory_honesty.py``)."""
    tokens = model.seq_len * micro_batch
    h = model.hidden
    gathered = 2.0 * cp_gathered * micro_batch * h / tp
    return ((ATTENTION_BACKWARD_TH + 3.0 / tp) * tokens * h * FP32_BYTES
            + (gathered + 4.0 * h * h / tp) * float(elem_bytes))


def backward_transient_bytes(model: ModelSpec, micro_batch: int, tp: int,
                             elem_bytes: int = 2, chunk: int = 0, cp_gathered: int = 0) -> float:
    """What one layer's backward allocates at its peak beyond what it keeps: the larger of
    its MLP's (:func:`mlp_backward_transient_bytes`) and its attention's
    (:func:`attention_backward_transient_bytes`), each counted on top of everything the
    layer keeps (the attention's runs after the MLP has freed its own saved tensors: a
    bound)."""
    return max(mlp_backward_transient_bytes(model, micro_batch, tp, elem_bytes, chunk),
               attention_backward_transient_bytes(model, micro_batch, tp, elem_bytes,
                                                  cp_gathered))


def chunked_mlp_saved_bytes(model: ModelSpec, micro_batch: int, tp: int,
                            elem_bytes: int = 2) -> float:
    """What the chunked MLP does not keep of :func:`activation_bytes_per_layer`'s ``none``
    count: the whole MLP's saved gate and up projections (``_ActDown``'s), ``T·f/tp`` each
    (GELU: up only); it keeps only its input, the norm's output counted there already."""
    ffn = (SWIGLU_FFN if model.gated_mlp else GELU_FFN) * model.ffn_hidden
    return model.seq_len * micro_batch * ffn / tp * float(elem_bytes)


def recompute_rope_table_bytes(model: ModelSpec, recompute: str) -> float:
    """A re-run layer (:func:`reruns_layer`): the cached fp32 cos and sin (``s × head_dim``
    each) the checkpoints keep as inputs, once per stage for the whole step (part of the
    working set's count); 0 else."""
    return 2 * FP32_BYTES * model.seq_len * model.head_dim if reruns_layer(recompute) else 0.0


# The runtime's GPT block (runtime/model.py) embeds positions with a learned table of seq_len
# rows on the first stage (and keeps the int64 positions for its backward); a RoPE model (Llama)
# has none. Its two LayerNorms per layer carry a bias each (2h more than ``layer_params``' 2h).
LEARNED_POSITIONS = False
NORM_BIAS_PARAMS_H = 0
LOSS_SCALAR_BYTES = 8.0  # the loss and the cross-entropy's weight total, fp32 scalars


def embedding_params(model: ModelSpec) -> int:
    """Token embedding (first stage) or LM head (last stage) parameters of the whole model; a
    TP rank holds ``1/`` :func:`vocab_shards` of them."""
    return model.vocab * model.hidden


def sequence_shards(model: ModelSpec, tp: int, cp: int = 1) -> int:
    """Megatron sequence parallelism (``runtime.model``): with ``tp > 1`` the residual stream
    and the RMSNorms of a layer work on ``1/tp`` of the rank's ``seq_len / cp`` tokens when
    those divide by ``tp`` (returns ``tp``); otherwise they are replicated (returns 1)."""
    return tp if tp > 1 and (model.seq_len // max(cp, 1)) % tp == 0 else 1


def vocab_shards(model: ModelSpec, tp: int) -> int:
    """How many ways a stage with TP degree ``tp`` splits the vocabulary (embedding rows, LM
    head rows, logits): ``tp`` when the vocabulary divides by it (the runtime's vocab-parallel
    embedding and cross-entropy, ``runtime/tensor_parallel.py``), else 1 (replicated)."""
    return tp if tp > 1 and model.vocab % tp == 0 else 1


def in_flight_microbatches(stage: int, pp: int, m: int, schedule: str,
                           virtual_stages: int = 1, link_warmup: int = 0) -> float:
    """Peak microbatches whose activations a stage holds at once, in whole-stage units.

    1F1B and ZB-H1 (same bound, Qi et al. §3): ``min(pp − stage + link_warmup, m)``
    (``link_warmup``: the stage's extra warm-up forwards over a datacenter link's latency,
    :func:`link_warmups`); GPipe: ``m``; interleaved with ``v`` chunks (Megatron's warm-up):
    ``(2·(pp − stage − 1) + (v − 1)·pp + 1)`` chunk-forwards of ``1/v`` of the stage each, at
    most ``m·v``.
    """
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved-zb":
        return interleaved_zb.stage_peaks(pp, m, virtual_stages)[stage][0]
    if schedule == "interleaved" and virtual_stages > 1:
        v = virtual_stages
        chunks = min(2 * (pp - stage - 1) + (v - 1) * pp + 1, m * v)
        return chunks / v
    return float(min(pp - stage + link_warmup, m))


# schedules whose runtime hides a datacenter link's latency with extra warm-up forwards
# (runtime/schedules.warmup_count): one model chunk per stage, a backward per microbatch
HIDES_LINK_LATENCY = ("1f1b", "zb-h1")


def link_warmups(delays: Sequence[float], period_s: float, m: int) -> tuple[int, ...]:
    """Extra warm-up forwards per stage that hide the datacenter links' latency in a 1F1B or
    ZB-H1 pipeline: ``delays[k]`` is the round trip (forward activation and backward gradient)
    that hop ``k → k + 1`` adds beyond an ordinary transfer, ``period_s`` a lower bound on the
    steady state's seconds per microbatch. Stage ``s`` waits on the round trips of every hop
    after it, so it starts ``Σ_{k ≥ s} ⌈delays[k] / period_s⌉`` more forwards before its first
    backward, at most ``m − (pp − s)`` (then it runs every forward first). With them no stage
    waits on a link's latency in the steady state: the pipeline pays it once, as fill
    (:func:`pipeline_time_s`' ``link_delay_s``), and holds the extra microbatches' activations
    (:func:`in_flight_microbatches`)."""
    pp = len(delays) + 1
    if period_s <= 0:
        raise ValueError(f"link_warmups: period_s={period_s} must be > 0")
    out, behind = [], 0
    for s in range(pp - 1, -1, -1):
        if s < pp - 1 and delays[s] > 0:
            behind += math.ceil(delays[s] / period_s - 1e-9)
        out.append(max(0, min(behind, m - (pp - s))))
    return tuple(reversed(out))


def zb_pending_weight_grads(stage: int, pp: int, m: int) -> int:
    """ZB-H1: microbatches whose deferred weight-gradient (W) pass is still pending when the
    stage's activations peak (stage ``s`` runs its W's ``s`` microbatches late)."""
    return max(0, min(stage, m - (pp - stage)))


def weight_grad_stash_bytes_per_layer(model: ModelSpec, micro_batch: int, tp: int,
                                      elem_bytes: int = 2) -> float:
    """ZB-H1: bytes one layer stashes per microbatch between its B and W passes: each linear's
    input (the first norm's output h, the attention output h/tp, the second norm's output h and
    the MLP's down-projection input f/tp) and output gradient (q, k, v: (h + 2·kv)/tp; o: h; up
    (and gate): f/tp each; down: h)."""
    s, b, h, f = model.seq_len, micro_batch, model.hidden, model.ffn_hidden
    kv = model.kv_heads * model.head_dim
    ffn_grads = (2 if model.gated_mlp else 1) * f
    replicated = 2 * h + 2 * h
    sharded = h + (h + 2 * kv) + f + ffn_grads
    return s * b * (replicated + sharded / tp) * float(elem_bytes)


def schedule_memory_args(stage: int, pp: int, m: int, schedule: str,
                         virtual_stages: int = 1, helix_filo: bool = False,
                         link_warmup: int = 0, recv_ahead: int = 0) -> dict[str, float]:
    """The schedule-dependent keyword arguments of :func:`stage_memory` for ``stage``
    (``interleaved-zb``: the peaks of its replayed order, :func:`interleaved_zb.stage_peaks`;
    ``helix``: its order's caps, :func:`helix.in_flight_bound`, ``helix_filo``: the
    first-in-last-out order's; 1F1B and ZB-H1: ``link_warmup`` extra warm-up forwards over a
    datacenter link, and ``recv_ahead`` more stage inputs received ahead from across one:
    :func:`link_warmups`)."""
    if schedule == "helix":
        # its entry cap and foreign-core cap (helix.in_flight_bound), never below 1F1B's at
        # the same position (the search's memory bounds assume it)
        in_flight = max(helix.in_flight_bound(pp, m, helix_filo), float(min(pp - stage, m)))
        # first in, last out: every microbatch's loss state waits for the backwards too
        return {"in_flight": in_flight, "pending_w": 0.0, "zb_stash": 0.0,
                "head_in_flight": float(m) if helix_filo else 1.0,
                "virtual_stages": virtual_stages,
                "ids_in_flight": float(m if helix_filo else min(pp, m)),
                "split_layers": True}
    if schedule == "interleaved-zb":
        v = virtual_stages
        in_flight, pending = interleaved_zb.stage_peaks(pp, m, v)[stage]
        return {"in_flight": in_flight, "pending_w": pending, "zb_stash": 1.0,
                "head_in_flight": 1.0, "virtual_stages": v,
                "ids_in_flight": float(min(in_flight * v, m)) if stage == 0 else in_flight,
                "moments": interleaved_zb.stage_moments(pp, m, v)[stage]}
    v = virtual_stages if schedule == "interleaved" else 1
    hides = schedule in HIDES_LINK_LATENCY
    warm = link_warmup if hides else 0
    return {"in_flight": in_flight_microbatches(stage, pp, m, schedule, v, warm),
            "recv_ahead": float(recv_ahead if hides else 0),
            "pending_w": float(zb_pending_weight_grads(stage, pp, m))
            if schedule == "zb-h1" else 0.0,
            "zb_stash": 1.0 if schedule == "zb-h1" else 0.0,
            "head_in_flight": float(m) if schedule == "gpipe" else 1.0,
            "virtual_stages": v,
            # interleaved: stage 0 starts up to pp·v chunk-0 microbatches before the first
            # chunk-0 backward (an upper bound; token ids are small)
            "ids_in_flight": float(min(pp * v, m)) if v > 1 and stage == 0 else
            in_flight_microbatches(stage, pp, m, schedule, v, warm)}


@dataclass(frozen=True, slots=True)
class StageMemory:
    """Affine memory model of one stage: ``fixed + per_layer · layers`` bytes per device."""

    fixed: float
    per_layer: float

    def bytes_for(self, layers: int) -> float:
        """Peak bytes with ``layers`` layers."""
        return self.fixed + self.per_layer * layers


# the chunked loss (runtime.model._ChunkedHeadLoss): tokens per chunk, and the shortest sequence
# for which the planner tries it beside the whole-sequence loss. A chunk's logits in fp32 are
# 2048·V·4 bytes (1 GiB at Llama 3's 128k vocabulary) against a whole sequence's, which from
# 16k tokens outgrow a GPU's share of the model (16k·128k·12 bytes while the unchunked loss
# runs: 25 GB); below it trying both rarely paid for the second search (plan_quality at 8k: 6
# of 80 plans faster, by at most 0.7%, for 1.8x the planning time; docs/planning.md §Chunked
# loss)
LOSS_CHUNK_TOKENS = 2048
LOSS_CHUNK_MIN_SEQ_LEN = 16384


def loss_chunk_tokens(model: ModelSpec) -> int:
    """The chunk the planner tries for ``model`` beside the whole-sequence loss (``plan_job``
    keeps the faster as the plan's ``training.loss_chunk_tokens``): :data:`LOSS_CHUNK_TOKENS`
    from :data:`LOSS_CHUNK_MIN_SEQ_LEN` tokens per sequence, else 0 (only the loss over the
    whole microbatch at once)."""
    return LOSS_CHUNK_TOKENS if model.seq_len >= LOSS_CHUNK_MIN_SEQ_LEN else 0


def chunked_loss_transient_bytes(model: ModelSpec, micro_batch: int, tp: int, elem_bytes: int,
                                 chunk: int) -> float:
    """What the chunked loss's backward (``runtime.model._ChunkedHeadLoss``) holds at its
    peak on one rank, ``model`` the rank's token-local view: the fp32 sum of the head's weight
    gradient and the input gradient for the whole microbatch, plus the largest of one chunk's
    logits in the plan precision and fp32 together (while they are converted), its logit
    gradient beside the chunk's weight-gradient product, and at the end that fp32 sum cast to
    the plan precision. ``chunk``: tokens per chunk; ``model.vocab / vocab_shards`` rows."""
    rows = model.vocab / vocab_shards(model, tp)
    tokens = model.seq_len * micro_batch
    c = min(chunk, tokens)
    eb = float(elem_bytes)
    fp32 = eb == 4
    weight_sum = rows * model.hidden * 4.0
    input_grad = tokens * model.hidden * eb
    convert = c * rows * (eb + (0.0 if fp32 else 4.0))
    product = c * rows * eb + rows * model.hidden * eb
    cast = 0.0 if fp32 else rows * model.hidden * eb
    return weight_sum + input_grad + max(convert, product, cast)


def stage_memory(model: ModelSpec, training: TrainingSpec, *, tp: int, dp: int, micro_batch: int,
                 in_flight: float, first: bool, last: bool,
                 virtual_stages: int = 1, pending_w: float = 0.0,
                 head_in_flight: float = 1.0, ids_in_flight: float | None = None,
                 zb_stash: float = 0.0, cp: int = 1,
                 moments: Sequence[tuple[float, float]] = (),
                 split_layers: bool = False, cp_masks: bool = True,
                 recv_ahead: float = 0.0) -> StageMemory:
    """Per-device memory of a stage as a function of its layer count.

    ``in_flight``: :func:`in_flight_microbatches`. Besides the model state and the layers'
    activations it counts what the runtime keeps per in-flight microbatch outside the layers:
    the stage output held for its backward (every stage but the last; per model chunk for
    interleaved) and the token ids (first stage); and on the last stage the final norm, the
    fp32 log-softmax the loss keeps and, while the loss is computed, the logits and their fp32
    copy (one microbatch: the last stage runs each backward right after its forward; GPipe
    keeps ``head_in_flight`` = all of them). ZB-H1 adds ``pending_w`` microbatches of stashed
    weight-gradient inputs (:func:`weight_grad_stash_bytes_per_layer`, and the head's); and
    with ``zb_stash`` (ZB-H1) the moment right after a B pass, when that microbatch's stash has
    replaced its activations: where one microbatch's stash outweighs its activations (full
    recompute keeps only the layer input) the difference is added.
    :func:`schedule_memory_args` gives the schedule-dependent arguments. ``moments``
    (interleaved-zb: ``(in_flight, pending_w)`` states its order passes through, each B's
    included) replaces the layers' ``in_flight``·activations + ``pending_w``·stash (and
    ``zb_stash``'s difference) by their largest sum over those states (the two peaks need not
    coincide); the terms outside the layers keep the peaks.

    Context parallelism ``cp > 1`` (``runtime/context_parallel.py``): every token-local term
    counts the rank's ``seq_len / cp`` tokens (:func:`cp_local_model`), each layer adds what
    the CP attention keeps beyond that (:func:`cp_attention_extra_bytes_per_layer`: the
    gathered full-sequence keys/values, and with ``cp_masks`` the materialised causal masks:
    ``not skips_masked_tiles(device)``), and ZeRO sharding spans the ``dp·cp`` gradient group.

    ``training.sharding`` (:func:`state_bytes_per_param`): gradients and full add the
    transient of the stage's largest unit (:func:`sharding_transient_bytes`) to ``fixed``.
    ``split_layers`` (helix) adds :func:`split_layer_extra_bytes` to each layer's activations.
    ``recv_ahead``: stage inputs the runtime receives ahead from across a datacenter link
    (``runtime/pipeline.py``, :func:`link_warmups`), one activation each.
    """
    per_param = state_bytes_per_param(training, dp * cp)
    eb = precision_bytes(training)
    if cp > 1:
        full, model = model, cp_local_model(model, cp)
        cp_extra = cp_attention_extra_bytes_per_layer(full, micro_batch, tp, cp,
                                                      training.recompute, eb, masks=cp_masks)
    else:
        cp_extra = 0.0
    s, b, h = model.seq_len, micro_batch, model.hidden
    act_one = activation_bytes_per_layer(model, micro_batch, tp, training.recompute, eb) + cp_extra
    if split_layers:
        act_one += split_layer_extra_bytes(model, micro_batch, training.recompute, eb)
    act = act_one * in_flight
    stash_one = weight_grad_stash_bytes_per_layer(model, micro_batch, tp, eb)
    stash = stash_one * pending_w + zb_stash * max(0.0, stash_one - act_one)
    if moments:  # the largest activations + stash over the states the order passes through
        act = max(act_one * a + stash_one * p for a, p in moments)
        stash = 0.0  # a B's moment (its activations and its stash) is one of them
    # matmul weights are TP-sharded, the norms replicated on every TP rank
    params = layer_matmul_params(model) / tp + (2 + NORM_BIAS_PARAMS_H) * h
    per_layer = params * per_param + act + stash
    fixed = float(FRAMEWORK_OVERHEAD_BYTES)
    # the backward's working set, a transient on top of what the stage holds: one MLP
    # backward (the first thing a layer's backward runs); a re-run layer (full,
    # attention-free) holds that layer's re-run too (recompute_working_set_bytes without the
    # RoPE tables, which stay for the step)
    rerun = reruns_layer(training.recompute)
    fixed += recompute_rope_table_bytes(model, training.recompute)
    gathered = full.seq_len - model.seq_len if cp > 1 else 0  # CP: the other ranks' tokens
    working = backward_working_set_bytes(model, micro_batch, tp, training.recompute, eb,
                                         training.mlp_chunk_tokens, gathered)
    if rerun and cp > 1:  # the re-run layer's gathered keys/values
        working += cp_attention_extra_bytes_per_layer(full, micro_batch, tp, cp, "none", eb,
                                                      masks=cp_masks)
    chunks_in_flight = in_flight * virtual_stages
    fixed += s * b * h * eb * recv_ahead  # inputs received ahead over a datacenter link
    vs = vocab_shards(model, tp)
    # vocab-parallel: the embedding keeps its local int64 ids and a bool out-of-range mask; the
    # cross-entropy its local int64 target index and a bool in-range mask (1 byte each)
    mask = 1.0 if vs > 1 else 0.0
    unit = params  # ZeRO-2/3: the stage's largest unit (one layer, the embedding, the head)
    if first:
        table = embedding_params(model) / vs + (s * h if LEARNED_POSITIONS else 0)
        unit = max(unit, table)
        ids = s * b * (8.0 + mask) + (s * 8.0 if LEARNED_POSITIONS else 0.0)  # int64 tokens
        fixed += table * per_param + ids * (in_flight if ids_in_flight is None
                                            else ids_in_flight)
    if not last:
        fixed += working
        fixed += s * b * h * eb * chunks_in_flight  # stage output kept for backward
    else:
        if split_layers:  # helix: each of its layers' outputs but the last goes on
            fixed += s * b * h * eb * in_flight * (virtual_stages - 1)
        elif virtual_stages > 1:  # the last stage's earlier chunks feed stage 0
            fixed += s * b * h * eb * max(0.0, chunks_in_flight - 1)
        head_table = 0 if (first and model.tie_embeddings) else embedding_params(model) / vs
        head = head_table + (1 + NORM_BIAS_PARAMS_H // 2) * h  # + final norm
        unit = max(unit, head)
        fixed += head * per_param
        logits = s * b * model.vocab / vs  # this rank's logit columns
        # per microbatch in flight: the final RMSNorm's saved input and output (sequence
        # parallel: a token shard; the output whole when the head is replicated, as the
        # gathered sequence is then the head's saved input); the saved fp32 log-softmax
        # (vocab-parallel: softmax); the int64 targets
        sp = sequence_shards(model, tp)
        norm_saved = s * b * eb * h * (1.0 / sp + (1.0 / sp if vs > 1 else 1.0))
        chunk = training.loss_chunk_tokens
        if chunk:
            # chunked (runtime.model._ChunkedHeadLoss): per microbatch in flight one fp32
            # log-sum-exp per token instead of the log-softmax, the int64 targets (the
            # in-range mask is made per chunk); the backward's chunk-sized buffers
            # (chunked_loss_transient_bytes); the head's weight gradient is made in the
            # backward, so a zero-bubble schedule stashes nothing for it
            fixed += head_in_flight * (norm_saved + s * b * (4.0 + 8.0) + LOSS_SCALAR_BYTES)
            fixed += max(working, chunked_loss_transient_bytes(model, b, tp, int(eb), chunk))
        else:
            fixed += head_in_flight * (norm_saved + logits * 4.0 + s * b * (8.0 + mask)
                                       + LOSS_SCALAR_BYTES)
            # transient while the loss runs: the logits, their gradient and, below fp32, the
            # fp32 copy the loss computes in (8 bytes a logit in bf16 and fp32, measured on an
            # H200: docs/runtime.md §GPU readiness check); never alive with full recompute's
            # re-run layer (the loss's backward ends before the first layer is re-run): the
            # larger counts
            fixed += max(working, logits * (2 * eb + (4.0 if eb != 4 else 0.0)))
            fixed += pending_w * (s * b * h + logits) * eb  # ZB-H1: the head's stashed W inputs
    fixed += sharding_transient_bytes(training, unit)
    return StageMemory(fixed, per_layer)


# ---------------------------------------------------------------- communication


def ring_all_reduce_s(nbytes: float, ranks: int, gbytes_per_s: float,
                      latency_s: float = COLLECTIVE_LATENCY_S) -> float:
    """α–β time of a ring all-reduce."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (ranks - 1) * latency_s + 2 * (ranks - 1) / ranks * nbytes / (gbytes_per_s * 1e9)


def ring_reduce_scatter_s(nbytes: float, ranks: int, gbytes_per_s: float,
                          latency_s: float = COLLECTIVE_LATENCY_S) -> float:
    """α–β time of a ring reduce-scatter (an all-gather costs the same)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return (ranks - 1) * latency_s + (ranks - 1) / ranks * nbytes / (gbytes_per_s * 1e9)


def dp_members_per_node(ranks: int, tp: int, gpus_per_node: int) -> int:
    """Members of one stage DP group (of ``ranks``) on one node: the node's GPUs hold
    ``gpus_per_node // tp`` TP groups side by side, one member of the DP group each (the
    planner places a stage's replicas on consecutive GPUs, TP innermost); 1 when a TP group
    fills a node or more."""
    return max(1, min(ranks, gpus_per_node // max(1, tp)))


def node_hierarchical_all_reduce(ranks: int, per_node: int, intra_gbytes: float,
                                 intra_latency_s: float, nic_gbytes: float,
                                 nic_latency_s: float) -> tuple[float, float]:
    """``(latency seconds, seconds per byte)`` of an all-reduce of a DP group of ``ranks``
    with ``per_node`` members per node, per byte each rank holds (α–β):

    1. reduce-scatter inside the node over its ``per_node`` members (``per_node − 1`` steps of
       ``M/per_node`` over the intra-node link);
    2. ``per_node`` all-reduces side by side, one per shard, each over ``⌈ranks/per_node⌉``
       nodes (``2(N − 1)`` steps of ``M/(per_node·N)`` over each GPU's own NIC share: the
       node's ``per_node`` NIC shares carry the node's one ring member's bytes together);
    3. all-gather inside the node (as 1).

    That is the runtime's hierarchical all-reduce (``runtime/collectives/hierarchical.py``:
    intra reduce-scatter, inter all-reduce among the shard owners, intra all-gather) with
    nodes as blocks, and what NCCL's ring reaches inside one pool with a channel per NIC (the
    node boundary carries one ring member's ``2(N − 1)/N·M``, spread over the node's NICs).
    One node (``ranks ≤ per_node``): a ring over the intra-node link; one member per node: a
    ring over the NICs."""
    if ranks <= 1:
        return 0.0, 0.0
    g = max(1, min(ranks, per_node))
    nodes = -(-ranks // g)
    lat = 2 * (g - 1) * intra_latency_s + 2 * (nodes - 1) * nic_latency_s
    per_byte = (2 * (g - 1) / g / (intra_gbytes * 1e9)
                + 2 * (nodes - 1) / nodes / g / (nic_gbytes * 1e9))
    return lat, per_byte


def transfer_s(nbytes: float, gbytes_per_s: float, latency_s: float) -> float:
    """Point-to-point transfer time."""
    return latency_s + nbytes / (gbytes_per_s * 1e9)


def host_staged_gbytes(src: DeviceSpec, dst: DeviceSpec, network_gbytes: float) -> float:
    """Effective bandwidth of a cross-vendor hop: device→host, network, host→device in series."""
    return 1.0 / (1.0 / src.pcie_gbps + 1.0 / network_gbytes + 1.0 / dst.pcie_gbps)


# ---------------------------------------------------------------- DP sync overlapped with backward

DP_BUCKET_BYTES = 25 * 2**20  # the runtime's gradient bucket (runtime/grad_sync.py; torch DDP's)
# fraction of the backward window the DP all-reduce can use when it runs alongside compute
# (the collective's kernels and the GEMMs contend for SMs and memory bandwidth); an estimate,
# not fitted: no published row overlaps its DP sync (Megatron SC'21 reduced after the backward)
DP_OVERLAP_SHARE = 0.8


def dp_overlap_share(device: DeviceSpec) -> float:
    """The share of a compute window ``device``'s DP collectives can run in
    (:data:`DP_OVERLAP_SHARE`); none on a CPU (vendor ``cpu``): gloo's collectives are CPU
    work on the same cores as the ranks' compute, so launching them early hides nothing but
    the waiting (``bench/fidelity.py --cpu``'s ZeRO-3 row, docs/planning.md)."""
    return 0.0 if device.vendor == "cpu" else DP_OVERLAP_SHARE


def backward_fraction(recompute: str) -> float:
    """Share of a layer's fwd+bwd compute spent in its backward (incl. a re-run layer's
    forward, which runs inside the backward): 2/3, or 3/4 with full or attention-free
    recompute (:func:`compute_passes`)."""
    passes = compute_passes(recompute)
    return (passes - 1) / passes


def dp_exposed_s(sync_s: float, last_bucket_s: float, window_s: float,
                 share: float = DP_OVERLAP_SHARE) -> float:
    """Exposed seconds of a bucketed DP gradient sync overlapped with the last microbatch's
    backward of the stage (what ``runtime/grad_sync.py`` does).

    ``sync_s``: the all-reduce of every bucket back to back; ``last_bucket_s``: the bucket the
    backward finishes last (the first layers' gradients, incl. the embedding on the first
    stage), which can only start when the backward ends and is always exposed;
    ``window_s``: the last microbatch's backward on the stage, of which ``share`` is usable
    for communication. The other buckets run during the window; what does not fit delays the
    last one::

        exposed = last + max(0, sync − last − share · window),   last = min(last_bucket, sync)
    """
    last = min(last_bucket_s, sync_s)
    return last + max(0.0, sync_s - last - share * window_s)


def dp_exposed_coeffs(c: float, e: float, window_per_layer: float, window_fixed: float,
                      last_bucket_s: float, share: float = DP_OVERLAP_SHARE
                      ) -> tuple[float, float]:
    """The planner's affine form ``(c', e')`` of :func:`dp_exposed_s` for a stage whose full
    sync is ``c·n + e`` and last-microbatch backward ``window_per_layer·n + window_fixed``
    with ``n`` layers: ``c' = max(0, c − share·w)``, ``e' = last + max(0, e − last −
    share·w_fixed)``. It is never below :func:`dp_exposed_s` (the positive part is
    subadditive; equal when the two parts have the same sign) and keeps the layer split exact
    (``planning/layers.py`` needs affine, non-decreasing DP times)."""
    cc = max(0.0, c - share * window_per_layer)
    ee = last_bucket_s + max(0.0, e - last_bucket_s - share * window_fixed)
    return cc, ee


def tp_all_reduces_per_layer(recompute: str) -> int:
    """All-reduce-equivalents of one layer's TP comm for one microbatch.

    Megatron TP(+SP): 2 forward (attention and MLP outputs) and 2 backward; a re-run layer's
    forward (full, attention-free: :func:`reruns_layer`) repeats the 2 forward ones.
    """
    return 4 + (2 if reruns_layer(recompute) else 0)


def measured_comm(device: DeviceSpec) -> CommProfile | None:
    """The device profile's measured transfers (``profiles.CommProfile``), or None."""
    return device.profile.comm if device.profile is not None else None


def node_ring_link(device: DeviceSpec) -> tuple[float, float]:
    """(bus GB/s, latency of one ring step) of a collective inside one node of ``device``: the
    device profile's measured all-reduce (``hettrain profile``) where it has one, else
    ``TP_BUS_EFFICIENCY`` of the catalog's intra-node link at ``TP_LATENCY_S``."""
    comm = measured_comm(device)
    if comm is not None:
        return comm.bus_bytes_per_s / 1e9, comm.ring_step_latency_s
    return device.intra_node_gbps * TP_BUS_EFFICIENCY, TP_LATENCY_S


def p2p_link(device: DeviceSpec, gbytes_per_s: float, latency_s: float) -> tuple[float, float]:
    """(GB/s, latency) of a pipeline transfer between two stages of ``device``'s vendor sent or
    received by ``device`` over a path of ``gbytes_per_s`` and ``latency_s``: where the device
    profile measured its p2p transfers (device tensors over the pool backend, as the runtime's
    same-vendor stream groups send them), no path is faster than the measured bandwidth nor
    quicker than the measured latency (the same library sends on every path)."""
    comm = measured_comm(device)
    if comm is None:
        return gbytes_per_s, latency_s
    return (min(gbytes_per_s, comm.p2p_bytes_per_s / 1e9), max(latency_s, comm.p2p_latency_s))


def tp_comm_per_layer_s(model: ModelSpec, micro_batch: int, tp: int, device: DeviceSpec,
                        elem_bytes: int = 2, recompute: str = "none") -> float:
    """Exposed TP comm of one layer and microbatch (the runtime's TP collectives are
    synchronous: nothing overlaps them), over :func:`node_ring_link`."""
    if tp <= 1:
        return 0.0
    nbytes = model.seq_len * micro_batch * model.hidden * elem_bytes
    bw, lat = node_ring_link(device)
    return tp_all_reduces_per_layer(recompute) * ring_all_reduce_s(nbytes, tp, bw, lat)


def activation_bytes(model: ModelSpec, micro_batch: int, elem_bytes: int = 2) -> float:
    """Bytes of one microbatch's boundary tensor crossing one pipeline boundary of one replica
    in one direction: ``s·b·h·e`` (the activation forward, its gradient backward), with ``e``
    the plan precision's element size (:func:`precision_bytes`: 2 for bf16/fp16, 4 for fp32).

    This is exactly what the runtime puts on the wire (``runtime/collectives/p2p.py``): the
    tensor is cast to the plan precision and sent ONCE per replica, cut into
    ``lcm(t_send, t_recv)`` equal pieces, one message per (sender, receiver) TP pair with
    overlapping slices; the receiving stage then all-gathers it inside its TP group (an
    intra-pool collective, not counted here). The busiest rank's link carries
    ``s·b·h·e / min(t_send, t_recv)`` (:func:`boundary_link_bytes`, what the planner times);
    a replica moves ``2·m·(p·v − 1)·s·b·h·e`` per step (:func:`pipeline_bytes_per_step`).
    """
    return float(model.seq_len * micro_batch * model.hidden * elem_bytes)


def boundary_link_bytes(model: ModelSpec, micro_batch: int, elem_bytes: int, tp_send: int,
                        tp_recv: int) -> float:
    """Bytes the busiest rank of a boundary sends or receives per microbatch and direction:
    :func:`activation_bytes` ``/ min(t_send, t_recv)``."""
    return activation_bytes(model, micro_batch, elem_bytes) / max(1, min(tp_send, tp_recv))


def pipeline_bytes_per_step(model: ModelSpec, micro_batch: int, elem_bytes: int,
                            num_microbatches: int, pp: int, virtual_stages: int = 1) -> float:
    """Boundary bytes one replica sends per step: ``2·m·(p·v − 1)`` boundary tensors of
    :func:`activation_bytes` (forward and backward over the ``p·v − 1`` chunk boundaries,
    including the ``v − 1`` hops from the last stage back to the first with interleaving)."""
    hops = max(0, pp * virtual_stages - 1)
    return 2 * num_microbatches * hops * activation_bytes(model, micro_batch, elem_bytes)


def helix_bytes_per_step(model: ModelSpec, micro_batch: int, elem_bytes: int,
                         num_microbatches: int, pp: int, hop: float = 0.0,
                         filo: bool = False) -> float:
    """Bytes one replica of the ``helix`` schedule (``filo``: its first-in-last-out order)
    sends per step, from its order (:func:`helix.transfers`): layer outputs to the next
    layer's owner, and each core moved off its owner's q/k/v and output, every one with its
    gradient (what ``runtime/helix.py`` sends; ``tests/runtime/training/test_helix.py``
    counts it)."""
    if pp == 1:
        return 0.0
    orders = helix.helix_orders(pp, model.layers, num_microbatches, helix.costs_for(model), hop,
                                filo)
    n = helix.transfers(orders, model.layers)
    shapes = helix.message_shapes(model, micro_batch, model.seq_len)
    return float(sum(n[k] * math.prod(shape) for k, shape in shapes.items()) * elem_bytes)


# ---------------------------------------------------------------- schedules


def zb_bubble_divisor(devices: Sequence[DeviceSpec], model: ModelSpec,
                      training: TrainingSpec, micro_batch: int) -> float:
    """What ZB-H1 divides 1F1B's bubble by on a pipeline of ``devices``' stages: per device
    the inverse of its profile's measured share ``(F + B − W)/(F + B + W)`` where the profile
    matches this layer shape and precision and measured the backward split
    (``LayerProfile.zb_bubble_ratio``), else the catalog rule, 3 (``F = B = W``); over the
    stages the smallest (one divisor for the pipeline, so the layer split stays exact:
    ``planning/layers.py``; the stage that fills least of its bubble bounds the pipeline)."""
    eb = precision_bytes(training)
    out = math.inf
    for d in devices:
        prof = d.profile
        r = (prof.zb_bubble_ratio(micro_batch, training.recompute)
             if prof is not None and prof.matches(model, eb) else None)
        out = min(out, ZB_CATALOG_DIVISOR if r is None else 1.0 / r)
    return ZB_CATALOG_DIVISOR if out == math.inf else out


def boundary_charges(hops: Sequence[float], pp: int, schedule: str,
                     virtual_stages: int = 1) -> list[float]:
    """Seconds per microbatch each boundary costs a ``pp``-stage pipeline: ``hops[i]`` for
    ``i < pp − 1`` is the hop from stage ``i`` to ``i + 1`` (activation and gradient), taken
    once per model chunk (``v`` times for the interleaved schedules); ``hops[pp − 1]``, given
    for the interleaved schedules, the hop from the last stage back to stage 0 that each chunk
    but the last takes (``v − 1`` times). A caller that passes no such element leaves it
    unpriced."""
    v = virtual_stages if chunked_schedule(schedule) else 1
    out = [b * v for b in hops[:pp - 1]]
    if v > 1:
        out += [b * (v - 1) for b in hops[pp - 1:pp]]
    return out


def pipeline_time_s(stage_s: list[float], boundary_s: list[float], m: int, schedule: str,
                    virtual_stages: int = 1, zb_div: float = ZB_CATALOG_DIVISOR,
                    model: ModelSpec | None = None, helix_hop: float = 0.0,
                    helix_filo: bool = False, link_delay_s: float = 0.0
                    ) -> tuple[float, float]:
    """Time of the pipelined part of a step and its bubble, for heterogeneous stages.

    1F1B: ``(m−1)·max + Σ`` over stages and boundary transfers (a slow link is a stage of its
    own; :func:`boundary_charges`). Interleaved with ``v`` chunks divides the bubble
    ``Σ − max`` by ``v`` (Narayanan §2.2.2) at ``v``× the boundary traffic, plus ``v − 1`` hops
    from the last stage back to stage 0 where ``boundary_s`` has that element. ZB-H1 (Qi et
    al., "Zero Bubble Pipeline Parallelism", ICLR'24) splits backward into input- (B) and
    weight-gradient (W) passes and, at the same peak memory, leaves ``(p − 1)(F + B − W)`` of
    1F1B's ``(p − 1)(F + B + W)``: bubble ``(Σ − max)/zb_div`` with ``zb_div`` from measured
    B/W (:func:`zb_bubble_divisor`) or, by default, the catalog's 3 (``F = B = W``).
    ``interleaved-zb`` (both, on ``v`` chunks: ``planning/interleaved_zb.py``) divides it by
    its replayed order's own divisor (:func:`interleaved_zb.bubble_divisor`, ``3·v`` where its
    list scheduler is optimal) scaled by ``zb_div/3``, with interleaved's boundary traffic.
    ``helix`` (``planning/helix.py``; needs ``model``): the stages' bubble ``Σ − max`` over
    stages only, divided by its order's divisor replayed on equal stages with ``helix_hop``
    per transfer (:func:`helix.bubble_divisor`: every transfer's delay, the moved cores'
    included, is in that replay; ``helix_filo``: the first-in-last-out order's), and
    interleaved's boundary traffic at one layer per chunk in the slowest term only (a link
    busier than a stage).
    ``link_delay_s``: the datacenter links' round-trip latency that 1F1B and ZB-H1 hide
    with extra warm-up (:func:`link_warmups`; ``boundary_s`` then carries only the hops'
    transfer time): paid once, as fill, in the total and the bubble and not divided by the
    schedule's divisor (the W passes are not assumed to fill it).
    Returns (total seconds, bubble seconds).
    """
    boundaries = boundary_charges(boundary_s, len(stage_s), schedule, virtual_stages)
    slowest = max(stage_s + boundaries)
    total = sum(stage_s) + sum(boundaries)
    bubble = total - slowest
    if schedule == "interleaved":
        bubble /= virtual_stages
    elif schedule == "zb-h1":
        bubble /= zb_div
    elif schedule == "interleaved-zb":
        bubble /= (interleaved_zb.bubble_divisor(len(stage_s), m, virtual_stages)
                   * zb_div / ZB_CATALOG_DIVISOR)
    elif schedule == "helix":
        if model is None:
            raise ValueError("pipeline_time_s: the helix order needs the model")
        # the replay already delays every transfer by the hop: the stages' bubble alone
        bubble = (sum(stage_s) - max(stage_s)) / helix.bubble_divisor(
            len(stage_s), model.layers, m, helix.costs_for(model), helix_hop, helix_filo)
    bubble += link_delay_s
    return m * slowest + bubble, bubble
