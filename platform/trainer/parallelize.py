"""Every parallelism a model gets, applied in one place and one fixed order.

    model = Transformer(cfg.model).to(device)
    parallel = parallelize(model, cfg.dims, cfg.training, replica_group=group, prime=priming_loss)
    loss = loss_fn(parallel.forward(tokens, ...))     # DDP (or the plain model) around it

The order matters and is the one torchtitan and Megatron use; each step assumes the ones
before it:

1. Tensor parallelism (DTensor `parallelize_module`, inside a node) shards the weights of the
   attention and MLP projections: it must see the plain modules, so it comes first.
2. Context parallelism touches no weight: it splits each micro-batch's documents over a CP
   group and swaps the attention kernel per micro-batch (`cp/`), so the model only has to
   accept a `context_parallel=` layout, which it always does. Nothing to apply here.
3. Activation checkpointing wraps each transformer block; it must wrap the TP-sharded blocks
   and sit inside compile and FSDP so their units are whole blocks.
4. `torch.compile` per block, after checkpointing (the recompute is compiled too) and before
   FSDP (whose hooks would otherwise break the graphs at every all-gather).
5. Gradient synchronisation over the replica span (dp x cp ranks, which hold the same weights):
   today DDP with a summing hook (`data_parallel.py`); FSDP2/HSDP (`fully_shard`) takes this
   place and shards parameters, gradients and optimizer state over the same span.

Steps 1, 3, 4 and FSDP in step 5 are the sharded-training issue's to fill; a config asking
for them is refused by the config checks (tp > 1) before anything is built.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from longrun.config.sections import TrainingSection
from longrun.parallel_dims import ParallelDims
from longrun.trainer.data_parallel import DataParallel


def parallelize(model: torch.nn.Module, dims: ParallelDims, training: TrainingSection, *,
                replica_group: dist.ProcessGroup | None,
                prime: Callable[[torch.nn.Module], torch.Tensor] | None = None) -> DataParallel:
    """`model` with every parallelism in `dims` applied; gradients are summed over
    `replica_group` (the dims.span ranks; None: one process, no communication). `prime` is a
    tiny loss DDP runs once so its bucket layout is fixed before the first real step (see
    data_parallel.py)."""
    if dims.tp > 1 or dims.pp > 1 or dims.fsdp > 1:  # steps 1, 5 (FSDP) and pipeline stages
        raise ValueError(f"the trainer has no tensor, pipeline or sharded data parallelism yet "
                         f"(parallelism.tp = {dims.tp}, pp = {dims.pp}, fsdp = {dims.fsdp}); "
                         f"set them to 1")
    # Step 2: context parallelism lives in the data path and the attention layout; nothing here.
    # Steps 3 and 4 (activation checkpointing, compile): none configured.
    return DataParallel(model, replica_group, bucket_mb=training.grad_sync_bucket_mb, prime=prime)
