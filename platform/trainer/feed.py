"""Where each step's work comes from: the corpus, the resumable sampler, one global batch per
step and this rank's part of it (split, or under context parallelism planned), made in a
prefetch thread.

    feed = StepFeed(cfg, corpus, sampler, cp=setup, device=device, rank=r, ranks=n)
    work, waited = feed.next()     # this rank's StepWork for the next step
    feed.done(work)                # the step happened: its data is consumed
    feed.state                     # the sampler position after the last step done (checkpointed)

Every rank of the span draws the same global batch of `cfg.global_batch_tokens` tokens from the
one global order, so `state` is the same on every rank and names no rank or layout: it loads
at any world size, and a job resumed on fewer or more ranks trains the same batches. Under
pipeline parallelism the draw packs each global batch straight into the job's fixed count of
micro-batches per rank (`fixed_bins.py`; at most that many x micro_batch_tokens x the span).

The prefetch thread runs ahead of training, so the live sampler is never the position to save:
each step's work carries the position after it, and only a step marked done moves `state`.
`close()` stops the thread; the next `next()` starts again from `state`. That is how a step
that failed, or a restore, rewinds the data.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from longrun.config import JobConfig
from longrun.config.memory import pipeline_micro_batches
from longrun.data.corpus import Corpus
from longrun.data.documents import DocumentSampler
from longrun.data.fixed_bins import pipeline_batches
from longrun.data.mixture import MixtureSampler
from longrun.data.packing import Prefetcher, global_batches
from longrun.trainer.cp.batches import ContextParallelSetup, planned_steps
from longrun.trainer.step import StepWork, data_parallel_step, pipeline_step, planned_step


class StepFeed:
    """`rank` of `ranks`: this rank's place in the span the global batch is split over (without
    context parallelism; under it the setup knows its span)."""

    def __init__(self, cfg: JobConfig, corpus: Corpus, sampler: DocumentSampler | MixtureSampler, *,
                 cp: ContextParallelSetup | None, device: torch.device, rank: int = 0, ranks: int = 1):
        if not 0 <= rank < ranks:
            raise ValueError(f"rank ({rank}) must lie in [0, ranks = {ranks})")
        self.cfg, self.corpus, self.sampler, self.cp, self.device = cfg, corpus, sampler, cp, device
        self.rank, self.ranks = rank, ranks
        self.state: dict[str, Any] = sampler.state_dict()
        self._prefetcher: Prefetcher[Any] | None = None

    def _source(self) -> Prefetcher[Any]:
        """This rank's `StepWork` per step; under context parallelism, planned global batches
        (`PlannedStep`), whose plans the prefetch thread makes while the current step trains."""
        if self._prefetcher is None:
            self.sampler.load_state_dict(self.state)
            source = draw_steps(self.cfg, self.corpus, self.sampler, cp=self.cp, rank=self.rank,
                                ranks=self.ranks)
            self._prefetcher = Prefetcher(source, self.cfg.data.prefetch)
        return self._prefetcher

    def next(self) -> tuple[StepWork, float]:
        """The next step's work and the seconds spent waiting for it."""
        data = self._source()
        return as_work(next(data), self.cp, self.device), data.last_wait_s

    def done(self, work: StepWork) -> None:
        """`work`'s step happened (trained or skipped): its data is consumed."""
        self.state = work.sampler_state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpointed position (checked against this corpus, seed and mixture)."""
        self.close()  # the data thread must not run while the sampler is repositioned
        self.sampler.load_state_dict(state)
        self.state = self.sampler.state_dict()  # in this longrun's form (an older one's extra keys go)

    def close(self) -> None:
        """Stop the data thread. The sampler may then be repositioned; training may go on."""
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None


def draw_steps(cfg: JobConfig, corpus: Corpus, sampler: DocumentSampler | MixtureSampler, *,
               cp: ContextParallelSetup | None, rank: int, ranks: int) -> Iterator[Any]:
    """Each step's global batch from `sampler`'s position on, as this rank's part of it: a
    `StepWork`, or under context parallelism a `PlannedStep` (`as_work` makes it one). Training's
    feed and validation (`validation.py`) draw alike, so both fit every layout."""
    budget = cfg.data.micro_batch_tokens
    if cfg.dims.pp > 1:
        # The schedule runs the job's one count of micro-batches, each full length:
        # the draw packs every step into exactly that many per rank, none empty.
        count = pipeline_micro_batches(cfg.training, cfg.data, cfg.dims)
        packed = pipeline_batches(corpus, sampler, count * ranks, budget)
        return (pipeline_step(batch, corpus, rank, ranks) for batch in packed)
    batches = global_batches(corpus, sampler, cfg.global_batch_tokens)
    if cp is None:
        return (data_parallel_step(batch, corpus, rank, ranks, budget) for batch in batches)
    return planned_steps(batches, corpus, cp, budget)


def as_work(item: Any, cp: ContextParallelSetup | None, device: torch.device) -> StepWork:
    """What `draw_steps` yielded, as this rank's `StepWork`."""
    return item if cp is None else planned_step(item, cp, device)
