"""The training step loop: data -> forward/backward -> clip -> step.

    python -c "from longrun.config import config_from_dict; from longrun.trainer import Trainer;
               Trainer(config_from_dict({'job': {'name': 'demo'}})).train()"

One optimizer step runs `training.grad_accum` micro-batches. The loss is normalised per token:
each micro-batch's summed token losses are divided by the number of loss tokens in the *whole
step*, so the gradient is that of the step's mean token loss however the tokens happen to be
split into micro-batches (packing makes micro-batch sizes vary). With data parallelism the
count is summed over the ranks first and the ranks' gradients are summed (`parallel.py`), so
the result is the gradient of the global batch's mean token loss, however the documents were
split across ranks.

Under context parallelism (`context_parallel=`, see `cp/batches.py`) a step is one planned
global batch: every rank of the dp x cp span runs the same number of micro-batches, each on
the CP group the plan gives it, and gradients are summed over the whole span.
"""

from __future__ import annotations

import logging
import math
import random
import resource
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from longrun.config import JobConfig
from longrun.config.sections import TrainingSection
from longrun.kinds import FaultKind
from longrun.trainer.cp.attention import ContextParallelAttention
from longrun.trainer.cp.batches import (
    ContextParallelSetup,
    PlannedStep,
    RankMicroBatch,
    cp_attention_for,
    planned_steps,
)
from longrun.trainer.cp.layout import LocalShard
from longrun.trainer.cp.planner import Plan
from longrun.trainer.data import DocumentSampler, build_corpus
from longrun.trainer.model import Transformer
from longrun.trainer.packing import (
    IGNORE_INDEX,
    MicroBatch,
    Prefetcher,
    build_micro_batch,
    packed_micro_batches,
)
from longrun.trainer.parallel import DataParallel
from longrun.trainer.schedule import build_scheduler
from longrun.trainer.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """A step produced NaN/inf (`quantity` is "loss" or "gradient norm"); the weights were
    not updated. `step` is the 1-based step that failed."""

    fault_kind = FaultKind.NAN  # how the controller classifies it (controller/workers.py)

    def __init__(self, step: int, quantity: str, value: float):
        self.step, self.quantity, self.value = step, quantity, value
        super().__init__(
            f"{quantity} is {value} at step {step}: training diverged or the weights or data hold "
            "NaN/inf; resume from an earlier checkpoint, lower training.lr or check the data"
        )


    def __reduce__(self):
        # Rebuilt from the constructor's own arguments: the default pickling would call
        # __init__ with the message alone, so the error could not cross process boundaries
        # (a Ray worker raising it to the controller).
        return type(self), (self.step, self.quantity, self.value)


class NonFiniteLossError(NonFiniteError):
    def __init__(self, step: int, loss: float):
        super().__init__(step, "loss", loss)
        self.loss = loss

    def __reduce__(self):
        return type(self), (self.step, self.loss)


class NonFiniteGradientError(NonFiniteError):
    def __init__(self, step: int, grad_norm: float):
        super().__init__(step, "gradient norm", grad_norm)
        self.grad_norm = grad_norm

    def __reduce__(self):
        return type(self), (self.step, self.grad_norm)


@dataclass
class StepMetrics:
    step: int  # 1-based count of optimizer steps done
    loss: float  # mean token loss of the step
    grad_norm: float  # global norm before clipping
    lr: float  # learning rate this step used
    tokens: int  # input tokens in the step
    tokens_per_s: float
    step_time_s: float  # data wait included; tokens and tokens_per_s are this rank's
    data_wait_s: float  # time blocked on the data pipeline
    mfu: float | None  # model FLOPs utilisation; None without a peak FLOPs figure
    memory_bytes: int  # peak CUDA memory allocated this step, or the process's peak RSS on CPU


def _hms(seconds: float) -> str:
    return str(timedelta(seconds=round(max(seconds, 0.0))))


