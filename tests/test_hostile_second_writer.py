"""A second writer of one checkpoint directory (issue 42, door 3).

Two controllers, of two job names, given one `checkpoint.dir`: the first owns it (`owner.lock`,
flock) from before it places anything; the second is refused before it places anything, with a
sentence naming the first's job, host and pid, and writes nothing; once the first is gone
(released, or SIGKILLed: the kernel lets go of its lock), the second goes ahead. A save's
coordinator refuses to commit, and to apply retention, once another controller owns its root.
A controller whose lease in Redis another controller took, or that could not renew it for the
store patience, stops its workers and ends without writing the record again; its lease outlasts
the store patience.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import ClassVar

import fsspec
import pytest
import torch
from controller_fakes import make_rig
from fsspec.implementations.memory import MemoryFileSystem

from longrun import keys
from longrun.checkpoint import CheckpointWriteError, CheckpointWriter, HostStager, LocalCommitLedger, Manifest
from longrun.checkpoint.layout import committed_steps, read_latest
from longrun.checkpoint.manifest import rank_shard_name
from longrun.checkpoint.owner import OWNER_FILE, Ownership
from longrun.checkpoint.writer import SaveJob
from longrun.config import config_from_dict
from longrun.controller.controller import JobFailed, job_status
from longrun.controller.lease import ControllerLease, lease_ttl_s
from longrun.controller.placement import PlacementCancelled, PlacementImpossible
from longrun.services import EmbeddedRedis
from longrun.services.redis_client import patient_client, quick_client

# A controller of its own process, as `longrun run` runs one: its placement waits (as for busy
# nodes) until the test writes a line to its stdin, then finds the cluster too small.
_FIRST = """
import sys
from longrun.config import load_config
from longrun.controller.controller import Controller, JobFailed
from longrun.controller.placement import PlacementImpossible


class WaitingPlacement:
    def spare_nodes(self, cfg, evicted):
        return 0

    def warm_spares(self):
        pass

    def release(self):
        pass

    def __call__(self, cfg, **kw):
        print("placing", flush=True)
        sys.stdin.readline()
        raise PlacementImpossible("the test let go")


try:
    Controller(load_config(sys.argv[1]), sys.argv[2], launch=WaitingPlacement(), serve_metrics=False).run()
except JobFailed:
    pass
"""


def config(name: str, tmp_path, **sections):
    """controller_fakes.job's 4-rank job, with `sections` replacing its own."""
    return config_from_dict({
        "job": {"name": name, "output_dir": str(tmp_path / "runs")},
        "cluster": {"nodes": 2, "workers_per_node": 2, "device": "cpu"},
        "parallelism": {"dp": 4},
        "training": {"steps": 10},
        "health": {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 5.0, "hang_timeout_s": 30,
                   "hang_min_s": 10},
    } | sections)


def shared_dir_job(name: str, tmp_path):
    """A job of its own name whose checkpoint.dir is the one every such job shares."""
    return config(name, tmp_path, checkpoint={"dir": str(tmp_path / "shared")})


