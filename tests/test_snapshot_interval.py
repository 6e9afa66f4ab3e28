"""When peer memory snapshots are taken (issue 39): the `auto` interval (the smallest whose send
fits in its steps' compute, chosen from measured timings, the slowest rank's), and the ranks'
agreement that makes every rank take and skip the same steps (a step one rank skipped is one no
restore can use)."""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import pytest
import torch

from longrun.checkpoint.memory import MemorySnapshots, read_snapshot
from longrun.checkpoint.snapshot_interval import AutoInterval, choose_interval
from longrun.config import config_from_dict


def _trainer(step: int = 1):
    trainer = SimpleNamespace(step=step)
    trainer.state_dict = lambda: {"step": trainer.step, "model": {"w": torch.arange(64.0)}}
    return trainer


@pytest.mark.parametrize("send_s, step_s, every", [
    (0.5, 1.0, 1),    # a send well inside one step
    (0.8, 1.0, 1),    # 0.8 s x 1.25 headroom = 1.0 s: still one
    (0.81, 1.0, 2),   # just over: two
    (2.1, 0.8, 4),    # 2.6 s of send for 0.8 s steps
    (30.0, 0.1, 375),
])
def test_the_interval_is_the_smallest_whose_compute_covers_a_send(send_s, step_s, every):
    assert choose_interval(send_s, step_s) == every


def test_the_interval_follows_the_median_step_and_the_recent_sends():
    auto = AutoInterval()
    assert auto.proposal() == 0  # nothing measured
    auto.observe_step(9.0)  # the first step, with its warm-up
    for _ in range(4):
        auto.observe_step(1.0)
    assert auto.proposal() == 0  # no send yet
    auto.observe_send(1.5)
    assert auto.step_s == 1.0 and auto.proposal() == 2  # the warm-up step does not set it
    auto.observe_send(4.0)  # sends got slower: at once
    assert auto.proposal() == 5
    proposals = []
    for _ in range(4):  # and faster: once the slow one is no longer among the recent sends
        auto.observe_send(0.2)
        proposals.append(auto.proposal())
    assert proposals == [5, 5, 5, 1]


def test_a_shorter_interval_waits_for_the_dead_band_a_longer_one_does_not():
    auto = AutoInterval()
    for _ in range(8):
        auto.observe_step(1.0)
    auto.observe_send(4.0)
    assert auto.proposal(current=1) == 5  # slower sends: up at once
    for _ in range(4):
        auto.observe_send(0.2)
    assert auto.proposal() == 1  # without a current interval, the plain rule
    for _ in range(7):
        auto.observe_send(0.2)
        assert auto.proposal(current=5) == 5  # the slow send is still among the last 12: kept
    auto.observe_send(0.2)
    assert auto.proposal(current=5) == 1  # past it, down to what the sends call for
    for _ in range(12):
        auto.observe_send(1.5)  # 1.5 x 1.25 fits 2 steps, but not with the dead band's 1.25 more
    assert auto.proposal() == 2 and auto.proposal(current=3) == 3
    assert auto.proposal(current=2) == 2 and auto.proposal(current=1) == 2


def test_sends_that_straddle_a_boundary_do_not_flip_the_interval_at_every_snapshot():
    """The hour soak's sends (1.8-3.4 s against 2.1 s steps) sit on the boundary between 2 and
    3: the plain rule flips with every slow send entering or leaving the last four."""
    rng = random.Random(2911)

    def changes(dead_band: bool) -> list[int]:
        auto, every, chosen = AutoInterval(), None, []
        for _ in range(300):
            auto.observe_step(rng.uniform(2.0, 2.2))
            auto.observe_send(rng.uniform(1.8, 3.4))
            proposal = auto.proposal(every if dead_band else None)
            if proposal != every:
                every = proposal
                chosen.append(every)
        return chosen

    plain, banded = changes(dead_band=False), changes(dead_band=True)
    assert len(plain) > 20 and set(plain) == {2, 3}
    assert banded[-1] == 3 and len(banded) <= 3  # up to the longer value, and kept there


def test_auto_measures_the_first_send_then_keeps_the_interval_it_calls_for():
    """Snapshots start every step; a step that finds the first send running skips without a
    count (no interval to keep yet); once it is measured, the interval is chosen and reported."""
    release, chosen, now = threading.Event(), [], [0.0]

    def send(step, blob, digest):
        if step == 1:
            release.wait(30)
            now[0] = 2.1  # the first send took 2.1 s
        read_snapshot(blob, digest)

    snaps = MemorySnapshots(send, None, on_interval=chosen.append, clock=lambda: now[0])
    trainer = _trainer()
    assert snaps.due(1) and snaps.take(trainer)
    for step in (2, 3):
        snaps.observe_step(0.8)
        trainer.step = step
        assert snaps.due(step) and not snaps.take(trainer)  # still sending: not counted
    assert snaps.skipped == 0 and chosen == []
    release.set()
    snaps.wait()
    snaps.observe_step(0.8)
    trainer.step = 4
    assert snaps.take(trainer)  # ready: taken, and its agreement sets the interval
    snaps.wait()
    assert chosen == [4] and snaps.every == 4  # ceil(2.1 x 1.25 / 0.8)
    assert [s for s in range(5, 13) if snaps.due(s)] == [8, 12]
    for step in (8, 12, 16, 20):  # instant sends: the slow one leaves the last four, not the last 12
        trainer.step = step
        assert snaps.take(trainer)
        snaps.wait()
    assert chosen == [4]  # the dead band holds the job's interval


