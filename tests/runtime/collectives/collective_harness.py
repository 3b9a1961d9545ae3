"""Helpers for the collectives tests: Plans built from dataclasses, and real gloo worlds."""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any

import torch.multiprocessing as mp

from hettrain.api.spec import ModelSpec, TrainingSpec
from hettrain.planning.plan import Plan, Prediction, RankPlan, StagePlan

MODEL = ModelSpec(layers=8, hidden=64, heads=4, seq_len=32, vocab=128, ffn_hidden=256,
                  kv_heads=4)


def make_plan(stages: list[dict[str, Any]], dp: int, cross_dc: dict | None = None) -> Plan:
    """Plan from per-stage dicts: ``{"tp": int, "pools": [(pool, dc, vendor, replicas)]}``.

    Ranks are numbered stage by stage, pool by pool, replica by replica, tp fastest.
    """
    stage_plans, ranks = [], []
    per = MODEL.layers // len(stages)
    for s, st in enumerate(stages):
        pools = st["pools"]
        if sum(p[3] for p in pools) != dp:
            raise ValueError(f"stage {s}: replicas must sum to dp={dp}")
        stage_plans.append(StagePlan(
            index=s, device="dev-" + pools[0][2], vendor=pools[0][2],
            backend="nccl" if pools[0][2] in ("nvidia", "amd") else "gloo",
            pools=tuple(p[0] for p in pools), datacenters=tuple(dict.fromkeys(p[1] for p in pools)),
            layer_start=s * per, layer_end=(s + 1) * per, tp=st["tp"], memory_gib=1.0,
            capacity_gib=80.0, time_ms=1.0, has_embedding=s == 0, has_head=s == len(stages) - 1))
        d = 0
        for pool, dc, _vendor, replicas in pools:
            for _ in range(replicas):
                for t in range(st["tp"]):
                    ranks.append(RankPlan(rank=len(ranks), node=f"{pool}-{d:03d}", pool=pool,
                                          datacenter=dc, local_rank=t, stage=s, dp=d, tp=t))
                d += 1
    return Plan(job="t", model=MODEL, training=TrainingSpec(global_batch=dp, steps=1), dp=dp,
                pp=len(stages), micro_batch=1, num_microbatches=1, schedule="1f1b",
                stages=tuple(stage_plans), ranks=tuple(ranks),
                predicted=Prediction(step_time_s=1.0, tokens_per_s=1.0, mfu=0.1),
                cross_dc=cross_dc or {"mode": "sync"}, data={"synthetic": True})


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, queue) -> None:
    import torch.distributed as dist
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        queue.put((rank, fn(rank, world, *args), None))
        dist.barrier()  # rank 0 serves the TCP store: no rank tears down while another works
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


def run_world(world: int, fn, *args, timeout: float = 90.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned gloo processes; results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            rank, value, err = queue.get(timeout=timeout)
            if err:
                errors.append(f"rank {rank}:\n{err}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
