"""A world of spawned ranks that survives its members being killed (tests and benchmarks).

    with World(target, size=4, args=(url,)) as world:
        world.start()                          # rank r runs target(r, 4, init_file, results, url)
        first = world.collect(4, timeout=120)  # 4 items put by any ranks, in arrival order
        world.kill(2)                          # on purpose: not an error
        world.start([2], target=rejoin)        # a replacement rank 2 in the same world
        rest = world.collect(4)
        world.join()                           # every rank exited 0 (or was killed on purpose)

Every rank sends its results through its own pipe, so nothing is shared between ranks: a rank
SIGKILLed in the middle of a send cannot hold a lock that another rank or the parent needs (a
`multiprocessing.Queue` shared by all ranks can deadlock that way: a killed writer may hold its
lock). The parent waits on every pipe and every process sentinel together, so a rank that dies
unplanned is reported at once, by rank and exit code, instead of after the timeout; a rank whose
target raises is reported with its traceback. Leaving the `with` block, or `close()`, kills every
rank still running, on error too; a rank also dies with its parent if the parent is SIGKILLed.
Torch-free: targets import what they need.

How ranks start (`LONGRUN_WORLD_START`, read when this module is imported): `spawn` by default,
a fresh interpreter per rank, which spends about 2 CPU-seconds importing torch and the training
stack before the target runs. `forkserver` (the test suite sets it: tests/conftest.py) forks each
rank from one server process that imported them once (`FORKSERVER_PRELOAD`), so a rank starts in
milliseconds; like spawn it carries the caller's sys.path, working directory and main module to
the rank, and `_rank_main` gives it the caller's environment of the moment too (the server's is
the one it started with). A variable read while those modules are imported takes the server's
value: set such variables before the first world starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

START_ENV = "LONGRUN_WORLD_START"
START_METHODS = ("spawn", "forkserver")
# What a forkserver imports once for every rank it forks (an import that fails is skipped).
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "numpy", "longrun.trainer.model",
                      "longrun.parallel.parallelize", "longrun.checkpoint.checkpointer")
REAP_S = 30.0  # how long a SIGKILLed process may take to be reaped


def start_context(method: str | None = None) -> mp.context.BaseContext:
    """The multiprocessing context ranks start in: `method`, else $LONGRUN_WORLD_START, else
    spawn. Never a plain fork: it would copy the caller's threads and torch/gloo state."""
    method = method or os.environ.get(START_ENV) or "spawn"
    if method not in START_METHODS:
        raise ValueError(f"{START_ENV}={method!r}: use one of {', '.join(START_METHODS)}")
    context = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return context


# Objects handed to targets (a Barrier, say) must come from this context too.
CONTEXT = start_context()


class WorldError(RuntimeError):
    """A world cannot deliver what was asked of it."""


class RankDied(WorldError):
    """A rank exited with a non-zero code without being killed on purpose, or its target raised."""

    def __init__(self, rank: int, exitcode: int | None, sent: int, detail: str = ""):
        self.rank, self.exitcode, self.sent = rank, exitcode, sent
        super().__init__(f"rank {rank} {describe_exit(exitcode)} after sending {sent} result(s)"
                         + (detail or "; its stderr may say why"))


class WorldTimeout(WorldError, TimeoutError):
    """The world did not deliver in time; the ranks still running are named."""


def describe_exit(code: int | None) -> str:
    if code is None:
        return "raised an exception"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"died with exit code {code} ({signal.Signals(-code).name})"
    return f"exited with exit code {code}"


class Results:
    """What a target puts its results on: the write end of its own rank's pipe."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._lock = threading.Lock()  # threads of one rank may put; this lock never leaves it

    def put(self, item: Any) -> None:
        with self._lock:
            self._conn.send(item)


@dataclass(frozen=True)
class _Crash:
    traceback: str


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process took the number: ours is gone
        return False
    return True


def _die_with_parent(parent: int) -> None:
    """A rank must not outlive a parent that was SIGKILLed (its cleanup never ran). Linux's
    parent-death signal fires when the thread that forked the rank ends. Under a forkserver that
    is the server's, which outlives the parent while any rank lives (every rank holds the pipe
    whose end tells it the parent is gone): there a thread waits for the parent itself."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() == parent:
        return
    if not _alive(parent):  # it died before anything was armed
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent,), name="longrun-world-parent",
                     daemon=True).start()


