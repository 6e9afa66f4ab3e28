"""Stage 2 of a save: a background thread writes the host snapshot and commits it atomically.

Per save, on every rank: write this rank's shard files into `step-N.tmp/` through fsspec,
hashing them on the way out (SHA-256) and fsyncing them on a local disk, then report the
checksums to the commit ledger (for a DCP data file, with each record's place and checksum:
`dcp_format.py`). On the coordinator (rank 0) additionally: wait until every rank has
reported, write DCP's `.metadata` from the reports, then the manifest, make the directory a
checkpoint (a local disk: fsync, then one atomic rename of the directory; an object store,
where a "rename" is a copy: move the shards, then write the manifest last), point `latest` at
it, and apply retention (the newest commit is always kept; a rollback's fenced checkpoints go,
`lineage.py`).

A thread, not a process: the snapshot already lives in host memory that a fork must never
copy (pinned buffers), torch.save spends most of its time in writes that release the GIL, and
a thread shares the snapshot without a copy. At most one save is in flight; the caller decides
whether a new save waits for it or is skipped. A failure is kept and re-raised to the trainer
(`raise_if_failed`), reported to the ledger (so the coordinator does not wait for a rank that
will never report) and to the `on_done` callback (metrics).
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
from longrun.checkpoint.dcp_format import METADATA_FILE, metadata_bytes, write_pieces
from longrun.checkpoint.layout import (
    MANIFEST,
    apply_retention,
    delete_step_dir,
    step_dir_name,
    tmp_dir_name,
    write_latest,
)
from longrun.checkpoint.lineage import FenceError, fenced_steps
from longrun.checkpoint.manifest import HashingWriter, Manifest, ShardInfo
from longrun.checkpoint.snapshot import Snapshot

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


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriter:
    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, rank: int, world_size: int,
                 ledger: CommitLedger, keep_last: int, commit_timeout_s: float = 600.0,
                 on_done: Callable[[SaveResult], None] | None = None):
        self.fs, self.root = fs, root.rstrip("/")
        self.rank, self.world_size = rank, world_size
        self.ledger, self.keep_last, self.commit_timeout_s = ledger, keep_last, commit_timeout_s
        self.on_done = on_done
        self._local = isinstance(fs, LocalFileSystem)
        self._lock = threading.Condition()
        self._job: SaveJob | None = None
        self._busy = False
        self._closed = False
        self._failure: BaseException | None = None
        self._fail_next: str | None = None  # an injected fault (fail_save): the next save fails
        self.last_result: SaveResult | None = None
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
            raise CheckpointWriteError(
                f"checkpoint save failed: {type(failure).__name__}: {failure}") from failure

    def close(self, timeout: float | None = None) -> None:
        """Finish the save in flight, then stop the thread."""
        self.wait_idle(timeout)
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout)

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
        tmp = f"{self.root}/{tmp_dir_name(job.step)}"
        written = 0
        write_s = 0.0
        try:
            self.fs.makedirs(tmp, exist_ok=True)
            with self._lock:
                injected, self._fail_next = self._fail_next, None
            if injected is not None:
                raise OSError(errno.ENOSPC, f"No space left on device ({injected})")
            files: dict[str, ShardInfo] = {}
            job.snapshot.wait()  # the device-to-host copy, if it is still running
            for name, tree in job.snapshot.tree.items():
                write = self._write_pieces if name.endswith(".distcp") else self._write_shard
                files[name] = write(f"{tmp}/{name}", tree)
                written += files[name].bytes
            write_s = time.perf_counter() - start
            self.ledger.report(job.step, self.rank, files)
            if self.coordinator:
                self._commit(job, tmp)
            return SaveResult(job.step, True, write_s, time.perf_counter() - start, written)
        except BaseException as exc:
            log.error("rank %d: checkpoint of step %d failed: %s", self.rank, job.step, exc)
            try:
                self.ledger.report(job.step, self.rank, None, error=f"{type(exc).__name__}: {exc}")
            except Exception:
                log.exception("could not report the failure to the commit ledger")
            return SaveResult(job.step, False, write_s, time.perf_counter() - start, written, exc)

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
        """A DCP data file: one torch.save record per tensor piece (`dcp_format.py`)."""
        with self.fs.open(path, "wb") as f:
            out = HashingWriter(f)
            items = write_pieces(out, pieces)
            out.flush()
            if self._local:
                os.fsync(f.fileno())
        info = out.info()
        info.items = items
        return info

    def _write_metadata(self, tmp: str, files: dict[str, ShardInfo]) -> ShardInfo:
        """DCP's `.metadata` for the pieces every rank reported, so `dcp.load` reads the
        checkpoint as is. Raises CommitAborted when the pieces do not cover every tensor."""
        try:
            raw = metadata_bytes(files)
        except ValueError as exc:
            raise CommitAborted(f"step not committed: {exc}") from None
        with self.fs.open(f"{tmp}/{METADATA_FILE}", "wb") as f:
            out = HashingWriter(f)
            out.write(raw)
            out.flush()
            if self._local:
                os.fsync(f.fileno())
        return out.info()

    def _check_visible(self, tmp: str, files: dict[str, ShardInfo]) -> None:
        """Every file the ranks reported is where the restore will look, at the size written
        (one listing): a rank that wrote to a directory of its own node (a checkpoint.dir not
        shared) must fail the commit, not leave a manifest naming pieces no one else can read."""
        try:
            listed = {entry["name"].rsplit("/", 1)[-1]: entry.get("size")
                      for entry in self.fs.ls(tmp, detail=True)}
        except FileNotFoundError:
            listed = {}
        wrong = [f"{name} ({'missing' if name not in listed else f'{listed[name]} bytes, not {info.bytes}'})"
                 for name, info in sorted(files.items())
                 if name not in listed or (listed[name] is not None and listed[name] != info.bytes)]
        if wrong:
            raise CheckpointWriteError(
                f"{len(wrong)} file(s) the ranks reported written are not in {tmp} as written: "
                f"{', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}. checkpoint.dir must be one "
                "directory every node shares")

    def _commit(self, job: SaveJob, tmp: str) -> None:
        if job.manifest is None:
            raise ValueError("the coordinator's save needs a manifest")
        try:
            job.manifest.files = self.ledger.wait_all(job.step, self.world_size, self.commit_timeout_s)
        finally:
            self.ledger.clear(job.step)
        self._check_visible(tmp, job.manifest.files)
        if any(info.items for info in job.manifest.files.values()):
            job.manifest.files[METADATA_FILE] = self._write_metadata(tmp, job.manifest.files)
        job.manifest.created_unix = time.time()
        final = f"{self.root}/{step_dir_name(job.step)}"
        if self.fs.exists(final):  # an earlier attempt committed this very step: keep one
            delete_step_dir(self.fs, final)
        if self._local:
            with self.fs.open(f"{tmp}/{MANIFEST}", "wb") as f:
                f.write(job.manifest.to_json())
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            os.rename(tmp, final)  # atomic: the checkpoint appears whole or not at all
            fsync_dir(self.root)
        else:
            # Object stores have no atomic directory rename; the manifest written last is what
            # makes the directory a checkpoint (layout.committed_steps looks for it).
            for name in job.manifest.files:
                self.fs.mv(f"{tmp}/{name}", f"{final}/{name}")
            self.fs.pipe_file(f"{final}/{MANIFEST}", job.manifest.to_json())
            self.fs.rm(tmp, recursive=True)
        write_latest(self.fs, self.root, job.step)
        try:
            fenced = fenced_steps(self.fs, self.root)
        except FenceError as exc:  # which ones are abandoned is unknown: delete nothing
            log.warning("checkpoint retention skipped: %s", exc)
            return
        removed = apply_retention(self.fs, self.root, self.keep_last, committed=job.step, fenced=fenced)
        if removed:
            log.info("checkpoint retention removed %s", ", ".join(p.rsplit("/", 1)[-1] for p in removed))
