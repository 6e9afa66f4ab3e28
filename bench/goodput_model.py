"""Goodput at scale, on paper: the expected share of wall time that trains the model at 1k, 16k
and 100k GPUs, from longrun's measured component times and a published failure rate, next to a
checkpoint-restart baseline. Pure arithmetic (no torch, no processes): it runs in well under a
second.

    .venv/bin/python bench/goodput_model.py
    .venv/bin/python bench/goodput_model.py --params 405e9 --storage-gbs 7000 --silent-share 0.25

Failure rate: Llama 3 405B's pre-training saw 419 unexpected interruptions in 54 days on 16,384
H100s, about 78% attributed to hardware (Meta, "The Llama 3 Herd of Models", 2024, section
3.3.4, table 5); the rate per GPU is taken as constant, so a job of N GPUs fails every
54 d x 16,384 / (419 N) on average (Poisson arrivals).

Measured inputs, each from a row of docs/benchmarks.md (2-vCPU CPU box, tiny worlds; every one
is a flag, so a GPU cluster's numbers can replace them):
  crash detection 0.48 s      "Losing no step": SIGKILL detected in 0.48 s (recovery.py --quick)
  warm restart 1.72 s         "Losing no step", steps-lost table, longrun / 8 steps / memory
                              snapshots every step: fault -> first step 1.72 s (a warm spare
                              takes over, restores from the keepers), 1 step lost
  cold restart 7.70 s         "Rerun after the house redesign": recovery.py, SIGKILL without
                              warm spares, fault -> first step (every process new)
  group formation at N        "Group bring-up": store scaling at 1,024 / 4,096 / 16,384 ranks,
                              longrun 0.88 / 3.24 / 15.73 s, TCPStore 2.02 / 5.72 / 27.45 s
                              (linear between, and past 16,384 at the last segment's slope)
  restore, memory 1.30 GB/s   "Losing no step", costs table, 1.62 GB: 1.25 s (fetch, SHA-256, load)
  restore, storage 0.88 GB/s  "Checkpoint save and restore": 1.22 GB cold page cache, 1.39 s
  snapshot blocking 13.1 GB/s costs table, 1.62 GB: 0.124 s; sent (serialise, hash) 4.36 s
  checkpoint blocking         "Checkpoint save and restore": longrun 0.173 s per 1.22 GB, end to
                              end 5.04 s; DCP async_save 0.561 s, end to end 4.06 s (the baseline)
  health defaults             platform/config/sections.py HealthSection: heartbeat_interval_s 1,
                              heartbeat_timeout_s 5, hang_min_s 10, hang_safety_factor 5
Assumptions (flags too): a 70B model's state at 16 bytes per parameter sharded over the whole
job; 2 TB/s of aggregate storage bandwidth (Llama 3's Tectonic, sustained); a 70B step from
Llama 3's tokens per GPU at 40% MFU; half of all faults silent (charged the learned hang
timeout), hardware faults replace a node (cold processes), the rest restart in place (warm
spares); 10% of faults also lose the memory snapshots that cover them (restored from storage).
The output lists every one.
Systems: longrun as configured by default (a memory snapshot every step, or as often as the
sends allow; a storage checkpoint every 50 steps), longrun with both intervals tuned (the best on
a grid; Young/Daly's sqrt(2 C MTBF) printed beside each as a cross-check), and the baseline:
restart everything, restore from storage, redo half a checkpoint interval on average, its
interval tuned alike. Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

from _common import logger, parser

log = logger("goodput_model")

GB = 1e9
DAY = 86400.0
STORE_RANKS = (1024, 4096, 16384)  # the store-scaling rows of "Group bring-up"


@dataclass(frozen=True)
class Knob:
    """One input: a measured number (with the row it comes from) or an assumption (with why)."""

    flag: str
    default: float
    unit: str
    source: str
    measured: bool = True


KNOBS = [
    Knob("crash-detect-s", 0.48, "s", "docs/benchmarks.md 'Losing no step': SIGKILL detected in 0.48 s"),
    Knob("warm-restart-s", 1.72, "s", "'Losing no step' steps-lost table, memory snapshots every step: "
         "fault -> first step 1.72 s (warm spare, restore from keepers; detection included)"),
    Knob("cold-restart-s", 7.70, "s", "'Rerun after the house redesign', recovery.py 'SIGKILL without "
         "warm spares': fault -> first step 7.70 s (new processes; detection included)"),
    Knob("baseline-restart-s", 7.70, "s", "restart everything = the same no-spares row, 7.70 s (Ray "
         "Train's full restart measured 14.37 s in that run)"),
    Knob("lost-steps", 1.0, "step(s)", "'Losing no step' steps-lost table: 1 step (the one in flight) "
         "with memory snapshots every step"),
    Knob("memory-restore-gbs", 1.62 / 1.25, "GB/s", "'Losing no step' costs, 1.62 GB: restore from "
         "memory 1.25 s"),
    Knob("storage-restore-gbs", 1.22 / 1.39, "GB/s", "'Checkpoint save and restore': restore of "
         "1.22 GB, cold page cache, 1.39 s"),
    Knob("snapshot-block-gbs", 1.62 / 0.124, "GB/s", "'Losing no step' costs, 1.62 GB: snapshot "
         "blocking copy 0.124 s"),
    Knob("snapshot-send-gbs", 1.62 / 4.36, "GB/s", "'Losing no step' costs, 1.62 GB: snapshot sent "
         "(serialised, hashed, handed over) 4.36 s"),
    Knob("ckpt-block-gbs", 1.22 / 0.173, "GB/s", "'Checkpoint save and restore': blocking per save "
         "0.173 s for 1.22 GB"),
    Knob("ckpt-write-gbs", 1.22 / 5.04, "GB/s", "'Checkpoint save and restore': end to end until "
         "committed 5.04 s"),
    Knob("baseline-block-gbs", 1.22 / 0.561, "GB/s", "'Checkpoint save and restore': DCP async_save "
         "blocking 0.561 s for 1.22 GB"),
    Knob("baseline-write-gbs", 1.22 / 4.06, "GB/s", "'Checkpoint save and restore': DCP end to end "
         "4.06 s"),
    Knob("heartbeat-timeout-s", 5.0, "s", "HealthSection default (heartbeat_interval_s 1.0): a frozen "
         "host is declared dead after it"),
    Knob("hang-min-s", 10.0, "s", "HealthSection default: floor of the learned hang timeout"),
    Knob("hang-factor", 5.0, "x step", "HealthSection default hang_safety_factor"),
    # Assumptions.
    Knob("interruptions", 419, "", "Llama 3 405B: unexpected interruptions (section 3.3.4)", False),
    Knob("days", 54, "d", "Llama 3 405B: length of that pre-training snapshot", False),
    Knob("reference-gpus", 16384, "GPUs", "Llama 3 405B: GPUs of that job", False),
    Knob("hardware-share", 0.78, "", "Llama 3: share attributed to hardware; such a fault replaces a "
         "node (cold processes), the rest restart in place on warm spares", False),
    Knob("silent-share", 0.5, "", "faults that report no death (hangs, frozen hosts): charged the "
         "learned hang timeout, not the crash detection", False),
    Knob("memory-miss", 0.1, "", "faults that also lose the snapshots covering them (correlated "
         "failures: a switch, a rack): restored from storage, half a storage interval redone", False),
    Knob("params", 70e9, "", "model parameters", False),
    Knob("bytes-per-param", 16, "B", "bf16 weights 2 + fp32 master 4 + Adam moments 8 = 14, ~16", False),
    Knob("storage-gbs", 2000, "GB/s", "aggregate storage bandwidth, shared by the job (Llama 3's "
         "Tectonic: 2 TB/s sustained, 7 TB/s peak)", False),
    Knob("peer-gbs", 3.0, "GB/s", "per GPU, snapshot traffic to and from keepers on other nodes (a "
         "node's 200 Gb/s front-end NIC shared by 8 GPUs)", False),
    Knob("tokens-per-gpu", 1024, "tokens", "per step (Llama 3's 16M-token batch over 16,384 GPUs), "
         "the batch growing with the job", False),
    Knob("mfu", 0.40, "", "Llama 3 405B reports 38-43%", False),
    Knob("peak-tflops", 989, "TFLOP/s", "H100 SXM dense bf16", False),
]
STORE = {"longrun": (0.88, 3.24, 15.73), "baseline": (2.02, 5.72, 27.45)}


def group_formation_s(ranks: float, points: tuple[float, ...]) -> float:
    """Store time to form a world and its groups at `ranks` (the measured rows, linear between
    and beyond: past 16,384 ranks at the last segment's per-rank cost)."""
    xs = STORE_RANKS
    if ranks <= xs[0]:
        return points[0] * ranks / xs[0]
    i = next((k for k in range(1, len(xs)) if ranks <= xs[k]), len(xs) - 1)
    slope = (points[i] - points[i - 1]) / (xs[i] - xs[i - 1])
    return points[i - 1] + slope * (ranks - xs[i - 1])


def mtbf_s(a, gpus: float) -> float:
    return a.days * DAY * a.reference_gpus / (a.interruptions * gpus)


def step_s(a) -> float:
    return 6 * a.params * a.tokens_per_gpu / (a.peak_tflops * 1e12 * a.mfu)


def scenario(a, gpus: float, shard_gpus: float | None = None) -> dict:
    """Everything that depends on the job's size but not on the checkpoint intervals."""
    shard = gpus if shard_gpus is None else min(shard_gpus, gpus)
    total = a.params * a.bytes_per_param
    per_gpu = total / shard
    step = step_s(a)
    # A silent fault is declared by the heartbeat timeout (a frozen host) or the learned hang
    # timeout (a collective stuck with live heartbeats): charged the later of the two.
    hang = max(a.heartbeat_timeout_s, a.hang_min_s, a.hang_factor * step)
    stored = per_gpu * gpus / (a.storage_gbs * GB)  # every rank's piece through the shared storage
    send = per_gpu / (a.snapshot_send_gbs * GB) + per_gpu / (a.peer_gbs * GB)
    return {
        "gpus": gpus, "mtbf_s": mtbf_s(a, gpus), "per_gpu_bytes": per_gpu, "step_s": step,
        "hang_detect_s": hang,
        # The measured restart rows include a crash's detection; silent faults wait for the timeout.
        "detect_extra_s": a.silent_share * (hang - a.crash_detect_s),
        "storage_restore_s": max(per_gpu / (a.storage_restore_gbs * GB), stored),
        "memory_restore_s": per_gpu / (a.memory_restore_gbs * GB) + per_gpu / (a.peer_gbs * GB),
        "snapshot_block_s": per_gpu / (a.snapshot_block_gbs * GB),
        "min_snapshot_every": max(1, math.ceil(send / step)),  # a send must end before the next
        "longrun": {"block_s": per_gpu / (a.ckpt_block_gbs * GB),
                    "min_interval_s": max(per_gpu / (a.ckpt_write_gbs * GB), stored),
                    "formation_s": group_formation_s(gpus, STORE["longrun"])},
        "baseline": {"block_s": per_gpu / (a.baseline_block_gbs * GB),
                     "min_interval_s": max(per_gpu / (a.baseline_write_gbs * GB), stored),
                     "formation_s": group_formation_s(gpus, STORE["baseline"])},
    }


def per_fault(a, s: dict, system: str, interval: float, every: int) -> dict:
    """Expected seconds one fault costs (nothing trains meanwhile), by part. `interval`: seconds
    between storage checkpoints; `every`: steps between memory snapshots (longrun)."""
    if system == "baseline":
        return {"detection": s["detect_extra_s"], "restart": a.baseline_restart_s,
                "group formation": s["baseline"]["formation_s"], "restore": s["storage_restore_s"],
                "redone work": interval / 2}
    hw, miss = a.hardware_share, a.memory_miss
    # The step in flight, plus on average half the steps between two snapshots.
    lost_memory = (a.lost_steps + (every - 1) / 2) * s["step_s"]
    return {"detection": s["detect_extra_s"],
            "restart": hw * a.cold_restart_s + (1 - hw) * a.warm_restart_s,
            "group formation": s["longrun"]["formation_s"],
            "restore": (1 - miss) * s["memory_restore_s"] + miss * s["storage_restore_s"],
            "redone work": (1 - miss) * lost_memory + miss * interval / 2}


def goodput(a, s: dict, system: str, interval: float, every: int = 1) -> tuple[float, dict, float]:
    """First order: a fault every MTBF stops training for its cost; the time left trains, paying
    the blocking part of each save (and of each memory snapshot)."""
    parts = per_fault(a, s, system, interval, every)
    overhead = s[system]["block_s"] / interval
    if system == "longrun":
        overhead += s["snapshot_block_s"] / (every * s["step_s"])
    return (1 - sum(parts.values()) / s["mtbf_s"]) / (1 + overhead), parts, overhead


def _log_grid(lo: float, hi: float, n: int = 1500) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)] if hi > lo else [lo]


