"""Worker processes for the start-up tests (imported by spawned children): a world formed the
way a training rank forms it, and a whole training rank run outside Ray."""

from __future__ import annotations


def group_timeouts(rank, world, init_file, results, url, config):
    """Join the groups as a worker does (`join_groups`), report each group's timeout in seconds."""
    import torch
    import torch.distributed as dist

    from longrun.config import JobConfig
    from longrun.worker.setup import join_groups

    cfg = JobConfig.model_validate(config)
    groups = join_groups(cfg, rank=rank, attempt=0, redis_url=url, node_ids=["n0"],
                         device=torch.device("cpu"))
    every = {"world": groups.world, **groups.named}
    seen = {name: pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for name, pg in every.items()}
    results.put((rank, "ok", seen))
    dist.barrier(group=groups.world)  # nobody tears down while a peer still looks
    groups.teardown()


def train_rank(rank, world, init_file, results, url, config):
    """One rank of a job, as its Ray actor would run it: assume the rank, then run() to the end."""
    from longrun.worker.actor import TrainWorker

    worker = TrainWorker()
    worker.assume(config, rank, 0, url, node_ids=["local"])
    summary = worker.run()
    results.put((rank, "done", summary["step"]))
