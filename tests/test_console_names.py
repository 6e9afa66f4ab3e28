"""Nodes as a person reads them, and Ray's worker-death paragraph folded into longrun's account.

The pieces first: the name a node gets, the ids replaced in a line, the names placement reads
from Ray, the parse of Ray's message and the hook that takes it off the console. Then a
controller stepped against the fakes of tests/controller_fakes.py on nodes with Ray-shaped ids:
the console, the job record (`longrun status`), the journal (`longrun report`) and the metrics
name the node by host and address and keep its id in the machine-readable fields. The console
of a real job whose rank is SIGKILLed is tests/test_user_view_job.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import controller_fakes
import pytest
import ray
import ray._private.state
import ray._private.worker
from controller_fakes import Clock, FakeGroup, Launcher, drive_to_running, job
from prometheus_client.openmetrics.exposition import generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from longrun.controller import placement
from longrun.controller.controller import Controller, job_status
from longrun.controller.ray_deaths import WorkerDeath, WorkerDeaths, parse_death
from longrun.controller.state import JobState
from longrun.controller.workers import RankEnded
from longrun.job_view import read_log, view_of_record
from longrun.node_names import NodeNames, node_name
from longrun.observability import report_figures
from longrun.observability.journal import read_journal

ID_A, ID_B = "05b90321" + "a" * 48, "05b90321" + "b" * 48  # Ray's shape: 56 hex digits
NAMES = {ID_A: "gpu-a (10.0.0.1)", ID_B: "gpu-b (10.0.0.2)"}
PIDS = {0: 4100, 1: 4101, 2: 4102, 3: 4103}

# What the raylet sends the driver when a rank's process is SIGKILLed (Ray 2.60, one line).
RAY_DEATH = (
    "A worker died or was killed while executing a task by an unexpected system error. To "
    "troubleshoot the problem, check the logs for the dead worker. Lease ID: 0400000012 Worker ID: "
    f"9f3c77e1d2 Node ID: {ID_A} Worker IP address: 10.0.0.1 Worker port: 40125 Worker PID: 4101 "
    "Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection "
    "error code 2. End of file. Some common causes include: (1) the process was killed by the OOM "
    "killer due to high memory usage, (2) ray stop --force was called, or (3) the worker crashed "
    "unexpectedly due to SIGSEGV or another unexpected error.")


# -- the pieces -----------------------------------------------------------------------------------


def test_a_node_is_named_by_host_and_address():
    assert node_name("gpu-a", "10.0.0.1") == "gpu-a (10.0.0.1)"
    assert node_name("", "10.0.0.1") == "10.0.0.1"  # no host name: the address alone
    assert node_name("10.0.0.1", "10.0.0.1") == "10.0.0.1"


def test_known_node_ids_in_a_line_are_replaced_by_their_names():
    names = NodeNames({ID_A: NAMES[ID_A]})
    line = f"dead rank: rank 1 on node {ID_A} died; evict {ID_A}, not {ID_B}."
    assert names.in_text(line) == (f"dead rank: rank 1 on node gpu-a (10.0.0.1) died; "
                                   f"evict gpu-a (10.0.0.1), not {ID_B}.")
    digest = "c" * 64  # a sha256 is no node id, even where its first 56 digits would match
    assert NodeNames({"c" * 56: "x"}).in_text(f"source {digest}") == f"source {digest}"
    assert names.name(ID_B) == ID_B  # never learnt: the id
    names.learn({ID_B: NAMES[ID_B]})
    assert names.name(ID_B) == "gpu-b (10.0.0.2)"


def test_placement_reads_each_nodes_host_name_from_ray(monkeypatch):
    monkeypatch.setattr(ray, "nodes", lambda: [
        {"NodeID": ID_A, "Alive": True, "NodeManagerAddress": "10.0.0.1", "NodeManagerHostname": "gpu-a",
         "Resources": {"CPU": 4.0}},
        {"NodeID": ID_B, "Alive": False, "NodeManagerAddress": "10.0.0.2", "NodeManagerHostname": "gpu-b",
         "Resources": {"CPU": 4.0}}])
    monkeypatch.setattr(ray._private.state, "available_resources_per_node", lambda: {ID_A: {"CPU": 4.0}})
    [node] = placement.alive_nodes()
    assert (node.node_id, node.name) == (ID_A, "gpu-a (10.0.0.1)")


def test_rays_worker_death_message_is_parsed():
    death = parse_death(RAY_DEATH)
    assert death == WorkerDeath(pid=4101, node_id=ID_A, address="10.0.0.1", exit_type="SYSTEM_ERROR",
                                detail="Worker unexpectedly exits with a connection error code 2")
    assert death.line(NodeNames(NAMES)) == ("ray: a worker process (pid 4101) on gpu-a (10.0.0.1) died "
                                            "(SYSTEM_ERROR, Worker unexpectedly exits with a connection "
                                            "error code 2)")
    assert parse_death("The autoscaler could not find a node type to satisfy the request") is None


def test_the_hook_keeps_rays_death_paragraph_and_prints_everything_else(monkeypatch):
    printed = []
    monkeypatch.setattr(ray._private.worker, "print_to_stdstream",
                        lambda data, ignore_prefix: printed.append(data["lines"]))
    with WorkerDeaths() as deaths:
        # As Ray's error thread calls it: the module's global, looked up at each call.
        ray._private.worker.print_to_stdstream({"lines": [RAY_DEATH], "pid": "raylet", "is_err": False},
                                               ignore_prefix=False)
        other = {"lines": ["Resource usage is high"], "pid": "raylet", "is_err": False}
        ray._private.worker.print_to_stdstream(other, ignore_prefix=False)
    assert printed == [["Resource usage is high"]]
    assert [d.pid for d in deaths.take()] == [4101] and deaths.take() == []
    ray._private.worker.print_to_stdstream({"lines": [RAY_DEATH], "pid": "raylet"}, ignore_prefix=False)
    assert printed[-1] == [RAY_DEATH]  # left: Ray prints as before


def test_rays_error_thread_hands_a_death_over_and_prints_the_rest():
    """Through a real driver: errors published to it as the raylet does, read by Ray's own
    error thread. Published in order (one channel: delivered in order), so once the death is
    taken the message before it has been printed. The thread subscribes some time after
    `ray.init` returns, and what is published before it has is never delivered: a death of
    another pid is published until one is taken, and only then the two messages."""
    code = textwrap.dedent(f"""
        import time, ray
        from ray._private.utils import publish_error_to_driver
        from longrun.controller.ray_deaths import WorkerDeaths

        def take_until(pid, probe=None):  # every death taken until one of pid is
            deadline, taken = time.monotonic() + 60, []
            while time.monotonic() < deadline and pid not in {{d.pid for d in taken}}:
                if probe is not None:
                    publish_error_to_driver("worker_died", probe, gcs, job)
                taken += deaths.take()
                time.sleep(0.05)  # until Ray's error thread has read it
            return taken

        with WorkerDeaths() as deaths:
            ray.init(num_cpus=1, include_dashboard=False, logging_level="error", log_to_driver=False)
            job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
            gcs = ray._private.worker.global_worker.gcs_client
            subscribed = take_until(4199, probe={RAY_DEATH.replace("PID: 4101", "PID: 4199")!r})
            publish_error_to_driver("resources", "Resource usage is high", gcs, job)
            publish_error_to_driver("worker_died", {RAY_DEATH!r}, gcs, job)
            taken = [d for d in take_until(4101) if d.pid != 4199]  # late probes are not news
            ray.shutdown()
        print("subscribed", bool(subscribed), "taken", [d.pid for d in taken])
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          env=os.environ | {"RAY_COLOR_PREFIX": "0"})
    assert "subscribed True taken [4101]" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "(raylet) Resource usage is high" in done.stdout, done.stdout
    assert "A worker died" not in done.stdout + done.stderr


