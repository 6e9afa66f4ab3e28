from __future__ import annotations

import urllib.request
from types import SimpleNamespace

import pytest

from longrun import keys
from longrun.health.heartbeat import HeartbeatPublisher, read_heartbeats
from longrun.observability.metrics import WorkerMetrics


def test_heartbeat_publishes_with_expiry_and_final_phase(redis_client):
    beat = HeartbeatPublisher(redis_client, "hb", attempt=2, rank=1, interval_s=60, timeout_s=5).start()
    beats = read_heartbeats(redis_client, "hb", 2, range(3))
    assert beats[0] is None and beats[2] is None
    assert beats[1].rank == 1 and beats[1].phase == "starting"
    # The key expires by itself when the worker stops refreshing it.
    ttl_ms = redis_client.pttl(keys.heartbeat_key("hb", 2, 1))
    assert 0 < ttl_ms <= 5000
    beat.update(step=7, phase="train", loss=2.5)
    beat.stop(final_phase="done")
    latest = read_heartbeats(redis_client, "hb", 2, range(2))[1]
    assert (latest.step, latest.phase, latest.loss) == (7, "done", 2.5)
    # Another attempt's keys are separate.
    assert read_heartbeats(redis_client, "hb", 3, range(2))[1] is None


def test_keys_are_namespaced_and_checked():
    assert keys.heartbeat_key("j", 0, 3).startswith(keys.attempt_prefix("j", 0))
    assert keys.store_prefix("j", 1) != keys.store_prefix("j", 2)
    assert keys.job_record_key("j").startswith(keys.job_prefix("j"))
    with pytest.raises(ValueError, match="job name"):
        keys.job_prefix("bad name:*")
    with pytest.raises(ValueError, match="attempt"):
        keys.attempt_prefix("j", -1)


def test_worker_metrics_are_served_on_loopback():
    metrics = WorkerMetrics("demo", rank=3)
    port = metrics.serve("127.0.0.1", 0)
    try:
        step = SimpleNamespace(step=5, loss=1.25, grad_norm=0.5, lr=1e-3, tokens=4096, tokens_per_s=2048.0,
                               step_time_s=2.0, data_wait_s=0.01, mfu=None)
        metrics.observe_step(step)
        metrics.observe_step(SimpleNamespace(**{**vars(step), "step": 6, "loss": float("nan")}))
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        metrics.close()
    assert 'longrun_train_step{job="demo",rank="3"} 6.0' in body
    assert 'longrun_train_loss{job="demo",rank="3"} 1.25' in body  # NaN is not exported as a loss
    assert 'longrun_train_tokens_total{job="demo",rank="3"} 8192.0' in body
    assert 'longrun_train_step_duration_seconds_count{job="demo",rank="3"} 2.0' in body
    assert "longrun_train_mfu_ratio{" not in body
