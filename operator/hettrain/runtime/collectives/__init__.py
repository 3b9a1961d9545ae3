"""Heterogeneous collective layer: groups from a Plan, hierarchical DP all-reduce, bridges.

Contract (the trainer relies on it; change only together with ``hettrain.runtime.trainer``)::

    from hettrain.runtime.collectives import HetCommunicator, Tier, DiLoCo
    comm = HetCommunicator.from_plan(plan, rank, device=torch.device("cpu"),
                                     backend_overrides=None,   # {pool | "*": backend}
                                     link=None,                # LinkModel; None: from the plan
                                     pipeline_bytes=8 << 20)   # hierarchical piece cap (None: 1)
        # needs dist.init_process_group(...) first (world group: gloo). Collective: creates, in
        # the same order on all ranks, one group per pool (pool backend: nccl/hccl when usable
        # here, else gloo), per stage-DP group its per-pool blocks and shard-owner bridge groups
        # (gloo, host-staged), the per-DC and by-DC variants, and the TP groups.
    comm.dp_all_reduce_(tensors, average=True, scope="global")  # -> algorithm used
        # flat | hierarchical (RS→AR→AG, pipelined) | leader, chosen by a latency-bandwidth model
        # of message size and link speeds (flat when the group is on one host;
        # comm.choose(nbytes, scope) tells; comm.algorithm forces one);
        # the cross-DC hop is compressed (bf16/int8, error feedback) when plan.cross_dc mode is
        # "compress". scope="dc": only this rank's datacenter.
    comm.cross_dc_all_reduce_(tensors, average=True, compress=False)   # DiLoCo outer step
    comm.send_activation(t, to_stage); comm.recv_activation(shape, dtype, from_stage)
    comm.tp_group, comm.dp_group, comm.pool_group     # ProcessGroup or None
    comm.stats[Tier.CROSS_DC].bytes / .seconds        # per Tier: INTRA_POOL, INTER_POOL, CROSS_DC
    dl = DiLoCo(params, comm, outer_steps=H, outer_lr=0.7, outer_momentum=0.9)
    dl.sync_gradients()   # after backward: DC-local gradient average
    dl.step(inner_step)   # after optimizer.step(): every H steps, outer Nesterov SGD across DCs

Lower level, on explicit groups: ``hierarchical_all_reduce_``, ``leader_all_reduce_``,
``flat_all_reduce_`` (= ``dist.all_reduce``), ``bridged_all_reduce_`` (and ``_async``),
``compressed_all_reduce_``; the model: ``LinkModel``, ``estimate_seconds``, ``choose_algorithm``.
"""

from hettrain.runtime.collectives.bridge import (
    BridgeWork,
    bridged_all_reduce_,
    bridged_all_reduce_async,
    compressed_all_reduce_,
)
from hettrain.runtime.collectives.choice import LinkModel, estimate_seconds
from hettrain.runtime.collectives.communicator import (
    HetCommunicator,
    choose_algorithm,
    link_model,
)
from hettrain.runtime.collectives.compression import Codec, ErrorFeedback
from hettrain.runtime.collectives.diloco import DiLoCo
from hettrain.runtime.collectives.hierarchical import (
    flat_all_reduce_,
    hierarchical_all_reduce_,
    leader_all_reduce_,
)
from hettrain.runtime.collectives.stats import CommStats, Tier, tier_of
from hettrain.runtime.collectives.topology import Hierarchy, layout, peer_rank

__all__ = [
    "BridgeWork", "Codec", "CommStats", "DiLoCo", "ErrorFeedback", "HetCommunicator", "Hierarchy",
    "LinkModel", "Tier", "bridged_all_reduce_", "bridged_all_reduce_async", "choose_algorithm",
    "compressed_all_reduce_", "estimate_seconds", "flat_all_reduce_", "hierarchical_all_reduce_",
    "layout", "leader_all_reduce_", "link_model", "peer_rank", "tier_of",
]
