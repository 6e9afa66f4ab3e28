"""The soak's faults, injected from outside longrun (not a bench itself): nothing here goes through
longrun's own injector (`health.faults`), and nothing waits for a moment that suits the job
(a snapshot just sent, a checkpoint just committed). A fault that needs something to hit (a
training worker, a node holding one) waits until there is one: between attempts there is none.

Each `_<kind>` does the fault and returns what it did; a fault with a second half (the node
comes back, the disk is freed, the frozen process is reaped) leaves it to `Deferred`, which the
soak's loop runs when its condition holds. Just before the blow each calls `world.hit()`, which
reads the step every rank reported last (the soak's own count of steps lost); what must fail
the soak (a frozen worker nobody noticed) goes to `world.fail()`."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import psutil
from _soak_probe import processes, spare_workers, training_workers

from longrun.checkpoint.layout import committed_steps, step_dir_name

KINDS = ("worker_kill", "worker_stop", "node_loss", "redis_kill", "run_sigterm", "checkpoint_corrupt",
         "disk_full", "controller_kill", "keeper_kill", "spare_kill", "startup_kill")
DISK_FULL_AFTER_FAULT_S = 120.0  # the longest the disk stays full after the fault it caused
PRECONDITION_WAIT_S = 300.0  # how long a fault waits for something to hit before it is given up
STOP_DETECTION_S = 180.0  # a SIGSTOPped worker still there after this was not detected: the soak fails


@dataclass
class Deferred:
    """The second half of a fault: `action` once `ready()` holds (checked by the soak's loop)."""

    what: str
    ready: Callable[[], bool]
    action: Callable[[], None]


class FaultError(RuntimeError):
    """A fault could not be injected (nothing to hit in time, no tmpfs); the soak reports it."""


def wait_for(what: str, found: Callable[[], Any], timeout: float = PRECONDITION_WAIT_S,
             ended: Callable[[], bool] = lambda: False, meanwhile: Callable[[], None] = lambda: None) -> Any:
    """`found()`'s first true value, looked for every 0.2 s; `meanwhile()` runs at each look (the
    soak's earlier faults' second halves: a wait here must not hold a full disk full)."""
    deadline = time.monotonic() + timeout
    while True:
        meanwhile()
        value = found()
        if value:
            return value
        if ended():  # the job's `longrun run` exited: nothing more will come, and the soak's clock stops
            raise FaultError(f"nothing to inject into: the job's run exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise FaultError(f"nothing to inject into: {what} for {timeout:g} s")
        time.sleep(0.2)  # the job's processes and record change in other processes


class Faults:
    """The kinds, against one soak (`world`: its cluster, Redis, runner, disk, record)."""

    def __init__(self, world, rng: random.Random):
        self.world, self.rng = world, rng
        self.stopped: list[psutil.Process] = []  # SIGSTOPped by us: reaped in cleanup()

    def run_ended(self) -> bool:
        return self.world.runner.poll() is not None

    def _wait(self, what: str, found: Callable[[], Any]) -> Any:
        """`wait_for` while the job's run lives, tending the earlier faults' second halves."""
        return wait_for(what, found, ended=self.run_ended, meanwhile=self.world.tend)

    def inject(self, kind: str) -> tuple[str, list[Deferred]]:
        return getattr(self, f"_{kind}")()

    # -- processes ----------------------------------------------------------------------------
    def _victim(self) -> psutil.Process:
        """A worker of the job while it trains (not one of an attempt being torn down)."""

        def running_workers():
            return (self.world.record() or {}).get("state") == "RUNNING" and training_workers()

        return self.rng.choice(self._wait("a training worker", running_workers))

    def _worker_kill(self):
        victim = self._victim()
        self.world.hit()
        victim.send_signal(signal.SIGKILL)
        return f"SIGKILL to worker pid {victim.pid}", []

    def _startup_kill(self):
        """A worker SIGKILLed while the job trains, then one of the next attempt's workers
        SIGKILLed while that attempt is still starting (placement, rendezvous or restore)."""
        first = self._victim()
        attempt = int(float((self.world.record() or {}).get("attempt", 0)))
        old = {p.pid for p in training_workers()}  # the failing attempt's: torn down, not starting
        self.world.hit()
        first.send_signal(signal.SIGKILL)

        def starting_worker():
            # The controller records RUNNING once the ranks' `run` is called: their groups, model
            # and restore come after, until the step ledger says training began.
            record = self.world.record() or {}
            now = int(float(record.get("attempt", 0)))
            if now <= attempt or self.world.steps.training_began(now):
                return None
            return [p for p in training_workers() if p.pid not in old]

        second = self.rng.choice(self._wait("a worker of the next attempt while it starts", starting_worker))
        time.sleep(self.rng.uniform(0.0, 0.5))  # somewhere in its start, not always its first moment
        record = self.world.record() or {}
        began = self.world.steps.training_began(int(float(record.get("attempt", 0))))
        second.send_signal(signal.SIGKILL)
        return (f"SIGKILL to worker pid {first.pid} while training, then to pid {second.pid} of the "
                f"next attempt in state {record.get('state')}, "
                f"{'after training began' if began else 'before training began (start-up or restore)'}", [])

    def _spare_kill(self):
        def spares():
            return (self.world.record() or {}).get("state") == "RUNNING" and spare_workers()

        victim = self.rng.choice(self._wait("a warm spare", spares))
        self.world.hit()
        victim.send_signal(signal.SIGKILL)
        return f"SIGKILL to warm spare pid {victim.pid}", []

    def _keeper_kill(self):
        def keepers():
            return (self.world.record() or {}).get("state") == "RUNNING" and processes("keepers", None)

        victim = self.rng.choice(self._wait("a snapshot keeper", keepers))
        self.world.hit()
        victim.send_signal(signal.SIGKILL)
        return f"SIGKILL to snapshot keeper pid {victim.pid}", []

    def _worker_stop(self):
        victim = self._victim()
        self.world.hit()
        victim.send_signal(signal.SIGSTOP)
        self.stopped.append(victim)
        started = time.monotonic()

        def gone() -> bool:
            return not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE

        def reap() -> None:
            if not gone():  # the controller did not kill it within the time: a hang went unseen
                self.world.fail(f"worker pid {victim.pid} still frozen {time.monotonic() - started:.0f} s "
                                "after its SIGSTOP: the hang was not detected (killed by the soak)")
                with contextlib.suppress(psutil.NoSuchProcess):
                    victim.kill()

        return (f"SIGSTOP to worker pid {victim.pid}",
                [Deferred("the frozen worker gone",
                          lambda: gone() or time.monotonic() - started > STOP_DETECTION_S, reap)])

    # -- the cluster --------------------------------------------------------------------------
    def _node_loss(self):
        cluster = self.world.cluster

        def job_node():
            record = self.world.record() or {}
            if record.get("state") != "RUNNING" or not training_workers():
                return None
            ids = set(json.loads(record.get("nodes", "[]")))
            live = [n for n in cluster.list_all_nodes() if n.node_id in ids and not n.head]
            return sorted(live, key=lambda n: n.node_id)

        node = self.rng.choice(self._wait("a node running the job", job_node))
        self.world.hit()
        cluster.remove_node(node, allow_graceful=False)  # a lost host says nothing
        back_after = self.rng.uniform(10.0, 40.0)
        due = time.monotonic() + back_after

        def give_back() -> None:
            cluster.add_node(**self.world.node_args())
            self.world.note("a node joined the cluster (the lost one's replacement)")

        return (f"removed Ray node {node.node_id[:12]} (back in {back_after:.0f} s)",
                [Deferred("the node back", lambda: time.monotonic() >= due, give_back)])

    def _redis_kill(self):
        outage = self.rng.uniform(2.0, 6.0)
        self.world.hit()
        self.world.redis.kill()
        time.sleep(outage)  # the outage is the fault itself
        self.world.redis.restart()
        return f"SIGKILL to redis-server, restarted after {outage:.1f} s with its append-only file", []

    # -- the job's process --------------------------------------------------------------------
    def _run_sigterm(self):
        runner = self.world.runner
        pid = runner.pid
        self.world.hit()
        code = runner.terminate()  # waits for it to exit (the grace bounds its save)
        if code == 0:
            return f"SIGTERM to longrun run pid {pid}: it had finished the job (exit 0)", []
        runner.start()
        return f"SIGTERM to longrun run pid {pid}: exit {code}; rerun as pid {runner.pid}", []

    def _controller_kill(self):
        """SIGKILL to `longrun run` alone (a crashed host of the driver, an OOM kill): Ray reaps
        the actors it owned, the workers; the snapshot keepers (detached) stay. Then the same
        command again, which takes the job over (at once: its lease proves the holder dead on this
        machine) and restores from the keepers."""
        runner = self.world.runner

        def training():
            return (self.world.record() or {}).get("state") == "RUNNING"

        self._wait("the job training", training)
        pid = runner.pid
        self.world.hit()
        code = runner.kill_controller()
        if code == 0:
            return f"SIGKILL to longrun run pid {pid}: it had finished the job (exit 0)", []
        runner.start()
        return f"SIGKILL to longrun run pid {pid}: exit {code}; rerun as pid {runner.pid}", []

    # -- storage ------------------------------------------------------------------------------
    def _checkpoint_corrupt(self):
        """Bit rot in the newest committed checkpoint, then a restore that must read storage:
        every snapshot keeper SIGKILLed and a training worker with them, at a moment when no
        newer save is due or in flight (so the restore's newest candidate is the corrupted one).
        The restore must find the damage, skip that step and take the one before."""
        fs, root = fsspec.core.url_to_fs(str(self.world.checkpoint_dir))
        interval = self.world.interval_steps

        def newest_files():
            fs.invalidate_cache()
            record = self.world.record() or {}
            running = record.get("state") == "RUNNING"
            step_now = int(float(record.get("step", 0)))
            steps = committed_steps(fs, root)
            # Two committed at least: the one corrupted and the one a restore falls back to (a full
            # disk earlier may have cost a save).
            if not running or len(steps) < 2 or steps[-1] != step_now // interval * interval \
                    or not 1 <= step_now - steps[-1] <= interval - 3:
                return None  # the newest save still in flight, or the next one about to start
            directory = Path(root) / step_dir_name(steps[-1])
            with contextlib.suppress(FileNotFoundError):
                files = sorted(p for p in directory.iterdir() if p.suffix == ".distcp")
                if files:
                    return steps[-1], files
            return None

        step, files = self._wait("a committed checkpoint with no newer save due", newest_files)
        target = self.rng.choice(files)
        size = target.stat().st_size
        offset = self.rng.randrange(max(1, size - 64))
        with open(target, "r+b") as f:  # bit rot: flipped bits the checksums must catch
            f.seek(offset)
            chunk = f.read(64)
            f.seek(offset)
            f.write(bytes(b ^ 0xFF for b in chunk))
        self.world.hit(corrupted=step)
        keepers = processes("keepers", None)
        for keeper in keepers:  # no memory snapshot left: the restore must read storage
            with contextlib.suppress(psutil.NoSuchProcess):
                keeper.send_signal(signal.SIGKILL)
        victim = self.rng.choice(self._wait("a training worker", training_workers))
        victim.send_signal(signal.SIGKILL)
        return (f"flipped 64 bytes at offset {offset} of {target.name} in checkpoint step {step}; "
                f"SIGKILL to {len(keepers)} snapshot keeper(s) and worker pid {victim.pid}", [])

    def _disk_full(self):
        disk = self.world.disk
        if disk is None:
            raise FaultError("no tmpfs for the checkpoints (not root, or mounting failed): "
                             "the full-disk fault is skipped")
        record = self.world.record() or {}
        step = int(float(record.get("step", 0)))
        attempt = int(float(record.get("attempt", 0)))
        interval = self.world.interval_steps
        # Full until a save was due while it was full and the next one too (an asynchronous
        # save's failure surfaces at the next save) when the job rides it out; when it declares
        # a fault, full through the restart: until an attempt after it trains (its restore, and
        # the save a restart from memory writes at once, meet the full disk).
        until = (step // interval + 2) * interval + 1
        self.world.hit()
        filled = disk.fill()
        started, wall = time.monotonic(), time.time()
        declared: list[float] = []

        def done() -> bool:
            now = self.world.record() or {}
            if not declared and self.world.declared_since(wall):
                declared.append(time.monotonic())
            if declared:
                restarted = int(float(now.get("attempt", 0))) > attempt and now.get("state") == "RUNNING"
                return restarted or time.monotonic() - declared[0] > DISK_FULL_AFTER_FAULT_S
            return int(float(now.get("step", 0))) >= until or time.monotonic() - started > 120

        def free() -> None:
            disk.free()
            self.world.note("the checkpoint disk has room again")

        return (f"filled the checkpoint tmpfs ({filled / 2**20:.1f} MiB) at step {step}; freed once a "
                f"restart trains again after the fault it causes (or at step {until} without one)",
                [Deferred("the disk freed", done, free)])

    def cleanup(self) -> None:
        for proc in self.stopped:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


class Tmpfs:
    """A small tmpfs for the checkpoints (the full-disk fault), mounted in the soak's own mount
    namespace where it can make one, so it vanishes with the soak whatever happens."""

    def __init__(self, path: Path, size_mb: int):
        self.path, self.size_mb = path, size_mb
        self.filler = path / ".soak-filler"
        self.mounted = False

    def mount(self) -> str | None:
        """Mount; None on success, else why not."""
        self.path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m", "soak-checkpoints",
                               str(self.path)], capture_output=True, text=True)
        if done.returncode != 0:
            return (done.stderr or done.stdout).strip() or f"mount exited {done.returncode}"
        self.mounted = True
        return None

    def fill(self) -> int:
        """Write until the disk is full; the bytes written."""
        written, chunk = 0, b"\0" * (1 << 20)
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in (1 << 20, 1 << 12, 1):
                while True:
                    try:
                        written += os.write(fd, chunk[:size])
                    except OSError:  # ENOSPC: this size no longer fits
                        break
        finally:
            os.close(fd)
        return written

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
            self.mounted = False


def private_mounts() -> bool:
    """Move this process into a mount namespace of its own whose mounts do not propagate back,
    so the tmpfs is never seen outside and dies with the soak. Must run before any thread."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        return False
    return subprocess.run(["mount", "--make-rprivate", "/"], capture_output=True).returncode == 0
