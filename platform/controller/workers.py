"""The training worker that runs inside a Ray actor, one per accelerator.

It is the seam between the two worlds: Ray places and supervises it; inside, it runs the
trainer, which never sees Ray. It wires the trainer's per-step hook to the heartbeat (for
the controller) and to Prometheus (for operators).
"""

from __future__ import annotations

import math
from typing import Any

import redis

from longrun.config import JobConfig
from longrun.health.heartbeat import HeartbeatPublisher
from longrun.observability.metrics import WorkerMetrics


class TrainWorker:
    """Plain class; the controller wraps it with `ray.remote(...)` and its resources."""

    def __init__(self, config: dict[str, Any], rank: int, attempt: int, redis_url: str):
        self.cfg = JobConfig.model_validate(config)
        self.rank = rank
        self.attempt = attempt
        self.redis_url = redis_url
        self.metrics_port: int | None = None

    def run(self) -> dict[str, Any]:
        from longrun.trainer import Trainer  # torch is imported only in the worker process

        cfg = self.cfg
        client = redis.Redis.from_url(self.redis_url)
        beat = HeartbeatPublisher(client, cfg.job.name, self.attempt, self.rank,
                                  cfg.health.heartbeat_interval_s, cfg.health.heartbeat_timeout_s).start()
        metrics = WorkerMetrics(cfg.job.name, self.rank)
        obs = cfg.observability
        self.metrics_port = metrics.serve(obs.metrics_host, obs.metrics_port)
        beat.update(phase="setup")
        last = None

        def on_step(m) -> None:
            nonlocal last
            last = m
            metrics.observe_step(m)
            beat.update(step=m.step, phase="train", loss=m.loss if math.isfinite(m.loss) else None,
                        step_time_s=m.step_time_s, tokens_per_s=m.tokens_per_s)

        try:
            trainer = Trainer(cfg)
            trainer.train(on_step=on_step)
        except BaseException:
            beat.stop(final_phase="failed")
            raise
        finally:
            metrics.close()
            client.close()
        beat.stop(final_phase="done")
        if last is None:
            raise RuntimeError("the trainer returned without completing a step")
        return {"rank": self.rank, "step": last.step, "loss": last.loss,
                "tokens_per_s": last.tokens_per_s, "metrics_port": self.metrics_port}
