"""The training step: data -> forward/backward -> clip -> optimizer, one path for every layout.

    python -c "from longrun.config import config_from_dict; from longrun.trainer import Trainer;
               Trainer(config_from_dict({'job': {'name': 'demo'}})).train()"

A step reads top to bottom in `train_step`: `_next_step` (this rank's `StepWork`, see
`step.py`, from the `StepFeed` of `feed.py`), `forward_backward` (every micro-batch,
gradients synchronised in the last one's backward), the NaN checks, clipping, the
`before_update` hooks, the optimizer. The model was wrapped once by `parallelize`
(`parallelize.py`), so the step does not know which parallelisms are on. Phases
(`on_phase`) mark where the rank is, for heartbeats and metrics.

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
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from longrun.config import JobConfig
from longrun.data.documents import build_corpus
from longrun.data.mixture import build_sampler
from longrun.data.packing import IGNORE_INDEX, MicroBatch, build_micro_batch
from longrun.data.tokenizers import load_tokenizer
from longrun.kinds import Phase
from longrun.parallel.pipeline import PipelinedModel
from longrun.trainer.build import build_model, initialise
from longrun.trainer.cp.batches import ContextParallelSetup, PlannedStep, RankMicroBatch
from longrun.trainer.cp.planner import Plan
from longrun.trainer.errors import NonFiniteError, NonFiniteGradientError, NonFiniteLossError
from longrun.trainer.feed import StepFeed
from longrun.trainer.optim import build_optimizer
from longrun.trainer.progress import ProgressPrinter, StepMetrics
from longrun.trainer.runtime import (
    peak_memory_bytes,
    resolve_device,
    rng_state,
    seed_everything,
    set_rng_state,
)
from longrun.trainer.schedule import build_scheduler
from longrun.trainer.step import MicroBatchWork, StepWork, plain_step, planned_step, planned_work

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
        self.corpus = build_corpus(cfg.data, cfg.model, self.tokenizer, cfg.job.seed)
        # Every rank of the span draws the same global batch from the one global order; its
        # share is split off (or, under CP, planned) by rank, so the position fits any layout.
        sampler = build_sampler(cfg.data, self.corpus, seed=cfg.job.seed)
        self.feed = StepFeed(cfg, self.corpus, sampler, cp=context_parallel, device=self.device,
                             rank=self.parallel.rank, ranks=self.parallel.size)
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
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.cfg.training.dtype == "bfloat16"):
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
        """Accumulate into .grad the gradient of the global batch's mean token loss (every
        micro-batch of every rank of the replica span); return that loss and this rank's
        training FLOPs (model FLOPs, for MFU). Every rank runs the same number of
        micro-batches; gradients are synchronised during the last one's backward. A rank idle
        in the last micro-batch still joins that synchronisation with a zero-weight pass;
        idle earlier ones are skipped."""
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
        return (self.parallel.all_reduce_sum(loss_sum) / loss_tokens).item(), flops

    def _forward_backward_pipelined(self, work: StepWork, loss_tokens) -> tuple[float, float]:
        """`forward_backward` through the pipeline schedule: every micro-batch of the step at
        once (the schedule interleaves their forwards and backwards across the stages). The
        loss is the last stage's, summed over the span and then shared with every stage."""
        assert self.pipeline is not None
        self.on_phase(Phase.PIPELINE)
        loss = self.pipeline.forward_backward([mb.inputs for mb in work.micro_batches], loss_tokens)
        flops = sum(self.flops.of_documents(mb.documents.seq_lens)
                    for mb in work.micro_batches if not mb.idle) * self.pipeline.layer_share
        self.on_phase(Phase.SYNC)
        return self.pipeline.pipeline_sum(self.parallel.all_reduce_sum(loss)).item(), flops

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
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        work, wait = self._next_step()
        lr = self.scheduler.get_last_lr()[0]
        try:
            self.optimizer.zero_grad(set_to_none=True)
            loss_value, flops = self.forward_backward(work)
            if not math.isfinite(loss_value):
                raise NonFiniteLossError(self.step + 1, loss_value)
            # A finite loss can still back-propagate inf (an overflow in one layer); stepping
            # on it would poison the weights, so check before the optimizer runs.
            grad_norm_value = float(self._clip_gradients())
            if not math.isfinite(grad_norm_value):
                raise NonFiniteGradientError(self.step + 1, grad_norm_value)
        except BaseException:
            # The step did not happen: rewind the data to the last completed step, so that
            # state_dict() and a retry in this process agree with the weights.
            self.close()
            raise
        self.on_phase(Phase.OPTIMIZER)
        for hook in self.before_update:
            hook()
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        self.feed.done(work)
        self.last_plan = work.plan
        self.last_work_cost = self._work_cost(work, flops)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the optimizer's kernels belong to this step's time
        step_time = time.perf_counter() - start
        # Every rank drew the whole global batch (or summed its count), so each knows its tokens.
        global_tokens = work.loss_tokens if work.loss_tokens is not None else 0
        return StepMetrics(
            step=self.step, loss=loss_value, grad_norm=grad_norm_value, lr=lr, tokens=work.tokens,
            tokens_per_s=work.tokens / step_time, step_time_s=step_time, data_wait_s=wait,
            mfu=flops / step_time / self.peak_flops if self.peak_flops else None,
            memory_bytes=peak_memory_bytes(self.device),
            global_tokens=global_tokens, global_tokens_per_s=global_tokens / step_time,
        )

    def train(self, steps: int | None = None,
              on_step: Callable[[StepMetrics], None]
              | Sequence[Callable[[StepMetrics], None]] | None = None) -> StepMetrics | None:
        """Run `steps` more steps (default: until training.steps). Each step's metrics go to
        the progress printer, then to the `on_step` hook(s). Returns the last metrics."""
        until = self.cfg.training.steps if steps is None else self.step + steps
        hooks = [] if on_step is None else [on_step] if callable(on_step) else list(on_step)
        if self.printer is not None:
            hooks.insert(0, self.printer)
        metrics = None
        while self.step < until:
            if self.step + 1 in self.skip_steps:
                self.skip_step()
                self.on_skip(self.step)
                continue
            metrics = self.train_step()
            for hook in hooks:
                hook(metrics)
        return metrics

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
        self.feed.load_state_dict(state["data"])  # checks it fits this corpus and layout
        self.parallel.load_state_dicts(self.optimizer, state["model"], state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        if state["rng"] is not None:  # None: restored at another world size, streams kept
            set_rng_state(state["rng"])
