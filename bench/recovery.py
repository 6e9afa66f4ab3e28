"""Recovery from a lost worker: longrun's controller vs Ray Train's TorchTrainer, side by side.

    RAY_USAGE_STATS_ENABLED=0 .venv/bin/python bench/recovery.py --quick   # one run of each
    RAY_USAGE_STATS_ENABLED=0 .venv/bin/python bench/recovery.py           # 3 repeats

Needs Ray Train (`pip install -e '.[bench]'`). Both run on the same local multi-node cluster
(`ray.cluster_utils.Cluster`: a head with no CPUs and 3 nodes of 2 CPUs), the same tiny model
and data (longrun's `Trainer`, 4 data-parallel CPU workers on gloo) and a checkpoint every step.
In each run rank 1 is hit after step 20 of the first attempt, from inside its own process:
  kill  SIGKILL (a crashed process);
  hang  SIGSTOP (a wedged process: alive, silent).
Measured, from the wall time the fault fired (recorded by the faulting process just before):
  detect    until the fault is declared. longrun: the controller's `fault` event. Ray Train
            has no such event; its figure is until its new worker group entered the training
            function again, which bounds its detection from above.
  recover   longrun: from the declaration until every rank of the new attempt completed a step
            (the controller's `recovered` event).
  to_step   fault -> first completed step of the new attempt: the end-to-end cost, comparable
            across the two.
  lost      the step at the fault minus the step training resumed from.
longrun also runs the kill without warm spares (`RayLauncher(spares=False)`): every restart
then starts fresh processes, which is what the spares save. And, for the steps a fault costs,
the kill with storage checkpoints every 8 steps (what a large model affords), with and without
peer memory snapshots every step (`checkpoint.memory_interval_steps`; the other runs keep
them off, so they measure what they measured before): without, the restart redoes the steps
since the last checkpoint; with, only the step whose snapshot was still being sent.
Ray Train runs with `FailureConfig(max_failures=1)` (its default, 0, would not restart at all)
and a `train.report` with a checkpoint each step (rank files in one checkpoint directory).
Both systems run under two sets of detection knobs, side by side:
  defaults   each as shipped: longrun's heartbeat every 1 s, a rank silent 5 s is dead, a 10 s
             floor on the learned hang timeout, 1 s restart backoff; Ray Train v2 polls its
             workers every 2 s and declares a worker whose health check hangs 600 s dead (so its
             hang is not run here: it would wait 10 minutes).
  same       both tuned alike: a 0.5 s detection interval (longrun's heartbeat, Ray Train's
             RAY_TRAIN_HEALTH_CHECK_INTERVAL_S) and a 3 s timeout (longrun's heartbeat timeout and
             hang floor, Ray Train's RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S), no restart backoff
             (Ray Train has none).
Each ratio is Ray Train's median over longrun's, fault to first step; longrun's with warm spares
and without (`ratio_no_spares`: the restart then starts processes cold, as Ray Train's does).
Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import parser

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # 4 workers share the cores; raylets pass it on

FAULT_STEP = 20
STEPS = 26
WORKERS = 4
STEP_PAD_S = 0.5  # rank 0 sleeps this after each step: the job is long enough for spares to warm


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# The detection knobs per profile: longrun's `health` section (None: its defaults) and restart
# backoff, and the environment Ray Train v2 reads (propagated from the driver at fit()).
SAME_INTERVAL_S, SAME_TIMEOUT_S = 0.5, 3.0
KNOBS = {
    "defaults": {"health": {}, "backoff_s": None, "ray_train_env": {}},
    "same": {"health": {"heartbeat_interval_s": SAME_INTERVAL_S, "heartbeat_timeout_s": SAME_TIMEOUT_S,
                        "hang_min_s": SAME_TIMEOUT_S},
             "backoff_s": 0.0,
             "ray_train_env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(SAME_INTERVAL_S),
                               "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": str(SAME_TIMEOUT_S)}},
}
RAY_TRAIN_ENV = sorted({key for knobs in KNOBS.values() for key in knobs["ray_train_env"]})


def job_dict(name: str, out: str, fault: str | None, *, interval: int = 1, memory: bool = False,
             profile: str = "same") -> dict:
    faults = [{"rank": 0, "step": 1, "kind": "slow", "seconds": STEP_PAD_S}]
    faults += [{"rank": 1, "step": FAULT_STEP, "kind": fault}] if fault else []
    return {
        "job": {"name": name, "seed": 7, "output_dir": out},
        "cluster": {"nodes": 2, "workers_per_node": 2, "device": "cpu"},
        "parallelism": {"dp": WORKERS},
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64},
        "data": {"source": "synthetic", "micro_batch_tokens": 128, "prefetch": 1,
                 "synthetic": {"min_len": 8, "max_len": 64, "mean": 24, "sigma": 0.8}},
        "training": {"steps": STEPS, "lr": 3e-3, "warmup_steps": 2, "log_every": 100},
        "checkpoint": {"interval_steps": interval, "keep_last": 3,
                       "memory_interval_steps": 1 if memory else 0},
        "health": {**KNOBS[profile]["health"], "faults": faults},
        "recovery": ({} if KNOBS[profile]["backoff_s"] is None
                     else {"restart_backoff_s": KNOBS[profile]["backoff_s"]}),
    }


# -- longrun ---------------------------------------------------------------------------------

def run_longrun(fault: str, redis_url: str, out: str, index: int, spares: bool = True, *,
                interval: int = 1, memory: bool = False, profile: str = "same") -> dict:
    from longrun.config import config_from_dict
    from longrun.controller.controller import Controller, job_status
    from longrun.controller.workers import RayLauncher
    from longrun.services.redis_client import quick_client

    tag = f"{profile}-{'warm' if spares else 'cold'}-i{interval}{'-mem' if memory else ''}"
    cfg = config_from_dict(job_dict(f"bench-{fault}-{index}-{tag}", out, fault, interval=interval,
                                    memory=memory, profile=profile))
    started = time.time()
    def show(line: str) -> None:
        say(f"  longrun {time.time() - started:6.2f} s | {line}")

    summary = Controller(cfg, redis_url, launch=RayLauncher(spares=spares), on_event=show).run()
    client = quick_client(redis_url)
    events = job_status(client, cfg.job.name, events=1000)["events"]
    client.close()
    fired = next(e for e in events if e["type"] == "fault_injected" and e["fault"] == fault)
    declared = next(e for e in events if e["type"] == "fault")
    recovered = next(e for e in events if e["type"] == "recovered")
    detect = declared["at"] - fired["at"]
    # The fault's own recovery: the step its restart resumed from, not the job's last resume (a
    # later restart, for another cause, resumes past the fault: "-3 steps lost" on 2026-11-28).
    return {"detect_s": detect, "recover_s": recovered["seconds"],
            "to_step_s": detect + recovered["seconds"],
            "steps_lost": fired["step"] - recovered["resumed_from"], "restarts": summary["restarts"],
            "declared": declared["reason"],
            "later_faults": [e["reason"] for e in events if e["type"] == "fault"][1:]}


# -- Ray Train --------------------------------------------------------------------------------

def _ray_train_loop(config: dict) -> None:
    """Ray Train's worker function: the same Trainer, per-step checkpoints, the same fault."""
    import torch
    import torch.distributed as dist
    from ray import train
    from ray.train import Checkpoint

    from longrun.config import config_from_dict
    from longrun.trainer import Trainer

    ctx = train.get_context()
    rank = ctx.get_world_rank()
    marks = Path(config["marks"])
    cfg = config_from_dict(job_dict("ray-train", config["out"], None))
    with Trainer(cfg, dp_group=dist.group.WORLD, progress=False) as trainer:
        resumed = 0
        checkpoint = train.get_checkpoint()
        if checkpoint is not None:
            with checkpoint.as_directory() as d:
                trainer.load_state_dict(torch.load(Path(d) / f"rank-{rank}.pt", weights_only=False))
            resumed = trainer.step
            (marks / f"restarted-{rank}").write_text(json.dumps({"at": time.time(), "step": resumed}))
        while trainer.step < cfg.training.steps:
            trainer.train(steps=1)
            if resumed and trainer.step == resumed + 1 and rank == 0:
                (marks / "first_step").write_text(json.dumps({"at": time.time()}))
            with tempfile.TemporaryDirectory() as d:
                torch.save(trainer.state_dict(), Path(d) / f"rank-{rank}.pt")
                train.report({"step": trainer.step}, checkpoint=Checkpoint.from_directory(d))
            if rank == 0:
                time.sleep(STEP_PAD_S)  # as longrun's slow fault: the same step times
            if rank == 1 and trainer.step == FAULT_STEP and not (marks / "fired").exists():
                (marks / "fired").write_text(json.dumps({"at": time.time(), "step": trainer.step}))
                os.kill(os.getpid(), signal.SIGKILL if config["fault"] == "kill" else signal.SIGSTOP)


