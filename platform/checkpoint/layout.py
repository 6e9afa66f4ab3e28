"""Checkpoint directory layout on any fsspec filesystem (a local or shared disk, an object store).

    <root>/step-00000120/       one save of step 120: every rank writes its files straight in
        __0_0.distcp ...
        manifest.json           written last, by the coordinator: the commit marker
    <root>/step-00000120.1/     a save of step 120 made while step-00000120 is committed (say the
                                path after a rollback saving a fenced step again): a revision,
                                written the same way; committed, it is step 120, the older goes
    <root>/latest               text: the name of the newest committed step directory

A directory is a checkpoint exactly when it holds a manifest. Files go straight to their
final place because on an object store a "rename" is a copy of every byte and a delete (hours
for a 70B checkpoint); the manifest is one small object written last, so a crash at any moment
leaves the previous checkpoint and, at worst, a directory without a manifest, which restores
never see. A save that fails removes its own files at once; what a crash leaves is swept when
an attempt starts, while no writer is alive (`sweep_uncommitted`), or by a later commit's
retention (earlier steps only: a later one may be a save other ranks are still writing). A
committed step is never overwritten: saving its step again writes the next revision, and the
older one is deleted only once the new one is committed. `step-N.tmp/` directories are what
longrun wrote before (its commit renamed them): never committed, swept the same way.

Listings are read fresh (`invalidate_cache`): other processes write here, and s3fs would
otherwise answer from what this process listed before.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Collection

import fsspec
from fsspec.implementations.local import LocalFileSystem

from longrun import safe_files
from longrun.checkpoint.stored import read_stored

MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8,})(?:\.([1-9]\d*))?$")  # step-N, or step-N.R (a revision)
_TMP_DIR = re.compile(r"^step-(\d{8,})\.tmp$")  # what longrun wrote before the manifest-last commit


def step_dir_name(step: int, revision: int = 0) -> str:
    if step < 0:
        raise ValueError(f"a checkpoint step must be >= 0, got {step}")
    return f"step-{step:08d}" + (f".{revision}" if revision else "")


def tmp_dir_name(step: int) -> str:
    """The staging directory of earlier longrun versions (recognised to be swept)."""
    return step_dir_name(step) + ".tmp"


def parse_dir(name: str) -> tuple[int, int] | None:
    """(step, revision) of a step directory's name, or None for anything else."""
    match = _STEP_DIR.match(name)
    return (int(match.group(1)), int(match.group(2) or 0)) if match else None


def parse_step(name: str) -> int | None:
    """The step of a step directory's name (any revision), or None for anything else."""
    parsed = parse_dir(name)
    return parsed[0] if parsed else None


def _names(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    fs.invalidate_cache()
    if not fs.exists(root):
        return []
    return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(root, detail=False)]


def _committed(fs: fsspec.AbstractFileSystem, root: str, name: str) -> bool:
    return fs.exists(f"{root}/{name}/{MANIFEST}")


def committed_dirs(fs: fsspec.AbstractFileSystem, root: str) -> dict[int, list[str]]:
    """{step: names of its committed directories, newest revision first}."""
    found: dict[int, list[tuple[int, str]]] = {}
    for name in _names(fs, root):
        parsed = parse_dir(name)
        if parsed is not None and _committed(fs, root, name):
            found.setdefault(parsed[0], []).append((parsed[1], name))
    return {step: [name for _, name in sorted(dirs, reverse=True)] for step, dirs in found.items()}


def committed_steps(fs: fsspec.AbstractFileSystem, root: str) -> list[int]:
    """Steps with a committed directory (a manifest in it), oldest first."""
    return sorted(committed_dirs(fs, root))


def step_dir(fs: fsspec.AbstractFileSystem, root: str, step: int) -> str:
    """The directory of committed step `step` (its newest revision); the plain name when the
    step is not committed (what an error message then names)."""
    revisions = sorted(((parsed[1], name) for name in _names(fs, root)
                        if (parsed := parse_dir(name)) is not None and parsed[0] == step), reverse=True)
    for _, name in revisions:
        if _committed(fs, root, name):
            return f"{root}/{name}"
    return f"{root}/{step_dir_name(step)}"


