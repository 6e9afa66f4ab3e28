"""Every parallelism a model gets, applied in one place and one fixed order.

    with torch.device("meta"):
        model = Transformer(cfg.model)                # shapes only: no memory, no values
    parallel = parallelize(model, cfg.dims, cfg.training, device=device, span_group=group,
                           mesh=mesh, prime=...)      # this rank's pieces, on `device`
    init_pieces(local_pieces(parallel.module), cfg.model, seed)   # or a restore fills them
    loss = loss_fn(parallel.forward(tokens, ...))     # DDP, FSDP2 or the plain model around it

The model may come in on the meta device (what the trainer does) or with real weights. On
meta, nothing is allocated until this rank's pieces are known: the pipeline cut, tensor
parallelism and FSDP's sharding all apply to shapes, and memory is given (`to_empty`) to what
this rank keeps, just before DDP, which needs real tensors, or just after FSDP, which shards
meta parameters as it would real ones. No rank ever holds the whole model: at 70B that is
282 GB of fp32 per rank. The values come after, from `weights_init.py` or a restore.

The order matters and is the one torchtitan and Megatron use; each step assumes the ones
before it:

0. Pipeline parallelism (`pipeline.py`) keeps only this rank's stages of the model: every
   later step applies to those pieces alone, and step 5 wraps each stage on its own (the
   schedule calls stages, not the model).
1. Tensor parallelism (DTensor `parallelize_module` on the mesh's "tp" dimension, inside a
   node; `tensor_parallel.py`) shards the weights of the attention and MLP projections: it
   must see the plain modules, so it comes first.
2. Context parallelism touches no weight: it splits each micro-batch's documents over a CP
   group and swaps the attention kernel per micro-batch (`cp/`), so the model only has to
   accept a `context_parallel=` layout, which it always does. Nothing to apply here.
3. Activation checkpointing (`activation_checkpointing.py`) hooks each transformer block; it
   must see the TP-sharded blocks (so the recompute is sharded too) and sit inside FSDP, whose
   units are the same blocks. `budget` hooks nothing: it sets the memory budget by which step
   4's graphs are partitioned (and is refused where nothing is compiled).
4. `torch.compile` (`compile.py`, training.compile): each block (or the whole model) compiled
   in place, after checkpointing, so the recompute is compiled too (the checkpoint hooks run
   around the compiled forward), and after TP, so the graphs see the DTensor weights; before
   FSDP, whose hooks dynamo leaves out of the graphs (one break at each all-gather, where the
   communication is anyway). torchtitan's order.
5. Gradient synchronisation over the span (dp x fsdp x cp ranks: one model's worth of replicas
   and shards). Where every rank holds whole weights: DDP with a summing hook
   (`data_parallel.py`). Where weights are DTensors (fsdp or tp > 1): FSDP2 (`fsdp.py`) on the
   mesh's ("replicate", "shard") dimensions, which shards parameters, gradients and optimizer
   state over "shard" and all-reduces across "replicate" (HSDP; pure replication when fsdp is
   1, so TP x DP and TP x CP compose through the same path). With bf16 on CUDA, FSDP2 also
   holds the weights' bf16 copies (`precision.py`); where nothing is sharded or the span is
   one rank, autocast casts them (measured faster alone). The model is materialised on
   `device` here (`materialise`): before DDP, after FSDP.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel

from longrun.config.sections import TrainingSection
from longrun.parallel.activation_checkpointing import apply_activation_checkpointing
from longrun.parallel.compile import apply_compile, resolved_mode
from longrun.parallel.data_parallel import DataParallel, summing_ddp
from longrun.parallel.dims import ParallelDims
from longrun.parallel.parallel_model import ParallelModel
from longrun.parallel.pipeline import PipelinedModel, PipelinePlan, StageDDP
from longrun.parallel.precision import casts_parameters, mixed_precision


def materialise(module: torch.nn.Module, device: torch.device) -> None:
    """Give a module built on the meta device memory on `device` (its values are undefined
    until initialised or restored) and compute its derived buffers (the rotary tables). A
    module that already has memory is moved to `device` instead."""
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        # `to_empty` gives a plain parameter leaving meta a new Parameter object per module that
        # holds it, which would untie tied embeddings: remember who shares one and tie again.
        holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        for sub in module.modules():
            for name, param in sub._parameters.items():
                if param is not None:
                    holders.setdefault(id(param), []).append((sub, name))
        module.to_empty(device=device)
        for (first, first_name), *others in (h for h in holders.values() if len(h) > 1):
            for sub, name in others:
                setattr(sub, name, getattr(first, first_name))
        for sub in module.modules():
            init_buffers = getattr(sub, "init_buffers", None)
            if callable(init_buffers):
                init_buffers()
    else:
        module.to(device)


def parallelize(model: torch.nn.Module, dims: ParallelDims, training: TrainingSection, *,
                span_group: dist.ProcessGroup | None, mesh: DeviceMesh | None = None,
                device: torch.device | str = "cpu", reshard_after_forward: bool = True,
                prime: Callable[[torch.nn.Module], torch.Tensor] | None = None,
                pipeline: PipelinePlan | None = None) -> ParallelModel:
    """`model` with every parallelism in `dims` applied, in place, this rank's part of it on
    `device` (built on meta: uninitialised; see the module docstring); gradients are summed
    over `span_group` (the dims.span ranks; None: one process, no communication). Where the
    weights are sharded (dims.sharded) `mesh` is the job's ("replicate", "shard", "tp") device
    mesh (`ParallelGroups.device_mesh`; under pipeline parallelism, this stage's). `prime` is a
    tiny loss DDP runs once so its bucket layout is fixed before the first real step (see
    data_parallel.py). `pipeline`: this rank's place in the pipeline, where dims.pp > 1."""
    device = torch.device(device)
    if dims.sharded and mesh is None:
        raise ValueError(f"parallelism.fsdp = {dims.fsdp} and tp = {dims.tp} shard the weights: "
                         "pass the device mesh (ParallelGroups.device_mesh)")
    if (dims.pp > 1) != (pipeline is not None):
        raise ValueError(f"parallelism.pp = {dims.pp}: pass its pipeline plan exactly when pp > 1")
    # Step 0: pipeline parallelism.
    pipe = None
    if pipeline is not None:
        pipe = PipelinedModel(model, pp=dims.pp, plan=pipeline, span_group=span_group)
        model = pipe.module
    # Step 1: tensor parallelism.
    if dims.tp > 1:
        from longrun.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"])
    # Step 2: context parallelism lives in the data path and the attention layout: nothing here.
    # Step 3: activation checkpointing.
    compile_mode = resolved_mode(training.compile, device)
    apply_activation_checkpointing(model, training.activation_checkpointing,
                                   budget=training.activation_memory_budget, compiled=compile_mode != "none")
    # Step 4: compile.
    apply_compile(model, compile_mode)
    # Step 5: gradient synchronisation, and memory for this rank's pieces.
    if pipe is not None:
        _sync_stages(pipe, dims, training, span_group=span_group, mesh=mesh, device=device)
        return pipe
    from longrun.parallel.fsdp import apply_fsdp
    from longrun.parallel.sharded_model import ShardedModel

    bf16 = casts_parameters(device, training.dtype)
    if not dims.sharded:
        materialise(model, device)
        return DataParallel(model, span_group, bucket_mb=training.grad_sync_bucket_mb, prime=prime)
    root = None
    if dims.span > 1:  # FSDP2 where it shards; a span of one (TP alone) keeps autocast (precision.py)
        root = apply_fsdp(model, _span_mesh(dims, mesh), reshard_after_forward=reshard_after_forward,
                          mp_policy=mixed_precision(device, training.dtype))
    materialise(model, device)
    return ShardedModel(model, span_group, fsdp_root=root, tensor_parallel=dims.tp > 1,
                        casts_parameters=root is not None and bf16)


def _span_mesh(dims: ParallelDims, mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: ("replicate", "shard") for HSDP, else ("shard",)."""
    return mesh["replicate", "shard"] if dims.replicas > 1 else mesh["shard"]


def _sync_stages(pipe: PipelinedModel, dims: ParallelDims, training: TrainingSection, *,
                 span_group: dist.ProcessGroup | None, mesh: DeviceMesh | None,
                 device: torch.device) -> None:
    """Each stage module under its data parallelism (the schedule turns the sync off for every
    micro-batch but the last): FSDP2 where the weights are sharded, without resharding after
    forward (a stage runs many micro-batches before their backwards); DDP otherwise. This
    rank's stages (`pipe.module`) get their memory here: before DDP, after FSDP."""
    if dims.tp > 1:
        pipe.loss_context = loss_parallel
    if dims.span == 1:
        materialise(pipe.module, device)
        return
    if not dims.sharded:
        materialise(pipe.module, device)
        pipe.wrapped = [summing_ddp(stage, span_group, bucket_mb=training.grad_sync_bucket_mb, kind=StageDDP)
                        for stage in pipe.stage_modules]
        pipe.prime()
        return
    from longrun.parallel.fsdp import apply_fsdp

    for stage in pipe.stage_modules:
        apply_fsdp(stage, _span_mesh(dims, mesh), reshard_after_forward=False,
                   mp_policy=mixed_precision(device, training.dtype))
    materialise(pipe.module, device)
