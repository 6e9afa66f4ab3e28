"""Trainer overhead: the longrun step loop vs a plain hand-written PyTorch loop, same work.

    .venv/bin/python bench/trainer_overhead.py             # dim 256, 4 layers, 2048-token micro-batches
    .venv/bin/python bench/trainer_overhead.py --quick     # about a minute
    .venv/bin/python bench/trainer_overhead.py --model 125m --rounds 3   # dim 768, 12 layers (slow on CPU)
    .venv/bin/python bench/trainer_overhead.py --profile 3 # + torch.profiler tables of 3 steps each

Single process on the CPU. Both sides train the same model config from the same initial
weights (torch seeded with job.seed, then `Transformer(cfg.model)`), with the same
micro-batches, optimizer settings and LR schedule:
  longrun - `Trainer(cfg).train_step()`: it reads the standard-library corpus through its own
            background prefetcher (packing included) and does everything its step does
            (loss-token count, FLOPs estimate, clipping, non-finite checks, metrics).
  plain   - the loop one would write by hand: forward, F.cross_entropy(reduction='sum') /
            loss tokens, backward, clip_grad_norm_, fused AdamW (weight decay on matrices
            only, as build_optimizer), LambdaLR step. It is fed micro-batches pre-built once,
            before timing, from the same corpus and sampler (`packed_micro_batches` over
            `build_corpus` + `DocumentSampler(seed=job.seed)`), i.e. the exact stream the
            Trainer's prefetcher produces; so the plain loop pays nothing for data.
Equal work is checked, not assumed: step k of both sides uses micro-batch k of that stream;
after every longrun step its reported token count must equal the pre-built batch's (else the
run aborts), and the two losses of each step are compared (`loss_max_abs_diff`: 0.0 on fp32
CPU with grad_accum 1, the same arithmetic in the same order, which also shows both sides took
the same optimizer steps; with grad_accum > 1 float summation order makes it ~1e-7).

Timing, made for a noisy shared machine: after W warm-up steps of each side, the two sides
are interleaved step by step (step k of one, then step k of the other, which one goes first
alternating with k), so a burst of load from elsewhere lands on both. Every step is timed from
outside with the same clock. Reported: the median over steps of each side's tokens/s, their
ratio (longrun / plain; the target is >= 0.95), and the median and quartiles of the per-step
paired ratios (plain time / longrun time of the same step k). The timed steps are grouped in R
rounds of N for a progress line each. A per-phase breakdown (data wait, forward, forward +
backward, clip, optimizer, scheduler, and for longrun its own step timer) is kept for both.
Interleaving has one bias, measured and reported: the longrun prefetcher refills its queue
(reads and packs one micro-batch, `data_build_ms_per_micro_batch`) while the plain step that
follows runs, so that work is charged to the plain side.
Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from longrun.config import config_from_dict
from longrun.trainer import (
    IGNORE_INDEX,
    ByteTokenizer,
    DocumentSampler,
    Trainer,
    Transformer,
    build_corpus,
    lr_multiplier,
    packed_micro_batches,
)

MODELS = {
    "small": {"dim": 256, "n_layers": 4, "n_heads": 4, "max_seq_len": 512},
    "125m": {"dim": 768, "n_layers": 12, "n_heads": 12, "max_seq_len": 1024},
}
PHASES = ("data", "forward", "fwd_bwd", "clip", "optimizer", "scheduler", "own_timer")


def log(msg: str) -> None:
    print(f"[trainer_overhead] {msg}", file=sys.stderr, flush=True)


def make_config(args: argparse.Namespace, total_steps: int):
    return config_from_dict({
        "job": {"name": "bench-trainer-overhead", "seed": args.seed},
        "cluster": {"device": "cpu"},
        "model": MODELS[args.model],
        "data": {"source": "text", "path": "stdlib", "micro_batch_tokens": args.tokens,
                 "prefetch": args.prefetch},
        "training": {"steps": total_steps, "warmup_steps": min(10, total_steps),
                     "grad_accum": args.grad_accum, "dtype": args.dtype, "lr": 3e-4,
                     "grad_clip": 1.0},
    })


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


def prebuild(cfg, n_steps: int):
    """The micro-batch stream the Trainer's prefetcher will produce, grouped per step; and the
    mean seconds it took to produce one micro-batch (reading and packing)."""
    corpus = build_corpus(cfg.data, cfg.model, ByteTokenizer(cfg.model.vocab_size), cfg.job.seed)
    stream = packed_micro_batches(corpus, DocumentSampler(len(corpus), seed=cfg.job.seed),
                                  cfg.data.micro_batch_tokens)
    accum = cfg.training.grad_accum
    start = time.perf_counter()
    batches = [[next(stream) for _ in range(accum)] for _ in range(n_steps)]
    return batches, (time.perf_counter() - start) / (n_steps * accum)


def timed_step(side, k: int, expected: list[int], losses: dict) -> dict:
    """Step k of one side, timed from outside; the phases it spent, per second."""
    start = time.perf_counter()
    loss, n = side.step(k)
    seconds = time.perf_counter() - start
    if n != expected[k]:
        raise RuntimeError(f"{side.name} step {k} had {n} tokens, the pre-built batch {expected[k]}: "
                           "the two sides are not doing the same work")
    losses[side.name].append(loss)
    return {"k": k, "tokens": n, "seconds": seconds, **side.clock.take()}


def profile(sides, first_step: int, steps: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for side in sides:
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for k in range(first_step, first_step + steps):
                side.step(k)
        log(f"profile of {steps} {side.name} steps (self CPU time):\n"
            + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 warm-up + 5 rounds x 6 timed steps per side")
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--tokens", type=int, default=2048, help="data.micro_batch_tokens")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--prefetch", type=int, default=4, help="data.prefetch of the Trainer")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch.set_num_threads, the same for both sides")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up steps per side; default 3 (--quick 2)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of timed steps, for the per-round log; default 12 (--quick 5)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per side per round; default 8 (--quick 6)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="afterwards, N more steps of each side under torch.profiler (tables to stderr)")
    args = parser.parse_args()
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    rounds = args.rounds or (5 if args.quick else 12)
    steps = args.steps or (6 if args.quick else 8)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    torch.set_num_threads(args.threads)
    total = warmup + rounds * steps + args.profile
    cfg = make_config(args, total)
    batches, build_s = prebuild(cfg, total)
    expected = [sum(len(mb.tokens) for mb in step) for step in batches]
    plain, longrun = Plain(cfg, batches), Longrun(cfg)
    n_params = longrun.trainer.model.num_params()
    log(f"model {args.model} {MODELS[args.model]}: {n_params:,} parameters; {args.tokens} tokens per "
        f"micro-batch x {args.grad_accum}; {args.threads} threads; {warmup} warm-up + {rounds} rounds x "
        f"{steps} timed steps per side, interleaved; {build_s * 1e3:.2f} ms to build one micro-batch")

    losses: dict[str, list[float]] = {"longrun": [], "plain": []}
    rows: dict[str, list[dict]] = {"longrun": [], "plain": []}
    per_round = []
    try:
        for k in range(warmup):
            for side in (longrun, plain) if k % 2 == 0 else (plain, longrun):
                timed_step(side, k, expected, losses)
        for r in range(rounds):
            for k in range(warmup + r * steps, warmup + (r + 1) * steps):
                # Step k of both sides back to back, the first of the pair alternating.
                for side in (longrun, plain) if k % 2 == 0 else (plain, longrun):
                    rows[side.name].append(timed_step(side, k, expected, losses))
            row = {"round": r}
            for name, mine in rows.items():
                mine = mine[-steps:]
                row[f"{name}_tok_s"] = sum(x["tokens"] for x in mine) / sum(x["seconds"] for x in mine)
            row["ratio"] = row["longrun_tok_s"] / row["plain_tok_s"]
            per_round.append(row)
            log(f"round {r}: longrun {row['longrun_tok_s']:,.0f} tok/s, plain {row['plain_tok_s']:,.0f} "
                f"tok/s, ratio {row['ratio']:.3f}")
        if args.profile:
            profile((longrun, plain), warmup + rounds * steps, args.profile)
    finally:
        longrun.close()

    ours = statistics.median(x["tokens"] / x["seconds"] for x in rows["longrun"])
    theirs = statistics.median(x["tokens"] / x["seconds"] for x in rows["plain"])
    # Step k took the same tokens on both sides: its ratio of tokens/s is plain time / longrun time.
    paired = [p["seconds"] / o["seconds"] for o, p in zip(rows["longrun"], rows["plain"], strict=True)]
    quartiles = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
    n = min(len(losses["longrun"]), len(losses["plain"]))
    loss_diff = max(abs(a - b) for a, b in zip(losses["longrun"][:n], losses["plain"][:n], strict=True))
    phase_medians = {
        name: {p: round(statistics.median(x.get(p, 0.0) for x in mine) * 1e3, 2)
               for p in (*PHASES, "seconds") if p in mine[0]}
        for name, mine in rows.items()}
    for m in phase_medians.values():
        m["step"] = m.pop("seconds")
    log(f"phase medians, ms per step: {json.dumps(phase_medians)}")
    log(f"max |loss longrun - loss plain| over {n} steps: {loss_diff:.2e}")
    log(f"longrun {ours:,.0f} tok/s, plain {theirs:,.0f} tok/s (medians over steps), "
        f"ratio {ours / theirs:.3f}; per-step paired ratio median {statistics.median(paired):.3f} "
        f"(quartiles {quartiles[0]:.3f}..{quartiles[2]:.3f}); target >= 0.95")
    print(json.dumps({
        "longrun_tok_s": round(ours, 1), "plain_tok_s": round(theirs, 1),
        "ratio": round(ours / theirs, 4), "ratio_paired_median": round(statistics.median(paired), 4),
        "ratio_paired_quartiles": [round(quartiles[0], 4), round(quartiles[2], 4)],
        "phases_ms": phase_medians, "loss_max_abs_diff": loss_diff,
        "data_build_ms_per_micro_batch": round(build_s * 1e3, 3),
        "rounds": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in per_round],
        "config": {"model": args.model, **MODELS[args.model], "params": n_params,
                   "micro_batch_tokens": args.tokens, "grad_accum": args.grad_accum, "dtype": args.dtype,
                   "prefetch": args.prefetch, "threads": args.threads, "warmup": warmup, "rounds": rounds,
                   "steps_per_round": steps, "tokens_per_step": statistics.median(expected), "data": "stdlib",
                   "torch": torch.__version__, "cpus": os.cpu_count()},
    }))


if __name__ == "__main__":
    main()
