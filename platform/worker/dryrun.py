"""One rank of a job's real layout, built on this machine's CPU: `longrun config dryrun`.

    report = dry_run(cfg, rank=None)      # None: the rank `config plan` calls the fullest
    report.as_json()                      # {"rank", "world", "param_bytes", "optimizer_bytes", ...}

The process joins a world of `cfg.world_size` ranks through torch's fake process-group backend
(every collective returns at once, with nothing in it), forms the layout's groups through
commgroup exactly as a worker would, builds the model through the trainer's own path (meta
device, pipeline cut, TP, FSDP, this rank's shards materialised and initialised) and the
optimizer's state (the zero-gradient step at lr 0 that `get_state_dict` takes), and measures
what it holds against what the planner (`config/memory.py`) predicts. It runs no step: a 70B
stage's forward on a CPU would take hours, and the numbers it checks are those of the state.

So a layout of 128 GPUs is checked on a laptop before anything is placed: that it builds at
all, that each rank holds its own state and never the whole model, how long its
initialisation takes, and that the planner is right.
"""

from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import asdict, dataclass

from longrun.config import JobConfig
from longrun.config.memory import MemoryPlan, plan_for, stage_plans
from longrun.parallel.dims import RankCoords, coords_of

MiB = 1 << 20


@dataclass(frozen=True)
class DryRunReport:
    rank: int
    world: int
    coords: dict[str, int]  # where the rank sits on each axis (dp, fsdp, pp, cp, tp)
    param_bytes: int  # this rank's pieces of the parameters (fp32)
    optimizer_bytes: int  # its AdamW state
    planned_bytes: float  # what `config plan` predicts for the same rank's parameters + optimizer
    planned_total_bytes: float  # the plan's total for the rank (gradients, activations too)
    peak_rss_bytes: int  # the process's peak resident memory while building
    baseline_rss_bytes: int  # before building (the interpreter, torch, the fake world)
    init_s: float  # materialising and initialising this rank's pieces
    build_s: float  # meta model, groups and every parallelism applied
    optimizer_s: float
    largest_block_bytes: int  # one transformer block, whole, fp32 (the transient allowance)

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.optimizer_bytes

    @property
    def planner_error(self) -> float:
        """(planned - measured) / measured for the parameters and optimizer state."""
        return (self.planned_bytes - self.state_bytes) / max(self.state_bytes, 1)

    def as_json(self) -> dict:
        return asdict(self) | {"state_bytes": self.state_bytes,
                               "planner_error": round(self.planner_error, 4)}


def rank_plan(cfg: JobConfig, rank: int) -> MemoryPlan:
    """The planner's estimate for `rank` (its pipeline stage's under pp)."""
    if cfg.dims.pp == 1:
        return plan_for(cfg)
    plans = stage_plans(cfg.model, cfg.dims, cfg.training, cfg.data, on_gpu=cfg.cluster.device != "cpu",
                        parallelism=cfg.parallelism)
    return plans[coords_of(cfg.dims, rank).pp]


def fullest_rank(cfg: JobConfig) -> int:
    """The first rank of the pipeline stage `config plan` calls the fullest (rank 0 without pp)."""
    pp = plan_for(cfg).pp_rank or 0
    dims = cfg.dims
    from longrun.commgroup.topology import single_node_layout

    return single_node_layout(dims).rank_of(RankCoords(dp=0, pp=pp, cp=0, tp=0, fsdp=0))


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def dry_run(cfg: JobConfig, rank: int | None = None, *, optimizer: bool = True) -> DryRunReport:
    """Build `rank` (default: the fullest) of `cfg`'s layout in this process and measure it
    (`optimizer`: its AdamW state too). Uses the process's default process group: run it in a
    process of its own."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from longrun.commgroup import NodeSpec, form_groups, make_layout
    from longrun.config.memory import parameter_counts
    from longrun.trainer.build import build_model
    from longrun.trainer.optim import build_optimizer
    from longrun.trainer.weights_init import init_pieces

    world = cfg.world_size
    rank = fullest_rank(cfg) if rank is None else rank
    if not 0 <= rank < world:
        raise ValueError(f"--rank {rank} is outside the job's world of {world} ranks")
    if dist.is_initialized():
        raise RuntimeError("dry_run needs a process without a default process group")
    device = torch.device("cpu")
    baseline = _current_rss()
    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        nodes = [NodeSpec(f"{i:05d}-node") for i in range(cfg.cluster.nodes)]
        groups = form_groups(make_layout(nodes, cfg.cluster.workers_per_node, cfg.dims), rank)
        mesh = groups.device_mesh("cpu") if cfg.dims.sharded else None
        span = groups.dp_cp if cfg.dims.span > 1 else None
        pipeline = groups.pp if cfg.dims.pp > 1 else None
        # Weights are seeded even where the job names model.init_from: the dry run needs no files.
        parallel, _ = build_model(cfg, device, span_group=span, mesh=mesh, pipeline_group=pipeline,
                                  prime=_priming_loss)
        built = time.perf_counter()
        from longrun.parallel.pieces import local_pieces

        init_pieces(local_pieces(parallel.module), cfg.model, cfg.job.seed)
        initialised = time.perf_counter()
        adamw = build_optimizer(parallel.module, cfg.training, device)
        if optimizer:
            _init_optim_state(adamw)  # what a checkpoint's get_state_dict does to a fresh one
        held = parallel.state_bytes(adamw)
        done = time.perf_counter()
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    plan = rank_plan(cfg, rank)
    _, block, _ = parameter_counts(cfg.model)
    coords = coords_of(cfg.dims, rank)
    return DryRunReport(
        rank=rank, world=world, coords=asdict(coords),
        param_bytes=held["parameters"], optimizer_bytes=held["optimizer"],
        planned_bytes=plan.parameters + (plan.optimizer if optimizer else 0.0),
        planned_total_bytes=plan.total_bytes,
        peak_rss_bytes=_peak_rss(), baseline_rss_bytes=baseline,
        build_s=built - start, init_s=initialised - built, optimizer_s=done - initialised,
        largest_block_bytes=block * 4)


def _priming_loss(module):
    """DDP's one tiny backward (only layouts that replicate whole weights use it)."""
    import numpy as np

    from longrun.data.packing import build_micro_batch

    mb = build_micro_batch([np.array([1, 2])])
    return module(mb.tokens, mb.positions, mb.cu_seqlens).float().sum()
