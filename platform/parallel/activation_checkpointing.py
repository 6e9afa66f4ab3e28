"""Activation checkpointing per transformer block: trade recomputation for activation memory.

    training.activation_checkpointing: none | full | selective

- **full**: a block keeps only its input; backward runs its forward again. Activation memory
  per block drops to one [tokens, dim] tensor, for about a third more compute.
- **selective**: a block keeps the outputs of its matrix multiplies, its attention and its
  tensor-parallel collectives (expensive to redo), and recomputes the cheap elementwise work
  in between (norms, rotary, SwiGLU's activation and product), which holds much of the memory
  for little of the time (Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models", make the case; this is torchtitan's op-level variant of it). The policy
  is asked about every op as the block runs (a Python dispatch mode): on an H200 with compiled
  blocks it kept 0.60 of no checkpointing's throughput, the host being the bottleneck.
- **budget** (compiled blocks or model only): no hooks; the compiler's min-cut partitioner
  decides once per graph what to keep, within `training.activation_memory_budget` (0: what
  full checkpointing keeps, 1: what no checkpointing keeps), recomputing the ops with the
  fewest FLOPs per byte first, so elementwise work goes before any matmul. It is the selective
  idea inside the compiled graph, at no per-op cost at run time. The attention, left out of the
  graphs (`compile.py`), keeps its outputs as without checkpointing.

Applied with torch's composable `checkpoint`, which hooks the block instead of wrapping it: the
module tree and the parameter names stay as they are, so checkpoints do not depend on it.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch._functorch.config
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from longrun.trainer.model import blocks

MODES = ("none", "full", "selective", "budget")


def _ops(*names: str) -> frozenset:
    """The overloads of the named ops that this torch build has (kernels differ by device)."""
    # Registers torch_attn._varlen_attn, the packed (varlen) flash kernel, where torch has it.
    with contextlib.suppress(ImportError):
        import torch.nn.attention.varlen
    found = []
    for name in names:
        namespace, op = name.split(".", 1)
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            found.append(packet.default)
    return frozenset(found)


# What selective checkpointing keeps: results that are expensive to compute again.
_KEEP = _ops(
    "aten.mm", "aten.addmm", "aten.bmm",
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._flash_attention_forward",
    # The packed-documents kernel on CUDA (packed_attention.py). It is one custom op over
    # aten._flash_attention_forward, so without it here the whole attention ran again in
    # backward: the GPU run of issue 40 counted twice the forward calls (once named, the
    # flash forward ran once per attention again; docs/benchmarks.md).
    "torch_attn._varlen_attn",
    "_c10d_functional.reduce_scatter_tensor", "_c10d_functional.all_gather_into_tensor",
    "_c10d_functional.all_reduce",
)


def _keep_expensive(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: torch.nn.Module, mode: str, *, budget: float = 0.5,
                                   compiled: bool = False) -> None:
    """Checkpoint every block of `model` (or of its pipeline stages' part) in place ("none"
    leaves the model as it is). "budget" hooks nothing: it sets the partitioner's budget for the
    graphs `compiled` (the caller compiles next) will make."""
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing must be one of {MODES}, got {mode!r}")
    # The partitioner's budget is process-wide and read when a graph is compiled (at its first
    # call): set it for every model, so one built after a budgeted one is not partitioned by it.
    torch._functorch.config.activation_memory_budget = budget if mode == "budget" else 1.0
    if mode == "budget" and not compiled:
        raise ValueError("activation_checkpointing: budget needs compiled blocks or model, and this "
                         "model is not compiled (training.compile: auto is none on the CPU); set "
                         "training.compile: blocks, or use activation_checkpointing: selective or full")
    if mode in ("none", "budget"):
        return
    # The model draws no random numbers (no dropout): nothing to replay in the recompute.
    options = {"preserve_rng_state": False}
    if mode == "selective":
        options["context_fn"] = partial(create_selective_checkpoint_contexts, _keep_expensive)
    for block in blocks(model):
        checkpoint(block, **options)
