"""A soak: one job for a set time through a stream of faults injected from outside, and what it cost.

    RAY_USAGE_STATS_ENABLED=0 unshare --net -- sh -c 'ip link set lo up && exec python bench/soak.py'
    (same) python bench/soak.py --quick       # about 5 minutes: each of the seven fault kinds once
    (same) python bench/soak.py --minutes 20  # any length; --seed N replays a schedule
    (same) python bench/soak.py --bounded     # the default tests' soak: three faults of different kinds

Runs as root inside a network namespace with only loopback (every server binds 127.0.0.1).
A simulated 3-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: a head with no CPUs
and 3 nodes of 2 CPUs), a Redis of its own with an append-only file, and one `longrun run` of the
tiny model (dim 64, 2 layers) on 2 of the nodes (one rank each, dp 2; the third node is the
spare), with a storage checkpoint every 10 steps (on a 64 MiB tmpfs) and a memory snapshot every
step. Rank 0 sleeps `--pace` (1 s) after each step, as a large model's step takes seconds.
Faults come from outside longrun's own injector, one at a seeded random moment of each slot of
`--every` seconds (120) from the first step on, kinds in a seeded order cycling through:
  worker_kill         SIGKILL to a training worker, by pid
  worker_stop         SIGSTOP to a training worker (the soak kills it later if longrun did not)
  node_loss           a Ray node running a rank removed (no graceful shutdown); a new node joins
                      10-40 s later
  redis_kill          SIGKILL to redis-server, restarted 2-6 s later on the same port
  run_sigterm         SIGTERM to `longrun run` (a scheduler's preemption), then the same command
                      again
  checkpoint_corrupt  64 flipped bytes in a data file of the newest committed checkpoint
  disk_full           the checkpoint tmpfs filled, freed once two saves were due or a fault was
                      declared
A fault that needs a target (a training worker, a node running one) waits until there is one.
Sampled throughout: RSS of the controller, the workers and the keepers (this soak's process
tree only), Redis's key count. At the end the same steps run again unpaced and fault-free on
the same cluster and layout, and the final weights are compared bit for bit.
Reported: goodput (productive seconds of the job's goodput record over the soak's wall clock,
which includes reruns) and its buckets, faults injected and survived by kind, steps lost per
fault (the ledger's, through the record's declared faults), Redis keys and RSS after warm-up
(first and last quarter medians), and the issue's targets met or not.
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

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

BOUNDED_KINDS = ["worker_kill", "redis_kill", "disk_full"]  # a process, the store, the storage


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--quick", action="store_true", help="about 5 minutes, each fault kind once")
    p.add_argument("--bounded", action="store_true",
                   help="the default tests' soak: three faults of different kinds, about a minute of job")
    p.add_argument("--every", type=float, default=None, help="seconds per fault (default 120)")
    p.add_argument("--kinds", default=None, help=f"comma-separated fault kinds, in order ({','.join(KINDS)})")
    p.add_argument("--pace", type=float, default=None, help="seconds rank 0 sleeps after each step (1.0)")
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
    minutes, pace, every = args.minutes, args.pace, args.every
    if args.quick:
        minutes, kinds = 5.0, kinds or random.Random(seed).sample(KINDS, len(KINDS))
    if args.bounded:
        minutes, kinds, pace, every = 1.2, kinds or BOUNDED_KINDS, pace or 0.3, every or 15.0
    unknown = set(kinds or []) - set(KINDS)
    if unknown:
        p.error(f"unknown fault kind(s) {sorted(unknown)}; choose from {', '.join(KINDS)}")
    plan = Plan.of(minutes, seed=seed, every_s=every, kinds=kinds, pace_s=pace or 1.0, steps=args.steps)
    soak = Soak(plan, log)
    started = time.monotonic()
    try:
        result = soak.run(private_mounts_ok=mounts_private)
    finally:
        if not args.keep:
            remove_workdir(soak.workdir)
    result["bench_s"] = round(time.monotonic() - started, 1)  # cluster, soak, reference, teardown
    result["targets"] = targets(result)
    log(f"goodput {result['goodput']} over {result['minutes']} min; buckets {result['buckets']}")
    for o in result["fault_log"]:
        log(f"  {o['at_s']:7.1f} s {o['kind']:<18} step {o['step']:>5} lost {o['steps_lost']} "
            f"survived {bool(o['survived'])}: {o['error'] or o['detail']}")
    log(f"faults by kind {result['faults_by_kind']}; steps lost max {result['steps_lost_max']}")
    log(f"redis keys {result['redis_keys']}; rss MiB {result['rss_mb']['total']}")
    log(f"bitwise equal {result['bitwise_equal']}; targets {result['targets']}")
    if args.keep:
        log(f"work directory kept: {soak.workdir}")
    print(json.dumps(result), flush=True)
    sys.exit(0 if result["failure"] is None else 1)


if __name__ == "__main__":
    main()
