"""Which dtype the weights compute in, and who casts them there.

    training.dtype: float32 | bfloat16

Master weights, gradients and AdamW's moments are always float32. With bfloat16 the matmuls
run in bf16, and something has to cast the weights:

- **FSDP2's mixed precision** (on CUDA, wherever FSDP2 shards: fsdp or HSDP spans of several
  ranks): `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`. A block's weights are
  cast as they are gathered (one fused copy per block, in the all-gather's copy-in), its
  gradients come back in fp32 (reduced in fp32), and the optimizer steps the fp32 shards.
- **autocast** everywhere else: a process training alone on a GPU, layouts whose weights are
  whole on every rank (DDP) or only split by tensor parallelism, and the CPU. Each op casts its
  fp32 weight on every micro-batch's forward.

Alone on a GPU FSDP2 was tried for its bf16 copies (as torchtitan wraps even one GPU) and
measured slower: on one H200, the 1B bench with compiled blocks ran at 36.6% MFU through a
one-rank FSDP2 and 48.1% with autocast (`docs/benchmarks.md`, issue 40). With nothing to
shard, FSDP2's per-block hooks and one-rank "collectives" cost more host time and copies than
autocast's casts, which its weight-cast cache makes once per forward.

On the CPU everything stays fp32 under FSDP2 (gloo has no fast bf16 path and the tests compare
with fp32 references); bf16 there is autocast's.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy


def casts_parameters(device: torch.device, dtype: str) -> bool:
    """Whether FSDP2 should hold the weights' bf16 copies (CUDA, training.dtype bfloat16)."""
    return device.type == "cuda" and dtype == "bfloat16"


def mixed_precision(device: torch.device, dtype: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for this device and training.dtype (see the module docstring)."""
    if casts_parameters(device, dtype):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()
