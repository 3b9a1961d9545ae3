"""Per-rank scenarios run in spawned gloo worlds by the collectives tests (return plain data)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from collective_harness import make_plan

from hettrain.runtime.collectives import (
    DiLoCo,
    HetCommunicator,
    LinkModel,
    Tier,
    bridged_all_reduce_,
    choose_algorithm,
    hierarchical_all_reduce_,
    leader_all_reduce_,
    link_model,
)

SIZES = (1, 7, 1001)  # odd lengths, not divisible by any group size used


def _ref(t: torch.Tensor, group=None) -> torch.Tensor:
    r = t.clone()
    dist.all_reduce(r, group=group)
    return r


def _algo_checks(comm: HetCommunicator, rank: int, scope: str = "global") -> dict:
    """Integer-valued fp32 (exact in any order) and random floats (rtol 1e-6), all algorithms."""
    out = {}
    g = torch.Generator().manual_seed(100 + rank)
    ref_group = comm._levels[scope].full
    for n in SIZES:
        ints = torch.randint(-50, 50, (n,), generator=g).float()
        ref = _ref(ints, ref_group)
        for algo in ("flat", "hierarchical", "leader", "auto"):
            comm.algorithm = algo
            t = ints.clone()
            comm.dp_all_reduce_([t], average=False, scope=scope)
            out[("int", n, algo)] = torch.equal(t, ref)
    a = torch.randn(3, 5, generator=g)
    b = torch.randn(11, generator=g)
    ra, rb = _ref(a, ref_group), _ref(b, ref_group)
    size = dist.get_world_size(ref_group)
    for algo in ("flat", "hierarchical", "leader"):
        comm.algorithm = algo
        x, y = a.clone(), b.clone()
        comm.dp_all_reduce_([x, y], average=True, scope=scope)
        out[("float", algo)] = bool(torch.allclose(x, ra / size, rtol=1e-6, atol=1e-6)
                                    and torch.allclose(y, rb / size, rtol=1e-6, atol=1e-6))
    comm.algorithm = "auto"
    return out


def two_pools_two_dcs(rank: int, world: int) -> dict:
    """2 pools x 2 ranks, one pool per DC: algorithms, explicit groups, bridge, stats, DiLoCo."""
    plan = make_plan([{"tp": 1, "pools": [("pa", "dc1", "nvidia", 2),
                                          ("pb", "dc2", "amd", 2)]}], dp=4)
    comm = HetCommunicator.from_plan(plan, rank, chunk_bytes=64)  # tiny chunks: many in flight
    out = _algo_checks(comm, rank)
    out.update({("dc", *k): v for k, v in _algo_checks(comm, rank, scope="dc").items()})
    out["tiers"] = {t.value: s.bytes for t, s in comm.stats.items()}

    # explicit groups, as the bench uses them
    intra_a, intra_b = dist.new_group([0, 1]), dist.new_group([2, 3])
    inter_0, inter_1 = dist.new_group([0, 2]), dist.new_group([1, 3])
    intra = intra_a if rank < 2 else intra_b
    inter = inter_0 if rank % 2 == 0 else inter_1
    x = torch.arange(1001, dtype=torch.float32) * (rank + 1)
    ref = _ref(x)
    h = x.clone()
    hierarchical_all_reduce_(h, intra, inter)
    lead = x.clone()
    leader_all_reduce_(lead, intra, inter_0 if rank % 2 == 0 else None,
                       leader=0 if rank < 2 else 2)
    br = x.clone()
    chunks = bridged_all_reduce_(br, dist.group.WORLD, chunk_bytes=4 * 100)
    out["explicit"] = (torch.equal(h, ref), torch.equal(lead, ref), torch.equal(br, ref), chunks)
    # exchange (all-gather + fixed-order sum) on a 2-member group: random floats, odd length,
    # 24-byte chunks; equals dist.all_reduce bit for bit (a + b is commutative in IEEE)
    f = torch.randn(1001, generator=torch.Generator().manual_seed(rank))
    ex = f.clone()
    bridged_all_reduce_(ex, inter, chunk_bytes=24, exchange=True)
    try:
        bridged_all_reduce_(f.clone(), dist.group.WORLD, exchange=True)
        refused = False
    except ValueError:
        refused = True
    out["exchange"] = (torch.equal(ex, _ref(f, inter)), refused)
    # pipelined: 1001 floats in pieces of 16 (64 bytes), padded last piece; async default inter
    # op and a synchronous one (returns an int, no handle)
    hp, hs = x.clone(), x.clone()
    hierarchical_all_reduce_(hp, intra, inter, pipeline_bytes=64)
    hierarchical_all_reduce_(hs, intra, inter, pipeline_bytes=64,
                             inter_op=lambda b, g: bridged_all_reduce_(b, g, chunk_bytes=24))
    out["pipelined"] = (torch.equal(hp, ref), torch.equal(hs, ref))

    # a communicator whose hierarchical path runs as a pipeline of 40-byte pieces
    pcomm = HetCommunicator.from_plan(plan, rank, chunk_bytes=64, pipeline_bytes=40)
    out.update({("pipe", *k): v for k, v in _algo_checks(pcomm, rank).items()})
    pcomm.stats.reset()
    pcomm.algorithm = "hierarchical"
    pcomm.dp_all_reduce_([torch.ones(1000)], average=False)
    st = pcomm.stats
    out["pipe_stats"] = (st[Tier.CROSS_DC].bytes, st[Tier.INTRA_POOL].bytes,
                         st[Tier.CROSS_DC].seconds >= 0, st[Tier.INTRA_POOL].seconds >= 0)
    # auto follows the plan's link model; a one-host override makes it flat (and still exact)
    pcomm.algorithm = "auto"
    hier = pcomm._levels["global"].hier
    picks = {}
    for nbytes in (4 << 10, 64 << 20):
        picks[nbytes] = (pcomm.choose(nbytes),
                         choose_algorithm(nbytes, hier, link_model(plan, hier), 40))
    y = torch.randint(-9, 9, (2048,), generator=torch.Generator().manual_seed(rank)).float()
    picks["used"] = (pcomm.dp_all_reduce_([y.clone()], average=False), pcomm.choose(8192))
    hcomm = HetCommunicator.from_plan(plan, rank, link=LinkModel(one_host=True))
    z = y.clone()
    picks["one_host"] = (hcomm.dp_all_reduce_([z], average=False), torch.equal(z, _ref(y)))
    out["picks"] = picks

    # DiLoCo with H=1, outer_lr=1, momentum 0 == plain synchronous data parallel (exact)
    torch.manual_seed(0)
    p_sync = torch.nn.Parameter(torch.randint(-8, 8, (13,)).float())
    p_dl = torch.nn.Parameter(p_sync.detach().clone())
    dl = DiLoCo([p_dl], comm, outer_steps=1, outer_lr=1.0, outer_momentum=0.0)
    lr = 0.5
    exact = True
    for step in range(5):
        grad = torch.randint(-16, 16, (13,), generator=torch.Generator().manual_seed(
            step * 10 + rank)).float()
        gs = grad.clone()
        comm.dp_all_reduce_([gs], average=True)
        with torch.no_grad():
            p_sync -= lr * gs
        p_dl.grad = grad.clone()
        dl.sync_gradients()
        with torch.no_grad():
            p_dl -= lr * p_dl.grad
        dl.step(step)
        exact = exact and torch.equal(p_dl.detach(), p_sync.detach())
    out["diloco_exact"] = exact

    # H=3 with momentum: replicas agree after every outer sync, and only then cross DCs
    comm.stats.reset()
    p = torch.nn.Parameter(torch.zeros(9))
    dl = DiLoCo([p], comm, outer_steps=3, outer_lr=0.7, outer_momentum=0.9)
    synced = []
    for step in range(6):
        p.grad = torch.full((9,), float(rank + step))
        dl.sync_gradients()
        with torch.no_grad():
            p -= 0.1 * p.grad
        synced.append(dl.step(step))
    gathered = [torch.empty(9) for _ in range(world)]
    dist.all_gather(gathered, p.detach())
    out["diloco_synced"] = synced
    out["diloco_agree"] = all(torch.equal(gathered[0], q) for q in gathered)
    out["diloco_cross_ops"] = comm.stats[Tier.CROSS_DC].ops

    # compressed cross-DC hop (int8, error feedback): close to exact, fewer cross-DC bytes
    cplan = make_plan([{"tp": 1, "pools": [("pa", "dc1", "nvidia", 2),
                                           ("pb", "dc2", "amd", 2)]}], dp=4,
                      cross_dc={"mode": "compress", "compression": "int8"})
    ccomm = HetCommunicator.from_plan(cplan, rank)
    v = torch.randn(5000, generator=torch.Generator().manual_seed(rank))
    ref = _ref(v)
    c = v.clone()
    ccomm.algorithm = "hierarchical"
    ccomm.dp_all_reduce_([c], average=False)
    comm.stats.reset()
    comm.algorithm = "hierarchical"
    comm.dp_all_reduce_([v.clone()], average=False)
    out["compress_rel_err"] = float((c - ref).norm() / ref.norm())
    out["compress_bytes"] = (ccomm.stats[Tier.CROSS_DC].bytes, comm.stats[Tier.CROSS_DC].bytes)
    return out


def uneven_pools(rank: int, world: int) -> dict:
    """3 pools of sizes 1/2/3 over two DCs (pools p1, p2 in dc1; p3 in dc2)."""
    plan = make_plan([{"tp": 1, "pools": [("p1", "dc1", "nvidia", 1), ("p2", "dc1", "nvidia", 2),
                                          ("p3", "dc2", "nvidia", 3)]}], dp=6)
    comm = HetCommunicator.from_plan(plan, rank, chunk_bytes=128)
    out = _algo_checks(comm, rank)
    out.update({("dc", *k): v for k, v in _algo_checks(comm, rank, scope="dc").items()})
    x = torch.randint(-9, 9, (1001,), generator=torch.Generator().manual_seed(rank)).float()
    ref = _ref(x)
    y = x.clone()
    comm.cross_dc_all_reduce_([y], average=False)
    out["cross_dc_exact"] = torch.equal(y, ref)
    out["shards"] = comm._levels["global"].hier.shards
    return out


def pipeline_p2p(rank: int, world: int) -> dict:
    """pp=2, tp=2, stages on pools of different vendors: TP group and host-staged p2p."""
    plan = make_plan([{"tp": 2, "pools": [("nv", "dc1", "nvidia", 1)]},
                      {"tp": 2, "pools": [("ga", "dc1", "intel", 1)]}], dp=1)
    comm = HetCommunicator.from_plan(plan, rank)
    me = plan.ranks[rank]
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=comm.tp_group)
    out = {"tp_sum": t.tolist(), "stage": me.stage}
    if me.stage == 0:
        act = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * rank
        comm.send_activation(act, to_stage=1)
        grad = comm.recv_activation((3, 4), torch.float32, from_stage=1)
        out["grad"] = grad.tolist()
    else:
        act = comm.recv_activation((3, 4), torch.float32, from_stage=0)
        out["act"] = act.tolist()
        comm.send_activation(act * -1, to_stage=0)
    out["tiers"] = {k.value: v.bytes for k, v in comm.stats.items()}
    return out
