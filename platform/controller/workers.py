"""The training worker that runs inside a Ray actor, one per accelerator.

It is the seam between the two worlds: Ray places and supervises it; inside, it runs the
trainer, which never sees Ray. It wires the trainer's per-step hook to the heartbeat (for
the controller), to Prometheus (for operators) and to the checkpointer (resume on start, save
every checkpoint.interval_steps).
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
        # torch is imported only in the worker process
        from longrun.checkpoint import Checkpointer, RedisCommitLedger
        from longrun.health.faults import FaultInjector
        from longrun.trainer import NonFiniteError, Trainer

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
            beat.update(step=m.step, loss=m.loss if math.isfinite(m.loss) else None,
                        loss_finite=math.isfinite(m.loss), step_time_s=m.step_time_s,
                        tokens_per_s=m.tokens_per_s, memory_bytes=m.memory_bytes)
            injector.after_step(m.step)

        resumed_from = 0
        try:
            with Trainer(cfg) as trainer:
                trainer.on_phase = lambda phase: beat.update(phase=phase)
                injector = FaultInjector(cfg.health.faults, self.rank, self.attempt, model=trainer.model)
                ckpt = Checkpointer(cfg, ledger=RedisCommitLedger(client, cfg.job.name, self.attempt))
                beat.update(phase="restore")
                restored = ckpt.restore(trainer)
                if restored is not None:
                    resumed_from = restored.step
                    print(f"resumed from the checkpoint of step {restored.step}", flush=True)
                trainer.before_update.append(ckpt.before_update)
                try:
                    trainer.train(on_step=[on_step, ckpt.on_step(trainer)])
                finally:
                    ckpt.close()  # the last save commits, or its failure is raised
        except NonFiniteError as exc:
            beat.update(step=exc.step - 1, loss=None, loss_finite=False)  # the step did not happen
            beat.stop(final_phase="failed")
            raise
        except BaseException:
            beat.stop(final_phase="failed")
            raise
        finally:
            metrics.close()
            client.close()
        beat.stop(final_phase="done")
        return {"rank": self.rank, "step": trainer.step, "resumed_from": resumed_from,
                "loss": last.loss if last else None,
                "tokens_per_s": last.tokens_per_s if last else None,
                "metrics_port": self.metrics_port}
