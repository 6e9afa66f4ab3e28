"""The job driver for `longrun run`: place the worker, watch it, record the job's life.

This first version drives single-worker jobs end to end through the state machine, the
Redis job record and the worker heartbeats. Multi-worker rendezvous, diagnostics and
automatic recovery build on the same loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
import redis
from ray.exceptions import RayActorError, RayTaskError

from longrun.config import JobConfig
from longrun.controller.job_state import JobRecordStore
from longrun.controller.state import JobState, JobStateMachine
from longrun.controller.workers import TrainWorker
from longrun.health.heartbeat import read_heartbeats


class JobFailed(RuntimeError):
    pass


class UnsupportedJob(ValueError):
    pass


def worker_resources(cfg: JobConfig) -> dict[str, Any]:
    """One worker per accelerator: a GPU each on CUDA; on CPU, one core each."""
    if cfg.cluster.device == "cuda":
        return {"num_gpus": 1, "num_cpus": 1}
    return {"num_cpus": 1}


def check_supported(cfg: JobConfig) -> None:
    if cfg.world_size != 1:
        raise UnsupportedJob(
            f"this version of longrun runs single-worker jobs; the config asks for {cfg.world_size} "
            "workers (cluster.nodes x cluster.workers_per_node). Set both to 1."
        )


def run_job(cfg: JobConfig, redis_url: str, *, attempt: int = 0, poll_s: float = 1.0,
            on_state: Callable[[JobState, str], None] | None = None) -> dict[str, Any]:
    """Run the job on the connected Ray cluster; returns the worker's summary.

    Raises JobFailed when the worker fails, with the worker's error as the cause.
    """
    check_supported(cfg)
    client = redis.Redis.from_url(redis_url)
    record = JobRecordStore(client, cfg.job.name)
    machine = JobStateMachine()

    def move(target: JobState, reason: str) -> None:
        record.record_transition(machine.transition(target, reason), attempt)
        if on_state:
            on_state(target, reason)

    record.update(steps=cfg.training.steps)
    move(JobState.PLACING, "placing 1 worker")
    actor_cls = ray.remote(max_restarts=0, max_concurrency=2)(TrainWorker)
    actor = actor_cls.options(name=f"longrun-{cfg.job.name}-a{attempt}-r0", **worker_resources(cfg)).remote(
        cfg.model_dump(mode="json"), 0, attempt, redis_url)
    move(JobState.RENDEZVOUS, "world of 1: no communication groups to form")
    result_ref = actor.run.remote()
    move(JobState.RUNNING, "training")
    try:
        summary = _watch(cfg, client, record, result_ref, attempt, poll_s)
        move(JobState.SUCCEEDED, f"finished {summary['step']} steps")
        return summary
    except (RayActorError, RayTaskError) as exc:
        move(JobState.FAILED, f"worker failed: {type(exc).__name__}")
        raise JobFailed(f"the worker failed: {exc}") from exc
    except KeyboardInterrupt:
        move(JobState.STOPPED, "interrupted by the user")
        raise
    finally:
        ray.kill(actor)
        client.close()


def _watch(cfg: JobConfig, client: redis.Redis, record: JobRecordStore, result_ref, attempt: int,
           poll_s: float) -> dict[str, Any]:
    """Wait for the worker, copying its heartbeat into the job record for `longrun status`."""
    while True:
        done, _ = ray.wait([result_ref], timeout=poll_s)
        beat = read_heartbeats(client, cfg.job.name, attempt, range(1))[0]
        if beat is not None:
            record.update(step=beat.step, loss=beat.loss, phase=beat.phase)
        if done:
            summary = ray.get(result_ref)
            record.update(step=summary["step"], loss=summary["loss"])
            return summary