def start_first(cfg, tmp_path, redis_url: str) -> subprocess.Popen:
    path = tmp_path / f"{cfg.job.name}.yaml"
    path.write_text(cfg.to_yaml())
    first = subprocess.Popen([sys.executable, "-c", _FIRST, str(path), redis_url], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert first.stdout.readline() == "placing\n"  # it owns the directory before it places
    return first


def owner_text(cfg) -> str:
    return Path(cfg.checkpoint_dir, OWNER_FILE).read_text()


def refused_second(make, launcher, cfg, first: subprocess.Popen, redis_client) -> None:
    """The second controller is refused naming the first, and touches nothing."""
    held = owner_text(cfg)
    who = (rf"checkpoint directory {re.escape(cfg.checkpoint_dir)} is in use by job 'writer-a', whose "
           rf"controller is pid {first.pid} on {re.escape(socket.gethostname())} \(since .+\): stop that "
           r"job first")
    with pytest.raises(JobFailed, match=who):
        make(cfg).run()
    assert launcher.calls == []  # nothing placed
    assert job_status(redis_client, cfg.job.name)["state"] is None  # no record written
    assert redis_client.get(keys.job_controller_key(cfg.job.name)) is None  # its lease given back
    assert owner_text(cfg) == held


def runs_past_ownership(make, launcher, cfg) -> None:
    """The second controller owns the directory (its name in the lock while it places) and
    runs on to the placement, which the fake cluster refuses."""
    seen = []
    launcher.failures[0] = PlacementImpossible("the cluster has 1 node")
    place = launcher.__class__.__call__

    def placing(self, *args, **kw):
        seen.append(json.loads(owner_text(cfg)))
        return place(self, *args, **kw)
    launcher.__class__ = type("Seeing", (launcher.__class__,), {"__call__": placing})
    with pytest.raises(JobFailed, match="the cluster has 1 node"):
        make(cfg).run()
    assert [(s["job"], s["pid"]) for s in seen] == [("writer-b", os.getpid())]
    assert not Path(cfg.checkpoint_dir, OWNER_FILE).exists()  # given back at the end


def test_a_second_writer_is_refused_while_the_first_owns_the_directory(redis_server, redis_client, tmp_path):
    make, launcher, *_ = make_rig(redis_server.url)
    first_cfg, second_cfg = shared_dir_job("writer-a", tmp_path), shared_dir_job("writer-b", tmp_path)
    assert first_cfg.checkpoint_dir == second_cfg.checkpoint_dir
    first = start_first(first_cfg, tmp_path, redis_server.url)
    try:
        refused_second(make, launcher, second_cfg, first, redis_client)
        first.stdin.write("go\n")  # the first ends (FAILED) and gives the directory back
        first.stdin.flush()
        assert first.wait(timeout=120) == 0
    finally:
        first.kill()
        first.wait()
    runs_past_ownership(make, launcher, second_cfg)


def test_a_second_longrun_run_is_refused_before_it_starts_anything(redis_server, tmp_path):
    """The same config run twice: each `longrun run` would start a Redis of its own, so the job
    name's lease never meets; the checkpoint directory's owner refuses the second before any
    service starts or any file is written."""
    cfg = shared_dir_job("writer-a", tmp_path)
    first = start_first(cfg, tmp_path, redis_server.url)
    try:
        held = owner_text(cfg)
        second = subprocess.run([sys.executable, "-m", "longrun.cli", "run", str(tmp_path / "writer-a.yaml")],
                                capture_output=True, text=True, timeout=300)
        out = " ".join((second.stdout + second.stderr).split())  # as the console wrapped it
        assert second.returncode == 1, out
        assert (f"error: checkpoint directory {cfg.checkpoint_dir} is in use by job 'writer-a', whose "
                f"controller is pid {first.pid} on {socket.gethostname()}") in out
        assert "give this one a checkpoint.dir of its own" in out and "Traceback" not in out
        assert "redis:" not in out and "ray:" not in out  # no service was started
        assert not os.path.exists(os.path.join(cfg.run_dir, "config.yaml"))  # nothing written
        assert owner_text(cfg) == held
    finally:
        first.kill()
        first.wait()


def test_a_killed_owners_directory_is_free_at_once(redis_server, redis_client, tmp_path):
    make, launcher, *_ = make_rig(redis_server.url)
    first_cfg, second_cfg = shared_dir_job("writer-a", tmp_path), shared_dir_job("writer-b", tmp_path)
    first = start_first(first_cfg, tmp_path, redis_server.url)
    try:
        refused_second(make, launcher, second_cfg, first, redis_client)
    finally:
        first.send_signal(signal.SIGKILL)  # nothing of it runs again: the kernel drops its flock
        first.wait()
    assert json.loads(owner_text(second_cfg))["job"] == "writer-a"  # the dead one's name is still there
    runs_past_ownership(make, launcher, second_cfg)


def test_a_link_planted_as_the_owner_lock_is_refused_and_not_written_through(redis_server, tmp_path):
    make, launcher, *_ = make_rig(redis_server.url)
    cfg = shared_dir_job("writer-link", tmp_path)
    os.makedirs(cfg.checkpoint_dir)
    victim = tmp_path / "victim"
    victim.write_text("someone else's file\n")
    os.symlink(victim, os.path.join(cfg.checkpoint_dir, OWNER_FILE))
    with pytest.raises(JobFailed, match=f"{OWNER_FILE} is a symbolic link or not a regular file; remove it"):
        make(cfg).run()
    assert victim.read_text() == "someone else's file\n" and launcher.calls == []


# -- the coordinator of a save -----------------------------------------------------------------


def _save(writer: CheckpointWriter, step: int) -> None:
    snapshot = HostStager().stage({rank_shard_name(0): {"x": torch.full((3,), float(step))}})
    writer.submit(SaveJob(step, snapshot, Manifest(step=step, world_size=1, dp_size=1, model={},
                                                   config_fingerprint="f")))
    writer.wait_idle()


def test_a_commit_under_another_owner_is_refused_and_ends_the_job(tmp_path):
    url = str(tmp_path / "ckpt")
    mine = Ownership.take(url, "mine")
    fs, root = fsspec.core.url_to_fs(url)
    writer = CheckpointWriter(fs, root, rank=0, world_size=1, ledger=LocalCommitLedger(), keep_last=1)
    try:
        _save(writer, 1)
        writer.raise_if_failed()
        mine.release()
        theirs = Ownership.take(url, "theirs")  # another job took the directory meanwhile
        _save(writer, 2)
        with pytest.raises(CheckpointWriteError, match=rf"the commit of step 2 refused: checkpoint directory "
                           rf"{re.escape(root)} belongs to job 'theirs', whose controller is pid "
                           rf"{os.getpid()}") as refused:
            writer.raise_if_failed()
        assert refused.value.fault_kind == "fatal"  # no restart: every attempt would meet it
        assert committed_steps(fs, root) == [1] and read_latest(fs, root) == 1
        assert sorted(os.listdir(root)) == ["latest", OWNER_FILE, "step-00000001"]  # step 2's files gone
        theirs.release()
    finally:
        writer.close()


class TakenOverFS(MemoryFileSystem):
    """An object store on which another controller takes the root the moment `latest` moves:
    between a commit and its retention."""

    protocol = "takenover"
    store: ClassVar[dict] = {}
    pseudo_dirs: ClassVar[list] = [""]
    take_over: ClassVar[list] = []

    def pipe_file(self, path, value, *args, **kwargs):
        super().pipe_file(path, value, *args, **kwargs)
        if path.endswith("/latest") and self.take_over:
            self.take_over.pop()()


fsspec.register_implementation("takenover", TakenOverFS, clobber=True)


def test_retention_under_another_owner_deletes_nothing():
    url = "takenover://ckpt"
    Ownership.take(url, "mine")
    fs, root = fsspec.core.url_to_fs(url)
    writer = CheckpointWriter(fs, root, rank=0, world_size=1, ledger=LocalCommitLedger(), keep_last=1)
    try:
        _save(writer, 1)
        writer.raise_if_failed()
        TakenOverFS.take_over.append(lambda: Ownership.take(url, "theirs"))
        _save(writer, 2)
        with pytest.raises(CheckpointWriteError, match=r"checkpoint retention after step 2 refused: "
                           r"checkpoint directory \S*ckpt belongs to job 'theirs'"):
            writer.raise_if_failed()
        assert committed_steps(fs, root) == [1, 2]  # keep_last 1 would have deleted step 1
    finally:
        writer.close()
        TakenOverFS.store.clear()


# -- the lease ---------------------------------------------------------------------------------


class PlacementUntilCancelled:
    """A placement that waits for nodes until the controller gives it up, as RayLauncher's does."""

    def __init__(self):
        self.placing = threading.Event()

    def spare_nodes(self, cfg, evicted):
        return 0

    def warm_spares(self):
        pass

    def release(self):
        pass

    def __call__(self, cfg, *, cancelled, **kw):
        self.placing.set()
        while not cancelled():
            threading.Event().wait(0.05)  # a pending placement looks again, as Ray's does
        raise PlacementCancelled("placing given up")


def test_a_controller_whose_lease_another_took_stops_and_writes_no_more(redis_server, redis_client, tmp_path):
    from longrun.controller.controller import Controller

    cfg = config("lease-taken", tmp_path)
    placement = PlacementUntilCancelled()
    controller = Controller(cfg, redis_server.url, launch=placement, serve_metrics=False)
    failed: list[BaseException] = []

    def run() -> None:
        try:
            controller.run()
        except JobFailed as exc:
            failed.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert placement.placing.wait(60)
    key = keys.job_controller_key(cfg.job.name)
    # The lease outlasts the store patience (60 s): cut off from Redis, this controller gives up first.
    assert cfg.health.store_patience_s == 60.0 and redis_client.pttl(key) > 60_000
    other = json.dumps({"id": "other", "host": "elsewhere", "pid": 4242, "since": 0})
    redis_client.set(key, other, xx=True)  # taken: by a controller that found it expired
    thread.join(60)
    assert not thread.is_alive() and len(failed) == 1
    message = str(failed[0])
    assert ("the controller lease of job 'lease-taken' is lost: another controller holds it now, on "
            "elsewhere (pid 4242") in message and "this controller stopped its workers" in message
    assert redis_client.get(key).decode() == other  # not given back: not its own
    assert job_status(redis_client, cfg.job.name)["state"] == "PLACING"  # no FAILED written over it
    assert not os.path.exists(os.path.join(cfg.checkpoint_dir, OWNER_FILE))


def test_a_lease_cut_off_from_redis_is_given_up_before_it_expires():
    server = EmbeddedRedis().start()
    patience = 1.0
    lost = threading.Event()
    lease = ControllerLease(patient_client(server.url, patience), "lease-cut-off",
                            ttl_s=lease_ttl_s(patience), give_up_s=patience,
                            renew_client=quick_client(server.url), on_lost=lambda reason: lost.set())
    try:
        lease.acquire()
        with server.client() as client:
            assert client.pttl(keys.job_controller_key("lease-cut-off")) > patience * 1000
        server.stop()  # and it does not come back
        assert lost.wait(60)
        assert "Redis could not be reached to renew it" in lease.lost
    finally:
        lease.release()
        server.stop()
