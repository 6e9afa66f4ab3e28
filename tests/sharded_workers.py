"""Worker processes for the sharded-training tests (imported by spawned children).

Each joins a gloo world, forms the layout's groups through commgroup (the device mesh is built
on them), and reports plain numbers; the assertions stay in the tests."""

from __future__ import annotations

import traceback

import numpy as np
from trainer_workers import _join, fixed_micro_batches

STEP_LENGTHS = [120, 77, 5, 1, 17, 64, 33, 90, 2, 41]  # a planned (CP) global batch
TEST_COST = dict(linear_s_per_token=2e-6, attn_s_per_token2=2e-9, ring_block_s_per_token2=3e-9,
                 p2p_latency_s=2e-4, p2p_s_per_byte=1e-9, micro_batch_overhead_s=1e-3)


def layout_config(parallelism: dict, world: int, **sections):
    """A tiny job at `parallelism` on one node of `world` workers (parallelism {} and world 1:
    the single-process reference). Shapes every TP degree up to 4 divides."""
    from longrun.config import config_from_dict

    cp = parallelism.get("cp", 1)
    dynamic = parallelism.get("dynamic_cp", False)
    raw = {
        "job": {"name": "sharded", "seed": 11},
        "cluster": {"device": "cpu", "workers_per_node": world},
        "parallelism": parallelism,
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 128,
                  "vocab_size": 260, "max_seq_len": 128},
        "data": {"source": "synthetic", "micro_batch_tokens": 128 if (cp > 1 or dynamic) else 256,
                 "prefetch": 1, "synthetic": {"min_len": 8, "max_len": 128, "mean": 40, "sigma": 0.8}},
        "training": {"steps": 4, "lr": 3e-3, "warmup_steps": 1, "grad_accum": 2},
    }
    for name, values in sections.items():
        raw[name] = raw.get(name, {}) | values
    return config_from_dict(raw)


def _full(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_weights(trainer) -> dict:
    """Every weight as a full (gathered) tensor, cloned."""
    return {k: _full(v).detach().clone() for k, v in trainer.model.state_dict().items()}


def _trainer(cfg, groups):
    """A trainer at `cfg`'s layout over `groups` (device mesh where sharded, CP setup where CP)."""
    from longrun.trainer import Trainer
    from longrun.trainer.cp.batches import setup_from_parallel_groups
    from longrun.trainer.cp.planner import CostModel

    mesh = groups.device_mesh("cpu") if cfg.dims.sharded else None
    if cfg.dims.cp_enabled:
        setup = setup_from_parallel_groups(groups, cost=CostModel.for_model(cfg.model, **TEST_COST))
        return Trainer(cfg, "cpu", context_parallel=setup, mesh=mesh, progress=False)
    return Trainer(cfg, "cpu", dp_group=groups.dp_cp, mesh=mesh, progress=False)


def _one_step(trainer, cfg):
    """This rank's part of a fixed global batch through `trainer`, and the same batch in one
    process: (loss, reference loss, worst relative gradient error over all parameters)."""
    from longrun.data.packing import build_micro_batch
    from longrun.trainer import Trainer
    from longrun.trainer.cp.batches import plan_step

    reference_cfg = layout_config({}, 1, training=cfg.training.model_dump())
    if cfg.dims.cp_enabled:
        rng = np.random.default_rng(3)
        docs = [rng.integers(0, 256, size=n) for n in STEP_LENGTHS]
        loss, _ = trainer.forward_backward_planned(plan_step(docs, trainer.cp, cfg.data.micro_batch_tokens))
        everything = [build_micro_batch(docs)]
    else:
        accum, span = cfg.training.grad_accum, trainer.parallel.size
        everything = fixed_micro_batches(span * accum)
        mine = everything[trainer.parallel.rank * accum:(trainer.parallel.rank + 1) * accum]
        loss, _ = trainer.forward_backward(mine)
    got = {n: _full(p.grad).detach().clone() for n, p in trainer.model.named_parameters()}
    with Trainer(reference_cfg, "cpu", progress=False) as alone:
        ref_loss, _ = alone.forward_backward(everything)
        want = {n: p.grad.detach().clone() for n, p in alone.model.named_parameters()}
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    worst = max(float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp(min=1e-12)) for k in want)
    return loss, ref_loss, worst


