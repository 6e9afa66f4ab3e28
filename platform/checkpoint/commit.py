"""Who has finished writing a checkpoint: the ledger the committing rank waits on.

Every rank reports its written shards (name -> checksum) or its failure; the coordinator (rank
0's writer) waits until all ranks have reported and only then writes the manifest. The ledger
lives in Redis, outside the training process group, so a save never puts a collective on the
training group and a rank that dies mid-save simply never reports (the coordinator times out,
and the step, without a manifest, is never restored and is removed). Keys are per attempt: a
restarted attempt that saves the same step again never sees a dead attempt's reports.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Protocol

import redis

from longrun import keys
from longrun.checkpoint.manifest import ShardInfo


class CommitAborted(RuntimeError):
    """The step cannot be committed: a rank failed to write it, or not all reported in time."""


class AgreementTimeout(RuntimeError):
    """Not every rank said whether it could restore a checkpoint in time: names the missing."""


class CommitLedger(Protocol):
    shared: bool  # whether ranks in other processes see the same ledger (agree() across them)

    def report(self, step: int, rank: int, files: dict[str, ShardInfo] | None,
               error: str | None = None) -> None: ...

    def wait_all(self, step: int, world_size: int, timeout_s: float) -> dict[str, ShardInfo]: ...

    def clear(self, step: int) -> None: ...

    def agree(self, key: str, rank: int, ok: bool, world_size: int, timeout_s: float) -> bool: ...


def _agreement(key: str, votes: dict[int, bool], world_size: int, timeout_s: float | None) -> bool:
    """Whether every rank voted ok; a veto decides at once. With `timeout_s` (the wait is
    over) and votes missing: AgreementTimeout naming the ranks that did not vote."""
    if not all(votes.values()):
        return False
    if len(votes) >= world_size:
        return True
    missing = [r for r in range(world_size) if r not in votes]
    shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
    raise AgreementTimeout(
        f"{key}: ranks {shown} did not finish reading and verifying their part within "
        f"{timeout_s:g} s (a slow or dead reader: see their logs, or raise "
        "checkpoint.restore_timeout_s)")


def _gather(step: int, reports: dict[int, dict], world_size: int) -> dict[str, ShardInfo]:
    failed = {r: rep["error"] for r, rep in reports.items() if rep.get("error")}
    if failed:
        shown = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failed.items())[:3])
        raise CommitAborted(f"step {step} not committed: {len(failed)} rank(s) failed to write ({shown})")
    files: dict[str, ShardInfo] = {}
    for rank in range(world_size):
        for name, info in reports[rank]["files"].items():
            files[name] = info if isinstance(info, ShardInfo) else ShardInfo.from_dict(info)
    return files


class LocalCommitLedger:
    """For ranks of one process (world size 1, tests): reports kept in memory."""

    shared = False  # one process only: its votes cannot reach another process

    def __init__(self) -> None:
        self._reports: dict[int, dict[int, dict]] = {}
        self._votes: dict[str, dict[int, bool]] = {}
        self._changed = threading.Condition()

    def report(self, step: int, rank: int, files: dict[str, ShardInfo] | None,
               error: str | None = None) -> None:
        with self._changed:
            self._reports.setdefault(step, {})[rank] = {"files": files or {}, "error": error}
            self._changed.notify_all()

    def wait_all(self, step: int, world_size: int, timeout_s: float) -> dict[str, ShardInfo]:
        with self._changed:
            done = self._changed.wait_for(lambda: len(self._reports.get(step, {})) >= world_size
                                          or any(r["error"] for r in self._reports.get(step, {}).values()),
                                          timeout=timeout_s)
            reports = dict(self._reports.get(step, {}))
        if not done:
            raise CommitAborted(_missing_message(step, reports, world_size, timeout_s))
        return _gather(step, reports, world_size)

    def clear(self, step: int) -> None:
        with self._changed:
            self._reports.pop(step, None)

    def agree(self, key: str, rank: int, ok: bool, world_size: int, timeout_s: float) -> bool:
        with self._changed:
            votes = self._votes
            votes.setdefault(key, {})[rank] = ok
            self._changed.notify_all()
            self._changed.wait_for(lambda: len(votes[key]) >= world_size or not all(votes[key].values()),
                                   timeout=timeout_s)
            return _agreement(key, dict(votes[key]), world_size, timeout_s)


def _missing_message(step: int, reports: dict, world_size: int, timeout_s: float) -> str:
    missing = [r for r in range(world_size) if r not in reports]
    shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
    return (f"step {step} not committed: ranks {shown} did not report their shards within "
            f"{timeout_s:g} s (dead, or storage too slow: raise checkpoint.commit_timeout_s)")


class RedisCommitLedger:
    """Reports in one Redis hash per step: field = rank, value = JSON of files or error."""

    _POLL_MIN_S, _POLL_MAX_S = 0.005, 0.25
    _TTL_S = 7 * 24 * 3600  # reports of a step nobody committed expire on their own

    shared = True  # every rank of the job sees the same ledger

    def __init__(self, client: redis.Redis, job: str, attempt: int):
        self._redis = client
        self._prefix = keys.attempt_prefix(job, attempt) + "ckpt:"

    def _key(self, step: int) -> str:
        return f"{self._prefix}{step}"

    def report(self, step: int, rank: int, files: dict[str, ShardInfo] | None,
               error: str | None = None) -> None:
        value = json.dumps({"files": {k: vars(v) for k, v in (files or {}).items()}, "error": error})
        pipe = self._redis.pipeline()
        pipe.hset(self._key(step), str(rank), value)
        pipe.expire(self._key(step), self._TTL_S)
        pipe.execute()

    def wait_all(self, step: int, world_size: int, timeout_s: float) -> dict[str, ShardInfo]:
        # Runs in the coordinator's writer thread, so a short poll with backoff costs nothing
        # that training would notice; one HGETALL per poll.
        deadline = time.monotonic() + timeout_s
        pause = self._POLL_MIN_S
        while True:
            raw = self._redis.hgetall(self._key(step))
            reports = {int(k): json.loads(v) for k, v in raw.items()}
            if len(reports) >= world_size or any(r.get("error") for r in reports.values()):
                return _gather(step, reports, world_size)
            if time.monotonic() >= deadline:
                raise CommitAborted(_missing_message(step, reports, world_size, timeout_s))
            time.sleep(pause)
            pause = min(pause * 2, self._POLL_MAX_S)

    def clear(self, step: int) -> None:
        self._redis.delete(self._key(step))

    def agree(self, key: str, rank: int, ok: bool, world_size: int, timeout_s: float) -> bool:
        """Vote on `key` and wait for every rank's vote (or a veto): the restore's "could every
        rank read and verify this step?", outside the process group, so a rank that never
        answers is named instead of hanging a collective."""
        name = f"{self._prefix}agree:{key}"
        pipe = self._redis.pipeline()
        pipe.hset(name, str(rank), "1" if ok else "0")
        pipe.expire(name, self._TTL_S)
        pipe.execute()
        deadline = time.monotonic() + timeout_s
        pause = self._POLL_MIN_S
        while True:
            votes = {int(k): v in (b"1", "1") for k, v in self._redis.hgetall(name).items()}
            if len(votes) >= world_size or not all(votes.values()):
                return _agreement(key, votes, world_size, None)
            if time.monotonic() >= deadline:  # one last look: a vote may have come meanwhile
                votes = {int(k): v in (b"1", "1") for k, v in self._redis.hgetall(name).items()}
                return _agreement(key, votes, world_size, timeout_s)
            time.sleep(pause)
            pause = min(pause * 2, self._POLL_MAX_S)
