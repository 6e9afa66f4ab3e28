"""Gradient sync overlapped with backward (longrun's DDP path) vs sync after backward.

    .venv/bin/python bench/overlap.py            # 2 ranks, gloo on CPU, ~2 min
    .venv/bin/python bench/overlap.py --quick    # fewer rounds

Every rank times, on the same model and the same micro-batches, in alternating rounds:
  longrun   `Trainer.forward_backward` with a data-parallel group: DDP buckets, each bucket's
            all-reduce launched from backward hooks while backward goes on;
  after     the same forward/backward on an unwrapped model, then the gradients all-reduced in
            buckets of the same size once backward has finished (the naive baseline);
  compute   the forward/backward alone (no communication);
  comm      the bucketed all-reduce alone (no compute).
Hidden fraction = (after - longrun) / comm: the share of the communication that the overlap
took off the step. Each rank uses one intra-op thread (2 ranks on 2 cores); gloo's
communication runs on its own threads, so on a 2-core machine it competes with compute.
Progress goes to stderr; the last line on stdout is one JSON object (rank 0's medians).
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
from _common import logger, parser

from longrun.testing.worlds import World

BUCKET_MB = 25.0
log = logger("overlap")


def config(args):
    from longrun.config import config_from_dict

    return config_from_dict({
        "job": {"name": "overlap-bench", "seed": 0},
        "cluster": {"device": "cpu"},
        "model": {"dim": args.dim, "n_layers": args.layers, "n_heads": args.dim // 64,
                  "max_seq_len": args.tokens},
        "data": {"source": "synthetic", "micro_batch_tokens": args.tokens, "prefetch": 0},
        "training": {"grad_sync_bucket_mb": BUCKET_MB},
    })


def micro_batches(args, rank: int):
    """Documents with lognormal lengths packed to exactly `args.tokens` tokens, per rank."""
    from longrun.data.packing import build_micro_batch

    rng = np.random.default_rng([rank, 11])
    batches = []
    for _ in range(args.accum):
        docs, left = [], args.tokens
        while left > 0:
            n = int(min(left, max(2, rng.lognormal(np.log(args.tokens / 4), 0.8))))
            docs.append(rng.integers(0, 256, size=n))
            left -= n
        batches.append(build_micro_batch(docs))
    return batches


def bucketed_all_reduce(grads, group) -> None:
    """The baseline's sync: flatten into buckets of BUCKET_MB, all-reduce them all, copy back."""
    import torch
    import torch.distributed as dist

    cap = int(BUCKET_MB * 2**20)
    buckets, current, size = [], [], 0
    for g in reversed(grads):  # the order backward produces them, as DDP assumes at first
        current.append(g)
        size += g.numel() * g.element_size()
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    flats = [torch.cat([g.reshape(-1) for g in b]) for b in buckets]
    works = [dist.all_reduce(f, group=group, async_op=True) for f in flats]
    for work, flat, bucket in zip(works, flats, buckets, strict=True):
        work.wait()
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def rank_main(rank: int, world: int, init_file: str, results, args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from longrun.trainer import Trainer

    cfg = config(args)
    batches = micro_batches(args, rank)
    ours = Trainer(cfg, dp_group=dist.group.WORLD, progress=False)
    plain = Trainer(cfg, progress=False)
    params = [p for p in plain.model.parameters()]
    n_params = sum(p.numel() for p in params)

    def run_ours():
        ours.optimizer.zero_grad(set_to_none=True)
        ours.forward_backward(batches)

    def run_compute():
        plain.optimizer.zero_grad(set_to_none=True)
        plain.forward_backward(batches)

    def run_after():
        run_compute()
        bucketed_all_reduce([p.grad for p in params], dist.group.WORLD)

    def run_comm():
        bucketed_all_reduce([p.grad for p in params], dist.group.WORLD)

    cases = {"longrun": run_ours, "after": run_after, "compute": run_compute, "comm": run_comm}
    times: dict[str, list[float]] = {k: [] for k in cases}
    run_compute()  # gradients exist for the comm-only case; also a warm-up
    for name in cases:
        cases[name]()  # warm-up: DDP's bucket rebuild, allocator
    for r in range(args.rounds):
        order = list(cases) if r % 2 == 0 else list(reversed(cases))
        for name in order:
            dist.barrier()  # both ranks start each case together
            start = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - start)
        if rank == 0:
            log(f"round {r + 1}/{args.rounds}: "
                + "  ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in times.items()))
    results.put((rank, {k: statistics.median(v) for k, v in times.items()}, n_params))
    dist.barrier()
    ours.close()
    plain.close()
    dist.destroy_process_group()


def main() -> None:
    cli = parser(__doc__.split("\n")[0])
    cli.add_argument("--world", type=int, default=2)
    cli.add_argument("--dim", type=int, default=512)
    cli.add_argument("--layers", type=int, default=4)
    cli.add_argument("--tokens", type=int, default=512, help="tokens per micro-batch per rank")
    cli.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    cli.add_argument("--rounds", type=int, default=10)
    cli.add_argument("--quick", action="store_true", help="4 rounds")
    args = cli.parse_args()
    if args.quick:
        args.rounds = 4
    with World(rank_main, args.world, args=(args,)) as world:
        out = sorted(world.run(timeout=1800), key=lambda r: r[0])
    medians, n_params = out[0][1], out[0][2]
    hidden = (medians["after"] - medians["longrun"]) / medians["comm"]
    log(f"{n_params:,} parameters ({n_params * 4 / 2**20:.0f} MiB of fp32 gradients), "
        f"{args.world} ranks, {args.tokens} tokens x {args.accum} micro-batches per rank")
    for name, seconds in medians.items():
        log(f"  {name:8s} {seconds * 1e3:8.1f} ms (median of {args.rounds})")
    log(f"speed-up of the step {medians['after'] / medians['longrun']:.2f}x; "
        f"communication hidden {100 * hidden:.0f}%")
    print(json.dumps({
        "world": args.world, "params": n_params, "tokens_per_rank": args.tokens * args.accum,
        "longrun_step_s": round(medians["longrun"], 4), "after_step_s": round(medians["after"], 4),
        "compute_s": round(medians["compute"], 4), "comm_s": round(medians["comm"], 4),
        "ratio": round(medians["after"] / medians["longrun"], 3),
        "hidden_fraction": round(hidden, 3),
    }))


if __name__ == "__main__":
    main()
