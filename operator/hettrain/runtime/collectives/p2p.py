"""Point-to-point activations between pipeline stages, host-staged (the world group is gloo)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def send_tensor(t: torch.Tensor, peer: int, group: dist.ProcessGroup | None = None) -> None:
    """Blocking send of ``t`` (copied to host when on an accelerator) to global rank ``peer``."""
    host = t.detach().contiguous()
    if host.device.type != "cpu":
        host = host.cpu()
    dist.send(host, dst=peer, group=group)


def recv_tensor(shape: Sequence[int], dtype: torch.dtype, peer: int,
                device: torch.device | None = None,
                group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Blocking receive from global rank ``peer``; the result lands on ``device``."""
    host = torch.empty(tuple(shape), dtype=dtype)
    dist.recv(host, src=peer, group=group)
    return host if device is None or device.type == "cpu" else host.to(device)
