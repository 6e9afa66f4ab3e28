"""Embedded servers: they start on loopback, demand their password and leave nothing behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest
import redis

from longrun.services import EmbeddedRay, EmbeddedRedis, ServiceError, ports
from longrun.services.process import kill_until_gone, pids_in_session


def _gone(pid: int) -> bool:
    """True when `pid` no longer exists or is a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_ports_are_chosen_outside_the_kernels_ephemeral_range_and_bind(monkeypatch):
    low, _ = ports.ephemeral_range()
    chosen = ports.free_ports(8)
    assert len(set(chosen)) == 8
    assert all(ports.LOWEST <= port < low for port in chosen), (chosen, low)  # not where bind(0) lands
    for port in chosen:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:  # one in use is passed over
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        monkeypatch.setattr(ports, "_candidates", lambda: [taken, chosen[0]])
        assert ports.free_ports(1) == [chosen[0]]
        assert len(ports.free_ports(3)) == 3  # past the candidates: the kernel's choice


def test_redis_answers_with_password_and_refuses_without():
    with EmbeddedRedis() as server:
        assert server.client().ping()
        assert server.client().set("k", "v") and server.client().get("k") == b"v"
        anonymous = redis.Redis(host="127.0.0.1", port=server.port)
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        wrong = redis.Redis(host="127.0.0.1", port=server.port, password="not-the-password")
        with pytest.raises(redis.AuthenticationError):
            wrong.ping()
        # Loopback only and no persistence by default.
        config = server.client().config_get("*")
        assert config["bind"].split() == ["127.0.0.1"]
        assert config["save"] == "" and config["appendonly"] == "no"


def test_redis_stop_leaves_no_process():
    server = EmbeddedRedis().start()
    pid = server.process.pid
    port = server.port
    server.stop()
    assert _gone(pid)
    assert not pids_in_session(pid)
    with pytest.raises(redis.ConnectionError):
        redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1).ping()


def test_kill_until_gone_leaves_nothing_of_a_session_that_keeps_forking():
    """A process that forks while it is being killed leaves a child one pass of SIGKILLs missed."""
    forker = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, sys, time
        for n in range(400):
            if os.fork() == 0:
                time.sleep(120)
                os._exit(0)
            if n == 0:
                print("forking", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert forker.stdout.readline().strip() == "forking"
        assert kill_until_gone(lambda: pids_in_session(forker.pid), timeout_s=60) == []
        assert not pids_in_session(forker.pid)
    finally:
        forker.kill()
        forker.wait()


def test_redis_dies_with_a_sigkilled_parent(tmp_path):
    """No orphans even when longrun itself is killed without a chance to clean up."""
    script = textwrap.dedent("""
        import sys, time
        from longrun.services import EmbeddedRedis
        server = EmbeddedRedis().start()
        print(server.process.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    assert not _gone(child_pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while not _gone(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # waiting for the kernel to deliver the parent-death signal
    assert _gone(child_pid)


def test_redis_missing_binary_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ServiceError, match=r"redis-server was not found.*apt-get install -y redis-server"):
        EmbeddedRedis().start()


def test_redis_start_failure_reports_the_log():
    # A port that is already taken makes redis-server exit at once, with its reason logged.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ServiceError, match=r"exited with code[\s\S]*already in use"):
            EmbeddedRedis(port=taken.getsockname()[1]).start()


def test_redis_port_out_of_range_is_refused():
    with pytest.raises(ValueError, match="between 1 and 65535"):
        EmbeddedRedis(port=70000)


def test_redis_url_needs_a_running_server():
    with pytest.raises(ServiceError, match="not running"):
        _ = EmbeddedRedis().url


def _submission_status(port: int, token: str) -> int | None:
    """The HTTP status of a job submission to 127.0.0.1:`port`; None when nothing listens."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/jobs/", data=b'{"entrypoint": "id"}',
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except urllib.error.URLError:
        return None


@pytest.mark.parametrize("token_file", [False, True], ids=["plain", "with-a-ray-token-in-home"])
def test_ray_head_on_loopback_runs_tasks_and_stops_cleanly(token_file, tmp_path, monkeypatch):
    if token_file:
        # One local `ray.init()` leaves ~/.ray/auth_token; Ray then turns token auth on for every
        # head started after it, and a driver without that token was refused (the head never
        # became ready). The embedded head uses its own token, whatever that file holds.
        (tmp_path / ".ray").mkdir()
        (tmp_path / ".ray" / "auth_token").write_text("a" * 64)
        monkeypatch.setenv("HOME", str(tmp_path))
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with EmbeddedRay(num_cpus=1) as head:
        ray_env = head.client_env  # what `longrun run` sets for its driver
        assert head.address.startswith("127.0.0.1:")
        leader = head.process.pid
        temp_dir = head.temp_dir
        # A separate driver process, as `longrun run` or a submitted job would be.
        code = textwrap.dedent(f"""
            import ray
            ray.init(address={head.address!r}, logging_level="error")
            @ray.remote
            def where():
                import ray
                return ray.util.get_node_ip_address()
            print(ray.get(where.remote()))
        """)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, **ray_env})
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[-1] == "127.0.0.1"
        # Without include_dashboard (`longrun run` without --ray-dashboard) there is no Jobs API:
        # Ray still runs its dashboard process, which accepts no job, even with the head's token.
        assert _submission_status(head.dashboard_port, head.auth_token) in (None, 404)
    assert _gone(leader)
    assert not pids_in_session(leader)
    assert not temp_dir.exists()
