"""What the trainer holds instead of a bare model: the model with its parallelisms applied,
and the few things the step needs to ask of the layout.

`parallelize` (parallelize.py) returns one of these; the step then never asks which
parallelisms are on:

    forward              the module to call (DDP's wrapper, or the model itself)
    micro_batch(last)    around one micro-batch's forward and backward (DDP: no_sync unless last)
    loss_parallel()      around the loss and its backward (TP: the vocabulary-sharded loss)
    all_reduce_sum(t)    a sum of small values over the span (token counts, the loss)
    state_dicts / load_state_dicts   what a checkpoint holds of the model and the optimizer
    state_bytes(optimizer)   how much of that this rank holds (what sharding divides)
    rank, size           this rank's place in the span its data is drawn for
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor


class ParallelModel:
    """The plain case (one process, or every rank holding the whole model): `module` is called
    directly and its state is whole on every rank. Subclasses change what their layout needs."""

    # True where every rank must run every micro-batch (FSDP gathers parameters in each one's
    # forward); False where an idle rank may skip all but the last (DDP syncs only there).
    syncs_every_micro_batch = False
    # True where the layout already computes in bf16 (FSDP2's mixed precision, precision.py):
    # the step then runs without autocast, which would only re-cast what is cast already.
    casts_parameters = False

    def __init__(self, module: torch.nn.Module, group: dist.ProcessGroup | None):
        self.module = module
        self.group = group  # the span: the ranks whose gradients are summed together
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    @property
    def forward(self) -> torch.nn.Module:
        return self.module

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        yield

    def loss_parallel(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum `tensor` over the span in place (a no-op alone) and return it."""
        if self.size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes of training state this rank holds: its pieces of the parameters, of their
        gradients (when present) and of the optimizer's state."""
        def held(t: Tensor) -> int:
            local = t.to_local() if isinstance(t, DTensor) else t
            return local.numel() * local.element_size()

        params = list(self.module.parameters())
        moments = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
        return {"parameters": sum(held(p) for p in params),
                "gradients": sum(held(p.grad) for p in params if p.grad is not None),
                "optimizer": sum(held(v) for v in moments)}

    def state_dicts(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """(model, optimizer) state to checkpoint, by parameter name in every layout (torch's
        `get_state_dict`: the optimizer's state keyed by name, not position), so a checkpoint
        of whole weights and one of DTensor pieces name the same tensors and either restores
        into the other. Where the weights are sharded it holds this rank's pieces. Note:
        an optimizer without state yet (before its first step) is given one (a step at lr 0)."""
        return get_state_dict(self.module, optimizer)

    def load_state_dicts(self, optimizer: torch.optim.Optimizer, model: dict, optim: dict) -> None:
        set_state_dict(self.module, optimizer, model_state_dict=model, optim_state_dict=optim)
