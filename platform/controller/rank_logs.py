"""The ranks' logs, on the controller's side: consumed from Redis into one file per rank and
attempt, the last lines of each rank kept for the fault that names it, and a warning that
every rank logs printed once, with the ranks that logged it.

    <output_dir>/<job>/logs/attempt-A/rank-R.log

The workers ship their lines (worker/rank_log.py); this is the list's one reader, at every
poll through the fail-fast client and once more, patiently, before the attempt's keys go.
A warning waits up to `hold_s` for the other ranks to log it too (they usually do within a
step), then is printed with the ranks that did: "warning (ranks 0-63): ...".
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import redis

from longrun import keys
from longrun.controller.attempt import Attempt
from longrun.controller.listeners import Listener, first_line
from longrun.controller.state import JobState, Transition
from longrun.health.node_beats import Beats
from longrun.safe_files import open_append

log = logging.getLogger(__name__)

TAIL = 20  # last lines kept per rank (a fault event carries the last 10)
HOLD_S = 2.0
BATCH = 10_000
SHOWN = ("WARNING", "ERROR", "CRITICAL")
OPENED = json.dumps({"opened": True})  # the list's first entry: the ranks push only into an open list
# Take up to ARGV[1] lines after the opening entry, atomically: the list never goes empty (Redis
# would delete it, and the ranks' RPUSHX would drop their lines until it is opened again).
_TAKE = """
local head = redis.call('LPOP', KEYS[1])
if not head then return {} end
local items = redis.call('LPOP', KEYS[1], ARGV[1])
redis.call('LPUSH', KEYS[1], head)
return items or {}
"""


def rank_log_path(run_dir: str, attempt: int, rank: int) -> str:
    return os.path.join(run_dir, "logs", f"attempt-{attempt}", f"rank-{rank}.log")


def find_rank_log(run_dir: str, rank: int, attempt: int | None = None) -> str:
    """The log file of `rank` in `attempt` (default: the newest attempt that has one)."""
    if attempt is not None:
        path = rank_log_path(run_dir, attempt, rank)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no log of rank {rank} in attempt {attempt}: {path} does not exist")
        return path
    root = os.path.join(run_dir, "logs")
    attempts = sorted((int(d.split("-", 1)[1]) for d in (os.listdir(root) if os.path.isdir(root) else ())
                       if d.startswith("attempt-") and d.split("-", 1)[1].isdigit()), reverse=True)
    for a in attempts:
        path = rank_log_path(run_dir, a, rank)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"no log of rank {rank} under {root} (attempts there: "
                            f"{', '.join(map(str, sorted(attempts))) or 'none'})")


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2, 5"; [3] -> "rank 3"."""
    ranks = sorted(set(ranks))
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


class RankLogs(Listener):
    def __init__(self, job: str, run_dir: str, quick: redis.Redis, patient: redis.Redis,
                 write: Callable[[str], None], *, hold_s: float = HOLD_S,
                 clock: Callable[[], float] = time.monotonic):
        self.job, self.run_dir, self.quick, self.patient = job, run_dir, quick, patient
        self.write, self.hold_s, self.clock = write, hold_s, clock
        self._tails: dict[tuple[int, int], deque[str]] = defaultdict(lambda: deque(maxlen=TAIL))
        # (level, text) -> (first seen, ranks) of a warning not printed yet; and those printed
        self._held: dict[tuple[str, str], tuple[float, set[int]]] = {}
        self._shown: set[tuple[str, str]] = set()
        self._world = 0
        self._failed = False

    # -- listener hooks ------------------------------------------------------------------------
    def moved(self, move: Transition, attempt: Attempt) -> None:
        if move.target is JobState.RENDEZVOUS:  # before the ranks run
            self.open(attempt.number)

    def heartbeats(self, attempt: Attempt, beats: Beats, wall: float) -> None:
        self._world = attempt.world_size
        self.drain(attempt.number)

    def ending(self, attempt: Attempt) -> None:
        self.drain(attempt.number, final=True)

    def ended(self, attempt: Attempt) -> None:
        self._tails = defaultdict(lambda: deque(maxlen=TAIL), {
            k: v for k, v in self._tails.items() if k[0] >= attempt.number})

    # -- reading -------------------------------------------------------------------------------
    def open(self, attempt: int, client: redis.Redis | None = None) -> None:
        """Open the attempt's list: the ranks push into it only once it exists (RPUSHX)."""
        try:
            (client or self.patient).rpush(keys.rank_logs_key(self.job, attempt), OPENED)
        except (redis.RedisError, OSError) as exc:
            log.warning("rank logs of attempt %d not opened (%s); opened at the next poll", attempt, exc)

    def drain(self, attempt: int, final: bool = False) -> None:
        """Consume the attempt's new lines into files and tails; print the warnings due (all of
        them when `final`). A Redis miss is read next time (fail fast) or given up (final)."""
        client = self.patient if final else self.quick
        key = keys.rank_logs_key(self.job, attempt)
        lines: dict[int, list[str]] = defaultdict(list)
        try:
            while True:
                raw = client.eval(_TAKE, 1, key, BATCH)  # only this reader removes; ranks append
                for item in raw:
                    entry = json.loads(item)
                    if "rank" in entry:  # not the opening entry
                        self._take(attempt, entry, lines)
                if len(raw) < BATCH:
                    break
            if not final and not raw and not client.exists(key):  # a restarted Redis lost it
                self.open(attempt, client)
        except (redis.RedisError, OSError, ValueError) as exc:
            log.debug("rank logs not read this time: %s", exc)
        self._append(attempt, lines)
        self._print_due(final)

    def last_lines(self, attempt: int, rank: int) -> tuple[str, list[str]]:
        """(the rank's log file, its last lines), after reading what is new."""
        self.drain(attempt)
        return rank_log_path(self.run_dir, attempt, rank), list(self._tails.get((attempt, rank), ()))

    def _take(self, attempt: int, entry: dict[str, Any], lines: dict[int, list[str]]) -> None:
        rank, line = int(entry["rank"]), str(entry["line"])
        lines[rank].append(line)
        self._tails[(attempt, rank)].append(line)
        level = entry.get("level", "INFO")
        if level in SHOWN and entry.get("console", True):
            key = (level, entry.get("text") or line)
            if key in self._shown:
                return
            self._held.setdefault(key, (self.clock(), set()))[1].add(rank)

    def _append(self, attempt: int, lines: dict[int, list[str]]) -> None:
        for rank, new in lines.items():
            path = rank_log_path(self.run_dir, attempt, rank)
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open_append(path) as f:  # never through a link planted in the run dir
                    f.write("\n".join(new) + "\n")
                self._failed = False
            except OSError as exc:  # a full disk must not stop the job
                if not self._failed:
                    self._failed = True
                    log.warning("rank logs not written to %s: %s", path, exc)

    def _print_due(self, everything: bool) -> None:
        now = self.clock()
        for key, (first, ranks) in list(self._held.items()):
            if everything or len(ranks) >= max(self._world, 1) or now - first >= self.hold_s:
                level, text = key
                self.write(f"{level.lower()} ({rank_ranges(sorted(ranks))}): {first_line(text)}")
                del self._held[key]
                self._shown.add(key)
