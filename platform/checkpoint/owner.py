"""One writer per checkpoint root: the controller that owns it, named in `<root>/owner.lock`.

Two controllers writing one root (the same config run twice, each `longrun run` with a Redis of
its own so their leases never meet; two job names with one `checkpoint.dir`) would sweep each
other's saves in progress, commit over each other's `latest` and delete each other's steps in
retention. So a controller takes the root before it places any worker (`Ownership.take`):

- on a local or shared file system, an exclusive flock on `owner.lock` (`file_lock`), with its
  owner written inside as JSON: a run id, the job, the host and pid. A second controller is
  refused with a sentence naming that owner; the kernel releases the lock when its holder dies,
  however it dies, so a SIGKILLed controller never blocks the next one. A clean end removes it.
- on an object store there is no lock that a dead owner lets go of (a conditional PUT creates
  an object once, and nothing removes it when its writer dies), so the newest controller
  writes its record over the old one and says whose it replaced; the earlier one's writers
  find out at their next commit (below) and stop. docs/security.md (door 3) says so plainly.

The coordinator of every save reads the owner when it starts (`owner_id`): the controller took
the root before placing it, so that is its own. Before it commits and before it applies
retention it reads the owner again (`ensure_owner`); anyone else there means another
controller took the root, and the coordinator refuses (`ForeignOwner`, fatal: no restart fixes
it) rather than write `latest` or delete steps under it. The controller's own sweeps run with
the lock held.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

from longrun import file_lock, safe_files
from longrun.checkpoint.stored import read_stored
from longrun.kinds import FaultKind

log = logging.getLogger(__name__)

OWNER_FILE = "owner.lock"


class CheckpointDirInUse(RuntimeError):
    """Another live controller owns the checkpoint root; the message names it and what to do."""


class ForeignOwner(RuntimeError):
    """A writer found its checkpoint root owned by another controller than its own."""

    fault_kind = FaultKind.FATAL  # every attempt would meet the same owner: the job ends


@dataclass(frozen=True)
class Owner:
    id: str  # this controller's run: what a writer compares
    job: str
    host: str
    pid: int
    since: float

    @classmethod
    def here(cls, job: str) -> Owner:
        return cls(uuid.uuid4().hex, job, socket.gethostname(), os.getpid(), time.time())

    @classmethod
    def parse(cls, text: str | bytes) -> Owner | None:
        """The owner a record names; None for anything else (empty, half-written, foreign)."""
        try:
            data = json.loads(text)
            return cls(str(data["id"]), str(data["job"]), str(data["host"]), int(data["pid"]),
                       float(data["since"]))
        except (ValueError, TypeError, KeyError):
            return None

    def to_json(self) -> str:
        return json.dumps(asdict(self)) + "\n"

    def described(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"job {self.job!r}, whose controller is pid {self.pid} on {self.host} (since {since})"


def read_owner(fs: fsspec.AbstractFileSystem, root: str) -> Owner | None:
    """The owner recorded under `root`; None when there is none (or it cannot be parsed);
    safe_files.UnsafePath when a link or a FIFO stands in its place (`stored.py`)."""
    try:
        return Owner.parse(read_stored(fs, f"{root}/{OWNER_FILE}"))
    except FileNotFoundError:
        return None


def _in_use(url: str, holder_text: str) -> str:
    holder = Owner.parse(holder_text) if holder_text else None
    who = holder.described() if holder else "a controller that has not written its name yet"
    return (f"checkpoint directory {url} is in use by {who}: stop that job first (`longrun stop`, "
            "or Ctrl-C where it runs), or give this one a checkpoint.dir of its own")


def in_use_refusal(url: str) -> str | None:
    """Why a controller could not take the checkpoint root at `url` now (the sentence
    `Ownership.take` refuses with), or None; it only looks, writing nothing. `longrun run` asks
    before it starts any service; the controller's `take` is what holds. Object stores, which
    have no lock, and file systems without locks are never refused here."""
    fs, root = fsspec.core.url_to_fs(url)
    if not isinstance(fs, LocalFileSystem):
        return None
    try:
        holder = file_lock.held_by(Path(root.rstrip("/")) / OWNER_FILE)
    except safe_files.UnsafePath as exc:
        return str(exc)
    return None if holder is None else _in_use(url, holder)


def owner_id(fs: fsspec.AbstractFileSystem, root: str) -> str | None:
    """The id of the owner recorded under `root` now (what a writer starting now belongs to)."""
    owner = read_owner(fs, root)
    return owner.id if owner else None


def ensure_owner(fs: fsspec.AbstractFileSystem, root: str, expected: str | None, doing: str) -> None:
    """ForeignOwner unless `root` still belongs to the owner `expected` (None: to none)."""
    fs.invalidate_cache()  # another process wrote it: no listing or object remembered from before
    now = read_owner(fs, root)
    if (now.id if now else None) == expected:
        return
    whose = f"belongs to {now.described()}" if now else "has no owner any more"
    raise ForeignOwner(
        f"{doing} refused: checkpoint directory {root} {whose}, not to the controller this writer "
        "started under; two jobs must not share a checkpoint.dir: give each its own, and stop this "
        "one if its controller is gone")


class Ownership:
    """The controller's hold on its checkpoint root, from `take` to `release`."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, owner: Owner, fd: int | None):
        self.fs, self.root, self.owner, self._fd = fs, root, owner, fd

    @classmethod
    def take(cls, url: str, job: str) -> Ownership:
        """Own the checkpoint root at `url` for `job` (creating it). CheckpointDirInUse, with
        nothing written, when a live controller owns it; safe_files.UnsafePath when the lock
        file is a link or not a regular file."""
        fs, root = fsspec.core.url_to_fs(url)
        root, owner = root.rstrip("/"), Owner.here(job)
        if not isinstance(fs, LocalFileSystem):
            previous = read_owner(fs, root)
            fs.pipe_file(f"{root}/{OWNER_FILE}", owner.to_json().encode())
            if previous is not None:
                log.warning("checkpoint directory %s was last owned by %s; an object store has no lock "
                            "that tells whether it still runs: if it does, its next commit is refused",
                            url, previous.described())
            return cls(fs, root, owner, None)
        os.makedirs(root, exist_ok=True)
        path = Path(root) / OWNER_FILE
        try:
            fd = file_lock.take(path, owner.to_json())
        except file_lock.LockHeld as held:
            raise CheckpointDirInUse(_in_use(url, held.holder)) from None
        except OSError as exc:
            if exc.errno not in file_lock.NO_LOCKS:
                raise
            log.warning("the file system of %s has no file locks (%s): its owner is recorded and every "
                        "commit checks it, but a second job is not refused at start", url, exc)
            safe_files.replace_file(path, owner.to_json())
            return cls(fs, root, owner, None)
        safe_files.remove_stale_temps(root)  # held alone: what a killed writer left of a replace
        return cls(fs, root, owner, fd)

    def verify(self, doing: str) -> None:
        """ForeignOwner if the root's record names another owner now (on an object store, a
        later controller took it)."""
        ensure_owner(self.fs, self.root, self.owner.id, doing)

    def release(self) -> None:
        """Give the root up: the lock file removed and let go; on an object store the record
        deleted if it is still this controller's."""
        path = f"{self.root}/{OWNER_FILE}"
        if self._fd is not None:
            fd, self._fd = self._fd, None
            file_lock.release(fd, path)
            return
        try:
            if owner_id(self.fs, self.root) == self.owner.id:
                self.fs.rm_file(path)
        except OSError as exc:  # the next owner writes over it
            log.warning("checkpoint owner record %s not removed: %s", path, exc)
