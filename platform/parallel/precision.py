"""Which dtype the weights compute in, and who casts them there.

    training.dtype: float32 | bfloat16

Master weights, gradients and AdamW's moments are always float32. With bfloat16 the matmuls
run in bf16, and something has to cast the weights:

- **FSDP2's mixed precision** (on CUDA, at every layout FSDP2 runs, one process included):
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`. A block's weights are cast as
  they are gathered (one fused copy per block, in the all-gather's copy-in), its gradients come
  back in fp32 (reduced in fp32), and the optimizer steps the fp32 shards. torchtitan does the
  same even at one GPU. A process training alone gets a mesh of its own (`one_rank_mesh`) for it.
- **autocast** (everywhere else: the CPU, and multi-rank layouts whose weights are whole on
  every rank, i.e. DDP): each op casts its fp32 weight on every micro-batch's forward. Issue 40's
  profile found 2,328 such casts per two steps of the 1B model (part of 12% of the device time
  in copies), which is what the FSDP2 path removes. DDP layouts on CUDA keep autocast until
  commgroup forms a one-rank shard group per rank, so the device mesh (replicate = the span,
  shard = 1) exists for them too.

On the CPU everything stays fp32 under FSDP2 (gloo has no fast bf16 path and the tests compare
with fp32 references); bf16 there is autocast's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy


def casts_parameters(device: torch.device, dtype: str) -> bool:
    """Whether FSDP2 should hold the weights' bf16 copies (CUDA, training.dtype bfloat16)."""
    return device.type == "cuda" and dtype == "bfloat16"


def mixed_precision(device: torch.device, dtype: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for this device and training.dtype (see the module docstring)."""
    if casts_parameters(device, dtype):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def one_rank_mesh(device: torch.device) -> DeviceMesh:
    """A 1-D ("shard",) mesh of this process alone, for FSDP2 in a process that trains alone.
    FSDP2 needs a process group; where none exists this process gets a world of one (nccl on
    CUDA, gloo elsewhere, over an in-memory store: nothing is opened to the network), as
    torchrun gives a single-GPU torchtitan run."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        extra = {}
        if device.type == "cuda":
            extra["device_id"] = torch.device("cuda", device.index if device.index is not None
                                              else torch.cuda.current_device())
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **extra)
    if dist.get_world_size() != 1:
        raise ValueError(f"a one-rank mesh in a world of {dist.get_world_size()} ranks: pass the "
                         "job's device mesh (ParallelGroups.device_mesh)")
    return init_device_mesh(device.type, (1,), mesh_dim_names=("shard",))
