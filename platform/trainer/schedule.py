"""Learning rate: linear warmup, then cosine decay to lr * min_lr_ratio.

`step` is the 0-based index of the optimizer step about to run (what `LambdaLR` passes: the
number of steps already taken). Warmup steps 0..W-1 rise linearly as (step + 1) / (W + 1), so
the first step does not waste itself at lr 0; step W runs at the peak; the cosine then reaches
its floor exactly at the last step of the run, step `total_steps - 1`, and stays there.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from longrun.config.sections import TrainingSection


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Factor in [min_lr_ratio, 1] applied to the peak learning rate at `step`."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_schedule(training: TrainingSection) -> Callable[[int], float]:
    """step -> learning rate for this training section."""

    def lr_at(step: int) -> float:
        return training.lr * lr_multiplier(
            step,
            warmup_steps=training.warmup_steps,
            total_steps=training.steps,
            min_lr_ratio=training.min_lr_ratio,
        )

    return lr_at


def build_scheduler(optimizer: Optimizer, training: TrainingSection) -> LambdaLR:
    """A LambdaLR scaling each param group's lr (set to training.lr) by `lr_multiplier`.
    Its state_dict holds the step count; the function is rebuilt from the config."""

    def factor(step: int) -> float:
        return lr_multiplier(
            step,
            warmup_steps=training.warmup_steps,
            total_steps=training.steps,
            min_lr_ratio=training.min_lr_ratio,
        )

    return LambdaLR(optimizer, factor)
