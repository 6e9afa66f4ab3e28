"""The control plane at 1,024 / 4,096 / 16,384 ranks: the real heartbeat path against a simulated fleet.

    unshare --net -- sh -c 'ip link set lo up && exec .venv/bin/python bench/control_plane.py'
    unshare --net -- sh -c 'ip link set lo up && exec .venv/bin/python bench/control_plane.py --quick'

A fleet process plays N ranks on N/8 nodes (each node's agent publishing one record per
interval, as health/node_agent.py does), and this process runs what the controller runs each
poll: the per-node reader, the monitor, a silent agent declared as its node, the policy
(longrun.testing.fleet). A dead rank, a hung rank, a NaN, a straggler and a lost node are
injected at random moments; for each size it prints when each was declared after its injection,
the poll's time (median and p99), the controller's CPU seconds per wall second, Redis memory and
commands per second.

The baseline, side by side: the same ranks as one JSON key each (what every job used before
per-node agents, and what small jobs still use), read with one MGET and parsed into the same
monitor, timed over the same number of polls (`--baseline-polls`) without faults.

Targets at 16,384 ranks (issue 29): poll p99 < 50 ms, controller CPU < 10% of a core at a 1 s
interval, a dead rank declared within 1.5 s of its death, a hang within its timeout + 1 s.
Progress on stderr; the last line on stdout is one JSON object for the largest size.
"""

from __future__ import annotations

import json
import re
import statistics
import time

from _common import logger, parser

from longrun.config.sections import HealthSection
from longrun.health.heartbeat import HeartbeatPublisher
from longrun.health.monitor import HealthMonitor
from longrun.health.node_beats import RankBeatReader
from longrun.services.redis_server import EmbeddedRedis
from longrun.testing.fleet import Fleet, FleetSpec

log = logger("control_plane")


def per_rank_baseline(redis_url: str, ranks: int, polls: int) -> list[float]:
    """Poll times (ms) of the per-rank path: a JSON key per rank, MGET, parse, judge."""
    from redis import Redis

    client = Redis.from_url(redis_url)
    pipe = client.pipeline(transaction=False)
    for rank in range(ranks):
        pub = HeartbeatPublisher(client, "baseline", 0, rank, interval_s=1.0, timeout_s=600.0)
        pub.update(step=10, phase="forward", loss=2.0, step_time_s=1.0, metrics_addr="10.0.0.1:9000")
        pub.client = pipe  # queue the SET instead of sending it
        pub.publish_now()
    pipe.execute()
    reader = RankBeatReader(client, "baseline", 0, ranks)
    monitor = HealthMonitor(ranks, HealthSection(), started_at=time.monotonic())
    times = []
    for _ in range(polls):
        t0 = time.perf_counter()
        monitor.observe(reader.read().columns, time.monotonic())
        times.append((time.perf_counter() - t0) * 1000)
    keys = list(client.scan_iter(match="longrun:baseline:*", count=10000))
    for i in range(0, len(keys), 10000):
        client.unlink(*keys[i:i + 10000])
    return times


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--quick", action="store_true", help="1,024 ranks, a short fault schedule")
    p.add_argument("--seed", type=int, default=29)
    p.add_argument("--interval", type=float, default=1.0, help="heartbeat interval = poll interval (s)")
    p.add_argument("--spacing", type=float, default=20.0, help="seconds between injected faults")
    p.add_argument("--baseline-polls", type=int, default=20)
    args = p.parse_args()
    sizes, spacing = ([1024], 6.0) if args.quick else (args.sizes, args.spacing)
    results = []
    with EmbeddedRedis() as server:
        for ranks in sizes:
            spec = FleetSpec(ranks=ranks, interval_s=args.interval, timeout_s=5 * args.interval,
                             step_s=args.interval, hang_min_s=10 * args.interval, spacing_s=spacing,
                             warmup_s=8 * args.interval, seed=args.seed, job=f"fleet{ranks}")
            log(f"{ranks} ranks on {spec.nodes} nodes for {spec.duration_s:.0f} s: "
                + ", ".join(f"{f.kind} on rank {f.rank} at {f.at_s:.1f} s" for f in spec.plan()))
            report = Fleet(spec, server.url).run(progress=log)
            summary = report.summary()
            base = per_rank_baseline(server.url, ranks, args.baseline_polls)
            summary["baseline_poll_ms_p50"] = round(statistics.median(base), 2)
            summary["baseline_poll_ms_p99"] = round(max(base), 2)
            summary["poll_speedup_p50"] = round(summary["baseline_poll_ms_p50"] / summary["poll_ms_p50"], 1)
            # The hung rank's own timeout, as the monitor applied it: learned per rank (5x its
            # slowest recent interval between sightings), never under the floor `hang_min_s`.
            summary["hang_min_s"] = spec.hang_min_s
            hang = next((d for d in report.detections if d.kind == "hang"), None)
            applied = re.search(r"timeout ([0-9.]+) s", (hang.detail or "") if hang else "")
            summary["hang_timeout_s"] = float(applied.group(1)) if applied else None
            if applied and hang.latency_s is not None:
                summary["detect_hang_over_timeout_s"] = round(hang.latency_s - summary["hang_timeout_s"], 3)
            for d in report.detections:
                log(f"  {d.kind:<9} rank {d.rank:>5}: declared as {d.declared_kind} after "
                    f"{'never' if d.latency_s is None else f'{d.latency_s:.2f} s'} -> {d.action}"
                    + (f" ({d.detail})" if d.kind == "hang" and d.detail else ""))
            for alarm in report.false_alarms[:5]:
                log(f"  false alarm: {alarm}")
            log(f"{ranks} ranks: poll p50 {summary['poll_ms_p50']} ms / p99 {summary['poll_ms_p99']} ms "
                f"(per-rank keys: {summary['baseline_poll_ms_p50']} ms, {summary['poll_speedup_p50']}x), "
                f"controller CPU {100 * summary['controller_cpu_share']:.1f}% of a core, Redis "
                f"{summary['redis_mib']} MiB, {summary['redis_commands_per_s']:.0f} commands/s")
            results.append(summary)
    columns = ("ranks", "poll_ms_p50", "poll_ms_p99", "poll_cpu_ms_p50", "poll_cpu_ms_p99",
               "baseline_poll_ms_p50", "controller_cpu_share", "detect_dead_s", "detect_hang_s",
               "hang_timeout_s", "detect_hang_over_timeout_s", "detect_nan_s", "detect_straggler_s",
               "detect_node_s", "redis_mib", "redis_commands_per_s", "false_alarms")
    print("| " + " | ".join(columns) + " |", flush=True)
    for s in results:
        print("| " + " | ".join(str(s.get(c)) for c in columns) + " |", flush=True)
    print(json.dumps(results[-1] | {"sizes": results}))


if __name__ == "__main__":
    main()
