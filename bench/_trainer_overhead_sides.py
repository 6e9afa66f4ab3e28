"""The two sides bench/trainer_overhead.py compares, each with a per-phase clock (run that
script; this file is not a bench): the longrun `Trainer` and a plain hand-written loop."""

from __future__ import annotations

import functools
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from longrun.data.packing import IGNORE_INDEX
from longrun.trainer import Trainer, Transformer, lr_multiplier


class Clock:
    """Seconds per named phase of the current step; a forward hook pair times the model."""

    def __init__(self, model: torch.nn.Module):
        self.now: dict[str, float] = defaultdict(float)
        self._fwd_start = 0.0
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)

    def _pre(self, *_):
        self._fwd_start = time.perf_counter()

    def _post(self, *_):
        self.now["forward"] += time.perf_counter() - self._fwd_start

    def timed(self, phase: str, fn):
        @functools.wraps(fn)  # keeps LambdaLR's mark on optimizer.step (else it warns)
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.now[phase] += time.perf_counter() - start
        return wrapper

    def take(self) -> dict[str, float]:
        out, self.now = dict(self.now), defaultdict(float)
        return out


class Longrun:
    name = "longrun"

    def __init__(self, cfg):
        self.trainer = Trainer(cfg, device="cpu", progress=False)
        t = self.trainer
        self.clock = Clock(t.model)
        # Instance attributes shadow the methods train_step calls: phase timing, no edits.
        t.forward_backward = self.clock.timed("fwd_bwd", t.forward_backward)
        t._clip_gradients = self.clock.timed("clip", t._clip_gradients)
        t.optimizer.step = self.clock.timed("optimizer", t.optimizer.step)
        t.scheduler.step = self.clock.timed("scheduler", t.scheduler.step)

    def step(self, k: int) -> tuple[float, int]:
        m = self.trainer.train_step()
        self.clock.now["data"] += m.data_wait_s
        self.clock.now["own_timer"] += m.step_time_s  # train_step's own clock, for comparison
        return m.loss, m.tokens

    def close(self) -> None:
        self.trainer.close()


class Plain:
    """A hand-written loop over pre-built micro-batches."""

    name = "plain"

    def __init__(self, cfg, batches):
        self.cfg, self.batches = cfg, batches
        t = cfg.training
        torch.manual_seed(cfg.job.seed)
        self.model = Transformer(cfg.model)
        params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=t.lr, betas=t.betas, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_multiplier(
            s, warmup_steps=t.warmup_steps, total_steps=t.steps, min_lr_ratio=t.min_lr_ratio))
        self.clock = Clock(self.model)
        self.bf16 = t.dtype == "bfloat16"

    def step(self, k: int) -> tuple[float, int]:
        now, clock = self.clock.now, time.perf_counter
        batches = self.batches[k]
        start = clock()
        self.optimizer.zero_grad(set_to_none=True)
        n_loss = sum(mb.n_tokens for mb in batches)
        total = 0.0
        for mb in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                logits = self.model(mb.tokens, mb.positions, mb.cu_seqlens)
            loss = F.cross_entropy(logits.float(), mb.targets, ignore_index=IGNORE_INDEX,
                                   reduction="sum") / n_loss
            loss.backward()
            total += loss.item()
        t1 = clock()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.training.grad_clip)
        t2 = clock()
        self.optimizer.step()
        t3 = clock()
        self.scheduler.step()
        t4 = clock()
        now["fwd_bwd"] += t1 - start
        now["clip"] += t2 - t1
        now["optimizer"] += t3 - t2
        now["scheduler"] += t4 - t3
        return total, sum(len(mb.tokens) for mb in batches)

    def close(self) -> None:
        pass
