"""Worker processes for the pipeline-parallel tests (imported by spawned children).

Each joins a gloo world, forms the layout's groups through commgroup (the pipeline's groups,
and each stage's device mesh where sharded) and reports plain numbers; the assertions stay in
the tests."""

from __future__ import annotations

import traceback

from sharded_workers import _full
from trainer_workers import _join, fixed_micro_batches

# Document lengths from 8 to 64 tokens: packed per rank, their global batches needed one
# micro-batch more than grad_accum on some steps (padded up to the schedule's rounding then).
VARIED = {"synthetic": {"min_len": 8, "max_len": 64, "mean": 24, "sigma": 0.8}}


def pipeline_config(parallelism: dict, world: int, *, schedule: str = "1f1b", grad_accum: int = 4,
                    n_layers: int = 8, sections: dict | None = None, data: dict | None = None, **training):
    """A tiny untied decoder of `n_layers` blocks at `parallelism` on one node of `world`
    workers (parallelism {} and world 1: the single-process reference); `sections`: more of
    the config (job, checkpoint, ...); `data`: more of the data section."""
    from longrun.config import config_from_dict

    return config_from_dict({**(sections or {}),
        "job": {"name": "pipeline", "seed": 5},
        "cluster": {"device": "cpu", "workers_per_node": world},
        "parallelism": parallelism,
        "model": {"dim": 64, "n_layers": n_layers, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                  "vocab_size": 260, "max_seq_len": 64, "tie_embeddings": False},
        "data": {"source": "synthetic", "micro_batch_tokens": 256, "prefetch": 1, **(data or {})},
        "training": {"steps": 4, "lr": 3e-3, "warmup_steps": 1, "grad_accum": grad_accum,
                     "pp_schedule": schedule, **training},
    })


def pipelined_trainer(cfg, groups):
    from longrun.trainer import Trainer

    mesh = groups.device_mesh("cpu") if cfg.dims.sharded else None
    return Trainer(cfg, "cpu", dp_group=groups.dp_cp, mesh=mesh,
                   pipeline_group=groups.pp if cfg.dims.pp > 1 else None, progress=False)