def gradients_match_one_process(rank: int, world: int, init_file: str, results, parallelism: dict,
                                ac: str) -> None:
    """One step of a fixed global batch at `parallelism` (activation checkpointing `ac`) gives
    the loss and every parameter's full gradient of one process on the whole batch; each rank
    holds only its piece of each parameter."""
    try:
        dist = _join(rank, world, init_file)
        from longrun.commgroup import form_groups, single_node_layout

        cfg = layout_config(parallelism, world, training={"activation_checkpointing": ac})
        groups = form_groups(single_node_layout(cfg.dims), rank)
        with _trainer(cfg, groups) as trainer:
            loss, ref_loss, worst = _one_step(trainer, cfg)
            held = trainer.state_bytes()  # this rank's pieces (gradients present after the step)
            whole = 4 * sum(p.numel() for p in trainer.model.parameters())  # fp32
        results.put((rank, loss, ref_loss, worst, held["parameters"] / whole, held["gradients"] / whole))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def resume_from_own_checkpoint(rank: int, world: int, init_file: str, results, parallelism: dict,
                               redis_url: str, root: str, job: str, corrupt: bool = False) -> None:
    """4 steps straight; then 3 steps with a checkpoint at step 2 written through the
    two-stage path (each replica group's rank 0 writes its piece), a fresh trainer restores it
    and trains to 4: the weights must equal the straight run's, bit for bit. `corrupt`:
    checkpoints at every step, and a byte of one piece of step 3 flipped before the restore,
    which must then fall back to step 2 on every rank."""
    try:
        dist = _join(rank, world, init_file)
        import redis
        import torch

        from longrun.checkpoint import Checkpointer, RedisCommitLedger
        from longrun.commgroup import form_groups, single_node_layout
        from longrun.worker.setup import replicas_of

        cfg = layout_config(parallelism, world, job={"name": job},
                            checkpoint={"dir": root, "interval_steps": 1 if corrupt else 2, "keep_last": 3})
        groups = form_groups(single_node_layout(cfg.dims), rank)
        replicas = replicas_of(groups)
        client = redis.Redis.from_url(redis_url)

        def checkpointer(attempt):
            return Checkpointer(cfg, rank=rank, world_size=world, dp_rank=replicas.rank,
                                dp_size=replicas.size, ledger=RedisCommitLedger(client, job, attempt))

        with _trainer(cfg, groups) as straight:
            straight.train()
            want = full_weights(straight)
        with _trainer(cfg, groups) as first:
            ckpt = checkpointer(0)
            first.before_update.append(ckpt.before_update)
            first.train(steps=3, on_step=ckpt.on_step(first))
            ckpt.close()
        dist.barrier()  # attempt 0 is over everywhere: step 2 (and with `corrupt` 3) is committed
        if corrupt and rank == 0:
            import glob

            from longrun.checkpoint.layout import step_dir_name

            # The last data file: the pieces of the last shard.
            path = sorted(glob.glob(f"{root}/{step_dir_name(3)}/*.distcp"))[-1]
            with open(path, "r+b") as f:
                f.seek(100)
                byte = f.read(1)
                f.seek(100)
                f.write(bytes([byte[0] ^ 0xFF]))
        dist.barrier()
        with _trainer(cfg, groups) as second:
            ckpt = checkpointer(1)
            restored = ckpt.restore(second, world_group=dist.group.WORLD, dp_group=replicas.group)
            second.before_update.append(ckpt.before_update)
            second.train(on_step=ckpt.on_step(second))
            got = full_weights(second)
            ckpt.close()
        bitwise = all(torch.equal(got[k], want[k]) for k in want)
        if rank == 0:  # the whole weights, for the test to compare an export of the pieces with
            torch.save(want, f"{root}/../straight.pt")
        results.put((rank, restored.step, bitwise, replicas.shard, replicas.rank))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def calibrated_then_loaded(rank: int, world: int, init_file: str, results, parallelism: dict, root: str):
    """A trainer that measures the dynamic-CP cost model (forward and backward passes that are
    no step's) and then trains, against one that loads what the first saved and trains: the
    same cost model and, bit for bit, the same weights (no gradient of a calibration pass may
    linger in a layout's own buffers)."""
    try:
        dist = _join(rank, world, init_file)
        import torch

        from longrun.commgroup import form_groups, single_node_layout
        from longrun.trainer.cp.calibration import load_or_calibrate

        cfg = layout_config(parallelism, world)
        groups = form_groups(single_node_layout(cfg.dims), rank)
        out = []
        for _ in range(2):
            with _trainer(cfg, groups) as t:
                cost = load_or_calibrate(root, t)
                t.train(steps=2)
                out.append(({k: _full(v).detach().clone() for k, v in t.model.state_dict().items()}, cost))
        same = all(torch.equal(out[0][0][k], out[1][0][k]) for k in out[0][0])
        results.put((rank, same, out[0][1] == out[1][1]))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def resume_from_memory_snapshot(rank: int, world: int, init_file: str, results, parallelism: dict) -> None:
    """Peer memory snapshots of sharded state: 4 steps straight; then 2 steps, a snapshot of
    step 2 (this rank's pieces) through a keeper, a fresh trainer restored from it, 2 more: the
    weights equal the straight run's, bit for bit."""
    try:
        dist = _join(rank, world, init_file)
        import torch

        from longrun.checkpoint.memory import MemorySnapshots, read_snapshot
        from longrun.checkpoint.sharding import globalize
        from longrun.commgroup import form_groups, single_node_layout
        from longrun.controller.keepers import SnapshotKeeper

        cfg = layout_config(parallelism, world)
        groups = form_groups(single_node_layout(cfg.dims), rank)
        keeper = SnapshotKeeper()

        with _trainer(cfg, groups) as straight:
            straight.train()
            want = full_weights(straight)
        with _trainer(cfg, groups) as first:
            snaps = MemorySnapshots(lambda step, blob, digest: keeper.put(rank, step, blob, digest), every=1)
            first.before_update.append(snaps.before_update)
            first.train(steps=2, on_step=lambda m: snaps.take(first) and snaps.wait())
            snaps.wait()
        with _trainer(cfg, groups) as second:
            state = read_snapshot(*keeper.get(rank, 2))
            second.load_state_dict(globalize(state, second.state_dict()))
            second.train()
            got = full_weights(second)
        results.put((rank, all(torch.equal(got[k], want[k]) for k in want)))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def _full_state(trainer) -> dict:
    """Every tensor of the model and optimizer state, whole (gathered), by its checkpoint name;
    plus the plain values a resume needs."""
    from longrun.checkpoint.dcp_format import fqn_of, tensor_leaves

    state = trainer.state_dict()
    tensors = {fqn_of(path): _full(t).detach().clone() for path, t in tensor_leaves(state)}
    return {"tensors": tensors, "step": state["step"], "data": state["data"],
            "scheduler": state["scheduler"]}


