"""Pipeline parallelism: the decoder cut into stages by transformer blocks, run by one of
`torch.distributed.pipelining`'s schedules.

    plan = PipelinePlan(group=pp_group, rank=r, schedule="interleaved_1f1b", virtual_stages=2)
    pipe = parallelize(model, dims, training, span_group=g, pipeline=plan)   # a PipelinedModel
    loss = pipe.forward_backward(micro_batches, loss_tokens)  # a whole step; this rank's loss share

What longrun decides, and why:

- **Names stay the model's.** This rank's pieces (`PipelineParts`) are registered under the
  whole model's names (`tok_embeddings` on the first stage, `layers.N`, `norm` and `output`
  on the last), so its state_dict names the same tensors as an unsplit model's and a
  checkpoint restores at any pp degree, or none.
- **One fixed micro-batch shape.** The schedules send activations between stages into buffers
  sized once, so every micro-batch is padded to `data.micro_batch_tokens` (rounded up to tp
  for sequence parallelism). Padding attends to nothing and has no target. The documents of a
  micro-batch (their boundaries and positions) are not sent: every rank of a pipeline drew
  the same global batch, so each stage builds its micro-batches' attention layouts itself,
  and the schedule hands a stage only the micro-batch's index (`mb`, a keyword the schedule
  splits like any other) to look them up.
- **The loss is the global batch's.** Each micro-batch's loss is its summed token losses over
  the global batch's loss-token count, with the schedule's own gradient scaling off
  (`scale_grads=False`): scaling by the micro-batch count as well would shrink the gradients
  silently (torchtitan's fix for the same issue).
- **One micro-batch count per job, none empty.** Every step runs the job's count
  (`config.memory.pipeline_micro_batches`: training.grad_accum, or the micro-batches per rank
  the global batch holds), which the config check holds to what the schedule runs (at least
  one per stage, a multiple of pp when interleaved). The feed packs each step's global batch
  into exactly that many per rank (`data/fixed_bins.py`), so no full-length empty micro-batch is
  computed, and the schedule is built once, on the first step. A step of another count is
  refused; `empty_micro_batches` counts the idle ones (None) a caller handed in.
- **Data parallelism per stage.** DDP (`StageDDP`: a summing hook, as `data_parallel.py`) or
  FSDP2 wraps each stage module; the stage runs every micro-batch but the last without
  gradient sync.
  FSDP keeps a stage's blocks gathered from forward to backward (no reshard after forward:
  with many micro-batches in flight, gathering each block again per micro-batch would
  multiply its all-gathers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _find_tensors

from longrun.data.packing import IGNORE_INDEX, MicroBatch, build_micro_batch
from longrun.parallel.parallel_model import ParallelModel
from longrun.parallel.schedules import (
    MULTI_STAGE,
    SCHEDULE_NAMES,
    micro_batches_to_run,
    stage_layers,
    stages_of_rank,
    stages_per_rank,
)
from longrun.trainer.model import PackedStream, Transformer, packed_stream

# training.pp_schedule -> torch's schedule class (the names and their shapes: schedules.py).
SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv_zero_bubble": ScheduleZBVZeroBubble,
}
assert tuple(SCHEDULES) == SCHEDULE_NAMES
CPU = torch.device("cpu")


class StageDDP(DistributedDataParallel):
    """DDP for a pipeline stage: every forward runs without preparing a gradient sync, and the
    schedule prepares the one sync of a step itself, before the last micro-batch's backward.

    The schedule already wraps its own forwards in `no_sync()`, but when it builds a schedule it
    infers the stage's shapes with a forward of its own through the module, outside `no_sync()`.
    Plain DDP would then expect a sync in the next backward, the first micro-batch's, and
    reduce its gradients early: they would be summed twice by the step's end."""

    def forward(self, *args, **kwargs):
        with self.no_sync():
            return super().forward(*args, **kwargs)


class PipelineParts(nn.Module):
    """This rank's pieces of the decoder, under the whole model's names: what the optimizer,
    gradient clipping and checkpoints see."""

    def __init__(self, model: Transformer, layer_ids: Sequence[int], *, first: bool, last: bool):
        super().__init__()
        self.cfg = model.cfg
        if first:
            self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        if last:
            self.norm, self.output = model.norm, model.output
        self.rotary = model.rotary
        self.sequence_multiple = model.sequence_multiple