def gradients_match_one_process(rank: int, world: int, init_file: str, results, parallelism: dict,
                                schedule: str, training: dict) -> None:
    """One step of a fixed global batch through the pipeline at `parallelism` gives the loss and
    (for the parameters this rank holds) the full gradients of one process on the whole batch.
    Reports (rank, loss, reference loss, worst relative gradient error, names held)."""
    try:
        dist = _join(rank, world, init_file)
        from longrun.commgroup import form_groups, single_node_layout
        from longrun.trainer import Trainer

        cfg = pipeline_config(parallelism, world, schedule=schedule, **training)
        groups = form_groups(single_node_layout(cfg.dims), rank)
        with pipelined_trainer(cfg, groups) as trainer:
            accum, span = cfg.training.grad_accum, trainer.parallel.size
            everything = fixed_micro_batches(span * accum)
            mine = everything[trainer.parallel.rank * accum:(trainer.parallel.rank + 1) * accum]
            loss, _ = trainer.forward_backward(mine)
            got = {n: _full(p.grad).detach().clone() for n, p in trainer.model.named_parameters()}
            norm = float(trainer._clip_gradients())
        reference = pipeline_config({}, 1, schedule=schedule, **training)
        with Trainer(reference, "cpu", progress=False) as alone:
            ref_loss, _ = alone.forward_backward(everything)
            want = {n: p.grad.detach().clone() for n, p in alone.model.named_parameters()}
            ref_norm = float(alone._clip_gradients())
        worst = max(float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp(min=1e-12)) for k in got)
        results.put((rank, loss, ref_loss, worst, sorted(got), norm, ref_norm))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def packed_steps_match_one_process(rank: int, world: int, init_file: str, results, parallelism: dict,
                                   schedule: str, training: dict, steps: int) -> None:
    """`steps` steps of the feed's global batches through the pipeline at `parallelism`, each
    from the same weights: the loss and (for the parameters this rank holds) the gradients of
    one process on the same documents. Reports (rank, micro-batches per step, empty ones per
    step, the counts the schedule was built for, worst relative gradient error, losses,
    reference losses)."""
    try:
        dist = _join(rank, world, init_file)
        from longrun.commgroup import form_groups, single_node_layout
        from longrun.data.packing import build_micro_batch
        from longrun.trainer import Trainer

        cfg = pipeline_config(parallelism, world, schedule=schedule, **training)
        groups = form_groups(single_node_layout(cfg.dims), rank)
        reference = pipeline_config({}, 1, schedule=schedule, **training)
        counts, empty, builds, worst, losses, ref_losses = [], [], [], 0.0, [], []
        with pipelined_trainer(cfg, groups) as trainer, Trainer(reference, "cpu", progress=False) as alone:
            pipe = trainer.pipeline
            build = pipe._build_schedule

            def counted(n):
                builds.append(n)
                return build(n)

            pipe._build_schedule = counted
            for _ in range(steps):
                work, _ = trainer.feed.next()
                trainer.feed.done(work)
                trainer.optimizer.zero_grad(set_to_none=True)
                loss, _ = trainer.forward_backward(work)
                counts.append(len(work.micro_batches))
                empty.append(getattr(pipe, "empty_micro_batches", None))
                got = {n: _full(p.grad).detach().clone() for n, p in trainer.model.named_parameters()}
                # The step's micro-batches over the span (a pipeline's stages hold the same ones).
                shares: list = [None] * world
                dist.all_gather_object(shares, (trainer.parallel.rank, [
                    mb.documents.doc_ids for mb in work.micro_batches if not mb.idle]))
                everything = [build_micro_batch([alone.corpus[i] for i in ids], doc_ids=ids)
                              for _, share in sorted(dict(shares).items()) for ids in share]
                alone.optimizer.zero_grad(set_to_none=True)
                ref_loss, _ = alone.forward_backward(everything)
                want = {n: p.grad for n, p in alone.model.named_parameters()}
                errors = [(got[k] - want[k]).abs().max() / want[k].abs().max().clamp(min=1e-12) for k in got]
                worst = max(worst, *map(float, errors))
                losses.append(loss)
                ref_losses.append(ref_loss)
        results.put((rank, counts, empty, builds, worst, losses, ref_losses))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def resumes_from_own_checkpoint(rank: int, world: int, init_file: str, results, parallelism: dict,
                                schedule: str, training: dict, redis_url: str, root: str, job: str) -> None:
    """4 steps straight; then 3 steps with a checkpoint at step 2 written through the two-stage
    path (each stage's replica-group rank 0 writes its stage's pieces), a fresh trainer
    restores it and trains to 4: this rank's weights must equal the straight run's, bit for
    bit. Reports (rank, restored step, bitwise, names held, loss of the last step, the empty
    micro-batches the three trainers computed)."""
    try:
        dist = _join(rank, world, init_file)
        import redis
        import torch

        from longrun.checkpoint import Checkpointer, RedisCommitLedger
        from longrun.commgroup import form_groups, single_node_layout
        from longrun.worker.setup import replicas_of

        cfg = pipeline_config(parallelism, world, schedule=schedule, **training, sections={
            "job": {"name": job}, "checkpoint": {"dir": root, "interval_steps": 2, "keep_last": 3}})
        groups = form_groups(single_node_layout(cfg.dims), rank)
        replicas = replicas_of(groups)
        client = redis.Redis.from_url(redis_url)

        def checkpointer(attempt):
            return Checkpointer(cfg, rank=rank, world_size=world, dp_rank=replicas.rank,
                                dp_size=replicas.size, ledger=RedisCommitLedger(client, job, attempt))

        def weights(trainer):
            return {k: _full(v).detach().clone() for k, v in trainer.model.state_dict().items()}

        empty = []
        with pipelined_trainer(cfg, groups) as straight:
            last = straight.train()
            want = weights(straight)
            empty.append(getattr(straight.pipeline, "empty_micro_batches_total", None))
        with pipelined_trainer(cfg, groups) as first:
            ckpt = checkpointer(0)
            first.before_update.append(ckpt.before_update)
            first.train(steps=3, on_step=ckpt.on_step(first))
            ckpt.close()
            empty.append(getattr(first.pipeline, "empty_micro_batches_total", None))
        dist.barrier()  # attempt 0 is over everywhere: step 2 is committed
        with pipelined_trainer(cfg, groups) as second:
            ckpt = checkpointer(1)
            restored = ckpt.restore(second, world_group=dist.group.WORLD, dp_group=replicas.group)
            second.before_update.append(ckpt.before_update)
            second.train(on_step=ckpt.on_step(second))
            got = weights(second)
            ckpt.close()
            empty.append(getattr(second.pipeline, "empty_micro_batches_total", None))
        bitwise = set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
        results.put((rank, restored.step, bitwise, sorted(want), last.loss, empty))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def _checkpointer(cfg, rank: int, world: int, replicas, redis_url: str, job: str, attempt: int):
    import redis

    from longrun.checkpoint import Checkpointer, RedisCommitLedger

    return Checkpointer(cfg, rank=rank, world_size=world, dp_rank=replicas.rank, dp_size=replicas.size,
                        ledger=RedisCommitLedger(redis.Redis.from_url(redis_url), job, attempt))