def run_ray_train(fault: str, out: str, index: int, profile: str = "same") -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    for key in RAY_TRAIN_ENV:  # this profile's knobs only: Ray Train propagates what is set
        os.environ.pop(key, None)
    os.environ.update(KNOBS[profile]["ray_train_env"])

    marks = Path(out) / "marks"
    marks.mkdir(parents=True)
    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={"marks": str(marks), "out": out, "fault": fault},
        scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False, resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(name=f"ray-train-{fault}-{index}-{profile}",
                             storage_path=str(Path(out) / "storage"),
                             failure_config=FailureConfig(max_failures=1)),
    )
    started = time.time()
    result = trainer.fit()
    say(f"  ray train | finished in {time.time() - started:.1f} s, last metrics {result.metrics}")
    fired = json.loads((marks / "fired").read_text())
    restarted = json.loads((marks / "restarted-0").read_text())
    first = json.loads((marks / "first_step").read_text())
    return {"detect_s": restarted["at"] - fired["at"], "to_step_s": first["at"] - fired["at"],
            "steps_lost": fired["step"] - restarted["step"]}


# -- the run ----------------------------------------------------------------------------------

def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    cli = parser(__doc__.split("\n")[0])
    cli.add_argument("--quick", action="store_true",
                     help="one run of each; no longrun hang at its defaults")
    cli.add_argument("--reps", type=int, default=3)
    cli.add_argument("--only", action="append", metavar="PROFILE/FAULT",
                     help="run only these rows (e.g. same/hang; `sparse` for the storage pair) and "
                          "print their runs as JSON instead of the ratios")
    args = cli.parse_args()
    reps = 1 if args.quick else args.reps
    try:
        import ray.train
    except ImportError as exc:
        raise SystemExit("bench/recovery.py compares with Ray Train: pip install -e '.[bench]' "
                         f"({exc})") from exc
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(3):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        results = run_all(reps, args.quick, set(args.only or ()))
    finally:
        ray.shutdown()
        cluster.shutdown()
    print_table(results)
    print(json.dumps(results if args.only else summarize(results, reps)))


