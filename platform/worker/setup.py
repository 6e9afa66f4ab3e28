"""What a worker builds before its first step: the device, the communication groups, the
trainer with its parallelisms, and the group its checkpoints treat as replicas.

    device = worker_device(cfg)
    groups = join_groups(cfg, rank=r, attempt=a, redis_url=url, node_ids=ids, device=device)
    trainer, replicas = build_trainer(cfg, groups, device)

Groups come from commgroup's Redis rendezvous, in the node order the controller placed the
ranks in, with the backend the device needs (NCCL on CUDA, gloo on CPU). The trainer never
creates a process group of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import fsspec
import torch
import torch.distributed as dist

from longrun.checkpoint.layout import committed_steps
from longrun.commgroup import NodeSpec, ParallelGroups, init_parallel_groups, make_layout
from longrun.config import JobConfig
from longrun.trainer import Trainer
from longrun.trainer.flops import peak_flops
from longrun.trainer.trainer import resolve_device


@dataclass(frozen=True)
class Replicas:
    """The ranks holding the same piece of the weights (`shard` of `shards`: the FSDP x TP
    shards; 0 of 1 where every rank holds whole weights): what a checkpoint writes once
    (`rank` 0 of them writes the piece) and reads once (and broadcasts to the others)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None
    shard: int = 0
    shards: int = 1


def backend_for(device: torch.device) -> str:
    """The collective backend a device needs: NCCL for CUDA tensors, gloo for CPU ones."""
    return "nccl" if device.type == "cuda" else "gloo"


def worker_device(cfg: JobConfig) -> torch.device:
    """This worker's device: on CUDA the one Ray assigned to the actor (its only visible GPU)."""
    device = resolve_device(cfg.cluster.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def join_groups(cfg: JobConfig, *, rank: int, attempt: int, redis_url: str, node_ids: list[str],
                device: torch.device) -> ParallelGroups:
    """Every communication group of this attempt, through the Redis rendezvous: those the
    job's parallel dims need, CP's Ulysses/USP sub-groups included."""
    # The layout orders nodes by name; prefixing the placement index keeps rank r on the node
    # the controller placed it on (node_ids[r // workers_per_node]).
    nodes = [NodeSpec(f"{i:05d}-{n}") for i, n in enumerate(node_ids)]
    layout = make_layout(nodes, cfg.cluster.workers_per_node, cfg.dims)
    if backend_for(device) == "gloo":
        pin_gloo_to_node_address()
    return init_parallel_groups(redis_url, job=cfg.job.name, attempt=attempt, rank=rank,
                                layout=layout, backend=backend_for(device),
                                device=device if device.type == "cuda" else None)


def pin_gloo_to_node_address() -> str | None:
    """Make gloo listen on, and advertise, the address Ray knows this node by. Without
    GLOO_SOCKET_IFNAME gloo takes the address the host name resolves to, which on many hosts
    (containers, /etc/hosts with 127.0.1.1) is loopback: the peers on other hosts are then told
    to connect to 127.0.0.1 and the world never forms. An operator's own GLOO_SOCKET_IFNAME is
    kept. Returns the interface now in force (None: left to gloo, outside Ray)."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return os.environ["GLOO_SOCKET_IFNAME"]
    import ray

    if not ray.is_initialized():
        return None
    interface = interface_of(ray.util.get_node_ip_address())
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    return interface


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` (None: none here does)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%", 1)[0] == address for a in addresses):
            return name
    return None


def build_trainer(cfg: JobConfig, groups: ParallelGroups | None, device: torch.device, *,
                  resuming: bool = False) -> tuple[Trainer, Replicas]:
    """The trainer, and its replicas (the ranks holding the same piece of the weights).
    Gradients are summed over the span (dp x fsdp x cp ranks). Without context parallelism
    each span rank draws its own share of the global batch; with it, every rank of the span
    draws the same global batch and the plan splits it. Where the weights are sharded (fsdp
    or tp > 1) the trainer gets the device mesh built on the groups already formed (its pipeline
    stage's), and under pipeline parallelism its pipeline group (the ranks of its stages).
    `resuming`: a restore will replace the initial weights, so model.init_from is not read.
    Ranks print no step lines: the driver shows the job's (observability/progress.py)."""
    peak = peak_flops(device, cfg.cluster.peak_tflops)
    mesh = groups.device_mesh(device.type) if groups is not None and cfg.dims.sharded else None
    replicas = replicas_of(groups)
    if not cfg.dims.cp_enabled:
        dp_group = groups.dp_cp if groups else None
        pipeline = groups.pp if groups is not None and cfg.dims.pp > 1 else None
        trainer = Trainer(cfg, device, dp_group=dp_group, mesh=mesh, pipeline_group=pipeline,
                          peak_flops=peak, load_init_from=not resuming, progress=False)
        return trainer, replicas
    from longrun.trainer.cp.batches import one_rank_setup, setup_from_parallel_groups
    from longrun.trainer.cp.calibration import load_or_calibrate
    from longrun.trainer.cp.planner import CostModel

    # A stand-in until the calibration (measured once per model, device and span, then read
    # from the job's output directory) replaces it below.
    provisional = CostModel.for_model(cfg.model, linear_s_per_token=1e-6, attn_s_per_token2=1e-9,
                                      ring_block_s_per_token2=1e-9, p2p_latency_s=1e-4,
                                      p2p_s_per_byte=1e-9, micro_batch_overhead_s=1e-3)
    setup = (setup_from_parallel_groups(groups, cost=provisional) if groups is not None
             else one_rank_setup(provisional, cfg.dims))
    trainer = Trainer(cfg, device, context_parallel=setup, mesh=mesh, peak_flops=peak,
                      load_init_from=not resuming, progress=False)
    load_or_calibrate(os.path.join(cfg.job.output_dir, cfg.job.name, "cp-calibration"), trainer)
    return trainer, replicas


def has_committed_checkpoint(cfg: JobConfig) -> bool:
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    return bool(committed_steps(fs, root.rstrip("/")))


def replicas_of(groups: ParallelGroups | None) -> Replicas:
    if groups is None:
        return Replicas(0, 1, None)
    group = groups.replicate
    return Replicas(dist.get_rank(group), dist.get_world_size(group), group,
                    shard=groups.shard_index, shards=groups.layout.dims.shards)
