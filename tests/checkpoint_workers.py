"""Processes for the checkpoint tests (imported by spawned children and subprocesses)."""

from __future__ import annotations

import sys
import traceback


def config(root: str, **sections):
    from longrun.config import config_from_dict

    raw = {
        "job": {"name": "ckpt", "seed": 5},
        "cluster": {"device": "cpu"},
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64},
        "data": {"source": "synthetic", "micro_batch_tokens": 256, "prefetch": 2,
                 "synthetic": {"min_len": 8, "max_len": 64, "mean": 24, "sigma": 0.8}},
        "training": {"steps": 8, "lr": 3e-3, "warmup_steps": 2},
        "checkpoint": {"dir": root, "interval_steps": 3, "keep_last": 5},
    }
    for name, values in sections.items():
        raw[name] = raw.get(name, {}) | values
    return config_from_dict(raw)


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def resume_across_attempts(rank: int, world: int, init_file: str, results, redis_url: str,
                           root: str) -> None:
    """Attempt 0 trains 5 of 8 steps (a checkpoint at step 3) and stops; attempt 1 restores
    (model read by rank 0 only and broadcast) and finishes. Reports whether the weights equal
    an uninterrupted run's, bit for bit."""
    try:
        import redis
        import torch
        import torch.distributed as dist

        from longrun.checkpoint import Checkpointer, RedisCommitLedger
        from longrun.trainer import Trainer

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        group = dist.group.WORLD
        client = redis.Redis.from_url(redis_url)
        cfg = config(root)
        layout = {"rank": rank, "world_size": world, "dp_rank": rank, "dp_size": world}
        with Trainer(cfg, dp_group=group, progress=False) as reference:
            reference.train()
            want = weights(reference)
        with Trainer(cfg, dp_group=group, progress=False) as first:
            ckpt = Checkpointer(cfg, ledger=RedisCommitLedger(client, "ckpt", 0), **layout)
            first.before_update.append(ckpt.before_update)
            first.train(steps=5, on_step=ckpt.on_step(first))
            ckpt.close()
        dist.barrier()  # attempt 0 is over everywhere (rank 0 has committed step 3)
        with Trainer(cfg, dp_group=group, progress=False) as second:
            ckpt = Checkpointer(cfg, ledger=RedisCommitLedger(client, "ckpt", 1), **layout)
            restored = ckpt.restore(second, world_group=group, dp_group=group)
            second.before_update.append(ckpt.before_update)
            second.train(on_step=ckpt.on_step(second))
            ckpt.close()
            got = weights(second)
        equal = all(torch.equal(got[k], want[k]) for k in want)
        results.put((rank, restored.step, equal))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def save_until_killed(root: str) -> None:
    """Resume from the newest checkpoint, then train and checkpoint every step until killed.
    Prints the step it resumed from. The state is ~40 MB so that a kill usually lands inside
    a write or a commit."""
    import torch

    from longrun.checkpoint import Checkpointer
    from longrun.trainer import Trainer

    torch.set_num_threads(1)
    cfg = config(root, model={"dim": 256, "n_layers": 4, "n_heads": 4},
                 training={"steps": 100_000}, checkpoint={"interval_steps": 1, "keep_last": 3})
    with Trainer(cfg, progress=False) as trainer:
        ckpt = Checkpointer(cfg)
        restored = ckpt.restore(trainer)
        print(f"resumed {restored.step if restored else 0}", flush=True)
        trainer.before_update.append(ckpt.before_update)
        trainer.train(on_step=ckpt.on_step(trainer))


if __name__ == "__main__":
    save_until_killed(sys.argv[1])
