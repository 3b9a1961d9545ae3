"""Point-to-point activations between pipeline stages, host-staged (the world group is gloo)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached and contiguous in host memory (a copy only when it is on a device)."""
    host = t.detach().contiguous()
    return host if host.device.type == "cpu" else host.cpu()


def to_device(host: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A received host tensor on ``device`` (``None`` or the CPU: as it is)."""
    return host if device is None or device.type == "cpu" else host.to(device)


def send_tensor(t: torch.Tensor, peer: int, group: dist.ProcessGroup | None = None) -> None:
    """Blocking send of ``t`` (copied to host when on an accelerator) to global rank ``peer``."""
    dist.send(to_host(t), dst=peer, group=group)


def recv_tensor(shape: Sequence[int], dtype: torch.dtype, peer: int,
                device: torch.device | None = None,
                group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Blocking receive from global rank ``peer``; the result lands on ``device``."""
    host = torch.empty(tuple(shape), dtype=dtype)
    dist.recv(host, src=peer, group=group)
    return to_device(host, device)
