"""The training step: data -> forward/backward -> clip -> optimizer, one path for every layout.

    python -c "from longrun.config import config_from_dict; from longrun.trainer import Trainer;
               Trainer(config_from_dict({'job': {'name': 'demo'}})).train()"

A step reads top to bottom in `_launch_step`: `_next_step` (this rank's `StepWork`, see
`step.py`, from the `StepFeed` of `feed.py`), `forward_backward_on_device` (every micro-batch,
gradients synchronised in the last one's backward), clipping, the non-finite check, the
`before_update` hooks, the optimizer. The model was wrapped once by `parallelize`
(`parallelize.py`), so the step does not know which parallelisms are on. Phases
(`on_phase`) mark where the rank is, for heartbeats and metrics.

No host synchronisation inside a step (issue 40). The loss and the gradient norm stay on the
device; whether either is NaN/inf is decided there too, and a non-finite step's update is
skipped on the device (`guard.py`: the fused AdamW's found-inf skip, as `GradScaler` does), so
no weight or optimizer state ever sees it. The values reach the host through a pinned,
non-blocking copy (`readings.py`) and are read one step late: `train()` reads step k's once step
k+1's forward and backward are queued, before step k+1's optimizer, and only then runs step k's
hooks (metrics, heartbeat, checkpoint), with the trainer's state still exactly step k's. A
non-finite step k raises `NonFiniteLossError` / `NonFiniteGradientError` naming step k there,
after putting the trainer back to step k-1 (step count, LR schedule, data position; its weights
and optimizer state never moved), so nothing of it is ever checkpointed or snapshotted. This is
on by default on CUDA (`read_late`); on the CPU the step has run by the time it returns, and
reading at once costs nothing, so step k's hooks run right after it (the same results, bit for
bit: tests/test_step_readings.py).

One optimizer step is one global batch of `cfg.global_batch_tokens` tokens (by default
data.micro_batch_tokens x training.grad_accum x the span), drawn the same by every rank of the
span and split among them (`step.py`; under context parallelism `context_parallel=`, planned
over CP groups, `cp/batches.py`); every rank runs the same number of micro-batches. The loss is
normalised per token: each micro-batch's summed token losses are divided by the number of loss
tokens in the *whole global batch*, which every rank knows, and the ranks' gradients are summed
(`data_parallel.py`). So the gradient is that of the global batch's mean token loss however its
documents were split into micro-batches and ranks: a job at another world size with the same
global batch follows the same trajectory (up to float summation order).

Where the weights are sharded (`parallelism.fsdp` or `tp` > 1) the trainer is given the job's
device mesh (`mesh=`, see `ParallelGroups.device_mesh`); the parameters, gradients and AdamW
state are then DTensors and `state_dict()` holds this rank's pieces of them.

With `validation.interval_steps` set, a step whose number is a multiple of it is followed, after
its update and before its hooks, by a validation pass on held-out data (`validation.py`): its
loss and seconds ride on that step's metrics (`val_loss`, `validation_s`).
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from longrun.config import JobConfig
from longrun.data.documents import build_corpus
from longrun.data.held_out import validation_split
from longrun.data.mixture import build_sampler
from longrun.data.packing import IGNORE_INDEX, MicroBatch, build_micro_batch
from longrun.data.tokenizers import load_tokenizer
from longrun.kinds import Phase
from longrun.parallel.compile import compile_counts
from longrun.parallel.pipeline import PipelinedModel
from longrun.trainer.build import build_model, initialise
from longrun.trainer.cp.batches import ContextParallelSetup, PlannedStep, RankMicroBatch
from longrun.trainer.cp.planner import Plan
from longrun.trainer.errors import NonFiniteError, NonFiniteGradientError, NonFiniteLossError
from longrun.trainer.feed import StepFeed
from longrun.trainer.guard import guarded_step, non_finite
from longrun.trainer.optim import build_optimizer, follow_training_config
from longrun.trainer.progress import ProgressPrinter, StepMetrics
from longrun.trainer.readings import StepReadings, StepTimer
from longrun.trainer.runtime import (
    peak_memory_bytes,
    resolve_device,
    rng_state,
    seed_everything,
    set_rng_state,
)
from longrun.trainer.schedule import build_scheduler
from longrun.trainer.step import MicroBatchWork, StepWork, plain_step, planned_step, planned_work
from longrun.trainer.validation import Validator

# Re-exported: callers import these from the trainer module.
__all__ = ["NonFiniteError", "NonFiniteGradientError", "NonFiniteLossError", "ProgressPrinter",
           "StepMetrics", "Trainer", "build_optimizer", "resolve_device"]

log = logging.getLogger(__name__)


class Trainer:
    """Model, optimizer, LR schedule and data for one rank; `train()` runs the steps.

    Determinism: the model is initialised from torch's RNG seeded with job.seed; the data
    order comes from the sampler's own generator (same seed, separate stream), so changing
    the model does not change the data order and vice versa. `state_dict()` holds all that a
    bitwise-exact resume needs."""

    def __init__(self, cfg: JobConfig, device: torch.device | str | None = None, *,
                 dp_group: dist.ProcessGroup | None = None,
                 context_parallel: ContextParallelSetup | None = None,
                 mesh: DeviceMesh | None = None, pipeline_group: dist.ProcessGroup | None = None,
                 peak_flops: float | None = None, progress: bool = True, init_weights: bool = True):
        self.cfg = cfg
        # Told the phase the step is entering (data, forward, backward, sync, optimizer): the
        # worker puts it in its heartbeat, so a hang report says where the rank was stuck.
        self.on_phase: Callable[[str], None] = lambda phase: None
        self.device = resolve_device(cfg.cluster.device, device)
        self.peak_flops = peak_flops
        seed_everything(cfg.job.seed)
        self.tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size)
        # Under context parallelism gradients are summed over all dp x cp ranks (each rank
        # back-propagates its own tokens' loss; the ring returns dK/dV to their owners).
        self.cp = context_parallel
        if context_parallel is not None and dp_group is not None:
            raise ValueError("pass dp_group or context_parallel (whose span group is the dp x cp "
                             "ranks), not both")
        # Where the weights are sharded (fsdp or tp > 1), `mesh` is the job's device mesh.
        span_group = context_parallel.span_group if context_parallel is not None else dp_group
        # Built on the meta device: this rank's pieces alone get memory (build.py).
        self.parallel, self.flops = build_model(cfg, self.device, span_group=span_group, mesh=mesh,
                                                pipeline_group=pipeline_group, prime=self._priming_loss)
        # Under pipeline parallelism this rank keeps only its stages' pieces.
        self.model = self.parallel.module
        self.pipeline = self.parallel if isinstance(self.parallel, PipelinedModel) else None
        # The values: the job's initial weights now, or (init_weights=False: a worker about to
        # restore) whatever the restore brings; `init_weights()` when nothing could be restored.
        self.initialised = False
        if init_weights:
            self.init_weights()
        self.optimizer = build_optimizer(self.model, cfg.training, self.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.training)
        # With validation.held_out, training draws from the documents not held out.
        corpus = build_corpus(cfg.data, cfg.model, self.tokenizer, cfg.job.seed)
        self.corpus, held_out = validation_split(cfg.data, cfg.model, cfg.validation, corpus, self.tokenizer,
                                                 cfg.job.seed)
        # Every rank of the span draws the same global batch from the one global order; its
        # share is split off (or, under CP, planned) by rank, so the position fits any layout.
        sampler = build_sampler(cfg.data, self.corpus, seed=cfg.job.seed)
        self.feed = StepFeed(cfg, self.corpus, sampler, cp=context_parallel, device=self.device,
                             rank=self.parallel.rank, ranks=self.parallel.size)
        self.validator = (None if held_out is None else
                          Validator(cfg, held_out, cp=context_parallel, rank=self.parallel.rank,
                                    ranks=self.parallel.size, device=self.device))
        self.step = 0
        self.last_plan: Plan | None = None  # the dynamic-CP plan of the last step (for metrics)
        # What this rank's data of the last step should cost (see `_work_cost`), for its heartbeat.
        self.last_work_cost: float | None = None
        # Steps (1-based) whose data is consumed without training (see skip_step).
        self.skip_steps: frozenset[int] = frozenset()
        # Told the number of a step just skipped: no metrics (nothing trained), but the worker
        # still beats, checkpoints when one is due and honours a stop there (StepHooks).
        self.on_skip: Callable[[int], None] = lambda step: None
        # Called right before the optimizer changes the weights (a checkpoint copy in flight
        # must finish first).
        self.before_update: list[Callable[[], None]] = []
        self.printer = (ProgressPrinter(cfg.training.steps, cfg.training.log_every,
                                        layout=self.layout) if progress else None)
        # Read each step's numbers one step late (see the module docstring): on CUDA, where the
        # host would otherwise wait for the device every step; elsewhere a step has run when it
        # returns, and its hooks run at once.
        self.read_late = self.device.type == "cuda"
        self._recompiles_seen = 0
        log.info("model: %s parameters on this rank, %d documents in the corpus",
                 f"{sum(p.numel() for p in self.model.parameters()):,}", len(self.corpus))

    def init_weights(self) -> None:
        """Give this rank's pieces the job's initial weights (`build.initialise`: seeded, or
        model.init_from's slices): the same values at every layout."""
        seconds = initialise(self.model, self.cfg)
        self.initialised = True
        log.info("initial weights of this rank's pieces in %.1f s", seconds)

    def close(self) -> None:
        """Stop the data thread. The sampler may then be repositioned; training may go on."""
        self.feed.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one step ----------------------------------------------------------------------------
    def _summed_token_loss(self, model: torch.nn.Module, inputs, attention=None) -> torch.Tensor:
        self.on_phase(Phase.FORWARD)
        inputs = inputs.to(self.device, non_blocking=True)
        # Where FSDP2 already gathers the weights in bf16 (precision.py), autocast would only
        # re-cast; it is for the layouts whose weights stay fp32 (the CPU, DDP).
        cast = not getattr(getattr(self, "parallel", None), "casts_parameters", False)
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.cfg.training.dtype == "bfloat16" and cast):
            if attention is None:
                logits = model(inputs.tokens, inputs.positions, inputs.cu_seqlens)
            else:
                logits = model(inputs.tokens, inputs.positions, context_parallel=attention)
        targets = inputs.targets
        if logits.shape[0] > targets.shape[0]:  # the model padded the stream (sequence parallel)
            targets = F.pad(targets, (0, logits.shape[0] - targets.shape[0]), value=IGNORE_INDEX)
        # Under tensor parallelism the logits are sharded by vocabulary and this runs in
        # `loss_parallel` (see _micro_batch): no rank ever holds the whole [T, vocab].
        return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")

    def _priming_loss(self, model: torch.nn.Module) -> torch.Tensor:
        """A two-token document through the whole model: enough for DDP to learn the order
        in which gradients become ready (see data_parallel.py), at next to no cost."""
        return self._summed_token_loss(
            model, build_micro_batch([np.array([self.tokenizer.BOS, self.tokenizer.EOS])]))

    def forward_backward(self, work: StepWork | list[MicroBatch]) -> tuple[float, float]:
        """`forward_backward_on_device`, its loss read on the host (a synchronisation: for
        callers that want the number now; the step itself does not)."""
        loss, flops = self.forward_backward_on_device(work)
        return loss.item(), flops

    def forward_backward_on_device(self, work: StepWork | list[MicroBatch]) -> tuple[torch.Tensor, float]:
        """Accumulate into .grad the gradient of the global batch's mean token loss (every
        micro-batch of every rank of the replica span); return that loss (a scalar on the
        device, not read) and this rank's training FLOPs (model FLOPs, for MFU). Every rank runs
        the same number of micro-batches; gradients are synchronised during the last one's
        backward. A rank idle in the last micro-batch still joins that synchronisation with a
        zero-weight pass; idle earlier ones are skipped."""
        if not isinstance(work, StepWork):
            work = plain_step(work)
        if work.loss_tokens is None:
            # Micro-batches handed in (`plain_step`): each rank knows only its own count, summed
            # before any backward, so every rank divides by the same number.
            loss_tokens = self.parallel.all_reduce_sum(
                torch.tensor(sum(w.documents.n_tokens for w in work.micro_batches), device=self.device))
            loss_tokens.clamp_(min=1)
        else:
            loss_tokens = max(work.loss_tokens, 1)
        if self.pipeline is not None:
            return self._forward_backward_pipelined(work, loss_tokens)
        loss_sum = torch.zeros((), device=self.device)
        flops = 0.0
        for i, mb in enumerate(work.micro_batches):
            last = i == len(work.micro_batches) - 1
            if mb.idle and not last and not self.parallel.syncs_every_micro_batch:
                continue
            loss_sum += self._micro_batch(mb, last=last, loss_tokens=loss_tokens)
            if not mb.idle:  # this rank's share of its group's work
                flops += self.flops.of_documents(mb.documents.seq_lens) / mb.share
        self.on_phase(Phase.SYNC)
        return self.parallel.all_reduce_sum(loss_sum) / loss_tokens, flops

    def _forward_backward_pipelined(self, work: StepWork, loss_tokens) -> tuple[torch.Tensor, float]:
        """`forward_backward` through the pipeline schedule: every micro-batch of the step at
        once (the schedule interleaves their forwards and backwards across the stages). The
        loss is the last stage's, summed over the span and then shared with every stage."""
        assert self.pipeline is not None
        self.on_phase(Phase.PIPELINE)
        loss = self.pipeline.forward_backward([mb.inputs for mb in work.micro_batches], loss_tokens)
        flops = sum(self.flops.of_documents(mb.documents.seq_lens)
                    for mb in work.micro_batches if not mb.idle) * self.pipeline.layer_share
        self.on_phase(Phase.SYNC)
        return self.pipeline.pipeline_sum(self.parallel.all_reduce_sum(loss)), flops

    def _micro_batch(self, mb: MicroBatchWork, *, last: bool, loss_tokens) -> torch.Tensor:
        """Forward and backward of one micro-batch (gradients synchronised only when `last`);
        returns its summed token loss (detached)."""
        with self.parallel.micro_batch(last=last), self.parallel.loss_parallel():
            if mb.idle:  # joins the gradient synchronisation, contributes nothing
                # Zero gradients whatever the priming loss is (the backward of `x * 0.0` never
                # reads x), but its *value* is not added: an infinite priming loss times 0.0 is
                # NaN and would fail a step whose real loss is finite.
                priming = self._priming_loss(self.parallel.forward)
                self.on_phase(Phase.BACKWARD)
                (priming * 0.0).backward()
                return torch.zeros((), device=self.device)
            attention = mb.attention() if mb.attention is not None else None
            loss = self._summed_token_loss(self.parallel.forward, mb.inputs, attention)
            self.on_phase(Phase.BACKWARD)
            (loss / loss_tokens).backward()
        loss = loss.detach()
        # A vocabulary-parallel loss is a DTensor, replicated over the TP group.
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def forward_loss(self, work: StepWork) -> torch.Tensor:
        """The summed token loss of a step's micro-batches over the span, forward only (for
        validation: call under `torch.no_grad()`, the model in eval mode). The loss of
        `forward_backward_on_device` without its backward: under pipeline parallelism the last
        stage's, shared with every stage; an idle micro-batch of a sharded layout still joins its
        weight gathers, contributing nothing."""
        if self.pipeline is not None:
            loss = self.pipeline.forward_only([mb.inputs for mb in work.micro_batches])
            return self.pipeline.pipeline_sum(self.parallel.all_reduce_sum(loss))
        total = torch.zeros((), device=self.device)
        model = self.parallel.module  # no DDP wrapper: a forward without gradients syncs nothing
        for mb in work.micro_batches:
            if mb.idle:
                if self.parallel.syncs_every_micro_batch:
                    self._priming_loss(model)
                continue
            with self.parallel.loss_parallel():
                attention = mb.attention() if mb.attention is not None else None
                loss = self._summed_token_loss(model, mb.inputs, attention)
            total += loss.full_tensor() if isinstance(loss, DTensor) else loss
        return self.parallel.all_reduce_sum(total)

    def micro_batch_pass(self, rmb: RankMicroBatch, *, last: bool, loss_tokens: int) -> torch.Tensor:
        """One planned micro-batch on its CP group (what the CP calibration times)."""
        assert self.cp is not None
        return self._micro_batch(planned_work(rmb, self.cp, self.device), last=last,
                                 loss_tokens=loss_tokens)

    def forward_backward_planned(self, step: PlannedStep) -> tuple[float, float]:
        """`forward_backward` of this rank's part of a planned global batch."""
        assert self.cp is not None
        return self.forward_backward(planned_step(step, self.cp, self.device))

    def _clip_gradients(self) -> torch.Tensor:
        """Global gradient norm (before clipping); clipped to training.grad_clip unless 0."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.cfg.training.grad_clip
        if self.pipeline is not None:
            return self._clip_pipelined(params, clip)
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        # Sharded gradients (FSDP) give a DTensor norm of partial sums: the global value is
        # its full tensor (one all-reduce over the shards).
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def _clip_pipelined(self, params: list[torch.nn.Parameter], clip: float) -> torch.Tensor:
        """The norm over every stage's gradients (each rank holds only its stages'): squares
        summed over the pipeline, then each stage clipped by the one global norm."""
        assert self.pipeline is not None
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        norm = self.pipeline.pipeline_sum(norm.pow(2)).sqrt()
        if clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm, foreach=True)
        return norm

    def _work_cost(self, work: StepWork, flops: float) -> float:
        """What this rank's data of a step should cost, comparable across the job's ranks (the
        straggler attribution, health/stragglers.py, asks whether a slow rank's data explains
        it): under context parallelism the planner's predicted seconds for its groups; otherwise
        the training FLOPs of its documents, which `forward_backward` counted anyway (linear in
        tokens plus the attention's sum of squared lengths: the same shape as the CP cost model,
        which only CP jobs calibrate). A pipeline rank's FLOPs are its stage's share of the
        layers; the attribution compares costs within a stage, so they are kept as they are."""
        return work.cost if work.cost is not None else flops

    def _next_step(self) -> tuple[StepWork, float]:
        """The next step's work and the seconds spent waiting for it. Under context
        parallelism the wait is for a planned global batch, so the phase is "plan"."""
        self.on_phase(Phase.PLAN if self.cp is not None else Phase.DATA)
        return self.feed.next()

    def train_step(self) -> StepMetrics:
        """One step, its numbers read at once: a host synchronisation, for callers that want
        this step's loss now (a test, a one-off step). `train()` reads them one step late.
        Raises `NonFiniteError` (the trainer back at the previous step, nothing updated)."""
        return self._settle(self._launch_step())

    def _launch_step(self, between: Callable[[], None] | None = None) -> _PendingStep:
        """Step `self.step + 1` with no host synchronisation: everything is queued on the
        device, the numbers are on their way to the host (`readings.py`), a non-finite step's
        update is skipped on the device (`guard.py`). `between` runs after this step's forward
        and backward, before its optimizer changes anything: `train()` finishes the previous
        step there (reads it, raises if it was not finite, runs its hooks)."""
        timer = StepTimer.begin(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        work, wait = self._next_step()
        lr = self.scheduler.get_last_lr()[0]
        before = _Rewind(self.step, self.scheduler.state_dict(),
                         [group["lr"] for group in self.optimizer.param_groups], self.feed.state)
        try:
            self.optimizer.zero_grad(set_to_none=True)
            loss, flops = self.forward_backward_on_device(work)
            # A finite loss can still back-propagate inf (an overflow in one layer): the flag
            # covers the gradient norm too, and stops the update on the device.
            grad_norm = self._clip_gradients()
            bad = non_finite(loss, grad_norm)
            readings = StepReadings.capture(loss, grad_norm, bad, timer)
            if between is not None:
                paused = time.perf_counter()
                between()
                timer.pause_s = time.perf_counter() - paused
        except BaseException:
            # The step did not happen: rewind the data to the last completed step, so that
            # state_dict() and a retry in this process agree with the weights.
            self.close()
            raise
        self.on_phase(Phase.OPTIMIZER)
        for hook in self.before_update:
            hook()
        guarded_step(self.optimizer, bad)
        self.scheduler.step()
        self.step += 1
        self.feed.done(work)
        self.last_plan = work.plan
        self.last_work_cost = self._work_cost(work, flops)
        timer.stop()
        memory = peak_memory_bytes(self.device)  # of the step, not of a validation pass after it
        # Validated on this step's weights, before its hooks (a checkpoint of it) run.
        validated = self.validator.run(self) if self.validator and self.validator.due(self.step) else None
        return _PendingStep(self.step, readings, before, lr=lr, work=work, wait_s=wait, flops=flops,
                            memory_bytes=memory, validated=validated)

    def _settle(self, pending: _PendingStep) -> StepMetrics:
        """Read a launched step's numbers: its metrics, or (not finite) the trainer put back to
        the step before it and `NonFiniteLossError` / `NonFiniteGradientError` naming it. Only
        valid before the next step's optimizer runs (`_launch_step`'s `between`)."""
        loss, grad_norm, bad, step_time = pending.readings.read()
        if bad:
            # Its weights and optimizer state never moved (guard.py); the rest goes back.
            rewind = pending.before
            self.step = rewind.step
            self.scheduler.load_state_dict(rewind.scheduler)
            for group, lr in zip(self.optimizer.param_groups, rewind.lrs, strict=True):
                group["lr"] = lr  # the schedule had set the next step's
            self.feed.state = rewind.data
            self.close()
            if not math.isfinite(loss):
                raise NonFiniteLossError(pending.step, loss)
            raise NonFiniteGradientError(pending.step, grad_norm)
        work, flops = pending.work, pending.flops
        # Every rank drew the whole global batch (or summed its count), so each knows its tokens.
        global_tokens = work.loss_tokens if work.loss_tokens is not None else 0
        return StepMetrics(
            step=pending.step, loss=loss, grad_norm=grad_norm, lr=pending.lr, tokens=work.tokens,
            tokens_per_s=work.tokens / step_time, step_time_s=step_time, data_wait_s=pending.wait_s,
            mfu=flops / step_time / self.peak_flops if self.peak_flops else None,
            memory_bytes=pending.memory_bytes,
            global_tokens=global_tokens, global_tokens_per_s=global_tokens / step_time,
            recompiles=self._recompiles(pending.step),
            val_loss=pending.validated[0] if pending.validated else None,
            validation_s=pending.validated[1] if pending.validated else 0.0,
        )

    def _recompiles(self, step: int) -> int:
        """torch.compile's recompilations so far, with a warning whenever a step after the
        first added some (each costs seconds, and a job that keeps recompiling is slow)."""
        seen = compile_counts().recompilations
        if seen > self._recompiles_seen and step > 1:
            log.warning("step %d: torch.compile recompiled %d time(s) (%d in this process); see "
                        "TORCH_LOGS=recompiles for why", step, seen - self._recompiles_seen, seen)
        self._recompiles_seen = seen
        return seen

    def train(self, steps: int | None = None,
              on_step: Callable[[StepMetrics], None]
              | Sequence[Callable[[StepMetrics], None]] | None = None) -> StepMetrics | None:
        """Run `steps` more steps (default: until training.steps). Each step's metrics go to
        the progress printer, then to the `on_step` hook(s), with the trainer's state that of
        that step. With `read_late`, step k's are read and its hooks run while step k+1 is
        under way (after its forward and backward, before its optimizer: see the module
        docstring); the last step's before this returns. Returns the last metrics."""
        until = self.cfg.training.steps if steps is None else self.step + steps
        hooks = [] if on_step is None else [on_step] if callable(on_step) else list(on_step)
        if self.printer is not None:
            hooks.insert(0, self.printer)
        done: list[StepMetrics] = []

        def finish(pending: _PendingStep) -> None:
            metrics = self._settle(pending)
            for hook in hooks:
                hook(metrics)
            done[:] = [metrics]

        pending: _PendingStep | None = None
        while self.step < until:
            if self.step + 1 in self.skip_steps:
                if pending is not None:
                    finish(pending)
                    pending = None
                self.skip_step()
                self.on_skip(self.step)
                continue
            if not self.read_late:
                finish(self._launch_step())
                continue
            previous = pending
            pending = self._launch_step(None if previous is None
                                        else lambda p=previous: self._between_steps(p, finish))
        if pending is not None:
            finish(pending)
        return done[0] if done else None

    def _between_steps(self, previous: _PendingStep, finish: Callable[[_PendingStep], None]) -> None:
        """Finish the previous step while this one's forward and backward run on the device. On
        CUDA its hooks run on a stream that has seen the previous step's kernels and not this
        step's, so what they queue (a checkpoint's device-to-host copy) runs beside this step's
        forward and backward instead of after them; this step's optimizer waits for it."""
        stream = previous.readings.stream_after()
        if stream is None:
            finish(previous)
            return
        with torch.cuda.stream(stream):
            finish(previous)
        torch.cuda.current_stream().wait_stream(stream)

    def skip_step(self) -> None:
        """Consume the next step's data without training on it (the health policy's answer
        to a loss spike that came back at the same data). The step still counts and the
        learning-rate schedule moves on, so the rest of the run sees the same step numbers
        and the same data it would have seen."""
        work, _ = self._next_step()
        with warnings.catch_warnings():  # skipping step 1 moves the schedule before any update
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            self.scheduler.step()
        self.step += 1
        self.feed.done(work)
        log.warning("skipped step %d: its data was consumed without training", self.step)

    # -- state -------------------------------------------------------------------------------
    @property
    def layout(self) -> str:
        """The parallel layout's short name (e.g. "fsdp2.tp2"), for logs and metric labels."""
        return self.cfg.dims.layout_name

    def state_bytes(self) -> dict[str, int]:
        """Bytes of training state this rank holds, by kind (see `ParallelModel.state_bytes`)."""
        return self.parallel.state_bytes(self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        """Everything a bitwise-exact resume needs. Tensors are the live ones (as with
        torch's own state_dicts): copy them before training on if they must not change."""
        model, optimizer = self.parallel.state_dicts(self.optimizer)
        return {
            "step": self.step,
            "model": model,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "data": dict(self.feed.state),
            "rng": rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; its "data" None: the data from its beginning (a resume that
        accepted a change of the data: config/identity.py)."""
        if state["data"] is not None:
            self.feed.load_state_dict(state["data"])  # checks it fits this corpus and layout
        self.parallel.load_state_dicts(self.optimizer, state["model"], state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        follow_training_config(self.optimizer, self.scheduler, self.cfg.training)
        self.step = int(state["step"])
        if state["rng"] is not None:  # None: restored at another world size, streams kept
            set_rng_state(state["rng"])


@dataclass(frozen=True)
class _Rewind:
    """What a step changes besides the weights and the optimizer's state (which a non-finite
    step leaves as they were): put back when its numbers turn out not finite."""

    step: int
    scheduler: dict[str, Any]
    lrs: list[float]  # each parameter group's learning rate
    data: dict[str, Any] | None


@dataclass
class _PendingStep:
    """A launched step whose numbers are still on their way to the host."""

    step: int
    readings: StepReadings
    before: _Rewind
    lr: float
    work: StepWork
    wait_s: float
    flops: float
    memory_bytes: int
    validated: tuple[float, float] | None = None  # (validation loss, its seconds) when one was due
