"""Scenarios: a job on a cluster under a failure/recovery model, and the built-in presets.

Presets (``--scenario``):

- ``llama3-16k`` — the Llama 3 405B setting (Dubey et al. 2024, §3.3): 16,384 H100 in one
  datacenter, the 405B model at sequence length 8,192 and a 2,048-sequence (16M-token) global
  batch (the planner picks DP16×PP64×TP4 with CP 4; the paper ran TP8 CP1), 54 days, the
  default failure model (≈419 unexpected interruptions in 54 days if the job ran all the
  time) and 32 hot spare nodes (1.5 %; Llama 3 ran inside a larger cluster, so replacements
  were at hand).
- ``llama3-16k-nospares`` — the same without spare nodes: a failed node is back only after its
  repair (lognormal, mean 4 h), which is where re-planning on survivors pays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hettrain.api.spec import JobSpec, parse_job_manifest
from hettrain.planning.inventory import ClusterInventory
from hettrain.sim.cluster import Topology, generate_cluster, topology_of
from hettrain.sim.model import (
    HOUR,
    MAX_EXPECTED_EVENTS,
    FailureModel,
    RecoveryModel,
    young_daly_interval,
)


@dataclass(frozen=True, slots=True)
class Scenario:
    """Everything one simulation needs except the seed and the policies."""

    name: str
    job_name: str
    spec: JobSpec
    inventory: ClusterInventory
    failures: FailureModel
    recovery: RecoveryModel
    days: float
    spare_nodes: int = 0  # per pool, hot spares held out of every plan

    @property
    def horizon_s(self) -> float:
        """Simulated wall time in seconds."""
        return self.days * 86400.0

    def topology(self) -> Topology:
        """The cluster's node/rack/DC layout."""
        return topology_of(self.inventory, self.failures.nodes_per_rack, self.spare_nodes)


def llama3_job(global_batch: int = 2048, name: str = "llama3-405b") -> tuple[str, JobSpec]:
    """The Llama 3 405B job (bf16, ZeRO-1, full recompute) as a parsed manifest.

    Full recompute: without sequence parallelism the runtime keeps each layer's norm inputs and
    outputs unsharded, so selective recompute does not fit 405B on 80 GB devices
    (``planning.cost.activation_bytes_per_layer``)."""
    doc: dict[str, Any] = {
        "apiVersion": "hettrain.dev/v1alpha1", "kind": "HetTrainingJob",
        "metadata": {"name": name},
        "spec": {"model": {"preset": "llama3-405b"},
                 "training": {"globalBatch": global_batch, "steps": 100000,
                              "recompute": "full"},
                 "checkpoint": {"uri": "s3://ckpt/llama3-405b"}},
    }
    return parse_job_manifest(doc)


def preset(name: str) -> Scenario:
    """A built-in scenario by name (see the module docstring)."""
    spares = {"llama3-16k": 32, "llama3-16k-nospares": 0}
    if name not in spares:
        from hettrain.sim.model import SimInputError

        raise SimInputError("--scenario", f"unknown scenario {name!r}; choose from "
                                          f"{', '.join(spares)}")
    job_name, spec = llama3_job()
    inv = generate_cluster("16384:H100-SXM", spare_nodes=spares[name])
    return Scenario(name, job_name, spec, inv, FailureModel(), RecoveryModel(), 54.0,
                    spares[name])


def expected_interruption_rate(topo: Topology, model: FailureModel,
                               nodes_used: tuple[int, ...], world_size: int) -> float:
    """Interruptions per second of a job using ``nodes_used`` per pool while it runs."""
    rate = 0.0
    dcs = set()
    for p, used in enumerate(nodes_used):
        if used <= 0:
            continue
        dcs.add(topo.pool_dc[p])
        rate += used * model.node_rate_per_s(topo.pool_device[p], topo.pool_gpus_per_node[p])
        if model.rack_mtbf_h > 0:
            rate += math.ceil(used / topo.nodes_per_rack) / (model.rack_mtbf_h * HOUR)
    if model.dc_mtbf_h > 0:
        rate += len(dcs) / (model.dc_mtbf_h * HOUR)
    if model.software_gpu_mtbf_h > 0:
        rate += world_size / (model.software_gpu_mtbf_h * HOUR)
    return rate


def checkpoint_interval(recovery: RecoveryModel, checkpoint_s: float, rate_per_s: float,
                        horizon_s: float = math.inf) -> tuple[float, str]:
    """(interval seconds, how it was chosen): the configured one or Young–Daly's optimum, the
    latter raised to ``horizon_s / MAX_EXPECTED_EVENTS`` where it would checkpoint more often
    than that over the run (a tiny model's checkpoint takes milliseconds: Young–Daly then asks
    for one every few seconds, 10^8 of them over ten years; near its optimum the lost time is
    flat, ``docs/simulator.md``)."""
    if recovery.checkpoint_interval_s is not None:
        return recovery.checkpoint_interval_s, "configured"
    mtbf = math.inf if rate_per_s <= 0 else 1.0 / rate_per_s
    interval = young_daly_interval(checkpoint_s, mtbf)
    least = horizon_s / MAX_EXPECTED_EVENTS
    if interval < least:
        return least, (f"young-daly {interval:.3g} s, raised to {least:.3g} s: at most "
                       f"{MAX_EXPECTED_EVENTS:,} checkpoints per run")
    return interval, "young-daly"
