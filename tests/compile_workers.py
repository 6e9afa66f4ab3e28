"""Worker processes for the compile tests (imported by spawned children): a layout with compiled
blocks against one eager process, on the same fixed global batch. Plain numbers come back; the
assertions stay in the tests."""

from __future__ import annotations

import traceback

from trainer_workers import _join


def compiled_step_matches_one_process(rank: int, world: int, init_file: str, results,
                                      parallelism: dict, ac: str, mode: str) -> None:
    """One step at `parallelism` with activation checkpointing `ac` and training.compile `mode`:
    (rank, loss, eager one-process loss, worst relative gradient error, compiled at all)."""
    try:
        dist = _join(rank, world, init_file)
        from sharded_workers import _one_step, _trainer, layout_config

        from longrun.commgroup import form_groups, single_node_layout
        from longrun.parallel.compile import compile_counts

        cfg = layout_config(parallelism, world, training={"activation_checkpointing": ac,
                                                          "compile": mode})
        groups = form_groups(single_node_layout(cfg.dims), rank)
        with _trainer(cfg, groups) as trainer:
            loss, ref_loss, worst = _one_step(trainer, cfg)
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
