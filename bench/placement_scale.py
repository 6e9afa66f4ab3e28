"""Placement and start at scale: how Ray placement groups and actor start grow with bundles and
actors on a real Ray cluster of simulated nodes, measured up to 16,384 bundles, fitted, projected.

    .venv/bin/python bench/placement_scale.py --isolate            # about 30 minutes on 2 cores
    .venv/bin/python bench/placement_scale.py --isolate --quick    # a smoke run: about 30 s

`--isolate` (root) re-runs the script inside a private network and /tmp namespace, as
`unshare --net --mount -- sh -c 'mount -t tmpfs tmpfs /tmp && ip link set lo up && exec ...'`
does (leave it out when already inside one), so its cluster neither meets nor is met by another
Ray cluster on the machine. The cluster is its own: a head without CPUs and `--raylets`
simulated nodes, each a `ray start --block` process with `--resources {"sim_gpu": S}` (and S
CPUs for longrun's {CPU: 1} bundles), bound to 127.0.0.1 under a temp dir of its own. Every
process it started is stopped at the end, on an error or Ctrl-C too, by process id (never
`ray stop`, which stops every Ray cluster on the machine).

A size N is N workers on N / 8 *logical* nodes of 8 (16,384 = 2,048 nodes x 8); logical node j
lives on raylet j mod R, its bundles pinned there by the label selector placement.py uses
(`ray.io/node-id`). So a raylet holds N / R bundles, more than a real node's 8 beyond N = 8 R:
at 16,384 on 8 raylets, 2,048 each. Measured per size (medians of `--reps`, `--reps-large`
above 2,048):
  pg_one       today's placement (controller/placement.py): ONE group of N bundles {sim_gpu: 1},
               strategy PACK, bundle i pinned to its logical node's raylet; create -> ready.
               Up to `--max-bundles` (16,384: measured, not projected).
  pg_per_node  the alternative: a group of 8 bundles per logical node, the same request each,
               all created at once, their readiness waited on together; create -> all ready.
               Up to `--max-per-node-bundles` (it grows fastest), projected beyond.
  place        longrun's own `place()` (nodes chosen from Ray's view, one group, waited on) for
               a job of min(R, N/8) nodes x the rest per node: the real code path.
  actors       N tiny actors (num_cpus 0, half a bundle's sim_gpu, as workers.py asks), one per
               bundle of a ready group: created -> every first method call answered. Up to
               `--max-actors`, stopped before the workers' memory (PSS) would pass `--max-mem-gib`.
               At each count one actor is replaced (killed, confirmed dead, a new one in its
               bundle answers: `replace_one`; `--replace-reps` of them at the largest count), and
               the CPU the started, idle workers burn is sampled.
With each wall time, the busy CPU seconds (idle rates subtracted) of the GCS, of the raylets
together and, for actors, of the driver (the controller submitting them). Also: the groups at
`--raylet-check-size` on R / 2 raylets (does a group's cost follow the bundles per raylet?),
and the re-placement after a node loss (one group: the group of N removed and placed again
with one node moved, at the largest N; per node: that node's group removed and placed on another
raylet, the others kept, at the largest per-node N; raylets have headroom, so neither waits on
a release).
Fits (least squares): linear, quadratic, a power law over all sizes (`exponent`) and over the
upper half (`exponent_top`, free of the fixed overhead that flattens small sizes); a series not
measured at 16,384 is projected there with the upper half's power law, never below the linear
fit. This box is not a cluster: its raylets share 2 cores and hold up to 2,048 bundles each (a
raylet's cost per bundle grows with what it holds), and 2 cores start every process. So the
projections to 2,048 nodes x 8 split central from per-node work, as a cluster would:
  place  the GCS's busy CPU for the group(s) at 16,384 (measured for one group) plus one node's
         raylet share (raylet CPU per bundle where a raylet holds 32 to 256, times 8);
  start  the larger of the GCS's and the driver's CPU per actor (median over the counts) times
         16,384, plus one node's own start (8 actors, every node at once).
This box's own times are reported too (`*_box_s`: measured, or extrapolated for the start).
The CPU is shared with other work on the box: timings are noisy, hence medians of repetitions.
Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from _common import logger, parser

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback only: no token file to write
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Keep the driver on 127.0.0.1 (see bench/elastic.py); `ray start` gets 1 (SimCluster._start).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from longrun.config import config_from_dict
from longrun.controller.placement import NODE_ID_LABEL, place

log = logger("placement_scale")
PER_NODE = 8  # workers per logical node (accelerators per host)
TARGET = 16384  # 2,048 nodes x 8
RAY = str(Path(sys.executable).with_name("ray"))
Sample = dict[str, float]  # wall, gcs, raylets (seconds)


class Tiny:
    """The lightest actor: a Ray worker process that answers."""

    def ping(self) -> int:
        return os.getpid()


class SimCluster:
    """A head and simulated nodes, each a `ray start --block` process of its own."""

    def __init__(self, sim_gpus: int):
        self.temp = tempfile.mkdtemp(prefix="lrps", dir="/tmp")  # short: socket paths are bounded
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.sim_gpus = sim_gpus
        self.procs: list[subprocess.Popen] = []

    def start(self, raylets: int, head_is_node: bool = False) -> list[str]:
        """The head, the driver connected to it, and `raylets` nodes: their ids. With
        `head_is_node` the head is the first of them (one node start less: --quick)."""
        node = self._node_args() if head_is_node else ["--num-cpus", "0"]
        self._start(["--head", "--port", str(self.port), "--include-dashboard", "false", *node])
        self._wait_head()
        ray.init(address=self.address, logging_level="ERROR", log_to_driver=False)
        return self.add(raylets - int(head_is_node))

    def _node_args(self) -> list[str]:
        return ["--num-cpus", str(self.sim_gpus), "--resources", json.dumps({"sim_gpu": self.sim_gpus})]

    def _start(self, args: list[str]) -> None:
        cmd = [RAY, "start", "--block", "--node-ip-address", "127.0.0.1", "--temp-dir", self.temp,
               "--disable-usage-stats", *args]
        # `ray start` refuses to join a cluster at all with the variable 0 (the driver's setting);
        # and no node starts idle workers for a driver (one per CPU here: thousands).
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
               "RAY_prestart_worker_first_driver": "0"}
        with open(os.path.join(self.temp, f"start{len(self.procs)}.log"), "wb") as out:
            self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True, preexec_fn=stop_with_parent))

    def _wait_head(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check()
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return
            time.sleep(0.5)
        raise TimeoutError(f"the head's GCS did not listen within {timeout_s:g} s")

    def _check(self) -> None:
        for i, p in enumerate(self.procs):
            if p.poll() is not None:
                tail = Path(self.temp, f"start{i}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"`ray start` #{i} exited early ({p.returncode}):\n{tail}")

    def add(self, count: int) -> list[str]:
        """`count` more raylets, one at a time (started together, 2 cores time their starts
        out); the ids of all of them, in a stable order."""
        for _ in range(count):
            want = len(self.raylets()) + 1
            for attempt in range(3):  # a busy box can time a node's start out (30 s): try again
                self._start(["--address", self.address, *self._node_args()])
                if self._joined(want):
                    break
                log(f"raylet {want} did not start (attempt {attempt + 1}); trying again")
            else:
                self._check()
                raise TimeoutError(f"raylet {want} did not start in 3 attempts")
        return self.raylets()

    def _joined(self, want: int, timeout_s: float = 180.0) -> bool:
        """Whether the node just started joined (else its `ray start` exited or timed out)."""
        proc, deadline = self.procs[-1], time.monotonic() + timeout_s
        while len(self.raylets()) < want:
            if proc.poll() is not None or time.monotonic() > deadline:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(30)
                self.procs.remove(proc)
                return False
            time.sleep(0.5)
        return True

    @staticmethod
    def raylets() -> list[str]:
        return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("sim_gpu"))

    def tree(self) -> list[psutil.Process]:
        out = []
        for p in self.procs:
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(p.pid)
                out += [root, *root.children(recursive=True)]
        return out

    def named(self, prefix: str) -> list[psutil.Process]:
        out = []
        for proc in self.tree():
            with contextlib.suppress(psutil.Error):
                if proc.name().startswith(prefix):
                    out.append(proc)
        return out

    def workers_pss(self) -> int:
        """The actors' memory: proportional set size (shared pages split among the sharers)."""
        total = 0
        for proc in self.named("ray::Tiny"):
            with contextlib.suppress(psutil.Error):
                total += proc.memory_full_info().pss
        return total

    def strays(self) -> list[psutil.Process]:
        """Processes of this cluster no longer under a `ray start` of it (a node whose start
        failed leaves its children): they name its temp dir or hold a file open under it."""
        out = []
        for proc in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if proc.pid != os.getpid() and (self.temp in " ".join(proc.info["cmdline"] or []) or any(
                        f.path.startswith(self.temp) for f in proc.open_files())):
                    out.append(proc)
        return out

    def stop(self) -> None:
        """Every process this cluster started, by id: a graceful stop, then a kill."""
        everything = self.tree()
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(everything, timeout=15)
        alive += self.tree() + self.strays()
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=5)


