"""Peer memory snapshots on a simulated 3-node Ray cluster with a real Redis (job on 2 nodes of
2 workers, one spare node): a worker SIGKILLed by pid from outside (at a seeded random time),
another SIGSTOPped, and a removed node each restart from the peers' memory, losing what the step
ledger says (the newest step any rank finished minus the step restored: never more than the
one or two steps a snapshot can be behind), with the goodput summary accounting for the whole
run, ending bitwise equal to an uninterrupted run; a corrupted snapshot sends every rank to
storage."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
from types import SimpleNamespace

import psutil
import pytest
import ray
import torch
from clusters import committed_weights, run_in_thread, signal_a_worker, simulated_cluster, wait_for

from longrun.checkpoint.memory import read_snapshot, serialize
from longrun.config import config_from_dict
from longrun.controller.controller import Controller, job_status
from longrun.controller.job_state import JobRecordStore
from longrun.controller.keepers import KEEP_STEPS, KEEPER_NAMESPACE, SnapshotKeeper, keeper_name
from longrun.goodput.summary import read_summary

STEPS = 14


def job(name: str, out, faults=(), **checkpoint):
    return config_from_dict({
        "job": {"name": name, "seed": 7, "output_dir": str(out)},
        "cluster": {"nodes": 2, "workers_per_node": 2, "device": "cpu"},
        "parallelism": {"dp": 4},
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64},
        "data": {"source": "synthetic", "micro_batch_tokens": 128, "prefetch": 1,
                 "synthetic": {"min_len": 8, "max_len": 64, "mean": 24, "sigma": 0.8}},
        # Slow enough steps that a fault from outside lands inside one, not between two.
        "training": {"steps": STEPS, "lr": 3e-3, "warmup_steps": 2, "log_every": 100},
        # Storage only at the end: anything restored mid-run came from memory.
        "checkpoint": {"interval_steps": 100, "keep_last": 10, "memory_interval_steps": 1} | checkpoint,
        "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0, "hang_timeout_s": 60,
                   "hang_min_s": 5,
                   "faults": [{"rank": 0, "step": 1, "kind": "slow", "seconds": 0.6}, *faults]},
        "recovery": {"restart_backoff_s": 3.0},
    })


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(3, 2) as (c, _):
        yield c


@pytest.fixture(scope="module")
def reference(cluster, redis_server, tmp_path_factory):
    cfg = job("mem-reference", tmp_path_factory.mktemp("ref"))
    summary = Controller(cfg, redis_server.url).run()
    assert summary["step"] == STEPS and summary["restarts"] == 0
    return committed_weights(cfg.checkpoint_dir, STEPS)


def keeper_actor(name: str):
    """A keeper by name: keepers live in a Ray namespace of their own (controller/keepers.py)."""
    return ray.get_actor(name, namespace=KEEPER_NAMESPACE)


def newest_snapshot(job: str, nodes: list[str]) -> int:
    """The newest step the keepers of `nodes` hold for every rank (0: none)."""
    held: dict[int, set[int]] = {}
    for node in nodes:
        with contextlib.suppress(ValueError):  # a keeper not there (yet, or any more)
            keeper = keeper_actor(keeper_name(job, node))
            for rank, steps in ray.get(keeper.holdings.remote()).items():
                for step in steps:
                    held.setdefault(step, set()).add(rank)
    return max((s for s, ranks in held.items() if len(ranks) == 4), default=0)


def at_a_random_moment_of_a_step(redis_client, job: str, seed: str) -> None:
    """Past step 6, from the poll that shows a new step, wait a seeded random time of up to
    about two step periods (a step is 0.6 s of rank 0's pacing plus its compute): the fault then
    lands anywhere in a step, in its forward, backward or update, while the snapshot of the
    step before is still being sent, or in the pacing, not only right after a snapshot landed."""
    record = wait_for(redis_client, job, step=6)
    wait_for(redis_client, job, step=record.step + 1)
    time.sleep(random.Random(seed).uniform(0.0, 1.5))  # the fault's moment, not a synchronisation


def right_after_a_snapshot(redis_client, job: str) -> list[str]:
    """Wait until the job is past step 6 and every rank's snapshot of a new step has just
    landed: a fault now hits the step after it, with nothing of that one finished. The nodes."""
    record = wait_for(redis_client, job, step=6)
    nodes = json.loads(record.fields["nodes"])
    seen = newest_snapshot(job, nodes)
    deadline = time.monotonic() + 60
    while newest_snapshot(job, nodes) <= seen:
        assert time.monotonic() < deadline, "no new snapshot in a minute"
    return nodes


def assert_lost_per_the_ledger_and_bitwise(cfg, result, reference, redis_client):
    assert result["step"] == STEPS and result["restarts"] == 1, result
    events = job_status(redis_client, cfg.job.name, events=200)["events"]
    recovered = [e for e in events if e["type"] == "recovered"]
    goodput = read_summary(redis_client, cfg.job.name)
    [fault] = goodput.faults
    # The step ledger's count (not the heartbeats', which can miss a dying attempt's last step):
    # the newest step any rank finished, minus the step every rank restored from memory. A
    # snapshot is at most one step behind its rank, and a rank one step behind its peers.
    assert fault["restored_from"] == "memory" and fault["restored_step"] == result["resumed_from"], fault
    assert fault["steps_lost"] == fault["last_step"] - fault["restored_step"]
    assert 0 <= fault["steps_lost"] <= 2
    # The design's bound, wherever in a step the fault landed: a snapshot every
    # `memory_interval_steps` steps, plus the one a rank's send may still be carrying when the
    # next is due (skipped, never waited for). It came from memory, mid-run.
    assert fault["steps_lost"] <= cfg.checkpoint.memory_interval_steps + 1, fault
    assert 0 < fault["restored_step"] < STEPS, fault
    assert len(recovered) == 1 and recovered[0]["source"] == "ledger", recovered
    assert (recovered[0]["resumed_from"], recovered[0]["steps_lost"]) == (fault["restored_step"],
                                                                          fault["steps_lost"])
    assert f"{fault['steps_lost']} step(s) of work lost" in recovered[0]["reason"]
    # Every second of the run in one bucket: from before the controller was built to its last
    # move (after its first), and never a second twice.
    moves = [e["at"] for e in events if e["type"] == "transition"]
    started, ended = result["ran"]
    assert moves[-1] - moves[0] <= goodput.wall_s <= moves[-1] - started + 1e-3, (goodput.buckets, moves)
    assert ended >= moves[-1]
    assert goodput.buckets["restore_memory"] > 0 and goodput.buckets["detection"] > 0
    assert goodput.buckets["productive"] > 0 and goodput.state == "SUCCEEDED"
    if fault["steps_lost"] == 0:
        assert goodput.buckets["redone"] == 0
    got = committed_weights(cfg.checkpoint_dir, STEPS)
    for name, want in reference.items():
        assert torch.equal(got[name], want), f"{name} differs from the uninterrupted run"


@pytest.mark.timeout(600)
# Both are `slow` (the suite's time): a worker SIGKILLed from outside is in the default run's
# soak and many-hosts tests, a hang in tests/test_controller_recovery.py, and restoring from
# memory in the tests below.
@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
def test_a_worker_stopped_from_outside_restarts_from_memory(how, cluster, reference, redis_server,
                                                            redis_client, tmp_path):
    cfg = job(f"mem-{how}", tmp_path)
    thread, result = run_in_thread(cfg, redis_server.url)
    at_a_random_moment_of_a_step(redis_client, cfg.job.name, f"mem-{how}")
    victim = signal_a_worker(signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
    try:
        thread.join(500)
    finally:
        if how == "sigstop":  # the controller had its actor killed; make sure the frozen process went
            with contextlib.suppress(psutil.NoSuchProcess):
                victim.kill()
    assert not thread.is_alive()
    assert_lost_per_the_ledger_and_bitwise(cfg, result, reference, redis_client)


@pytest.mark.timeout(600)
def test_a_removed_node_restores_its_ranks_from_the_peer_copies(cluster, reference, redis_server,
                                                                 redis_client, tmp_path):
    cfg = job("mem-node", tmp_path)
    thread, result = run_in_thread(cfg, redis_server.url)
    victim = right_after_a_snapshot(redis_client, cfg.job.name)[1]  # ranks 2, 3 and a keeper go
    cluster.remove_node(next(n for n in cluster.list_all_nodes() if n.node_id == victim))
    try:
        thread.join(500)
    finally:
        cluster.add_node(num_cpus=2)  # leave the module's cluster as it was found
        cluster.wait_for_nodes()
    assert not thread.is_alive()
    assert victim not in json.loads(JobRecordStore(redis_client, cfg.job.name).read().fields["nodes"])
    assert_lost_per_the_ledger_and_bitwise(cfg, result, reference, redis_client)


@pytest.mark.timeout(600)
def test_a_corrupted_snapshot_sends_every_rank_to_storage(cluster, reference, redis_server, redis_client,
                                                          tmp_path):
    cfg = job("mem-corrupt", tmp_path, interval_steps=4)
    thread, result = run_in_thread(cfg, redis_server.url)
    record = wait_for(redis_client, cfg.job.name, step=6)
    signal_a_worker(signal.SIGKILL)
    wait_for(redis_client, cfg.job.name, state="RECOVERING")  # the restart backs off 3 s: time to corrupt
    corrupted = []
    for node in json.loads(record.fields["nodes"]):
        keeper = keeper_actor(keeper_name(cfg.job.name, node))
        for rank, steps in ray.get(keeper.holdings.remote()).items():
            for step in steps:
                _, digest = ray.get(keeper.get.remote(rank, step))
                # The keeper keeps the old sum; waited on, so every copy is bad before the restart.
                ray.get(keeper.put.remote(rank, step, b"flipped bits", digest))
                blob, _ = ray.get(keeper.get.remote(rank, step))
                corrupted.append(bytes(blob) == b"flipped bits")
    assert corrupted and all(corrupted)
    assert wait_for(redis_client, cfg.job.name).state == "RECOVERING", "restarted before the copies were bad"
    thread.join(500)
    assert not thread.is_alive()
    assert result["step"] == STEPS and result["restarts"] == 1
    recovered = [e for e in job_status(redis_client, cfg.job.name, events=200)["events"]
                 if e["type"] == "recovered"]
    assert recovered[0]["resumed_from"] == 4  # storage: step 4, every snapshot after it was bad
    [fault] = read_summary(redis_client, cfg.job.name).faults
    assert (fault["restored_from"], fault["restored_step"]) == ("storage", 4), fault
    # A rank beats step 6 before that step's ledger record (written once what is due after the
    # step is done), so the kill may land between the two: the ledger's last step is 5 or 6,
    # and the loss is counted from it.
    assert fault["last_step"] >= 5 and fault["steps_lost"] == fault["last_step"] - 4, fault
    assert recovered[0]["steps_lost"] == fault["steps_lost"], (recovered, fault)
    got = committed_weights(cfg.checkpoint_dir, STEPS)
    assert all(torch.equal(got[n], w) for n, w in reference.items())


@pytest.mark.timeout(600)
def test_a_failed_last_save_is_written_from_the_snapshot_of_the_last_step(cluster, reference, redis_server,
                                                                       redis_client, tmp_path):
    """The job's only storage save, at its last step, fails on rank 1 as on a full disk. The
    restart resumes from the peers' snapshot of that step and, though it trains nothing, must
    commit it: the job may not end with its last steps held in memory only."""
    cfg = job("mem-last-save", tmp_path, faults=[{"rank": 1, "step": STEPS - 1, "kind": "fail_save"}])
    summary = Controller(cfg, redis_server.url).run()
    assert summary["step"] == STEPS and summary["restarts"] == 1, summary
    assert summary["resumed_from"] == STEPS, summary  # the last snapshot reached the keepers first
    events = job_status(redis_client, cfg.job.name, events=200)["events"]
    faults = [e for e in events if e["type"] == "fault"]
    assert any("No space left on device" in json.dumps(e) for e in faults), faults
    [fault] = read_summary(redis_client, cfg.job.name).faults
    restored = (fault["restored_from"], fault["restored_step"], fault["steps_lost"])
    assert restored == ("memory", STEPS, 0), fault
    got = committed_weights(cfg.checkpoint_dir, STEPS)
    for name, want in reference.items():
        assert torch.equal(got[name], want), f"{name} differs from the uninterrupted run"


def test_a_keeper_holds_the_last_arrivals_and_forgets_an_abandoned_path():
    keeper = SnapshotKeeper()
    blob, digest = serialize({"step": 3, "w": torch.arange(4.0)})
    for step in range(1, 5):
        keeper.put(0, step, blob, digest)
    assert keeper.holdings() == {0: list(range(5 - KEEP_STEPS, 5))}
    # A rollback to step 2 (a skipped bad step): what came after 2 is another path's.
    keeper.drop_after(2)
    assert keeper.holdings() == {0: []}
    keeper.put(0, 3, blob, digest)  # the new path's steps are kept, whatever the old held
    keeper.put(0, 4, blob, digest)
    keeper.put(0, 5, blob, digest)
    assert keeper.holdings() == {0: [4, 5]}


def test_chunks_of_many_ranks_stream_to_threaded_keepers_and_back(cluster):
    """Issue 39: three replicas send their parts of one shard at once, chunk by chunk, to two
    keepers made as `Keepers.ensure` makes them; each rank's restore fetches its own and its
    replicas' parts back, every chunk checked, and reassembles the shard bitwise."""
    from longrun.checkpoint.memory import MemorySnapshots, Part
    from longrun.controller.snapshot_keeper import THREADS
    from longrun.worker.snapshot_transfer import fetch_snapshot, snapshot_sender

    keeper = ray.remote(num_cpus=0, max_concurrency=THREADS)(SnapshotKeeper)
    names = ["mem-stream-a", "mem-stream-b"]
    actors = [keeper.options(name=n, namespace=KEEPER_NAMESPACE).remote() for n in names]
    replicas = (0, 1, 2)
    weights = torch.arange(300_000, dtype=torch.float32)  # 1.2 MB: many chunks each
    try:
        snaps = []
        for rank in replicas:
            trainer = SimpleNamespace(step=4, state_dict=lambda r=rank: {
                "step": 4, "model": {"w": weights}, "optimizer": {}, "rng": torch.full((3,), r)})
            snaps.append(MemorySnapshots(snapshot_sender(rank, names, timeout_s=60), every=1,
                                         part=Part(rank, 3, replicas), chunk_bytes=64 << 10))
            assert snaps[-1].take(trainer)  # the three sends run at once
        for s in snaps:
            s.wait()
        assert all(s.sent_step == 4 and s.failed == 0 for s in snaps)
        held = {str(r): names for r in replicas}
        for rank in replicas:
            got, problems = fetch_snapshot(rank, 4, held)
            assert problems == [] and got["part"] == rank
            assert torch.equal(got["state"]["model"]["w"], weights)
            assert torch.equal(got["state"]["rng"], torch.full((3,), rank))
    finally:
        for actor in actors:
            ray.kill(actor)


def test_a_killed_keeper_is_left_out_and_the_snapshots_go_on_to_the_other(cluster):
    """Issue 41's soak: a keeper SIGKILLed mid-attempt made every later send fail (one of its two
    keepers raised), so no snapshot landed until the attempt ended. Now the dead keeper is left
    out: each send is whole on the live one, and only when both are gone does a send fail."""
    from longrun.checkpoint.memory import MemorySnapshots
    from longrun.worker.snapshot_transfer import fetch_snapshot, snapshot_sender

    keeper = ray.remote(num_cpus=0, max_restarts=0)(SnapshotKeeper)
    names = ["mem-dead-a", "mem-dead-b"]
    actors = [keeper.options(name=n, namespace=KEEPER_NAMESPACE).remote() for n in names]
    ray.get([a.holdings.remote() for a in actors])
    weights = torch.arange(100_000, dtype=torch.float32)
    try:
        snaps = MemorySnapshots(snapshot_sender(0, names, timeout_s=60), every=1, chunk_bytes=64 << 10)
        for step in (1, 2, 3):
            if step == 2:
                ray.kill(actors[0], no_restart=True)  # between two sends: the next meets it dead
            trainer = SimpleNamespace(step=step, state_dict=lambda s=step: {
                "step": s, "model": {"w": weights + s}, "optimizer": {}})
            assert snaps.take(trainer)
            snaps.wait()
            assert snaps.sent_step == step and snaps.failed == 0, step
        assert ray.get(actors[1].holdings.remote()) == {0: [2, 3]}
        got, problems = fetch_snapshot(0, 3, {"0": names})
        assert torch.equal(got["state"]["model"]["w"], weights + 3), problems
        ray.kill(actors[1], no_restart=True)
        assert snaps.take(SimpleNamespace(step=4, state_dict=lambda: {"step": 4, "model": {"w": weights}}))
        snaps.wait()
        assert snaps.failed == 1 and snaps.sent_step == 3  # no keeper left: that snapshot is lost
        # The controller starts a new keeper under the dead one's name (Keepers.revive): the
        # next send looks it up and reaches it.
        actors.append(keeper.options(name=names[0], namespace=KEEPER_NAMESPACE).remote())
        assert snaps.take(SimpleNamespace(step=5, state_dict=lambda: {"step": 5, "model": {"w": weights}}))
        snaps.wait()
        assert snaps.failed == 1 and snaps.sent_step == 5
        assert ray.get(actors[-1].holdings.remote()) == {0: [5]}
    finally:
        for actor in actors:
            ray.kill(actor)


def test_a_keeper_killed_mid_attempt_is_replaced_by_the_next_look(cluster):
    """The controller looks at its keepers every few seconds while an attempt runs (never
    waiting on one): a keeper whose process was SIGKILLed gets a new one under its name on a
    node Ray still lists, and one on a node Ray lost does not."""
    from longrun.controller.keepers import Keepers

    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU"))[:2]
    keepers = Keepers("mem-revive")
    keepers.ensure(nodes)
    try:
        def answered() -> None:  # the pings the last look sent are answered (or failed)
            ray.wait(list(keepers._pings.values()), num_returns=len(nodes), timeout=60)

        only_first = lambda ask: set(ask) & {nodes[0]}  # noqa: E731  (Ray "lost" the second node)
        assert keepers.revive(nodes, alive=only_first) == []  # all alive: pinged, nothing else
        answered()
        victims = [keeper_actor(keeper_name("mem-revive", n)) for n in nodes]
        pids = [ray.get(v.__ray_call__.remote(lambda keeper: os.getpid())) for v in victims]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            psutil.Process(pid).wait(timeout=60)
        assert keepers.revive(nodes, alive=only_first) == []  # the answers from before the kill
        answered()
        # The pings to the dead keepers failed: a new one on the node Ray still lists.
        assert keepers.revive(nodes, alive=only_first) == [nodes[0]]
        assert ray.get(keeper_actor(keeper_name("mem-revive", nodes[0])).holdings.remote(), timeout=60) == {}
        with pytest.raises(ValueError):
            keeper_actor(keeper_name("mem-revive", nodes[1]))
    finally:
        keepers.close()


# A controller's driver in a process of its own, killed by the test: it starts detached keepers
# for three jobs on the given nodes (the third with a 2 s orphan timeout), gives each a snapshot
# of step 3 for ranks 0 and 1, and says "ready" once the third's keepers, called by its
# Keepers' thread, have lived past their timeout.
_CONTROLLER = """
import sys, threading, time
import ray
from longrun.controller.keepers import KEEPER_NAMESPACE, Keepers, keeper_name
address, nodes = sys.argv[1], sys.argv[2].split(",")
ray.init(address=address, logging_level="ERROR")
for job, orphan in (("mem-survive-a", 600.0), ("mem-survive-b", 600.0), ("mem-survive-c", 2.0)):
    Keepers(job, "tag-a", orphan).ensure(nodes)
    keepers = [ray.get_actor(keeper_name(job, n), namespace=KEEPER_NAMESPACE) for n in nodes]
    ray.get([k.put.remote(rank, 3, bytes(1000), "d") for k in keepers for rank in (0, 1)])
time.sleep(3.0)  # past the third job's orphan timeout: its keepers live only if they were called
ray.get([ray.get_actor(keeper_name("mem-survive-c", n), namespace=KEEPER_NAMESPACE).holdings.remote()
         for n in nodes], timeout=30)
print("ready", flush=True)
threading.Event().wait()
"""


def _gone(name: str) -> bool:
    try:
        keeper_actor(name)
    except ValueError:
        return True
    return False


def test_keepers_outlive_a_killed_controller_for_the_next_one_of_the_same_job(cluster):
    """The soak's controller_kill lost 10 and 5 steps: the keepers went with the controller,
    so its rerun restored from storage. Now they are detached: the next controller of the job
    takes them over (its tag: the same job and layout) and plans its restore from them; keepers
    of another tag are let go; and keepers no controller calls any more end themselves."""
    import subprocess
    import sys

    from longrun.controller.keepers import Keepers

    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU"))[:2]
    driver = subprocess.Popen([sys.executable, "-c", _CONTROLLER, cluster.address, ",".join(nodes)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "ready"
    finally:
        driver.kill()  # SIGKILL: nothing of the driver's own runs after this
        driver.wait(60)
    successor = Keepers("mem-survive-a", "tag-a", 600)
    try:
        assert sorted(successor.adopt_survivors(nodes)) == nodes
        restore = successor.plan(2, newer_than=0, before_step=None)
        assert restore is not None and restore.step == 3
        assert restore.keepers == {r: [keeper_name("mem-survive-a", n) for n in nodes] for r in (0, 1)}
    finally:
        successor.close()
    stranger = Keepers("mem-survive-b", "tag-of-another-layout", 600)
    assert stranger.adopt_survivors(nodes) == [] and stranger.plan(2, newer_than=0, before_step=None) is None
    orphans = [keeper_name(job, n) for job in ("mem-survive-b", "mem-survive-c") for n in nodes]
    deadline = time.monotonic() + 60
    while not all(_gone(name) for name in orphans):  # let go, or ended for want of a controller
        assert time.monotonic() < deadline, [name for name in orphans if not _gone(name)]
        time.sleep(0.2)  # polling Ray's control store, which has no notification for it


def test_a_keeper_no_controller_calls_ends_itself():
    now, ended = [0.0], threading.Event()
    keeper = SnapshotKeeper("tag", orphan_after_s=0.4, clock=lambda: now[0], end=lambda code: ended.set())
    try:
        assert keeper.touch() == "tag" and not keeper.orphaned(0.4)
        now[0] = 0.3
        keeper.holdings()  # any call is a controller's
        now[0] = 0.6
        assert not keeper.orphaned(0.4)
        keeper.retag("new")
        assert keeper.touch() == "new"
        now[0] = 5.0  # nobody called since 0.6: its watch ends the process
        assert ended.wait(30)
    finally:
        keeper.close()


def test_the_controller_looks_at_its_keepers_every_few_seconds():
    from longrun.controller.listeners import KeeperReviver

    now, calls = [100.0], []
    reviver = KeeperReviver(lambda: calls.append(now[0]), every_s=5.0, clock=lambda: now[0])

    def polls(*times: float) -> None:
        for t in times:
            now[0] = t
            reviver.heartbeats(None, {}, t)

    polls(100.0, 110.0)  # the attempt is still starting: its launch owns the keepers
    now[0] = 111.0
    reviver.trained(None)
    polls(112.0, 115.9, 116.0, 117.0, 121.0)
    reviver.ending(None)
    polls(130.0)  # its workers stopped: the next launch plans from the keepers
    assert calls == [116.0, 121.0]


def test_the_next_attempt_sends_to_a_new_keeper_where_one_was_killed(cluster, tmp_path):
    """Issue 41's soak: the keepers were ensured before the plan found the dead ones, so a killed
    keeper was never replaced and the next attempt's ranks could not reach it (snapshots off for
    the whole attempt). Every target the next attempt gets must answer."""
    from longrun.controller.workers import RayLauncher

    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU"))[:2]
    cfg = job("mem-new-keeper", tmp_path)
    launcher = SimpleNamespace(placement=SimpleNamespace(node_ids=nodes), keepers=None)
    try:
        first = RayLauncher._snapshot_plans(launcher, cfg, None)
        victim = keeper_actor(keeper_name(cfg.job.name, nodes[0]))
        pid = ray.get(victim.__ray_call__.remote(lambda keeper: os.getpid()))
        os.kill(pid, signal.SIGKILL)  # as the soak's keeper_kill does
        psutil.Process(pid).wait(timeout=60)
        second = RayLauncher._snapshot_plans(launcher, cfg, None)
        assert [p["targets"] for p in second] == [p["targets"] for p in first]
        for name in {t for p in second for t in p["targets"]}:
            assert ray.get(keeper_actor(name).holdings.remote(), timeout=30) == {}, name
    finally:
        if launcher.keepers is not None:
            launcher.keepers.close()


def test_a_snapshot_is_verified():
    blob, digest = serialize({"step": 3, "w": torch.arange(4.0)})
    assert torch.equal(read_snapshot(blob, digest)["w"], torch.arange(4.0))
    with pytest.raises(ValueError, match="does not match its checksum"):
        read_snapshot(blob[:-1] + b"x", digest)


def test_a_bad_copy_is_passed_over_for_the_peer_copy(cluster, tmp_path):
    """Storage only when a snapshot and its peer copy are both unusable."""
    from longrun.checkpoint.sharding import localize
    from longrun.trainer import Trainer
    from longrun.worker.snapshots import restore_from_memory

    cfg = config_from_dict(job("mem-copies", tmp_path).model_dump(mode="json")
                           | {"cluster": {"device": "cpu"}, "parallelism": {}})
    with Trainer(cfg, progress=False) as source:
        source.train(steps=2)
        blob, digest = serialize(localize(source.state_dict())[0])
        want = {k: v.clone() for k, v in source.model.state_dict().items()}
    keeper = ray.remote(num_cpus=0)(SnapshotKeeper)
    good, bad = (keeper.options(name=f"mem-copies-{n}", namespace=KEEPER_NAMESPACE).remote()
                 for n in ("good", "bad"))
    ray.get([bad.put.remote(0, 2, blob[:-1] + b"x", digest), good.put.remote(0, 2, blob, digest)])
    try:
        with Trainer(cfg, progress=False) as fresh:
            plan = {"step": 2, "keepers": {"0": ["mem-copies-bad", "mem-copies-good"]}}
            assert restore_from_memory(fresh, 0, plan, None) == 2
            assert all(torch.equal(v, want[k]) for k, v in fresh.model.state_dict().items())
        with Trainer(cfg, progress=False) as fresh:
            plan = {"step": 2, "keepers": {"0": ["mem-copies-bad", "mem-copies-gone"]}}
            assert restore_from_memory(fresh, 0, plan, None) is None  # both unusable: storage
    finally:
        for actor in (good, bad):
            ray.kill(actor)


@pytest.mark.timeout(600)
def test_a_stop_while_recovering_commits_the_snapshot_and_the_rerun_resumes_from_it(
        cluster, reference, redis_server, redis_client, tmp_path):
    """Issue 26, hole 2: a fault, then the scheduler's SIGTERM during the backoff. The keepers'
    newest snapshot is committed before they go, and running the job again resumes from it."""
    from longrun.checkpoint.layout import committed_steps

    cfg = job("mem-stop", tmp_path, interval_steps=4)
    controller = Controller(cfg, redis_server.url)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(controller.run()), daemon=True)
    thread.start()
    wait_for(redis_client, cfg.job.name, step=6)
    signal_a_worker(signal.SIGKILL)
    wait_for(redis_client, cfg.job.name, state="RECOVERING")  # backing off 3 s
    controller.request_preemption("SIGTERM from the scheduler")
    thread.join(300)
    assert not thread.is_alive() and result["preempted"], result
    steps = committed_steps(*_fs_root(cfg))
    kept = steps[-1]
    assert kept > 4 and kept % 4, steps  # a snapshot's step, newer than the step-4 checkpoint
    assert f"the memory snapshot of step {kept}" in result["reason"], result["reason"]
    again = Controller(cfg, redis_server.url).run()
    assert again["step"] == STEPS and again["resumed_from"] == kept, again
    got = committed_weights(cfg.checkpoint_dir, STEPS)
    assert all(torch.equal(got[n], w) for n, w in reference.items())


def _fs_root(cfg):
    import fsspec

    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    return fs, root.rstrip("/")
