"""The controller's elastic continuation, one step at a time, against fake worker groups.

No Ray: the launcher knows how many nodes the "cluster" has (`available`) and refuses, as
placement.py does, a config that needs more; groups are sized by the config they were placed
with. The clock is fake (polls and the controller's sleeps advance it), the heartbeats and the
job record are real keys in a real Redis.
"""

from __future__ import annotations

import pytest
from controller_fakes import Clock
from prometheus_client import generate_latest

from longrun import keys
from longrun.config import config_from_dict
from longrun.controller.controller import Controller, JobFailed, job_status
from longrun.controller.placement import PlacementImpossible, PlacementTimeout
from longrun.controller.state import JobState
from longrun.controller.workers import RankEnded
from longrun.health.decisions import Action
from longrun.health.heartbeat import HeartbeatPublisher

NODES = ("node-a", "node-b", "node-c", "node-d")


def job(name: str, tmp_path, nodes: int = 3, per_node: int = 2, **recovery):
    return config_from_dict({
        "job": {"name": name, "output_dir": str(tmp_path)},
        "cluster": {"nodes": nodes, "workers_per_node": per_node, "device": "cpu"},
        "parallelism": {"dp": nodes, "fsdp": per_node},
        "data": {"source": "synthetic", "micro_batch_tokens": 256},
        "training": {"steps": 10, "grad_accum": 2},
        "health": {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 5.0, "hang_timeout_s": 30,
                   "hang_min_s": 10},
        "recovery": {"restart_backoff_s": 0.0, "diagnostics": [], "shrink_after_s": 30.0} | recovery,
    })


