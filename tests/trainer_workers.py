"""Worker processes for the data-parallel trainer tests (imported by spawned children).

Each worker joins a gloo world through a file store, runs its checks, and reports plain
numbers back through a queue; the assertions stay in the test."""

from __future__ import annotations

import copy
import traceback

import numpy as np


def tiny_config(**training):
    from longrun.config import config_from_dict

    return config_from_dict({
        "job": {"name": "dp", "seed": 3},
        "cluster": {"device": "cpu"},
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64},
        "data": {"source": "synthetic", "micro_batch_tokens": 256, "prefetch": 2,
                 "synthetic": {"min_len": 8, "max_len": 64, "mean": 24, "sigma": 0.8}},
        "training": {"steps": 6, "lr": 3e-3, "warmup_steps": 2} | training,
    })


def fixed_micro_batches(count: int):
    """`count` packed micro-batches of random documents, identical in every process."""
    from longrun.data.packing import build_micro_batch

    rng = np.random.default_rng(7)
    batches = []
    for _ in range(count):
        lengths = rng.integers(4, 40, size=int(rng.integers(2, 6)))
        batches.append(build_micro_batch([rng.integers(0, 256, size=n) for n in lengths]))
    return batches


def _grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _join(rank: int, world: int, init_file: str):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # up to 4 ranks share 2 cores; more threads only thrash

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    return dist


def gradients_match_one_process(rank: int, world: int, init_file: str, results) -> None:
    """For accumulation 1 and 2: this rank's share of a global batch through DDP gives the
    same gradients and loss as one process running the whole batch."""
    try:
        dist = _join(rank, world, init_file)
        from longrun.trainer import Trainer

        for accum in (1, 2):
            cfg = tiny_config(grad_accum=accum)
            everything = fixed_micro_batches(world * accum)
            mine = everything[rank * accum:(rank + 1) * accum]
            with Trainer(cfg, dp_group=dist.group.WORLD, progress=False) as parallel:
                loss, _ = parallel.forward_backward(mine)
                got = _grads(parallel.model)
            with Trainer(cfg, progress=False) as alone:
                ref_loss, _ = alone.forward_backward(everything)
                want = _grads(alone.model)
            worst = max(float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp(min=1e-12))
                        for k in want)
            results.put((rank, accum, loss, ref_loss, worst))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def resume_is_bitwise(rank: int, world: int, init_file: str, results) -> None:
    """Straight through 6 steps vs 3 steps, state saved, a new Trainer loads it and runs to
    6: every rank reports whether the weights are bitwise equal, and its final loss."""
    try:
        import torch

        dist = _join(rank, world, init_file)
        from longrun.trainer import Trainer

        cfg = tiny_config(grad_accum=2)
        group = dist.group.WORLD
        with Trainer(cfg, dp_group=group, progress=False) as straight:
            last = straight.train()
            want = _weights(straight)
        with Trainer(cfg, dp_group=group, progress=False) as first:
            first.train(steps=3)
            saved = copy.deepcopy(first.state_dict())
        with Trainer(cfg, dp_group=group, progress=False) as second:
            second.load_state_dict(saved)
            resumed = second.train()
            got = _weights(second)
        equal = all(torch.equal(got[k], want[k]) for k in want)
        results.put((rank, equal, last.loss, resumed.loss, saved["data"]))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def communication_overlaps_backward(rank: int, world: int, init_file: str, results) -> None:
    """With small buckets, record the order of two events in one backward: each bucket's
    all-reduce launch, and the gradient of the first layer (among the last backward computes)."""
    try:
        dist = _join(rank, world, init_file)
        import longrun.parallel.data_parallel as parallel
        from longrun.trainer import Trainer

        events: list[str] = []
        summing_hook = parallel._sum_allreduce_hook

        def recording_hook(group, bucket):
            events.append("allreduce")
            return summing_hook(group, bucket)

        parallel._sum_allreduce_hook = recording_hook
        cfg = tiny_config(grad_sync_bucket_mb=0.01)
        with Trainer(cfg, dp_group=dist.group.WORLD, progress=False) as trainer:
            first_layer = trainer.model.layers[0].attention_norm.weight
            first_layer.register_hook(lambda grad: events.append("first-layer-grad"))
            events.clear()  # drop the priming backward's events
            trainer.forward_backward(fixed_micro_batches(world)[rank:rank + 1])
        results.put((rank, events))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
