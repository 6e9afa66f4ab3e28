"""Tensor and sequence parallelism for the Llama-style decoder, through DTensor.

Megatron's layout (and torchtitan's plan for the same model), on the TP group of a node:

- **Column-wise** q/k/v and MLP up/gate projections: each rank computes its own heads and its
  slice of the hidden layer, with no communication inside the block.
- **Row-wise** attention output and MLP down projections: each rank's partial sums are
  reduce-scattered back to the residual stream.
- **Sequence parallel** everywhere else: the residual stream, the norms and the embedding's
  output hold 1/tp of the tokens each (`Shard(0)` of the packed [T, dim] stream), so the
  activations between blocks are not replicated; a block's input is all-gathered where the
  column-wise projections need every token, and the row-wise output is reduce-scattered
  rather than all-reduced (the same bytes as Megatron's all-reduce, split in two halves).
- **Vocabulary-parallel embedding and loss**: the embedding table and the output layer are
  sharded by vocabulary; the logits stay sharded by vocabulary (`Shard(-1)`) into the loss,
  which `loss_parallel` computes without ever gathering [T, vocab]. Tied embeddings stay
  tied: both are `Shard(0)` of the same matrix on the same mesh.

The packed stream must hold a multiple of tp tokens for the sequence shards; the model pads
the stream (`Transformer.sequence_multiple`) and the attention never sees the padding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from longrun.trainer.model import Transformer, blocks

if TYPE_CHECKING:
    from longrun.parallel.pipeline import PipelineParts

_SEQ = Shard(0)  # the packed stream is [tokens, ...]: sequence parallel splits dim 0


def _block_plan() -> dict:
    # Attention and feed-forward take (x, cos, sin, layout) and (x,): only x is gathered.
    return {
        "attention_norm": SequenceParallel(sequence_dim=0),
        "attention": PrepareModuleInput(input_layouts=(_SEQ, None, None, None),
                                        desired_input_layouts=(Replicate(), None, None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=_SEQ),
        "ffn_norm": SequenceParallel(sequence_dim=0),
        "feed_forward": PrepareModuleInput(input_layouts=(_SEQ,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=_SEQ),
    }


def apply_tensor_parallel(model: Transformer | PipelineParts, tp_mesh: DeviceMesh) -> None:
    """Shard `model` in place over the 1-D `tp_mesh` (see the module docstring). Head counts,
    the hidden size and the vocabulary must divide by the TP degree (the config checks say so
    before anything is built)."""
    tp = tp_mesh.size()
    cfg = model.cfg
    for what, n in (("model.n_heads", cfg.n_heads), ("the KV heads", cfg.kv_heads),
                    ("the feed-forward hidden size", cfg.hidden_dim), ("model.vocab_size", cfg.vocab_size)):
        if n % tp:
            raise ValueError(f"{what} ({n}) must be divisible by parallelism.tp ({tp})")
    # A pipeline stage holds the embedding (first), the norm and output (last) or neither.
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=_SEQ),
        "norm": SequenceParallel(sequence_dim=0),
        # Logits stay DTensors sharded by vocabulary: the trainer's loss runs under loss_parallel.
        "output": ColwiseParallel(input_layouts=_SEQ, output_layouts=Shard(-1), use_local_output=False),
    }
    held = {name: style for name, style in plan.items() if hasattr(model, name)}
    if held:
        parallelize_module(model, tp_mesh, held)
    for block in blocks(model):
        parallelize_module(block, tp_mesh, _block_plan())
    if cfg.tie_embeddings:
        # parallelize_module gave each module its own DTensor parameter: tie them again (the
        # embedding's row-wise and the output's column-wise shards are the same Shard(0)).
        model.output.weight = model.tok_embeddings.weight
    model.sequence_multiple = tp
