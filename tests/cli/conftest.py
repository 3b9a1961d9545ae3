"""Hand-built heterogeneous plans for the render tests (independent of the planner's choices)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from hettrain.api.spec import MODEL_PRESETS, ModelSpec, TrainingSpec
from hettrain.planning.plan import Plan, Prediction, RankPlan, StagePlan

# (device, vendor, backend, pool, datacenter, HBM GiB) per stage.
STAGE_POOLS = [
    ("H100-SXM", "nvidia", "nccl", "h100-east", "us-east", 80.0),
    ("MI300X", "amd", "nccl", "mi300-east", "us-east", 192.0),
    ("Gaudi3", "intel", "gloo", "gaudi-west", "eu-west", 128.0),
    ("Ascend910B", "huawei", "hccl", "ascend-west", "eu-west", 64.0),
]


def build_plan(pp: int = 3, dp: int = 2, microbatches: int = 4, schedule: str = "1f1b",
               tps: Sequence[int] = (8, 4, 8, 2), gpus_per_node: int = 8,
               virtual_stages: int = 1, stage_times: Sequence[float] | None = None) -> Plan:
    """A plan whose stage ``s`` runs on ``STAGE_POOLS[s % 4]``; ranks packed onto nodes of
    ``gpus_per_node`` GPUs, node names ``<pool>-<index:03d>`` as in the cluster contract."""
    preset = MODEL_PRESETS["llama3-8b"]
    model = ModelSpec(name="llama3-8b", ffn_hidden=preset["ffn_hidden"],
                      **{k: v for k, v in preset.items() if k != "ffn_hidden"})
    bounds = [round(i * model.layers / pp) for i in range(pp + 1)]
    stages, ranks = [], []
    next_rank = 0
    used_on_pool: dict[str, int] = {}
    for s in range(pp):
        device, vendor, backend, pool, dc, hbm = STAGE_POOLS[s % len(STAGE_POOLS)]
        tp = tps[s % len(tps)]
        time_ms = stage_times[s] if stage_times else 30.0 + 7.0 * s
        stages.append(StagePlan(
            index=s, device=device, vendor=vendor, backend=backend, pools=(pool,),
            datacenters=(dc,), layer_start=bounds[s], layer_end=bounds[s + 1], tp=tp,
            memory_gib=0.6 * hbm, capacity_gib=hbm, time_ms=time_ms,
            has_embedding=s == 0, has_head=s == pp - 1,
        ))
        for d in range(dp):
            for t in range(tp):
                slot = used_on_pool.get(pool, 0)
                used_on_pool[pool] = slot + 1
                node_index, local = divmod(slot, gpus_per_node)
                ranks.append(RankPlan(rank=next_rank, node=f"{pool}-{node_index:03d}", pool=pool,
                                      datacenter=dc, local_rank=local, stage=s, dp=d, tp=t))
                next_rank += 1
    training = TrainingSpec(global_batch=dp * microbatches, steps=10, micro_batch=1)
    return Plan(
        job="hetero", model=model, training=training, dp=dp, pp=pp, micro_batch=1,
        num_microbatches=microbatches, schedule=schedule, stages=tuple(stages),
        ranks=tuple(ranks), virtual_stages=virtual_stages,
        predicted=Prediction(step_time_s=1.25, tokens_per_s=52428.8, mfu=0.41, compute_s=0.9,
                             bubble_s=0.2, tp_comm_s=0.05, pp_comm_s=0.04, dp_comm_s=0.06,
                             cross_dc_bytes_per_step=3.5 * 2**30),
        cross_dc={"mode": "sync"}, data={"synthetic": True},
        notes=("stage 1 on MI300X gets more layers: 192 GiB HBM",
               "rejected pp=2: stage memory 91 GiB > 80 GiB on H100-SXM"),
    )


@pytest.fixture
def make_plan() -> Callable[..., Plan]:
    """Factory fixture: ``make_plan(pp=..., dp=..., microbatches=..., schedule=...)``."""
    return build_plan
