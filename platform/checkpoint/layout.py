"""Checkpoint directory layout on any fsspec filesystem.

    <root>/step-00000120.tmp/   being written: per-rank shards, not yet a checkpoint
    <root>/step-00000120/       committed: the manifest was written last, then the rename
        manifest.json
    <root>/latest               text: the name of the newest committed step directory

A directory counts as committed only when its name has no `.tmp` suffix *and* it holds a
manifest, so a crash at any moment leaves either the previous checkpoint or the new one.
"""

from __future__ import annotations

import re
from collections.abc import Collection

import fsspec

MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TMP_DIR = re.compile(r"^step-(\d{8,})\.tmp$")


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"a checkpoint step must be >= 0, got {step}")
    return f"step-{step:08d}"


def tmp_dir_name(step: int) -> str:
    return step_dir_name(step) + ".tmp"


def parse_step(name: str) -> int | None:
    """The step of a committed directory name, or None for anything else."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def _names(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    if not fs.exists(root):
        return []
    return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(root, detail=False)]


def committed_steps(fs: fsspec.AbstractFileSystem, root: str) -> list[int]:
    """Steps with a committed directory (named step-N, manifest present), oldest first."""
    steps = []
    for name in _names(fs, root):
        step = parse_step(name)
        if step is not None and fs.exists(f"{root}/{name}/{MANIFEST}"):
            steps.append(step)
    return sorted(steps)


def abandoned_tmp_dirs(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    return sorted(f"{root}/{name}" for name in _names(fs, root) if _TMP_DIR.match(name))


def read_latest(fs: fsspec.AbstractFileSystem, root: str) -> int | None:
    path = f"{root}/{LATEST}"
    if not fs.exists(path):
        return None
    return parse_step(fs.cat_file(path).decode().strip())


def write_latest(fs: fsspec.AbstractFileSystem, root: str, step: int) -> None:
    """Point `latest` at a committed step: write a temporary file, then move it over."""
    tmp = f"{root}/{LATEST}.tmp"
    fs.pipe_file(tmp, step_dir_name(step).encode())
    fs.mv(tmp, f"{root}/{LATEST}")


def apply_retention(fs: fsspec.AbstractFileSystem, root: str, keep_last: int,
                    committed: int | None = None, fenced: Collection[int] = ()) -> list[str]:
    """Delete committed checkpoints beyond the newest `keep_last`, and abandoned ones: `.tmp`
    directories, step directories without a manifest (a commit that died half-way on a store
    without atomic rename) and the `fenced` steps (a rollback's abandoned path, `lineage.py`).
    Only committed, unfenced directories count towards `keep_last`. With `committed` (the step
    just committed) that one is never deleted, whatever its number: leftovers of an abandoned
    path may carry higher step numbers and must not push the newest commit out; and only
    abandoned directories of earlier steps go: a later one may be a save other ranks are
    still writing. Returns what was deleted."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the newest checkpoint is always kept), got {keep_last}")
    steps = committed_steps(fs, root)
    live = [s for s in steps if s not in fenced]
    if committed in live:
        others = [s for s in live if s != committed]
        keep = {committed, *others[max(len(others) - (keep_last - 1), 0):]}
    else:
        keep = set(live[-keep_last:])
    doomed = [f"{root}/{step_dir_name(s)}" for s in steps if s not in keep]
    for name in _names(fs, root):
        tmp = _TMP_DIR.match(name)
        step = int(tmp.group(1)) if tmp else parse_step(name)
        if step is None or (committed is not None and step >= committed):
            continue
        if tmp or not fs.exists(f"{root}/{name}/{MANIFEST}"):
            doomed.append(f"{root}/{name}")
    for path in doomed:
        delete_step_dir(fs, path)
    return doomed


def delete_step_dir(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Manifest first: a crash half-way through deleting must leave a directory that no
    longer counts as committed, never a "committed" one with shards missing."""
    if fs.exists(f"{path}/{MANIFEST}"):
        fs.rm_file(f"{path}/{MANIFEST}")
    fs.rm(path, recursive=True)