def best_intervals(a, s: dict, system: str) -> tuple[float, int]:
    """The storage interval (s, from the time a save takes to reach storage up to a day) and,
    for longrun, the snapshot interval (steps, from what the sends allow) with the highest
    goodput: each on a log grid, the other held, twice round."""
    t_grid = _log_grid(max(1.0, s[system]["min_interval_s"]), DAY)
    k_lo = s["min_snapshot_every"]
    k_grid = sorted({round(k) for k in _log_grid(k_lo, max(k_lo, DAY / s["step_s"]))})
    interval, every = DAY, k_lo
    for _ in range(2):
        interval = max(t_grid, key=lambda t: goodput(a, s, system, t, every)[0])
        if system == "longrun":
            every = max(k_grid, key=lambda k: goodput(a, s, system, interval, k)[0])
    return interval, every


def young_daly(a, s: dict, system: str) -> tuple[float, float]:
    """Young/Daly's first-order optimum sqrt(2 C M), C a save's blocking time, M the mean time
    between the faults that need it: for storage checkpoints, and for memory snapshots (s)."""
    needs_storage = 1.0 if system == "baseline" else a.memory_miss
    storage = math.sqrt(2 * s[system]["block_s"] * s["mtbf_s"] / needs_storage) if needs_storage else math.inf
    memory = math.sqrt(2 * s["snapshot_block_s"] * s["mtbf_s"] / (1 - a.memory_miss))
    return storage, memory


