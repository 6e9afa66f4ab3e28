"""Sharded data parallelism: FSDP2 (`fully_shard`) per transformer block and at the root.

Each rank of a shard group keeps 1/fsdp of every parameter, its gradient and its AdamW state
(DTensors sharded on dim 0). A block's forward all-gathers its parameters, its backward
gathers them again and reduce-scatters the gradients; on a 2-D (replicate, shard) mesh the
shards are then all-reduced across replicas (HSDP). Under tensor parallelism the parameters
are already TP DTensors and FSDP shards them further (2-D, FSDP x TP). What longrun sets,
and why:

- **One unit per block, and the root.** A block's parameters travel in one collective; the
  root unit holds the embedding, the final norm and the (tied) output layer, and keeps them
  gathered from forward to backward (they are needed first in backward).
- **Explicit prefetch both ways.** Block i+1's all-gather is issued when block i's forward
  starts, and block i-1's when block i's backward starts, so gathers run under compute (the
  overlap that makes sharding cheap) instead of waiting for the CPU to reach the next block.
- **Summed, not averaged.** The trainer divides each loss by the token count of the whole
  global batch (see `data_parallel.py`), so gradients must be summed over the span; FSDP's
  default divides by the mesh size, so the divide factor is 1 and the collectives are plain
  sums (gloo has no pre-multiplied sum; on NCCL a sum is the zero-copy path).
- **Every micro-batch reduce-scatters its gradients.** Accumulating unsharded gradients until
  the last micro-batch would hold a whole replica's gradients on every rank, which is what
  sharding exists to avoid; reduce-scattering each micro-batch keeps only the shard. For the
  same reason every rank runs every micro-batch (an idle one with a zero-weight pass): the
  parameter gathers are collectives of the whole shard group. Under HSDP each micro-batch's
  shards are all-reduced across replicas too (see `sharded_model.py` for why not deferred).
- **Mixed precision on GPUs only** (`precision.py`). With `training.dtype: bfloat16` on CUDA,
  parameters are gathered in bf16 and gradients reduced in fp32; on CPU everything stays fp32
  (gloo has no fast bf16 path and the tests compare against fp32 references).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from longrun.parallel.precision import mixed_precision
from longrun.trainer.model import blocks

__all__ = ["apply_fsdp", "mixed_precision"]


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool,
               mp_policy: MixedPrecisionPolicy) -> FSDPModule:
    """Shard `model` (a Transformer or a pipeline stage of one, TP-sharded or not) in place over
    `mesh`: 1-D ("shard") for FSDP, 2-D ("replicate", "shard") for HSDP. Returns the root FSDP
    module."""
    units = blocks(model)
    for block in units:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    root = fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy)
    for i, block in enumerate(units):
        if i + 1 < len(units):
            block.set_modules_to_forward_prefetch([units[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([units[i - 1]])
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    return root