class Group:
    """One attempt's ranks on the first `cfg.cluster.nodes` live nodes; polls run a script."""

    def __init__(self, cfg, nodes, clock: Clock):
        self.cfg, self.clock = cfg, clock
        self.node_ids = tuple(nodes[:cfg.cluster.nodes])
        self.node_names: dict[str, str] = {}
        self.pids: dict[int, int] = {}
        self.world = cfg.world_size
        self.script: list[list[RankEnded]] = []
        self.pending = set(range(self.world))
        self.started = self.stopped = False

    def node_of(self, rank: int) -> str:
        return self.node_ids[rank // self.cfg.cluster.workers_per_node]

    def diagnose(self, timeout_s):
        return []

    def start(self):
        self.started = True

    def running(self):
        return len(self.pending)

    def poll(self, timeout_s):
        self.clock.t += timeout_s
        ended = self.script.pop(0) if self.script else []
        self.pending -= {e.rank for e in ended}
        return ended

    def draining(self):
        return {}

    def stop(self):
        self.stopped = True


class ElasticLauncher:
    """Places a config on the live nodes (never evicted ones), or refuses as placement does: too
    few nodes is PlacementImpossible; enough nodes of which some are `busy` (alive, another job
    holds their resources) is PlacementTimeout once `timeout_s` has passed on the fake clock."""

    def __init__(self, clock: Clock):
        self.clock, self.nodes = clock, list(NODES[:3])
        self.busy: set[str] = set()
        self.placed: list = []  # the config of every successful placement
        self.groups: list[Group] = []
        self.tries = 0

    def live(self, evicted):
        return [n for n in self.nodes if n not in set(evicted)]

    def free(self, evicted):
        return [n for n in self.live(evicted) if n not in self.busy]

    def __call__(self, cfg, *, attempt, redis_url, evicted, resume_before_step, timeout_s, skip_steps=(),
                 cancelled=None):
        self.tries += 1
        live, free = self.live(evicted), self.free(evicted)
        if len(live) < cfg.cluster.nodes:
            raise PlacementImpossible(f"the job needs {cfg.cluster.nodes} node(s); the cluster has "
                                      f"{len(live)}", available=len(free), existing=len(live))
        if len(free) < cfg.cluster.nodes:
            self.clock.t += timeout_s  # Ray's placement group waited for the busy nodes
            raise PlacementTimeout(f"{cfg.world_size} worker(s) could not be reserved within "
                                   f"{timeout_s:g} s: their resources are in use",
                                   available=len(free), existing=len(live))
        group = Group(cfg, free, self.clock)
        self.placed.append(cfg)
        self.groups.append(group)
        return group

    def spare_nodes(self, cfg, evicted):
        # As RayLauncher: free nodes beyond the job's own (a busy node is no spare).
        return max(0, len(self.free(evicted)) - cfg.cluster.nodes)

    def warm_spares(self):
        pass

    def release(self):
        pass


@pytest.fixture
def rig(redis_server, redis_client):
    clock = Clock()
    launcher = ElasticLauncher(clock)

    def make(cfg):
        def sleep(seconds):
            clock.t += seconds  # the controller's waits pass on the fake clock

        return Controller(cfg, redis_server.url, launch=launcher, clock=clock, sleep=sleep,
                          serve_metrics=False)

    return make, launcher, clock


def beat_all(redis_client, c: Controller, step: int) -> None:
    """Every rank of the live attempt publishes a heartbeat at `step`."""
    for rank in range(c.attempt.world_size):
        pub = HeartbeatPublisher(redis_client, c.cfg.job.name, c.attempt.number, rank, interval_s=1.0,
                                 timeout_s=60.0)
        pub.update(step=step, phase="forward", loss=2.0)
        pub.publish_now()


def finished(rank: int, step: int, preempted: bool = False) -> RankEnded:
    return RankEnded(rank, summary={"rank": rank, "step": step, "loss": 2.0, "resumed_from": 0,
                                    "preempted": preempted})


def to_running(c: Controller) -> None:
    while c.machine.state is not JobState.RUNNING:
        assert not c.step().terminal, c.failure


def lose_node(c: Controller, launcher: ElasticLauncher, redis_client, node: str = "node-c") -> None:
    """`node` leaves the cluster while the job runs: its rank is reported lost."""
    beat_all(redis_client, c, 4)
    assert c.step() is JobState.RUNNING
    launcher.nodes.remove(node)
    rank = next(r for r in range(c.attempt.world_size) if c.group.node_of(r) == node)
    c.group.script.append([RankEnded(rank, kind="node_lost", detail=f"Ray reports node {node} dead")])
    assert c.step() is JobState.RECOVERING


def metric(c: Controller, line: str) -> float:
    text = generate_latest(c.metrics.registry).decode()
    found = [x for x in text.splitlines() if x.startswith(line + " ")]
    assert found, f"{line} not exported"
    return float(found[0].split()[-1])


def test_a_lost_node_without_a_spare_continues_on_the_rest_after_shrink_after_s(rig, redis_client, tmp_path):
    make, launcher, clock = rig
    cfg = job("el-shrink", tmp_path, min_nodes=2)
    c = make(cfg)
    to_running(c)
    lose_node(c, launcher, redis_client)
    assert c.step() is JobState.PLACING
    waited_from = clock.t
    while c.step() is JobState.PLACING:  # short of a node: waiting, the full size tried every second
        assert clock.t - waited_from <= cfg.recovery.shrink_after_s + 1
    assert c.machine.state is JobState.RENDEZVOUS
    assert clock.t - waited_from >= cfg.recovery.shrink_after_s
    smaller = launcher.placed[-1]
    assert (smaller.cluster.nodes, smaller.world_size) == (2, 4)
    assert (smaller.parallelism.dp, smaller.parallelism.fsdp) == (2, 2)  # dp first: the shards stay
    assert smaller.training.global_batch_tokens == cfg.global_batch_tokens == 256 * 2 * 6
    assert c.layout is smaller
    events = job_status(redis_client, cfg.job.name, events=100)["events"]
    assert [e["type"] for e in events if e["type"] in ("waiting_for_nodes", "resized")] == [
        "waiting_for_nodes", "resized"]
    resized = next(e for e in events if e["type"] == "resized")
    assert (resized["direction"], resized["nodes"], resized["world_size"], resized["from_nodes"]) == (
        "shrink", 2, 4, 3)
    assert "3 -> 2 node(s), 6 -> 4 rank(s)" in resized["reason"] and "global batch 3072 tokens kept" in \
        resized["reason"]
    status = job_status(redis_client, cfg.job.name)
    assert status["fields"]["size"] == "2 of 3 node(s), 4 rank(s)" and status["restarts"] == 1
    # The smaller attempt is watched as 4 ranks and finishes.
    assert c.step() is JobState.RUNNING and c.attempt.world_size == 4
    beat_all(redis_client, c, 6)
    assert c.step() is JobState.RUNNING
    c.group.script.append([finished(r, 10) for r in range(4)])
    assert c.step() is JobState.SUCCEEDED
    assert c.summary["nodes"] == 2 and c.summary["restarts"] == 1
    assert metric(c, 'longrun_elastic_resizes_total{direction="shrink",job="el-shrink"}') == 1
    assert metric(c, 'longrun_job_nodes{job="el-shrink"}') == 2
    assert metric(c, 'longrun_job_world_size{job="el-shrink"}') == 4


def test_min_nodes_equal_to_the_job_waits_for_its_nodes_then_fails(rig, redis_client, tmp_path):
    make, launcher, clock = rig
    cfg = job("el-full", tmp_path, min_nodes=3)
    c = make(cfg)
    to_running(c)
    lose_node(c, launcher, redis_client)
    assert c.step() is JobState.PLACING
    start, tries = clock.t, launcher.tries
    while c.step() is JobState.PLACING:
        pass
    assert c.machine.state is JobState.FAILED and clock.t - start >= cfg.recovery.shrink_after_s
    assert launcher.tries - tries >= 30 and all(p.cluster.nodes == 3 for p in launcher.placed)
    assert "fewer than recovery.min_nodes (3)" in c.failure and "the cluster has 2" in c.failure


def test_min_nodes_equal_to_the_job_resumes_in_full_when_the_node_comes_back_in_time(rig, redis_client,
                                                                                    tmp_path):
    make, launcher, _ = rig
    c = make(job("el-back", tmp_path, min_nodes=3))
    to_running(c)
    lose_node(c, launcher, redis_client)
    for _ in range(5):
        assert c.step() is JobState.PLACING
    launcher.nodes.append("node-d")  # a replacement joins within shrink_after_s
    assert c.step() is JobState.RENDEZVOUS and launcher.placed[-1].cluster.nodes == 3
    events = job_status(redis_client, "el-back", events=100)["events"]
    assert not [e for e in events if e["type"] == "resized"]


def test_a_job_that_is_not_elastic_fails_at_once_when_told_not_to_wait(rig, redis_client, tmp_path):
    make, launcher, _ = rig
    c = make(job("el-rigid", tmp_path, node_wait_s=0.0))
    to_running(c)
    lose_node(c, launcher, redis_client)
    with pytest.raises(JobFailed, match=r"the cluster has 2$"):
        c.run()
    assert len(launcher.placed) == 1


def test_a_job_that_is_not_elastic_waits_node_wait_s_for_a_replacement_then_fails(rig, redis_client,
                                                                                  tmp_path):
    make, launcher, clock = rig
    cfg = job("el-rigid-wait", tmp_path)
    c = make(cfg)
    to_running(c)
    lose_node(c, launcher, redis_client)
    start = clock.t
    with pytest.raises(JobFailed, match=r"the cluster has 2; no node joined .* within "
                                        r"recovery\.node_wait_s \(600 s\)$"):
        c.run()
    assert clock.t - start >= cfg.recovery.node_wait_s and len(launcher.placed) == 1
    assert job_status(redis_client, cfg.job.name)["restarts"] == 1  # the wait spent no budget


def test_capacity_back_grows_the_job_at_the_next_checkpoint(rig, redis_client, tmp_path):
    make, launcher, _ = rig
    cfg = job("el-grow", tmp_path, min_nodes=2, shrink_after_s=0.0)
    c = make(cfg)
    to_running(c)
    lose_node(c, launcher, redis_client)
    to_running(c)  # shrink_after_s = 0: straight on at 2 nodes
    shrunk = c.attempt.number
    assert c.layout.cluster.nodes == 2
    beat_all(redis_client, c, 5)
    assert c.step() is JobState.RUNNING
    assert redis_client.get(keys.preempt_key(cfg.job.name, shrunk)) is None  # nothing to grow into
    launcher.nodes.append("node-d")  # capacity is back
    beat_all(redis_client, c, 6)
    assert c.step() is JobState.RUNNING
    # The workers are asked to save at the next agreed step boundary (the preemption mechanism).
    assert redis_client.get(keys.preempt_key(cfg.job.name, shrunk)) == b"now"
    assert c.attempt.grow is not None and c.attempt.grow.nodes == 3
    beat_all(redis_client, c, 6)
    assert c.step() is JobState.RUNNING  # asked once
    c.group.script.append([finished(r, 7, preempted=True) for r in range(4)])
    assert c.step() is JobState.RECOVERING
    move = c.machine.history[-1]
    assert move.decision.action is Action.RESIZE and "step 7 is committed" in move.reason
    assert c.step() is JobState.PLACING
    assert c.step() is JobState.RENDEZVOUS
    assert launcher.placed[-1] is cfg and c.layout is cfg
    events = job_status(redis_client, cfg.job.name, events=100)["events"]
    kinds = [e["type"] for e in events if e["type"] in ("resized", "grow_requested")]
    assert kinds == ["resized", "grow_requested", "resized"]
    grow = [e for e in events if e["type"] == "resized"][-1]
    assert (grow["direction"], grow["nodes"], grow["world_size"]) == ("grow", 3, 6)
    assert "step 7 is committed" in grow["reason"]
    to_running(c)
    beat_all(redis_client, c, 8)
    c.group.script.append([finished(r, 10) for r in range(6)])
    assert c.step() is JobState.SUCCEEDED and c.summary["nodes"] == 3
    assert c.summary["restarts"] == 1  # the lost node; growing spends no restart budget
    assert metric(c, 'longrun_elastic_resizes_total{direction="shrink",job="el-grow"}') == 1
    assert metric(c, 'longrun_elastic_resizes_total{direction="grow",job="el-grow"}') == 1
    assert metric(c, 'longrun_job_restarts_total{cause="node_lost",job="el-grow"}') == 1
    assert metric(c, 'longrun_job_nodes{job="el-grow"}') == 3


def test_a_grow_asked_after_the_last_step_finishes_the_job(rig, redis_client, tmp_path):
    make, launcher, _ = rig
    c = make(job("el-late", tmp_path, min_nodes=2, shrink_after_s=0.0))
    to_running(c)
    lose_node(c, launcher, redis_client)
    to_running(c)
    launcher.nodes.append("node-d")
    beat_all(redis_client, c, 9)
    assert c.step() is JobState.RUNNING and c.attempt.grow is not None
    c.group.script.append([finished(r, 10) for r in range(4)])  # they finished before reading it
    assert c.step() is JobState.SUCCEEDED and c.summary["nodes"] == 2


def test_a_restart_while_shrunk_tries_the_full_size_first_and_shrinks_again_without_waiting(
        rig, redis_client, tmp_path):
    make, launcher, _ = rig
    c = make(job("el-again", tmp_path, min_nodes=2))
    to_running(c)
    lose_node(c, launcher, redis_client)
    to_running(c)
    tries = launcher.tries
    beat_all(redis_client, c, 5)
    c.group.script.append([RankEnded(1, kind="dead", detail="rank 1's process died")])
    assert c.step() is JobState.RECOVERING
    assert c.step() is JobState.PLACING
    assert c.step() is JobState.RENDEZVOUS  # the full size refused, 2 nodes at once
    assert launcher.tries - tries == 2 and launcher.placed[-1].cluster.nodes == 2
    # The same layout as the attempt before: no resize to record.
    events = job_status(redis_client, "el-again", events=100)["events"]
    assert [e["direction"] for e in events if e["type"] == "resized"] == ["shrink"]


# -- busy is not gone (issue 26, hole 1): a node that is alive but whose resources another job
# holds is waited for or worked around, and never spends the restart budget.

def test_a_grow_whose_node_turns_busy_before_placing_keeps_training_on_fewer(rig, redis_client, tmp_path):
    make, launcher, _ = rig
    cfg = job("el-busy-grow", tmp_path, min_nodes=2, shrink_after_s=0.0, max_restarts=1)
    c = make(cfg)
    to_running(c)
    lose_node(c, launcher, redis_client)  # restart 1 of 1: the budget is spent
    to_running(c)
    launcher.nodes.append("node-d")  # free: the grow is asked for
    beat_all(redis_client, c, 6)
    assert c.step() is JobState.RUNNING and c.attempt.grow is not None
    c.group.script.append([finished(r, 7, preempted=True) for r in range(4)])
    assert c.step() is JobState.RECOVERING
    launcher.busy.add("node-d")  # another job takes it before the placement does
    assert c.step() is JobState.PLACING
    assert c.step() is JobState.RENDEZVOUS  # the full size timed out: straight on at 2 nodes
    assert launcher.placed[-1].cluster.nodes == 2 and c.layout.cluster.nodes == 2
    to_running(c)
    beat_all(redis_client, c, 8)
    assert c.step() is JobState.RUNNING and c.attempt.grow is None  # busy: no grow asked again
    c.group.script.append([finished(r, 10) for r in range(4)])
    assert c.step() is JobState.SUCCEEDED and c.summary["nodes"] == 2
    assert c.summary["restarts"] == 1  # the lost node only: waiting on a busy node spends nothing
    events = job_status(redis_client, cfg.job.name, events=100)["events"]
    assert [e["attempt"] for e in events if e["type"] == "fault"] == [0]  # the lost node only
    assert [e["direction"] for e in events if e["type"] == "resized"] == ["shrink"]


def test_a_restart_while_shrunk_with_the_node_back_but_busy_continues_on_fewer(rig, redis_client, tmp_path):
    make, launcher, _ = rig
    cfg = job("el-busy-restart", tmp_path, min_nodes=2, max_restarts=2)
    c = make(cfg)
    to_running(c)
    lose_node(c, launcher, redis_client)
    to_running(c)
    launcher.nodes.append("node-d")
    launcher.busy.add("node-d")  # back, but another job holds it
    beat_all(redis_client, c, 5)
    assert c.step() is JobState.RUNNING and c.attempt.grow is None  # a busy node is no reason to grow
    c.group.script.append([RankEnded(1, kind="dead", detail="rank 1's process died")])
    assert c.step() is JobState.RECOVERING  # restart 2 of 2
    assert c.step() is JobState.PLACING
    assert c.step() is JobState.RENDEZVOUS  # the full size waited out its timeout; 2 nodes at once
    assert launcher.placed[-1].cluster.nodes == 2
    restarts = job_status(redis_client, cfg.job.name)["restarts"]
    assert restarts == 2  # node_lost and dead; the placement timeout was none
    to_running(c)
    c.group.script.append([finished(r, 10) for r in range(4)])
    assert c.step() is JobState.SUCCEEDED


def test_too_few_free_nodes_for_any_size_waits_for_busy_ones_and_never_fails(rig, redis_client, tmp_path):
    make, launcher, _ = rig
    cfg = job("el-all-busy", tmp_path, min_nodes=2, shrink_after_s=0.0)
    c = make(cfg)
    to_running(c)
    lose_node(c, launcher, redis_client)
    launcher.busy.add("node-b")  # 2 nodes exist, 1 can be placed: fewer than min_nodes
    assert c.step() is JobState.PLACING
    for _ in range(5):
        assert c.step() is JobState.PLACING
    waiting = [e for e in job_status(redis_client, cfg.job.name, events=100)["events"]
               if e["type"] == "waiting_for_nodes"]
    assert len(waiting) == 1 and "busy is not gone" in waiting[0]["reason"]
    launcher.busy.clear()
    assert c.step() is JobState.RENDEZVOUS and launcher.placed[-1].cluster.nodes == 2
    assert job_status(redis_client, cfg.job.name)["restarts"] == 1


def test_a_job_that_is_not_elastic_waits_for_busy_nodes_without_spending_restarts(rig, redis_client,
                                                                                  tmp_path):
    make, launcher, _ = rig
    cfg = job("el-rigid-busy", tmp_path, max_restarts=0)
    launcher.busy.add("node-c")
    c = make(cfg)
    assert c.step() is JobState.PLACING
    for _ in range(3):
        assert c.step() is JobState.PLACING  # each try waits out the placement timeout
    assert launcher.tries == 3 and not launcher.placed
    events = job_status(redis_client, cfg.job.name, events=100)["events"]
    waiting = [e for e in events if e["type"] == "waiting_for_nodes"]
    assert len(waiting) == 1, events
    reason = waiting[0]["reason"]
    assert "their resources are in use" in reason and "no restart budget" in reason
    assert not [e for e in events if e["type"] in ("fault", "decision")]
    launcher.busy.clear()
    assert c.step() is JobState.RENDEZVOUS and c.attempt.number == 0
    to_running(c)
    c.group.script.append([finished(r, 10) for r in range(6)])
    assert c.step() is JobState.SUCCEEDED and c.summary["restarts"] == 0
    # A node that does not exist still fails the job at once, as before.
    launcher.nodes.remove("node-c")
    with pytest.raises(JobFailed, match="the cluster has 2"):
        make(job("el-rigid-gone", tmp_path)).run()
