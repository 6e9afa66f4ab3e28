"""A soak: one job for a set time through a stream of faults injected from outside, and what it cost.

    RAY_USAGE_STATS_ENABLED=0 unshare --net -- sh -c 'ip link set lo up && exec python bench/soak.py'
    (same) python bench/soak.py --quick       # about 5 minutes: each fault kind once, a 32 MB state
    (same) python bench/soak.py --minutes 20  # any length; --seed N replays a schedule
    (same) python bench/soak.py --bounded     # the default tests' soak: three faults of different kinds
    (same) python bench/soak.py --state-mb 512  # the training state's size (default 512 MB)

Runs as root inside a network namespace with only loopback (every server binds 127.0.0.1).
A simulated 3-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: a head with no CPUs
and 3 nodes of 2 CPUs), a Redis of its own with an append-only file, and one `longrun run` on 2
of the nodes (one rank each, dp 2; the third node is the spare) of a 2-layer model whose
training state (fp32 weights and AdamW moments) is `--state-mb` (512 MB: its snapshot's send
takes half a step or more here), with a storage checkpoint every 10 steps (on a tmpfs sized to
the state) and memory snapshots at the default `auto` interval (every step where a send fits in
one, longer where it does not; each attempt's choice, read from its rank logs, is the bound on
the steps a fault covered by a snapshot may lose). Every rank sleeps `--pace` (1 s) inside each step,
before the optimizer update, as a large model's forward and backward take seconds: a fault's
random moment falls in the forward, backward, update, save or snapshot by its real share.
Faults come from outside longrun's own injector, one at a seeded random moment of each slot of
`--every` seconds (120) from the first step on, kinds in a seeded order cycling through:
  worker_kill         SIGKILL to a training worker, by pid
  worker_stop         SIGSTOP to a training worker (still frozen 180 s later: the soak FAILS)
  node_loss           a Ray node running a rank removed (no graceful shutdown); a new node joins
                      10-40 s later
  redis_kill          SIGKILL to redis-server, restarted 2-6 s later on the same port
  run_sigterm         SIGTERM to `longrun run` (a scheduler's preemption), then the same command
                      again
  controller_kill     SIGKILL to `longrun run` (its workers go with it; its snapshot keepers stay
                      for the next controller), then the same command again
  keeper_kill         SIGKILL to a snapshot keeper
  spare_kill          SIGKILL to a warm spare worker
  startup_kill        SIGKILL to a training worker, then to a worker of the next attempt while it
                      starts (placement, rendezvous or restore)
  checkpoint_corrupt  64 flipped bytes in a data file of the newest committed checkpoint, then
                      every keeper and a worker SIGKILLed: the restore must read storage, find
                      the damage and take the step before
  disk_full           the checkpoint tmpfs filled; kept full through the restart the failed save
                      causes (freed once an attempt after it trains)
A fault that needs a target (a training worker, a node running one) waits until there is one.
A `longrun run` that exits 75 without the soak's SIGTERM fails the soak.
Sampled throughout: RSS of the controller, the workers and the keepers (this soak's process
tree only), Redis's key count, and (from the step ledger's keys) the step each rank reported
last and each attempt's restored step. At the end the same steps run again unpaced and
fault-free on the same cluster and layout, and the final weights are compared bit for bit.
Reported: `goodput_clock` (productive seconds of the job's goodput record over the soak's own
wall clock, which includes reruns) beside `goodput_ledger` (the job's own), its buckets, faults
injected and survived by kind, steps lost per fault and by kind (the ledger's, through the
record's declared faults, and the soak's own count beside it), whether each corrupted
checkpoint was detected, Redis keys and RSS by role after warm-up (first and last quarter
medians; a role judged by its largest process, since evictions and replaced nodes change how
many it has), and the issue's targets met or not.
Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

from _common import logger, parser
from _soak_faults import KINDS, private_mounts
from _soak_harness import STATE_MB

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

BOUNDED_KINDS = ["worker_kill", "redis_kill", "disk_full"]  # a process, the store, the storage
QUICK_STATE_MB, BOUNDED_STATE_MB = 32.0, 16.0  # small enough for minutes on 2 cores


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--quick", action="store_true", help="about 5 minutes, each fault kind once")
    p.add_argument("--bounded", action="store_true",
                   help="the default tests' soak: three faults of different kinds, about a minute of job")
    p.add_argument("--every", type=float, default=None, help="seconds per fault (default 120)")
    p.add_argument("--kinds", default=None, help=f"comma-separated fault kinds, in order ({','.join(KINDS)})")
    p.add_argument("--pace", type=float, default=None,
                   help="seconds every rank sleeps inside each step, before its optimizer update (1.0)")
    p.add_argument("--state-mb", type=float, default=None,
                   help=f"the training state's size in MB, weights and AdamW moments (default {STATE_MB:g}; "
                   f"--quick {QUICK_STATE_MB:g}, --bounded {BOUNDED_STATE_MB:g})")
    p.add_argument("--steps", type=int, default=None, help="the job's steps (default: sized to the time)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, checkpoints)")
    args = p.parse_args()
    # Before any thread exists: the tmpfs is then private to this soak and dies with it.
    mounts_private = os.geteuid() == 0 and private_mounts()

    from _soak_harness import Plan, Soak, remove_workdir
    from _soak_report import targets

    log = logger("soak")
    seed = args.seed if args.seed is not None else random.randrange(1 << 16)
    kinds = args.kinds.split(",") if args.kinds else None
    minutes, pace, every, state_mb = args.minutes, args.pace, args.every, args.state_mb
    if args.quick:
        minutes, kinds = 5.0, kinds or random.Random(seed).sample(KINDS, len(KINDS))
        state_mb = state_mb or QUICK_STATE_MB
    if args.bounded:
        minutes, kinds, pace, every = 1.2, kinds or BOUNDED_KINDS, pace or 0.3, every or 15.0
        state_mb = state_mb or BOUNDED_STATE_MB
    if state_mb is not None and state_mb <= 0:
        p.error(f"--state-mb must be positive, not {state_mb:g}")
    unknown = set(kinds or []) - set(KINDS)
    if unknown:
        p.error(f"unknown fault kind(s) {sorted(unknown)}; choose from {', '.join(KINDS)}")
    plan = Plan.of(minutes, seed=seed, every_s=every, kinds=kinds, pace_s=pace or 1.0, steps=args.steps,
                   state_mb=state_mb or STATE_MB)
    soak = Soak(plan, log)
    started = time.monotonic()
    try:
        result = soak.run(private_mounts_ok=mounts_private)
    finally:
        if not args.keep:
            remove_workdir(soak.workdir)
    result["bench_s"] = round(time.monotonic() - started, 1)  # cluster, soak, reference, teardown
    result["targets"] = targets(result)
    log(f"goodput {result['goodput_clock']} by the soak's clock, {result['goodput_ledger']} by the job's, "
        f"over {result['minutes']} min at {result['state_mb']} MB of state; buckets {result['buckets']}")
    for o in result["fault_log"]:
        log(f"  {o['at_s']:7.1f} s {o['kind']:<18} step {o['step']:>5} lost {o['steps_lost']} "
            f"(outside {o['steps_lost_outside']}) survived {bool(o['survived'])}: "
            f"{o['error'] or o['detail']}")
    log(f"faults by kind {result['faults_by_kind']}; steps lost by kind {result['steps_lost_by_kind']}")
    log(f"redis keys {result['redis_keys']}; rss MiB {result['rss_mb']}")
    log(f"bitwise equal {result['bitwise_equal']}; targets {result['targets']}")
    if args.keep:
        log(f"work directory kept: {soak.workdir}")
    print(json.dumps(result), flush=True)
    sys.exit(0 if result["failure"] is None else 1)


if __name__ == "__main__":
    main()
