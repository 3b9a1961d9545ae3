"""Learning-rate schedules: linear warmup, then constant, cosine or WSD (warmup-stable-decay).

The learning rate of optimizer step ``step`` (0-based) is a pure function of the step and the
plan's training settings, so a run resumed at any step (on any layout) continues the same curve.

- ``constant``: ``lr`` after warmup.
- ``cosine``: from ``lr`` down to ``min_lr_ratio·lr`` along a half cosine over the steps after
  warmup (Loshchilov & Hutter, SGDR, 2017).
- ``wsd``: ``lr`` until the last ``wsd_decay_fraction`` of the steps, then linear decay to
  ``min_lr_ratio·lr`` (Hu et al., MiniCPM, 2024).

Warmup rises linearly from ``lr/warmup`` at step 0 to ``lr`` at step ``warmup - 1``.
"""

from __future__ import annotations

import math

from hettrain.api.spec import LR_SCHEDULES, TrainingSpec


def lr_at(t: TrainingSpec, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based) under ``t``'s schedule."""
    base, total, warm = t.learning_rate, t.steps, t.warmup_steps
    if t.lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"plan.training.lr_schedule={t.lr_schedule!r}: must be one of "
                         f"{LR_SCHEDULES} (spec.training.lrSchedule)")
    if step < warm:
        return base * (step + 1) / warm
    if t.lr_schedule == "constant":
        return base
    floor = base * t.min_lr_ratio
    if t.lr_schedule == "cosine":
        span = max(1, total - warm - 1)
        progress = min(1.0, (step - warm) / span)
        return floor + (base - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay = max(1, round(t.wsd_decay_fraction * (total - warm)))
    start = total - decay
    if step < start:
        return base
    progress = min(1.0, (step - start + 1) / decay)
    return base + (floor - base) * progress
