"""The small doors of issue 42 (item 12): `/metrics` against idle and piled-up connections, and
the command line against markup and terminal escape sequences in what it prints."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from longrun.observability import server as server_module
from longrun.observability.server import ObservabilityServer

HOSTILE = "\x1b]0;owned\x07\x1b[2J[/x]"  # retitle the terminal, clear the screen, close a markup tag


def _longrun(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longrun.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=120)


def _scrape(url: str) -> bytes:
    """/metrics, asked again while the server still counts connections just closed as busy."""
    for _ in range(100):
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
                return response.read()
        except (http.client.RemoteDisconnected, ConnectionResetError):
            continue  # turned away: a slot is freed when its handler has seen its client go
    pytest.fail("/metrics turned every request away")


def test_metrics_closes_idle_connections_and_turns_away_a_pile_of_them(monkeypatch):
    registry = CollectorRegistry()
    Counter("longrun_probe_total", "a probe", registry=registry).inc()
    with ObservabilityServer(registry, host="127.0.0.1", port=0) as server:
        # MAX_CONNECTIONS idle connections hold every slot (they send nothing, for up to the
        # request timeout); every connection beyond them is closed at once, holding no thread.
        held = [socket.create_connection(("127.0.0.1", server.port), timeout=5)
                for _ in range(server_module.MAX_CONNECTIONS)]
        for _ in range(8):
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as extra:
                assert extra.recv(1) == b""
        assert server.refused == 8
        for conn in held:
            conn.close()
        assert b"longrun_probe_total 1.0" in _scrape(server.url)

    monkeypatch.setattr(server_module, "REQUEST_TIMEOUT_S", 0.5, raising=False)
    with ObservabilityServer(registry, host="127.0.0.1", port=0) as server, \
            socket.create_connection(("127.0.0.1", server.port), timeout=30) as idle:
        assert idle.recv(1) == b""  # closed by the server: its request never came


def test_markup_and_escape_sequences_in_a_config_are_shown_as_text(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps({"job": {"name": "tiny", HOSTILE: 1}}))  # JSON is YAML
    out = _longrun("config", "validate", path, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "job.\\x1b]0;owned\\x07\\x1b[2J[/x]: unknown key" in out.stderr
    assert "\x1b" not in out.stderr + out.stdout


def test_escape_sequences_in_a_manifest_do_not_reach_the_terminal(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text " * 20)
    out = tmp_path / "out"
    prepared = _longrun("data", "prepare", corpus, "--tokenizer", "byte", "--out", out, "--no-progress",
                        cwd=tmp_path)
    assert prepared.returncode == 0, prepared.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["tokenizer"]["kind"] = HOSTILE  # whoever can write the directory wrote this
    manifest["shards"][0]["bin_sha256"] = HOSTILE + manifest["shards"][0]["bin_sha256"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    shown = _longrun("data", "inspect", out, cwd=tmp_path)
    if shown.returncode != 0:
        pytest.fail(shown.stderr)
    assert "\x1b" not in shown.stdout + shown.stderr
    assert "\\x1b]0;owned\\x07\\x1b[2J[/x]" in shown.stdout
