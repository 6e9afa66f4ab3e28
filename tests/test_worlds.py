"""longrun.testing.worlds: results per rank, deaths reported at once, kills on purpose, replacements."""

from __future__ import annotations

import os
import signal
import time

import pytest
import worlds_workers as w

from longrun.testing.worlds import RankDied, World, WorldError, WorldTimeout

# A bound on a hang, not a performance claim: every test passes a long timeout and must return
# well inside it; the old shared-queue harness waited the whole timeout out.
TIMEOUT = 120
PROMPT = 60


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_results_come_back_per_rank(tmp_path):
    with World(w.report, 3, tmp_path, args=(2,)) as world:
        world.start()
        out = world.collect(6, timeout=TIMEOUT)
        world.join()
    init_file = str(tmp_path / "init")
    assert sorted(r[:4] for r in out) == [(r, i, 3, init_file) for r in range(3) for i in range(2)]
    assert len({r[4] for r in out}) == 3  # one process per rank


def test_an_unplanned_death_is_named_at_once_with_its_rank_and_exit_code(tmp_path):
    with World(w.hold, 3, tmp_path) as world:
        world.start([0, 1])
        world.start([2], target=w.die)
        start = time.monotonic()
        with pytest.raises(RankDied) as err:
            world.collect(4, timeout=TIMEOUT)  # only 3 "up" can ever come: rank 2 dies
        assert time.monotonic() - start < PROMPT
    assert err.value.rank == 2 and err.value.exitcode == -signal.SIGKILL
    assert "rank 2 died with exit code -9 (SIGKILL)" in str(err.value)


def test_an_exception_in_a_target_is_raised_with_its_traceback(tmp_path):
    with World(w.fail, 2, tmp_path) as world:
        world.start()
        start = time.monotonic()
        with pytest.raises(RankDied, match=r"rank \d raised an exception") as err:
            world.collect(2, timeout=TIMEOUT)
        assert time.monotonic() - start < PROMPT
    assert "ValueError: rank" in str(err.value) and "cannot go on" in str(err.value)


def test_a_member_killed_in_the_middle_of_a_send_blocks_nobody(tmp_path):
    release = tmp_path / "release"
    with World(w.report_when_released, 3, tmp_path, args=(str(release),)) as world:
        world.start([0, 2])
        up = world.collect(2, timeout=TIMEOUT)
        # Only once the others are up: the flooder's first message is its "up" (one pipe per
        # rank keeps its order), and no flood can arrive ahead of another rank's "up".
        world.start([1], target=w.flood, args=())
        up += world.collect(1, timeout=TIMEOUT)
        assert sorted(r[:2] for r in up) == [(0, "up"), (1, "up"), (2, "up")]
        assert world.kill(1) == -signal.SIGKILL  # on purpose: not an error
        release.touch()  # the survivors report only now, after the kill
        start = time.monotonic()
        out = world.collect(2, timeout=TIMEOUT)
        world.join()
        assert time.monotonic() - start < PROMPT
    assert sorted(r[:2] for r in out) == [(0, "released"), (2, "released")]


def test_a_replacement_joins_the_same_world(tmp_path):
    with World(w.hold, 3, tmp_path) as world:
        world.start()
        pids = {r: pid for r, _, pid in world.collect(3, timeout=TIMEOUT)}
        with pytest.raises(WorldError, match="still running"):
            world.start([1])
        world.kill(1)
        assert _gone(pids[1])
        world.start([1], target=w.report, args=(1,))
        rank, _, size, init_file, pid = world.get(timeout=TIMEOUT)
        assert world.pid(1) == pid != pids[1]
    assert (rank, size, init_file) == (1, 3, str(tmp_path / "init"))


def test_a_silent_world_times_out_naming_the_ranks_still_running(tmp_path):
    with World(w.hold, 2, tmp_path) as world:
        world.start()
        world.collect(2, timeout=TIMEOUT)
        start = time.monotonic()
        with pytest.raises(WorldTimeout, match=r"ranks still running: \[0, 1\]"):
            world.get(timeout=1)
        assert time.monotonic() - start < PROMPT


def test_ranks_that_exit_without_their_results_are_an_error_not_a_wait(tmp_path):
    with World(w.quiet, 2, tmp_path) as world:
        world.start()
        with pytest.raises(WorldError, match="every rank has exited"):
            world.collect(1, timeout=TIMEOUT)


def test_leaving_the_world_on_an_error_kills_every_member(tmp_path):
    with pytest.raises(KeyError), World(w.hold, 2) as world:  # no workdir: a temporary one
        world.start()
        pids = [pid for _, _, pid in world.collect(2, timeout=TIMEOUT)]
        init_dir = os.path.dirname(world.init_file)
        raise KeyError("the caller fails")
    assert all(_gone(pid) for pid in pids)
    assert not os.path.exists(init_dir)
