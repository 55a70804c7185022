"""The learning rate of a step: linear warm-up to the peak, then cosine decay towards the floor.

    step   0 .. warmup-1            warmup .. steps-1
    lr     peak * (step+1)/warmup   floor + (peak - floor) * (1 + cos(pi * t)) / 2,
                                    t = (step - warmup) / (steps - warmup)

So the first step already trains (lr = peak / warmup, not 0), the peak is reached at step
`warmup`, and the cosine would reach `min_lr` one step after the last: the last step still
trains, at floor + (peak - floor) * (1 - cos(pi / (steps - warmup))) / 2 (with the default
min_lr = 0 a run whose last step ran at 0 wasted it; most trainers end the same way). A run
that ends inside its warm-up never decays. A pure function of the step: resuming needs only
the step.
"""

from __future__ import annotations

import math

__all__ = ["lr_at"]


def lr_at(step: int, *, lr: float, steps: int, warmup_steps: int = 0,
          min_lr: float = 0.0) -> float:
    """The learning rate of `step` (0-based) of a run of `steps` steps."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    t = min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))
