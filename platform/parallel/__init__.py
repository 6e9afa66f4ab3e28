"""How a model is spread over ranks: the layout's arithmetic and every parallelism applied to it.

    dims.py          ParallelDims: a job's layout (pp, dp replicate/shard, cp, tp) and its checks;
                     torch-free, so the controller and `longrun config` use it too
    parallelize.py   every parallelism applied to the model in one fixed order
    parallel_model.py   what the step asks of a layout; data_parallel.py: DDP with a summing
                     hook and a fixed bucket layout; sharded_model.py: DTensor weights
    tensor_parallel.py, fsdp.py, activation_checkpointing.py   TP with sequence parallel and a
                     vocabulary-parallel loss; FSDP2/HSDP per block; recompute per block

This package's own import is torch-free (nothing here is imported eagerly): `dims` is read by
the controller, which must never import torch.
"""
