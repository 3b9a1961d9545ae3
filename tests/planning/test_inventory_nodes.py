"""inventory_from_nodes: Kubernetes Node objects (plain dicts) -> pools."""

from __future__ import annotations

from typing import Any

import pytest

from hettrain.api.spec import parse_job_spec
from hettrain.planning.catalog import CATALOG, DeviceSpec
from hettrain.planning.errors import PlanningInputError
from hettrain.planning.inventory import DEFAULT_NIC_GBPS, Link, inventory_from_nodes
from hettrain.planning.planner import plan_job

REGION = "topology.kubernetes.io/region"
ZONE = "topology.kubernetes.io/zone"


def node(name: str, labels: dict[str, str], alloc: dict[str, str], *, ready: str = "True",
         taints: list[dict] | None = None, unschedulable: bool = False) -> dict[str, Any]:
    """A Node as the API server returns it (only the fields the inventory reads, plus noise)."""
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
        "spec": {"taints": taints or [], **({"unschedulable": True} if unschedulable else {})},
        "status": {"allocatable": {"cpu": "96", "memory": "2Ti", **alloc},
                   "conditions": [{"type": "MemoryPressure", "status": "False"},
                                  {"type": "Ready", "status": ready}]},
    }


def h100(name: str, **kw: Any) -> dict[str, Any]:
    labels = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", REGION: "us-east",
              ZONE: "us-east-1a", **kw.pop("labels", {})}
    return node(name, labels, {"nvidia.com/gpu": "8"}, **kw)


def test_vendor_resources_and_product_labels_map_to_catalog_devices() -> None:
    inv = inventory_from_nodes([
        h100("n1"), h100("n2"),
        node("m1", {"amd.com/gpu.product-name": "AMD-Instinct-MI300X", REGION: "eu-west"},
             {"amd.com/gpu": "8"}),
        node("g1", {"hettrain.dev/device": "Gaudi3", REGION: "eu-west"}, {"habana.ai/gaudi": "8"}),
        node("g2", {"habana.ai/device.type": "gaudi2", REGION: "eu-west"},
             {"habana.ai/gaudi": "8"}),
        node("a1", {"huawei.com/npu.product": "Ascend910B", REGION: "cn-north"},
             {"huawei.com/Ascend910": "16"}),
        node("cpu1", {REGION: "us-east"}, {}),  # no accelerator: not a pool
    ])
    by_device = {p.device.name: p for p in inv.pools}
    assert set(by_device) == {"H100-SXM", "MI300X", "Gaudi3", "Gaudi2", "Ascend-910B"}
    h = by_device["H100-SXM"]
    assert (h.nodes, h.gpus_per_node, h.datacenter, h.zone) == (("n1", "n2"), 8, "us-east",
                                                                "us-east-1a")
    assert h.name == "h100-sxm-us-east-us-east-1a"
    assert by_device["MI300X"].vendor == "amd" and by_device["MI300X"].datacenter == "eu-west"
    assert by_device["Gaudi3"].vendor == "intel"
    assert by_device["Ascend-910B"].gpus_per_node == 16
    assert by_device["Ascend-910B"].device is CATALOG["Ascend-910B"]
    assert inv.gpus == 2 * 8 + 8 + 8 + 8 + 16
    assert inv.datacenters == ("cn-north", "eu-west", "us-east")


def test_not_ready_cordoned_and_tainted_nodes_are_excluded() -> None:
    no_sched = [{"key": "maintenance", "effect": "NoSchedule"}]
    inv = inventory_from_nodes([
        h100("ok"),
        h100("notready", ready="False"),
        h100("unknown", ready="Unknown"),
        h100("cordoned", unschedulable=True),
        h100("tainted", taints=no_sched),
        h100("evicting", taints=[{"key": "x", "effect": "NoExecute"}]),
        h100("soft", taints=[{"key": "y", "effect": "PreferNoSchedule"}]),
    ])
    assert inv.node_names() == ("ok", "soft")
    tolerant = inventory_from_nodes([h100("ok"), h100("tainted", taints=no_sched)],
                                    tolerated_taints=["maintenance"])
    assert tolerant.node_names() == ("ok", "tainted")


def test_pool_label_nic_label_and_gpu_count_grouping() -> None:
    inv = inventory_from_nodes([
        h100("a", labels={"hettrain.dev/pool": "train", "hettrain.dev/nic-gbps": "3200"}),
        h100("b", labels={"hettrain.dev/pool": "train", "hettrain.dev/nic-gbps": "1600"}),
        h100("c"),
    ])
    pools = {p.name: p for p in inv.pools}
    assert pools["train"].nodes == ("a", "b")
    assert pools["train"].nic_gbps == 1600  # the slowest node of the pool
    assert pools["h100-sxm-us-east-us-east-1a"].nic_gbps == DEFAULT_NIC_GBPS
    assert pools["train"].nic_gbytes_per_gpu == pytest.approx(1600 / 8 / 8)


def test_unknown_device_is_a_clear_error_unless_declared() -> None:
    weird = node("w1", {"hettrain.dev/device": "Mystery9", REGION: "r"}, {"nvidia.com/gpu": "4"})
    with pytest.raises(PlanningInputError, match=r"node w1.*Mystery9.*catalog.*devices:"):
        inventory_from_nodes([weird])
    custom = DeviceSpec("Mystery9", "nvidia", 500, 96 * 2**30, 3.0, 300, "nccl", 0.4, 25)
    inv = inventory_from_nodes([weird], devices={"Mystery9": custom})
    assert inv.pools[0].device is custom and inv.pools[0].gpus == 4


def test_gpu_node_without_device_label_names_the_label() -> None:
    with pytest.raises(PlanningInputError, match=r"node x1.*hettrain.dev/device"):
        inventory_from_nodes([node("x1", {REGION: "r"}, {"amd.com/gpu": "8"})])


def test_bad_nic_label_names_node_and_label() -> None:
    with pytest.raises(PlanningInputError, match=r"node a label hettrain.dev/nic-gbps.*'fast'"):
        inventory_from_nodes([h100("a", labels={"hettrain.dev/nic-gbps": "fast"})])


def test_inventory_from_nodes_plans_end_to_end() -> None:
    nodes = [h100(f"h{i}") for i in range(2)] + [
        node(f"m{i}", {"amd.com/gpu.product-name": "AMD-Instinct-MI300X", REGION: "eu-west"},
             {"amd.com/gpu": "8"}) for i in range(2)]
    inv = inventory_from_nodes(nodes, links=[Link("us-east", "eu-west", 400, 30)])
    spec = parse_job_spec({"model": {"preset": "llama3-8b"},
                           "training": {"globalBatch": 64, "steps": 1}})
    plan = plan_job("j", spec, inv)
    assert {r.node for r in plan.ranks} <= {n["metadata"]["name"] for n in nodes}
    assert plan.global_batch == 64
    assert sum(s.layers for s in plan.stages) == spec.model.layers
