"""What a worker builds before its first step: the device, the communication groups, the
trainer with its parallelisms, and the group its checkpoints treat as replicas.

    device = worker_device(cfg, rank=r)
    groups = join_groups(cfg, rank=r, attempt=a, redis_url=url, node_ids=ids, device=device)
    trainer, replicas = build_trainer(cfg, groups, device)

Groups come from commgroup's Redis rendezvous, in the node order the controller placed the
ranks in, with the backend the device needs (NCCL on CUDA, gloo on CPU). The trainer never
creates a process group of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import fsspec
import torch
import torch.distributed as dist

from longrun.checkpoint.layout import committed_steps
from longrun.commgroup import NodeSpec, ParallelGroups, init_parallel_groups, make_layout
from longrun.commgroup.store import StoreLinks
from longrun.config import JobConfig
from longrun.kinds import FaultKind
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


def worker_device(cfg: JobConfig, rank: int = 0) -> torch.device:
    """This worker's device, made the current one. On CUDA every rank of a node sees every GPU
    of the node (Ray's per-actor CUDA_VISIBLE_DEVICES masking is off: controller/workers.py,
    which NCCL's NVLink paths need), so each picks its own: the GPU Ray assigned to the actor,
    or outside Ray its local rank (rank % workers_per_node)."""
    device = resolve_device(cfg.cluster.device)
    if device.type != "cuda":
        return device
    index = gpu_index(ray_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"),
                      rank % cfg.cluster.workers_per_node, torch.cuda.device_count())
    torch.cuda.set_device(index)  # what torch.cuda.current_device() elsewhere (checkpoints) sees
    return torch.device("cuda", index)


def ray_gpu_ids() -> list[str]:
    """The GPU ids Ray assigned to this actor (none outside Ray)."""
    try:
        import ray

        return [str(i) for i in ray.get_gpu_ids()] if ray.is_initialized() else []
    except Exception:  # not in a Ray worker: no assignment
        return []


def gpu_index(assigned: list[str], visible: str | None, local_rank: int, count: int) -> int:
    """torch's index of this rank's GPU among the `count` it sees. `assigned`: the ids Ray gave
    the actor (with Ray's masking off, the node's own ids: physical indices, or the entries of
    the node's CUDA_VISIBLE_DEVICES, `visible`, where the node sets one, e.g. a container given
    some of a host's GPUs; with masking on, the one entry of the actor's own mask); the first
    is this rank's, found in `visible` when set. Without an assignment, the local rank."""
    index = local_rank
    if assigned:
        ids = [v.strip() for v in (visible or "").split(",") if v.strip()]
        if assigned[0] in ids:
            index = ids.index(assigned[0])
        elif assigned[0].isdigit():
            index = int(assigned[0])
    if not 0 <= index < count:
        raise RuntimeError(f"this rank's GPU is index {index} (Ray's GPU ids {assigned or 'none'}, "
                           f"CUDA_VISIBLE_DEVICES {visible!r}, local rank {local_rank}) but torch sees "
                           f"{count} GPU(s); check cluster.workers_per_node against the node's GPUs")
    return index


def join_groups(cfg: JobConfig, *, rank: int, attempt: int, redis_url: str, node_ids: list[str],
                device: torch.device, links: StoreLinks | None = None) -> ParallelGroups:
    """Every communication group of this attempt, through the Redis rendezvous: those the
    job's parallel dims need, CP's Ulysses/USP sub-groups included; each with the job's
    `health.collective_timeout_s`. `links`: the rank's Redis connections for the store to use
    (a rank keeps to two: services/redis_client.py `RankRedis`); None opens the store's own."""
    # The layout orders nodes by name; prefixing the placement index keeps rank r on the node
    # the controller placed it on (node_ids[r // workers_per_node]).
    nodes = [NodeSpec(f"{i:05d}-{n}") for i, n in enumerate(node_ids)]
    layout = make_layout(nodes, cfg.cluster.workers_per_node, cfg.dims)
    if backend_for(device) == "gloo":
        pin_gloo_to_node_address()
    return init_parallel_groups(redis_url, job=cfg.job.name, attempt=attempt, rank=rank,
                                layout=layout, backend=backend_for(device),
                                timeout=timedelta(seconds=cfg.health.collective_timeout_s),
                                device=device if device.type == "cuda" else None, links=links)


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


def build_trainer(cfg: JobConfig, groups: ParallelGroups | None, device: torch.device
                  ) -> tuple[Trainer, Replicas]:
    """The trainer, its weights not yet set (`start_weights` sets them, after a restore had its
    chance), and its replicas (the ranks holding the same piece of the weights). Gradients are
    summed over the span (dp x fsdp x cp ranks). Without context parallelism each span rank
    draws its own share of the global batch; with it, every rank of the span draws the same
    global batch and the plan splits it. Where the weights are sharded (fsdp or tp > 1) the
    trainer gets the device mesh built on the groups already formed (its pipeline stage's), and
    under pipeline parallelism its pipeline group (the ranks of its stages). Ranks print no step
    lines: the driver shows the job's (observability/progress.py)."""
    peak = peak_flops(device, cfg.cluster.peak_tflops)
    mesh = groups.device_mesh(device.type) if groups is not None and cfg.dims.sharded else None
    replicas = replicas_of(groups)
    if not cfg.dims.cp_enabled:
        dp_group = groups.dp_cp if groups else None
        pipeline = groups.pp if groups is not None and cfg.dims.pp > 1 else None
        trainer = Trainer(cfg, device, dp_group=dp_group, mesh=mesh, pipeline_group=pipeline,
                          peak_flops=peak, init_weights=False, progress=False)
        return trainer, replicas
    from longrun.trainer.cp.batches import one_rank_setup, setup_from_parallel_groups
    from longrun.trainer.cp.planner import CostModel

    # A stand-in until the calibration (measured once per model, device and span, then read
    # from the job's output directory: `calibrate_context_parallel`) replaces it.
    provisional = CostModel.for_model(cfg.model, linear_s_per_token=1e-6, attn_s_per_token2=1e-9,
                                      ring_block_s_per_token2=1e-9, p2p_latency_s=1e-4,
                                      p2p_s_per_byte=1e-9, micro_batch_overhead_s=1e-3)
    setup = (setup_from_parallel_groups(groups, cost=provisional) if groups is not None
             else one_rank_setup(provisional, cfg.dims))
    trainer = Trainer(cfg, device, context_parallel=setup, mesh=mesh, peak_flops=peak,
                      init_weights=False, progress=False)
    return trainer, replicas


def start_weights(trainer: Trainer, restored_step: int, *, checkpoints_expected: bool) -> None:
    """After the restore: a trainer that restored nothing gets the job's initial weights now, so
    a restore never pays for an initialisation it would overwrite. `checkpoints_expected`:
    committed checkpoints existed; if none could be restored and the job starts from
    model.init_from, going on from the HF weights would silently drop the trained steps."""
    if restored_step:
        return
    if checkpoints_expected and trainer.cfg.model.init_from:
        raise InitFromSkipped(trainer.cfg.model.init_from)
    trainer.init_weights()


def calibrate_context_parallel(cfg: JobConfig, trainer: Trainer) -> None:
    """Under dynamic context parallelism, the planner's cost model: measured on this machine
    once per model, device and span (a few seconds of passes through the model, so after its
    weights are set) and read from the job's output directory after that."""
    if not cfg.dims.cp_enabled:
        return
    from longrun.trainer.cp.calibration import load_or_calibrate

    load_or_calibrate(os.path.join(cfg.job.output_dir, cfg.job.name, "cp-calibration"), trainer)


class InitFromSkipped(RuntimeError):
    """Committed checkpoints exist, so the job meant to resume, and none could be restored:
    starting from model.init_from's weights would be silently wrong."""

    fault_kind = FaultKind.FATAL

    def __init__(self, path: str):
        super().__init__(
            f"committed checkpoints exist, but none of them could be restored (see the restore "
            f"warnings above), so the job will not start again from model.init_from ({path}); "
            "repair or remove them to start again from model.init_from")


def has_committed_checkpoint(cfg: JobConfig) -> bool:
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    return bool(committed_steps(fs, root.rstrip("/")))


def replicas_of(groups: ParallelGroups | None) -> Replicas:
    if groups is None:
        return Replicas(0, 1, None)
    group = groups.replicate
    return Replicas(dist.get_rank(group), dist.get_world_size(group), group,
                    shard=groups.shard_index, shards=groups.layout.dims.shards)