def save_at_layout(rank: int, world: int, init_file: str, results, parallelism: dict, schedule: str,
                   training: dict, redis_url: str, root: str, job: str) -> None:
    """Train 3 steps at a pipeline layout with a checkpoint at step 3; every rank keeps the
    whole state it holds (its stages' tensors, gathered) in `root`/../saved-<rank>.pt, for the
    restoring world to compare with."""
    try:
        dist = _join(rank, world, init_file)
        import torch
        from sharded_workers import _full_state

        from longrun.commgroup import form_groups, single_node_layout
        from longrun.worker.setup import replicas_of

        cfg = pipeline_config(parallelism, world, schedule=schedule, **training, sections={
            "job": {"name": job}, "checkpoint": {"dir": root, "interval_steps": 3}})
        cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"steps": 3})})
        groups = form_groups(single_node_layout(cfg.dims), rank)
        replicas = replicas_of(groups)
        with pipelined_trainer(cfg, groups) as trainer:
            ckpt = _checkpointer(cfg, rank, world, replicas, redis_url, job, 0)
            trainer.before_update.append(ckpt.before_update)
            trainer.train(on_step=ckpt.on_step(trainer))
            ckpt.close()
            torch.save(_full_state(trainer), f"{root}/../saved-{rank}.pt")
        results.put((rank, "saved"))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def restore_at_layout(rank: int, world: int, init_file: str, results, parallelism: dict, schedule: str,
                      training: dict, redis_url: str, root: str, job: str, saved_ranks: int) -> None:
    """A fresh trainer at another layout (another pp degree, or none) restores the newest
    checkpoint under `root`; reports whether every tensor it holds, gathered, equals the saving
    world's, bit for bit, with the same step, data position and schedule."""
    try:
        dist = _join(rank, world, init_file)
        import torch
        from sharded_workers import _full_state

        from longrun.commgroup import form_groups, single_node_layout
        from longrun.worker.setup import replicas_of

        cfg = pipeline_config(parallelism, world, schedule=schedule, **training,
                              sections={"checkpoint": {"dir": root}})
        groups = form_groups(single_node_layout(cfg.dims), rank)
        replicas = replicas_of(groups)
        saved: dict = {}
        for r in range(saved_ranks):
            state = torch.load(f"{root}/../saved-{r}.pt", weights_only=True)
            saved.setdefault("tensors", {}).update(state["tensors"])
            saved.update({k: state[k] for k in ("step", "data", "scheduler")})
        with pipelined_trainer(cfg, groups) as trainer:
            ckpt = _checkpointer(cfg, rank, world, replicas, redis_url, job, 1)
            restored = ckpt.restore(trainer, world_group=dist.group.WORLD, dp_group=replicas.group)
            got = _full_state(trainer)
            ckpt.writer.close()
        same = (all(torch.equal(t, saved["tensors"][k]) for k, t in got["tensors"].items())
                and (got["step"], got["data"], got["scheduler"]) == (saved["step"], saved["data"],
                                                                      saved["scheduler"]))
        results.put((rank, restored.step, same, sorted(got["tensors"])))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
