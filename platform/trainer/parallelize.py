"""Every parallelism a model gets, applied in one place and one fixed order.

    model = Transformer(cfg.model).to(device)
    parallel = parallelize(model, cfg.dims, cfg.training, span_group=group, mesh=mesh, prime=...)
    loss = loss_fn(parallel.forward(tokens, ...))     # DDP, FSDP2 or the plain model around it

The order matters and is the one torchtitan and Megatron use; each step assumes the ones
before it:

1. Tensor parallelism (DTensor `parallelize_module` on the mesh's "tp" dimension, inside a
   node; `tensor_parallel.py`) shards the weights of the attention and MLP projections: it
   must see the plain modules, so it comes first.
2. Context parallelism touches no weight: it splits each micro-batch's documents over a CP
   group and swaps the attention kernel per micro-batch (`cp/`), so the model only has to
   accept a `context_parallel=` layout, which it always does. Nothing to apply here.
3. Activation checkpointing (`activation_checkpointing.py`) hooks each transformer block; it
   must see the TP-sharded blocks (so the recompute is sharded too) and sit inside FSDP, whose
   units are the same blocks.
4. `torch.compile` per block would come here, after checkpointing (the recompute compiled too)
   and before FSDP (whose hooks would break the graphs at every all-gather); not configured.
5. Gradient synchronisation over the span (dp x fsdp x cp ranks: one model's worth of replicas
   and shards). Where every rank holds whole weights: DDP with a summing hook
   (`data_parallel.py`). Where weights are DTensors (fsdp or tp > 1): FSDP2 (`fsdp.py`) on the
   mesh's ("replicate", "shard") dimensions, which shards parameters, gradients and optimizer
   state over "shard" and all-reduces across "replicate" (HSDP; pure replication when fsdp is
   1, so TP x DP and TP x CP compose through the same path).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from longrun.config.sections import TrainingSection
from longrun.parallel_dims import ParallelDims
from longrun.trainer.activation_checkpointing import apply_activation_checkpointing
from longrun.trainer.data_parallel import DataParallel
from longrun.trainer.parallel_model import ParallelModel


def parallelize(model: torch.nn.Module, dims: ParallelDims, training: TrainingSection, *,
                span_group: dist.ProcessGroup | None, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool = True,
                prime: Callable[[torch.nn.Module], torch.Tensor] | None = None) -> ParallelModel:
    """`model` with every parallelism in `dims` applied, in place; gradients are summed over
    `span_group` (the dims.span ranks; None: one process, no communication). Where the weights
    are sharded (dims.sharded) `mesh` is the job's ("replicate", "shard", "tp") device mesh
    (`ParallelGroups.device_mesh`). `prime` is a tiny loss DDP runs once so its bucket layout
    is fixed before the first real step (see data_parallel.py)."""
    if dims.pp > 1:
        raise ValueError(f"the trainer has no pipeline parallelism yet (parallelism.pp = {dims.pp}); "
                         "set it to 1")
    if dims.sharded and mesh is None:
        raise ValueError(f"parallelism.fsdp = {dims.fsdp} and tp = {dims.tp} shard the weights: "
                         "pass the device mesh (ParallelGroups.device_mesh)")
    # Step 1: tensor parallelism.
    if dims.tp > 1:
        from longrun.trainer.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"])
    # Step 2: context parallelism lives in the data path and the attention layout: nothing here.
    # Step 3: activation checkpointing.
    apply_activation_checkpointing(model, training.activation_checkpointing)
    # Step 4 (compile): not configured.
    # Step 5: gradient synchronisation.
    if not dims.sharded:
        return DataParallel(model, span_group, bucket_mb=training.grad_sync_bucket_mb, prime=prime)
    from longrun.trainer.fsdp import apply_fsdp, mixed_precision
    from longrun.trainer.sharded_model import ShardedModel

    root = None
    if dims.span > 1:
        dp_mesh = mesh["replicate", "shard"] if dims.replicas > 1 else mesh["shard"]
        device = next(model.parameters()).device
        root = apply_fsdp(model, dp_mesh, reshard_after_forward=reshard_after_forward,
                          mp_policy=mixed_precision(device, training.dtype))
    return ShardedModel(model, span_group, fsdp_root=root, tensor_parallel=dims.tp > 1)