def stop_with_parent() -> None:
    """In a `ray start` child before exec: SIGTERM when this script dies, however it dies
    (`ray start --block` then stops its node), so no node outlives a killed run."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_of(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            total += t.user + t.system
    return total


class Meter:
    """Busy CPU seconds of some processes: their CPU time less their idle rate (resource
    reports, health checks), measured once over `idle_s` with nothing to do."""

    def __init__(self, procs: list[psutil.Process], idle_s: float):
        self.procs, self.idle_per_s = procs, 0.0
        c0, t0 = self.raw(), time.perf_counter()
        time.sleep(idle_s)
        self.idle_per_s = (self.raw() - c0) / (time.perf_counter() - t0)

    def raw(self) -> float:
        return cpu_of(self.procs)

    def read(self) -> float:
        """A reading; the difference of two is the busy time between them."""
        return self.raw() - self.idle_per_s * time.perf_counter()


class Meters:
    """The GCS's and the raylets' busy CPU over a block, with its wall time."""

    def __init__(self, cluster: SimCluster, idle_s: float):
        self.gcs = Meter(cluster.named("gcs_server"), idle_s)
        self.raylets = Meter([p for p in cluster.named("raylet") if p.name() == "raylet"], idle_s)

    @contextlib.contextmanager
    def block(self, out: Sample):
        g0, r0, t0 = self.gcs.read(), self.raylets.read(), time.perf_counter()
        yield out
        out.update(wall=time.perf_counter() - t0, gcs=self.gcs.read() - g0, raylets=self.raylets.read() - r0)


def pinned_group(nodes: list[str]) -> PlacementGroup:
    """A {sim_gpu: 1} bundle per entry, bundle i pinned to raylet nodes[i], as place() asks
    (strategy PACK, `ray.io/node-id` label selectors)."""
    return placement_group([{"sim_gpu": 1.0} for _ in nodes], strategy="PACK",
                           bundle_label_selector=[{NODE_ID_LABEL: n} for n in nodes])


def layout(n: int, raylets: list[str]) -> list[list[str]]:
    """Per logical node (8 workers), the raylet of each of its bundles."""
    return [[raylets[j % len(raylets)]] * PER_NODE for j in range(max(1, n // PER_NODE))]


def flat(nodes: list[list[str]]) -> list[str]:
    return [r for node in nodes for r in node]


def wait_free(timeout_s: float = 120.0) -> None:
    """Until every sim_gpu is free again (a removed group gives its resources back lazily)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray.available_resources().get("sim_gpu", 0.0) >= ray.cluster_resources()["sim_gpu"] - 1e-6:
            return
        time.sleep(0.05)
    log(f"warning: sim_gpu not all free after {timeout_s:g} s")