def evaluate(a, s: dict) -> dict:
    """longrun as configured by default (a snapshot every step or as often as the sends allow,
    storage every checkpoint.interval_steps = 50 steps), longrun tuned, and the baseline."""
    out = {}
    default_every = s["min_snapshot_every"]
    default_interval = max(50 * s["step_s"], s["longrun"]["min_interval_s"])
    for name, system, (interval, every) in (
            ("longrun, defaults", "longrun", (default_interval, default_every)),
            ("longrun, tuned", "longrun", best_intervals(a, s, "longrun")),
            ("baseline", "baseline", best_intervals(a, s, "baseline"))):
        g, parts, overhead = goodput(a, s, system, interval, every)
        storage_yd, memory_yd = young_daly(a, s, system)
        out[name] = {"goodput": g, "interval_s": interval, "snapshot_every": every if system == "longrun"
                     else None, "young_daly_s": storage_yd,
                     "snapshot_young_daly_steps": memory_yd / s["step_s"] if system == "longrun" else None,
                     "per_fault_s": sum(parts.values()), "parts": parts, "overhead": overhead}
    return out


def hm(seconds: float) -> str:
    if math.isinf(seconds):
        return "never"
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def number(value: float, unit: str) -> str:
    text = f"{value:,.0f}" if value >= 1000 and value == int(value) else f"{value:.4g}"
    return f"{text} {unit}".strip()