def save_at_layout(rank: int, world: int, init_file: str, results, parallelism: dict,
                   redis_url: str, root: str, job: str, interval: int = 3) -> None:
    """Train 3 steps at `parallelism`, checkpointing every `interval` steps and at step 3; rank 0
    keeps the whole state (gathered from the pieces) in `root`/../saved.pt for the restoring
    world to compare with."""
    try:
        dist = _join(rank, world, init_file)
        import redis
        import torch

        from longrun.checkpoint import Checkpointer, RedisCommitLedger
        from longrun.commgroup import form_groups, single_node_layout
        from longrun.worker.setup import replicas_of

        cfg = layout_config(parallelism, world, job={"name": job},
                            checkpoint={"dir": root, "interval_steps": interval}, training={"steps": 3})
        groups = form_groups(single_node_layout(cfg.dims), rank)
        replicas = replicas_of(groups)
        with _trainer(cfg, groups) as trainer:
            ckpt = Checkpointer(cfg, rank=rank, world_size=world, dp_rank=replicas.rank,
                                dp_size=replicas.size,
                                ledger=RedisCommitLedger(redis.Redis.from_url(redis_url), job, 0))
            trainer.before_update.append(ckpt.before_update)
            trainer.train(on_step=ckpt.on_step(trainer))
            ckpt.close()
            full = _full_state(trainer)
        if rank == 0:
            torch.save(full, f"{root}/../saved.pt")
        results.put((rank, "saved"))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def restore_at_layout(rank: int, world: int, init_file: str, results, parallelism: dict,
                      redis_url: str, root: str, job: str) -> None:
    """A fresh trainer at `parallelism` restores the newest checkpoint under `root`, whatever
    layout wrote it; reports whether its whole state equals the saved one, bit for bit, and
    the tensor bytes this rank read."""
    try:
        dist = _join(rank, world, init_file)
        import redis
        import torch

        from longrun.checkpoint import Checkpointer, RedisCommitLedger
        from longrun.commgroup import form_groups, single_node_layout
        from longrun.worker.setup import replicas_of

        cfg = layout_config(parallelism, world, checkpoint={"dir": root})
        groups = form_groups(single_node_layout(cfg.dims), rank)
        replicas = replicas_of(groups)
        saved = torch.load(f"{root}/../saved.pt", weights_only=True)
        with _trainer(cfg, groups) as trainer:
            # A later attempt of the saving job: the ranks vote in its ledger on each step.
            ckpt = Checkpointer(cfg, rank=rank, world_size=world, dp_rank=replicas.rank,
                                dp_size=replicas.size,
                                ledger=RedisCommitLedger(redis.Redis.from_url(redis_url), job, 1))
            restored = ckpt.restore(trainer, world_group=dist.group.WORLD, dp_group=replicas.group)
            got = _full_state(trainer)
            ckpt.writer.close()
        same = (got["tensors"].keys() == saved["tensors"].keys()
                and all(torch.equal(got["tensors"][k], saved["tensors"][k]) for k in saved["tensors"])
                and (got["step"], got["data"], got["scheduler"]) == (saved["step"], saved["data"],
                                                                      saved["scheduler"]))
        results.put((rank, restored.step, same, restored.bytes_read, replicas.rank,
                     restored.written_by is not None, [step for step, _ in restored.skipped]))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
