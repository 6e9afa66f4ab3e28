"""A node's heartbeat agent among hostile neighbours (issue 42, door 2).

Its abstract socket has no permissions: any process on the host can send to it. Real datagrams
from processes the controller did not register (this test process, a process of another user)
and malformed ones from a registered rank must change nothing: the agent keeps hearing and
publishing its real rank for the attempt the controller named, and both its threads live.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from longrun import keys
from longrun.health.node_agent import NodeAgent
from longrun.health.node_beats import decode

INTERVAL_S = 0.2
WAIT_S = 30.0  # bounds a broken run; the tests wait on what they look for


def _rank_process(address: str) -> subprocess.Popen:
    """Rank 0: a real process beating to the agent, a step per beat (its beats say attempt 0)."""
    code = f"""
import time
from longrun.health.heartbeat import AgentLink, HeartbeatPublisher
beat = HeartbeatPublisher(None, "hostile", 0, 0, {INTERVAL_S}, 60.0, link=AgentLink({address!r}, 0)).start()
for step in range(1, 100000):
    beat.update(step=step, phase="forward", loss=2.0, step_time_s={INTERVAL_S})
    time.sleep({INTERVAL_S})
"""
    return subprocess.Popen([sys.executable, "-c", code])


def _record(client, attempt: int):
    raw = client.get(keys.node_beats_key("hostile", attempt, 0))
    return None if raw is None else decode(raw)[2]


def _wait_for(what: str, found):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if value := found():
            return value
        time.sleep(INTERVAL_S / 4)  # the agent publishes to Redis, which offers no event to wait on
    pytest.fail(f"not seen within {WAIT_S} s: {what}")


def _step_of_rank_0(client, attempt: int) -> int:
    rows = _record(client, attempt)
    return int(rows["step"][0]) if rows is not None and len(rows) == 1 and rows["rank"][0] == 0 else 0


def _send(address: str, message) -> None:
    data = message if isinstance(message, bytes) else json.dumps(message).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(data, address)


def _send_as_nobody(agent: NodeAgent, message: dict) -> None:
    """Register a forked child as rank 0's process, then have it send `message` as user nobody:
    the pid is right, the user is not."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            os.close(write)
            os.read(read, 1)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            _send(agent.address, message)
        finally:
            os._exit(0)
    os.close(read)
    agent.expect(7, {0: (child, 0)})
    os.write(write, b"x")
    os.close(write)
    os.waitpid(child, 0)


def test_spoofed_and_malformed_beats_change_nothing(redis_server):
    client = redis_server.client()
    agent = NodeAgent("hostile", "node-h", redis_server.url, INTERVAL_S, timeout_s=60.0)
    rank = _rank_process(agent.address)
    try:
        # The controller names the attempt (7) and rank 0's process; the rank's beats say 0.
        agent.expect(7, {0: (rank.pid, 0)})
        _wait_for("rank 0 published for attempt 7", lambda: _step_of_rank_0(client, 7) >= 2)

        hostile = [
            {"node": 0, "beat": {"rank": 0, "attempt": 10**12, "step": 10**6, "pid": rank.pid}},
            {"node": 0, "beat": {"step": 5}},  # no rank: had ended the receiving thread
            {"node": 0, "beat": {"rank": 0, "pid": "not-a-pid"}},  # had ended the publishing thread
            {"node": 0, "beat": {"rank": 0, "metrics_addr": "evil.example:9100"}},
            b"\xff\x00 not json", b"[" * 100000,
        ]
        for message in hostile:  # from this process: same user, not a registered rank
            _send(agent.address, message)
        if os.getuid() == 0:  # root can be another user: a real other-uid sender
            _send_as_nobody(agent, hostile[0])
            agent.expect(7, {0: (rank.pid, 0)})
        # A process the controller did register (this one, as rank 1) sending nonsense for itself
        # and a beat for someone else's rank.
        agent.expect(7, {0: (rank.pid, 0), 1: (os.getpid(), 0)})
        malformed = [{"beat": {"rank": 1, "step": "many"}}, {"beat": {"rank": 1, "pp_stage": 10**9}},
                     {"beat": {"rank": 1, "loss": [1]}}, {"beat": {"rank": 1, "phase": "x" * 500}},
                     {"beat": {"rank": 0, "step": 10**6}}, {"beat": {"rank": 1, "metrics_addr": "a b:1"}},
                     b"[" * 60000]
        for message in malformed:
            _send(agent.address, message)
        sent = len(hostile) + len(malformed) + (1 if os.getuid() == 0 else 0)
        _wait_for("every hostile datagram refused", lambda: agent.stats()["refused"] >= sent)

        # Both threads live, and the real rank is still heard and published, for attempt 7 only.
        assert agent.ping()["alive"] is True
        step = _step_of_rank_0(client, 7)
        _wait_for("rank 0 still advancing", lambda: _step_of_rank_0(client, 7) > step)
        rows = _record(client, 7)
        assert rows["rank"].tolist() == [0] and int(rows["step"][0]) < 10**6
        assert client.get(keys.node_beats_key("hostile", 10**12, 0)) is None
        roster = json.loads(client.get(keys.node_roster_key("hostile", 7, 0)))
        assert roster["0"]["pid"] == rank.pid and roster["0"]["metrics_addr"] is None
    finally:
        rank.kill()
        rank.wait()
        agent.close()
    assert agent.ping()["alive"] is False  # what the controller asks before reusing an agent


def test_two_runs_of_one_job_name_on_a_host_get_an_agent_each(redis_server):
    first = NodeAgent("samename", "node-s", redis_server.url, INTERVAL_S, timeout_s=60.0)
    try:
        second = NodeAgent("samename", "node-s", redis_server.url, INTERVAL_S, timeout_s=60.0)
        second.close()
        assert first.address != second.address
    finally:
        first.close()
