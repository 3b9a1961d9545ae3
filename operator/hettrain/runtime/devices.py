"""Which torch device a rank trains on, from its stage's vendor and what this host offers.

Inside a pod the device plugin exposes exactly the pod's accelerators, so process ``i`` of the
pod (``RANK - HETTRAIN_RANK_START``) takes device ``i`` of its kind:

| vendor | kind | torch module | pool backend |
|---|---|---|---|
| nvidia | ``cuda`` | ``torch.cuda`` | nccl |
| amd | ``cuda`` | ``torch.cuda`` (ROCm builds of torch) | nccl (RCCL) |
| intel (Gaudi) | ``hpu`` | ``habana_frameworks.torch`` | hccl |
| huawei (Ascend) | ``npu`` | ``torch_npu`` | hccl |

``HETTRAIN_DEVICE`` picks: ``auto`` (default) takes the vendor's kind when this host has it and
falls back to ``cpu`` otherwise (CPU nodes, tests, the demo), saying why; ``cpu`` forces the CPU
(and gloo everywhere); ``cuda``/``hpu``/``npu`` demand that kind and fail naming the variable
when it is missing. A pod that runs more processes than it sees devices is an error, never two
ranks on one device.

The probe that counts devices is injectable so the choice is tested without accelerators.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

ENV_DEVICE = "HETTRAIN_DEVICE"
DEVICE_CHOICES = ("auto", "cpu", "cuda", "hpu", "npu")
VENDOR_KIND = {"nvidia": "cuda", "amd": "cuda", "intel": "hpu", "huawei": "npu"}
# the torch extension that registers a kind (imported only to probe for it)
KIND_MODULE = {"hpu": "habana_frameworks.torch", "npu": "torch_npu"}

Probe = Callable[[str], int]


@dataclass(frozen=True)
class DeviceChoice:
    """The device of one rank (``kind``, ``index``), and why it was chosen."""

    kind: str
    index: int | None
    reason: str

    @property
    def device(self) -> torch.device:
        """As a torch device (``npu`` exists only once ``torch_npu`` is imported: the probe)."""
        return torch.device(self.kind, self.index)

    @property
    def accelerated(self) -> bool:
        """True when the rank trains on an accelerator (its pool may use nccl/hccl)."""
        return self.kind != "cpu"


def count_devices(kind: str) -> int:
    """How many devices of ``kind`` (``cuda``/``hpu``/``npu``) this process sees (0: none)."""
    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    module = KIND_MODULE.get(kind)
    if module is None:
        raise ValueError(f"unknown device kind {kind!r}: one of cuda, hpu, npu")
    try:
        importlib.import_module(module)
    except ImportError:
        return 0
    mod = getattr(torch, kind, None)
    if mod is None or not mod.is_available():
        return 0
    return int(mod.device_count())


def check_choice(requested: str) -> str:
    """``requested`` if it is a valid ``HETTRAIN_DEVICE`` value; else an error naming it."""
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"env {ENV_DEVICE}={requested!r}: must be one of {DEVICE_CHOICES}")
    return requested


def select_device(vendor: str, local_index: int, requested: str = "auto",
                  probe: Probe = count_devices) -> DeviceChoice:
    """The device for process ``local_index`` of a pod of ``vendor`` GPUs (see module doc)."""
    check_choice(requested)
    if local_index < 0:
        raise ValueError(f"local process index {local_index} < 0 (RANK below "
                         "HETTRAIN_RANK_START)")
    if requested == "cpu":
        return DeviceChoice("cpu", None, f"{ENV_DEVICE}=cpu")
    kind = VENDOR_KIND.get(vendor) if requested == "auto" else requested
    if kind is None:  # a CPU pool, or a custom device the catalog does not map
        return DeviceChoice("cpu", None, f"vendor {vendor!r} has no accelerator kind")
    count = probe(kind)
    if count == 0:
        if requested == "auto":
            return DeviceChoice("cpu", None,
                                f"no {kind} device visible for vendor {vendor!r}; CPU fallback")
        module = KIND_MODULE.get(kind, "torch.cuda")
        raise ValueError(f"env {ENV_DEVICE}={requested}: no {kind} device is visible "
                         f"({module} missing or no device); set {ENV_DEVICE}=auto or cpu")
    if local_index >= count:
        raise ValueError(f"process {local_index} of this pod has no {kind} device: the pod "
                         f"sees {count}; LOCAL_WORLD_SIZE must not exceed the GPUs the pod "
                         "requests")
    return DeviceChoice(kind, local_index, f"{vendor} pool: {kind}:{local_index} of {count}")


def activate(device: torch.device) -> None:
    """Make ``device`` the current device of its kind (before nccl/hccl groups are built)."""
    if device.type == "cpu":
        return
    mod = getattr(torch, device.type, None)
    if mod is not None and hasattr(mod, "set_device"):
        mod.set_device(device)
