"""The soak itself (not a bench): one `longrun run` on a simulated 3-node Ray cluster with its own
Redis, faults from outside at seeded random times, samples throughout, the reference run and the
report. bench/soak.py (the hour) and tests/test_soak.py (the bounded version) both run this.

The soak's wall clock starts when the first `longrun run` is launched and stops when the last
one exits: it is goodput's denominator across reruns (`goodput_clock`; time between a killed
run's exit and its rerun's first record counts too), beside the job's own (`goodput_ledger`)."""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _soak_faults import KINDS, Deferred, FaultError, Faults, Tmpfs
from _soak_job import (
    CPUS_PER_NODE,
    INTERVAL_STEPS,
    JOB,
    KEEP_LAST,
    NODES,
    REFERENCE_JOB,
    ffn_for,
    reference_job,
    soak_job,
    state_mb_of,
    write_job,
)
from _soak_probe import ROLES, Probe, flatness, read_goodput, read_record
from _soak_steps import StepWatch

from longrun.services import EmbeddedRedis
from longrun.services.ports import free_port

EXIT_PREEMPTED = 75
STARTUP_EST_S = 40.0  # `longrun run` to the first step on this machine (torch, Ray, placement)
# What a fault costs here; half is counted, so the job runs a little long rather than short.
FAULT_COST_EST_S = 12.0
# The model's step on top of the pacing: a fixed part (the update's and the ledger's bookkeeping)
# and a part per MB of state. Measured on the 2-core machine at 512 MB (2026-11-29, snapshots at
# the auto interval, the save every 10 steps and three keepers sharing the cores): about 1.8 s a
# paced step, 1.9 s with the faults' restarts (it was 5 s on the slower VM of 2026-11-26, when the
# estimate was 0.0075 s per MB and the hour's job ended after half its faults on this one). A
# little low, so the job outlasts its faults rather than ending before the last.
STEP_FIXED_EST_S = 0.1
COMPUTE_EST_S_PER_MB = 0.0012
# The default state: each rank's half sent to the keepers at the 0.18-0.36 GB/s of bench/lose_no_step.py's
# 3 GB run (a snapshot every 2 steps of 8.4 s) takes half a paced step or more.
STATE_MB = 512.0


def estimated_step_s(pace_s: float, state_mb: float) -> float:
    """A paced step's estimated seconds on this machine: the pacing and the model's own."""
    return pace_s + STEP_FIXED_EST_S + COMPUTE_EST_S_PER_MB * state_mb


