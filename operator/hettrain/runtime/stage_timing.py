"""Measured stage times for closed-loop calibration (runtime → operator).

Each rank keeps, per optimizer step, the forward+backward seconds of one microbatch spent
computing on its stage (the pipeline's receives and sends excluded,
:attr:`hettrain.runtime.pipeline.StageRunner.last_compute_s`) and the seconds it spent
communicating (pipeline receives/sends plus the DP / cross-DC gradient sync). The medians of
the last :data:`WINDOW` steps (the process's first step, a warm-up, is left out) are exported
on the rank's metrics endpoint (port 9400 + local rank) as

- ``hettrain_runtime_stage_compute_seconds``  (forward+backward of one microbatch),
- ``hettrain_runtime_stage_layers_seconds``   (the same, the decoder layers only:
  :class:`LayerClock`),
- ``hettrain_runtime_stage_comm_seconds``     (per step),
- ``hettrain_runtime_stage_measured_steps``   (how many steps the medians cover),

which the operator reads from the first rank of every stage (``hettrain.calibration_scrape``),
together with ``hettrain_runtime_step`` and ``hettrain_runtime_last_checkpoint_step``. The
same numbers go into the rank's ``HETTRAIN_SUMMARY_DIR`` file as ``stage_timing``.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any

import torch

WINDOW = 20  # steps the medians cover
WARMUP_STEPS = 1  # first steps of the process not measured (allocator, kernels, caches)


class StageTimer:
    """Rolling medians of one rank's per-step compute and communication seconds."""

    def __init__(self, window: int = WINDOW, warmup: int = WARMUP_STEPS) -> None:
        self._compute: deque[float] = deque(maxlen=window)
        self._layers: deque[float] = deque(maxlen=window)
        self._comm: deque[float] = deque(maxlen=window)
        self._warmup = warmup
        self.measured = 0  # steps measured (warm-up excluded), may exceed the window

    def add(self, compute_s: float, comm_s: float, layers_s: float = 0.0) -> None:
        """Record one step: microbatch compute seconds (all, and the layers' only) and
        communication seconds."""
        if self._warmup > 0:
            self._warmup -= 1
            return
        self._compute.append(compute_s)
        self._layers.append(layers_s)
        self._comm.append(comm_s)
        self.measured += 1

    @property
    def compute_s(self) -> float:
        """Median forward+backward compute seconds of one microbatch (0 before any step)."""
        return statistics.median(self._compute) if self._compute else 0.0

    @property
    def layers_s(self) -> float:
        """Median forward+backward seconds of the stage's layers for one microbatch."""
        return statistics.median(self._layers) if self._layers else 0.0

    @property
    def comm_s(self) -> float:
        """Median communication seconds per step (0 before any step)."""
        return statistics.median(self._comm) if self._comm else 0.0

    def as_json(self) -> dict[str, Any]:
        """The summary file's ``stage_timing`` entry."""
        return {"compute_s": self.compute_s, "layers_s": self.layers_s, "comm_s": self.comm_s,
                "steps": self.measured}


class LayerClock:
    """Seconds the stage's decoder layers take, forward and backward (set as
    ``StageModel.layer_clock``; the pipeline reads and resets it every step).

    Forward: wall time around the layer loop. Backward: from the gradient reaching the layers'
    output to it leaving their input, marked by two identity autograd functions
    (:class:`_Mark`); recompute (re-run in backward) is inside that span. The embedding, the
    final norm, the LM head and the loss are outside both: calibration compares the layers
    with the model's layer cost directly.
    """

    def __init__(self) -> None:
        self.forward_s = 0.0
        self.backward_s = 0.0
        self._bwd_start = 0.0

    def reset(self) -> float:
        """The seconds accumulated since the last reset (forward + backward), then zero."""
        total = self.forward_s + self.backward_s
        self.forward_s = self.backward_s = 0.0
        return total

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Mark the layers' input (its backward closes the backward span)."""
        return _Mark.apply(x, self, False) if x.requires_grad else x

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """Mark the layers' output (its backward opens the backward span)."""
        return _Mark.apply(x, self, True) if x.requires_grad else x


class _Mark(torch.autograd.Function):
    """Identity whose backward records the time on a :class:`LayerClock`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clock: LayerClock, opens: bool) -> torch.Tensor:
        ctx.clock, ctx.opens = clock, opens
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        now = time.perf_counter()
        if ctx.opens:
            ctx.clock._bwd_start = now
        elif ctx.clock._bwd_start:
            ctx.clock.backward_s += now - ctx.clock._bwd_start
            ctx.clock._bwd_start = 0.0
        return grad, None, None
