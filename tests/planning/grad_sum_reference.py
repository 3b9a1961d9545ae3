"""``planning/replica_groups.groups_grad_sum_s`` recomputed from its description, for the
replica-group tests: what the runtime's sum between groups costs on its slowest rank."""

from __future__ import annotations

from hettrain.planning import cost
from hettrain.planning.replica_groups import GLOO_RING_GBYTES


def grad_sum_s(model, inv, groups) -> float:
    """``groups``: ``(replicas, cp, [(layer start, layer end, tp, pools)])`` per group. Each
    rank copies its fp32 gradients (its TP shard of each layer's matmuls, the norms whole, its
    vocabulary rows, the final norm) to the host and back and sums them in gloo rings over one
    holder per replica and CP rank of every group, at the slowest pool's NIC share (at most
    gloo's ring rate), a round trip per ring step, one ring per run of layers shared with the
    same stages of the other groups; across datacenters the local broadcast once more."""
    holders = sum(dp * cp for dp, cp, _ in groups)
    pools = {p for _, _, stages in groups for *_, ps in stages for p in ps}
    nic = min([inv.pool(p).nic_gbytes_per_gpu for p in pools] + [GLOO_RING_GBYTES]) * 1e9
    spans_dcs = len({inv.pool(p).datacenter for p in pools}) > 1
    cuts = {a for _, _, stages in groups for a, *_ in stages}
    worst = 0.0
    for _, _, stages in groups:
        for i, (a, b, tp, ps) in enumerate(stages):
            first, last = i == 0, i == len(stages) - 1
            tables = first + (last and not model.tie_embeddings)
            params = ((b - a) * (cost.layer_matmul_params(model) / tp + 2 * model.hidden)
                      + model.vocab * model.hidden / cost.vocab_shards(model, tp) * tables
                      + model.hidden * last)
            nbytes = 4 * params
            rings = 1 + sum(a < c < b for c in cuts)
            share = 2 * (holders - 1) / holders + spans_dcs
            worst = max(worst, 2 * nbytes / (inv.pool(ps[0]).device.pcie_gbps * 1e9)
                        + share * nbytes / nic
                        + rings * (4 * (holders - 1) * cost.COLLECTIVE_LATENCY_S
                                   + cost.HOST_STAGING_LATENCY_S))
    return worst
