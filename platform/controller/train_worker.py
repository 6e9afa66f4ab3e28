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
import os
import time
from typing import Any

from longrun import keys
from longrun.config import JobConfig
from longrun.health.heartbeat import HeartbeatPublisher
from longrun.observability.discovery import advertised_address
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
               skip_steps: list[tuple[int, int]] | None = None) -> None:
        self.cfg = JobConfig.model_validate(config)
        self.rank = rank
        self.attempt = attempt
        self.redis_url = redis_url
        self.node_ids = node_ids or ["local"]
        self.resume_before_step = resume_before_step
        self.skip_steps = [tuple(w) for w in skip_steps or ()]  # [first, last] windows not to train on

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
        from longrun.trainer import NonFiniteError

        cfg = self.cfg
        # Heartbeats fail fast (the next interval retries); commit reports must survive a
        # Redis restart, so they go through the patient client.
        client = quick_client(self.redis_url)
        ledger_client = patient_client(self.redis_url, cfg.health.store_patience_s)
        beat = HeartbeatPublisher(client, cfg.job.name, self.attempt, self.rank,
                                  cfg.health.heartbeat_interval_s, cfg.health.heartbeat_timeout_s).start()
        node = self.node_ids[self.rank // cfg.cluster.workers_per_node]
        metrics = WorkerMetrics(cfg.job.name, self.rank, attempt=self.attempt, node=node)
        obs = cfg.observability
        last = None
        groups = None

        def on_step(m) -> None:
            nonlocal last
            last = m
            metrics.observe_step(m)
            if trainer.last_plan is not None:
                plan = trainer.last_plan
                metrics.observe_cp_plan([g.cp for mb in plan.micro_batches for g in mb.groups if g.sequences],
                                        plan.predicted_s, m.step_time_s)
            beat.update(step=m.step, loss=m.loss if math.isfinite(m.loss) else None,
                        loss_finite=math.isfinite(m.loss), step_time_s=m.step_time_s,
                        tokens_per_s=m.tokens_per_s, memory_bytes=m.memory_bytes)
            injector.after_step(m.step)

        def on_saved(result) -> None:  # the writer thread, when a save is done
            metrics.observe_checkpoint(write_s=result.write_s)
            if result.committed and result.error is None:
                metrics.checkpoint_committed(result.step, time.time())

        resumed_from = 0
        try:
            self.metrics_port = metrics.serve(obs.metrics_host, obs.metrics_port)
            # Published in the heartbeat: the controller turns it into Prometheus scrape targets.
            beat.update(phase="setup", metrics_addr=advertised_address(obs.metrics_host, self.metrics_port))
            if cfg.world_size > 1:
                beat.update(phase="rendezvous")
                groups = self._join_groups()
                metrics.observe_init_timings(groups.timings)
            trainer, replicas = self._trainer(groups)
            with trainer:
                trainer.on_phase = self._phase_timer(beat, metrics)
                injector = FaultInjector(cfg.health.faults, self.rank, self.attempt, model=trainer.model,
                                         on_fire=self._record_fault(ledger_client),
                                         on_phase=trainer.on_phase)
                ckpt = Checkpointer(cfg, rank=self.rank, world_size=cfg.world_size,
                                    dp_rank=replicas[0], dp_size=replicas[1], on_saved=on_saved,
                                    ledger=RedisCommitLedger(ledger_client, cfg.job.name, self.attempt))
                beat.update(phase="restore")
                restored = ckpt.restore(trainer, groups.world if groups else None, replicas[2],
                                        before_step=self.resume_before_step)
                if restored is not None:
                    resumed_from = restored.step
                    metrics.checkpoint_committed(restored.step, _committed_at(ckpt, restored.step))
                    beat.update(step=restored.step, resumed_from=restored.step)
                    if self.rank == 0:
                        print(f"resumed from the checkpoint of step {restored.step}", flush=True)
                if self.skip_steps:
                    trainer.skip_steps = frozenset(s for first, last_skipped in self.skip_steps
                                                   for s in range(first, last_skipped + 1))
                    if self.rank == 0:
                        windows = ", ".join(f"{a}-{b}" for a, b in self.skip_steps)
                        print(f"skipping the data of steps {windows} (repeated loss spikes)", flush=True)
                trainer.before_update.append(ckpt.before_update)
                saves = ckpt.saves

                def after_save(m) -> None:
                    nonlocal saves
                    if ckpt.saves != saves:
                        saves = ckpt.saves
                        metrics.observe_checkpoint(blocking_s=ckpt.last_blocking_s)
                try:
                    trainer.train(on_step=[on_step, ckpt.on_step(trainer), after_save])
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

    def _trainer(self, groups):
        """The trainer, and how its replicas are grouped for checkpoints: (rank among the
        replicas, their count, their group). Without context parallelism the replicas are the
        data-parallel group; with it, every rank of the dp x cp span holds the same weights and
        the same data position (all draw the same global batch), so the span is the group."""
        import torch.distributed as dist

        from longrun.trainer import Trainer
        from longrun.trainer.flops import peak_flops
        from longrun.trainer.loop import resolve_device

        cfg, par = self.cfg, self.cfg.parallelism
        peak = peak_flops(resolve_device(cfg.cluster.device), cfg.cluster.peak_tflops)
        if par.cp == 1 and not par.dynamic_cp:
            dp_group = groups.dp if groups else None
            rank, size = (dist.get_rank(dp_group), dist.get_world_size(dp_group)) if groups else (0, 1)
            return Trainer(cfg, dp_group=dp_group, peak_flops=peak), (rank, size, dp_group)
        from longrun.trainer.cp_batches import setup_from_parallel_groups
        from longrun.trainer.cp_calibration import load_or_calibrate
        from longrun.trainer.dynamic_cp import CostModel

        # A stand-in until the calibration (measured once per model, device and span, then
        # read from the job's output directory) replaces it below.
        provisional = CostModel.for_model(cfg.model, linear_s_per_token=1e-6, attn_s_per_token2=1e-9,
                                          ring_block_s_per_token2=1e-9, p2p_latency_s=1e-4,
                                          p2p_s_per_byte=1e-9, micro_batch_overhead_s=1e-3)
        setup = setup_from_parallel_groups(groups, cost=provisional, dynamic=par.dynamic_cp,
                                           static_cp=par.cp, impl=par.cp_impl)
        trainer = Trainer(cfg, context_parallel=setup, peak_flops=peak)
        load_or_calibrate(os.path.join(cfg.job.output_dir, cfg.job.name, "cp-calibration"), trainer)
        span = groups.dp_cp
        return trainer, (dist.get_rank(span), dist.get_world_size(span), span)

    @staticmethod
    def _phase_timer(beat, metrics):
        """The trainer's phase hook: each phase into the heartbeat, and its duration (until the
        next phase begins) into the phase histogram."""
        current: list = [None, 0.0]

        def on_phase(phase: str) -> None:
            now = time.perf_counter()
            if current[0] is not None:
                metrics.observe_phase(current[0], now - current[1])
            current[0], current[1] = phase, now
            beat.update(phase=phase)
        return on_phase

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
        # The layout orders nodes by name; prefixing the placement index keeps rank r on the
        # node the controller placed it on (node_ids[r // workers_per_node]).
        nodes = [NodeSpec(f"{i:05d}-{n}") for i, n in enumerate(self.node_ids)]
        layout = make_layout(nodes, cfg.cluster.workers_per_node,
                             ParallelDims(dp=par.dp, cp=par.cp, tp=par.tp, pp=par.pp))
        return init_parallel_groups(self.redis_url, job=cfg.job.name, attempt=self.attempt,
                                    rank=self.rank, layout=layout)


def _committed_at(ckpt, step: int) -> float:
    """When the checkpoint of `step` was committed (its directory's time), for the age panel."""
    from longrun.checkpoint.layout import step_dir_name

    try:
        return float(ckpt.fs.modified(f"{ckpt.root}/{step_dir_name(step)}").timestamp())
    except (OSError, NotImplementedError, AttributeError):
        return time.time()
