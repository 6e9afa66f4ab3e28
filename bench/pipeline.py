"""Pipeline parallelism: the bubble each schedule leaves, measured against the theory, tokens/s
against FSDP, and the training state a rank holds against DDP's.

    .venv/bin/python bench/pipeline.py            # 4 ranks, gloo on CPU, ~30 s
    .venv/bin/python bench/pipeline.py --quick    # fewer rounds

Every layout trains the same model (8 blocks, untied) on the same global batch, on one
4-rank world:
  ddp               the baseline: every rank holds the whole model, its gradients and AdamW state;
  fsdp4             FSDP2 over the 4 ranks (longrun's sharded default);
  pp4-1f1b          4 pipeline stages of 2 blocks, 1F1B;
  pp4-interleaved   4 pipeline ranks x 2 virtual stages of 1 block, interleaved 1F1B.
The pipelines run `--micro-batches` micro-batches per step (all four layouts train the same
global batch: DDP and FSDP split it over their ranks, a pipeline's every stage sees all of it).
The bubble per rank is measured, not assumed: the seconds a stage spends inside its forward
and backward (`PipelineStage.forward_one_chunk`, `backward_one_chunk`,
`backward_weight_one_chunk`, timed by wrapping them) against the step's wall time; idle =
1 - busy / wall, the mean over ranks, next to the theory for equal stages ((p - 1) / m of the
useful time for 1F1B, divided by v when interleaved; as a share of the step, bubble / (1 +
bubble)). On a 2-core machine four ranks compete for the cores, so a stage's compute stretches
when its neighbours compute too: the measured bubble is a lower bound of an uncontended one
and the step times say little about GPUs; the memory ratios carry over.
Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import json
import statistics
import time

from _common import logger, packed_micro_batches, parser

from longrun.testing.worlds import World

log = logger("pipeline")
LAYOUTS = {
    "ddp": ({"dp": 4}, "1f1b"),
    "fsdp4": ({"fsdp": 4}, "1f1b"),
    "pp4-1f1b": ({"pp": 4}, "1f1b"),
    "pp4-interleaved": ({"pp": 4, "pp_virtual_stages": 2}, "interleaved_1f1b"),
}


def config(args, parallelism: dict, schedule: str, accum: int):
    from longrun.config import config_from_dict

    return config_from_dict({
        "job": {"name": "pipeline-bench", "seed": 0},
        "cluster": {"device": "cpu", "workers_per_node": 4},
        "parallelism": parallelism,
        "model": {"dim": args.dim, "n_layers": 8, "n_heads": args.dim // 64, "max_seq_len": args.tokens,
                  "tie_embeddings": False},
        "data": {"source": "synthetic", "micro_batch_tokens": args.tokens, "prefetch": 0},
        "training": {"grad_accum": accum, "pp_schedule": schedule},
    })


class StageClock:
    """Seconds spent inside a pipeline stage's compute, by wrapping its three entry points."""

    METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self):
        from torch.distributed.pipelining.stage import _PipelineStageBase

        self.busy = 0.0
        for name in self.METHODS:
            original = getattr(_PipelineStageBase, name)

            def timed(stage, *a, _original=original, **k):
                start = time.perf_counter()
                try:
                    return _original(stage, *a, **k)
                finally:
                    self.busy += time.perf_counter() - start
            setattr(_PipelineStageBase, name, timed)


def rank_main(rank: int, world: int, init_file: str, results, args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from longrun.commgroup import form_groups, single_node_layout
    from longrun.trainer import Trainer

    clock = StageClock()
    batches = packed_micro_batches(args.tokens, args.micro_batches)
    report = {}
    for name, (parallelism, schedule) in LAYOUTS.items():
        pp = parallelism.get("pp", 1)
        span = 4 // pp
        cfg = config(args, parallelism, schedule, args.micro_batches // span)
        groups = form_groups(single_node_layout(cfg.dims), rank)
        mesh = groups.device_mesh("cpu") if cfg.dims.sharded else None
        trainer = Trainer(cfg, dp_group=groups.dp_cp, mesh=mesh,
                          pipeline_group=groups.pp if pp > 1 else None, progress=False)
        mine = trainer.parallel.rank
        accum = args.micro_batches // span
        work = batches[mine * accum:(mine + 1) * accum]

        def step(t=trainer, b=work):
            t.optimizer.zero_grad(set_to_none=True)
            t.forward_backward(b)
            t.optimizer.step()

        step()  # warm-up: the schedule's shape inference, FSDP's lazy init, DDP's buckets
        times, busy = [], []
        for _ in range(args.rounds):
            dist.barrier()
            clock.busy = 0.0
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
            busy.append(clock.busy)
        held = trainer.state_bytes()
        wall = statistics.median(times)
        idle = 1 - statistics.median(b / t for b, t in zip(busy, times, strict=True)) if pp > 1 else None
        report[name] = {"state_bytes": sum(held.values()), "step_s": wall, "idle": idle}
        if rank == 0:
            log(f"{name:16s} state {sum(held.values()) / 2**20:7.1f} MiB  step {wall * 1e3:7.1f} ms"
                + (f"  idle {idle:.1%}" if idle is not None else ""))
        trainer.close()
        dist.barrier()
    results.put((rank, report))
    dist.destroy_process_group()


def main() -> None:
    from longrun.parallel.schedules import bubble_fraction

    cli = parser(__doc__.split("\n")[0])
    cli.add_argument("--dim", type=int, default=256)
    cli.add_argument("--tokens", type=int, default=256, help="tokens per micro-batch")
    cli.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step (global)")
    cli.add_argument("--rounds", type=int, default=6)
    cli.add_argument("--quick", action="store_true", help="3 rounds")
    args = cli.parse_args()
    if args.quick:
        args.rounds = 3
    with World(rank_main, 4, args=(args,)) as world:
        out = dict(world.run(timeout=3600))
    tokens = args.tokens * args.micro_batches
    per_layout = {}
    for name in LAYOUTS:
        ranks = [out[r][name] for r in range(4)]
        per_layout[name] = {
            "state_mib_max": round(max(r["state_bytes"] for r in ranks) / 2**20, 2),
            "step_s": round(max(r["step_s"] for r in ranks), 4),
            "tokens_per_s": round(tokens / max(r["step_s"] for r in ranks), 1),
            "idle": (round(statistics.mean(r["idle"] for r in ranks), 4)
                     if ranks[0]["idle"] is not None else None),
        }
    ddp, fsdp = per_layout["ddp"], per_layout["fsdp4"]
    one, inter = per_layout["pp4-1f1b"], per_layout["pp4-interleaved"]
    m = args.micro_batches
    print(json.dumps({
        "world": 4, "dim": args.dim, "layers": 8, "micro_batches": m, "tokens_per_step": tokens,
        "bubble_1f1b": one["idle"], "bubble_theory_1f1b": round(bubble_fraction("1f1b", 4, m), 4),
        "bubble_interleaved": inter["idle"],
        "bubble_theory_interleaved": round(bubble_fraction("interleaved_1f1b", 4, m, 2), 4),
        "interleaved_vs_1f1b": round(inter["tokens_per_s"] / one["tokens_per_s"], 3),
        "pp4_vs_fsdp4_tokens_per_s": round(one["tokens_per_s"] / fsdp["tokens_per_s"], 3),
        "pp4_state_vs_ddp": round(one["state_mib_max"] / ddp["state_mib_max"], 3),
        "fsdp4_state_vs_ddp": round(fsdp["state_mib_max"] / ddp["state_mib_max"], 3),
        "layouts": per_layout,
    }))


if __name__ == "__main__":
    main()
