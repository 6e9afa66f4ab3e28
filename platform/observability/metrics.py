"""Worker-side Prometheus metrics.

Names carry units, labels are bounded (job, rank): never a step number or an error string.
Each worker owns a private registry so several workers in one process (tests, a local run)
do not collide, and serves it on loopback unless configured otherwise.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Step times from ~10 ms (tiny CPU models) to minutes (huge models with pipeline bubbles).
STEP_TIME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 300)


class WorkerMetrics:
    def __init__(self, job: str, rank: int, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        labels = ("job", "rank")
        self._values = {"job": job, "rank": str(rank)}
        r = self.registry
        self.step = Gauge("longrun_train_step", "Last completed optimizer step.", labels, registry=r)
        self.loss = Gauge("longrun_train_loss", "Training loss of the last step.", labels, registry=r)
        self.grad_norm = Gauge("longrun_train_grad_norm", "Global gradient norm before clipping.",
                               labels, registry=r)
        self.lr = Gauge("longrun_train_learning_rate", "Learning rate of the last step.", labels, registry=r)
        self.tokens = Counter("longrun_train_tokens", "Tokens trained on.", labels, registry=r)
        self.tokens_per_s = Gauge("longrun_train_tokens_per_second", "Throughput of the last step.",
                                  labels, registry=r)
        self.step_time = Histogram("longrun_train_step_duration_seconds", "Wall time per optimizer step.",
                                   labels, buckets=STEP_TIME_BUCKETS, registry=r)
        self.data_wait = Histogram("longrun_train_data_wait_seconds",
                                   "Time a step waited for its data.", labels,
                                   buckets=STEP_TIME_BUCKETS, registry=r)
        self.mfu = Gauge("longrun_train_mfu_ratio", "Model FLOPs utilisation of the last step (0-1).",
                         labels, registry=r)
        self.port: int | None = None

    def observe_step(self, m) -> None:
        """Record one step's metrics (a `longrun.trainer.StepMetrics`)."""
        v = self._values
        self.step.labels(**v).set(m.step)
        if math.isfinite(m.loss):
            self.loss.labels(**v).set(m.loss)
        if m.grad_norm is not None and math.isfinite(m.grad_norm):
            self.grad_norm.labels(**v).set(m.grad_norm)
        self.lr.labels(**v).set(m.lr)
        self.tokens.labels(**v).inc(m.tokens)
        self.tokens_per_s.labels(**v).set(m.tokens_per_s)
        self.step_time.labels(**v).observe(m.step_time_s)
        self.data_wait.labels(**v).observe(m.data_wait_s)
        if m.mfu is not None:
            self.mfu.labels(**v).set(m.mfu)

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Expose /metrics over HTTP; returns the bound port (a free one when port is 0)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        self.port = server.server_address[1]
        return self.port

    def close(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.shutdown()
            server.server_close()
            self._server = None