def steps(n: int) -> str:
    return f"{n} step" + ("" if n == 1 else "s")


def size(nbytes: float) -> str:
    return f"{nbytes / GB:.2f} GB" if nbytes >= GB else f"{nbytes / 1e6:.0f} MB"


def main() -> None:
    p = parser(__doc__)
    for k in KNOBS:
        p.add_argument(f"--{k.flag}", type=float, default=k.default, help=f"{k.unit} - {k.source}")
    p.add_argument("--gpus", type=float, nargs="+", default=[1024, 16384, 100000])
    p.add_argument("--shard-gpus", type=float, default=None,
                   help="GPUs one copy of the state is sharded over (HSDP); default: the whole job")
    p.add_argument("--target", type=float, default=0.97)
    a = p.parse_args()
    log("pure arithmetic over the measured rows of docs/benchmarks.md; no processes")

    print("## Inputs (measured, from docs/benchmarks.md; each a --flag)\n")
    print("| input | value | source |\n| --- | --- | --- |")
    for k in KNOBS:
        if k.measured:
            value = getattr(a, k.flag.replace("-", "_"))
            mark = "" if value == k.default else " (overridden)"
            print(f"| {k.flag} | {number(value, k.unit)}{mark} | {k.source} |")
    print("| group formation, longrun / TCPStore | "
          f"{'/'.join(map(str, STORE['longrun']))} s vs {'/'.join(map(str, STORE['baseline']))} s at "
          f"{'/'.join(map(str, STORE_RANKS))} ranks | 'Group bring-up', store scaling rows |")
    print("\n## Assumptions (each a --flag)\n")
    print("| assumption | value | why |\n| --- | --- | --- |")
    for k in KNOBS:
        if not k.measured:
            value = getattr(a, k.flag.replace("-", "_"))
            print(f"| {k.flag} | {number(value, k.unit)} | {k.source} |")
    print(f"| state sharded over | {'the whole job' if a.shard_gpus is None else f'{a.shard_gpus:g} GPUs'} | "
          "each GPU holds total / shard GPUs of it; the job restores N x that from storage |")
    print("| model | first order | faults Poisson, none during a recovery; a fault's cost trains "
          "nothing; blocking time per save or snapshot stops training; storage saves must not "
          "overlap |")

    rows = []
    for n in a.gpus:
        s = scenario(a, n, a.shard_gpus)
        systems = evaluate(a, s)
        tuned = systems["longrun, tuned"]
        rows.append({"gpus": int(n), "mtbf_s": s["mtbf_s"], "per_gpu_bytes": s["per_gpu_bytes"],
                     "step_s": s["step_s"], "systems": systems,
                     # The fault cost longrun could afford and still reach the target, at its overheads.
                     "budget_s": (1 - a.target * (1 + tuned["overhead"])) * s["mtbf_s"]})

    print(f"\n## Goodput by job size ({a.params / 1e9:g}B parameters, "
          f"{a.params * a.bytes_per_param / 1e12:.2f} TB of state)\n")
    print("| GPUs | MTBF | state per GPU | step | system | memory snapshot every (Young/Daly) | "
          "storage checkpoint every (Young/Daly) | per fault | steady overhead | **goodput** |")
    print("| " + " | ".join(["---"] * 10) + " |")
    for r in rows:
        for name, v in r["systems"].items():
            snap = "-" if v["snapshot_every"] is None else \
                f"{steps(v['snapshot_every'])} ({v['snapshot_young_daly_steps']:.0f})"
            print(f"| {r['gpus']:,} | {hm(r['mtbf_s'])} | {size(r['per_gpu_bytes'])} | {r['step_s']:.2f} s | "
                  f"{name} | {snap} | {hm(v['interval_s'])} ({hm(v['young_daly_s'])}) | "
                  f"{v['per_fault_s']:.1f} s | {v['overhead']:.2%} | **{v['goodput']:.2%}** |")
    print(f"\nPer-fault budget for {a.target:.0%} (at tuned longrun's overheads): "
          + ", ".join(f"{r['budget_s']:.0f} s at {r['gpus']:,} GPUs" for r in rows) + ".")

    print("\n## Where a fault's seconds go (longrun tuned vs baseline)\n")
    names = list(rows[0]["systems"]["baseline"]["parts"])
    print("| GPUs | system | " + " | ".join(names) + " |")
    print("| " + " | ".join(["---"] * (len(names) + 2)) + " |")
    for r in rows:
        for name in ("longrun, tuned", "baseline"):
            parts = r["systems"][name]["parts"]
            print(f"| {r['gpus']:,} | {name} | " + " | ".join(f"{parts[k]:.2f} s" for k in names) + " |")

    n_mid = 16384 if 16384 in a.gpus else a.gpus[len(a.gpus) // 2]
    s = scenario(a, n_mid, a.shard_gpus)
    every = best_intervals(a, s, "longrun")[1]
    print(f"\n## Storage checkpoint interval at {int(n_mid):,} GPUs (longrun: a memory snapshot every "
          f"{steps(every)})\n")
    print("| storage checkpoint every | longrun goodput | baseline goodput |\n| --- | --- | --- |")
    sweep = {}
    for t in (30, 120, 300, 900, 1800, 3600, 3 * 3600):
        lg, bg = goodput(a, s, "longrun", t, every)[0], goodput(a, s, "baseline", t)[0]
        sweep[t] = {"longrun": round(lg, 5), "baseline": round(bg, 5)}
        print(f"| {hm(t)} | {lg:.2%} | {bg:.2%} |")

    print(f"\n## State size at {int(n_mid):,} GPUs (each system at its best intervals)\n")
    print(f"| model ({a.bytes_per_param:g} B/param) | sharded over | state per GPU | longrun tuned | "
          "longrun defaults | baseline |\n| --- | --- | --- | --- | --- | --- |")
    states = []
    for params, shard in ((8e9, None), (70e9, None), (405e9, None), (70e9, 512), (405e9, 1024)):
        b = argparse.Namespace(**(vars(a) | {"params": params}))
        s = scenario(b, n_mid, shard)
        v = {name: x["goodput"] for name, x in evaluate(b, s).items()}
        where = "the job" if shard is None else f"{shard:,} GPUs (HSDP)"
        states.append({"params": params, "shard_gpus": shard} | {k: round(x, 5) for k, x in v.items()})
        print(f"| {params / 1e9:g}B | {where} | {size(s['per_gpu_bytes'])} | {v['longrun, tuned']:.2%} | "
              f"{v['longrun, defaults']:.2%} | {v['baseline']:.2%} |")

    verdict = {}
    mid = next(r for r in rows if r["gpus"] == int(n_mid))
    for name, v in mid["systems"].items():
        top = max(v["parts"], key=v["parts"].get)
        verdict[name] = {"goodput": round(v["goodput"], 5), "meets": v["goodput"] >= a.target,
                         "largest_per_fault": top, "largest_s": round(v["parts"][top], 2)}
    print(f"\nAt {int(n_mid):,} GPUs against the {a.target:.0%} target: " + "; ".join(
        f"{name} {v['goodput']:.2%} ({'meets' if v['meets'] else 'MISSES'}; largest cost per fault: "
        f"{v['largest_per_fault']}, {v['largest_s']} s)" for name, v in verdict.items()) + ".")
    r5 = lambda x: round(x, 5)  # noqa: E731
    names = list(rows[0]["systems"])
    print(json.dumps({
        "gpus": [r["gpus"] for r in rows], "params": a.params, "target": a.target,
        "mtbf_h": [round(r["mtbf_s"] / 3600, 3) for r in rows],
        "per_gpu_gb": [round(r["per_gpu_bytes"] / GB, 4) for r in rows],
        "goodput": {n: [r5(r["systems"][n]["goodput"]) for r in rows] for n in names},
        "per_fault_s": {n: [round(r["systems"][n]["per_fault_s"], 2) for r in rows] for n in names},
        "storage_interval_s": {n: [round(r["systems"][n]["interval_s"], 1) for r in rows] for n in names},
        "young_daly_s": {n: [round(r["systems"][n]["young_daly_s"], 1) for r in rows] for n in names},
        "snapshot_every_steps": [r["systems"]["longrun, tuned"]["snapshot_every"] for r in rows],
        "budget_s": [round(r["budget_s"], 1) for r in rows],
        f"at_{int(n_mid)}": verdict, "interval_sweep": sweep, "state_sizes": states,
    }))


if __name__ == "__main__":
    main()
