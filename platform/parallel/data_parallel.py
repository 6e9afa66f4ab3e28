"""Data-parallel gradient synchronisation, overlapped with backward.

PyTorch's DistributedDataParallel already does the overlap well: gradients are grouped into
buckets in the order backward produces them, and each bucket's all-reduce is launched from an
autograd hook the moment its last gradient is ready, while backward goes on computing the
earlier layers. longrun adds only what its loop needs on top:

- **A summing communication hook.** The loop normalises the loss by the token count of the
  whole *global* step (all ranks, all micro-batches), so each rank's gradient is already its
  share of the global mean and the ranks' gradients must be *summed*. DDP's default averages
  (divides by the world size), which would weight a rank's tokens by how the batch happened to
  be split. The hook also saves DDP's division pass over every gradient.
- **Accumulation without extra syncs**: every micro-batch but the last runs under `no_sync()`.
- **Bucket layout fixed before the first real step.** DDP rebuilds its buckets once, after its
  first backward, in the order gradients became ready. A sum's rounding depends on where an
  element sits in its bucket (a ring all-reduce adds the ranks in an order that depends on the
  chunk), so a run resumed from a checkpoint would reduce step k+1 with different buckets from
  the uninterrupted run and drift from it by float rounding at 3+ ranks. One tiny priming
  backward at construction (two tokens; its gradients are discarded) makes every real step of
  every run use the rebuilt layout, so resuming is bitwise exact at any world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from longrun.parallel.parallel_model import ParallelModel


# Unannotated on purpose: DDP checks a hook's annotations against the real classes, and this
# module's annotations are strings. (group: ProcessGroup, bucket: GradBucket) -> Future[Tensor]
def _sum_allreduce_hook(group, bucket):
    work = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def summing_ddp(module: torch.nn.Module, group: dist.ProcessGroup, *, bucket_mb: float,
                kind: type[DistributedDataParallel] = DistributedDataParallel) -> DistributedDataParallel:
    """`module` under DDP (or the subclass `kind`) over `group`, its gradients summed (see the
    module docstring)."""
    # device_ids stays None even on CUDA: DDP would otherwise copy every forward input to the
    # device, including cu_seqlens, which the model keeps on the host on purpose.
    ddp = kind(
        module, process_group=group, bucket_cap_mb=bucket_mb,
        forward_sync_buffers=False,  # the only buffers are rotary tables, equal everywhere
        gradient_as_bucket_view=True,  # no second copy of the gradients
    )
    ddp.register_comm_hook(group, _sum_allreduce_hook)
    return ddp


class DataParallel(ParallelModel):
    """Wraps `model` for data parallelism over `group` (None or a group of one: no wrapping,
    no communication). Call the model through `forward`; keep using `module` (the plain model)
    for state_dicts, so checkpoints do not depend on the parallel layout."""

    def __init__(self, model: torch.nn.Module, group: dist.ProcessGroup | None, *,
                 bucket_mb: float = 25.0,
                 prime: Callable[[torch.nn.Module], Tensor] | None = None):
        super().__init__(model, group)
        self._ddp: DistributedDataParallel | None = None
        if self.size > 1:
            self._ddp = summing_ddp(model, group, bucket_mb=bucket_mb)
            if prime is not None:
                prime(self._ddp).backward()
                for p in model.parameters():
                    p.grad = None

    @property
    def forward(self) -> torch.nn.Module:
        return self._ddp if self._ddp is not None else self.module

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        """Backward inside this block accumulates locally unless `last`, when the summed
        gradients are synchronised, overlapped with the backward itself."""
        if self._ddp is None or last:
            yield
        else:
            with self._ddp.no_sync():
                yield