Results = dict[str, dict[str, list[dict]]]  # "profile/system" -> fault -> runs


def run_all(reps: int, quick: bool, only: set[str] = frozenset()) -> Results:
    """Every run, by profile and system, then fault: longrun (with and without spares) and Ray
    Train at both profiles' knobs, and the storage-every-8-steps pair at the same knobs; or the
    rows `only` names."""
    from longrun.services import EmbeddedRedis

    results: Results = {}

    def record(key: str, fault: str, label: str, fn, *args, **kwargs) -> None:
        say(label)
        r = fn(*args, **kwargs)
        say(f"  -> {r}")
        results.setdefault(key, {}).setdefault(fault, []).append(r)

    with EmbeddedRedis() as redis_server, tempfile.TemporaryDirectory(prefix="longrun-bench-") as tmp:
        url = redis_server.url
        for rep in range(reps):
            head = f"rep {rep + 1}/{reps}"
            for profile in KNOBS:
                for fault in ("kill", "hang"):
                    if fault == "hang" and profile == "defaults" and quick:
                        continue
                    if only and f"{profile}/{fault}" not in only:
                        continue
                    where = f"{tmp}/{profile}-{fault}-{rep}"
                    record(f"{profile}/longrun", fault, f"{head}: longrun at {profile}, {fault}",
                           run_longrun, fault, url, f"{where}-lr", rep, profile=profile)
                    if fault == "kill":  # what the warm spares buy: the same fault without them
                        record(f"{profile}/longrun_cold", fault,
                               f"{head}: longrun at {profile} without spares, {fault}",
                               run_longrun, fault, url, f"{where}-cold", rep, spares=False, profile=profile)
                    if fault == "hang" and profile == "defaults":
                        continue  # Ray Train's default health-check timeout is 600 s
                    record(f"{profile}/ray_train", fault, f"{head}: Ray Train at {profile}, {fault}",
                           run_ray_train, fault, f"{where}-rt", rep, profile=profile)
            # What memory snapshots buy: steps lost with storage every 8 steps.
            if only and "sparse" not in only:
                continue
            record("sparse", "kill", f"{head}: longrun, storage every 8 steps",
                   run_longrun, "kill", url, f"{tmp}/sparse-{rep}", rep, interval=8)
            record("sparse_memory", "kill", f"{head}: longrun, storage every 8 steps + memory snapshots",
                   run_longrun, "kill", url, f"{tmp}/mem-{rep}", rep, interval=8, memory=True)
    return results


