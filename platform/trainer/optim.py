"""The optimizer: AdamW with weight decay on matrices only."""

from __future__ import annotations

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