class ProgressPrinter:
    """One line per `every` steps (and the last), like torchtitan's:
    step 12/100  loss 4.1234  grad_norm 1.23  lr 3.0e-04  tok/s 12,345  elapsed 0:00:05  eta 0:00:30
    The eta extrapolates the mean step time of the steps this printer has seen."""

    def __init__(self, total_steps: int, every: int = 1,
                 write: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.total_steps, self.every, self.clock = total_steps, every, clock
        self.write = write or (lambda line: print(line, file=sys.stdout, flush=True))
        self._start: float | None = None
        self._first_step = 0

    def __call__(self, m: StepMetrics) -> None:
        now = self.clock()
        if self._start is None:  # count from the start of the first step seen
            self._start, self._first_step = now - m.step_time_s, m.step - 1
        if m.step % self.every == 0 or m.step >= self.total_steps:
            self.write(self.format(m, now - self._start))

    def format(self, m: StepMetrics, elapsed_s: float) -> str:
        done = max(m.step - self._first_step, 1)
        eta = elapsed_s / done * max(self.total_steps - m.step, 0)
        parts = [
            f"step {m.step}/{self.total_steps}", f"loss {m.loss:.4f}",
            f"grad_norm {m.grad_norm:.2f}", f"lr {m.lr:.1e}", f"tok/s {m.tokens_per_s:,.0f}",
        ]
        if m.mfu is not None:
            parts.append(f"mfu {100 * m.mfu:.1f}%")
        parts.append(f"mem {m.memory_bytes / 2**30:.2f}GiB")
        parts += [f"elapsed {_hms(elapsed_s)}", f"eta {_hms(eta)}"]
        return "  ".join(parts)


def resolve_device(setting: str, device: torch.device | str | None = None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("cluster.device is 'cuda' but torch sees no GPU; use 'auto' or 'cpu'")
    return torch.device(setting)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # CUDA generators too


def rng_state() -> dict[str, Any]:
    """Every generator's state as tensors and plain Python values only, so a checkpoint of
    it loads with `torch.load(weights_only=True)` (which refuses numpy arrays)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                       float(gauss)),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss,
                         gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def build_optimizer(model: torch.nn.Module, training: TrainingSection,
                    device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay only on matrices (linear weights, embeddings), never on norm gains.
    The fused kernel where torch has one for the device, else the multi-tensor one."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": training.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=training.lr, betas=training.betas,
                             fused=fused, foreach=None if fused else True)


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Trainer:
    """Model, optimizer, LR schedule and data for one rank; `train()` runs the steps.

    Determinism: the model is initialised from torch's RNG seeded with job.seed; the data
    order comes from the sampler's own generator (same seed, separate stream), so changing
    the model does not change the data order and vice versa. `state_dict()` holds all that a
    bitwise-exact resume needs."""

    def __init__(self, cfg: JobConfig, device: torch.device | str | None = None, *,
                 dp_group: dist.ProcessGroup | None = None,
                 context_parallel: ContextParallelSetup | None = None,
                 peak_flops: float | None = None, progress: bool = True):
        self.cfg = cfg
        # Told the phase the step is entering (data, forward, backward, sync, optimizer): the
        # worker puts it in its heartbeat, so a hang report says where the rank was stuck.
        self.on_phase: Callable[[str], None] = lambda phase: None
        self.device = resolve_device(cfg.cluster.device, device)
        self.peak_flops = peak_flops
        seed_everything(cfg.job.seed)
        # Initialised on the CPU, then moved: the same weights whatever the device.
        self.model = Transformer(cfg.model).to(self.device)
        self.tokenizer = ByteTokenizer(cfg.model.vocab_size)
        # Under context parallelism gradients are summed over all dp x cp ranks (each rank
        # back-propagates its own tokens' loss; the ring returns dK/dV to their owners).
        self.cp = context_parallel
        if context_parallel is not None and dp_group is not None:
            raise ValueError("pass dp_group or context_parallel (whose span group is the dp x cp "
                             "ranks), not both")
        sync_group = context_parallel.span_group if context_parallel is not None else dp_group
        self.dp = DataParallel(self.model, sync_group, bucket_mb=cfg.training.grad_sync_bucket_mb,
                               prime=self._priming_loss)
        self.optimizer = build_optimizer(self.model, cfg.training, self.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.training)
        self.corpus = build_corpus(cfg.data, cfg.model, self.tokenizer, cfg.job.seed)
        # Every rank of a CP span draws the same global batch; the plan splits it.
        shard_rank, shard_size = (0, 1) if context_parallel is not None else (self.dp.rank, self.dp.size)
        self.sampler = DocumentSampler(len(self.corpus), seed=cfg.job.seed,
                                       dp_rank=shard_rank, dp_size=shard_size)
        self.step = 0
        self.last_plan: Plan | None = None  # the dynamic-CP plan of the last step (for metrics)
        # Steps (1-based) whose data is consumed without training (see skip_step).
        self.skip_steps: frozenset[int] = frozenset()
        # Called right before the optimizer changes the weights (a checkpoint copy in flight
        # must finish first).
        self.before_update: list[Callable[[], None]] = []
        # Sampler position after the last micro-batch consumed by a *completed* step.
        self._data_state = self.sampler.state_dict()
        self._prefetcher: Prefetcher[Any] | None = None
        self.printer = (ProgressPrinter(cfg.training.steps, cfg.training.log_every)
                        if progress else None)
        log.info("model: %s parameters (%s without the embedding), %d documents in the corpus",
                 f"{self.model.num_params():,}",
                 f"{self.model.num_params(exclude_embedding=True):,}", len(self.corpus))

    # -- data --------------------------------------------------------------------------------
    def _data(self) -> Prefetcher[Any]:
        """Micro-batches; under context parallelism, planned global batches (`PlannedStep`),
        whose plans the prefetch thread makes while the current step trains."""
        if self._prefetcher is None:
            self.sampler.load_state_dict(self._data_state)
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

    def close(self) -> None:
        """Stop the data thread. The sampler may then be repositioned; training may go on."""
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one step ----------------------------------------------------------------------------
    def _summed_token_loss(self, model: torch.nn.Module, mb: MicroBatch | LocalShard,
                           context_parallel: ContextParallelAttention | None = None) -> torch.Tensor:
        self.on_phase("forward")
        mb = mb.to(self.device, non_blocking=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.cfg.training.dtype == "bfloat16"):
            if context_parallel is None:
                logits = model(mb.tokens, mb.positions, mb.cu_seqlens)
            else:
                logits = model(mb.tokens, mb.positions, context_parallel=context_parallel)
        return F.cross_entropy(logits.float(), mb.targets, ignore_index=IGNORE_INDEX,
                               reduction="sum")

    def _priming_loss(self, model: torch.nn.Module) -> torch.Tensor:
        """A two-token document through the whole model: enough for DDP to learn the order
        in which gradients become ready (see parallel.py), at next to no cost."""
        return self._summed_token_loss(
            model, build_micro_batch([np.array([self.tokenizer.BOS, self.tokenizer.EOS])]))

    def forward_backward(self, batches: list[MicroBatch]) -> tuple[float, float]:
        """Accumulate into .grad the gradient of the global batch's mean token loss (all
        `batches` of every data-parallel rank); return that loss and this rank's training
        FLOPs (model FLOPs, for MFU)."""
        # Summed over the ranks before any backward, so every rank divides by the same count.
        loss_tokens = self.dp.all_reduce_sum(
            torch.tensor(sum(mb.n_tokens for mb in batches), device=self.device))
        loss_tokens.clamp_(min=1)
        loss_sum = torch.zeros((), device=self.device)
        flops = 0.0
        for i, mb in enumerate(batches):
            flops += self.model.flops_of_documents(mb.seq_lens)
            with self.dp.micro_batch(last=i == len(batches) - 1):
                loss = self._summed_token_loss(self.dp.forward, mb)
                self.on_phase("backward")
                (loss / loss_tokens).backward()
            loss_sum += loss.detach()
        self.on_phase("sync")
        return (self.dp.all_reduce_sum(loss_sum) / loss_tokens).item(), flops

    def forward_backward_planned(self, step: PlannedStep) -> tuple[float, float]:
        """`forward_backward` under context parallelism: this rank's micro-batches of a planned
        global batch, each on its CP group. Every rank runs the same number of micro-batches;
        gradients are synchronised (summed over dp x cp) during the last one's backward. A
        rank idle in the last micro-batch still joins that synchronisation with a zero-weight
        pass; idle earlier ones are skipped."""
        assert self.cp is not None
        loss_tokens = max(step.loss_tokens, 1)  # the whole global batch's, known to every rank
        loss_sum = torch.zeros((), device=self.device)
        flops = 0.0
        for i, rmb in enumerate(step.micro_batches):
            last = i == len(step.micro_batches) - 1
            if rmb.idle and not last:
                continue
            loss_sum += self.micro_batch_pass(rmb, last=last, loss_tokens=loss_tokens)
            if not rmb.idle:  # this rank's share of its group's work
                flops += self.model.flops_of_documents(rmb.batch.seq_lens) / rmb.group.cp
        self.on_phase("sync")
        return (self.dp.all_reduce_sum(loss_sum) / loss_tokens).item(), flops

    def micro_batch_pass(self, rmb: RankMicroBatch, *, last: bool, loss_tokens: int) -> torch.Tensor:
        """Forward and backward of one planned micro-batch on its CP group (gradients
        synchronised only when `last`); returns its summed token loss (detached)."""
        assert self.cp is not None
        with self.dp.micro_batch(last=last):
            if rmb.idle:  # joins the gradient synchronisation, contributes nothing
                loss = self._priming_loss(self.dp.forward) * 0.0
            elif rmb.shard is None:
                loss = self._summed_token_loss(self.dp.forward, rmb.batch)
            else:
                attn = cp_attention_for(rmb, self.cp, self.device)
                loss = self._summed_token_loss(self.dp.forward, rmb.shard, attn)
            self.on_phase("backward")
            (loss / loss_tokens).backward()
        return loss.detach()

    def _clip_gradients(self) -> torch.Tensor:
        """Global gradient norm (before clipping); clipped to training.grad_clip unless 0."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.cfg.training.grad_clip
        if clip > 0:
            return torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)

    def train_step(self) -> StepMetrics:
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.on_phase("data")
        data, wait = self._data(), 0.0
        batches: list[MicroBatch] = []
        planned: PlannedStep | None = None
        if self.cp is None:
            for _ in range(self.cfg.training.grad_accum):
                batches.append(next(data))
                wait += data.last_wait_s
        else:
            planned = next(data)
            wait = data.last_wait_s
        lr = self.scheduler.get_last_lr()[0]
        try:
            self.optimizer.zero_grad(set_to_none=True)
            if planned is None:
                loss_value, flops = self.forward_backward(batches)
            else:
                loss_value, flops = self.forward_backward_planned(planned)
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
        self.on_phase("optimizer")
        for hook in self.before_update:
            hook()
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        self._data_state = batches[-1].sampler_state if planned is None else planned.sampler_state
        self.last_plan = planned.plan if planned is not None else None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the optimizer's kernels belong to this step's time
        step_time = time.perf_counter() - start
        tokens = (sum(len(mb.tokens) for mb in batches) if planned is None
                  else sum(len(r.batch.tokens) // r.group.cp for r in planned.micro_batches if r.batch))
        return StepMetrics(
            step=self.step, loss=loss_value, grad_norm=grad_norm_value, lr=lr, tokens=tokens,
            tokens_per_s=tokens / step_time, step_time_s=step_time, data_wait_s=wait,
            mfu=flops / step_time / self.peak_flops if self.peak_flops else None,
            memory_bytes=_memory_bytes(self.device),
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
        self.on_phase("data")
        data = self._data()
        if self.cp is None:
            for _ in range(self.cfg.training.grad_accum):
                state = next(data).sampler_state
        else:
            state = next(data).sampler_state
        with warnings.catch_warnings():  # skipping step 1 moves the schedule before any update
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            self.scheduler.step()
        self.step += 1
        self._data_state = state
        log.warning("skipped step %d: its data was consumed without training", self.step)

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a bitwise-exact resume needs. Tensors are the live ones (as with
        torch's own state_dicts): copy them before training on if they must not change."""
        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "data": dict(self._data_state),
            "rng": rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()  # the data thread must not run while the sampler is repositioned
        self.sampler.load_state_dict(state["data"])  # checks it fits this corpus and layout
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self._data_state = dict(state["data"])
        set_rng_state(state["rng"])
