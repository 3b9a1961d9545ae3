"""Context parallelism (CP) in the cost model: time of one layer of a CP stage. Pure arithmetic.

What the runtime does (``runtime/context_parallel.py``): each sequence of ``s`` tokens is cut
into ``2·cp`` chunks of ``L = s/2cp`` tokens and CP rank ``c`` holds chunks ``c`` and
``2cp−1−c``. Everything but attention is token-local, so a rank's GEMMs, elementwise work and
LM head run on ``s/cp`` tokens (:func:`cost.cp_local_model`). Attention: the keys and values
(``kv_heads``, TP-sharded) are all-gathered over the CP group, and each local query chunk ``j``
attends to the key prefix ``[0, (j+1)·L)`` under a lower-right causal mask (its last ``L`` keys
are the diagonal block). Where the device's attention kernels skip masked tiles
(:func:`cost.skips_masked_tiles`: flash / memory-efficient attention on NVIDIA GPUs) a rank
computes exactly ``1/cp`` of the causal query-key pairs of the whole sequence; elsewhere SDPA
materialises the mask and computes the diagonal blocks in full, ``L²·(2cp+1)`` pairs,
``(2cp+1)/(2cp²)`` of the ``s²/2`` (:func:`attention_share`). The backward reduce-scatters the
gradient of the gathered keys and values over the CP group: each rank receives the sum of its
own rows.

Communication per layer and microbatch (:func:`cp_comm_per_layer_s`): forward, an all-gather
of K and V side by side, ``2·b·s·kv/tp`` elements in the plan precision; backward, a
reduce-scatter of their gradients, the same size (an all-reduce on gloo: :func:`scatters_rows`);
full and attention-free recompute re-run the forward's all-gather in the backward
(attention-free re-runs the layer around the attention outputs it kept, whose K/V projections
are gathered again; selective recompute re-runs only the attention core, on the gathered
tensors it kept). The runtime exchanges each key/value head of the rank (its head group) on its
own, all gathers launched at once, each group's attention as soon as its gather has arrived,
and each group's gradient reduction as soon as its attention backward has produced it
(:func:`head_groups`): with ``G`` groups, of ``t`` seconds of communication and ``w`` seconds
of attention each, ``t + (G − 1)·max(0, t − w)`` of it is exposed (:func:`exposed_s`: the
first gather and the last reduction always are). The window is ``cost.dp_overlap_share`` of
the attention's time (:func:`attention_window_s`: the collectives and the attention contend
for the device, as the DP sync and the backward do), none on a CPU, whose gloo collectives
run on the ranks' own cores; attention-free's re-run computes no attention, so its gather is
exposed whole.
The CP group's link: the
node's (``intra_node_gbps`` at ``TP_BUS_EFFICIENCY``, like TP) when the group's ``tp·cp`` GPUs
sit in one node, else the scale-out NIC per GPU (:func:`cp_link`).
"""

from __future__ import annotations

from hettrain.api.spec import ModelSpec, TrainingSpec
from hettrain.planning import cost
from hettrain.planning.catalog import DeviceSpec

CP_NIC_LATENCY_S = cost.COLLECTIVE_LATENCY_S  # α of one ring step over the NIC


def attention_share(cp: int, *, skips_masked: bool) -> float:
    """A CP rank's attention query-key pairs over those of causal attention on the whole
    sequence: ``1/cp`` where the kernel skips masked tiles (:func:`cost.skips_masked_tiles`; the
    rank's two chunks hold ``2cp`` causal ``L``-blocks, the sequence ``2cp·cp``), else
    ``L²·(2cp+1) / (s²/2)`` with ``L = s/2cp``, i.e. ``(2cp+1)/(2cp²)``: ``1/cp`` plus the masked
    halves of the diagonal blocks (0.625 for cp = 2); 1 without CP."""
    if cp <= 1:
        return 1.0
    if skips_masked:
        return 1.0 / cp
    return (2 * cp + 1) / (2.0 * cp * cp)


def cp_link(device: DeviceSpec, gpus_per_node: int, nic_gbytes_per_gpu: float, tp: int,
            cp: int) -> tuple[float, float]:
    """(GB/s, latency s) of a CP group's ring: intra-node when the group's ``tp·cp`` GPUs fill
    whole aligned blocks of a node (``planning/placement.py`` puts the ``cp`` replicas of a
    ``(stage, dp)`` on consecutive ``tp``-GPU blocks; :func:`cost.node_ring_link`), else the
    NIC."""
    if gpus_per_node % (tp * cp) == 0:
        return cost.node_ring_link(device)
    return nic_gbytes_per_gpu, CP_NIC_LATENCY_S


