"""Device choice per rank (vendor -> torch device kind, CPU fallback, errors naming the env) and
the process-group bookkeeping that lets ranks on different vendors' hosts agree on groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hettrain.runtime.collectives import communicator
from hettrain.runtime.config import RuntimeConfig
from hettrain.runtime.devices import (
    ENV_DEVICE,
    VENDOR_KIND,
    count_devices,
    select_device,
)


def probe_of(**counts: int):
    """A device probe that sees ``counts[kind]`` devices of each kind and records the asks."""
    asked: list[str] = []

    def probe(kind: str) -> int:
        asked.append(kind)
        return counts.get(kind, 0)

    probe.asked = asked
    return probe


@pytest.mark.parametrize(("vendor", "kind"), [("nvidia", "cuda"), ("amd", "cuda"),
                                              ("intel", "hpu"), ("huawei", "npu")])
def test_each_vendor_gets_its_kind_and_the_process_index(vendor, kind):
    choice = select_device(vendor, 3, "auto", probe_of(**{kind: 8}))
    assert (choice.kind, choice.index) == (kind, 3)
    if kind != "npu":  # torch knows "npu" only once torch_npu (not installed here) is imported
        assert choice.device == torch.device(kind, 3)
    assert choice.accelerated
    assert f"{kind}:3 of 8" in choice.reason


def test_auto_falls_back_to_cpu_without_devices_and_says_why():
    probe = probe_of()
    choice = select_device("nvidia", 0, "auto", probe)
    assert choice.device == torch.device("cpu") and not choice.accelerated
    assert choice.index is None
    assert "no cuda device" in choice.reason and "CPU fallback" in choice.reason
    assert probe.asked == ["cuda"]


def test_cpu_pools_and_forced_cpu_never_probe():
    probe = probe_of(cuda=8)
    assert select_device("cpu", 0, "auto", probe).device.type == "cpu"
    assert select_device("nvidia", 0, "cpu", probe).device.type == "cpu"
    assert probe.asked == []


def test_forced_kind_without_devices_is_an_error_naming_the_variable():
    with pytest.raises(ValueError, match=rf"{ENV_DEVICE}=cuda: no cuda device.*=auto or cpu"):
        select_device("nvidia", 0, "cuda", probe_of())
    with pytest.raises(ValueError, match=rf"{ENV_DEVICE}=npu.*torch_npu"):
        select_device("huawei", 0, "npu", probe_of())


def test_forced_kind_overrides_the_vendor():
    assert select_device("cpu", 1, "cuda", probe_of(cuda=2)).device == torch.device("cuda", 1)


def test_more_processes_than_devices_is_an_error_not_a_shared_device():
    with pytest.raises(ValueError, match="process 2 of this pod has no cuda device: the pod "
                                         "sees 2; LOCAL_WORLD_SIZE"):
        select_device("nvidia", 2, "auto", probe_of(cuda=2))


def test_bad_values_are_rejected():
    with pytest.raises(ValueError, match=rf"{ENV_DEVICE}='gpu': must be one of"):
        select_device("nvidia", 0, "gpu", probe_of())
    with pytest.raises(ValueError, match="RANK below HETTRAIN_RANK_START"):
        select_device("nvidia", -1, "auto", probe_of())


def test_real_probe_on_this_host():
    """No Gaudi/Ascend plugin is installed here; the CUDA count is whatever torch reports."""
    assert count_devices("hpu") == 0
    assert count_devices("npu") == 0
    assert count_devices("cuda") == (torch.cuda.device_count()
                                     if torch.cuda.is_available() else 0)
    with pytest.raises(ValueError, match="unknown device kind 'xpu'"):
        count_devices("xpu")
    assert set(VENDOR_KIND) == {"nvidia", "amd", "intel", "huawei"}


def test_runtime_config_reads_and_validates_the_device(tmp_path):
    from tests.runtime.training.plans import tiny_plan

    path = tmp_path / "plan.json"
    path.write_text(tiny_plan([(0, 4, "p")], dp=1).to_json())
    env = {"HETTRAIN_PLAN_PATH": str(path)}
    assert RuntimeConfig.from_env(env).device == "auto"
    assert RuntimeConfig.from_env({**env, ENV_DEVICE: "cpu"}).device == "cpu"
    with pytest.raises(ValueError, match=rf"env {ENV_DEVICE}='tpu': must be one of"):
        RuntimeConfig.from_env({**env, ENV_DEVICE: "tpu"})


def test_group_sequence_is_the_same_on_hosts_that_resolve_backends_differently(monkeypatch):
    """A rank on a CUDA host resolves the plan's ``nccl`` to nccl, a rank on a Gaudi host (not a
    member of that pool) to gloo. Both must issue the same ``new_group`` calls in the same
    order: torch names groups by call count, so one merged request hangs the job."""
    requests = [((0, 1), "nccl"), ((0,), "nccl"), ((0,), "gloo"), ((0, 1), "nccl"),
                ((2, 3), "hccl"), ((0, 2), "gloo"), ((2,), "hccl"), ((2,), "gloo")]
    calls: dict[int, list] = {}

    def run_as(rank: int, resolve) -> dict:
        seen = calls.setdefault(rank, [])
        monkeypatch.setattr(dist, "get_rank", lambda: rank)
        monkeypatch.setattr(dist, "new_group",
                            lambda ranks, backend: seen.append((tuple(ranks), backend))
                            or object())
        groups = communicator._Groups(resolve)
        got = [groups.get(r, b) for r, b in requests]
        return {"groups": got, "backends": groups.backends}

    def cuda_host(b: str) -> str:
        return "nccl" if b == "nccl" else "gloo"

    def gaudi_host(b: str) -> str:
        return "hccl" if b == "hccl" else "gloo"

    on_cuda = run_as(0, cuda_host)
    on_gaudi = run_as(2, gaudi_host)
    run_as(3, lambda _b: "gloo")  # a rank on the host CPU (a CPU pool, or HETTRAIN_DEVICE=cpu)
    assert [r for r, _ in calls[0]] == [r for r, _ in calls[2]]  # same sequence of groups
    assert [r for r, _ in calls[0]] == [r for r, _ in calls[3]]
    assert len(calls[0]) == 7  # the repeated ((0, 1), "nccl") is one group
    assert calls[0][1] == ((0,), "nccl") and calls[2][1] == ((0,), "gloo")
    assert on_cuda["groups"][0] is on_cuda["groups"][3]
    assert on_cuda["groups"][4] is None  # not a member of (2, 3)
    assert sorted(on_cuda["backends"].values()) == ["gloo", "gloo", "nccl", "nccl"]
    assert sorted(on_gaudi["backends"].values()) == ["gloo", "gloo", "hccl", "hccl"]
