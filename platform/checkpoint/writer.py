"""Stage 2 of a save: a background thread writes the host snapshot and commits it.

Per save, on every rank: write this rank's files straight into the step's directory
(`layout.save_dir_name`: `step-N/`, or the next revision when step N is committed already)
through fsspec, the DCP data file by several threads with its checksums computed beside the
writes (`records.py`), fsynced on a local disk; then report the checksums to the commit ledger
(for a DCP data file, with each record's place and checksum). On the coordinator (rank 0)
additionally: wait until every rank has reported, check with one listing that every reported
file is there at its size, write DCP's `.metadata` from the reports, then the manifest, last:
the manifest is what makes the directory a checkpoint (`layout.py`), so nothing is renamed or
moved (on an object store a move is a copy of every byte); then point `latest` at it and apply
retention (the newest commit is always kept; a rollback's fenced checkpoints go, `lineage.py`).
Before the manifest and again before retention it checks that the root still belongs to the
controller it started under (`owner.py`); another owner there ends the job instead.

A save that fails removes what it wrote at once (the coordinator, whose commit a failure
aborts, the whole uncommitted directory), so a disk that stays full is not filled further by
every retry; a crash leaves a directory without a manifest, which nothing restores and the next
attempt sweeps (`layout.sweep_uncommitted`).

A thread, not a process: the snapshot already lives in host memory that a fork must never
copy (pinned buffers), the writes and the hashing release the GIL, and a thread shares the
snapshot without a copy. At most one save is in flight; the caller decides whether a new save
waits for it or is skipped. A failure is kept and re-raised to the trainer (`raise_if_failed`),
reported to the ledger (so the coordinator does not wait for a rank that will never report)
and to the `on_done` callback (metrics).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from longrun.checkpoint.commit import CommitAborted, CommitLedger
from longrun.checkpoint.dcp_format import METADATA_FILE, metadata_bytes
from longrun.checkpoint.deleter import BackgroundDeleter
from longrun.checkpoint.layout import (
    MANIFEST,
    apply_retention,
    fsync_dir,
    replace_file,
    save_dir_name,
    write_latest,
)
from longrun.checkpoint.lineage import FenceError, fenced_steps
from longrun.checkpoint.manifest import HashingWriter, Manifest, ShardInfo
from longrun.checkpoint.owner import ensure_owner, owner_id
from longrun.checkpoint.records import lay_out, write_local, write_stream
from longrun.checkpoint.snapshot import Snapshot
from longrun.kinds import FaultKind

__all__ = ["CheckpointWriteError", "CheckpointWriter", "SaveJob", "SaveResult", "fsync_dir"]

log = logging.getLogger(__name__)


class CheckpointWriteError(RuntimeError):
    """A background save failed; earlier checkpoints are untouched."""


@dataclass
class SaveJob:
    step: int
    snapshot: Snapshot  # tree: {file name: what goes in that file}
    manifest: Manifest | None = None  # the coordinator's manifest (files filled in on commit)


@dataclass
class SaveResult:
    step: int
    committed: bool  # the checkpoint exists (coordinator) / this rank's shards are reported
    write_s: float  # writing this rank's shards
    total_s: float  # from submit to done (commit included on the coordinator)
    bytes: int
    error: BaseException | None = field(default=None, repr=False)


class CheckpointWriter:
    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, rank: int, world_size: int,
                 ledger: CommitLedger, keep_last: int, commit_timeout_s: float = 600.0,
                 on_done: Callable[[SaveResult], None] | None = None):
        self.fs, self.root = fs, root.rstrip("/")
        self.rank, self.world_size = rank, world_size
        self.ledger, self.keep_last, self.commit_timeout_s = ledger, keep_last, commit_timeout_s
        self.on_done = on_done
        self._local = isinstance(fs, LocalFileSystem)
        # Whose root this is as the writer starts: its controller took it before placing it.
        # Commits and retention happen only while it still is (`owner.py`).
        self._owner = owner_id(fs, self.root) if self.coordinator else None
        self._lock = threading.Condition()
        self._job: SaveJob | None = None
        self._busy = False
        self._closed = False
        self._failure: BaseException | None = None
        self._fail_next: str | None = None  # an injected fault (fail_save): the next save fails
        self.last_result: SaveResult | None = None
        # Only the coordinator applies retention; its deletions run beside the next save.
        self._deleter = BackgroundDeleter(fs) if self.coordinator else None
        self._thread = threading.Thread(target=self._run, name=f"longrun-ckpt-writer-{rank}",
                                        daemon=True)
        self._thread.start()

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._busy

    def submit(self, job: SaveJob) -> None:
        """Hand a save to the thread. The caller must not stage into the snapshot's buffers
        again before `wait_idle()` returns (or `busy` is False)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the checkpoint writer is closed")
            if self._busy:
                raise RuntimeError("a save is already in flight; wait_idle() first")
            self._job, self._busy = job, True
            self._lock.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: not self._busy, timeout=timeout)

    def raise_if_failed(self) -> None:
        """Re-raise (once) the failure of the last save, if it failed."""
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            error = CheckpointWriteError(f"checkpoint save failed: {type(failure).__name__}: {failure}")
            # A cause that would recur in any attempt (a foreign owner of the root) ends the job.
            error.fault_kind = getattr(failure, "fault_kind", FaultKind.EXCEPTION)
            raise error from failure

    def close(self, timeout: float | None = None) -> None:
        """Finish the save in flight and the deletions it started, then stop the threads."""
        self.wait_idle(timeout)
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout)
        if self._deleter is not None:
            self._deleter.close(timeout)

    def wait_deleted(self, timeout: float | None = None) -> bool:
        """Until the old checkpoints retention has given up so far are gone from storage."""
        return self._deleter is None or self._deleter.wait(timeout)

    # -- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._job is not None or self._closed)
                if self._job is None:
                    return
                job = self._job
            result = self._save(job)
            with self._lock:
                self._job, self._busy = None, False
                self.last_result = result
                if result.error is not None:
                    self._failure = result.error
                self._lock.notify_all()
            if self.on_done is not None:
                try:
                    self.on_done(result)
                except Exception:  # a metrics hook must not kill the writer
                    log.exception("checkpoint on_done hook failed")

    def fail_next_save(self, why: str) -> None:
        """Make the next save fail as on a full disk (the `fail_save` fault, health/faults.py)."""
        with self._lock:
            self._fail_next = why

    def _save(self, job: SaveJob) -> SaveResult:
        start = time.perf_counter()
        written = 0
        write_s = 0.0
        step_dir, created = None, []  # what this save wrote: removed again if it fails
        try:
            # A CPU snapshot's copy, left to this thread so that it overlaps the next step's
            # forward and backward; first, even for a save about to fail, because the trainer
            # waits for it before its next optimizer update (it sets its event even if it fails).
            job.snapshot.copy()
            name = save_dir_name(self.fs, self.root, job.step)
            step_dir = f"{self.root}/{name}"
            self.fs.makedirs(step_dir, exist_ok=True)
            with self._lock:
                injected, self._fail_next = self._fail_next, None
            if injected is not None:
                raise OSError(errno.ENOSPC, f"No space left on device ({injected})")
            files: dict[str, ShardInfo] = {}
            job.snapshot.wait()  # the device-to-host copy, if it is still running
            for file_name, tree in job.snapshot.tree.items():
                path = f"{step_dir}/{file_name}"
                created.append(path)
                write = self._write_pieces if file_name.endswith(".distcp") else self._write_shard
                files[file_name] = write(path, tree)
                written += files[file_name].bytes
            write_s = time.perf_counter() - start
            self.ledger.report(job.step, self.rank, files)
            if self.coordinator:
                self._commit(job, step_dir, name)
            return SaveResult(job.step, True, write_s, time.perf_counter() - start, written)
        except BaseException as exc:
            log.error("rank %d: checkpoint of step %d failed: %s", self.rank, job.step, exc)
            try:
                self.ledger.report(job.step, self.rank, None, error=f"{type(exc).__name__}: {exc}")
            except Exception:
                log.exception("could not report the failure to the commit ledger")
            if step_dir is not None:
                self._remove_partial(step_dir, created)
            return SaveResult(job.step, False, write_s, time.perf_counter() - start, written, exc)

    def _remove_partial(self, step_dir: str, created: list[str]) -> None:
        """After a failed save: this rank's files, and on the coordinator (its commit is off)
        the whole directory, unless a manifest made it a checkpoint after all (a failure after
        the commit, say in retention, leaves what was committed)."""
        try:
            if self.fs.exists(f"{step_dir}/{MANIFEST}"):
                return
            if self.coordinator:
                if self.fs.exists(step_dir):
                    self.fs.rm(step_dir, recursive=True)
                return
            for path in created:
                if self.fs.exists(path):
                    self.fs.rm_file(path)
        except Exception as exc:  # the sweep at the next attempt's start gets what is left
            log.warning("rank %d: could not remove the failed save's files under %s: %s",
                        self.rank, step_dir, exc)

    def _write_shard(self, path: str, tree: Any) -> ShardInfo:
        with self.fs.open(path, "wb") as f:
            out = HashingWriter(f)
            try:
                torch.save(tree, out)
            except Exception as exc:
                if out.error is not None:
                    raise out.error from exc
                raise
            out.flush()
            if self._local:
                os.fsync(f.fileno())
        return out.info()

    def _write_pieces(self, path: str, pieces: dict[str, dict[str, Any]]) -> ShardInfo:
        """A DCP data file: one torch.save record per tensor piece (`records.py`), by several
        threads on a local disk, streamed to an object store."""
        records = lay_out(pieces)
        if self._local:
            return write_local(path, records)
        with self.fs.open(path, "wb") as f:
            return write_stream(f, records)

    def _write_metadata(self, step_dir: str, files: dict[str, ShardInfo]) -> ShardInfo:
        """DCP's `.metadata` for the pieces every rank reported, so `dcp.load` reads the
        checkpoint as is. Raises CommitAborted when the pieces do not cover every tensor."""
        try:
            raw = metadata_bytes(files)
        except ValueError as exc:
            raise CommitAborted(f"step not committed: {exc}") from None
        with self.fs.open(f"{step_dir}/{METADATA_FILE}", "wb") as f:
            out = HashingWriter(f)
            out.write(raw)
            out.flush()
            if self._local:
                os.fsync(f.fileno())
        return out.info()

    def _check_visible(self, step_dir: str, files: dict[str, ShardInfo]) -> set[str]:
        """Every file the ranks reported is where the restore will look, at the size written
        (one listing): a rank that wrote to a directory of its own node (a checkpoint.dir not
        shared) must fail the commit, not leave a manifest naming pieces no one else can read.
        Returns the names listed that no rank reported (leftovers of a save that died here)."""
        self.fs.invalidate_cache()  # other processes wrote them: no listing remembered from before
        try:
            listed = {entry["name"].rsplit("/", 1)[-1]: entry.get("size")
                      for entry in self.fs.ls(step_dir, detail=True)}
        except FileNotFoundError:
            listed = {}
        wrong = [f"{name} ({'missing' if name not in listed else f'{listed[name]} bytes, not {info.bytes}'})"
                 for name, info in sorted(files.items())
                 if name not in listed or (listed[name] is not None and listed[name] != info.bytes)]
        if wrong:
            raise CheckpointWriteError(
                f"{len(wrong)} file(s) the ranks reported written are not in {step_dir} as written: "
                f"{', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}. checkpoint.dir must be one "
                "directory every node shares")
        # `.metadata` is not reported by a rank: the coordinator writes it next, over any old one.
        return set(listed) - set(files) - {MANIFEST, METADATA_FILE}

    def _commit(self, job: SaveJob, step_dir: str, name: str) -> None:
        if job.manifest is None:
            raise ValueError("the coordinator's save needs a manifest")
        try:
            job.manifest.files = self.ledger.wait_all(job.step, self.world_size, self.commit_timeout_s)
        finally:
            self.ledger.clear(job.step)
        leftovers = self._check_visible(step_dir, job.manifest.files)
        if any(info.items for info in job.manifest.files.values()):
            job.manifest.files[METADATA_FILE] = self._write_metadata(step_dir, job.manifest.files)
        job.manifest.created_unix = time.time()
        if self._local:
            fsync_dir(step_dir)  # the files' names are durable before a manifest names them
        ensure_owner(self.fs, self.root, self._owner, f"the commit of step {job.step}")
        # The commit: one file, written whole or not at all (`layout.replace_file`).
        replace_file(self.fs, f"{step_dir}/{MANIFEST}", job.manifest.to_json())
        if self._local:
            fsync_dir(self.root)
        for leftover in sorted(leftovers):  # not part of this checkpoint: nothing reads them
            self.fs.rm(f"{step_dir}/{leftover}", recursive=True)
        write_latest(self.fs, self.root, job.step, name)
        try:
            fenced = fenced_steps(self.fs, self.root)
        except FenceError as exc:  # which ones are abandoned is unknown: delete nothing
            log.warning("checkpoint retention skipped: %s", exc)
            return
        ensure_owner(self.fs, self.root, self._owner, f"checkpoint retention after step {job.step}")
        removed = apply_retention(self.fs, self.root, self.keep_last, committed=job.step, fenced=fenced,
                                  remove=self._deleter.submit if self._deleter is not None else None)
        if removed:
            log.info("checkpoint retention removed %s", ", ".join(p.rsplit("/", 1)[-1] for p in removed))