def time_pg_one(n: int, raylets: list[str], meters: Meters) -> Sample:
    nodes = flat(layout(n, raylets))
    with meters.block({}) as out:
        group = pinned_group(nodes)
        ray.get(group.ready(), timeout=1800)
    remove_placement_group(group)
    return out


def time_pg_per_node(n: int, raylets: list[str], meters: Meters) -> Sample:
    with meters.block({}) as out:
        t0 = time.perf_counter()
        groups = [pinned_group(node) for node in layout(n, raylets)]
        out["create_calls"] = time.perf_counter() - t0  # the driver's requests alone
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=1800)
    for g in groups:
        remove_placement_group(g)
    if len(ready) < len(groups):
        raise TimeoutError(f"{len(groups) - len(ready)} of {len(groups)} per-node groups not ready")
    return out


def time_place(n: int, raylets: list[str], meters: Meters) -> Sample:
    nodes = min(len(raylets), max(1, n // PER_NODE))
    cfg = config_from_dict({"job": {"name": "scale"}, "cluster": {
        "nodes": nodes, "workers_per_node": n // nodes, "device": "cpu"}, "parallelism": {"dp": n}})
    with meters.block({}) as out:
        placement = place(cfg, timeout_s=1800)
    placement.remove()
    return out


GROUP_KINDS: dict[str, Callable[[int, list[str], Meters], Sample]] = {
    "pg_one": time_pg_one, "pg_per_node": time_pg_per_node, "place": time_place}


def start_actors(group: PlacementGroup, indices: range) -> list[Any]:
    cls = ray.remote(num_cpus=0, resources={"sim_gpu": 0.5}, max_restarts=0)(Tiny)
    return [cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=i)).remote() for i in indices]


def kill_confirmed(actors: list[Any], timeout_s: float = 120.0) -> None:
    """Kill and wait until Ray reports each dead (as RayWorkerGroup.stop does)."""
    for a in actors:
        ray.kill(a, no_restart=True)
    pings = [a.ping.remote() for a in actors]
    ray.wait(pings, num_returns=len(pings), timeout=timeout_s)


def time_actors(n: int, raylets: list[str], meters: Meters, cluster: SimCluster, replace_reps: int = 0,
                idle_sample_s: float = 0.0) -> dict[str, Any]:
    """N actors in a ready group's bundles, created -> every first call answered; then the CPU
    the idle workers burn over `idle_sample_s`; then `replace_reps` times one of them killed and
    replaced in its bundle."""
    group = pinned_group(flat(layout(n, raylets)))
    ray.get(group.ready(), timeout=600)
    d0 = time.process_time()
    with meters.block({}) as out:
        actors = start_actors(group, range(n))
        ray.get([a.ping.remote() for a in actors], timeout=1800)
    out.update(driver=time.process_time() - d0, pss=cluster.workers_pss(), replace=[], replace_start=[])
    if idle_sample_s:
        workers = cluster.named("ray::Tiny")
        c0, t0 = cpu_of(workers), time.perf_counter()
        time.sleep(idle_sample_s)
        out["idle_cores"] = (cpu_of(workers) - c0) / (time.perf_counter() - t0)
    for rep in range(replace_reps):
        k = (rep * 7919) % n
        t0 = time.perf_counter()
        kill_confirmed([actors[k]])
        t1 = time.perf_counter()
        actors[k] = start_actors(group, range(k, k + 1))[0]
        ray.get(actors[k].ping.remote(), timeout=300)
        out["replace"].append(time.perf_counter() - t0)
        out["replace_start"].append(time.perf_counter() - t1)
    kill_confirmed(actors)
    remove_placement_group(group)
    return out


def time_node_loss(n_one: int, n_node: int, raylets: list[str]) -> tuple[float, float]:
    """Re-placement after logical node 0 (on raylets[0]) is lost: (one group of n_one, per node
    with n_node / 8 groups) seconds, from giving the old reservation up to the new one ready."""
    moved = [raylets[-1]] * PER_NODE  # another raylet for node 0
    nodes = layout(n_one, raylets)
    group = pinned_group(flat(nodes))
    ray.get(group.ready(), timeout=1800)
    t0 = time.perf_counter()
    remove_placement_group(group)
    group = pinned_group(flat([moved, *nodes[1:]]))
    ray.get(group.ready(), timeout=1800)
    one = time.perf_counter() - t0
    remove_placement_group(group)
    wait_free()
    groups = [pinned_group(node) for node in layout(n_node, raylets)]
    ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=1800)
    t0 = time.perf_counter()
    remove_placement_group(groups[0])
    groups[0] = pinned_group(moved)
    ray.get(groups[0].ready(), timeout=600)
    per_node = time.perf_counter() - t0
    for g in groups:
        remove_placement_group(g)
    return one, per_node


def fit(sizes: list[int], values: list[float]) -> dict[str, Any]:
    """Least squares: linear, quadratic, power law (all sizes and the upper half); at 16,384.
    Values at or below zero (CPU seconds under the clock's 10 ms resolution, less the idle
    rate) are left out."""
    x, y = np.asarray(sizes, float), np.asarray(values, float)
    dropped = int(np.sum(y <= 0))
    x, y = x[y > 0], y[y > 0]
    sizes = [int(s) for s in x]
    if len(x) < 2:
        return {"points": len(x), "dropped": dropped, "why": "fewer than 2 positive values: no fit"}

    def rmse(pred: np.ndarray) -> float:
        return float(np.sqrt(np.mean((pred - y) ** 2)))

    b, a = np.polyfit(x, y, 1)
    out: dict[str, Any] = {"points": len(x), "dropped": dropped, "linear": {
        "a": float(a), "b": float(b), "rmse": rmse(a + b * x), "at_16k": float(a + b * TARGET)}}
    if len(x) >= 3:
        c2, c1, c0 = np.polyfit(x, y, 2)
        out["quadratic"] = {"a": float(c0), "b": float(c1), "c": float(c2),
                            "rmse": rmse(c0 + c1 * x + c2 * x * x),
                            "at_16k": float(c0 + c1 * TARGET + c2 * TARGET**2)}
    p, logk = np.polyfit(np.log(x), np.log(y), 1)
    out["power"] = {"k": math.exp(logk), "exponent": float(p), "rmse": rmse(math.exp(logk) * x**p),
                    "at_16k": float(math.exp(logk) * TARGET**p)}
    top = max(2, len(x) // 2)
    pt, logkt = np.polyfit(np.log(x[-top:]), np.log(y[-top:]), 1)
    out["power_top"] = {"k": math.exp(logkt), "exponent": float(pt), "sizes": [int(s) for s in x[-top:]],
                        "at_16k": float(math.exp(logkt) * TARGET**pt)}
    out["exponent"], out["exponent_top"] = float(p), float(pt)
    if TARGET in sizes:
        out["measured_16k"] = float(y[list(sizes).index(TARGET)])
        out["projected_16k"] = out["measured_16k"]
    else:
        out["projected_16k"] = max(out["power_top"]["at_16k"], out["linear"]["at_16k"])
    return out


def med(values: list[float]) -> float:
    return float(statistics.median(values))


def doubling(low: int, high: int) -> list[int]:
    out = [low]
    while out[-1] * 2 <= high:
        out.append(out[-1] * 2)
    return out


def measure_groups(sizes: list[int], per_node_upto: int, raylets: list[str], meters: Meters,
                   reps: Callable[[int], int], kinds: list[str]) -> dict[str, dict[int, list[Sample]]]:
    series: dict[str, dict[int, list[Sample]]] = {k: {} for k in kinds}
    for n in sizes:
        here = [k for k in kinds if k != "pg_per_node" or n <= per_node_upto]
        for rep in range(reps(n)):
            # The first two kinds alternate who goes first: neither always meets a warmer GCS.
            order = here[:2] if rep % 2 == 0 else here[1::-1]
            for kind in order + here[2:]:
                wait_free()
                series[kind].setdefault(n, []).append(GROUP_KINDS[kind](n, raylets, meters))
        def line(k: str, n: int = n) -> str:
            wall, gcs, rays = (med([s[key] for s in series[k][n]]) for key in ("wall", "gcs", "raylets"))
            return f"{k} {wall:.3f} s (GCS {gcs:.2f}, raylets {rays:.2f} CPU s)"

        log(f"{n:5d} bundles: " + ", ".join(line(k) for k in here))
    return series


def measure_actors(counts: list[int], raylets: list[str], meters: Meters, cluster: SimCluster,
                   reps: Callable[[int], int], replace_reps: int, max_mem_gib: float,
                   quick: bool = False) -> dict[int, list[dict[str, Any]]]:
    """Per count, its repetitions; the first of each samples idle CPU and replaces one actor
    (`replace_reps` at the largest count: the last before the memory budget)."""
    actors: dict[int, list[dict[str, Any]]] = {}
    budget, per_actor = max_mem_gib * 2**30, 0.0
    if not quick:
        time_actors(counts[0], raylets, meters, cluster)  # warm-up, not measured: the first workers ever
    for i, n in enumerate(counts):
        if n * per_actor > budget:
            log(f"the actor series stops at {max(actors)}: {n} actors would take ~"
                f"{n * per_actor / 2**30:.1f} GiB (--max-mem-gib {max_mem_gib:g})")
            break
        last = i + 1 == len(counts) or counts[i + 1] * per_actor > budget
        runs = []
        for rep in range(reps(n)):
            wait_free()
            replace = (replace_reps if last else 1) if rep == 0 else 0
            runs.append(time_actors(n, raylets, meters, cluster, replace_reps=replace,
                                    idle_sample_s=(0.5 if quick else 3.0) if rep == 0 else 0.0))
        actors[n] = runs
        per_actor = max(r["pss"] for r in runs) / n
        wall, busy, driver = (med([r[k] for r in runs]) for k in ("wall", "gcs", "driver"))
        log(f"{n:5d} actors: started {wall:.2f} s, GCS {busy:.3f} CPU s, driver {driver:.3f} CPU s, workers "
            f"{per_actor * n / 2**30:.2f} GiB, idle {runs[0]['idle_cores']:.2f} cores; replace one "
            f"{med(runs[0]['replace']):.2f} s")
    return actors


def per_bundle(cpu: dict[int, float], raylets: int) -> float:
    """Raylet CPU per bundle where a raylet holds 32 to 256 bundles (above, a raylet's cost per
    bundle grows with the bundles it holds; below, the CPU clock is too coarse); all sizes
    when none is in that range."""
    chosen = {n: v for n, v in cpu.items() if 32 <= n / raylets <= 256} or cpu
    return max(0.0, med([v / n for n, v in chosen.items()]))


def summarize(groups: dict[str, dict[int, list[Sample]]], actors: dict[int, list[dict[str, Any]]],
              loss: list[tuple[float, float]], loss_at: tuple[int, int], by_raylets: dict,
              raylets: int) -> dict[str, Any]:
    def of_groups(kind: str, key: str) -> dict[int, float]:
        return {n: med([s[key] for s in v]) for n, v in groups.get(kind, {}).items()}

    def of_actors(key: str) -> dict[int, float]:
        return {n: med([r[key] for r in v if key in r]) for n, v in actors.items()}

    def keyed(d: dict[int, float]) -> dict[str, float]:
        return {str(n): v for n, v in d.items()}

    series = {"pg_one": of_groups("pg_one", "wall"), "pg_per_node": of_groups("pg_per_node", "wall"),
              "place": of_groups("place", "wall"),
              "pg_one_gcs_cpu": of_groups("pg_one", "gcs"),
              "pg_per_node_gcs_cpu": of_groups("pg_per_node", "gcs"),
              "pg_one_raylets_cpu": of_groups("pg_one", "raylets"),
              "pg_per_node_raylets_cpu": of_groups("pg_per_node", "raylets"),
              "actors": of_actors("wall"), "actors_gcs_cpu": of_actors("gcs"),
              "actors_driver_cpu": of_actors("driver")}
    fits = {name: fit(list(s), list(s.values())) for name, s in series.items() if s}
    # On a cluster every node starts its own 8 processes, all nodes at once; what does not
    # spread is the GCS (one process) and the controller (the one driver submitting every
    # actor). They work concurrently: the larger of the two, plus one node's own start.
    gcs_per_actor = med([v / n for n, v in series["actors_gcs_cpu"].items()])
    driver_per_actor = med([v / n for n, v in series["actors_driver_cpu"].items()])
    central = TARGET * max(gcs_per_actor, driver_per_actor)
    one_node = series["actors"][min(series["actors"])]
    top = max(actors)
    replace_top = [x for r in actors[top] for x in r["replace"]]
    # Placing on a cluster: the GCS's busy CPU for all the bundles (central: measured at 16,384
    # when the series got there) plus one node's raylet work for its 8 (every node at once).
    # Here R raylets hold N / R bundles each, and a raylet's cost per bundle grows with that.
    # Where the GCS's CPU stayed under the clock's resolution (tiny sizes only: --quick), this
    # box's wall time stands in for it (an upper bound).
    place_cluster = {kind: fits[f"{kind}_gcs_cpu"]["projected_16k"]
                     + PER_NODE * per_bundle(series[f"{kind}_raylets_cpu"], raylets)
                     if "projected_16k" in fits.get(f"{kind}_gcs_cpu", {}) else fits[kind]["projected_16k"]
                     for kind in ("pg_one", "pg_per_node")}
    return {
        "sizes": list(series["pg_one"]), "actor_sizes": list(series["actors"]),
        "pg_one_s_at": keyed(series["pg_one"]), "pg_per_node_s_at": keyed(series["pg_per_node"]),
        "place_s_at": keyed(series["place"]),
        "pg_per_node_create_calls_s_at": keyed(of_groups("pg_per_node", "create_calls")),
        **{f"{name}_s_at": keyed(series[name]) for name in (
            "pg_one_gcs_cpu", "pg_per_node_gcs_cpu", "pg_one_raylets_cpu", "pg_per_node_raylets_cpu",
            "actors_gcs_cpu", "actors_driver_cpu")},
        "actors_s_at": keyed(series["actors"]),
        "actors_pss_gib_at": {str(n): max(r["pss"] for r in v) / 2**30 for n, v in actors.items()},
        "actors_idle_cores_at": {str(n): v[0]["idle_cores"] for n, v in actors.items()},
        "replace_one_s_at": {str(n): med(v[0]["replace"]) for n, v in actors.items()},
        "pg_by_raylets": by_raylets,
        "fit": fits,
        # today's design, one group, on a cluster of 2,048 nodes; then this box's time
        "projected_16k_place_s": place_cluster["pg_one"],
        "projected_16k_place_box_s": fits["pg_one"]["projected_16k"],
        "projected_16k_place_per_node_s": place_cluster["pg_per_node"],
        "projected_16k_place_per_node_box_s": fits["pg_per_node"]["projected_16k"],
        "gcs_cpu_per_actor_s": gcs_per_actor, "driver_cpu_per_actor_s": driver_per_actor,
        "projected_16k_start_s": central + one_node,
        "projected_16k_start_central_s": central, "one_node_start_s": one_node,
        "projected_16k_start_box_s": fits["actors"].get("projected_16k"),
        "replace_one_s": med(replace_top), "replace_one_at": top,
        "replace_node_pg_one_s": med([o for o, _ in loss]), "replace_node_pg_one_at": loss_at[0],
        "replace_node_pg_per_node_s": med([p for _, p in loss]), "replace_node_pg_per_node_at": loss_at[1],
    }


def report(r: dict[str, Any]) -> None:
    nan = float("nan")
    log("bundles | one group s | GCS / raylets CPU s | per node s | GCS / raylets CPU s | place() s")
    for k in map(str, r["sizes"]):
        log(f"{k:>7} | {r['pg_one_s_at'][k]:11.3f} | {r['pg_one_gcs_cpu_s_at'][k]:8.2f} / "
            f"{r['pg_one_raylets_cpu_s_at'][k]:8.2f} | {r['pg_per_node_s_at'].get(k, nan):10.3f} | "
            f"{r['pg_per_node_gcs_cpu_s_at'].get(k, nan):8.2f} / "
            f"{r['pg_per_node_raylets_cpu_s_at'].get(k, nan):8.2f} | {r['place_s_at'].get(k, nan):9.3f}")
    log("actors | start s | GCS CPU s | driver CPU s | workers GiB | idle cores | replace one s")
    for k in map(str, r["actor_sizes"]):
        log(f"{k:>6} | {r['actors_s_at'][k]:7.2f} | {r['actors_gcs_cpu_s_at'][k]:9.3f} | "
            f"{r['actors_driver_cpu_s_at'][k]:12.3f} | {r['actors_pss_gib_at'][k]:11.2f} | "
            f"{r['actors_idle_cores_at'][k]:10.2f} | {r['replace_one_s_at'][k]:.2f}")
    for name, f in r["fit"].items():
        if "linear" in f:
            log(f"fit {name}: {f['linear']['a']:.4g} + {f['linear']['b']:.4g} n, exponent "
                f"{f['exponent']:.2f} (upper half {f['exponent_top']:.2f}), at 16,384: "
                f"{f['projected_16k']:.2f} s"
                + (" (measured)" if "measured_16k" in f else ""))
    log(f"16,384 workers to place on a cluster: one group {r['projected_16k_place_s']:.1f} s, per node "
        f"{r['projected_16k_place_per_node_s']:.1f} s (on this box: {r['projected_16k_place_box_s']:.1f} s, "
        f"{r['projected_16k_place_per_node_box_s']:.1f} s); start {r['projected_16k_start_s']:.1f} s "
        f"(GCS {r['gcs_cpu_per_actor_s'] * 1e3:.1f} ms, driver "
        f"{r['driver_cpu_per_actor_s'] * 1e3:.1f} ms CPU "
        f"per actor; this box's wall time extrapolated: {r['projected_16k_start_box_s']:.0f} s)")
    log(f"replace one actor of {r['replace_one_at']}: {r['replace_one_s']:.2f} s; a node lost: one group "
        f"of {r['replace_node_pg_one_at']} {r['replace_node_pg_one_s']:.3f} s, per node (of "
        f"{r['replace_node_pg_per_node_at'] // PER_NODE} groups) {r['replace_node_pg_per_node_s']:.3f} s")
    for raylets, row in r["pg_by_raylets"].items():
        log(f"at {row['size']} bundles on {raylets} raylets: " + ", ".join(
            f"{k} {v:.3f}" for k, v in row.items() if k != "size"))


def isolate() -> None:
    """Run this script again inside a private network and /tmp namespace (see the docstring)."""
    inner = 'mount -t tmpfs tmpfs /tmp && ip link set lo up && exec "$0" "$@"'
    args = [a for a in sys.argv[1:] if a != "--isolate"]
    os.execvp("unshare", ["unshare", "--net", "--mount", "--", "sh", "-c", inner, sys.executable,
                          os.path.abspath(__file__), *args])


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--isolate", action="store_true", help="re-run in a private net + /tmp namespace (root)")
    p.add_argument("--quick", action="store_true", help="smoke run: groups of 8, 16; 4, 8 actors")
    p.add_argument("--raylets", type=int, default=8, help="simulated nodes (each costs ~0.3 GiB)")
    p.add_argument("--max-bundles", type=int, default=TARGET)
    p.add_argument("--max-per-node-bundles", type=int, default=8192)
    p.add_argument("--raylet-check-size", type=int, default=4096)
    p.add_argument("--max-actors", type=int, default=256, help="(and --max-mem-gib) 192 fit in 12 GiB here")
    p.add_argument("--max-mem-gib", type=float, default=12.0, help="the actor series stops before this")
    p.add_argument("--reps", type=int, default=5, help="repetitions per placement size up to 2,048")
    p.add_argument("--reps-large", type=int, default=3, help="repetitions per placement size above 2,048")
    p.add_argument("--actor-reps", type=int, default=3, help="per actor count (one less above 64)")
    p.add_argument("--replace-reps", type=int, default=5, help="actors replaced at the largest count")
    p.add_argument("--no-place", action="store_true", help="skip longrun's own place() series")
    args = p.parse_args()
    if args.isolate:
        isolate()
    if args.quick:
        args.raylets, args.max_bundles, args.max_per_node_bundles, args.raylet_check_size = 1, 16, 16, 16
        args.max_actors, args.reps, args.reps_large, args.actor_reps, args.replace_reps = 8, 2, 1, 1, 1
    sizes = doubling(PER_NODE, args.max_bundles)
    per_node_upto = min(args.max_per_node_bundles, sizes[-1])
    check = min(args.raylet_check_size, sizes[-1])
    half = max(1, args.raylets // 2)
    # Twice the most a raylet holds in any measurement: headroom for a moved node's group.
    sim_gpus = 2 * max(PER_NODE, math.ceil(sizes[-1] / args.raylets), math.ceil(check / half))
    kinds = ["pg_one", "pg_per_node"] + ([] if args.no_place else ["place"])
    idle_s = 1.0 if args.quick else 5.0

    def reps(n: int) -> int:
        return args.reps if n <= 2048 else args.reps_large

    def actor_reps(n: int) -> int:  # each repetition above 64 takes minutes here
        return args.actor_reps if n <= 64 else max(1, args.actor_reps - 1)

    def on_term(signum: int, frame: Any) -> None:  # a kill is an error like any other: clean up
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    result: dict[str, Any] = {"raylets": args.raylets, "workers_per_logical_node": PER_NODE,
                              "sim_gpu_per_raylet": sim_gpus, "target": TARGET}
    cluster = SimCluster(sim_gpus)
    result["cluster_temp_dir"] = cluster.temp  # the GCS and raylets name it; none outlives the run
    t0 = time.perf_counter()
    try:
        raylets = cluster.start(half, head_is_node=args.quick)
        signal.signal(signal.SIGTERM, on_term)  # again: ray.init installed a handler that aborts
        meters = Meters(cluster, idle_s)
        log(f"head + {half} raylet(s) up in {time.perf_counter() - t0:.1f} s ({sim_gpus} sim_gpu each); idle "
            f"CPU: GCS {meters.gcs.idle_per_s:.3f}, raylets {meters.raylets.idle_per_s:.3f} s/s")
        for kind in () if args.quick else ("pg_one", "pg_per_node"):  # warm-up: the first groups ever
            wait_free()
            GROUP_KINDS[kind](min(check, 1024), raylets, meters)
        by_raylets: dict[str, dict[str, float]] = {}
        if half < args.raylets:  # one size on half the raylets, then (in the series) on all
            on_half = measure_groups([check], check, raylets, meters, reps, kinds[:2])
            by_raylets[str(half)] = {"size": check, **{
                f"{k}_{key}": med([s[key] for s in on_half[k][check]]) for k in kinds[:2]
                for key in ("wall", "gcs", "raylets")}}
            raylets = cluster.add(args.raylets - half)
            meters = Meters(cluster, idle_s)
        mem = psutil.virtual_memory()
        log(f"{len(raylets)} raylets up; memory in use: {(mem.total - mem.available) / 2**30:.1f} GiB")

        groups = measure_groups(sizes, per_node_upto, raylets, meters, reps, kinds)
        if by_raylets:
            by_raylets[str(len(raylets))] = {"size": check, **{
                f"{k}_{key}": med([s[key] for s in groups[k][check]]) for k in kinds[:2]
                for key in ("wall", "gcs", "raylets")}}
        loss = []
        for _ in range(reps(sizes[-1])):
            wait_free()
            loss.append(time_node_loss(sizes[-1], per_node_upto, raylets))
        log(f"node loss: one group {med([o for o, _ in loss]):.3f} s, per node "
            f"{med([q for _, q in loss]):.3f} s")
        # Doubling, with 1.5x steps from 64 on: more points where memory runs out.
        counts = doubling(PER_NODE // 2 if args.quick else PER_NODE, args.max_actors)
        counts = sorted({*counts, *(c * 3 // 2 for c in counts if c >= 64 and c * 3 // 2 <= args.max_actors)})
        actors = measure_actors(counts, raylets, meters, cluster, actor_reps, args.replace_reps,
                                args.max_mem_gib, quick=args.quick)
        result.update(summarize(groups, actors, loss, (sizes[-1], per_node_upto), by_raylets, len(raylets)))
        result["elapsed_s"] = time.perf_counter() - t0
        report(result)
    finally:
        try:
            ray.shutdown()
        finally:
            cluster.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
