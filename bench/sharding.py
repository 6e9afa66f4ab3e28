"""Sharded training vs data parallelism: training state held per rank, and step time.

    .venv/bin/python bench/sharding.py            # 4 ranks, gloo on CPU, ~3 min
    .venv/bin/python bench/sharding.py --quick    # fewer rounds

Every layout trains the same model on the same global batch (each span rank its share of
fixed micro-batches), on one 4-rank world:
  ddp          the baseline: every rank holds the whole model, its gradients and AdamW state
               (longrun's DDP path);
  fsdp4        FSDP2 over 4 ranks, explicit forward/backward prefetch (longrun's default);
  fsdp4-noprefetch  the same with FSDP2's own defaults (no explicit prefetch), to see what
               issuing the next block's all-gather early is worth;
  hsdp2x2      sharded over 2, replicated over 2;
  tp2xfsdp2    tensor (and sequence) parallel over 2, FSDP over 2.
Reported per layout: the state bytes rank 0 holds (parameters + gradients + optimizer,
`Trainer.state_bytes`), its ratio to DDP's, and the median step time (forward, backward,
optimizer) and its ratio to DDP's. On a 2-core CPU machine gloo's collectives compete with
compute for the cores, so the step times say little about GPUs; the memory ratios carry over.
Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import json
import statistics
import time

from _common import logger, packed_micro_batches, parser

from longrun.testing.worlds import World

log = logger("sharding")
LAYOUTS = {
    "ddp": {"dp": 4},
    "fsdp4": {"fsdp": 4},
    "fsdp4-noprefetch": {"fsdp": 4},
    "hsdp2x2": {"dp": 2, "fsdp": 2},
    "tp2xfsdp2": {"fsdp": 2, "tp": 2},
}


def config(args, parallelism: dict):
    from longrun.config import config_from_dict

    return config_from_dict({
        "job": {"name": "sharding-bench", "seed": 0},
        "cluster": {"device": "cpu", "workers_per_node": 4},
        "parallelism": parallelism,
        "model": {"dim": args.dim, "n_layers": args.layers, "n_heads": args.dim // 64,
                  "max_seq_len": args.tokens},
        "data": {"source": "synthetic", "micro_batch_tokens": args.tokens, "prefetch": 0},
    })


def rank_main(rank: int, world: int, init_file: str, results, args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from longrun.commgroup import form_groups, single_node_layout
    from longrun.trainer import Trainer

    report = {}
    for name, parallelism in LAYOUTS.items():
        cfg = config(args, parallelism)
        groups = form_groups(single_node_layout(cfg.dims), rank)
        mesh = groups.device_mesh("cpu") if cfg.dims.sharded else None
        trainer = Trainer(cfg, dp_group=groups.dp_cp, mesh=mesh, progress=False)
        if name.endswith("-noprefetch"):
            for block in trainer.model.layers:
                block.set_modules_to_forward_prefetch([])
                block.set_modules_to_backward_prefetch([])
        span, mine = trainer.parallel.size, trainer.parallel.rank
        batches = packed_micro_batches(args.tokens, span * args.accum)
        batches = batches[mine * args.accum:(mine + 1) * args.accum]

        def step(t=trainer, b=batches):
            t.optimizer.zero_grad(set_to_none=True)
            t.forward_backward(b)
            t.optimizer.step()

        step()  # warm-up: FSDP's lazy init, DDP's bucket rebuild, optimizer state
        times = []
        for _ in range(args.rounds):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        held = trainer.state_bytes()
        report[name] = {"state_bytes": sum(held.values()), "step_s": statistics.median(times)}
        if rank == 0:
            log(f"{name:17s} state {sum(held.values()) / 2**20:7.1f} MiB  step "
                f"{statistics.median(times) * 1e3:7.1f} ms (median of {args.rounds})")
        trainer.close()
        dist.barrier()
    results.put((rank, report))
    dist.destroy_process_group()


def main() -> None:
    cli = parser(__doc__.split("\n")[0])
    cli.add_argument("--dim", type=int, default=512)
    cli.add_argument("--layers", type=int, default=4)
    cli.add_argument("--tokens", type=int, default=512, help="tokens per micro-batch per rank")
    cli.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    cli.add_argument("--rounds", type=int, default=8)
    cli.add_argument("--quick", action="store_true", help="3 rounds")
    args = cli.parse_args()
    if args.quick:
        args.rounds = 3
    with World(rank_main, 4, args=(args,)) as world:
        out = dict(world.run(timeout=3600))
    report = out[0]
    base = report["ddp"]
    rows = {name: {"state_mib": round(r["state_bytes"] / 2**20, 2),
                   "state_vs_ddp": round(r["state_bytes"] / base["state_bytes"], 3),
                   "step_s": round(r["step_s"], 4), "step_vs_ddp": round(r["step_s"] / base["step_s"], 3)}
            for name, r in report.items()}
    rows["prefetch_speedup"] = round(report["fsdp4-noprefetch"]["step_s"] / report["fsdp4"]["step_s"], 3)
    print(json.dumps({"world": 4, "dim": args.dim, "layers": args.layers,
                      "tokens_per_rank": args.tokens * args.accum, **rows}))


if __name__ == "__main__":
    main()