# -- a controller on named nodes ----------------------------------------------------------------


class NamedLauncher(Launcher):
    """The fakes' launcher, its groups on Ray-shaped node ids with names and rank pids, each
    rank's self-check passing its compute check."""

    def __call__(self, cfg, **kw):
        group = super().__call__(cfg, **kw)
        group.node_names, group.pids = dict(NAMES), dict(PIDS)
        passed = [("compute", True, 0.1, "")]
        group.diagnose = lambda timeout_s: [report | {"checks": passed}
                                            for report in FakeGroup.diagnose(group, timeout_s)]
        return group


@pytest.fixture
def named(redis_server, monkeypatch):
    monkeypatch.setattr(controller_fakes, "NODES", (ID_A, ID_B))  # rank r on NODES[r // 2]
    clock = Clock()
    launcher = NamedLauncher(clock)

    def make(cfg, **kw):
        return Controller(cfg, redis_server.url, launch=launcher, clock=clock, sleep=lambda s: None,
                          serve_metrics=False, **kw)

    return make, launcher


def test_the_console_status_journal_and_metrics_name_a_dead_ranks_node(named, redis_client, tmp_path):
    make, launcher = named
    cfg = job("named-dead", output_dir=str(tmp_path))
    printed, reported = [], []
    c = make(cfg, on_event=printed.append, worker_deaths=lambda: reported.pop() if reported else [])
    drive_to_running(c)
    controller_fakes.beat_all(redis_client, cfg, 0, step=2, phase="forward")
    assert c.step() is JobState.RUNNING  # the heartbeats
    # Prometheus: `node` by name, `node_id` beside it.
    exposed = generate_latest(c.metrics.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(exposed)}
    beats = {(s.labels["rank"], s.labels["node"], s.labels["node_id"])
             for s in families["longrun_heartbeat_timestamp_seconds"].samples}
    assert ("1", "gpu-a (10.0.0.1)", ID_A) in beats and ("3", "gpu-b (10.0.0.2)", ID_B) in beats
    checks = {(s.labels["node"], s.labels["node_id"]) for s in families["longrun_diagnostics_ok"].samples}
    assert checks == {("gpu-a (10.0.0.1)", ID_A), ("gpu-b (10.0.0.2)", ID_B)}
    reported.append([parse_death(RAY_DEATH)])  # Ray's account of rank 1's death, as the kill lands
    launcher.groups[0].script.append([RankEnded(1, kind="dead",
                                                detail="rank 1's process died (ActorDiedError)")])
    assert c.step() is JobState.RECOVERING
    text = "\n".join(printed)
    assert ID_A not in text and ID_B not in text, text
    fault = next(line for line in printed if line.startswith("fault: rank 1's process died"))
    assert "; rank 1 was on node gpu-a (10.0.0.1), its last lines are in " in fault, fault
    state = next(line for line in printed if line.startswith("state RECOVERING: "))
    assert "rank 1 on node gpu-a (10.0.0.1) died" in state, state
    assert "ray: " not in text  # Ray's account of rank 1's death: the fault says it
    assert not reported  # taken
    # Machine-readable: the id, with the name beside it; the reasons read by status are named.
    status = job_status(redis_client, cfg.job.name, events=50)
    [event] = [e for e in status["events"] if e["type"] == "fault"]
    assert (event["node"], event["node_name"]) == (ID_A, "gpu-a (10.0.0.1)")
    assert "gpu-a (10.0.0.1)" in status["fields"]["reason"] and ID_A not in status["fields"]["reason"]
    assert json.loads(status["fields"]["node_names"]) == NAMES
    journal = read_journal(cfg.run_dir)
    assert [(e["node"], e["node_name"]) for e in journal.events if e["type"] == "fault"] == \
        [(ID_A, "gpu-a (10.0.0.1)")]
    (dead,) = [t for t in report_figures.timeline_figure(journal).data if t.name == "fault: dead"]
    assert "node gpu-a (10.0.0.1)" in dead.hovertext[0] and ID_A not in dead.hovertext[0]