def _watch_parent(parent: int) -> None:
    """SIGKILL this process once `parent` has exited (a pidfd turns readable; else a poll)."""
    try:
        fd = os.pidfd_open(parent)
    except ProcessLookupError:
        fd = -1  # already gone
    except (OSError, AttributeError):  # no pidfd here: look every second
        while _alive(parent):
            time.sleep(1.0)
        fd = -1
    if fd >= 0:
        select.select([fd], [], [])
    os.kill(os.getpid(), signal.SIGKILL)


def _rank_main(target: Callable, rank: int, size: int, init_file: str, conn: Connection,
               args: tuple, parent: int, environ: dict[str, str]) -> None:
    _die_with_parent(parent)
    if os.environ != environ:  # a forkserver's child: the caller's environment, not the server's
        os.environ.clear()
        os.environ.update(environ)
    try:
        target(rank, size, init_file, Results(conn), *args)
    except Exception:
        text = traceback.format_exc()
        sys.stderr.write(f"rank {rank}:\n{text}")
        with contextlib.suppress(OSError):
            conn.send(_Crash(text))
        raise SystemExit(1) from None
    finally:
        conn.close()
    # Done, and everything it sent is through the pipe: skip interpreter finalization. With
    # DDP's asynchronous work still referenced, gloo's threads can outlive the interpreter and
    # abort the process at exit ("terminate called without an active exception"; a known race,
    # pytorch/pytorch#179291), which would read as a rank that died after its results.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@dataclass
class _Member:
    rank: int
    process: BaseProcess
    reader: Connection | None  # None once at end of file
    killed: bool = False  # on purpose: its death is not an error
    exitcode: int | None = None  # set once reaped