class StageModule(nn.Module):
    """One pipeline stage: the first embeds, the last normalises and projects to logits. Its
    input is the previous stage's output (the first stage's: the micro-batch's tokens, [1, T]);
    `mb` ([1]) names the micro-batch, whose stream (`StepStreams`) says how tokens attend."""

    def __init__(self, parts: PipelineParts, layer_ids: range, streams: StepStreams, *,
                 first: bool, last: bool):
        super().__init__()
        self.first, self.last, self.streams = first, last, streams
        if first:
            self.tok_embeddings = parts.tok_embeddings
        self.layers = nn.ModuleDict({str(i): parts.layers[str(i)] for i in layer_ids})
        if last:
            self.norm, self.output = parts.norm, parts.output
        self.rotary = parts.rotary

    def forward(self, x: Tensor, mb: Tensor) -> Tensor:
        stream = self.streams[int(mb.reshape(-1)[0])]
        cos, sin = self.rotary(stream.positions)
        h = self.tok_embeddings(x.reshape(-1)) if self.first else x
        for layer in self.layers.values():
            h = layer(h, cos, sin, stream.layout)
        return self.output(self.norm(h)) if self.last else h


class StepStreams(list):
    """The current step's micro-batches as `PackedStream`s, by index (set before each step)."""


@dataclass(frozen=True)
class PipelinePlan:
    """This rank's place in the pipeline and how the pipeline runs (from the job's config)."""

    group: dist.ProcessGroup | None  # the pp ranks: one per stage position, same data
    rank: int  # this rank's position in it (0: holds the first stage)
    schedule: str = "1f1b"  # training.pp_schedule
    virtual_stages: int = 1  # stages per rank of the multi-stage schedules
    layers_per_stage: tuple[int, ...] | None = None  # parallelism.pp_layers; None: even
    micro_batch_tokens: int = 4096  # the fixed micro-batch shape (data.micro_batch_tokens)
    device: torch.device = CPU  # where this rank's stages run (the rest of the model stays behind)