ROWS = (("longrun", "longrun"), ("longrun_cold", "longrun, no spares"), ("ray_train", "Ray Train"))


def print_table(results: Results) -> None:
    say("\n| knobs | fault | system | detect s | recover s | fault -> first step s | steps lost |")
    say("| --- | --- | --- | --- | --- | --- | --- |")
    for profile in KNOBS:
        for fault in ("kill", "hang"):
            for system, label in ROWS:
                runs = results.get(f"{profile}/{system}", {}).get(fault)
                if not runs:
                    continue
                bound = "<= " if system == "ray_train" else ""
                recover = "" if system == "ray_train" else f"{median(runs, 'recover_s'):.2f}"
                say(f"| {profile} | {fault} | {label} | {bound}{median(runs, 'detect_s'):.2f} | {recover} "
                    f"| {median(runs, 'to_step_s'):.2f} | {median(runs, 'steps_lost'):g} |")
    for key, label in (("sparse", "longrun, storage every 8 steps"),
                       ("sparse_memory", "longrun, storage every 8 steps + memory snapshots")):
        runs = results.get(key, {}).get("kill")
        if not runs:
            continue
        say(f"| same | kill | {label} | {median(runs, 'detect_s'):.2f} | {median(runs, 'recover_s'):.2f} "
            f"| {median(runs, 'to_step_s'):.2f} | {median(runs, 'steps_lost'):g} |")


def summarize(results: Results, reps: int) -> dict:
    def to_step(key: str, fault: str = "kill") -> float:
        return median(results[key][fault], "to_step_s")

    lr, cold, rt = (results[f"same/{system}"] for system in ("longrun", "longrun_cold", "ray_train"))
    summary = {
        "knobs": KNOBS,
        # Fault to first step, Ray Train's median over longrun's, side by side.
        "ratio_defaults": round(to_step("defaults/ray_train") / to_step("defaults/longrun"), 2),
        "ratio_no_spares_defaults": round(
            to_step("defaults/ray_train") / to_step("defaults/longrun_cold"), 2),
        "ratio_same_knobs": round(to_step("same/ray_train") / to_step("same/longrun"), 2),
        "ratio_no_spares": round(to_step("same/ray_train") / to_step("same/longrun_cold"), 2),
        "ratio_hang_same_knobs": round(
            to_step("same/ray_train", "hang") / to_step("same/longrun", "hang"), 2),
        "longrun_defaults_s": round(to_step("defaults/longrun"), 3),
        "longrun_no_spares_defaults_s": round(to_step("defaults/longrun_cold"), 3),
        "ray_train_defaults_s": round(to_step("defaults/ray_train"), 3),
        "longrun_same_knobs_s": round(to_step("same/longrun"), 3),
        "longrun_no_spares_s": round(to_step("same/longrun_cold"), 3),
        "ray_train_same_knobs_s": round(to_step("same/ray_train"), 3),
        "longrun_hang_same_knobs_s": round(to_step("same/longrun", "hang"), 3),
        "ray_train_hang_same_knobs_s": round(to_step("same/ray_train", "hang"), 3),
        # The same-knobs rows in detail (the keys earlier runs reported).
        "detect_kill_s": round(median(lr["kill"], "detect_s"), 3),
        "detect_hang_s": round(median(lr["hang"], "detect_s"), 3),
        "recover_s": round(median(lr["kill"], "recover_s"), 3),
        "recover_hang_s": round(median(lr["hang"], "recover_s"), 3),
        "recover_no_spares_s": round(median(cold["kill"], "recover_s"), 3),
        "ray_train_detect_kill_s_upper": round(median(rt["kill"], "detect_s"), 3),
        "ray_train_detect_hang_s_upper": round(median(rt["hang"], "detect_s"), 3),
        "steps_lost": max(r["steps_lost"] for key in results if key.endswith("/longrun")
                          for runs in results[key].values() for r in runs),
        "ray_train_steps_lost": max(r["steps_lost"] for key in results if key.endswith("/ray_train")
                                    for runs in results[key].values() for r in runs),
        "steps_lost_storage_every_8": median(results["sparse"]["kill"], "steps_lost"),
        "steps_lost_with_memory": median(results["sparse_memory"]["kill"], "steps_lost"),
        "to_step_with_memory_s": round(to_step("sparse_memory"), 3),
        "reps": reps,
    }
    if "hang" in results["defaults/longrun"]:
        summary["longrun_hang_defaults_s"] = round(to_step("defaults/longrun", "hang"), 3)
    return summary


if __name__ == "__main__":
    main()
