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

Activation memory (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", MLSys'23, Table 2), bytes per layer with tensor and sequence parallelism:
``s·b·h·(34 + 5·a·s/h)/t`` without recompute, ``34·s·b·h/t`` with selective recompute, and
``2·s·b·h/t`` (the layer input) with full recompute. In 1F1B stage ``i`` keeps ``p − i``
microbatches in flight (Narayanan et al. §2.2.1).

Model state bytes per parameter (Rajbhandari et al., ZeRO, SC'20, §3): bf16/fp16 mixed precision
keeps 2 (weights) + 4 (fp32 gradients, Megatron's main grads) + 12 (fp32 master, Adam m and v);
the distributed optimizer (ZeRO-1) shards the 12 over data-parallel ranks. fp32 training keeps
4 + 4 + 8.

Communication uses the α–β model (Hockney; Thakur et al., "Optimization of Collective
Communication Operations in MPICH", 2005): a ring all-reduce of ``n`` bytes over ``k`` ranks costs
``2·(k−1)·α + 2·(k−1)/k · n/β``; reduce-scatter and all-gather cost half of that each.
"""

from __future__ import annotations

from dataclasses import dataclass

from hettrain.api.spec import ModelSpec, TrainingSpec
from hettrain.planning.catalog import DeviceSpec

GIB = 2**30
FRAMEWORK_OVERHEAD_BYTES = 3 * GIB  # CUDA/ROCm context, allocator, comm buffers
MEMORY_HEADROOM = 0.92  # fraction of HBM the planner is allowed to fill (fragmentation)
COLLECTIVE_LATENCY_S = 20e-6  # α for one ring step inside a datacenter
HOST_STAGING_LATENCY_S = 50e-6  # extra per transfer for device->host->device staging


def precision_bytes(training: TrainingSpec) -> int:
    """Bytes of one activation / weight element."""
    return 4 if training.precision == "fp32" else 2


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


def recompute_forward_flops(model: ModelSpec, tokens: int, mode: str) -> float:
    """Extra forward FLOPs per layer spent recomputing activations in the backward pass."""
    if mode == "full":
        return layer_forward_flops(model, tokens)
    if mode == "selective":  # only the attention core (Korthikanti §4.2)
        return tokens * 4.0 * model.seq_len * model.hidden
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
ATTENTION_EFFICIENCY = 0.50  # attention core vs large GEMMs; FITTED (Table 1)
ELEMENTWISE_BYTES_PER_HIDDEN = 24.0  # counted: 2 norms, 2 bias+dropout+residual, bf16
ELEMENTWISE_BYTES_PER_FFN = 4.0  # counted: the MLP activation reads + writes f, bf16
KERNELS_PER_PASS = 14  # counted: 4-5 GEMMs, attention, ~8 elementwise per layer forward
TP_BUS_EFFICIENCY = 0.85  # NCCL ring bus bandwidth / link bandwidth on NVLink; FITTED (Table 1)
TP_LATENCY_S = 5e-6  # α of one ring step over NVLink (NCCL small-message latency); estimate


def compute_passes(recompute: str) -> int:
    """Forward-pass equivalents of a layer's GEMMs per microbatch: forward 1, backward 2
    (input and weight gradients), plus 1 when the whole forward is recomputed."""
    return 3 + (1 if recompute == "full" else 0)


def attention_passes(recompute: str) -> int:
    """Forward-pass equivalents of the attention core: selective recompute redoes it too."""
    return 3 + (1 if recompute in ("full", "selective") else 0)


def gemm_efficiency(device: DeviceSpec, gemm_flops: float) -> float:
    """Achieved fraction of peak of one GEMM of ``gemm_flops`` FLOPs: the saturating curve
    ``e·x / (x + peak·e·KERNEL_FIXED_S)`` implied by a fixed time per kernel."""
    e = device.efficiency
    return e * gemm_flops / (gemm_flops + device.flops * e * KERNEL_FIXED_S)


def layer_compute_s(model: ModelSpec, micro_batch: int, tp: int, device: DeviceSpec,
                    recompute: str, elem_bytes: int = 2) -> float:
    """Compute seconds of one layer for one microbatch on one TP rank (no communication).

    A device profile that measured this layer shape (``planning/profiles.py``) replaces the
    model: its fitted seconds, plus one modelled attention forward for selective recompute.
    """
    tokens = micro_batch * model.seq_len
    prof = device.profile
    if prof is not None and prof.matches(model):
        t = prof.layer_s(micro_batch, tp, recompute)
        if recompute == "selective":
            t += (4.0 * tokens * model.seq_len * model.hidden / tp
                  / (device.flops * device.efficiency * ATTENTION_EFFICIENCY))
        return t
    passes = compute_passes(recompute)
    gemm = passes * 2.0 * tokens * layer_matmul_params(model) / tp
    attn = attention_passes(recompute) * 4.0 * tokens * model.seq_len * model.hidden / tp
    peak = device.flops * device.efficiency
    elementwise = (passes * tokens * (ELEMENTWISE_BYTES_PER_HIDDEN * model.hidden
                                      + ELEMENTWISE_BYTES_PER_FFN * model.ffn_hidden)
                   / tp * elem_bytes / 2)
    return (gemm / peak + attn / (peak * ATTENTION_EFFICIENCY)
            + elementwise / (device.hbm_tbps * 1e12)
            + passes * KERNELS_PER_PASS * KERNEL_FIXED_S)


def layer_time_s(model: ModelSpec, training: TrainingSpec, micro_batch: int, tp: int,
                 device: DeviceSpec) -> float:
    """Seconds of one layer per microbatch on a stage: compute plus exposed TP comm."""
    eb = precision_bytes(training)
    return (layer_compute_s(model, micro_batch, tp, device, training.recompute, eb)
            + tp_comm_per_layer_s(model, micro_batch, tp, device, eb, training.recompute))


def head_time_s(model: ModelSpec, micro_batch: int, tp: int, device: DeviceSpec) -> float:
    """Seconds of the LM head (vocab-parallel logits, forward + 2 backward GEMMs) per
    microbatch on one TP rank."""
    flops = 3 * head_forward_flops(model, micro_batch * model.seq_len) / tp
    return flops / (device.flops * device.efficiency) + 3 * KERNEL_FIXED_S


def min_seconds_per_flop(device: DeviceSpec, model: ModelSpec | None = None) -> float:
    """A lower bound on seconds per model FLOP (fwd + bwd, no recompute) on ``device``: every
    term of the model only adds to ``F/(peak·e)``; a matching profile's layer takes at least
    ``β·b/tp`` for ``3·F(b)/tp`` FLOPs."""
    bound = 1.0 / (device.flops * device.efficiency)
    prof = device.profile
    if model is not None and prof is not None and prof.matches(model):
        bound = min(bound, prof.beta / (3.0 * layer_forward_flops(model, model.seq_len)))
    return bound


# ---------------------------------------------------------------- memory


def state_bytes_per_param(training: TrainingSpec, dp: int) -> float:
    """Weights + gradients + optimizer bytes per parameter on one rank."""
    if training.precision == "fp32":
        weights, grads, optim = 4.0, 4.0, 8.0
    else:
        weights, grads, optim = 2.0, 4.0, 12.0
    if training.optimizer_sharding:
        optim /= dp
    return weights + grads + optim


def activation_bytes_per_layer(model: ModelSpec, micro_batch: int, tp: int, recompute: str,
                               elem_bytes: int = 2) -> float:
    """Korthikanti et al. activation bytes of one layer for one microbatch (TP + SP)."""
    s, b, h, a = model.seq_len, micro_batch, model.hidden, model.heads
    scale = elem_bytes / 2  # the paper's constants assume 2-byte activations
    if recompute == "full":
        return 2.0 * s * b * h / tp * scale
    if recompute == "selective":
        return 34.0 * s * b * h / tp * scale
    return s * b * h * (34.0 + 5.0 * a * s / h) / tp * scale


def embedding_params(model: ModelSpec) -> int:
    """Token embedding (first stage) or LM head (last stage) parameters."""
    return model.vocab * model.hidden


@dataclass(frozen=True, slots=True)
class StageMemory:
    """Affine memory model of one stage: ``fixed + per_layer · layers`` bytes per device."""

    fixed: float
    per_layer: float

    def bytes_for(self, layers: int) -> float:
        """Peak bytes with ``layers`` layers."""
        return self.fixed + self.per_layer * layers


def stage_memory(model: ModelSpec, training: TrainingSpec, *, tp: int, dp: int, micro_batch: int,
                 in_flight: int, first: bool, last: bool) -> StageMemory:
    """Per-device memory of a stage as a function of its layer count."""
    per_param = state_bytes_per_param(training, dp)
    eb = precision_bytes(training)
    act = activation_bytes_per_layer(model, micro_batch, tp, training.recompute, eb) * in_flight
    per_layer = layer_params(model) / tp * per_param + act
    fixed = float(FRAMEWORK_OVERHEAD_BYTES)
    tokens_bytes = model.seq_len * micro_batch * model.hidden * eb
    if first:
        fixed += embedding_params(model) / tp * per_param + tokens_bytes * in_flight / tp
    if last:
        if not (first and model.tie_embeddings):  # tied: one tensor for both ends
            fixed += embedding_params(model) / tp * per_param
        # fp32 logits for the loss of one microbatch (vocab-parallel cross entropy)
        fixed += model.seq_len * micro_batch * model.vocab / tp * 4.0 * 2
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


def transfer_s(nbytes: float, gbytes_per_s: float, latency_s: float) -> float:
    """Point-to-point transfer time."""
    return latency_s + nbytes / (gbytes_per_s * 1e9)


def host_staged_gbytes(src: DeviceSpec, dst: DeviceSpec, network_gbytes: float) -> float:
    """Effective bandwidth of a cross-vendor hop: device→host, network, host→device in series."""
    return 1.0 / (1.0 / src.pcie_gbps + 1.0 / network_gbytes + 1.0 / dst.pcie_gbps)


def tp_all_reduces_per_layer(recompute: str) -> int:
    """All-reduce-equivalents of one layer's TP comm for one microbatch.

    Megatron TP(+SP): 2 forward (attention and MLP outputs) and 2 backward; a full-recompute
    forward repeats the 2 forward ones.
    """
    return 4 + (2 if recompute == "full" else 0)


def tp_comm_per_layer_s(model: ModelSpec, micro_batch: int, tp: int, device: DeviceSpec,
                        elem_bytes: int = 2, recompute: str = "none") -> float:
    """Exposed TP comm of one layer and microbatch (the runtime's TP collectives are
    synchronous: nothing overlaps them), at ``TP_BUS_EFFICIENCY`` of the intra-node link."""
    if tp <= 1:
        return 0.0
    nbytes = model.seq_len * micro_batch * model.hidden * elem_bytes
    bw = device.intra_node_gbps * TP_BUS_EFFICIENCY
    return tp_all_reduces_per_layer(recompute) * ring_all_reduce_s(nbytes, tp, bw,
                                                                    TP_LATENCY_S)


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


# ---------------------------------------------------------------- schedules


def pipeline_time_s(stage_s: list[float], boundary_s: list[float], m: int, schedule: str,
                    virtual_stages: int = 1) -> tuple[float, float]:
    """Time of the pipelined part of a step and its bubble, for heterogeneous stages.

    1F1B: ``(m−1)·max + Σ`` over stages and boundary transfers (a slow link is a stage of its
    own). Interleaved with ``v`` chunks divides the bubble ``Σ − max`` by ``v`` (Narayanan §2.2.2)
    at ``v``× the boundary traffic. ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism",
    ICLR'24) splits backward into input- and weight-gradient passes and fills about two thirds
    of the 1F1B bubble at the same peak memory: bubble ``(Σ − max)/3``.
    Returns (total seconds, bubble seconds).
    """
    boundaries = list(boundary_s)
    if schedule == "interleaved":
        boundaries = [b * virtual_stages for b in boundaries]
    slowest = max(stage_s + boundaries)
    total = sum(stage_s) + sum(boundaries)
    bubble = total - slowest
    if schedule == "interleaved":
        bubble /= virtual_stages
    elif schedule == "zb-h1":
        bubble /= 3.0
    return m * slowest + bubble, bubble
