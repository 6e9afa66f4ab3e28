"""Worker processes for the compile and precision tests (imported by spawned children): a layout
with compiled blocks against one eager process, on the same fixed global batch. Plain numbers
come back; the assertions stay in the tests."""

from __future__ import annotations

import traceback

from trainer_workers import _join, fixed_micro_batches


def _full(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _against_eager(trainer, cfg):
    """This rank's part of a fixed global batch through `trainer` (compiled), and the whole batch
    in one eager process: (loss, eager loss, worst relative gradient error over all parameters)."""
    from sharded_workers import layout_config

    from longrun.trainer import Trainer

    accum, span = cfg.training.grad_accum, trainer.parallel.size
    everything = fixed_micro_batches(span * accum)
    mine = everything[trainer.parallel.rank * accum:(trainer.parallel.rank + 1) * accum]
    loss, _ = trainer.forward_backward(mine)
    got = {n: _full(p.grad).detach().clone() for n, p in trainer.model.named_parameters()}
    eager_training = cfg.training.model_dump() | {"compile": "none", "activation_checkpointing": "none"}
    with Trainer(layout_config({}, 1, training=eager_training), "cpu", progress=False) as alone:
        ref_loss, _ = alone.forward_backward(everything)
        want = {n: p.grad.detach().clone() for n, p in alone.model.named_parameters()}
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    worst = max(float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp(min=1e-12)) for k in want)
    return loss, ref_loss, worst


def compiled_step_matches_one_process(rank: int, world: int, init_file: str, results,
                                      parallelism: dict, ac: str, mode: str) -> None:
    """One step at `parallelism` with activation checkpointing `ac` and training.compile `mode`:
    (rank, loss, eager one-process loss, worst relative gradient error, compiled at all)."""
    try:
        dist = _join(rank, world, init_file)
        from sharded_workers import _trainer, layout_config

        from longrun.commgroup import form_groups, single_node_layout
        from longrun.parallel.compile import compile_counts

        cfg = layout_config(parallelism, world, training={"activation_checkpointing": ac,
                                                          "compile": mode})
        groups = form_groups(single_node_layout(cfg.dims), rank)
        with _trainer(cfg, groups) as trainer:
            loss, ref_loss, worst = _against_eager(trainer, cfg)
        results.put((rank, loss, ref_loss, worst, compile_counts().compilations > 0))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def compiled_pipeline_matches_eager(rank: int, world: int, init_file: str, results) -> None:
    """Two steps through a 2-stage 1F1B pipeline with compiled blocks, and the same two steps
    eager: (rank, compiled losses, eager losses, compiled at all)."""
    try:
        dist = _join(rank, world, init_file)
        from pipeline_workers import pipeline_config, pipelined_trainer

        from longrun.commgroup import form_groups, single_node_layout
        from longrun.parallel.compile import compile_counts

        losses = {}
        for mode in ("blocks", "none"):
            cfg = pipeline_config({"pp": 2}, world, n_layers=4, compile=mode, steps=2)
            groups = form_groups(single_node_layout(cfg.dims), rank)
            with pipelined_trainer(cfg, groups) as trainer:
                losses[mode] = [trainer.train_step().loss for _ in range(2)]
        results.put((rank, losses["blocks"], losses["none"], compile_counts().compilations > 0))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def bf16_parameters(rank: int, world: int, init_file: str, results, parallelism: dict) -> None:
    """Training at `parallelism` with CUDA's decision forced on the CPU (bf16 parameters where
    FSDP2 shards): (rank, layout, [losses], [the CPU's autocast losses], master weights' dtypes,
    gradients' dtypes, compute dtype seen by a matmul, autocast used)."""
    try:
        dist = _join(rank, world, init_file)
        import torch
        from sharded_workers import _trainer, layout_config

        from longrun.commgroup import form_groups, single_node_layout
        from longrun.parallel import parallelize as parallelize_module
        from longrun.parallel import precision

        cfg = layout_config(parallelism, world, training={"dtype": "bfloat16", "steps": 3})
        groups = form_groups(single_node_layout(cfg.dims), rank)
        with _trainer(cfg, groups) as plain:  # the CPU's own bf16: autocast
            autocast_losses = [plain.train_step().loss for _ in range(3)]
        def forced(device, dtype):  # what casts_parameters says on CUDA
            return dtype == "bfloat16"

        precision.casts_parameters = parallelize_module.casts_parameters = forced
        seen, autocast = [], []

        def watch(module, args, out):
            seen.append(out.dtype)
            autocast.append(torch.is_autocast_enabled("cpu"))

        with _trainer(cfg, groups) as trainer:
            module = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Linear))
            module.register_forward_hook(watch)
            losses = [trainer.train_step().loss for _ in range(3)]
            masters = sorted({str(p.dtype) for p in trainer.model.parameters()})
            grads = sorted({str(p.grad.dtype) for p in trainer.model.parameters() if p.grad is not None})
            layout = (type(trainer.parallel).__name__, trainer.parallel.casts_parameters)
        results.put((rank, layout, losses, autocast_losses, masters, grads, sorted({str(d) for d in seen}),
                     any(autocast)))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
