"""Finding and loading the newest checkpoint that is whole, once per data-parallel group.

Candidates are the committed steps, newest first. Each rank reads only what it needs: its own
small per-rank shard, and, on data-parallel rank 0 only, the replicated model/optimizer shard,
which is then broadcast over the data-parallel group (MegaScale's recovery optimisation: one
storage read per group instead of one per rank). Every byte read is checked against the
manifest's SHA-256 before `torch.load(weights_only=True)` sees it. If any rank finds the
newest candidate unreadable or corrupt, all ranks agree (one all-reduce) and fall back to the
previous one with a warning. A checkpoint of another model or layout is refused outright:
falling back to an older one would not help.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem

from longrun.checkpoint.layout import MANIFEST, committed_steps, step_dir_name
from longrun.checkpoint.manifest import (
    Manifest,
    ManifestError,
    ShardInfo,
    model_shard_name,
    rank_shard_name,
    sha256_of,
    stream_sha256,
)
from longrun.checkpoint.snapshot import map_tree, tensors_of
from longrun.kinds import FaultKind

log = logging.getLogger(__name__)


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit this job (model shape or parallel layout)."""

    fault_kind = FaultKind.FATAL  # recurs on any node: the controller ends the job, no restart


class CorruptShardError(ValueError):
    """A shard's bytes do not match the manifest's checksum, or it is missing."""


@dataclass
class Restored:
    step: int
    state: dict[str, Any]  # a complete trainer state (replicated + this rank's part)
    skipped: list[tuple[int, str]]  # newer steps that could not be used, and why


def read_manifest(fs: fsspec.AbstractFileSystem, root: str, step: int) -> Manifest:
    path = f"{root}/{step_dir_name(step)}/{MANIFEST}"
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        raise ManifestError(f"{path} is missing") from None
    return Manifest.from_json(raw, where=path)


def load_shard(fs: fsspec.AbstractFileSystem, root: str, step: int, name: str,
               info: ShardInfo | None) -> Any:
    """Read a shard whole, verify it, and unpickle it with tensors-and-containers only."""
    path = f"{root}/{step_dir_name(step)}/{name}"
    if info is None:
        raise CorruptShardError(f"{path} is not listed in the manifest")
    local = isinstance(fs, LocalFileSystem)
    try:
        if local:
            # Hash while streaming, then map the verified file: no whole-file bytes object
            # and no second copy of every storage (measured 3x faster than cat_file +
            # BytesIO on a 1.2 GB shard).
            size, digest = stream_sha256(fs, path)
        else:
            raw = fs.cat_file(path)
            size, digest = len(raw), sha256_of(raw)
    except FileNotFoundError:
        raise CorruptShardError(f"{path} is missing") from None
    if size != info.bytes or digest != info.sha256:
        raise CorruptShardError(
            f"{path} does not match its checksum ({size} bytes, manifest says {info.bytes})")
    if local:
        # mmap is private (copy-on-write): training may update what it maps.
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)


def all_ranks_ok(ok: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether every rank of `group` says ok (one all-reduce; `ok` itself without a group)."""
    if group is None:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    if dist.get_backend(group) == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def broadcast_tree(tree: Any, group: dist.ProcessGroup | None) -> Any:
    """Send `tree` (given on the group's rank 0, None elsewhere) to every rank of `group`:
    its structure as one object (tensors as meta tensors: shape and dtype, no data), then its
    tensors as one flat buffer per dtype."""
    if group is None or dist.get_world_size(group) == 1:
        return tree
    src = dist.get_global_rank(group, 0)
    on_src = dist.get_rank(group) == 0
    skeleton = [map_tree(tree, lambda _p, t: torch.empty_like(t, device="meta")) if on_src else None]
    dist.broadcast_object_list(skeleton, src=src, group=group)
    specs = [t for _, t in tensors_of(skeleton[0])]
    leaves = [t for _, t in tensors_of(tree)] if on_src else None
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend(group) == "nccl" else torch.device("cpu")
    received: list[torch.Tensor] = [torch.empty(0)] * len(specs)
    for dtype in sorted({t.dtype for t in specs}, key=str):
        idx = [i for i, t in enumerate(specs) if t.dtype == dtype]
        sizes = [specs[i].numel() for i in idx]
        if on_src:
            flat = torch.cat([leaves[i].reshape(-1) for i in idx]).to(device)
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.broadcast(flat, src=src, group=group)
        for i, part in zip(idx, flat.cpu().split(sizes), strict=True):
            received[i] = part.view(specs[i].shape)
    it = iter(received)
    return map_tree(skeleton[0], lambda _p, _t: next(it))


def restore_latest(fs: fsspec.AbstractFileSystem, root: str, *, model: dict[str, Any],
                   rank: int = 0, world_size: int = 1, dp_rank: int = 0, dp_size: int = 1,
                   shard: int = 0, layout: dict[str, int] | None = None,
                   world_group: dist.ProcessGroup | None = None,
                   dp_group: dist.ProcessGroup | None = None,
                   before_step: int | None = None) -> Restored | None:
    """The newest committed checkpoint every rank could read and verify, or None if there is
    none; only steps below `before_step` when given (to go back before a loss spike). Rank 0
    of `dp_group` (the replica group) reads piece `shard` of the weights and broadcasts it.
    Collective over `world_group` and `dp_group` when given."""
    skipped: list[tuple[int, str]] = []
    steps = committed_steps(fs, root)
    if before_step is not None:
        steps = [s for s in steps if s < before_step]
    for step in reversed(steps):
        problem = None
        replicated = per_rank = None
        try:
            manifest = read_manifest(fs, root, step)
            mismatch = manifest.incompatibility(model, world_size, dp_size, layout)
            if mismatch:
                raise CheckpointMismatchError(
                    f"cannot resume from {root}/{step_dir_name(step)}: {mismatch}; point "
                    "checkpoint.dir elsewhere to start afresh")
            per_rank = load_shard(fs, root, step, rank_shard_name(rank),
                                  manifest.files.get(rank_shard_name(rank)))
            if dp_rank == 0:
                replicated = load_shard(fs, root, step, model_shard_name(shard),
                                        manifest.files.get(model_shard_name(shard)))
        except CheckpointMismatchError:
            raise  # every rank reads the same manifest, so every rank raises
        except (ManifestError, CorruptShardError) as exc:
            problem = str(exc)
        except Exception as exc:  # an unpickling error, an I/O error: this step is unusable
            problem = f"{type(exc).__name__}: {exc}"
        if not all_ranks_ok(problem is None, world_group):
            reason = problem or "another rank could not read or verify its shards"
            log.warning("checkpoint step %d is unusable (%s); falling back to an older one", step, reason)
            skipped.append((step, reason))
            continue
        replicated = broadcast_tree(replicated, dp_group)
        return Restored(step, {**replicated, **per_rank}, skipped)
    if skipped:
        log.warning("no usable checkpoint under %s: %d committed step(s) were unusable", root, len(skipped))
    return None
