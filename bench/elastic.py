"""Recovery without a spare: a lost node's fault to the first step at the smaller size (elastic
continuation), vs today's behaviour when no node can replace it.

    RAY_USAGE_STATS_ENABLED=0 .venv/bin/python bench/elastic.py            # 30 s outage
    RAY_USAGE_STATS_ENABLED=0 .venv/bin/python bench/elastic.py --quick    # 10 s outage, fewer steps

A simulated 3-node Ray cluster on this machine (`ray.cluster_utils.Cluster`, as
tests/test_elastic_run.py builds it: a head with no CPUs and 3 nodes of 1 CPU, every node bound
to 127.0.0.1) with no spare node, one rank per node (dp 3, grad_accum 2), bench/recovery.py's
tiny model and data, a checkpoint every 4 steps, rank 0 sleeping STEP_PAD_S after each step
(so a step takes about as long as the controller's half-second poll), default self-checks,
no warm spares (they would only compete for the cores), hangs declared after a minute at the
earliest (none is measured; a busy machine would set off bench/recovery.py's 5 s). The same
job runs twice; in each, once every rank is past step REMOVE_AT, rank 2's Ray node is removed
(`Cluster.remove_node`: its raylet and every process on it die, as a lost host), and a new
node joins `--outage-s` later.

  elastic   recovery.min_nodes 2, recovery.shrink_after_s `--shrink-after-s`. Measured from
            the removal: `detect` (the controller's `fault` event), `shrunk` (its `resized`
            event: placing 3 nodes was tried for shrink_after_s first) and `to_step` (every
            rank of the 2-node attempt completed a step, the `trained` hook the `recovered`
            event comes from). When the node is back the job grows to 3 at a checkpoint:
            `grow` is from the node's return to the first step at 3 nodes.
  baseline  recovery.min_nodes unset (today). With no node to place the third rank on, the
            controller fails the job at once (PlacementImpossible: waiting cannot help a
            cluster that lacks the node; nothing places it back by itself). So the baseline is
            an operator's rerun of the same job, submitted the moment the node is back (the
            best case: no one is paged, nothing is late) and resuming from its newest
            checkpoint: `to_step` is from the removal to the rerun's first completed step, so
            it is the outage plus a cold start.
Both are also timed end to end (`total`: the first start to the last step, the rerun included).
`ratio` is baseline to_step / elastic to_step. A controller that waited for the node instead of
failing (an autoscaler replacing it) would save the rerun's start, not the outage: its fault ->
first step is bounded below by the outage as the baseline's is.
Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from typing import Any

from _common import parser
from recovery import job_dict as recovery_job_dict
from recovery import say

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # 3 workers share the cores; raylets pass it on
# Ray turns a loopback address into the host's own IP when connecting, unless it is told this is
# not a real cluster: then every node, the driver and the workers keep to 127.0.0.1.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

NODES = 3
INTERVAL = 4  # checkpoint every 4 steps
STEP_PAD_S = 0.5  # rank 0 sleeps this after each step: steps about as long as a poll
REMOVE_AT = 10  # the node goes once every rank is past this step (a checkpoint is committed)
HOST = "127.0.0.1"  # every Ray node and the driver: nothing leaves the machine


def job_dict(name: str, out: str, steps: int, shrink_after_s: float | None) -> dict:
    """bench/recovery.py's job on 3 nodes of one rank; elastic when `shrink_after_s` is set."""
    cfg = recovery_job_dict(name, out, None)
    cfg["cluster"] = {"nodes": NODES, "workers_per_node": 1, "device": "cpu"}
    cfg["parallelism"] = {"dp": NODES}
    # As tests/test_elastic_run.py: 2 micro-batches a rank at 3 ranks (a global batch of 768
    # tokens, pinned when the job shrinks: 2 ranks then train a larger share of it each).
    cfg["training"] |= {"steps": steps, "grad_accum": 2}
    cfg["checkpoint"] = {"interval_steps": INTERVAL, "keep_last": 3}
    # A fault fires in one attempt only: the same pace in every attempt (and in a rerun, whose
    # attempt numbers continue the failed run's).
    cfg["health"]["faults"] = [{"rank": 0, "step": 1, "kind": "slow", "seconds": STEP_PAD_S, "attempt": a}
                               for a in range(8)]
    # No hangs are measured here, and on a busy machine a step can take many times its usual
    # time: a hang is only declared after a minute (bench/recovery.py's 5 s would misfire).
    cfg["health"]["hang_min_s"] = 60.0
    cfg["observability"] = {"linger_s": 0.0}
    if shrink_after_s is not None:
        cfg["recovery"] |= {"min_nodes": NODES - 1, "shrink_after_s": shrink_after_s}
    return cfg


