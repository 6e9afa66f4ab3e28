"""What this version of longrun can run, beyond what makes a config valid.

A valid config (`JobConfig`) describes a job that makes sense; a runnable one is also a job
the controller's workers can train here: something to split for
dynamic CP, a layout whose estimated memory fits `cluster.device_memory_gb` (`memory.py`),
and, for a submitted job, checkpoints on a path every node resolves alike (absolute or a URL).
`longrun config validate`, `run` and `submit` all ask this one function, so validate never
calls a config good that run would refuse.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from longrun.config.memory import plan_problem
from longrun.redis_password import RedisPasswordError, is_reference, resolve

if TYPE_CHECKING:
    from longrun.config.job import JobConfig


class UnsupportedJob(ValueError):
    """A valid config this version cannot run (each line: dotted path, then the reason)."""


def runnable_problems(cfg: JobConfig, *, runs_here: bool = True) -> list[tuple[str, str]]:
    """(dotted path, reason) for each thing that keeps this valid config from running.
    `runs_here`: the job runs in this process's environment (`run`, `validate`); a submitted job
    runs in the cluster's, which supplies a password the URL only refers to."""
    problems = []
    if not runs_here and (where := _relative_local_path(cfg.checkpoint_dir)):
        knob = "checkpoint.dir" if cfg.checkpoint.dir else "job.output_dir"
        problems.append((knob, f"the checkpoints would go to {where!r}, a relative path: each node of the "
                         "cluster resolves it inside its own copy of the job's working directory, so ranks "
                         "would commit to different disks and a restart on another node would find "
                         "nothing. Give an absolute path on storage every node mounts, or a URL "
                         "(s3://..., gs://...)"))
    if runs_here and is_reference(cfg.cluster.redis_url):
        try:
            resolve(cfg.cluster.redis_url)
        except RedisPasswordError as exc:
            problems.append(("cluster.redis_url", str(exc)))
    par = cfg.parallelism
    if par.dynamic_cp and cfg.world_size < 2:
        problems.append(("parallelism.dynamic_cp", "dynamic context parallelism splits sequences "
                         "across workers; a one-worker job has nothing to split. Set it to false "
                         "or add workers."))
    if cfg.model.init_from:
        from longrun.interop.hf import init_from_problem

        if problem := init_from_problem(cfg.model):
            problems.append(("model.init_from", problem))
    memory = plan_problem(cfg)
    if memory:
        problems.append(("cluster.device_memory_gb", memory))
    return problems


def _relative_local_path(path: str) -> str | None:
    """`path` when it is a relative path on the local file system (no URL scheme), else None."""
    if "://" in path:
        path = path.split("://", 1)[1] if path.startswith("file://") else "/"
    return None if PurePosixPath(path).is_absolute() else path


def check_runnable(cfg: JobConfig, *, runs_here: bool = True) -> None:
    """Raise UnsupportedJob listing every problem `runnable_problems` finds."""
    problems = runnable_problems(cfg, runs_here=runs_here)
    if problems:
        raise UnsupportedJob("\n".join(f"{path}: {why}" for path, why in problems))
