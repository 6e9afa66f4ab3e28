"""Worker processes for the initial-weights tests (imported by spawned children).

Each joins a gloo world, forms the layout's groups through commgroup and builds the trainer
through its real path (meta device, parallelize, this rank's pieces initialised); it reports
digests of the full tensors, so the assertions stay in the tests."""

from __future__ import annotations

import hashlib
import traceback

from pipeline_workers import pipeline_config, pipelined_trainer
from sharded_workers import _full
from trainer_workers import _join


def digest(tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()


def initial_weights(rank: int, world: int, init_file: str, results, parallelism: dict,
                    schedule: str, grad_accum: int) -> None:
    """Every weight this rank holds a piece of, gathered whole: name -> digest."""
    try:
        dist = _join(rank, world, init_file)
        from longrun.commgroup import form_groups, single_node_layout

        cfg = pipeline_config(parallelism, world, schedule=schedule, grad_accum=grad_accum)
        groups = form_groups(single_node_layout(cfg.dims), rank)
        with pipelined_trainer(cfg, groups) as trainer:
            # Every rank of a stage gathers the same names in the same order (collectives).
            weights = {n: digest(_full(p)) for n, p in trainer.model.named_parameters()}
            local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                        for p in trainer.model.parameters())
        results.put((rank, weights, local))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


def init_from_slices(rank: int, world: int, init_file: str, results, parallelism: dict,
                     hf_dir: str) -> None:
    """A trainer starting from an HF directory at `parallelism`: the bytes this rank read, the
    bytes of its pieces, and the digests of its full weights."""
    try:
        dist = _join(rank, world, init_file)
        from longrun.commgroup import form_groups, single_node_layout
        from longrun.config import config_from_dict
        from longrun.interop import hf_import
        from longrun.interop.hf import model_section_from_hf

        read = []
        original = hf_import.read_slice

        def counting(f, name, index):
            block = original(f, name, index)
            read.append(block.numel() * block.element_size())
            return block

        hf_import.read_slice = counting
        cfg = config_from_dict({
            "job": {"name": "hf", "seed": 3}, "cluster": {"device": "cpu", "workers_per_node": world},
            "parallelism": parallelism, "model": model_section_from_hf(hf_dir),
            "data": {"source": "synthetic", "micro_batch_tokens": 256, "prefetch": 1},
            "training": {"steps": 1, "warmup_steps": 0}})
        groups = form_groups(single_node_layout(cfg.dims), rank)
        with pipelined_trainer(cfg, groups) as trainer:
            held = sum(p.to_local().numel() * 4 for p in trainer.model.parameters())
            weights = {n: digest(_full(p)) for n, p in trainer.model.named_parameters()}
        results.put((rank, sum(read), held, weights))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