def first_steps() -> Any:
    """A controller listener: `.at[attempt]` = (wall time, ranks) when that attempt completed
    its first step on every rank (the moment its `recovered` event is measured at)."""
    from longrun.controller.listeners import Listener  # after the environment above is set

    class FirstSteps(Listener):
        def __init__(self) -> None:
            self.at: dict[int, tuple[float, int]] = {}

        def trained(self, attempt: Any) -> None:
            self.at[attempt.number] = (time.time(), attempt.world_size)

    return FirstSteps()


class Job:
    """One controller run in a thread (its summary, or the exception it ended with)."""

    def __init__(self, cfg: Any, redis_url: str, label: str):
        from longrun.controller.controller import Controller
        from longrun.controller.workers import RayLauncher

        started = time.time()
        self.started = started
        self.steps = first_steps()
        def show(line: str) -> None:
            say(f"  {label} {time.time() - started:6.2f} s | {line}")

        self.controller = Controller(cfg, redis_url, launch=RayLauncher(spares=False), on_event=show)
        self.controller.listeners.listeners.append(self.steps)
        self.summary: dict | None = None
        self.error: BaseException | None = None
        self.ended: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.summary = self.controller.run()
        except BaseException as exc:  # reported by the caller (JobFailed is the baseline's)
            self.error = exc
        self.ended = time.time()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise SystemExit(f"the job did not end within {timeout:g} s")


