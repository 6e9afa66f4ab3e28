"""A real Prometheus finds a job's exporters through the controller's /sd, scrapes them, and
evaluates every dashboard query, variable, annotation and alert rule longrun ships.

The exporters here are fed synthetic values (no training runs), so every query that needs
data gets some; the end-to-end check with a real job uses the same `check_queries`.
"""

from __future__ import annotations

import shutil
import time
from types import SimpleNamespace

import pytest

from longrun.observability import alerts
from longrun.observability.discovery import target_groups
from longrun.observability.metrics import ControllerMetrics, WorkerMetrics
from longrun.observability.queries import DEFAULT_VALUES, Query, check_queries
from longrun.services.process import ServiceError
from longrun.services.prometheus import EmbeddedPrometheus, PromQLError, scrape_config

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="prometheus not installed (Debian package prometheus)")


def feed(worker: WorkerMetrics, rank: int) -> None:
    step = SimpleNamespace(step=10, loss=2.5, val_loss=2.7, grad_norm=1.0, lr=1e-3, tokens=4096,
                           tokens_per_s=2048.0, step_time_s=2.0 + rank, data_wait_s=0.01, mfu=0.35,
                           memory_bytes=2**30)
    worker.observe_step(step)
    for phase, seconds in (("data", 0.01), ("forward", 0.5), ("backward", 1.0), ("sync", 0.3),
                           ("optimizer", 0.1)):
        worker.observe_phase(phase, seconds)
    worker.observe_checkpoint(blocking_s=0.02, write_s=4.0)
    worker.checkpoint_committed(10, time.time())
    worker.observe_cp_plan([1, 2, 2, 4], predicted_s=1.9, measured_s=2.1)
    worker.observe_state("fsdp2.tp2", {"parameters": 4 << 20, "gradients": 4 << 20, "optimizer": 8 << 20})
    worker.observe_restore("storage", 1.2)
    worker.observe_init_timings(SimpleNamespace(store_connect_s=0.01, arrival_s=0.2, world_init_s=0.4,
                                                groups_s={"tp_0": 0.1}, total_s=0.8))


def feed_controller(c: ControllerMetrics) -> None:
    c.set_state("RUNNING")
    c.set_attempt(1)
    c.set_step(10, 100)
    c.set_evicted(0)
    c.fault("dead")
    c.restart("dead")
    c.detection(3.0)
    c.recovery(20.0)
    for rank in range(2):
        c.heartbeat_age(rank, f"node-{rank}", 0.5, sent_at=time.time())
    c.diagnostics("node-0", "compute", True, 0.2)
    c.group_init("total", 0.8)


@pytest.fixture(scope="module")
def job():
    """A controller serving /metrics and /sd, and two workers, on loopback."""
    controller = ControllerMetrics("demo")
    workers = [WorkerMetrics("demo", rank, attempt=1, node=f"node-{rank}") for rank in range(2)]
    endpoints = {rank: (f"127.0.0.1:{w.serve('127.0.0.1', 0)}", f"node-{rank}")
                 for rank, w in enumerate(workers)}
    controller.serve("127.0.0.1", 0, targets=lambda: target_groups(
        "demo", 1, endpoints, f"127.0.0.1:{controller.port}"))
    feed_controller(controller)
    for rank, w in enumerate(workers):
        feed(w, rank)
    yield SimpleNamespace(controller=controller, workers=workers, endpoints=endpoints)
    for w in workers:
        w.close()
    controller.close()


@pytest.fixture(scope="module")
def prom(job):
    with EmbeddedPrometheus(sd_urls=[job.controller.server.sd_url], rules=alerts.rules_text()) as server:
        yield server


def test_targets_come_from_http_sd_with_longrun_labels(prom, job):
    up = prom.wait_for('up{job="demo"} == 1', predicate=lambda d: len(d["result"]) == 3)
    labels = sorted((r["metric"]["role"], r["metric"].get("rank", "-"), r["metric"]["instance"])
                    for r in up["result"])
    assert labels == [("controller", "-", f"127.0.0.1:{job.controller.port}"),
                      ("worker", "0", job.endpoints[0][0]), ("worker", "1", job.endpoints[1][0])]
    # honor_labels: the exposed job label is kept as `job` (no exported_job), on every series.
    state = prom.wait_for('longrun_job_state{job="demo"}')
    assert all("exported_job" not in r["metric"] for r in state["result"])
    assert {r["metric"]["longrun_job_state"] for r in state["result"]} >= {"PENDING", "RUNNING", "FAILED"}
    worker = prom.wait_for('longrun_train_step{job="demo"}', predicate=lambda d: len(d["result"]) == 2)
    for r in worker["result"]:
        m = r["metric"]
        assert (m["attempt"], m["role"], m["node"]) == ("1", "worker", f"node-{m['rank']}")


def test_every_query_evaluates_and_every_panel_has_data(prom):
    # rate() and increase() need two samples: wait until every target was scraped three times.
    prom.wait_for('min(count_over_time(up{job="demo"}[1m])) >= 3')
    prom.wait_for('count(count_over_time(longrun_train_memory_bytes{job="demo"}[1m]) >= 3) == 2')
    report = check_queries(prom.query)
    assert report.checked > 40
    assert report.ok, report.describe()


def test_a_broken_query_is_reported_not_raised(prom):
    bad = Query("test", 'sum(rate(longrun_train_tokens_total{job=~"$job"}[$__rate_interval])', True)
    empty = Query("test", 'longrun_no_such_metric{job=~"$job"}', True)
    fine_if_empty = Query("test", 'longrun_no_such_metric{job=~"$job"}', False)
    report = check_queries(prom.query, [bad, empty, fine_if_empty])
    assert [q for q, _ in report.errors] == [bad] and "parse error" in report.errors[0][1]
    assert report.empty == [empty] and not report.ok
    with pytest.raises(PromQLError, match="parse error"):
        prom.query(bad.resolved(DEFAULT_VALUES))


def test_alert_rules_load_and_fire_on_the_real_server(prom, job):
    # Last in the module: it leaves the job FAILED with a stale rank.
    groups = prom.rule_groups()
    assert [r["name"] for g in groups for r in g["rules"]] == [r.name for r in alerts.RULES]
    controller = job.controller
    # rank 1's newest beat is two minutes old, while RUNNING: pending for its `for: 1m`
    controller.heartbeat_age(1, "node-1", 120.0, sent_at=time.time() - 120.0)
    pending = prom.wait_for('ALERTS{alertname="LongrunHeartbeatStale"}')
    assert pending["result"][0]["metric"]["alertstate"] == "pending"
    assert pending["result"][0]["metric"]["rank"] == "1"
    controller.set_state("FAILED")  # `for: 0m`: fires at the next evaluation
    firing = prom.wait_for('ALERTS{alertname="LongrunJobFailed",alertstate="firing"}')
    assert firing["result"][0]["metric"]["job"] == "demo"
    assert all(r["health"] == "ok" for g in prom.rule_groups() for r in g["rules"]), prom.rule_groups()


def test_a_bad_config_is_a_clear_service_error():
    with pytest.raises(ServiceError, match="prometheus exited"):
        EmbeddedPrometheus("scrape_configs: [{job_name: x, honor_labels: maybe}]\n").start()
    with pytest.raises(ValueError, match="either"):
        EmbeddedPrometheus("global: {}\n", targets=["127.0.0.1:1"])
    config = scrape_config(targets=["127.0.0.1:9100"], sd_urls=["http://127.0.0.1:9400/sd"], interval="2s")
    assert "honor_labels: true" in config and "http_sd_configs" in config
