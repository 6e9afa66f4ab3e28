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
    metrics = WorkerMetrics("demo", rank=3, attempt=1, node="node-a")
    port = metrics.serve("127.0.0.1", 0)
    try:
        step = SimpleNamespace(step=5, loss=1.25, grad_norm=0.5, lr=1e-3, tokens=4096, tokens_per_s=2048.0,
                               step_time_s=2.0, data_wait_s=0.01, mfu=None, memory_bytes=2**20)
        metrics.observe_step(step)
        metrics.observe_step(SimpleNamespace(**{**vars(step), "step": 6, "loss": float("nan")}))
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never a proxy
        body = opener.open(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        metrics.close()
    labels = 'attempt="1",job="demo",node="node-a",node_id="node-a",rank="3"'  # node_id: no name given
    assert f"longrun_train_step{{{labels}}} 6.0" in body
    assert f"longrun_train_loss{{{labels}}} 1.25" in body  # NaN is not exported as a loss
    assert f"longrun_train_tokens_total{{{labels}}} 8192.0" in body
    assert f"longrun_train_step_duration_seconds_count{{{labels}}} 2.0" in body
    assert f"longrun_train_memory_bytes{{{labels}}} 1.048576e+06" in body
    assert "longrun_train_mfu_ratio{" not in body


_BLOCKED_WORKER = """
import os, sys, time
import redis, torch, torch.distributed as dist
from longrun.health.heartbeat import HeartbeatPublisher
rank, init, url = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
client = redis.Redis.from_url(url)
if rank == 0:
    beat = HeartbeatPublisher(client, "hb-native", 0, 0, interval_s=0.05, timeout_s=1.0).start()
    beat.update(phase="sync")
    dist.all_reduce(torch.ones(4))  # blocks in gloo (native code) until rank 1 joins
    beat.update(phase="after")
    client.set("hb-native:done", "1")
    time.sleep(3600)  # the test freezes and kills this process
else:
    while not client.exists("hb-native:release"):
        time.sleep(0.01)
    dist.all_reduce(torch.ones(4))
"""


def _wait_for(predicate, what: str, timeout: float = 60.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_heartbeats_flow_during_a_blocking_collective_and_stop_when_frozen(redis_server, redis_client,
                                                                           tmp_path):
    import signal
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", _BLOCKED_WORKER, str(r), str(tmp_path / "init"),
                               redis_server.url]) for r in range(2)]
    try:
        def beat():
            return read_heartbeats(redis_client, "hb-native", 0, range(1))[0]

        first = _wait_for(lambda: (b := beat()) and b.phase == "sync" and b, "rank 0 inside all_reduce")
        # Rank 0 is blocked inside the collective (rank 1 has not joined): beats keep coming.
        later = _wait_for(lambda: (b := beat()) and b.sent_at > first.sent_at + 0.2 and b,
                          "a heartbeat sent while blocked")
        assert later.phase == "sync" and not redis_client.exists("hb-native:done")
        redis_client.set("hb-native:release", "1")
        _wait_for(lambda: redis_client.exists("hb-native:done"), "the collective to finish")
        # A frozen process (SIGSTOP) stops refreshing; its key expires within the timeout.
        procs[0].send_signal(signal.SIGSTOP)
        _wait_for(lambda: beat() is None, "the frozen worker's heartbeat to expire", timeout=10)
    finally:
        for p in procs:
            p.kill()
            p.wait()
