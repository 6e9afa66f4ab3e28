"""What one optimizer step computes on this rank: its micro-batches, as one shape for every
layout.

A step is one *global* batch (`packing.global_batches`: documents in the one global order up
to the global token budget), drawn the same by every rank of the span, so its loss-token count
is known everywhere and no rank's share depends on how many ranks there are. Without context
parallelism `data_parallel_step` splits it: whole documents, longest first to the least-loaded
rank (`split_among_ranks`), each rank's packed into micro-batches of at most
data.micro_batch_tokens (`pack_first_fit`), every rank running as many micro-batches as the
busiest one (idle ones pad). Every rank computes the same split from the lengths alone, and
reads only its own documents. Under pipeline parallelism the draw itself packed the batch into
the job's fixed count of micro-batches per rank (`fixed_bins.py`) and `pipeline_step` deals them
out: no rank is ever idle there. Under context parallelism (`cp/batches.py`) the planner splits
it instead, and a micro-batch may be a slice of documents spread over a CP group. Both become
a `StepWork`, and the trainer has one forward/backward path over it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from longrun.data.corpus import Corpus
from longrun.data.packing import GlobalBatch, MicroBatch, build_micro_batch

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
    # Loss tokens of the whole global batch, known to every rank (it drew the whole batch);
    # None when each rank knows only its own and they must be summed (`plain_step`).
    loss_tokens: int | None
    sampler_state: dict[str, Any] | None  # where the data goes on after this step
    plan: Plan | None = None  # the context-parallel plan, for metrics
    # What this rank's share costs in the planner's model (predicted seconds, the sum over its
    # micro-batches of its CP group's time); None without a plan: the trainer then counts the
    # documents' FLOPs (`Trainer.last_work_cost`). The straggler attribution compares it across ranks.
    cost: float | None = None

    @property
    def tokens(self) -> int:
        return sum(w.tokens for w in self.micro_batches)


def split_among_ranks(lengths: np.ndarray, n_ranks: int) -> list[list[int]]:
    """Which documents of a global batch (positions into `lengths`) each rank trains, each list
    in global order: longest first to the least-loaded rank (by tokens), ties to the earlier
    document and the lower rank. A function of the lengths alone, so every rank computes the
    same split without talking."""
    order = np.lexsort((np.arange(len(lengths)), -np.asarray(lengths)))
    loads = [(0, rank) for rank in range(n_ranks)]  # a heap: the least loaded, then the lowest
    shares: list[list[int]] = [[] for _ in range(n_ranks)]
    for i in order.tolist():
        load, rank = heapq.heappop(loads)
        shares[rank].append(i)
        heapq.heappush(loads, (load + int(lengths[i]), rank))
    return [sorted(share) for share in shares]


def pack_first_fit(positions: list[int], lengths: np.ndarray, token_budget: int) -> list[list[int]]:
    """One rank's documents into micro-batches of at most `token_budget` tokens, first-fit
    decreasing (few micro-batches, so few idle ones on the other ranks); each micro-batch's
    documents in global order."""
    order = sorted(positions, key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = int(lengths[i])
        if n > token_budget:
            raise ValueError(f"a document of {n} tokens does not fit data.micro_batch_tokens "
                             f"({token_budget}); raise micro_batch_tokens to at least model.max_seq_len")
        k = next((k for k, free in enumerate(room) if free >= n), len(bins))
        if k == len(bins):
            bins.append([])
            room.append(token_budget)
        bins[k].append(i)
        room[k] -= n
    return [sorted(b) for b in bins]


def data_parallel_step(batch: GlobalBatch, corpus: Corpus, rank: int, n_ranks: int,
                       token_budget: int) -> StepWork:
    """This rank's part of a global batch split among `n_ranks` ranks (no context parallelism):
    its micro-batches, then idle ones up to the busiest rank's count (the ranks step through
    micro-batches in lock-step: the last one synchronises the gradients)."""
    packed = [pack_first_fit(share, batch.lengths, token_budget)
              for share in split_among_ranks(batch.lengths, n_ranks)]
    work = [MicroBatchWork(mb, mb) for mb in (_read(batch, corpus, positions) for positions in packed[rank])]
    work += [MicroBatchWork(None, None)] * (max(map(len, packed)) - len(work))
    return StepWork(work, loss_tokens=batch.loss_tokens, sampler_state=batch.sampler_state)


def pipeline_step(batch: GlobalBatch, corpus: Corpus, rank: int, n_ranks: int) -> StepWork:
    """This rank's part of a global batch the draw packed into a fixed count of micro-batches
    (`fixed_bins.pipeline_batches`, under pipeline parallelism): every `n_ranks`-th of them,
    from the `rank`-th on, so every rank runs the same count, each with real tokens. The ranks
    compute the same deal from the batch alone."""
    bins = batch.micro_batches
    if bins is None or len(bins) % n_ranks:
        raise ValueError(f"a pipeline step needs a global batch packed into a multiple of the span's "
                         f"{n_ranks} ranks, got {None if bins is None else len(bins)} micro-batches")
    # The draw leaves no bin empty; one that were would run idle (the pipeline counts those).
    mine = [_read(batch, corpus, list(positions)) if positions else None for positions in bins[rank::n_ranks]]
    work = [MicroBatchWork(mb, mb) for mb in mine]
    return StepWork(work, loss_tokens=batch.loss_tokens, sampler_state=batch.sampler_state)


def _read(batch: GlobalBatch, corpus: Corpus, positions: list[int]) -> MicroBatch:
    ids = batch.indices[positions]
    return build_micro_batch([corpus[int(i)] for i in ids], doc_ids=ids)


def plain_step(batches: list[MicroBatch]) -> StepWork:
    """A step of micro-batches this rank was handed (e.g. by a test): each rank knows only its
    own loss-token count, so the trainer sums them over the ranks."""
    return StepWork([MicroBatchWork(mb, mb) for mb in batches], loss_tokens=None,
                    sampler_state=batches[-1].sampler_state if batches else None)


def planned_step(step: PlannedStep, setup: ContextParallelSetup, device) -> StepWork:
    """This rank's part of a planned global batch."""
    return StepWork([planned_work(rmb, setup, device) for rmb in step.micro_batches],
                    loss_tokens=step.loss_tokens, sampler_state=step.sampler_state, plan=step.plan,
                    cost=sum(rmb.group.predicted_s for rmb in step.micro_batches))


def planned_work(rmb: RankMicroBatch, setup: ContextParallelSetup, device) -> MicroBatchWork:
    from longrun.trainer.cp.batches import cp_attention_for

    if rmb.idle:
        return MicroBatchWork(None, None)
    if rmb.shard is None:  # a group of one: whole documents, plain attention
        return MicroBatchWork(rmb.batch, rmb.batch)
    return MicroBatchWork(rmb.shard, rmb.batch, share=rmb.group.cp,
                          attention=lambda: cp_attention_for(rmb, setup, device))
