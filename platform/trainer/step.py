"""What one optimizer step computes on this rank: its micro-batches, as one shape for every
layout.

Plain and data-parallel training is the degenerate plan: each rank packs its own micro-batches
of whole documents, and the loss-token count of the global batch is only known after summing
over the ranks. Under context parallelism (`cp/batches.py`) the step is a planned global batch:
every rank of the span draws the same documents, so the count is known everywhere, and a
micro-batch may be a slice of documents spread over a CP group, or idle. Both become a `StepWork`,
and the trainer has one forward/backward path over it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from longrun.trainer.packing import MicroBatch

if TYPE_CHECKING:
    from longrun.trainer.cp.batches import ContextParallelSetup, PlannedStep, RankMicroBatch
    from longrun.trainer.cp.layout import LocalShard
    from longrun.trainer.cp.planner import Plan


@dataclass(frozen=True)
class MicroBatchWork:
    """One micro-batch of this rank."""

    inputs: MicroBatch | LocalShard | None  # None: idle, it only joins the gradient sync
    documents: MicroBatch | None  # the whole documents it covers (for FLOPs); None when idle
    share: int = 1  # ranks splitting those documents (this rank does 1/share of their FLOPs)
    # Builds the attention the model uses for a slice of documents spread over a CP group;
    # None: plain packed attention over whole documents.
    attention: Callable[[], Any] | None = None

    @property
    def idle(self) -> bool:
        return self.inputs is None

    @property
    def tokens(self) -> int:
        """Input tokens this rank processes."""
        return 0 if self.documents is None else len(self.documents.tokens) // self.share


@dataclass(frozen=True)
class StepWork:
    micro_batches: list[MicroBatchWork]
    # Loss tokens of the whole global batch when every rank knows it (a planned batch); None
    # when each rank knows only its own and they must be summed over the ranks.
    loss_tokens: int | None
    sampler_state: dict[str, Any] | None  # where the data goes on after this step
    plan: Plan | None = None  # the context-parallel plan, for metrics

    @property
    def tokens(self) -> int:
        return sum(w.tokens for w in self.micro_batches)


def plain_step(batches: list[MicroBatch]) -> StepWork:
    """A step of this rank's own micro-batches (no context parallelism)."""
    return StepWork([MicroBatchWork(mb, mb) for mb in batches], loss_tokens=None,
                    sampler_state=batches[-1].sampler_state if batches else None)


def planned_step(step: PlannedStep, setup: ContextParallelSetup, device) -> StepWork:
    """This rank's part of a planned global batch."""
    return StepWork([planned_work(rmb, setup, device) for rmb in step.micro_batches],
                    loss_tokens=step.loss_tokens, sampler_state=step.sampler_state, plan=step.plan)


def planned_work(rmb: RankMicroBatch, setup: ContextParallelSetup, device) -> MicroBatchWork:
    from longrun.trainer.cp.batches import cp_attention_for

    if rmb.idle:
        return MicroBatchWork(None, None)
    if rmb.shard is None:  # a group of one: whole documents, plain attention
        return MicroBatchWork(rmb.batch, rmb.batch)
    return MicroBatchWork(rmb.shard, rmb.batch, share=rmb.group.cp,
                          attention=lambda: cp_attention_for(rmb, setup, device))
