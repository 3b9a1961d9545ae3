"""``planning/replica_groups.groups_grad_sum_s`` recomputed from its description, for the
replica-group tests: what the runtime's sum between groups costs on its slowest rank."""

from __future__ import annotations

from hettrain.planning import cost
from hettrain.planning.replica_groups import GLOO_RING_GBYTES

ALPHA, STAGING = cost.COLLECTIVE_LATENCY_S, cost.HOST_STAGING_LATENCY_S


def _grad_bytes(model, a: int, b: int, tp: int, first: bool, last: bool) -> float:
    """fp32 bytes of one rank's TP shard of each layer's matmuls, the norms whole, its
    vocabulary rows (embedding first, head last unless tied) and the final norm."""
    tables = first + (last and not model.tie_embeddings)
    return 4 * ((b - a) * (cost.layer_matmul_params(model) / tp + 2 * model.hidden)
                + model.vocab * model.hidden / cost.vocab_shards(model, tp) * tables
                + model.hidden * last)


def _crossings(inv, groups, a: int, b: int) -> list:
    """The datacenter links one holder set of layers ``[a, b)`` crosses: its chunk ring visits
    the groups in order (each at the datacenters of its stages holding any of those layers)
    and closes the loop; a neighbouring pair not both wholly in one datacenter crosses the
    slowest link between them."""
    dcs = [{inv.pool(p).datacenter for lo, hi, _, ps in stages if lo < b and a < hi for p in ps}
           for _, _, stages in groups]
    out = []
    for i, here in enumerate(dcs):
        there = dcs[(i + 1) % len(dcs)]
        links = [inv.link(x, y) for x in here for y in there if x != y]
        if links and (here != there or len(here) > 1):
            out.append(min(links, key=lambda k: k.bandwidth_gbps))
    return out


def _link_s(model, groups, inv) -> float:
    """Seconds of the busiest datacenter link: each of group 0's stages sends ``2(G − 1)/G`` of
    its fp32 gradient bytes (every TP rank) over each link its ring crosses; a link carries
    half of what crosses it each way."""
    _, _, stages = groups[0]
    g = len(groups)
    sent: dict = {}  # bytes per link
    for i, (a, b, tp, _) in enumerate(stages):
        nbytes = tp * _grad_bytes(model, a, b, tp, i == 0, i == len(stages) - 1)
        for link in _crossings(inv, groups, a, b):
            key = frozenset((link.a, link.b))
            sent[key] = sent.get(key, 0.0) + 2 * (g - 1) / g * nbytes
    return max((n / 2 / (inv.link(*key).bandwidth_gbps / 8 * 1e9) for key, n in sent.items()),
               default=0.0)


def grad_sum_s(model, inv, groups) -> float:
    """``groups``: ``(replicas, cp, [(layer start, layer end, tp, pools)])`` per group.

    Per set, inside the rank's DP×CP group of ``d`` (nodes of the stage's slowest pool:
    reduce-scatter / all-reduce / all-gather; between pools at gloo's rate) a reduce-scatter,
    its ``1/d`` slice to the host and back and in gloo rings between the ``G`` groups (the
    rings of all the rank's sets side by side: one ring's latency per rank; one per set for
    a rank alone in its DP×CP group), then an all-gather: one all-reduce's bytes and steps in all
    where the group is in one pool off gloo, else an all-reduce for each; a vocabulary table
    whose holders do not pair: one gloo ring over every holder, PCIe both ways, the broadcast
    once more. A ring step is a round trip; the NIC share is the slowest pool's, at most
    gloo's ring rate. A rank whose rings cross datacenter links (:func:`_crossings`) also
    waits the slowest one's latency on each ring step (as many times as its ring latencies
    above, once more per unpaired table), and the busiest link's transfer time
    (:func:`_link_s`) is added once."""
    holders = [dp * cp for dp, cp, _ in groups]
    n, g = sum(holders), len(groups)
    pools = {p for _, _, stages in groups for *_, ps in stages for p in ps}
    nic = min([inv.pool(p).nic_gbytes_per_gpu for p in pools] + [GLOO_RING_GBYTES]) * 1e9
    cuts = {a for _, _, stages in groups for a, *_ in stages}
    # a table some group keeps whole on each TP rank, beside another TP degree, does not pair
    per_replica = [{tp if model.vocab % tp else 1 for tp in tps}
                   for tps in ([st[0][2] for *_, st in groups], [st[-1][2] for *_, st in groups])]
    unpaired = [len(h) > 1 for h in per_replica]

    def one_ring(nbytes, rings, pcie):
        return (2 * nbytes / pcie + (2 * (n - 1) / n + 1) * nbytes / nic
                + rings * (4 * (n - 1) * ALPHA + STAGING))

    worst = 0.0
    for dp, cp, stages in groups:
        for i, (a, b, tp, ps) in enumerate(stages):
            first, last = i == 0, i == len(stages) - 1
            nbytes = _grad_bytes(model, a, b, tp, first, last)
            rings = 1 + sum(a < c < b for c in cuts)
            pcie = inv.pool(ps[0]).device.pcie_gbps * 1e9
            tables = (first and unpaired[0]) + (
                last and unpaired[1] and not model.tie_embeddings)
            ring = tables * 4 * model.vocab * model.hidden / cost.vocab_shards(model, tp)
            nbytes -= ring
            pool = [inv.pool(p) for p in ps]
            d = dp * cp
            per_node = max(1, min(d, min(p.gpus_per_node for p in pool) // tp))
            nodes = -(-d // per_node)
            intra = min(p.device.intra_node_gbps for p in pool) * 1e9
            link = min(p.nic_gbytes_per_gpu for p in pool) * 1e9
            if len(pool) > 1:  # between pools: gloo on the host
                link = min(link, GLOO_RING_GBYTES * 1e9, pcie)
            inside = 0.0
            if d > 1:
                inside = (rings * (2 * (per_node - 1) + 2 * (nodes - 1)) * ALPHA
                          + nbytes * (2 * (per_node - 1) / per_node / intra
                                      + 2 * (nodes - 1) / nodes / per_node / link))
            chunk = nbytes / d
            flat = len(pool) == 1 and pool[0].device.backend != "gloo"
            # every set's rings between the groups run at once (one ring's latency), or set by
            # set where the rank is alone in its DP×CP group
            rounds = 1 if d > 1 else rings
            sec = ((1 if flat else 2) * inside + 2 * chunk / pcie + 2 * (g - 1) / g * chunk / nic
                   + rounds * (4 * (g - 1) * ALPHA + STAGING))
            if ring:
                sec += one_ring(ring, tables, pcie)
            lat = max((k.latency_ms for k in _crossings(inv, groups, a, b)), default=0) / 1000
            worst = max(worst, sec + (rounds + tables) * 2 * (g - 1) * lat)
    return worst + _link_s(model, groups, inv)
