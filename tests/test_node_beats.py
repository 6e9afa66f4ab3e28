"""Per-node heartbeats: the record's format, and a real agent hearing real rank processes.

A rank's death on a node whose other ranks live is declared as that rank's (the agent saw its
process exit), and an agent's death as its node's (its record expired).
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from longrun import keys
from longrun.config.sections import HealthSection
from longrun.health.beat_columns import BeatColumns, phase_code
from longrun.health.heartbeat import Heartbeat
from longrun.health.monitor import HealthMonitor
from longrun.health.node_agent import NodeAgent, NodeBeats
from longrun.health.node_beats import NodeBeatReader, columns_of, decode, encode, rows_of
from longrun.kinds import FaultKind

INTERVAL_S = 0.2
WAIT_S = 30.0  # generous: the tests wait on what they look for, this only bounds a broken run


def test_a_record_round_trips_into_the_columns_the_monitor_judges():
    beats = [Heartbeat(rank=9, step=41, phase="backward", loss=2.5, step_time_s=1.25, pp_stage=1,
                       work_cost=3.0, sent_at=100.5),
             Heartbeat(rank=8, step=40, phase="checkpoint", loss=None, loss_finite=False, resumed_from=30)]
    node, sent_at, rows = decode(encode(1, 7.0, rows_of([vars(b) for b in beats])))
    assert (node, sent_at, len(rows)) == (1, 7.0, 2)
    cols = columns_of(rows, world_size=16)
    expected = BeatColumns.from_beats({b.rank: b for b in beats}, 16)
    for name in ("present", "step", "phase", "loss_finite", "resumed_from", "pp_stage", "sent_at"):
        assert np.array_equal(getattr(cols, name), getattr(expected, name)), name
    for name in ("loss", "step_time_s", "work_cost"):
        assert np.allclose(getattr(cols, name), getattr(expected, name), equal_nan=True), name
    assert cols.beat(9).phase == "backward" and cols.beat(8).loss is None and not cols.present[0]


def test_a_truncated_record_is_refused():
    raw = encode(0, 1.0, rows_of([{"rank": 0, "step": 1}]))
    with pytest.raises(ValueError, match="rows it announces"):
        decode(raw[:-3])
    with pytest.raises(ValueError, match="magic"):
        decode(b"nope" + raw[4:])


def test_the_agent_leaves_out_an_exited_process_and_a_rank_not_heard_within_the_timeout():
    node = NodeBeats(node=0, timeout_s=5.0)
    node.heard({"rank": 0, "step": 3, "pid": 100}, at=10.0)
    node.heard({"rank": 1, "step": 3, "pid": 101}, at=10.0)
    node.heard({"rank": 2, "step": 3, "pid": 102}, at=2.0)  # heard last 8 s before the record
    assert node.check(lambda pid: pid != 101) is True
    assert node.check(lambda pid: pid != 101) is False  # news once
    node.heard({"rank": 1, "step": 4, "pid": 101}, at=10.5)  # a datagram in flight when it died
    assert decode(node.record(now=10.0, wall=0.0))[2]["rank"].tolist() == [0]


def _rank_process(job: str, address: str, rank: int) -> subprocess.Popen:
    """A rank: a real process beating to its node's agent, advancing a step per beat."""
    code = f"""
import time
from longrun.health.heartbeat import AgentLink, HeartbeatPublisher
beat = HeartbeatPublisher(None, {job!r}, 0, {rank}, {INTERVAL_S}, 60.0,
                          link=AgentLink({address!r}, 0)).start()
for step in range(1, 100000):
    beat.update(step=step, phase="forward", loss=2.0, step_time_s={INTERVAL_S})
    time.sleep({INTERVAL_S})
"""
    return subprocess.Popen([sys.executable, "-c", code])


