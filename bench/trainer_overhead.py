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
            before timing, from the same corpus and sampler (`global_batches` over
            `build_corpus` + `DocumentSampler(seed=job.seed)`, each packed by
            `data_parallel_step`), i.e. the exact stream the Trainer's prefetcher produces;
            so the plain loop pays nothing for data.
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
The two sides are in bench/_trainer_overhead_sides.py.
Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

import torch
from _common import logger, parser
from _trainer_overhead_sides import Longrun, Plain

from longrun.config import config_from_dict
from longrun.data.byte_tokenizer import ByteTokenizer
from longrun.data.documents import DocumentSampler, build_corpus
from longrun.data.packing import global_batches
from longrun.trainer.step import data_parallel_step

MODELS = {
    "small": {"dim": 256, "n_layers": 4, "n_heads": 4, "max_seq_len": 512},
    "125m": {"dim": 768, "n_layers": 12, "n_heads": 12, "max_seq_len": 1024},
}
PHASES = ("data", "forward", "fwd_bwd", "clip", "optimizer", "scheduler", "own_timer")
log = logger("trainer_overhead")


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


def prebuild(cfg, n_steps: int):
    """The micro-batch stream the Trainer's prefetcher will produce, grouped per step; and the
    mean seconds it took to produce one micro-batch (reading and packing)."""
    corpus = build_corpus(cfg.data, cfg.model, ByteTokenizer(cfg.model.vocab_size), cfg.job.seed)
    # What the Trainer's feed does alone: a global batch of global_batch_tokens, packed into
    # micro-batches of micro_batch_tokens (`data_parallel_step` for a span of one rank).
    stream = global_batches(corpus, DocumentSampler(len(corpus), seed=cfg.job.seed),
                            cfg.global_batch_tokens)
    start = time.perf_counter()
    batches = [[w.inputs for w in data_parallel_step(next(stream), corpus, 0, 1,
                                                     cfg.data.micro_batch_tokens).micro_batches]
               for _ in range(n_steps)]
    return batches, (time.perf_counter() - start) / sum(len(b) for b in batches)


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


def parse_args():
    cli = parser(__doc__)
    cli.add_argument("--quick", action="store_true", help="2 warm-up + 5 rounds x 6 timed steps per side")
    cli.add_argument("--model", choices=sorted(MODELS), default="small")
    cli.add_argument("--tokens", type=int, default=2048, help="data.micro_batch_tokens")
    cli.add_argument("--grad-accum", type=int, default=1)
    cli.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    cli.add_argument("--prefetch", type=int, default=4, help="data.prefetch of the Trainer")
    cli.add_argument("--threads", type=int, default=os.cpu_count(),
                     help="torch.set_num_threads, the same for both sides")
    cli.add_argument("--warmup", type=int, default=None,
                     help="warm-up steps per side; default 3 (--quick 2)")
    cli.add_argument("--rounds", type=int, default=None,
                     help="rounds of timed steps, for the per-round log; default 12 (--quick 5)")
    cli.add_argument("--steps", type=int, default=None,
                     help="timed steps per side per round; default 8 (--quick 6)")
    cli.add_argument("--seed", type=int, default=0)
    cli.add_argument("--profile", type=int, default=0, metavar="N",
                     help="afterwards, N more steps of each side under torch.profiler (tables to stderr)")
    args = cli.parse_args()
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    args.rounds = args.rounds or (5 if args.quick else 12)
    args.steps = args.steps or (6 if args.quick else 8)
    return args


def main() -> None:
    args = parse_args()
    warmup, rounds, steps = args.warmup, args.rounds, args.steps
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
    try:
        rows, losses, per_round = interleave((longrun, plain), expected, warmup, rounds, steps)
        if args.profile:
            profile((longrun, plain), warmup + rounds * steps, args.profile)
    finally:
        longrun.close()
    summary = summarize(rows, losses, per_round)
    print(json.dumps({
        **summary, "data_build_ms_per_micro_batch": round(build_s * 1e3, 3),
        "rounds": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in per_round],
        "config": {"model": args.model, **MODELS[args.model], "params": n_params,
                   "micro_batch_tokens": args.tokens, "grad_accum": args.grad_accum, "dtype": args.dtype,
                   "prefetch": args.prefetch, "threads": args.threads, "warmup": warmup, "rounds": rounds,
                   "steps_per_round": steps, "tokens_per_step": statistics.median(expected), "data": "stdlib",
                   "torch": torch.__version__, "cpus": os.cpu_count()},
    }))


def interleave(sides, expected: list[int], warmup: int, rounds: int, steps: int):
    """Warm-up steps, then `rounds` of `steps` timed steps, step k of both sides back to back."""
    longrun, plain = sides
    losses: dict[str, list[float]] = {"longrun": [], "plain": []}
    rows: dict[str, list[dict]] = {"longrun": [], "plain": []}
    per_round = []
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
    return rows, losses, per_round


def summarize(rows: dict[str, list[dict]], losses: dict[str, list[float]], per_round: list[dict]) -> dict:
    """Medians over steps, the paired per-step ratios, the loss difference, phase medians."""
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
    return {
        "longrun_tok_s": round(ours, 1), "plain_tok_s": round(theirs, 1),
        "ratio": round(ours / theirs, 4), "ratio_paired_median": round(statistics.median(paired), 4),
        "ratio_paired_quartiles": [round(quartiles[0], 4), round(quartiles[2], 4)],
        "phases_ms": phase_medians, "loss_max_abs_diff": loss_diff,
    }


if __name__ == "__main__":
    main()