def save_dir_name(fs: fsspec.AbstractFileSystem, root: str, step: int) -> str:
    """Where a new save of `step` writes: the revision above its newest committed one (the plain
    name when none is), so a committed checkpoint is never written over. Every rank of a save
    asks and gets the same answer: commits happen only between saves."""
    committed = committed_dirs(fs, root).get(step)
    if not committed:
        return step_dir_name(step)
    newest = parse_dir(committed[0])
    assert newest is not None
    return step_dir_name(step, newest[1] + 1)


def uncommitted_dirs(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """Step directories without a manifest (a save in progress or one that died) and earlier
    versions' `.tmp` directories."""
    return sorted(f"{root}/{name}" for name in _names(fs, root)
                  if _TMP_DIR.match(name) or (parse_dir(name) is not None and not _committed(fs, root, name)))


def sweep_uncommitted(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """Delete every uncommitted directory. Only when no writer of this checkpoint root is alive
    (between attempts): a save in progress looks the same. Returns what was deleted."""
    doomed = uncommitted_dirs(fs, root)
    for path in doomed:
        fs.rm(path, recursive=True)
    return doomed


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write `data` at `path` so a reader sees the old content or the new, never a part: on a
    local disk a new temporary file, fsynced, renamed over it (`safe_files.replace_file`: never
    written through a planted link) and the directory fsynced; on an object store one PUT,
    which replaces an object whole (a move would be a copy there)."""
    if not isinstance(fs, LocalFileSystem):
        fs.pipe_file(path, data)
        return
    safe_files.replace_file(path, data)
    fsync_dir(os.path.dirname(path) or ".")


def read_latest(fs: fsspec.AbstractFileSystem, root: str) -> int | None:
    """The step `latest` names (None: no such file, or not a step's name); UnsafePath when a
    link or a FIFO stands in its place (`stored.py`)."""
    try:
        raw = read_stored(fs, f"{root}/{LATEST}")
    except FileNotFoundError:
        return None
    return parse_step(raw.decode(errors="replace").strip())


def write_latest(fs: fsspec.AbstractFileSystem, root: str, step: int, name: str | None = None) -> None:
    """Point `latest` at committed step `step` (directory `name`, default its plain name)."""
    replace_file(fs, f"{root}/{LATEST}", (name or step_dir_name(step)).encode())


def apply_retention(fs: fsspec.AbstractFileSystem, root: str, keep_last: int,
                    committed: int | None = None, fenced: Collection[int] = (),
                    remove: Callable[[str], None] | None = None) -> list[str]:
    """Delete committed checkpoints beyond the newest `keep_last`, older revisions of a step a
    newer revision replaced, and abandoned directories: uncommitted ones (no manifest) and the
    `fenced` steps (a rollback's abandoned path, `lineage.py`). Only committed, unfenced steps
    count towards `keep_last`. With `committed` (the step just committed) that one is never
    deleted, whatever its number: leftovers of an abandoned path may carry higher step numbers
    and must not push the newest commit out; and only uncommitted directories of earlier steps
    go: a later one may be a save other ranks are still writing. Each doomed directory loses
    its manifest here; `remove` (default: at once, recursively) deletes the rest, say on a
    thread of its own (`deleter.py`). Returns what was deleted."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the newest checkpoint is always kept), got {keep_last}")
    dirs = committed_dirs(fs, root)
    steps = sorted(dirs)
    live = [s for s in steps if s not in fenced]
    if committed in live:
        others = [s for s in live if s != committed]
        keep = {committed, *others[max(len(others) - (keep_last - 1), 0):]}
    else:
        keep = set(live[-keep_last:])
    doomed = [f"{root}/{name}" for s in steps for name in (dirs[s] if s not in keep else dirs[s][1:])]
    for name in _names(fs, root):
        tmp = _TMP_DIR.match(name)
        step = int(tmp.group(1)) if tmp else parse_step(name)
        if step is None or (committed is not None and step >= committed):
            continue
        if tmp or not _committed(fs, root, name):
            doomed.append(f"{root}/{name}")
    for path in doomed:
        delete_step_dir(fs, path, remove)
    return doomed


def delete_step_dir(fs: fsspec.AbstractFileSystem, path: str,
                    remove: Callable[[str], None] | None = None) -> None:
    """Manifest first: a crash half-way through deleting must leave a directory that no
    longer counts as committed, never a "committed" one with shards missing."""
    if fs.exists(f"{path}/{MANIFEST}"):
        fs.rm_file(f"{path}/{MANIFEST}")
    if remove is None:
        fs.rm(path, recursive=True)
    else:
        remove(path)
