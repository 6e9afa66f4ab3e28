"""The model when its parameters are DTensors: tensor parallel, FSDP2/HSDP, or both.

The state a checkpoint takes is torch's sharded state dict (`get_state_dict`, as in every
layout: `ParallelModel.state_dicts`): the model's DTensors by parameter name, and the
optimizer's state by parameter name too (AdamW's moments are DTensors shaped like their
parameters). Each rank thus hands over only what it holds; `longrun.checkpoint` writes each
piece once and reads back whichever pieces this rank holds at its layout.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import loss_parallel

from longrun.parallel.parallel_model import ParallelModel

# The gradient norm of FSDP x TP parameters is a partial sum over the ("shard", "tp") mesh, and
# DTensor warns (every step, every rank) that reducing it takes two all-reduces of one scalar.
# That costs nothing worth a line per step; the order is the same on every rank.
logging.getLogger("torch.distributed.tensor._redistribute").addFilter(
    lambda record: "sequential all_reduce" not in record.getMessage())


class ShardedModel(ParallelModel):
    """`module` after `parallelize` sharded it. `fsdp_root`: the root FSDP unit when FSDP2
    syncs the gradients over the span (None: a tensor-parallel group alone, no span).
    `tensor_parallel`: logits are sharded by vocabulary, so the loss runs under `loss_parallel`.
    `casts_parameters`: FSDP2 gathers the weights in bf16 (`precision.py`), so no autocast.

    Under HSDP every micro-batch's reduced shards are also all-reduced across replicas. FSDP2
    can defer that to the last micro-batch (`set_requires_all_reduce`), but it then keeps the
    partial sums in a buffer of its own that `zero_grad` does not clear (and torch 2.13's
    `reset_iter_state`, which should, fails), so a pass that is not a step's last (the CP
    calibration's) leaks into the next step: a run that calibrated drifted from one that
    loaded the same calibration. Correct first; the deferral can come back with a torch that
    clears its buffer."""

    def __init__(self, module: torch.nn.Module, group: dist.ProcessGroup | None, *,
                 fsdp_root: FSDPModule | None, tensor_parallel: bool, casts_parameters: bool = False):
        super().__init__(module, group)
        self.fsdp_root = fsdp_root
        self.tensor_parallel = tensor_parallel
        self.casts_parameters = casts_parameters
        # FSDP gathers each block's parameters in every micro-batch's forward: all ranks run all.
        self.syncs_every_micro_batch = fsdp_root is not None

    def loss_parallel(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.tensor_parallel else contextlib.nullcontext()
