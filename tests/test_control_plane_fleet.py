"""The control plane against a simulated fleet (longrun.testing.fleet): a real Redis, the per-node
records the agents publish, and the controller's reader, monitor and policy. Every injected
fault is declared with the right kind and on the right rank or node, and nothing else is.

At 1,024 ranks in the default run, on short intervals, every kind of fault (the slow node, the
rank slowed by its data and the lone straggler explained as such); at 4,096 and 16,384 ranks in
the slow run (bench/control_plane.py measures the same thing with timings).
"""

from __future__ import annotations

import pytest

from longrun.kinds import FaultKind
from longrun.testing.fleet import DECLARED_AS, KINDS, Fleet, FleetSpec


def _assert_every_fault_named(report, spec):
    assert report.polls > 0
    for d in report.detections:
        assert d.declared_at is not None, f"{d.kind} on rank {d.rank} was never declared"
        assert d.declared_kind == DECLARED_AS[d.kind], d
        if d.kind in ("node", "slow_node"):  # declared as the node (a slow node: on one of its ranks)
            assert d.declared_node == f"node-{d.rank // spec.per_node}", d
        elif d.kind != "nan":  # a NaN is job-wide: its detail names the rank (checked below)
            assert d.declared_rank == d.rank, d
        assert d.declared_at >= d.injected_at, d  # declared after it happened, never before
    assert sorted(d.kind for d in report.detections) == sorted(spec.kinds)
    assert report.false_alarms == []


def _assert_slowness_explained(report, spec):
    node = next(d for d in report.detections if d.kind == "slow_node")
    assert node.blame == "node" and node.action == "evict_and_restart"
    assert node.declared_node == f"node-{node.rank // spec.per_node}"
    data = next(d for d in report.detections if d.kind == "slow_data")
    assert data.blame == "data" and data.action == "continue"  # its data, not its node: nothing evicted
    alone = next(d for d in report.detections if d.kind == "straggler")
    assert alone.blame == "rank" and alone.action == "continue"  # slow alone: no case against its node


def test_every_fault_among_1024_ranks_is_declared_as_itself(redis_server):
    spec = FleetSpec(ranks=1024, interval_s=0.25, timeout_s=2.5, step_s=0.25, hang_min_s=3.0,
                     straggler_patience=4, warmup_s=2.0, spacing_s=3.0, kinds=KINDS, seed=3, job="fleet-1k")
    report = Fleet(spec, redis_server.url).run()
    _assert_every_fault_named(report, spec)
    nan = next(d for d in report.detections if d.kind == "nan")
    assert nan.declared_kind == FaultKind.NAN and nan.action == "restart"
    dead = next(d for d in report.detections if d.kind == "dead")
    assert dead.action == "restart"
    _assert_slowness_explained(report, spec)


@pytest.mark.slow
def test_a_slow_node_is_named_and_evicted_and_slow_data_is_named_and_left_alone(redis_server):
    # 4,096 ranks. The run ends 30 s after the last slowdown at the latest: each is named within it.
    spec = FleetSpec(ranks=4096, interval_s=0.5, timeout_s=2.5, step_s=0.5, hang_min_s=2.0, warmup_s=3.0,
                     spacing_s=6.0, kinds=("slow_node", "slow_data", "straggler"), seed=11, job="fleet-4k")
    assert spec.duration_s - spec.plan()[-1].at_s <= 30.0
    report = Fleet(spec, redis_server.url).run()
    _assert_every_fault_named(report, spec)
    _assert_slowness_explained(report, spec)


@pytest.mark.slow
def test_every_fault_among_16384_ranks_is_declared_as_itself(redis_server):
    spec = FleetSpec(ranks=16384, seed=5, job="fleet-16k")
    report = Fleet(spec, redis_server.url).run()
    _assert_every_fault_named(report, spec)
