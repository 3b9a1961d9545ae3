"""DiLoCo: inner steps sync within a datacenter; every H steps an outer Nesterov SGD across DCs.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (2023).
Pseudo-gradient ``Δ = θ_global − θ_local`` is averaged over the stage DP group (arranged by
datacenter, optionally compressed with error feedback), then ``θ_global`` takes a Nesterov
momentum step and is copied into the local parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hettrain.runtime.collectives.communicator import HetCommunicator


class DiLoCo:
    """Outer optimizer wrapping a communicator; call :meth:`step` after each inner step."""

    def __init__(self, params: Iterable[torch.nn.Parameter], comm: HetCommunicator,
                 outer_steps: int = 50, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 compress: bool | None = None) -> None:
        if outer_steps < 1:
            raise ValueError(f"outer_steps must be >= 1, got {outer_steps}")
        if outer_lr <= 0:
            raise ValueError(f"outer_lr must be > 0, got {outer_lr}")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum}")
        self.params = [p for p in params]
        self.comm = comm
        self.outer_steps, self.outer_lr, self.outer_momentum = outer_steps, outer_lr, outer_momentum
        self.compress = (comm.codec.kind != "none") if compress is None else compress
        self.global_params = [p.detach().clone() for p in self.params]
        self.momentum = [torch.zeros_like(p) for p in self.global_params]
        self.outer_syncs = 0

    def sync_gradients(self) -> str:
        """Average this step's gradients within the datacenter (inner data parallelism)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        return self.comm.dp_all_reduce_(grads, average=True, scope="dc")

    @torch.no_grad()
    def step(self, inner_step: int) -> bool:
        """After inner step ``inner_step`` (0-based): outer sync every ``outer_steps``."""
        if (inner_step + 1) % self.outer_steps:
            return False
        deltas = [g - p.detach() for g, p in zip(self.global_params, self.params, strict=True)]
        self.comm.cross_dc_all_reduce_(deltas, average=True, compress=self.compress)
        mu, lr = self.outer_momentum, self.outer_lr
        for g, m, d, p in zip(self.global_params, self.momentum, deltas, self.params,
                              strict=True):
            m.mul_(mu).add_(d)
            update = d + mu * m if mu else d
            g.sub_(lr * update)
            p.copy_(g)
        self.outer_syncs += 1
        return True