class PipelinedModel(ParallelModel):
    """The trainer's model under pipeline parallelism: `module` is this rank's `PipelineParts`;
    `forward_backward` runs a step's micro-batches through the schedule. `parallelize` puts
    each of `stage_modules` under its stage's data parallelism in `wrapped` (what the schedule
    calls)."""

    syncs_every_micro_batch = True
    # Micro-batches with no document (handed in as None) of the last step, and of every step
    # so far: a whole micro-batch of compute each. The feed never hands one in.
    empty_micro_batches = 0
    empty_micro_batches_total = 0

    def __init__(self, model: Transformer, *, pp: int, plan: PipelinePlan,
                 span_group: dist.ProcessGroup | None):
        schedule = plan.schedule
        if schedule not in SCHEDULES:
            raise ValueError(f"training.pp_schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        if model.cfg.tie_embeddings:
            raise ValueError("model.tie_embeddings shares the embedding (first stage) with the output "
                             "layer (last stage); pipeline parallelism needs it false")
        self.schedule_name, self.pp, self.pp_rank, self.pp_group = schedule, pp, plan.rank, plan.group
        self.n_stages = pp * stages_per_rank(schedule, plan.virtual_stages)
        self.stage_ids = stages_of_rank(plan.rank, pp, plan.virtual_stages, schedule)
        ranges = stage_layers(model.cfg.n_layers, self.n_stages, plan.layers_per_stage)
        held = sorted(i for s in self.stage_ids for i in ranges[s])
        first, last = 0 in self.stage_ids, self.n_stages - 1 in self.stage_ids
        # Still on the meta device when the trainer built it so: `parallelize` gives this
        # rank's stages memory once they are sharded, and the other stages never get any.
        parts = PipelineParts(model, held, first=first, last=last)
        super().__init__(parts, span_group)
        self.device = plan.device
        self.first, self.last = first, last
        self.micro_batch_tokens = plan.micro_batch_tokens
        self.streams = StepStreams()
        self.stage_modules = [StageModule(parts, ranges[s], self.streams, first=s == 0,
                                          last=s == self.n_stages - 1) for s in self.stage_ids]
        self.wrapped: list[nn.Module] = list(self.stage_modules)  # what the schedule calls
        self.layer_share = len(held) / model.cfg.n_layers  # of the model's FLOPs (for MFU)
        self.loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self._schedule = None
        self._micro_batches = 0
        self._loss_tokens = 1

    def prime(self) -> None:
        """One tiny synchronised forward and backward through each DDP stage, gradients
        discarded: DDP fixes its bucket layout after its first synchronised backward, and a
        resumed run must reduce its first step with the same buckets as the uninterrupted run
        (see data_parallel.py)."""
        self.streams[:] = [self._stream(self._empty())]
        mb = torch.zeros(1, dtype=torch.long)
        for module, stage in zip(self.wrapped, self.stage_modules, strict=True):
            x = (self.streams[0].tokens if stage.first
                 else torch.zeros(self.length, self.module.cfg.dim, device=self.device, requires_grad=True))
            loss = module(x, mb).float().sum() * 0.0
            if isinstance(module, DistributedDataParallel):
                module.reducer.prepare_for_backward(list(_find_tensors(loss)))
            loss.backward()
        self.streams.clear()
        for p in self.module.parameters():
            p.grad = None

    # -- shapes ------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Every micro-batch's padded token count (a multiple of the sequence-parallel degree)."""
        m = self.module.sequence_multiple
        return -(-self.micro_batch_tokens // m) * m

    def _stream(self, mb: MicroBatch) -> PackedStream:
        return packed_stream(self.module.cfg, mb.tokens.to(self.device), mb.positions.to(self.device),
                             mb.cu_seqlens, length=self.length)

    def _empty(self) -> MicroBatch:
        """A micro-batch with nothing to learn: one token, no target (zero loss, zero gradient)."""
        return build_micro_batch([np.array([0])])

    # -- the schedule ------------------------------------------------------------------------
    def _loss(self, logits: Tensor, target: Tensor) -> Tensor:
        token_loss = F.cross_entropy(logits.float(), target.reshape(-1), ignore_index=IGNORE_INDEX,
                                     reduction="sum")
        return token_loss / self._loss_tokens

    def _build_schedule(self, n: int):
        cls = SCHEDULES[self.schedule_name]
        stages = [PipelineStage(module, stage_index=s, num_stages=self.n_stages, device=self.device,
                                group=self.pp_group)
                  for module, s in zip(self.wrapped, self.stage_ids, strict=True)]
        if self.schedule_name in MULTI_STAGE:
            return cls(stages, n_microbatches=n, loss_fn=self._loss, scale_grads=False)
        return cls(stages[0], n_microbatches=n, loss_fn=self._loss, scale_grads=False)

    def micro_batches_needed(self, n: int) -> int:
        """The fewest micro-batches, at least `n`, the schedule runs (one per stage at least;
        the interleaved ones a multiple of pp): a step must have exactly that many."""
        return micro_batches_to_run(self.schedule_name, self.pp, self.n_stages, n)

    def forward_backward(self, micro_batches: Sequence[MicroBatch | None], loss_tokens) -> Tensor:
        """Forward and backward of a step's micro-batches (None: an empty one, counted in
        `empty_micro_batches`) through the pipeline; gradients of the global batch's mean token
        loss accumulate in .grad. Every step has the job's one count, a count the schedule runs:
        the schedule is built for it on the first step and never again. Returns this rank's
        share of that loss (its micro-batches' token losses over `loss_tokens`; nonzero on the
        last stage only)."""
        self.empty_micro_batches = sum(mb is None for mb in micro_batches)
        self.empty_micro_batches_total += self.empty_micro_batches
        return self._run(micro_batches, loss_tokens, backward=True)

    def forward_only(self, micro_batches: Sequence[MicroBatch]) -> Tensor:
        """The summed token loss of `micro_batches` (the job's count of them) through the same
        schedule, forward only (validation; call under `torch.no_grad()`): nonzero on the last
        stage only, as in `forward_backward`."""
        return self._run(micro_batches, 1, backward=False)

    def _run(self, micro_batches: Sequence[MicroBatch | None], loss_tokens, *, backward: bool) -> Tensor:
        n = len(micro_batches)
        if self._schedule is not None and n != self._micro_batches:
            raise ValueError(f"this pipeline runs {self._micro_batches} micro-batches per step (the "
                             f"job's count, fixed), got {n}")
        if self.micro_batches_needed(n) != n:
            raise ValueError(
                f"{self.schedule_name} over {self.n_stages} stages cannot run a step of {n} micro-batches "
                f"(the fewest it runs from there: {self.micro_batches_needed(n)}); set training.grad_accum "
                "or training.global_batch_tokens to give a count it runs")
        if self._schedule is None:
            self._schedule, self._micro_batches = self._build_schedule(n), n
        batches = [mb if mb is not None else self._empty() for mb in micro_batches]
        self.streams[:] = [self._stream(mb) for mb in batches]
        self._loss_tokens = loss_tokens
        # On the host: each stage reads its micro-batch's index in Python (no device sync).
        kwargs = {"mb": torch.arange(n)}
        args = (torch.stack([s.tokens for s in self.streams]),) if self.first else ()
        target, losses = None, None
        if self.last:
            target = torch.stack([F.pad(mb.targets, (0, self.length - len(mb.targets)), value=IGNORE_INDEX)
                                  for mb in batches]).to(self.device)
            losses = []
        # Forward only: torch's `eval()` clears this flag around `step()` the same way (the
        # schedule re-infers its stages' shapes when it flips), but would also gather every
        # micro-batch's logits on the last stage (return_outputs, which it cannot pass): [n,
        # tokens, vocab] held at once for nothing.
        schedule, had_backward = self._schedule, self._schedule._has_backward
        schedule._has_backward = had_backward and backward
        try:
            with self.loss_context():
                schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        finally:
            schedule._has_backward = had_backward
            self.streams.clear()
        total = torch.zeros((), device=self.device)
        for loss in losses or ():
            # A vocabulary-parallel loss is a DTensor, replicated over the TP group.
            total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
        return total

    def pipeline_sum(self, tensor: Tensor) -> Tensor:
        """Sum `tensor` over the pipeline's stages in place (e.g. the loss, held by the last)."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.pp_group)
        return tensor
