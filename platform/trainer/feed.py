"""Where each step's work comes from: the corpus, the resumable sampler, and packing (under
context parallelism: planning global batches) in a prefetch thread.

    feed = StepFeed(cfg, corpus, sampler, cp=setup, device=device)
    work, waited = feed.next()     # this rank's StepWork for the next step
    feed.done(work)                # the step happened: its data is consumed
    feed.state                     # the sampler position after the last step done (checkpointed)

The prefetch thread runs ahead of training, so the live sampler is never the position to save:
each step's work carries the position after it, and only a step marked done moves `state`.
`close()` stops the thread; the next `next()` starts again from `state`. That is how a step
that failed, or a restore, rewinds the data.
"""

from __future__ import annotations

from typing import Any

import torch

from longrun.config import JobConfig
from longrun.trainer.corpus import Corpus
from longrun.trainer.cp.batches import ContextParallelSetup, planned_steps
from longrun.trainer.data import DocumentSampler
from longrun.trainer.mixture import MixtureSampler
from longrun.trainer.packing import Prefetcher, packed_micro_batches
from longrun.trainer.step import StepWork, plain_step, planned_step


class StepFeed:
    def __init__(self, cfg: JobConfig, corpus: Corpus, sampler: DocumentSampler | MixtureSampler, *,
                 cp: ContextParallelSetup | None, device: torch.device):
        self.cfg, self.corpus, self.sampler, self.cp, self.device = cfg, corpus, sampler, cp, device
        self.state: dict[str, Any] = sampler.state_dict()
        self._prefetcher: Prefetcher[Any] | None = None

    def _source(self) -> Prefetcher[Any]:
        """Micro-batches; under context parallelism, planned global batches (`PlannedStep`),
        whose plans the prefetch thread makes while the current step trains."""
        if self._prefetcher is None:
            self.sampler.load_state_dict(self.state)
            budget = self.cfg.data.micro_batch_tokens
            source: Any
            if self.cp is None:
                source = packed_micro_batches(self.corpus, self.sampler, budget)
            else:
                global_tokens = budget * self.cfg.training.grad_accum * self.cp.span_size
                source = planned_steps(packed_micro_batches(self.corpus, self.sampler, global_tokens),
                                       self.cp, budget)
            self._prefetcher = Prefetcher(source, self.cfg.data.prefetch)
        return self._prefetcher

    def next(self) -> tuple[StepWork, float]:
        """The next step's work and the seconds spent waiting for it."""
        data = self._source()
        if self.cp is not None:
            return planned_step(next(data), self.cp, self.device), data.last_wait_s
        batches, wait = [], 0.0
        for _ in range(self.cfg.training.grad_accum):
            batches.append(next(data))
            wait += data.last_wait_s
        return plain_step(batches), wait

    def done(self, work: StepWork) -> None:
        """`work`'s step happened (trained or skipped): its data is consumed."""
        self.state = work.sampler_state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpointed position (checked against this corpus and layout)."""
        self.close()  # the data thread must not run while the sampler is repositioned
        self.sampler.load_state_dict(state)
        self.state = dict(state)

    def close(self) -> None:
        """Stop the data thread. The sampler may then be repositioned; training may go on."""
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
