"""The model one rank trains: built on the meta device, spread by `parallelize`, and only this
rank's pieces given memory; their values come from `initialise` (or from a restore, which
never pays for an initialisation it would overwrite).

    parallel, flops = build_model(cfg, device, span_group=g, mesh=mesh, pipeline_group=pp)
    initialise(parallel.module, cfg)      # a fresh job: seeded values, or model.init_from's slices

The whole model never exists on any rank: at 70B, fp32, that would be 282 GB per rank (2.3 TB
per 8-GPU node) and minutes of random numbers before a single shard is cut.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from longrun.config import JobConfig
from longrun.parallel.parallel_model import ParallelModel
from longrun.parallel.parallelize import parallelize
from longrun.parallel.pieces import local_pieces
from longrun.parallel.pipeline import PipelinePlan
from longrun.trainer.model import FlopsModel, Transformer
from longrun.trainer.weights_init import init_pieces

log = logging.getLogger(__name__)


def build_model(cfg: JobConfig, device: torch.device, *, span_group: dist.ProcessGroup | None,
                mesh: DeviceMesh | None = None, pipeline_group: dist.ProcessGroup | None = None,
                prime: Callable[[torch.nn.Module], torch.Tensor] | None = None,
                ) -> tuple[ParallelModel, FlopsModel]:
    """This rank's part of the job's model under every parallelism of its layout, on `device`,
    its values not yet set; and the whole model's FLOPs (MFU counts the whole model's work
    whatever this rank keeps). See `parallelize` for the arguments."""
    if (cfg.dims.pp > 1) != (pipeline_group is not None):
        raise ValueError(f"parallelism.pp = {cfg.dims.pp}: pass the pipeline group exactly when pp > 1")
    with torch.device("meta"):
        model = Transformer(cfg.model)
    flops = FlopsModel.of(model)
    pipeline = None
    if pipeline_group is not None:
        pipeline = PipelinePlan(pipeline_group, dist.get_rank(pipeline_group),
                                schedule=cfg.training.pp_schedule,
                                virtual_stages=cfg.parallelism.pp_virtual_stages,
                                layers_per_stage=cfg.parallelism.pp_layers,
                                micro_batch_tokens=cfg.data.micro_batch_tokens, device=device)
    parallel = parallelize(model, cfg.dims, cfg.training, span_group=span_group, mesh=mesh,
                           device=device, prime=prime, pipeline=pipeline,
                           reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward)
    return parallel, flops


def initialise(module: torch.nn.Module, cfg: JobConfig) -> float:
    """Fill this rank's pieces of `module` with the job's initial weights: `model.init_from`'s
    (only the slices this rank holds are read) or the seeded ones (`weights_init.py`), the same
    at every layout. Returns the seconds it took."""
    start = time.perf_counter()
    pieces = local_pieces(module)
    if cfg.model.init_from:
        from longrun.interop.hf_import import load_hf_pieces

        read = load_hf_pieces(cfg.model.init_from, cfg.model, pieces)
        log.info("model.init_from: read %.2f GB of %s (this rank's slices)", read / 1e9, cfg.model.init_from)
    else:
        init_pieces(pieces, cfg.model, cfg.job.seed)
    return time.perf_counter() - start
