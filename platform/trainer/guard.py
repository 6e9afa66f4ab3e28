"""Non-finite steps never reach the weights, decided on the device.

    bad = non_finite(loss, grad_norm)          # a device flag: 1.0 when either is NaN/inf
    guarded_step(optimizer, bad)               # the update, skipped on the device when bad

The trainer no longer reads the loss and the gradient norm before the optimizer runs (a host
synchronisation per step, which drains the GPU's queue twice a step): it learns them one step
late (`readings.py`). So the check that used to stop a NaN before the update is now made on the
device, the way torch's own `GradScaler` skips a step whose gradients overflowed: the fused
AdamW kernel takes a `found_inf` tensor and, where it is 1, leaves parameters and moments as
they were and takes back its step count. A NaN step therefore changes no weight and no
optimizer state, whenever the host finds out about it.

An optimizer without a fused kernel (none longrun builds) falls back to reading the flag on the
host before stepping: correct, one synchronisation per step.
"""

from __future__ import annotations

import torch
from torch import Tensor


def non_finite(loss: Tensor, grad_norm: Tensor) -> Tensor:
    """A float32 scalar on the loss's device: 1.0 when the loss or the gradient norm is not finite
    (0-dim, like the optimizer's step counts it is subtracted from)."""
    both = torch.stack((loss.detach().float(), grad_norm.detach().float().to(loss.device)))
    return (~torch.isfinite(both)).any().float()


def guarded_step(optimizer: torch.optim.Optimizer, bad: Tensor) -> None:
    """`optimizer.step()`, a no-op on parameters and state where `bad` is 1 (see the module
    docstring)."""
    if not optimizer.defaults.get("fused"):
        if not bool(bad.item()):  # host fallback: one synchronisation
            optimizer.step()
        return
    # GradScaler's protocol (torch.amp.grad_scaler): optimizers with fused kernels read these
    # two attributes in step() and hand them to the kernel.
    optimizer.grad_scale = None
    optimizer.found_inf = bad
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf
