"""Worker processes for the multi-process commgroup tests (imported by spawned children)."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

from longrun.commgroup import NodeSpec, ParallelDims, make_layout

JOB = "cgtest"


def world4_layout():
    # 2 nodes x 2 workers; dp 2 x cp 2: every kind of group has real members, and the
    # dynamic-CP groups come in sizes 1, 2 and 4.
    return make_layout([NodeSpec("node-a"), NodeSpec("node-b")], 2, ParallelDims(dp=2, cp=2))


def form_and_check(rank, world, init_file, results, url, attempt, timeout_s):
    """Form the world, check every group, report (rank, outcome, detail)."""
    try:
        import torch.distributed as dist

        from longrun.commgroup import check_groups, init_parallel_groups

        groups = init_parallel_groups(url, job=JOB, attempt=attempt, rank=rank, layout=world4_layout(),
                                      timeout=timedelta(seconds=timeout_s))
        seconds = check_groups(groups)
        results.put((rank, "ok", sorted(seconds)))
        dist.barrier()  # nobody tears down while a peer still checks
        groups.teardown()
    except Exception as exc:
        results.put((rank, type(exc).__name__, str(exc), getattr(exc, "missing_ranks", None)))


def train_until_failure_then_reform(rank, world, init_file, results, url):
    """Attempt 0: all-reduce in a loop until a peer dies; then re-form as attempt 1 in this
    same process (no re-spawn, no re-import) and check every group again."""
    import torch
    import torch.distributed as dist

    from longrun.commgroup import check_groups, init_parallel_groups

    try:
        layout = world4_layout()
        # A survivor whose ring neighbour lives learns of the death only by its collective's
        # timeout: short, so the test does not wait out a long one.
        groups = init_parallel_groups(url, job=JOB, attempt=0, rank=rank, layout=layout,
                                      timeout=timedelta(seconds=8))
        failure = None
        steps = 0
        while failure is None:
            x = torch.ones(4)
            try:
                dist.all_reduce(x, group=groups.world)
                steps += 1
                if steps == 1:  # ready to be killed only once training is under way
                    results.put((rank, "training", os.getpid(), 0))
            except Exception as exc:  # a dead peer surfaces as a gloo error
                failure = exc
        groups.teardown()
        groups = init_parallel_groups(url, job=JOB, attempt=1, rank=rank, layout=layout,
                                      timeout=timedelta(seconds=60))
        check_groups(groups)
        x = torch.ones(1)
        dist.all_reduce(x)
        results.put((rank, "reformed", int(x.item()), steps))
        dist.barrier()
        groups.teardown()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), 0))


def join_as_replacement(rank, world, init_file, results, url):
    """A fresh process taking a dead rank's place: the controller gives it the new attempt."""
    try:
        import torch
        import torch.distributed as dist

        from longrun.commgroup import check_groups, init_parallel_groups

        groups = init_parallel_groups(url, job=JOB, attempt=1, rank=rank, layout=world4_layout(),
                                      timeout=timedelta(seconds=60))
        check_groups(groups)
        x = torch.ones(1)
        dist.all_reduce(x)
        results.put((rank, "reformed", int(x.item()), 0))
        dist.barrier()
        groups.teardown()
    except Exception:
        results.put((rank, "error", traceback.format_exc(), 0))
