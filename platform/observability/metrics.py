"""Worker-side Prometheus metrics (the controller's are in controller_metrics.py).

Names carry units, labels are bounded: job, attempt, rank, node (and node_id) on every series, plus `phase`
where a step's or a bring-up's time is split; never a step number or an error string. Each
worker owns a private registry so several workers in one process (tests, a local run) do not
collide, and serves it on loopback unless configured otherwise.

    metrics = WorkerMetrics("my-run", rank=3, attempt=2, node="node-a")
    port = metrics.serve("127.0.0.1", 0)      # then report ("host:port", node) to the controller
    metrics.observe_step(step_metrics)        # every step
    metrics.observe_phase("forward", 0.12)    # from the trainer's on_phase timings
    metrics.close()
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# The controller's metrics live in their own module; importable from here as well.
from longrun.observability.controller_metrics import ControllerMetrics
from longrun.observability.server import ObservabilityServer
from longrun.observability.vocab import (
    INIT_PHASES,
    PHASES,
    RESTORE_SOURCES,
    STATE_KINDS,
    WORKER_LABELS,
    bounded,
)

# Step times from ~10 ms (tiny CPU models) to minutes (huge models with pipeline bubbles).
STEP_TIME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 300)
# A phase can be a fraction of a millisecond (the optimizer of a small model).
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, *STEP_TIME_BUCKETS)
# The stall a checkpoint costs training (the host snapshot): milliseconds when it works.
CHECKPOINT_BLOCKING_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# The background write to storage: seconds to half an hour for big models on object stores.
CHECKPOINT_WRITE_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
# Dynamic CP sizes are powers of two.
CP_SIZE_BUCKETS = tuple(float(2**i) for i in range(10))  # 1 .. 512


class WorkerMetrics:
    def __init__(self, job: str, rank: int, *, attempt: int = 0, node: str = "", node_id: str | None = None,
                 registry: CollectorRegistry | None = None):
        """`node`: the rank's node as a person reads it ("host (address)"), `node_id` its Ray id
        (None: `node` is the id)."""
        self.registry = registry or CollectorRegistry()
        self._values = {"job": job, "attempt": str(attempt), "rank": str(rank), "node": node,
                        "node_id": node if node_id is None else node_id}
        labels, r = WORKER_LABELS, self.registry

        def gauge(name: str, doc: str, extra: Sequence[str] = ()) -> Gauge:
            return Gauge(name, doc, (*labels, *extra), registry=r)

        def histogram(name: str, doc: str, buckets: Sequence[float], extra: Sequence[str] = ()) -> Histogram:
            return Histogram(name, doc, (*labels, *extra), buckets=buckets, registry=r)

        self.step = gauge("longrun_train_step", "Last completed optimizer step.")
        self.loss = gauge("longrun_train_loss", "Training loss of the last step.")
        self.grad_norm = gauge("longrun_train_grad_norm", "Global gradient norm before clipping.")
        self.val_loss = gauge("longrun_validation_loss",
                              "Mean token loss on the held-out data of the last validation pass.")
        self.lr = gauge("longrun_train_learning_rate", "Learning rate of the last step.")
        # prometheus-client appends _total: exported as longrun_train_tokens_total.
        self.tokens = Counter("longrun_train_tokens", "Tokens trained on (this rank).", labels, registry=r)
        self.tokens_per_s = gauge("longrun_train_tokens_per_second",
                                  "Throughput of the last step (this rank).")
        self.step_time = histogram("longrun_train_step_duration_seconds", "Wall time per optimizer step.",
                                   STEP_TIME_BUCKETS)
        self.data_wait = histogram("longrun_train_data_wait_seconds", "Time a step waited for its data.",
                                   STEP_TIME_BUCKETS)
        self.mfu = gauge("longrun_train_mfu_ratio", "Model FLOPs utilisation of the last step (0-1).")
        self.memory = gauge("longrun_train_memory_bytes",
                            "Peak accelerator memory allocated in the last step (peak RSS on CPU).")
        # The layout label has one value per job (its parallel degrees): bounded.
        self.state = gauge("longrun_train_state_bytes",
                           "Training state this rank holds, by kind (parameters, gradients, optimizer "
                           "state), labelled with the job's parallel layout.", ("kind", "layout"))
        self.phase_time = histogram("longrun_train_phase_duration_seconds",
                                    "Time spent per phase of a step (data, forward, backward, sync, ...).",
                                    PHASE_BUCKETS, ("phase",))
        self.ckpt_blocking = histogram("longrun_checkpoint_blocking_seconds",
                                       "Time training waited for a checkpoint (the host snapshot).",
                                       CHECKPOINT_BLOCKING_BUCKETS)
        self.ckpt_write = histogram("longrun_checkpoint_write_seconds",
                                    "Background write of a checkpoint to storage.", CHECKPOINT_WRITE_BUCKETS)
        self.ckpt_step = gauge("longrun_checkpoint_last_step", "Step of the newest committed checkpoint.")
        self.restore_time = gauge("longrun_checkpoint_restore_seconds",
                                  "How long this rank's last restore took, by where it read from "
                                  "(storage, or a peer's memory).", ("source",))
        self.ckpt_time = gauge("longrun_checkpoint_last_commit_timestamp_seconds",
                               "Unix time the newest committed checkpoint was committed.")
        self.cp_size = histogram("longrun_dynamic_cp_group_size",
                                 "Context-parallel group size the dynamic CP planner chose, per micro-batch.",
                                 CP_SIZE_BUCKETS)
        self.cp_predicted = gauge("longrun_dynamic_cp_predicted_step_seconds",
                                  "Step time the CP cost model predicted for the last plan.")
        self.cp_measured = gauge("longrun_dynamic_cp_measured_step_seconds",
                                 "Measured time of the last planned step.")
        self.snapshots_dropped = Counter(
            "longrun_memory_dropped_snapshots", "Peer memory snapshots dropped on this rank: skipped "
            "(due while a rank's previous send was still running: every rank skips it) or not stored "
            "(a send that failed); training went on.", labels, registry=r)
        self.snapshot_every = gauge("longrun_memory_snapshot_interval_steps",
                                    "Steps between peer memory snapshots (the auto interval the job chose).")
        self.group_init = gauge("longrun_group_init_seconds",
                                "Communication-group bring-up time of this attempt, per phase.", ("phase",))
        self._server: ObservabilityServer | None = None
        self.port: int | None = None

    def observe_step(self, m) -> None:
        """Record one step's metrics (a `longrun.trainer.StepMetrics`)."""
        v = self._values
        self.step.labels(**v).set(m.step)
        if math.isfinite(m.loss):  # a NaN loss is a fault the monitor reports; it is no loss value
            self.loss.labels(**v).set(m.loss)
        if m.grad_norm is not None and math.isfinite(m.grad_norm):
            self.grad_norm.labels(**v).set(m.grad_norm)
        val_loss = getattr(m, "val_loss", None)  # a step a validation pass followed
        if val_loss is not None and math.isfinite(val_loss):
            self.val_loss.labels(**v).set(val_loss)
        self.lr.labels(**v).set(m.lr)
        self.tokens.labels(**v).inc(m.tokens)
        self.tokens_per_s.labels(**v).set(m.tokens_per_s)
        self.step_time.labels(**v).observe(m.step_time_s)
        self.data_wait.labels(**v).observe(m.data_wait_s)
        if m.mfu is not None:
            self.mfu.labels(**v).set(m.mfu)
        memory = getattr(m, "memory_bytes", None)
        if memory is not None:
            self.memory.labels(**v).set(memory)

    def observe_state(self, layout: str, held: dict[str, int]) -> None:
        """Bytes of training state this rank holds by kind (`Trainer.state_bytes()`), under
        the job's layout name (`ParallelDims.layout_name`): what sharding saves, per rank."""
        for kind, nbytes in held.items():
            self.state.labels(**self._values, kind=bounded(kind, STATE_KINDS, "state kind"),
                              layout=layout).set(nbytes)

    def observe_phase(self, phase: str, seconds: float) -> None:
        """Time spent in one phase of a step; phase names outside vocab.PHASES become "other"."""
        self.phase_time.labels(**self._values, phase=bounded(phase, PHASES, "phase")).observe(seconds)

    def observe_checkpoint(self, blocking_s: float | None = None, write_s: float | None = None) -> None:
        """One save: the stall training saw (stage 1) and/or the background write (stage 2)."""
        if blocking_s is not None:
            self.ckpt_blocking.labels(**self._values).observe(blocking_s)
        if write_s is not None:
            self.ckpt_write.labels(**self._values).observe(write_s)

    def checkpoint_committed(self, step: int, at: float) -> None:
        """A checkpoint was committed (or, after a restore, the one restored from: call it then
        too, so the checkpoint-age panel and alert have a value before this attempt's first save)."""
        self.ckpt_step.labels(**self._values).set(step)
        self.ckpt_time.labels(**self._values).set(at)

    def observe_restore(self, source: str, seconds: float) -> None:
        """A restore at the start of an attempt, from `source` (vocab.RESTORE_SOURCES)."""
        self.restore_time.labels(**self._values, source=bounded(source, RESTORE_SOURCES, "restore source")
                                 ).set(seconds)

    def snapshot_dropped(self, step: int, why: str) -> None:
        """A memory snapshot was dropped (`checkpoint/memory.py`): counted, never labelled by
        step or reason."""
        self.snapshots_dropped.labels(**self._values).inc()

    def snapshot_interval(self, every: int) -> None:
        """The steps between memory snapshots, as the ranks chose them (`auto`)."""
        self.snapshot_every.labels(**self._values).set(every)

    def observe_cp_plan(self, cp_sizes: Sequence[int], predicted_s: float, measured_s: float | None) -> None:
        """One dynamic-CP plan: the CP size of each micro-batch, the cost model's step time and,
        once the step ran, the measured one."""
        sizes = self.cp_size.labels(**self._values)
        for size in cp_sizes:
            sizes.observe(size)
        self.cp_predicted.labels(**self._values).set(predicted_s)
        if measured_s is not None:
            self.cp_measured.labels(**self._values).set(measured_s)

    def observe_group_init(self, phase: str, seconds: float) -> None:
        """One phase of this attempt's communication-group bring-up (vocab.INIT_PHASES)."""
        self.group_init.labels(**self._values, phase=bounded(phase, INIT_PHASES, "init phase")).set(seconds)

    def observe_init_timings(self, timings) -> None:
        """All phases of a `longrun.commgroup.init.InitTimings` (the per-group times summed)."""
        for phase, seconds in init_phases(timings).items():
            self.observe_group_init(phase, seconds)

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Expose /metrics over HTTP; returns the bound port (a free one when port is 0)."""
        self._server = ObservabilityServer(self.registry, host=host, port=port)
        self.port = self._server.port
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


def init_phases(timings) -> dict[str, float]:
    """InitTimings -> {phase: seconds} in vocab.INIT_PHASES terms (duck-typed, so the metrics
    do not import torch through commgroup)."""
    return {"store_connect": timings.store_connect_s, "arrival": timings.arrival_s,
            "world_init": timings.world_init_s, "groups": float(sum(timings.groups_s.values())),
            "total": timings.total_s}


__all__ = ["ControllerMetrics", "WorkerMetrics", "init_phases"]
