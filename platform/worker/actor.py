"""The training worker that runs inside a Ray actor, one per accelerator.

It is the seam between the two worlds: Ray places and supervises it; inside, it runs the
trainer, which never sees Ray. Its life: created blank, `warm()` (imports), `assume()` a rank
of an attempt, `diagnose()` (self-checks), `run()`: join the groups and build the trainer
(`setup.py`), restore, and train with `StepHooks` (`hooks.py`) around every step: heartbeat
for the controller, metrics for operators, checkpoints, injected faults.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

from longrun import keys
from longrun.config import JobConfig
from longrun.failures import carried
from longrun.goodput.ledger import StepLedger
from longrun.health.heartbeat import AgentLink, HeartbeatPublisher
from longrun.kinds import FaultKind, Phase
from longrun.observability.discovery import advertised_address
from longrun.observability.metrics import WorkerMetrics
from longrun.parallel.dims import coords_of
from longrun.worker.rank_log import RankLogShipper
from longrun.worker.redis_links import RankRedis

log = logging.getLogger(__name__)


class TrainWorker:
    """Plain class; the controller wraps it with `ray.remote(...)` and its resources. Every
    remote method's error reaches the controller as a torch-free RankFailure (failures.py).

    An actor is created blank and is given its place in a job with `assume()`. That split is
    what makes warm spares possible: a spare is started ahead of need, `warm()` imports torch
    and the training stack (seconds of CPU), and on a restart it only has to `assume()` the
    rank of the worker it replaces. `node_ids[i]` is the Ray node of node index i (rank r is
    on node r // workers_per_node)."""

    def __init__(self) -> None:
        self.cfg: JobConfig | None = None
        self.metrics_port: int | None = None
        self._groups = None  # the attempt's communication groups, torn down when run() ends
        self._links = None  # this rank's two Redis connections (worker/redis_links.py), from first use

    @carried
    def warm(self) -> float:
        """Import what a run needs, before it is needed; the seconds it took."""
        import time

        start = time.perf_counter()
        import torch  # noqa: F401

        import longrun.checkpoint.checkpointer  # the package itself imports lazily
        import longrun.commgroup
        import longrun.health.diagnostics
        import longrun.health.faults
        import longrun.trainer
        import longrun.worker.hooks
        import longrun.worker.setup
        import longrun.worker.snapshots  # noqa: F401

        return time.perf_counter() - start

    @carried
    def assume(self, config: dict[str, Any], rank: int, attempt: int, redis_url: str,
               node_ids: list[str] | None = None, resume_before_step: int | None = None,
               skip_steps: list[tuple[int, int]] | None = None,
               snapshots: dict[str, Any] | None = None, beat_address: str | None = None,
               node_names: dict[str, str] | None = None) -> int:
        """`snapshots`: peer memory snapshots, from the controller (controller/keepers.py):
        the keepers to send to ("targets") and, after a fault, where to restore from
        ("restore": the step and each rank's keeper); None: off. `beat_address`: this node's
        heartbeat agent (health.node_agents), None without one. `node_names`: node id -> "host
        (address)", the label a person reads on this rank's metrics. Returns this process's
        pid, by which the agent knows this rank's beats from anyone else's datagrams."""
        self.cfg = JobConfig.model_validate(config)
        self.snapshots = snapshots
        self.rank = rank
        self.attempt = attempt
        self.redis_url = redis_url
        self.node_ids = node_ids or ["local"]
        self.resume_before_step = resume_before_step
        self.skip_steps = [tuple(w) for w in skip_steps or ()]  # [first, last] windows not to train on
        self.beat_address = beat_address
        self.node_names = node_names or {}
        return os.getpid()

    def _redis(self):
        """This rank's Redis connections (two at most, whatever it does: worker/redis_links.py),
        opened on first use, closed when run() ends."""
        if self._links is None:
            self._links = RankRedis(self.redis_url, self.cfg.job.name, self.attempt, self.rank,
                                    patience_s=self.cfg.health.store_patience_s)
        return self._links

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    @carried
    def write_probe(self, token: str) -> None:
        """Leave this node's probe in the checkpoint directory (checkpoint/shared.py)."""
        from longrun.checkpoint.shared import write_probe

        node = self.node_ids[self.rank // self.cfg.cluster.workers_per_node]
        write_probe(self.cfg.checkpoint_dir, token, node)

    @carried
    def diagnose(self) -> dict[str, Any]:
        """The self-checks of `recovery.diagnostics` on this worker; the collective check
        runs among the workers of this node (a group made for it over the Redis store)."""
        from longrun.commgroup.store import RedisStore
        from longrun.health.diagnostics import run_diagnostics
        from longrun.worker.setup import worker_device

        cfg = self.cfg
        per_node = cfg.cluster.workers_per_node
        node_index, local_rank = divmod(self.rank, per_node)
        links = self._redis()
        store = None
        if per_node > 1 and "collective" in cfg.recovery.diagnostics:
            prefix = f"{keys.attempt_prefix(cfg.job.name, self.attempt)}diag:{node_index}:"
            store = (RedisStore(self.redis_url, namespace=prefix, links=links.store()), local_rank, per_node)
        # The self-check's all-reduce fails fast (a node that cannot sum a small tensor among its
        # own workers in 30 s fails its check), never later than the job's collective timeout.
        timeout = timedelta(seconds=min(30.0, cfg.health.collective_timeout_s))
        report = run_diagnostics(cfg.recovery.diagnostics, node=self.node_ids[node_index],
                                 rank=self.rank, device=worker_device(cfg, self.rank),
                                 redis_url=self.redis_url, node_group=store, store_client=links.client,
                                 collective_timeout=timeout)
        return {"node": report.node, "rank": report.rank, "ok": report.ok, "reason": report.reason,
                "checks": [(c.name, c.ok, c.seconds, c.detail) for c in report.checks]}

    @carried
    def run(self) -> dict[str, Any]:
        """Join the groups, build the trainer, restore, train to the end; rank's summary."""
        cfg = self.cfg
        # Everything this rank sends to Redis shares one connection that fails fast (heartbeats,
        # the step ledger and the log shipper retry on their own); commit reports must survive a
        # Redis restart, so they go through its patient view; the rendezvous store has the second.
        links = self._redis()
        client, ledger_client = links.client, links.patient
        # This rank's log lines go to the controller (its log file, shared warnings once), not
        # through Ray to the console.
        shipper = RankLogShipper(client, cfg.job.name, self.attempt, self.rank).start()
        # The step ledger (goodput) is written every step: a Redis away must not stall training.
        self.step_ledger = StepLedger(client, cfg.job.name, self.attempt, self.rank)
        node_index = self.rank // cfg.cluster.workers_per_node
        node = self.node_ids[node_index]
        # At scale the beat goes to this node's agent (controller/agents.py started it before us).
        link = AgentLink(self.beat_address, node_index) if self.beat_address else None
        health = cfg.health
        beat = HeartbeatPublisher(client, cfg.job.name, self.attempt, self.rank, health.heartbeat_interval_s,
                                  health.heartbeat_timeout_s, link=link).start()
        metrics = WorkerMetrics(cfg.job.name, self.rank, attempt=self.attempt,
                                node=self.node_names.get(node, node), node_id=node)
        self._groups = None
        try:
            obs = cfg.observability
            self.metrics_port = metrics.serve(obs.metrics_host, obs.metrics_port)
            # Published in the heartbeat: the controller turns it into Prometheus scrape targets.
            address = advertised_address(obs.metrics_host, self.metrics_port)
            beat.update(phase=Phase.SETUP, metrics_addr=address,
                        pp_stage=coords_of(cfg.dims, self.rank).pp if cfg.dims.pp > 1 else None)
            summary = self._train(beat, metrics, ledger_client, client)
            beat.stop(final_phase=Phase.DONE)
        except BaseException as exc:
            # Into this rank's log file too (the traceback Ray prints goes only to Ray's log).
            log.error("rank %d stops: %s: %s", self.rank, type(exc).__name__, exc,
                      exc_info=not isinstance(exc, KeyboardInterrupt),
                      extra={"console": False})  # the controller reports it as a fault
            step = getattr(exc, "step", None)
            if getattr(exc, "fault_kind", None) == FaultKind.NAN and step is not None:
                beat.update(step=step - 1, loss=None, loss_finite=False)  # the step did not happen
            beat.stop(final_phase=Phase.FAILED)
            raise
        finally:
            if self._groups is not None:
                self._groups.teardown()
            metrics.close()
            shipper.close()  # its last lines go out on the rank's connection, closed next
            self._links, links = None, self._links
            links.close()
        return summary | {"rank": self.rank, "metrics_port": self.metrics_port}

    def _train(self, beat: HeartbeatPublisher, metrics: WorkerMetrics, ledger_client, client):
        # torch is imported only in the worker process
        from longrun.checkpoint import Checkpointer, RedisCommitLedger
        from longrun.health.faults import FaultInjector
        from longrun.worker.hooks import StepHooks
        from longrun.worker.preemption import Preempted, PreemptionWatch
        from longrun.worker.setup import (
            build_trainer,
            calibrate_context_parallel,
            has_committed_checkpoint,
            join_groups,
            start_weights,
            worker_device,
        )

        # The start-up phases, each judged by its own deadline (health/startup.py): setup (until
        # here), rendezvous, build, restore, init, calibration, then the first step.
        cfg, groups = self.cfg, None
        device = worker_device(cfg, self.rank)
        if cfg.world_size > 1:
            beat.update(phase=Phase.RENDEZVOUS)
            groups = self._groups = join_groups(cfg, rank=self.rank, attempt=self.attempt,
                                                redis_url=self.redis_url, node_ids=self.node_ids,
                                                device=device, links=self._redis().store())
            metrics.observe_init_timings(groups.timings)
        # Only this rank's pieces of the model get memory; their values come from the restore
        # below or, when nothing is restored, from the job's initialisation (start_weights).
        beat.update(phase=Phase.BUILD)
        trainer, replicas = build_trainer(cfg, groups, device)
        with trainer:
            hooks = StepHooks(beat, metrics)
            hooks.ledger = self.step_ledger
            hooks.checkpointer = Checkpointer(
                cfg, rank=self.rank, world_size=cfg.world_size, dp_rank=replicas.rank,
                dp_size=replicas.size, on_saved=hooks.saved,
                ledger=RedisCommitLedger(ledger_client, cfg.job.name, self.attempt))
            hooks.faults = FaultInjector(cfg.health.faults, self.rank, self.attempt, model=trainer.model,
                                         on_fire=self._record_fault(ledger_client), on_phase=hooks.phase,
                                         on_fail_save=hooks.checkpointer.writer.fail_next_save)
            hooks.preemption = PreemptionWatch(client, cfg.job.name, self.attempt)
            if self.snapshots is not None:
                from longrun.worker.snapshots import memory_snapshots

                # Every rank gets one: each snapshot begins with the ranks' agreement (its part
                # of its shard, the same steps on every rank), even where the keepers are gone.
                hooks.snapshots = memory_snapshots(cfg, self.rank, self.snapshots, groups,
                                                   on_drop=metrics.snapshot_dropped,
                                                   on_interval=metrics.snapshot_interval)
            # Before the hooks' own: an in-step slow fault's time is then what the snapshot's
            # copy overlaps, as a larger model's compute would be.
            trainer.before_update.append(hooks.faults.before_update)
            hooks.attach(trainer)
            resumed_from = self._restore(trainer, hooks, groups, replicas)
            if not resumed_from:
                hooks.phase(Phase.INIT)
            start_weights(trainer, resumed_from, checkpoints_expected=bool(cfg.model.init_from)
                          and has_committed_checkpoint(cfg))
            if cfg.dims.cp_enabled:
                hooks.phase(Phase.CALIBRATION)
            calibrate_context_parallel(cfg, trainer)
            hooks.begin_training()
            preempted = False
            try:
                trainer.train(on_step=hooks.after_step)
            except Preempted as stop:  # asked to stop; the checkpoint of this step is committed
                preempted = True
                if self.rank == 0:
                    print(f"stopped on request after step {stop.step}: its checkpoint is committed",
                          flush=True)
            finally:
                if hooks.snapshots is not None:
                    # The last snapshot reaches the keepers before the last save's fate is known:
                    # if that save failed, the restart resumes from it (and writes it) instead
                    # of training the last steps again.
                    hooks.snapshots.wait()
                hooks.checkpointer.close()  # the last save commits, or its failure is raised
        last = hooks.last
        return {"step": trainer.step, "resumed_from": resumed_from, "preempted": preempted,
                "loss": last.loss if last else None,
                "tokens_per_s": last.tokens_per_s if last else None}

    def _restore(self, trainer, hooks, groups, replicas) -> int:
        """Resume from the peers' memory when the controller found a snapshot newer than the
        newest committed checkpoint, else from that checkpoint (before the policy's step, if
        any); skip the data windows the policy marked. The step resumed from (0: none)."""
        hooks.phase(Phase.RESTORE)
        ckpt = hooks.checkpointer
        world = groups.world if groups else None
        started = time.perf_counter()
        plan = (self.snapshots or {}).get("restore")
        if plan is not None:
            from longrun.controller.snapshot_keeper import keeper_name
            from longrun.worker.snapshots import restore_from_memory

            node = self.node_ids[self.rank // self.cfg.cluster.workers_per_node]
            step = restore_from_memory(trainer, self.rank, plan, world, replicas.group,
                                       prefer=keeper_name(self.cfg.job.name, node))
            if step is not None:
                hooks.restored(step, time.time(), source="memory", seconds=time.perf_counter() - started)
                if self.rank == 0:
                    print(f"resumed from the memory snapshot of step {step}", flush=True)
                # The controller chose the snapshot for being newer than every committed
                # checkpoint, so a save due at its step never committed (the failed save that
                # ended the last attempt, say): it is written now. At the job's last step nothing
                # else would write it, and the job would end with its last steps in memory only.
                hooks.checkpoint_if_due(step)
                self._skip_windows(trainer)
                return step
            started = time.perf_counter()
        restored = ckpt.restore(trainer, world, replicas.group, before_step=self.resume_before_step)
        took = time.perf_counter() - started
        resumed_from = 0
        if restored is None:
            hooks.restored(None, 0.0, source="storage", seconds=took)
        else:
            resumed_from = restored.step
            hooks.restored(restored.step, _committed_at(ckpt, restored.step), source="storage", seconds=took)
            if self.rank == 0:
                print(f"resumed from the checkpoint of step {restored.step}", flush=True)
        self._skip_windows(trainer)
        return resumed_from

    def _skip_windows(self, trainer) -> None:
        if self.skip_steps:
            trainer.skip_steps = frozenset(s for first, last in self.skip_steps
                                           for s in range(first, last + 1))
            if self.rank == 0:
                windows = ", ".join(f"{a}-{b}" for a, b in self.skip_steps)
                print(f"skipping the data of steps {windows} (repeated loss spikes)", flush=True)

    def _record_fault(self, client):
        """An injected fault goes into the job's event log before it fires (with its wall time)."""
        from longrun.controller.job_state import JobRecordStore

        def record(spec, step: int) -> None:
            JobRecordStore(client, self.cfg.job.name).event(
                "fault_injected", self.attempt, f"injecting {spec.kind} on rank {self.rank} at step {step}",
                fault=spec.kind, rank=self.rank, step=step)
        return record


def _committed_at(ckpt, step: int) -> float:
    """When the checkpoint of `step` was committed (its manifest's time: written last, it is
    the commit; an object store's directories have no time), for the age panel."""
    from longrun.checkpoint.layout import MANIFEST, step_dir

    try:
        return float(ckpt.fs.modified(f"{step_dir(ckpt.fs, ckpt.root, step)}/{MANIFEST}").timestamp())
    except (OSError, NotImplementedError, AttributeError):
        return time.time()
