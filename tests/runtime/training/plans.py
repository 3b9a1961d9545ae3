"""Hand-built tiny plans for runtime tests (layouts the planner could produce)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from hettrain.api.spec import ModelSpec, TrainingSpec
from hettrain.planning.plan import Plan, Prediction, RankPlan, ReplicaGroup, StagePlan

BACKEND = {"cpu": "gloo", "nvidia": "nccl", "amd": "nccl", "intel": "hccl", "huawei": "hccl"}
TINY = ModelSpec(layers=4, hidden=32, heads=4, seq_len=32, vocab=256, ffn_hidden=128,
                 kv_heads=2, name="gpt-tiny-test")


def tiny_plan(splits: list[tuple[int, int, str]], dp: int, *, steps: int = 10,
              micro_batch: int = 2, num_microbatches: int = 4, schedule: str = "1f1b",
              model: ModelSpec = TINY, lr: float = 3e-3, tp: int | Sequence[int] = 1,
              replica_dcs: Sequence[str] | None = None, cross_dc: dict | None = None,
              vendors: Sequence[str] | None = None, **training) -> Plan:
    """``splits`` = [(layer_start, layer_end, pool)] per stage; each stage has ``dp`` replicas
    of ``tp`` ranks (an int, or one degree per stage).

    ``replica_dcs[d]`` puts replica ``d`` in that datacenter (pool ``{pool}-{dc}``); by default
    everything is in ``dc1``. ``cross_dc`` is the plan's cross-DC section (mode, compression,
    outer_steps, outer_lr, outer_momentum). ``vendors[s]`` is stage ``s``'s vendor (default
    ``cpu``), with its catalog backend (nccl for nvidia/amd, hccl for intel/huawei).
    ``training`` overrides TrainingSpec fields (fp32, ZeRO-1 on unless DiLoCo, by default).
    """
    tps = [tp] * len(splits) if isinstance(tp, int) else list(tp)
    dcs = list(replica_dcs or ["dc1"] * dp)
    multi_dc = len(set(dcs)) > 1
    stages, ranks = [], []
    for s, (a, b, pool) in enumerate(splits):
        pools = [f"{pool}-{dc}" if multi_dc else pool for dc in dcs]
        vendor = vendors[s] if vendors else "cpu"
        stages.append(StagePlan(index=s, device="cpu", vendor=vendor, backend=BACKEND[vendor],
                                pools=tuple(dict.fromkeys(pools)),
                                datacenters=tuple(dict.fromkeys(dcs)), layer_start=a,
                                layer_end=b, tp=tps[s], memory_gib=0.1, capacity_gib=1.0,
                                time_ms=1.0, has_embedding=s == 0,
                                has_head=s == len(splits) - 1))
        for d in range(dp):
            for t in range(tps[s]):
                ranks.append(RankPlan(rank=len(ranks), node=f"{pools[d]}-s{s}-n{d}",
                                      pool=pools[d], datacenter=dcs[d], local_rank=t,
                                      stage=s, dp=d, tp=t))
    gb = dp * micro_batch * num_microbatches
    return Plan(job="rt-test", model=model,
                training=TrainingSpec(**{
                    "global_batch": gb, "steps": steps, "micro_batch": micro_batch,
                    "precision": "fp32", "learning_rate": lr, "seed": 3,
                    "optimizer_sharding": (cross_dc or {}).get("mode") != "diloco",
                    **training}),
                dp=dp, pp=len(splits), micro_batch=micro_batch,
                num_microbatches=num_microbatches, schedule=schedule, stages=tuple(stages),
                ranks=tuple(ranks), predicted=Prediction(step_time_s=1, tokens_per_s=1, mfu=0),
                data={"synthetic": True},
                cross_dc=dict(cross_dc or {}))


def with_cp(plan: Plan, cp: int) -> Plan:
    """``plan`` with context parallelism ``cp`` on every stage: each rank of the plan is
    replaced by ``cp`` consecutive ranks (CP index 0..cp-1) on the same node."""
    if cp == 1:
        return plan
    ranks = []
    for r in plan.ranks:
        for c in range(cp):
            ranks.append(replace(r, rank=len(ranks), cp=c, local_rank=r.local_rank * cp + c))
    stages = tuple(replace(s, cp=cp) for s in plan.stages)
    return replace(plan, ranks=tuple(ranks), stages=stages)


def grouped_plan(groups: Sequence[dict], *, steps: int = 6, micro_batch: int = 2,
                 model: ModelSpec = TINY, lr: float = 3e-3, **training) -> Plan:
    """A plan of heterogeneous replica groups. Each ``groups[i]`` is a dict with ``splits``
    ``[(layer_start, layer_end, pool)]``, ``dp`` (default 1), ``num_microbatches`` (default
    2), ``tp`` (default 1; an int or one per stage), ``cp`` (default 1: :func:`with_cp`),
    ``short`` (default 0: the group's last replicas that run one microbatch fewer) and ``dc``
    (default ``dc1``). Ranks are numbered group by group; the global batch is the sum
    of the groups' shares."""
    built, ranks = [], []
    for gi, spec in enumerate(groups):
        one = tiny_plan(spec["splits"], spec.get("dp", 1), steps=steps, micro_batch=micro_batch,
                        num_microbatches=spec.get("num_microbatches", 2), model=model,
                        lr=lr, tp=spec.get("tp", 1))
        one = with_cp(one, spec.get("cp", 1))
        dc = spec.get("dc", "dc1")
        stages = tuple(replace(s, datacenters=(dc,)) for s in one.stages)
        built.append(ReplicaGroup(index=gi, dp=one.dp, pp=one.pp,
                                  num_microbatches=one.num_microbatches, stages=stages,
                                  short_replicas=spec.get("short", 0)))
        for r in one.ranks:
            ranks.append(replace(r, rank=len(ranks), group=gi, node=f"g{gi}-{r.node}",
                                 datacenter=dc))
    gb = micro_batch * sum(g.microbatches for g in built)
    g0 = built[0]
    return Plan(job="rt-test", model=model,
                training=TrainingSpec(**{
                    "global_batch": gb, "steps": steps, "micro_batch": micro_batch,
                    "precision": "fp32", "learning_rate": lr, "seed": 3,
                    "optimizer_sharding": True, **training}),
                dp=g0.dp, pp=g0.pp, micro_batch=micro_batch,
                num_microbatches=g0.num_microbatches, schedule="1f1b", stages=g0.stages,
                ranks=tuple(ranks), predicted=Prediction(step_time_s=1, tokens_per_s=1, mfu=0),
                data={"synthetic": True}, groups=tuple(built))


def single_pool_cluster(device: str, nodes: int) -> dict:
    """A cluster document: one pool of ``nodes`` nodes with 8 ``device`` GPUs each."""
    return {"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster", "metadata": {"name": "x"},
            "datacenters": [{"name": "a"}],
            "pools": [{"name": "p", "datacenter": "a", "device": device, "nodes": nodes,
                       "gpusPerNode": 8}]}
