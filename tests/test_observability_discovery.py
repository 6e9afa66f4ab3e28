"""The observability HTTP server (/metrics, /sd) and the http_sd / file_sd target groups."""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from longrun.observability import discovery
from longrun.observability.discovery import target_groups, validate_groups, write_file_sd
from longrun.observability.metrics import ControllerMetrics
from longrun.observability.server import ObservabilityServer

# Loopback only: never let an http_proxy in the environment carry a test request elsewhere.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def get(url: str, accept: str | None = None):
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with OPENER.open(request, timeout=5) as response:
        return response.status, response.headers["Content-Type"], response.read().decode()


def groups_for_two_ranks() -> list[dict]:
    return target_groups("demo", 3, {1: ("127.0.0.1:9102", "node-b"), 0: ("127.0.0.1:9101", "node-a")},
                         "127.0.0.1:9400")


def test_target_groups_label_workers_and_the_controller():
    groups = groups_for_two_ranks()
    assert groups == [
        {"targets": ["127.0.0.1:9101"],
         "labels": {"job": "demo", "attempt": "3", "rank": "0", "node": "node-a", "role": "worker"}},
        {"targets": ["127.0.0.1:9102"],
         "labels": {"job": "demo", "attempt": "3", "rank": "1", "node": "node-b", "role": "worker"}},
        {"targets": ["127.0.0.1:9400"], "labels": {"job": "demo", "role": "controller"}},
    ]
    assert target_groups("demo", 0, {}, None) == []
    # With the nodes' names: `node` as a person reads it, `node_id` as Ray knows it.
    named = target_groups("demo", 3, {0: ("127.0.0.1:9101", "node-a")}, None,
                          names={"node-a": "gpu-a (10.0.0.1)"})
    assert named[0]["labels"] == {"job": "demo", "attempt": "3", "rank": "0", "node": "gpu-a (10.0.0.1)",
                                  "node_id": "node-a", "role": "worker"}


@pytest.mark.parametrize("endpoint", ["127.0.0.1", "host:port", ":9100", "h:0", "h:70000"])
def test_target_groups_refuse_bad_endpoints(endpoint):
    with pytest.raises(ValueError, match="host:port"):
        target_groups("demo", 0, {0: (endpoint, "n")})


@pytest.mark.parametrize("groups", [
    {"targets": ["a:1"]},  # not a list
    [{"targets": "a:1"}],
    [{"labels": {"job": "x"}}],
    [{"targets": ["a:1"], "labels": {"bad-name": "x"}}],
    [{"targets": ["a:1"], "labels": {"__reserved": "x"}}],
    [{"targets": ["a:1"], "labels": {"rank": 0}}],  # values must be strings
    [{"targets": ["a:1"], "extra": 1}],
])
def test_validate_groups_refuses_what_prometheus_would(groups):
    with pytest.raises(ValueError):
        validate_groups(groups)


def test_server_serves_metrics_and_sd_on_loopback():
    metrics = ControllerMetrics("demo")
    metrics.set_state("RUNNING")
    port = metrics.serve("127.0.0.1", 0, targets=groups_for_two_ranks)
    try:
        server = metrics.server
        assert server.url == f"http://127.0.0.1:{port}" and server.sd_url.endswith("/sd")
        status, ctype, body = get(f"{server.url}/metrics")
        assert status == 200 and ctype.startswith("text/plain")
        samples = {(s.name, s.labels.get("longrun_job_state")): s.value
                   for f in text_string_to_metric_families(body) for s in f.samples}
        assert samples[("longrun_job_state", "RUNNING")] == 1
        # Prometheus asks for OpenMetrics first; the server honours the Accept header.
        _, ctype, body = get(f"{server.url}/metrics", accept="application/openmetrics-text;version=1.0.0")
        assert ctype.startswith("application/openmetrics-text") and body.rstrip().endswith("# EOF")
        status, ctype, body = get(server.sd_url)
        # Prometheus' http_sd accepts exactly this content type.
        assert status == 200 and ctype == "application/json"
        assert validate_groups(json.loads(body)) == groups_for_two_ranks()
        with pytest.raises(urllib.error.HTTPError) as missing:
            get(f"{server.url}/nothing")
        assert missing.value.code == 404
    finally:
        metrics.close()
    with pytest.raises(urllib.error.URLError):
        get(f"http://127.0.0.1:{port}/metrics")  # closed means closed


def test_sd_is_absent_without_targets_and_a_failing_callback_is_a_500():
    from prometheus_client import CollectorRegistry

    with ObservabilityServer(CollectorRegistry()) as plain:
        assert plain.host == "127.0.0.1"
        with pytest.raises(urllib.error.HTTPError) as absent:
            get(plain.sd_url)
        assert absent.value.code == 404

    def broken():
        raise RuntimeError("placement not known yet")

    with ObservabilityServer(CollectorRegistry(), targets=broken) as server:
        with pytest.raises(urllib.error.HTTPError) as failed:
            get(server.sd_url)
        assert failed.value.code == 500 and b"placement not known yet" in failed.value.read()
        assert get(f"{server.url}/metrics")[0] == 200  # the server survives


def test_sd_reflects_the_callback_at_each_request():
    from prometheus_client import CollectorRegistry

    current = {"groups": []}
    with ObservabilityServer(CollectorRegistry(), targets=lambda: current["groups"]) as server:
        assert json.loads(get(server.sd_url)[2]) == []
        current["groups"] = groups_for_two_ranks()
        assert len(json.loads(get(server.sd_url)[2])) == 3


def test_write_file_sd_writes_valid_json_atomically(tmp_path):
    path = tmp_path / "sd" / "demo.json"
    write_file_sd(path, groups_for_two_ranks())
    assert json.loads(path.read_text()) == groups_for_two_ranks()
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)
    # A reader polling the file while it is rewritten never sees a partial file.
    big = [{"targets": [f"10.0.{i // 250}.{i % 250}:9100"], "labels": {"job": "demo", "rank": str(i)}}
           for i in range(2000)]
    stop, seen, problems = threading.Event(), [], []

    def reader():
        while not stop.is_set():
            try:
                seen.append(len(json.loads(path.read_text())))
            except ValueError as exc:
                problems.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(30):
            write_file_sd(path, big if i % 2 else groups_for_two_ranks())
    finally:
        stop.set()
        thread.join()
    assert not problems and set(seen) <= {3, 2000}
    assert sorted(os.listdir(path.parent)) == ["demo.json"]  # no temp file left behind


def test_write_file_sd_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "demo.json"
    write_file_sd(path, groups_for_two_ranks())

    def refuse(*args):
        raise OSError("disk full")

    monkeypatch.setattr(discovery.os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        write_file_sd(path, [])
    assert json.loads(path.read_text()) == groups_for_two_ranks()
    assert os.listdir(tmp_path) == ["demo.json"]
    with pytest.raises(ValueError):  # invalid groups are refused before anything is written
        write_file_sd(path, [{"targets": ["a:1"], "labels": {"bad-name": "x"}}])