def _judge_until(reader: NodeBeatReader, monitor: HealthMonitor, done, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        beats = reader.read()
        found = done(beats, monitor.observe(beats.columns, time.monotonic()))
        if found:
            return found
        time.sleep(INTERVAL_S)  # the controller's poll interval, not a synchronisation
    pytest.fail(f"not seen within {WAIT_S} s: {what}")


def test_a_ranks_death_is_seen_by_its_node_and_its_neighbour_lives_on(redis_server):
    # A heartbeat timeout of 60 s: a death found within the test's wait was seen by the agent
    # watching the process, not by a beat going stale.
    job, node_id = "agentjob", "node-a"
    agent = NodeAgent(job, node_id, redis_server.url, INTERVAL_S, timeout_s=60.0)
    ranks = [_rank_process(job, agent.address, r) for r in range(2)]
    agent.expect(0, {r: (p.pid, 0) for r, p in enumerate(ranks)})  # what the controller registers
    try:
        reader = NodeBeatReader(redis_server.client(), job, 0, world_size=2, workers_per_node=2)
        monitor = HealthMonitor(2, HealthSection(heartbeat_interval_s=INTERVAL_S, heartbeat_timeout_s=60.0),
                                started_at=time.monotonic())
        _judge_until(reader, monitor, lambda beats, _: beats.columns.present.all()
                     and (beats.columns.step >= 2).all(), "both ranks beating")
        ranks[1].send_signal(signal.SIGKILL)
        ranks[1].wait()
        faults = _judge_until(reader, monitor, lambda _, faults: faults, "rank 1's death")
        assert [(f.kind, f.rank) for f in faults] == [(FaultKind.DEAD, 1)]
        alive = reader.read()
        assert alive.columns.present.tolist() == [True, False] and alive.lost_nodes == []
        assert alive.live()[0].pid == ranks[0].pid  # the roster: what the controller's listeners need
    finally:
        for p in ranks:
            p.kill()
            p.wait()
        agent.close()


def test_an_ended_attempt_is_not_published_again_once_its_keys_are_gone(redis_server):
    job, node_id = "agentjob3", "node-c"
    agent = NodeAgent(job, node_id, redis_server.url, INTERVAL_S, timeout_s=60.0)
    rank = _rank_process(job, agent.address, 0)
    agent.expect(0, {0: (rank.pid, 0)})
    client = redis_server.client()
    key = keys.node_beats_key(job, 0, 0)
    try:
        deadline = time.monotonic() + WAIT_S
        while client.get(key) is None and time.monotonic() < deadline:
            time.sleep(INTERVAL_S / 4)  # until the agent published the rank (Redis offers no event)
        assert client.get(key) is not None
        agent.forget(0)  # what the controller does when the attempt's group stopped
        client.delete(key, keys.node_roster_key(job, 0, 0))
        rounds = agent.rounds
        while agent.rounds < rounds + 3 and time.monotonic() < deadline:
            time.sleep(INTERVAL_S / 4)
        assert agent.rounds >= rounds + 3  # three publishing rounds later, with the rank still beating
        assert client.get(key) is None
    finally:
        rank.kill()
        rank.wait()
        agent.close()


def test_an_agents_death_reads_as_its_nodes_once(redis_server):
    job, node_id = "agentjob2", "node-b"
    # The agent in a process of its own (to SIGKILL): it says its address, is told its rank's pid.
    agent = subprocess.Popen([sys.executable, "-c", f"""
import sys, threading
from longrun.health.node_agent import NodeAgent
agent = NodeAgent({job!r}, {node_id!r}, {redis_server.url!r}, {INTERVAL_S}, timeout_s=1.0)
print(repr(agent.address), flush=True)
agent.expect(0, {{0: (int(sys.stdin.readline()), 0)}})
threading.Event().wait()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    address = ast.literal_eval(agent.stdout.readline())
    rank = _rank_process(job, address, 0)
    agent.stdin.write(f"{rank.pid}\n")
    agent.stdin.flush()
    try:
        reader = NodeBeatReader(redis_server.client(), job, 0, world_size=1, workers_per_node=1)
        monitor = HealthMonitor(1, HealthSection(heartbeat_interval_s=INTERVAL_S, heartbeat_timeout_s=1.0),
                                started_at=time.monotonic())
        _judge_until(reader, monitor, lambda beats, _: beats.columns.present.all(), "the rank beating")
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        lost = _judge_until(reader, monitor, lambda beats, _: beats.lost_nodes, "the node lost")
        assert lost == [0]
        assert reader.read().lost_nodes == []  # named once
        assert address.startswith("\0")  # abstract: nothing left on disk
    finally:
        rank.kill()
        rank.wait()
        if agent.poll() is None:
            agent.kill()


def test_phase_codes_are_shared_and_an_unknown_phase_gets_its_own():
    assert phase_code("forward") == phase_code("forward") != phase_code("backward")
    assert phase_code("a-phase-from-a-newer-worker") == phase_code("a-phase-from-a-newer-worker")
