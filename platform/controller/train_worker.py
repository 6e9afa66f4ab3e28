"""The training worker that runs inside a Ray actor, one per accelerator.

It is the seam between the two worlds: Ray places and supervises it; inside, it runs the
trainer, which never sees Ray. It wires the trainer's per-step hook to the heartbeat (for
the controller), to Prometheus (for operators), to the checkpointer (resume on start, save
every checkpoint.interval_steps) and to the fault injector (tests and chaos runs).

With more than one worker it first joins the attempt's communication groups through the
Redis rendezvous (`commgroup`), in the node order the controller placed the ranks in.
"""

from __future__ import annotations

import math
from typing import Any

from longrun import keys
from longrun.config import JobConfig
from longrun.health.heartbeat import HeartbeatPublisher
from longrun.observability.metrics import WorkerMetrics
from longrun.services.redis_client import patient_client, quick_client


class TrainWorker:
    """Plain class; the controller wraps it with `ray.remote(...)` and its resources.

    An actor is created blank and is given its place in a job with `assume()`. That split is
    what makes warm spares possible: a spare is started ahead of need, `warm()` imports torch
    and the training stack (seconds of CPU), and on a restart it only has to `assume()` the
    rank of the worker it replaces. `node_ids[i]` is the Ray node of node index i (rank r is
    on node r // workers_per_node)."""

    def __init__(self) -> None:
        self.cfg: JobConfig | None = None
        self.metrics_port: int | None = None

    def warm(self) -> float:
        """Import what a run needs, before it is needed; the seconds it took."""
        import time

        start = time.perf_counter()
        import torch  # noqa: F401

        import longrun.checkpoint
        import longrun.commgroup
        import longrun.health.diagnostics
        import longrun.health.faults
        import longrun.trainer  # noqa: F401

        return time.perf_counter() - start

    def assume(self, config: dict[str, Any], rank: int, attempt: int, redis_url: str,
               node_ids: list[str] | None = None, resume_before_step: int | None = None,
               skip_steps: tuple[int, int] | None = None) -> None:
        self.cfg = JobConfig.model_validate(config)
        self.rank = rank
        self.attempt = attempt
        self.redis_url = redis_url
        self.node_ids = node_ids or ["local"]
        self.resume_before_step = resume_before_step
        self.skip_steps = skip_steps  # [first, last]: data the policy decided not to train on

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def diagnose(self) -> dict[str, Any]:
        """The self-checks of `recovery.diagnostics` on this worker; the collective check
        runs among the workers of this node (a group made for it over the Redis store)."""
        import torch

        from longrun.commgroup.store import RedisStore
        from longrun.health.diagnostics import run_diagnostics
        from longrun.trainer.loop import resolve_device

        cfg = self.cfg
        per_node = cfg.cluster.workers_per_node
        node_index, local_rank = divmod(self.rank, per_node)
        store = None
        if per_node > 1 and "collective" in cfg.recovery.diagnostics:
            prefix = f"{keys.attempt_prefix(cfg.job.name, self.attempt)}diag:{node_index}:"
            store = (RedisStore(self.redis_url, namespace=prefix), local_rank, per_node)
        device = resolve_device(cfg.cluster.device)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        report = run_diagnostics(cfg.recovery.diagnostics, node=self.node_ids[node_index],
                                 rank=self.rank, device=device, redis_url=self.redis_url,
                                 node_group=store)
        return {"node": report.node, "rank": report.rank, "ok": report.ok, "reason": report.reason,
                "checks": [(c.name, c.ok, c.seconds, c.detail) for c in report.checks]}

    def run(self) -> dict[str, Any]:
        # torch is imported only in the worker process
        from longrun.checkpoint import Checkpointer, RedisCommitLedger
        from longrun.health.faults import FaultInjector
        from longrun.trainer import NonFiniteError, Trainer

        cfg = self.cfg
        # Heartbeats fail fast (the next interval retries); commit reports must survive a
        # Redis restart, so they go through the patient client.
        client = quick_client(self.redis_url)
        ledger_client = patient_client(self.redis_url, cfg.health.store_patience_s)
        beat = HeartbeatPublisher(client, cfg.job.name, self.attempt, self.rank,
                                  cfg.health.heartbeat_interval_s, cfg.health.heartbeat_timeout_s).start()
        metrics = WorkerMetrics(cfg.job.name, self.rank)
        obs = cfg.observability
        self.metrics_port = metrics.serve(obs.metrics_host, obs.metrics_port)
        beat.update(phase="setup")
        last = None
        groups = None

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
            world_group = dp_group = None
            dp_rank, dp_size = 0, 1
            if cfg.world_size > 1:
                beat.update(phase="rendezvous")
                groups = self._join_groups()
                world_group, dp_group = groups.world, groups.dp
                import torch.distributed as dist

                dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
            with Trainer(cfg, dp_group=dp_group) as trainer:
                trainer.on_phase = lambda phase: beat.update(phase=phase)
                injector = FaultInjector(cfg.health.faults, self.rank, self.attempt, model=trainer.model,
                                         on_fire=self._record_fault(ledger_client))
                ckpt = Checkpointer(cfg, rank=self.rank, world_size=cfg.world_size, dp_rank=dp_rank,
                                    dp_size=dp_size,
                                    ledger=RedisCommitLedger(ledger_client, cfg.job.name, self.attempt))
                beat.update(phase="restore")
                restored = ckpt.restore(trainer, world_group, dp_group,
                                        before_step=self.resume_before_step)
                if restored is not None:
                    resumed_from = restored.step
                    beat.update(step=restored.step, resumed_from=restored.step)
                    if self.rank == 0:
                        print(f"resumed from the checkpoint of step {restored.step}", flush=True)
                if self.skip_steps is not None:
                    first, last = self.skip_steps
                    trainer.skip_steps = frozenset(range(first, last + 1))
                    if self.rank == 0:
                        print(f"skipping the data of steps {first}-{last} (repeated loss spikes)", flush=True)
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
            if groups is not None:
                groups.teardown()
            metrics.close()
            client.close()
            ledger_client.close()
        beat.stop(final_phase="done")
        return {"rank": self.rank, "step": trainer.step, "resumed_from": resumed_from,
                "loss": last.loss if last else None,
                "tokens_per_s": last.tokens_per_s if last else None,
                "metrics_port": self.metrics_port}

    def _record_fault(self, client):
        """An injected fault goes into the job's event log before it fires (with its wall time)."""
        from longrun.controller.job_state import JobRecordStore

        def record(spec, step: int) -> None:
            JobRecordStore(client, self.cfg.job.name).event(
                "fault_injected", self.attempt, f"injecting {spec.kind} on rank {self.rank} at step {step}",
                fault=spec.kind, rank=self.rank, step=step)
        return record

    def _join_groups(self):
        from longrun.commgroup import NodeSpec, ParallelDims, init_parallel_groups, make_layout

        cfg, par = self.cfg, self.cfg.parallelism
        if par.tp * par.cp * par.pp > 1:
            raise NotImplementedError("the controller runs data-parallel jobs; tp, cp and pp come next")
        layout = make_layout([NodeSpec(n) for n in self.node_ids], cfg.cluster.workers_per_node,
                             ParallelDims(dp=par.dp, cp=par.cp, tp=par.tp, pp=par.pp))
        return init_parallel_groups(self.redis_url, job=cfg.job.name, attempt=self.attempt,
                                    rank=self.rank, layout=layout)
