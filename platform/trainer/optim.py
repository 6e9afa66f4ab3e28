"""The optimizer: AdamW with weight decay on matrices only; after a restore, the config's settings."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import _get_scalar_dtype

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


def lay_out_state(optimizer: torch.optim.Optimizer) -> bool:
    """Give an Adam(W) that has no state yet its state tensors, uninitialised: the layout a
    restore reads into. torch's `get_state_dict` would make them by zero-filling a gradient per
    parameter and taking a step at lr 0 over the zeroed moments, which costs about as much as
    reading the checkpoint itself; the tensors are the ones Adam's own lazy initialisation
    makes (same dtype, device and layout, `step` where its kernel wants it). Whoever calls this
    must overwrite them or clear `optimizer.state`. False, doing nothing, for another optimizer,
    one with state, or one whose parameters have gradients (it has begun a step)."""
    if optimizer.state or type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        return False
    params = [(p, group) for group in optimizer.param_groups for p in group["params"]]
    if any(p.grad is not None for p, _ in params):
        return False
    for p, group in params:
        if not p.requires_grad:
            continue
        state = optimizer.state[p]
        if group["capturable"] or group["fused"]:
            state["step"] = torch.zeros((), dtype=_get_scalar_dtype(is_fused=group["fused"]), device=p.device)
        else:
            state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")
        moments = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
        for name in moments:
            state[name] = torch.empty_like(p, memory_format=torch.preserve_format)
    return True


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
