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
