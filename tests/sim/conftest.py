"""Shared small jobs and clusters for the simulator tests (real planner, small sizes)."""

from __future__ import annotations

import pytest

from hettrain.api.spec import JobSpec, parse_job_manifest
from hettrain.sim.capacity import CapacityOracle
from hettrain.sim.cluster import generate_cluster, topology_of


def small_job(global_batch: int = 64) -> tuple[str, JobSpec]:
    """Llama 3 8B with a small global batch: plans in ~10 ms on a few H100 nodes."""
    return parse_job_manifest({
        "apiVersion": "hettrain.dev/v1alpha1", "kind": "HetTrainingJob",
        "metadata": {"name": "j"},
        "spec": {"model": {"preset": "llama3-8b"},
                 "training": {"globalBatch": global_batch, "steps": 10}},
    })


def oracle_for(generate: str, nodes_per_rack: int = 2, spare_nodes: int = 0,
               global_batch: int = 64) -> CapacityOracle:
    """A fresh memoised oracle for the small job on a generated cluster."""
    name, spec = small_job(global_batch)
    inv = generate_cluster(generate, spare_nodes=spare_nodes)
    return CapacityOracle(name, spec, topology_of(inv, nodes_per_rack, spare_nodes))


@pytest.fixture
def eight_nodes() -> CapacityOracle:
    """64 H100 in 8 nodes, 2 nodes per rack, no spares."""
    return oracle_for("64:H100-SXM")