def test_a_lost_node_is_evicted_by_name_and_status_shows_it_so(named, redis_client, tmp_path):
    make, launcher = named
    cfg = job("named-lost", output_dir=str(tmp_path))
    printed = []
    c = make(cfg, on_event=printed.append)
    drive_to_running(c)
    launcher.groups[0].script.append([
        RankEnded(0, kind="node_lost", detail=f"Ray reports node {ID_A} dead; rank 0's process went with it"),
        RankEnded(1, kind="dead", detail=f"rank 1's process went with its node {ID_A}")])
    assert c.step() is JobState.RECOVERING
    assert "evicted: node gpu-a (10.0.0.1) will not be used again" in printed, printed
    assert not any(ID_A in line for line in printed), printed
    status = job_status(redis_client, cfg.job.name, events=50)
    assert list(status["evicted"]) == [ID_A]  # the record keeps the id: placement reads it
    assert view_of_record(status, "the record").evicted == ["gpu-a (10.0.0.1)"]
    assert read_log("\n".join(printed)).evicted == ["gpu-a (10.0.0.1)"]


def test_a_death_ray_reports_of_a_process_that_is_no_rank_is_one_line(named, tmp_path):
    make, _ = named
    spare = WorkerDeath(pid=5200, node_id=ID_B, address="10.0.0.2", exit_type="SYSTEM_ERROR",
                        detail="Worker unexpectedly exits with a connection error code 2")
    rank = WorkerDeath(pid=PIDS[3], node_id=ID_B, address="10.0.0.2", exit_type="SYSTEM_ERROR", detail="")
    reported, printed = [], []
    c = make(job("named-spare", output_dir=str(tmp_path)), on_event=printed.append,
             worker_deaths=lambda: reported.pop() if reported else [])
    drive_to_running(c)
    reported.append([spare, rank])
    assert c.step() is JobState.RUNNING
    said = [line for line in printed if line.startswith("ray: ")]
    assert said == ["ray: a worker process (pid 5200) on gpu-b (10.0.0.2) died (SYSTEM_ERROR, Worker "
                    "unexpectedly exits with a connection error code 2)"]