class World:
    """`size` ranks of `target(rank, size, init_file, results, *args)`, each in its own process."""

    def __init__(self, target: Callable, size: int, workdir: str | os.PathLike | None = None,
                 args: tuple = (), timeout: float = 600.0, start_method: str | None = None):
        """`start_method`: spawn or forkserver (default: this module's CONTEXT, see above)."""
        self.target, self.size, self.args, self.timeout = target, size, tuple(args), timeout
        self.context = CONTEXT if start_method is None else start_context(start_method)
        self._tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="longrun-world-")
        self.init_file = str(Path(workdir if workdir is not None else self._tmp.name) / "init")
        self._members: list[_Member] = []
        self._pending: deque = deque()
        self._sent: Counter = Counter()  # results received, per rank
        self._closed = False

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- members -------------------------------------------------------------------------------

    def start(self, ranks: Iterable[int] | None = None, target: Callable | None = None,
              args: tuple | None = None) -> None:
        """Start these ranks (all by default), with the world's target and args unless given.
        A rank may be started again once its previous process was killed or has exited."""
        if self._closed:
            raise WorldError("this world is closed: make a new World")
        for rank in range(self.size) if ranks is None else ranks:
            if not 0 <= rank < self.size:
                raise ValueError(f"rank {rank} is outside a world of {self.size}")
            old = self._current(rank)
            if old is not None and old.exitcode is None and not old.killed:
                raise WorldError(f"rank {rank} is still running: kill it before starting a replacement")
            reader, writer = self.context.Pipe(duplex=False)
            process = self.context.Process(
                target=_rank_main, name=f"rank-{rank}",
                args=(target or self.target, rank, self.size, self.init_file, writer,
                      self.args if args is None else tuple(args), os.getpid(), dict(os.environ)))
            try:
                process.start()
            finally:
                writer.close()  # the child holds the only write end: its death reads as end of file
            self._members.append(_Member(rank, process, reader))

    def pid(self, rank: int) -> int:
        return self._member(rank).process.pid

    def kill(self, rank: int) -> int:
        """SIGKILL a rank on purpose and reap it; the results it sent stay readable. Returns
        its exit code."""
        member = self._member(rank)
        member.killed = True
        if member.exitcode is None:
            member.process.kill()
            member.process.join(REAP_S)
            self._reap(member)
        return member.exitcode

    def kill_all(self) -> None:
        """SIGKILL every running rank at once (the whole world fails), then reap them all."""
        running = [m for m in self._members if m.exitcode is None]
        for m in running:
            m.killed = True
            m.process.kill()
        for m in running:
            self._reap(m)

    def close(self) -> None:
        """Kill every rank still running and release the pipes (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for m in self._members:
            if m.process.exitcode is None:
                m.killed = True
                m.process.kill()
        for m in self._members:
            m.process.join(REAP_S)
            if m.reader is not None:
                m.reader.close()
                m.reader = None
            with contextlib.suppress(ValueError):  # still running after REAP_S: leave it be
                m.process.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # --- results -------------------------------------------------------------------------------

    def run(self, n: int | None = None, timeout: float | None = None, join_s: float = 120.0) -> list:
        """Start every rank, return the first `n` results (default: one per rank), then wait
        until every rank has exited."""
        self.start()
        out = self.collect(self.size if n is None else n, timeout)
        self.join(join_s)
        return out

    def get(self, timeout: float | None = None) -> Any:
        """The next result from any rank."""
        return next(self.results(1, timeout))

    def collect(self, n: int, timeout: float | None = None) -> list:
        """The next `n` results from any ranks, in arrival order, within `timeout` overall."""
        return list(self.results(n, timeout))

    def results(self, n: int, timeout: float | None = None) -> Iterator:
        """Yield the next `n` results as they arrive, within `timeout` overall."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for _ in range(n):
            while not self._pending:
                self._wait(deadline, f"{n} result(s)")
            yield self._pending.popleft()

    def join(self, timeout: float = 60.0) -> None:
        """Wait until every rank has exited; raise if one failed. Results sent meanwhile are kept
        for `get`/`collect`."""
        deadline = time.monotonic() + timeout
        while any(m.exitcode is None for m in self._members):
            self._wait(deadline, "every rank to exit")

    def _wait(self, deadline: float, what: str) -> None:
        """Block until some rank sends a result or exits; raise when one died or time is up."""
        live = [m for m in self._members if m.exitcode is None]
        if not live:
            raise WorldError(f"every rank has exited while waiting for {what} (results per rank: "
                             f"{dict(sorted(self._sent.items()))}): a target returned without "
                             "putting everything the caller expects")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WorldTimeout(f"timed out waiting for {what}; ranks still running: "
                               f"{sorted(m.rank for m in live)}; results per rank so far: "
                               f"{dict(sorted(self._sent.items()))}")
        handles: dict[Any, _Member] = {}
        for m in live:
            handles[m.process.sentinel] = m
            if m.reader is not None:
                handles[m.reader] = m
        for ready in wait(list(handles), remaining):
            m = handles[ready]
            if ready is m.reader:
                self._read(m)
            elif m.exitcode is None:
                self._reap(m)

    def _read(self, m: _Member) -> None:
        try:
            item = m.reader.recv()
        except (EOFError, OSError):  # the rank exited, perhaps killed in the middle of a send
            m.reader.close()
            m.reader = None
            return
        if isinstance(item, _Crash):
            raise RankDied(m.rank, None, self._sent[m.rank], f":\n{item.traceback}")
        self._sent[m.rank] += 1
        self._pending.append(item)

    def _reap(self, m: _Member) -> None:
        """The process has exited: keep what it sent before, then judge its exit code."""
        m.process.join(REAP_S)
        while m.reader is not None and m.reader.poll():
            self._read(m)
        if m.reader is not None:  # a grandchild may hold the write end: stop listening anyway
            m.reader.close()
            m.reader = None
        m.exitcode = m.process.exitcode
        if m.exitcode is None:
            raise WorldError(f"rank {m.rank} (pid {m.process.pid}) did not exit within {REAP_S:.0f} s "
                             "of being killed")
        if m.exitcode != 0 and not m.killed:
            raise RankDied(m.rank, m.exitcode, self._sent[m.rank])

    def _current(self, rank: int) -> _Member | None:
        return next((m for m in reversed(self._members) if m.rank == rank), None)

    def _member(self, rank: int) -> _Member:
        member = self._current(rank)
        if member is None:
            raise WorldError(f"rank {rank} was never started")
        return member
