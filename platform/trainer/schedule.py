"""Learning rate: linear warmup, then the configured shape (`training.lr_schedule`).

`step` is the 0-based index of the optimizer step about to run (what `LambdaLR` passes: the
number of steps already taken). Warmup steps 0..W-1 rise linearly as (step + 1) / (W + 1), so
the first step does not waste itself at lr 0; step W runs at the peak. Then:

- cosine, linear: decay from the peak to its floor (lr x min_lr_ratio), reached exactly at the
  last step of the run, step `total_steps - 1`;
- wsd (warmup-stable-decay): the peak until the last D decay steps, which fall linearly to the
  floor at the last step. The decay's start is counted back from the end, so a run extended by
  raising `training.steps` before its decay began goes on at the peak: what MiniCPM and
  DeepSeek use to extend or branch a run without redoing its decay;
- constant: the peak to the end.

The schedule's position is the optimizer's step count, which `LambdaLR`'s state (in every
checkpoint) holds; the shape is rebuilt from the config.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from longrun.config.sections import TrainingSection

if TYPE_CHECKING:  # torch-free to import: `longrun config show` describes the schedule
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LambdaLR


@dataclass(frozen=True)
class Shape:
    """One schedule: its kind and where its phases begin and end (steps, 0-based)."""

    kind: str
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float
    decay_start: int  # the first step below the peak after warmup (total_steps: never)

    def multiplier(self, step: int) -> float:
        """Factor in [min_lr_ratio, 1] applied to the peak learning rate at `step`."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.kind == "constant":
            return 1.0
        floor = self.min_lr_ratio
        if self.kind == "wsd":
            if step < self.decay_start:
                return 1.0
            decay = self.total_steps - self.decay_start
            progress = min(1.0, (step - self.decay_start + 1) / decay)
            return floor + (1.0 - floor) * (1.0 - progress)
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - 1 - self.warmup_steps))
        if self.kind == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def shape_of(training: TrainingSection) -> Shape:
    warmup, total = training.warmup_steps, training.steps
    if training.lr_schedule == "wsd":
        decay = training.decay_steps
        if decay is None:
            decay = round(training.decay_fraction * max(0, total - warmup))
        decay = max(1, min(decay, total - warmup))  # at least the last step reaches the floor
        start = total - decay
    elif training.lr_schedule == "constant":
        start = total
    else:
        start = warmup + 1 if total - 1 > warmup else total  # step W runs at the peak
    return Shape(training.lr_schedule, warmup, total, training.min_lr_ratio, start)


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The cosine schedule's factor at `step` (what every job ran before `lr_schedule`)."""
    return Shape("cosine", warmup_steps, total_steps, min_lr_ratio, warmup_steps + 1).multiplier(step)


def lr_schedule(training: TrainingSection) -> Callable[[int], float]:
    """step -> learning rate for this training section."""
    shape = shape_of(training)
    return lambda step: training.lr * shape.multiplier(step)


def describe(training: TrainingSection) -> str:
    """The schedule in one line, for `longrun config show`."""
    shape, lr = shape_of(training), training.lr
    floor = lr * training.min_lr_ratio
    last = training.steps - 1
    warm = f"warmup to {lr:g} over steps 0-{shape.warmup_steps - 1}, " if shape.warmup_steps else ""
    if shape.kind == "constant":
        return f"constant: {warm}{lr:g} to step {last}"
    if shape.kind == "wsd":
        stable_end = shape.decay_start - 1
        stable = f"{lr:g} to step {stable_end}, " if stable_end >= shape.warmup_steps else ""
        return (f"wsd: {warm}{stable}linear decay over steps {shape.decay_start}-{last} "
                f"({training.steps - shape.decay_start} steps) to {floor:g}")
    return f"{shape.kind}: {warm}{lr:g} at step {shape.warmup_steps}, decaying to {floor:g} at step {last}"


def build_scheduler(optimizer: Optimizer, training: TrainingSection) -> LambdaLR:
    """A LambdaLR scaling each param group's lr (set to training.lr) by the schedule's factor.
    Its state_dict holds the step count; the shape is rebuilt from the config."""
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, shape_of(training).multiplier)
