"""Simulated multi-node Ray clusters for the controller tests (one process tree, loopback), the
weights a job on one committed, a controller run in a thread, its workers signalled from
outside, and what a command left running."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import psutil


@contextlib.contextmanager
def simulated_cluster(nodes: int, cpus_per_node: int) -> Iterator:
    """A local multi-node Ray cluster (a head without CPUs and `nodes` worker nodes), connected
    to for the duration: yields (cluster, worker nodes). Workers run one thread each (several
    share 2 cores; raylets pass OMP_NUM_THREADS on)."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ["OMP_NUM_THREADS"] = "1"
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    workers = [c.add_node(num_cpus=cpus_per_node) for _ in range(nodes)]
    c.wait_for_nodes()
    ray.init(address=c.address)
    try:
        yield c, workers
    finally:
        ray.shutdown()
        c.shutdown()


def committed_weights(checkpoint_dir: str, step: int) -> dict:
    """The full model weights of committed checkpoint `step` under `checkpoint_dir` (any layout)."""
    import fsspec

    from longrun.checkpoint.catalog import load_model_weights
    from longrun.checkpoint.restore import read_manifest

    fs, root = fsspec.core.url_to_fs(checkpoint_dir)
    return load_model_weights(fs, root, step, read_manifest(fs, root, step))


def run_in_thread(cfg, redis_url):
    from longrun.controller.controller import Controller

    """The job's controller in a thread; `result` gets its summary, and "ran" the wall-clock
    times (seconds since the epoch) before the controller was built and after it returned."""
    result: dict = {}
    started = time.time()
    controller = Controller(cfg, redis_url)

    def run():
        result.update(controller.run())
        result["ran"] = (started, time.time())
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def wait_for(redis_client, job: str, *, step: int | None = None, state: str | None = None,
             timeout: float = 300):
    from longrun.controller.job_state import JobRecordStore
    store, deadline = JobRecordStore(redis_client, job), time.monotonic() + timeout
    while True:
        record = store.read()
        if record is not None and (step is None or record.step >= step) and (
                state is None or record.state == state):
            return record
        assert time.monotonic() < deadline, f"{job} never reached step {step} / state {state}"
        time.sleep(0.05)  # polling the job record another process writes


def training_workers() -> list[psutil.Process]:
    """This test's worker processes now training (Ray titles them after the task they run),
    newest first: the current job's, not the last job's still exiting. Only this process's
    descendants (its Ray cluster's raylets start them): a test on another worker of the suite
    runs a job of its own at the same time, whose workers are not this test's to signal."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmdline = p.cmdline()
            if cmdline and cmdline[0].startswith("ray::TrainWorker.run") and p.is_running():
                found.append((p.create_time(), p))
        except psutil.NoSuchProcess:
            continue
    return [p for _, p in sorted(found, key=lambda found: found[0], reverse=True)]


def signal_a_worker(sig: int) -> psutil.Process:
    for victim in training_workers():
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.send_signal(sig)
            return victim
    raise AssertionError("no training worker to signal")


MARK = "LONGRUN_TEST_MARK"


def marked_processes(mark: str) -> list[int]:
    """Processes whose environment has MARK=`mark`: what a command run with it started and left
    behind (its servers inherit its environment). Not every Ray or Redis on the machine: a test
    on another worker of the suite starts and stops its own meanwhile."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for pid in psutil.pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(pid)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found