def test_a_rank_that_fails_as_its_group_is_stopped_prints_no_traceback():
    """A surviving rank whose collective broke when its peer died raises on its own, in the
    moment between the controller hearing of the death and killing the group. Its error is
    the dead peer's fault, reported once by the controller; unread, Ray prints it as an
    'Unhandled error' with its coloured `ray::TrainWorker.run()` traceback. Made certain here:
    rank 0's run() has raised (the call queued behind it on the actor has answered) before
    the group, which never polled it, is stopped."""
    code = textwrap.dedent("""
        import gc, time, types, ray
        from longrun.controller.workers import RayWorkerGroup

        @ray.remote
        class TrainWorker:
            def __init__(self, rank):
                self.rank = rank
            def run(self):
                if self.rank == 0:
                    raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4100")
                time.sleep(600)  # a rank still training, as far as it knows
            def node_id(self):
                return ray.get_runtime_context().get_node_id()

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        actors = [TrainWorker.remote(rank) for rank in (0, 1)]
        node = ray.get(actors[0].node_id.remote())
        group = RayWorkerGroup(types.SimpleNamespace(node_ids=(node,), names={}), actors)
        group.start()
        ray.get(actors[0].node_id.remote())  # runs after rank 0's run() has raised
        group.stop()
        del group, actors
        gc.collect()
        ray.shutdown()
        print("stopped")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          env=os.environ | {"RAY_COLOR_PREFIX": "0"})
    said = done.stdout + done.stderr
    assert "stopped" in done.stdout, said[-3000:]
    assert "Unhandled error" not in said and "TrainWorker" not in said and "\x1b" not in said, said[-3000:]