class Ranks:
    """`agree` for ranks played by threads: the element-wise max, as `job_max` all-reduces it."""

    def __init__(self, n: int):
        self._barrier, self._said = threading.Barrier(n), {}

    def agree(self, rank: int):
        def agree(values: list[int]) -> list[int]:
            self._said[rank] = values
            self._barrier.wait(30)
            out = [max(said[i] for said in self._said.values()) for i in range(len(values))]
            self._barrier.wait(30)
            return out
        return agree


def test_one_busy_rank_makes_every_rank_skip_the_same_snapshot():
    ranks, release = Ranks(2), threading.Event()
    sent: dict[int, list[int]] = {0: [], 1: []}

    def sender(rank: int):
        def send(step, blob, digest):
            if rank == 0 and step == 1:  # rank 0's keeper is slow
                release.wait(30)
            sent[rank].append(read_snapshot(blob, digest)["step"])
        return send

    snaps = [MemorySnapshots(sender(r), every=1, agree=ranks.agree(r)) for r in range(2)]
    trainers = [_trainer(), _trainer()]
    took: dict[tuple[int, int], bool] = {}

    def run(rank: int, step: int) -> None:
        trainers[rank].step = step
        took[(rank, step)] = snaps[rank].take(trainers[rank])

    def both(step: int) -> None:
        threads = [threading.Thread(target=run, args=(r, step)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)

    both(1)
    snaps[1].wait()  # rank 1's first send is through; rank 0's is held
    both(2)
    assert (took[(0, 2)], took[(1, 2)]) == (False, False)  # rank 1 skips too, though it is free
    assert snaps[0].skipped == snaps[1].skipped == 1
    release.set()
    snaps[0].wait()
    both(3)
    for s in snaps:
        s.wait()
    assert sent == {0: [1, 3], 1: [1, 3]}  # the same steps on every rank


def test_one_rank_over_its_budget_turns_snapshots_off_on_every_rank():
    ranks = Ranks(2)
    sent = []
    snaps = [MemorySnapshots(lambda *a: sent.append(a), every=1, agree=ranks.agree(r),
                             host_budget_bytes=None if r == 0 else 1) for r in range(2)]
    out = {}
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, snaps[r].take(_trainer())))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == {0: False, 1: False} and not any(s.enabled for s in snaps) and sent == []
    assert not snaps[0].due(2)  # and no rank agrees over snapshots again


@pytest.mark.parametrize("value, every", [("auto", None), (None, None), (3, 3)])
def test_memory_interval_steps_is_auto_by_default(value, every, monkeypatch):
    from longrun.worker import snapshots

    monkeypatch.setattr(snapshots, "snapshot_sender", lambda *a, **k: None)
    chosen = {"checkpoint": {"memory_interval_steps": value}} if value != "auto" else {}  # the default
    raw = {"job": {"name": "auto"}} | chosen
    made = snapshots.memory_snapshots(config_from_dict(raw), 0, {"targets": []})
    assert (made.auto is None) == (every is not None) and made.every == (every or 1)


def test_sizing_the_sends_outside_ray_does_not_start_a_ray():
    # memory_snapshots() sizes its chunks by the node's object store; asked by a process not
    # connected to Ray (a test, a tool), `ray.nodes()` started a local Ray, which the next
    # module's `ray.init(address=...)` then met ("called ray.init twice").
    import subprocess
    import sys

    probe = ("import ray\nfrom longrun.worker.snapshot_transfer import node_object_store_bytes\n"
             "assert node_object_store_bytes() is None\nassert not ray.is_initialized()\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_driver_says_which_interval_the_ranks_chose_and_when_it_changes():
    from longrun.controller.user_view import SnapshotInterval
    from longrun.goodput.accounting import StepRecord

    lines: list[str] = []
    listener = SnapshotInterval(lines.append)
    every = [None, None, 1, 1, 4, 4, None, 4]  # measuring, chosen, changed, a skipped step's record
    listener.steps(0, [StepRecord(step, 0.0, 1.0, metrics=None if e is None and step == 7 else
                                  {"loss": 1.0} | ({"snapshot_every": e} if e else {}))
                       for step, e in enumerate(every, start=1)])
    assert [line.split(":")[0] for line in lines] == ["memory snapshots every 1 step(s) from step 3",
                                                      "memory snapshots every 4 step(s) from step 5"]
