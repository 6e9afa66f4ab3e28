"""What autograd keeps from a forward for its backward, seen through the saved-tensor hooks
(the memory planner's tests and the compiled-checkpointing tests measure with it)."""

from __future__ import annotations

import numpy as np
import torch

from longrun.data.packing import build_micro_batch


def kept_bytes(trainer, tokens: int) -> int:
    """Bytes autograd keeps from one micro-batch's forward for its backward (distinct storages,
    parameters excluded)."""
    mb = build_micro_batch([np.random.default_rng(0).integers(0, 256, size=tokens)])
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer._summed_token_loss(trainer.model, mb)
    params = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)
