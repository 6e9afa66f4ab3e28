"""longrun.testing.worlds: results per rank, deaths reported at once, kills on purpose, replacements."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import worlds_workers as w

from longrun.testing.worlds import RankDied, World, WorldError, WorldTimeout, start_context

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


# A parent that starts a world of two ranks that hold, prints their pids, then waits to be killed.
PARENT = """
import sys, threading
import worlds_workers as w
from longrun.testing.worlds import World
world = World(w.hold, 2, start_method=sys.argv[1])
world.start()
print(" ".join(str(pid) for _, _, pid in world.collect(2, timeout=120)), flush=True)
threading.Event().wait()
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_ranks_die_with_a_parent_that_was_sigkilled(method, tmp_path):
    """Under a forkserver a rank's parent process is the server, not the caller: it still dies
    with the caller (the server exits once the caller is gone, and takes its children)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    parent = subprocess.Popen([sys.executable, "-c", PARENT, method], stdout=subprocess.PIPE, text=True,
                              cwd=tmp_path, env={**os.environ, "PYTHONPATH": tests})
    try:
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2, pids
        assert all(not _gone(pid) for pid in pids)
    finally:
        parent.kill()
        parent.wait(TIMEOUT)
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).wait(TIMEOUT)  # returns once it is gone (or raises: already gone)
        assert _gone(pid), pid


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_rank_starts_with_the_callers_environment_and_directory_of_the_moment(method, tmp_path,
                                                                               monkeypatch):
    with World(w.report, 1, tmp_path, start_method=method) as world:  # the server, if any, starts here
        world.run()
    monkeypatch.setenv("LONGRUN_WORLD_PROBE", "set-after-the-server-started")
    monkeypatch.chdir(tmp_path)
    with World(w.environment, 2, tmp_path, args=("LONGRUN_WORLD_PROBE",), start_method=method) as world:
        out = world.run(timeout=TIMEOUT)
    probe = "set-after-the-server-started"
    assert sorted(r[:3] for r in out) == [(r, probe, str(tmp_path)) for r in range(2)]
    assert len({r[3] for r in out} | {os.getpid()}) == 3  # a process of its own per rank


def test_a_start_method_that_would_fork_the_caller_is_refused():
    with pytest.raises(ValueError, match="LONGRUN_WORLD_START='fork': use one of spawn, forkserver"):
        start_context("fork")