def kv_bytes(model: ModelSpec, micro_batch: int, tp: int, elem_bytes: int) -> float:
    """Bytes of the gathered keys (or values) of one layer and microbatch on one TP rank: the
    whole sequence, ``kv_heads/tp`` heads (at least one)."""
    kv = model.kv_heads * model.head_dim / min(tp, model.kv_heads)
    return float(micro_batch * model.seq_len * kv * elem_bytes)


def scatters_rows(device: DeviceSpec) -> bool:
    """Whether the runtime's CP group on ``device`` reduce-scatters the K/V gradient (every
    backend but gloo; gloo's reduce-scatter is no faster than its all-reduce, measured by
    ``bench/cp_exchange.py``, so the runtime all-reduces there)."""
    return device.backend != "gloo"


def head_groups(model: ModelSpec, tp: int) -> int:
    """Key/value heads of one TP rank (at least one): the runtime's exchanges per layer."""
    return max(1, model.kv_heads // min(tp, model.kv_heads))


def exposed_s(total_s: float, window_s: float, groups: int) -> float:
    """Exposed seconds of ``groups`` equal collectives of ``total_s`` together, run back to
    back beside ``groups`` equal pieces of compute of ``window_s`` together, each piece
    waiting for its collective (a gather) or each collective for its piece (a reduction):
    ``t + (G − 1)·max(0, t − w)`` per piece ``t``, ``w``; all of ``total_s`` with no window."""
    t, w = total_s / groups, window_s / groups
    return t + (groups - 1) * max(0.0, t - w)


def cp_comm_per_layer_s(model: ModelSpec, micro_batch: int, tp: int, cp: int,
                        elem_bytes: int, recompute: str, gbytes_per_s: float,
                        latency_s: float, *, scatter_rows: bool,
                        attention_s: float = 0.0) -> float:
    """Exposed CP communication of one layer and microbatch (module docstring): per head group
    (:func:`head_groups`) one all-gather of its keys and values together, ``2·``:func:`kv_bytes`
    over the groups (two when the layer is re-run, full or attention-free recompute), and one
    reduce-scatter of their gradients, the same size, over ``cp`` ranks (a ring all-gather and
    a ring reduce-scatter move the same ``(cp − 1)/cp`` of the bytes); an all-reduce instead
    without ``scatter_rows`` (:func:`scatters_rows`). ``attention_s``: the forward seconds of
    the rank's attention core (:func:`attention_window_s`; 0 where nothing overlaps), under
    which the gathers run, and under twice it (three times with selective recompute, which
    re-runs the core there) the reductions (:func:`exposed_s`)."""
    if cp <= 1:
        return 0.0
    groups = head_groups(model, tp)
    n = 2 * kv_bytes(model, micro_batch, tp, elem_bytes) / groups
    gather = groups * cost.ring_reduce_scatter_s(n, cp, gbytes_per_s, latency_s)
    rows = groups * (cost.ring_reduce_scatter_s(n, cp, gbytes_per_s, latency_s) if scatter_rows
                     else cost.ring_all_reduce_s(n, cp, gbytes_per_s, latency_s))
    backward = 3.0 if recompute == "selective" else 2.0  # attention passes in the backward
    out = (exposed_s(gather, attention_s, groups)
           + exposed_s(rows, backward * attention_s, groups))
    if recompute == "full":  # the re-run layer gathers again and recomputes the attention
        out += exposed_s(gather, attention_s, groups)
    elif cost.reruns_layer(recompute):  # attention-free: the re-run keeps the attention
        out += gather
    return out


def attention_window_s(model: ModelSpec, micro_batch: int, tp: int, cp: int,
                       device: DeviceSpec, elem_bytes: int = 2) -> float:
    """The share of a CP rank's attention-core forward seconds (the cost model's attention
    term on the rank's :func:`attention_share` of the pairs) that the CP collectives can run
    under: ``cost.dp_overlap_share`` of it (the collectives' kernels and the attention contend
    for the device, as the DP sync and the backward do; none on a CPU, whose gloo
    collectives run on the ranks' own cores); 0 without CP."""
    overlap = cost.dp_overlap_share(device)
    if cp <= 1 or overlap == 0.0:
        return 0.0
    share = attention_share(cp, skips_masked=cost.skips_masked_tiles(device))
    flops = share * cost.attention_core_forward_flops(model, micro_batch * model.seq_len) / tp
    return overlap * flops / (device.matmul_flops(elem_bytes)
                              * cost.attention_efficiency(device, elem_bytes))


def cp_layer_compute_s(model: ModelSpec, micro_batch: int, tp: int, cp: int,
                       device: DeviceSpec, recompute: str, elem_bytes: int = 2,
                       mlp_chunk_tokens: int = 0) -> float:
    """Compute seconds of one layer for one microbatch on one CP×TP rank (no communication):
    :func:`cost.layer_compute_s` on the rank's ``s/cp`` tokens, with the attention term
    raised to the rank's :func:`attention_share` of the whole sequence's causal attention
    (on ``s/cp`` tokens the model counts ``(s/cp)²`` pairs, ``1/cp²`` of ``s²``).
    A device profile's measured layer time (if it matches the full model) is scaled by the
    rank's share of the FLOPs instead. ``mlp_chunk_tokens``: the chunked MLP over the rank's
    tokens (:func:`cost.modelled_layer_s`; a profile's line by
    :func:`cost.mlp_chunk_time_ratio` on them)."""
    chunk = mlp_chunk_tokens
    if cp <= 1:
        return cost.layer_compute_s(model, micro_batch, tp, device, recompute, elem_bytes,
                                    mlp_chunk_tokens=chunk)
    share = attention_share(cp, skips_masked=cost.skips_masked_tiles(device))
    prof = device.profile
    local = cost.cp_local_model(model, cp)
    if prof is not None and prof.matches(model, elem_bytes):
        full = cost.layer_compute_s(model, micro_batch, tp, device, recompute, elem_bytes)
        return (full * _flops_share(model, cp, share)
                * cost.mlp_chunk_time_ratio(local, micro_batch, tp, device, recompute,
                                            elem_bytes, chunk))
    t = cost.layer_compute_s(local, micro_batch, tp, device, recompute, elem_bytes,
                             mlp_chunk_tokens=chunk)
    s_loc = local.seq_len
    # the model's attention term is 4·tokens·s·h per pass (s² pairs counted in full); a CP
    # rank's share of it is share·s², of which (s/cp)² is already in t
    pairs = share * model.seq_len ** 2 - s_loc ** 2
    extra = (cost.attention_passes(recompute) * 4.0 * micro_batch * pairs * model.hidden / tp)
    rate = device.matmul_flops(elem_bytes) * cost.attention_efficiency(device, elem_bytes)
    return t + extra / rate


def _flops_share(model: ModelSpec, cp: int, share: float) -> float:
    """A CP rank's share of a layer's forward FLOPs (GEMMs ``1/cp``, attention ``share``:
    :func:`attention_share`)."""
    gemm = 2.0 * cost.layer_matmul_params(model)
    attn = 4.0 * model.seq_len * model.hidden
    return (gemm / cp + attn * share) / (gemm + attn)


def cp_layer_time_s(model: ModelSpec, training: TrainingSpec, micro_batch: int, tp: int,
                    cp: int, device: DeviceSpec, link: tuple[float, float]) -> float:
    """Seconds of one layer per microbatch on a CP stage: compute, the exposed TP comm of the
    rank's ``s/cp`` tokens and the exposed CP comm over ``link`` (:func:`cp_link`)."""
    eb = cost.precision_bytes(training)
    if cp <= 1:
        return cost.layer_time_s(model, training, micro_batch, tp, device)
    local = cost.cp_local_model(model, cp)
    # eager attention: the rank's share of the materialised scores (every pair of its key
    # prefixes: attention_share without skipped tiles)
    eager = (cost.eager_score_bytes(model, micro_batch, tp, training.recompute, eb)
             * attention_share(cp, skips_masked=False) / (device.hbm_tbps * 1e12)
             if training.attention == "eager" else 0.0)
    return (cp_layer_compute_s(model, micro_batch, tp, cp, device, training.recompute, eb,
                               training.mlp_chunk_tokens)
            + eager
            + cost.tp_comm_per_layer_s(local, micro_batch, tp, device, eb, training.recompute)
            + cp_comm_per_layer_s(model, micro_batch, tp, cp, eb, training.recompute, *link,
                                  scatter_rows=scatters_rows(device),
                                  attention_s=attention_window_s(model, micro_batch, tp, cp,
                                                                 device, eb)))


def cp_head_time_s(model: ModelSpec, micro_batch: int, tp: int, cp: int, device: DeviceSpec,
                   elem_bytes: int = 2, loss_chunk_tokens: int = 0) -> float:
    """The LM head of a CP rank: :func:`cost.head_time_s` on its ``s/cp`` tokens."""
    return cost.head_time_s(cost.cp_local_model(model, cp), micro_batch, tp, device, elem_bytes,
                            loss_chunk_tokens)