@dataclass
class Plan:
    minutes: float
    kinds: list[str]  # one fault per entry, in order
    every_s: float  # one fault at a random moment of each slot of this length
    pace_s: float
    steps: int
    seed: int
    state_mb: float = STATE_MB  # the job's training state (weights and AdamW moments), both ranks

    @property
    def ffn_dim(self) -> int:
        return ffn_for(self.state_mb)

    @property
    def step_s(self) -> float:
        """A paced step's estimated seconds on this machine: the pacing and the model's own."""
        return estimated_step_s(self.pace_s, self.state_mb)

    @classmethod
    def of(cls, minutes: float, *, seed: int, every_s: float | None = None, kinds: list[str] | None = None,
           pace_s: float = 1.0, steps: int | None = None, state_mb: float = STATE_MB) -> Plan:
        """A fault every `every_s` (default 120) over the planned time, kinds in a seeded
        order that cycles through all of them; or exactly `kinds`, spread over the time."""
        rng = random.Random(seed)
        horizon = max(30.0, minutes * 60 - STARTUP_EST_S)
        if kinds is None:
            every_s = every_s or 120.0
            count = max(1, int(horizon // every_s))
            order: list[str] = []
            while len(order) < count:
                order += rng.sample(KINDS, len(KINDS))
            kinds = order[:count]
        every_s = every_s or horizon / (len(kinds) + 1)
        if steps is None:  # the job outlasts the last fault's slot by about two slots more
            busy = (len(kinds) + 2) * every_s
            steps = int((busy - len(kinds) * FAULT_COST_EST_S / 2) / estimated_step_s(pace_s, state_mb))
        return cls(minutes, kinds, every_s, pace_s, max(steps, 20), seed, state_mb)


@dataclass
class Injected:
    kind: str
    at_s: float  # soak clock
    wall: float
    step: int
    detail: str = ""
    error: str | None = None
    attempt: int | None = None  # the job's attempt when the fault struck
    hit_wall: float | None = None  # when it struck (after waiting for something to hit)
    reported: int | None = None  # the newest step any rank reported finishing just before
    reported_end: int | None = None  # ... and the newest the struck attempt reported at all (set at the end)
    corrupted: int | None = None  # checkpoint_corrupt: the committed step whose bytes were flipped


class RedisHandle:
    """The soak's Redis: append-only, so a SIGKILLed server restarted on the same port with the
    same password keeps the job record, as a production Redis with persistence would."""

    def __init__(self, workdir: Path):
        self.port, self.password, self.data = free_port(), secrets.token_urlsafe(16), workdir / "redis-data"
        self.server: EmbeddedRedis | None = None
        self.restarts = 0

    def start(self) -> RedisHandle:
        self.server = EmbeddedRedis(port=self.port, password=self.password, persist_dir=self.data).start()
        return self

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        assert self.server is not None and self.server.process is not None
        os.kill(self.server.process.pid, signal.SIGKILL)  # a crash: no shutdown, no final save
        self.server.stop()

    def restart(self) -> None:
        self.start()
        self.restarts += 1

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


class Runner:
    """`longrun run job.yaml`, in a session of its own (a SIGTERM reaches it alone), appended to
    one log; run again after a preemption."""

    def __init__(self, config: Path, log: Path, grace_s: float):
        self.config, self.log, self.grace_s = config, log, grace_s
        self.proc: subprocess.Popen | None = None
        self.exits: list[int] = []
        self.launches: list[float] = []  # wall times (time.time()) of each launch ...
        self.ended: list[float] = []  # ... and of each exit seen

    def start(self) -> None:
        env = os.environ | {"OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0", "COLUMNS": "200",
                            "RAY_USAGE_STATS_ENABLED": "0"}
        with open(self.log, "ab") as out:
            out.write(f"\n===== longrun run (launch {len(self.launches) + 1}) =====\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "longrun.cli", "run", str(self.config)], cwd=self.config.parent,
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        self.launches.append(time.time())

    def lifetimes(self) -> list[tuple[float, float]]:
        """(launch, exit) wall times of each run that ended."""
        return list(zip(self.launches, self.ended, strict=False))

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def poll(self) -> int | None:
        assert self.proc is not None
        code = self.proc.poll()
        if code is not None and len(self.exits) < len(self.launches):
            self.exits.append(code)
            self.ended.append(time.time())
        return code

    def terminate(self) -> int:
        """SIGTERM (a scheduler's preemption) and wait for the exit, up to the grace and a minute."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(self.grace_s + 60)
        except subprocess.TimeoutExpired:
            self.kill()
        code = self.poll()
        assert code is not None
        return code

    def kill_controller(self) -> int:
        """SIGKILL to `longrun run` alone (not its session: the Ray actors it owned are Ray's to
        reap), and its exit."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(60)
        code = self.poll()
        assert code is not None
        return code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@dataclass
class Soak:
    plan: Plan
    say: Any  # a progress line to stderr
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="longrun-soak-")))
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # what fails the soak, found by a fault's second half

    # -- what the faults see (the `world` of _soak_faults) -------------------------------------
    interval_steps = INTERVAL_STEPS

    def note(self, text: str) -> None:
        self.notes.append(f"{self.clock():.0f}s {text}")
        self.say(text)

    def fail(self, text: str) -> None:
        self.failures.append(text)
        self.note(f"FAIL: {text}")

    def hit(self, *, corrupted: int | None = None) -> None:
        """A fault strikes now: what every rank reported last, read from outside, just before."""
        fault = self._striking
        fault.corrupted = corrupted
        record = self.record() or {}
        fault.attempt = int(float(record["attempt"])) if record.get("attempt") is not None else None
        fault.hit_wall = time.time()
        fault.reported = self.steps.last_reported(fault.attempt)

    @property
    def tmpfs_mb(self) -> int:
        """Room for the checkpoints kept, one being written and one being deleted, and 64 MiB."""
        return int(state_mb_of(self.plan.ffn_dim) * (KEEP_LAST + 2)) + 64

    def node_args(self) -> dict:
        return {"num_cpus": CPUS_PER_NODE}

    def record(self) -> dict[str, str] | None:
        """The job record now, or the last one read while Redis is down or loading its file."""
        record = read_record(self.redis.url, JOB)
        if record is not None:
            self._last_record = record
        return record or getattr(self, "_last_record", None)

    def declared_since(self, wall: float) -> bool:
        goodput = read_goodput(self.redis.url, JOB) or {}
        faults = goodput.get("faults") or []
        return any(float(f.get("declared_at", 0)) >= wall for f in faults if isinstance(f, dict))

    def tend(self) -> None:
        """The second half of each earlier fault whose moment has come (free the disk, bring the
        node back, reap the frozen worker): from the soak's loop, and from any wait inside an
        injection, so that one fault's wait never stretches another's."""
        for item in [d for d in getattr(self, "deferred", []) if _ready(d)]:
            self.deferred.remove(item)
            item.action()

    def clock(self) -> float:
        return time.monotonic() - self.t0 if getattr(self, "t0", None) else 0.0

    # -- the run ------------------------------------------------------------------------------
    def run(self, *, private_mounts_ok: bool) -> dict[str, Any]:
        from ray.cluster_utils import Cluster

        plan = self.plan
        self.say(f"plan: {len(plan.kinds)} fault(s) {plan.kinds}, one per {plan.every_s:.0f} s, {plan.steps} "
                 f"steps paced {plan.pace_s:g} s, state {state_mb_of(plan.ffn_dim)} MB, seed {plan.seed}; "
                 f"in {self.workdir}")
        ckpt = self.workdir / "checkpoints"
        self.disk: Tmpfs | None = Tmpfs(ckpt, self.tmpfs_mb)
        why = self.disk.mount()
        if why is not None:
            self.note(f"no tmpfs for the checkpoints ({why}): the full-disk fault will be skipped")
            self.disk = None
        elif not private_mounts_ok:
            self.note("the tmpfs is mounted in the host's mount namespace; it is unmounted at the end")
        self.checkpoint_dir = ckpt
        self.redis = RedisHandle(self.workdir).start()
        self.cluster = None
        self.runner: Runner | None = None
        self.faults = Faults(self, random.Random(self.plan.seed + 1))
        try:
            os.environ["OMP_NUM_THREADS"] = "1"  # raylets pass it on to the workers
            self.say(f"starting a {NODES}-node Ray cluster")
            self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
            for _ in range(NODES):
                self.cluster.add_node(**self.node_args())
            self.cluster.wait_for_nodes()
            result = self._soak()
            result |= self._reference(result["steps_done"])
            return result
        finally:
            self._teardown()

    def _soak(self) -> dict[str, Any]:
        plan = self.plan
        job = soak_job(self.workdir / "out", plan.steps, ray_address=self.cluster.address,
                       redis_url=self.redis.url, checkpoint_dir=self.checkpoint_dir, pace_s=plan.pace_s,
                       ffn_dim=plan.ffn_dim)
        config = write_job(self.workdir / "soak.yaml", job)
        self.runner = Runner(config, self.workdir / "soak.log", job["recovery"]["preemption_grace_s"])
        self.steps = StepWatch(self.redis.url, JOB)
        self.t0 = time.monotonic()
        self.runner.start()
        self.probe = Probe(self.t0, every_s=max(2.0, min(15.0, plan.every_s / 8)),
                           controller_pid=self.runner.pid, redis_url=self.redis.url, job=JOB).start()
        schedule: list[tuple[float, str]] | None = None
        injected: list[Injected] = []
        self.deferred: list[Deferred] = []
        failure, last_progress, first_step_at = None, -1e9, None
        progress_every = 10.0 if plan.minutes <= 10 else 30.0
        hard_stop = max(plan.minutes * 60 * 3, plan.minutes * 60 + 600)
        rng = random.Random(plan.seed)
        while True:
            code = self.runner.poll()
            if code is not None:
                if code == 0:
                    break
                if code == EXIT_PREEMPTED:  # ours are rerun inside the fault: this one stopped by itself
                    failure = (f"longrun run exited {EXIT_PREEMPTED} (preempted) without a SIGTERM from "
                               f"the soak; see {self.runner.log}")
                    break
                failure = f"longrun run exited {code}; see {self.runner.log}"
                break
            if self.failures:
                failure = self.failures[0]
                self.runner.terminate()
                break
            record = self.record() or {}
            step = int(float(record.get("step", 0)))
            if record.get("attempt") is not None:
                self.steps.look(int(float(record["attempt"])))
            if first_step_at is None and step >= 1:
                first_step_at = self.clock()
                schedule = [(first_step_at + i * plan.every_s + rng.uniform(0, plan.every_s), kind)
                            for i, kind in enumerate(plan.kinds)]
                self.say(f"first step at {first_step_at:.0f} s; faults at "
                         + ", ".join(f"{at:.0f} s {kind}" for at, kind in schedule))
            self.tend()
            if schedule and schedule[0][0] <= self.clock():
                _, kind = schedule.pop(0)
                self.deferred += self._inject(kind, step, injected)
                self.probe.controller_pid = self.runner.pid
                continue
            if self.clock() - last_progress >= progress_every:
                last_progress = self.clock()
                self._progress(record, injected)
            if self.clock() > hard_stop:
                failure = f"the job did not finish within {hard_stop / 60:.0f} minutes"
                self.runner.terminate()
                break
            time.sleep(0.25)  # the job runs in other processes; this loop only looks and injects
        wall_s = self.clock()
        for item in self.deferred:  # the job ended: free the disk, reap what we froze, return nodes
            item.action()
        if failure is None and self.failures:  # found by a second half run just now
            failure = self.failures[0]
        self.probe.stop()
        record = self.record() or {}
        if schedule:
            self.note(f"{len(schedule)} planned fault(s) not injected: the job ended first")
        goodput = read_goodput(self.redis.url, JOB)
        return self._report(wall_s, record, injected, goodput, failure, first_step_at or 0.0)

    def _inject(self, kind: str, step: int, injected: list[Injected]) -> list[Deferred]:
        fault = Injected(kind, self.clock(), time.time(), step)
        injected.append(fault)
        self._striking = fault
        self.say(f"fault {len(injected)}/{len(self.plan.kinds)}: {kind} at step {step}")
        try:
            fault.detail, later = self.faults.inject(kind)
        except FaultError as exc:
            fault.error = str(exc)
            self.note(f"fault {kind} not injected: {exc}")
            return []
        self.say(f"  {fault.detail}")
        return later

    def _progress(self, record: dict[str, str], injected: list[Injected]) -> None:
        goodput = read_goodput(self.redis.url, JOB) or {}
        share = goodput.get("goodput")
        self.say(f"{self.clock():6.0f} s | {record.get('state', '?'):<11} step {record.get('step', '?')}/"
                 f"{self.plan.steps} attempt {record.get('attempt', '?')} run {len(self.runner.launches)} | "
                 f"faults {len(injected)}/{len(self.plan.kinds)} | goodput "
                 f"{'?' if share is None else f'{float(share):.3f}'}")

    # -- the report ---------------------------------------------------------------------------
    def _report(self, wall_s: float, record: dict[str, str], injected: list[Injected],
                goodput: dict[str, Any] | None, failure: str | None, warm_s: float) -> dict[str, Any]:
        from _soak_report import by_kind, fault_outcomes, goodput_summary, snapshot_intervals

        steps_done = int(float(record.get("step", 0)))
        for fault in injected:
            fault.reported_end = self.steps.last_seen(fault.attempt)
        log_text = self.runner.log.read_text(errors="replace") if self.runner.log.exists() else ""
        intervals = snapshot_intervals(self.workdir / "out" / JOB / "logs")
        wall_at_zero = time.time() - self.clock()
        outcomes = fault_outcomes(injected, goodput, steps_done=steps_done,
                                  finished=failure is None and record.get("state") == "SUCCEEDED",
                                  restores=self.steps.restores, interval=INTERVAL_STEPS, log_text=log_text,
                                  memory_intervals=intervals)
        lost = [o["steps_lost"] for o in outcomes if o["steps_lost"] is not None]
        counts, lost_by_kind = by_kind(outcomes)
        samples = self.probe.samples
        # Each role judged by its largest process (a leak grows a process; the number of
        # processes changes with evictions and replaced nodes, which moves a role's sum). A role
        # with no process at a sample (the keepers between a kill and the next attempt) has no
        # level there: it would pull a quarter's median to 0.
        rss = {role: flatness(samples, warm_s, lambda s, r=role: s.rss_largest_mb.get(r) or None)
               for role in ROLES}
        role_sums = {role: flatness(samples, warm_s, lambda s, r=role: s.rss_mb[r] or None) for role in ROLES}
        total_rss = flatness(samples, warm_s, lambda s: sum(s.rss_mb.values()))
        keys = flatness(samples, warm_s, lambda s: s.redis_keys)
        return {
            "minutes": round(wall_s / 60, 2), "planned_minutes": self.plan.minutes, "seed": self.plan.seed,
            "steps": self.plan.steps, "steps_done": steps_done, "pace_s": self.plan.pace_s,
            "state_mb": state_mb_of(self.plan.ffn_dim), "interval_steps": INTERVAL_STEPS,
            # (attempt, the soak clock's second, interval), as the fault log's `at_s`
            "snapshot_intervals": [[a, round(wall - wall_at_zero, 1), k] for a, wall, k in intervals],
            "state": record.get("state"), "failure": failure,
            "faults": sum(o["injected"] for o in outcomes), "faults_planned": len(self.plan.kinds),
            "faults_by_kind": counts, "steps_lost_by_kind": lost_by_kind, "fault_log": outcomes,
            **goodput_summary(goodput, wall_s, self.runner.lifetimes()),
            "steps_lost_max": max(lost) if lost else None,
            "redis_keys_max": keys["max"], "redis_keys": keys, "redis_restarts": self.redis.restarts,
            "rss_growth_mb": total_rss["growth"], "rss_mb": rss | {"total": total_rss},
            "rss_role_sums_mb": role_sums,
            "controller_loaded_torch": any(s.controller_torch for s in samples),
            "runs": len(self.runner.launches), "exit_codes": self.runner.exits, "notes": self.notes,
        }

    # -- the uninterrupted run ----------------------------------------------------------------
    def _reference(self, steps: int) -> dict[str, Any]:
        """The same steps unpaced and fault-free on the same cluster and layout; its final
        weights against the soak's, bit for bit."""
        if steps != self.plan.steps:
            return {"bitwise_equal": None, "final_checkpoint": None, "reference_s": None}
        try:
            soak = final_weights(self.checkpoint_dir, steps)
        except (OSError, ValueError) as exc:  # ManifestError is a ValueError
            self.note(f"the job ended SUCCEEDED without a committed checkpoint of its last step {steps} "
                      f"({exc}): nothing to compare")
            return {"bitwise_equal": None, "final_checkpoint": False, "reference_s": None}
        self.say(f"the uninterrupted reference run: {steps} steps, unpaced")
        for _ in range(NODES - len([n for n in self.cluster.list_all_nodes() if not n.head])):
            self.cluster.add_node(**self.node_args())  # a node still out when the job ended
        config = write_job(self.workdir / "reference.yaml",
                           reference_job(self.workdir / "reference", steps, ray_address=self.cluster.address,
                                         ffn_dim=self.plan.ffn_dim))
        runner = Runner(config, self.workdir / "reference.log", 60.0)
        started = time.monotonic()
        runner.start()
        assert runner.proc is not None
        code = runner.proc.wait()
        took = round(time.monotonic() - started, 1)
        if code != 0:
            self.note(f"the reference run exited {code}; see {runner.log}")
            return {"bitwise_equal": None, "final_checkpoint": True, "reference_s": took}
        want = final_weights(self.workdir / "reference" / REFERENCE_JOB / "checkpoints", steps)
        import torch

        differ = sorted(n for n in want if n not in soak or not torch.equal(soak[n], want[n]))
        if differ:
            self.note(f"weights differ from the uninterrupted run: {differ[:5]}")
        return {"bitwise_equal": not differ and soak.keys() == want.keys(), "final_checkpoint": True,
                "reference_s": took}

    def _teardown(self) -> None:
        with contextlib.suppress(Exception):
            if self.runner is not None:
                self.runner.kill()
        with contextlib.suppress(Exception):
            self.faults.cleanup()
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.shutdown()
        with contextlib.suppress(Exception):
            self.redis.stop()
        if self.disk is not None:
            self.disk.unmount()


def _ready(item: Deferred) -> bool:
    try:
        return bool(item.ready())
    except Exception:  # a process that vanished between two looks: look again next tick
        return False


def final_weights(checkpoint_dir: Path, step: int) -> dict:
    import fsspec

    from longrun.checkpoint.catalog import load_model_weights
    from longrun.checkpoint.restore import read_manifest

    fs, root = fsspec.core.url_to_fs(str(checkpoint_dir))
    return load_model_weights(fs, root, step, read_manifest(fs, root, step))


def remove_workdir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)



