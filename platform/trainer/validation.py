"""Validation: the mean token loss on held-out data every `validation.interval_steps` steps, on
every rank at the job's layout.

    validator = Validator(cfg, held_out, cp=setup, rank=r, ranks=n, device=d)
    if validator.due(trainer.step):
        loss, seconds = validator.run(trainer)      # every rank, after the same step's update

What a pass evaluates: the first `validation.steps` global batches of the held-out stream, the
same ones every pass (as torchtitan and Megatron-LM do), drawn from the start of a fixed order of
the held-out corpus (`VALIDATION_SEED`, not the job's seed: jobs with different seeds validate on
the same tokens). So the position in the held-out data is a constant, nothing of it needs a
checkpoint, and a resumed job computes the same losses as an uninterrupted one (bitwise on the
CPU, where the weights are bitwise too). Each global batch is drawn and split as training's are
(`feed.draw_steps`: split among the span, planned over CP groups, packed into the pipeline's
fixed micro-batch count), so every layout runs it, and a pass costs `steps` forward passes of a
training step.

The loss is the trainer's (`Trainer.forward_loss`: the model in eval mode, no gradient, the same
forward and loss as training, the pipeline's last stage computing it): every micro-batch's summed
token losses, summed over the span and divided by the loss tokens of all the pass's global
batches, which every rank knows. Every rank returns the same number, and layouts agree up to the
float summation order.

Where the held-out corpus comes from: `data/held_out.py` (a share of the training documents, or
`validation.path`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from longrun.config import JobConfig
from longrun.data.documents import DocumentSampler
from longrun.kinds import Phase
from longrun.trainer.cp.batches import ContextParallelSetup
from longrun.trainer.feed import as_work, draw_steps
from longrun.trainer.step import StepWork

if TYPE_CHECKING:
    from longrun.trainer.trainer import Trainer

VALIDATION_SEED = 0x7A1  # the held-out stream's order: fixed, whatever the job's seed


class Validator:
    """`rank` of `ranks`: this rank's place in the span, as for the training feed."""

    def __init__(self, cfg: JobConfig, corpus, *, cp: ContextParallelSetup | None, rank: int, ranks: int,
                 device: torch.device):
        self.cfg, self.corpus, self.cp, self.device = cfg, corpus, cp, device
        self.rank, self.ranks = rank, ranks
        self.interval = cfg.validation.interval_steps or 0

    def due(self, step: int) -> bool:
        return self.interval > 0 and step > 0 and step % self.interval == 0

    def works(self) -> Iterator[StepWork]:
        """This rank's part of each of the pass's global batches, from the stream's start. One
        order over the whole held-out corpus (a mixture's weights are the training draw's)."""
        sampler = DocumentSampler(len(self.corpus), seed=VALIDATION_SEED)
        drawn = draw_steps(self.cfg, self.corpus, sampler, cp=self.cp, rank=self.rank, ranks=self.ranks)
        for item in itertools.islice(drawn, self.cfg.validation.steps):
            yield as_work(item, self.cp, self.device)

    def run(self, trainer: Trainer) -> tuple[float, float]:
        """(the mean token loss of the pass, its seconds), the same on every rank."""
        started = time.perf_counter()
        trainer.on_phase(Phase.VALIDATION)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = 0
        trainer.model.eval()
        try:
            with torch.no_grad():
                for work in self.works():
                    total += trainer.forward_loss(work)
                    tokens += work.loss_tokens or 0
        finally:
            trainer.model.train()
        loss = (total / max(tokens, 1)).item()  # the one host synchronisation of the pass
        return loss, time.perf_counter() - started