def wait_for(what: str, ready, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


class Bench:
    def __init__(self, cluster: Any, redis_url: str, tmp: str, steps: int, outage_s: float):
        from longrun.services.redis_client import quick_client

        self.cluster, self.redis_url, self.tmp = cluster, redis_url, tmp
        self.steps, self.outage_s = steps, outage_s
        self.client = quick_client(redis_url)

    def events(self, name: str) -> list[dict]:
        from longrun.controller.controller import job_status

        return job_status(self.client, name, events=1000)["events"]

    def remove_a_node(self, job: Job, name: str) -> float:
        """Once every rank is past REMOVE_AT, remove rank 2's node; the wall time it went."""
        from longrun.controller.job_state import JobRecordStore

        store = JobRecordStore(self.client, name)
        wait_for(f"{name} past step {REMOVE_AT}", lambda: job.ended or (
            (r := store.read()) is not None and r.step > REMOVE_AT))
        if job.ended:
            raise SystemExit(f"{name} ended before the node was removed: {job.error or job.summary}")
        victim = json.loads(store.read().fields["nodes"])[-1]
        node = next(n for n in self.cluster.list_all_nodes() if n.node_id == victim)
        removed = time.time()
        self.cluster.remove_node(node)
        say(f"  removed node {victim[:12]} (rank 2's) at step {store.read().step}")
        return removed

    def give_the_node_back(self, removed: float) -> float:
        """`--outage-s` after the removal, a new node joins; the wall time it is up (a node
        takes a few seconds to start, so the outage is that much longer than asked)."""
        time.sleep(max(0.0, removed + self.outage_s - time.time()))
        self.cluster.add_node(num_cpus=1, node_ip_address=HOST)
        self.cluster.wait_for_nodes()
        back = time.time()
        say(f"  a node is back, {back - removed:.1f} s after the removal")
        return back

    def elastic(self, shrink_after_s: float) -> dict:
        from longrun.config import config_from_dict

        name = "bench-elastic"
        say(f"elastic: recovery.min_nodes {NODES - 1}, shrink_after_s {shrink_after_s:g}")
        job = Job(config_from_dict(job_dict(name, f"{self.tmp}/elastic", self.steps, shrink_after_s)),
                  self.redis_url, "elastic")
        removed = self.remove_a_node(job, name)
        back = self.give_the_node_back(removed)
        job.join(600)
        if job.error is not None:
            raise SystemExit(f"the elastic job failed: {job.error}")
        events = self.events(name)
        fault = next(e for e in events if e["type"] == "fault")
        resized = [e for e in events if e["type"] == "resized"]
        shrink = next(e for e in resized if e["direction"] == "shrink")
        first_small = min((at, n) for n, (at, world) in job.steps.at.items() if world == NODES - 1)
        recovered = next(e for e in events if e["type"] == "recovered" and e["attempt"] == shrink["attempt"])
        grow = next((e for e in resized if e["direction"] == "grow"), None)
        grown = job.steps.at.get(grow["attempt"]) if grow else None
        return {
            "detect_s": fault["at"] - removed,
            "shrunk_s": shrink["at"] - removed,
            "to_step_s": first_small[0] - removed,
            "recovered_event_s": recovered["seconds"],  # the controller's own: declared -> first step
            "steps_lost": recovered["steps_lost"],
            "resumed_from": recovered["resumed_from"],
            "node_back_s": back - removed,
            "grow_s": grown[0] - back if grown else None,  # node back -> first step at 3 nodes
            "total_s": job.ended - job.started,
            "final_nodes": job.summary["nodes"],
            "waited_for_nodes": any(e["type"] == "waiting_for_nodes" for e in events),
        }

    def baseline(self) -> dict:
        from longrun.config import config_from_dict

        name = "bench-fixed"
        say("baseline: recovery.min_nodes unset")
        cfg = config_from_dict(job_dict(name, f"{self.tmp}/fixed", self.steps, None))
        job = Job(cfg, self.redis_url, "fixed")
        removed = self.remove_a_node(job, name)
        wait_for("the job to end", lambda: job.ended, timeout=300)
        failed = job.ended
        if job.error is None:
            raise SystemExit(f"the non-elastic job did not fail without its node: {job.summary}")
        say(f"  the job failed {failed - removed:.1f} s after the removal: {job.error}")
        events = self.events(name)
        fault = next(e for e in events if e["type"] == "fault")
        back = self.give_the_node_back(removed)
        rerun = Job(cfg, self.redis_url, "rerun")  # the same job again: resumes from its checkpoint
        rerun.join(600)
        if rerun.error is not None:
            raise SystemExit(f"the rerun failed: {rerun.error}")
        first_at = min(at for at, _ in rerun.steps.at.values())
        return {
            "detect_s": fault["at"] - removed,
            "failed_s": failed - removed,
            "failure": str(job.error).splitlines()[0],
            "node_back_s": back - removed,
            "to_step_s": first_at - removed,
            "rerun_to_step_s": first_at - back,  # node back (and the rerun started) -> first step
            "total_s": rerun.ended - job.started,
            "final_nodes": rerun.summary["nodes"],
        }


def main() -> None:
    cli = parser(__doc__.split("\n")[0])
    cli.add_argument("--quick", action="store_true", help="10 s outage, 40 steps")
    cli.add_argument("--outage-s", type=float, default=None, help="seconds the node is gone (default 30)")
    cli.add_argument("--shrink-after-s", type=float, default=2.0, help="recovery.shrink_after_s (default 2)")
    cli.add_argument("--steps", type=int, default=None, help="training steps per job (default 80)")
    args = cli.parse_args()
    outage = args.outage_s if args.outage_s is not None else (10.0 if args.quick else 30.0)
    steps = args.steps or (40 if args.quick else 80)

    import ray
    from ray.cluster_utils import Cluster

    from longrun.services import EmbeddedRedis

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": HOST,
                                                            "include_dashboard": False})
    for _ in range(NODES):
        cluster.add_node(num_cpus=1, node_ip_address=HOST)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, _node_ip_address=HOST, log_to_driver=False)
    try:
        with EmbeddedRedis() as redis_server, tempfile.TemporaryDirectory(prefix="longrun-bench-") as tmp:
            bench = Bench(cluster, redis_server.url, tmp, steps, outage)
            elastic = bench.elastic(args.shrink_after_s)
            say(f"  -> {elastic}")
            baseline = bench.baseline()
            say(f"  -> {baseline}")
    finally:
        ray.shutdown()
        cluster.shutdown()

    ratio = baseline["to_step_s"] / elastic["to_step_s"]
    say(f"\n| run | detect s | fault -> first step s | end to end s |\n| --- | --- | --- | --- |\n"
        f"| elastic (shrink to 2 after {args.shrink_after_s:g} s) | {elastic['detect_s']:.2f} | "
        f"{elastic['to_step_s']:.2f} | {elastic['total_s']:.1f} |\n"
        f"| baseline (fails; rerun when the node is back, {outage:g} s) | {baseline['detect_s']:.2f} | "
        f"{baseline['to_step_s']:.2f} | {baseline['total_s']:.1f} |\n"
        f"ratio (baseline / elastic, fault -> first step): {ratio:.1f}x")
    r3 = lambda x: None if x is None else round(x, 3)  # noqa: E731
    print(json.dumps({
        "outage_s": outage, "shrink_after_s": args.shrink_after_s, "steps": steps,
        "elastic_detect_s": r3(elastic["detect_s"]), "elastic_shrunk_s": r3(elastic["shrunk_s"]),
        "elastic_to_step_s": r3(elastic["to_step_s"]), "elastic_steps_lost": elastic["steps_lost"],
        "elastic_grow_s": r3(elastic["grow_s"]), "elastic_total_s": r3(elastic["total_s"]),
        "elastic_node_back_s": r3(elastic["node_back_s"]), "elastic_final_nodes": elastic["final_nodes"],
        "elastic_waited_for_nodes": elastic["waited_for_nodes"],
        "baseline": "fails (PlacementImpossible); rerun when the node is back",
        "baseline_failed_s": r3(baseline["failed_s"]), "baseline_node_back_s": r3(baseline["node_back_s"]),
        "baseline_to_step_s": r3(baseline["to_step_s"]),
        "baseline_rerun_to_step_s": r3(baseline["rerun_to_step_s"]),
        "baseline_total_s": r3(baseline["total_s"]), "ratio": round(ratio, 2),
    }))


if __name__ == "__main__":
    main()
