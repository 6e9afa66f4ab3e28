"""The optimizer: AdamW with weight decay on matrices only; after a restore, the config's settings."""

from __future__ import annotations

from typing import Any

import torch

from longrun.config.sections import TrainingSection


def build_optimizer(model: torch.nn.Module, training: TrainingSection,
                    device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay only on matrices (linear weights, embeddings), never on norm gains.
    The fused kernel where torch has one for the device, else the multi-tensor one."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": training.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=training.lr, betas=training.betas,
                             fused=fused, foreach=None if fused else True)


def follow_training_config(optimizer: torch.optim.Optimizer, scheduler: Any,
                           training: TrainingSection) -> None:
    """After a restore: the learning rate, betas and weight decay of `training`, not the
    checkpoint's. Loading an optimizer's state brings back its groups' settings, and loading the
    scheduler's its base learning rate, so a change of them (accepted on resume:
    config/identity.py) would never take effect. An unchanged config changes nothing: the same
    values, the learning rate computed as the scheduler (a `LambdaLR`) computes it."""
    groups = optimizer.param_groups
    for group, weight_decay in zip(groups, (training.weight_decay, 0.0), strict=True):  # as built
        group["betas"] = tuple(training.betas)
        group["weight_decay"] = weight_decay
        group["initial_lr"] = training.lr
    scheduler.base_lrs = [training.lr] * len(groups)
    step = scheduler.last_epoch
    lrs = [base * factor(step) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, lr in zip(groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports (the step's metrics)
