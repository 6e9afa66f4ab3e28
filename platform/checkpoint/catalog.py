"""What is in a checkpoint root, read only: what `longrun checkpoint list|inspect` runs.

    longrun checkpoint list runs/tiny/checkpoints
    longrun checkpoint inspect runs/tiny/checkpoints --step 120 --verify

Everything here only reads the checkpoint root (any fsspec URL); nothing under it is changed.
The functions return plain data (dataclasses with `to_json()`), the command line formats it.
`longrun.interop.export` takes the weights out of a checkpoint found here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import fsspec
import torch

from longrun.checkpoint.dcp_format import table_of
from longrun.checkpoint.layout import (
    LATEST,
    MANIFEST,
    committed_steps,
    parse_step,
    read_latest,
    step_dir,
    uncommitted_dirs,
)
from longrun.checkpoint.lineage import FenceError, abandoned_reason, fenced_steps, read_fences
from longrun.checkpoint.manifest import Manifest, ManifestError, stream_check
from longrun.checkpoint.resharding import read_whole
from longrun.checkpoint.restore import read_manifest
from longrun.safe_files import UnsafePath

# The two names of one matrix when model.tie_embeddings is on (trainer/model.py).
TIED_KEYS = ("tok_embeddings.weight", "output.weight")
_HASH_CHUNK = 8 << 20


class CheckpointNotFound(ValueError):
    """The directory, or the step asked for, holds no committed checkpoint."""


# -- finding ---------------------------------------------------------------------------------


def open_root(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, root path) of a checkpoint root; CheckpointNotFound if it does not exist."""
    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/") or "/"
    if not fs.isdir(root):
        raise CheckpointNotFound(f"no such checkpoint directory: {url}")
    return fs, root


def _hint(fs: fsspec.AbstractFileSystem, root: str) -> str:
    """Why a directory without step-N/ children may still be the wrong one the user meant."""
    name = root.rsplit("/", 1)[-1]
    if fs.exists(f"{root}/{MANIFEST}") or parse_step(name.removesuffix(".tmp")) is not None:
        return "; this looks like one checkpoint: pass its parent directory (the checkpoint root)"
    if committed_steps(fs, f"{root}/checkpoints"):
        return f"; the checkpoints seem to be in {root}/checkpoints"
    return " (expected step-NNNNNNNN/ directories, each with a manifest.json)"


def resolve_step(fs: fsspec.AbstractFileSystem, root: str, step: int | None) -> int:
    """`step` if it is committed, or the newest committed step when None."""
    steps = committed_steps(fs, root)
    if not steps:
        raise CheckpointNotFound(f"no committed checkpoint under {root}{_hint(fs, root)}")
    if step is None:  # the newest on the live path: a rollback's fenced steps are not resumed
        try:
            fenced = fenced_steps(fs, root)
        except FenceError:  # `list` says why; reading is still possible
            fenced = set()
        live = [s for s in steps if s not in fenced]
        return live[-1] if live else steps[-1]
    if step not in steps:
        raise CheckpointNotFound(f"no committed checkpoint of step {step} under {root}; "
                                 f"committed steps: {', '.join(map(str, steps))}")
    return step


# -- list ------------------------------------------------------------------------------------


@dataclass
class StepEntry:
    step: int
    path: str
    latest: bool
    created_unix: float | None = None
    total_bytes: int | None = None
    shards: int | None = None
    world_size: int | None = None
    dp_size: int | None = None
    error: str | None = None  # an unreadable manifest
    abandoned: str | None = None  # fenced off by a loss-spike rollback (lineage.py): why


@dataclass
class PendingEntry:
    """A step directory without a manifest (or an earlier longrun's `step-N.tmp`): a save in
    progress, or one a crash abandoned."""
    step: int
    path: str
    files: int
    total_bytes: int


@dataclass
class Listing:
    root: str
    steps: list[StepEntry]
    pending: list[PendingEntry]
    latest: int | None  # what the `latest` file names (None: no such file)
    latest_problem: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def list_checkpoints(url: str) -> Listing:
    """Committed steps (oldest first) and uncommitted step directories under a checkpoint root.
    CheckpointNotFound if it has neither."""
    fs, root = open_root(url)
    steps = committed_steps(fs, root)
    tmp_dirs = uncommitted_dirs(fs, root)
    if not steps and not tmp_dirs:
        raise CheckpointNotFound(f"no checkpoints under {url}{_hint(fs, root)}")
    latest = read_latest(fs, root)
    try:
        fences = read_fences(fs, root)
    except FenceError as exc:
        fences, fence_problem = [], str(exc)
    else:
        fence_problem = None
    entries = []
    for step in steps:
        entry = StepEntry(step, step_dir(fs, root, step), latest == step)
        try:
            m = read_manifest(fs, root, step)
        except ManifestError as exc:
            entry.error = str(exc)
        else:
            entry.created_unix = m.created_unix
            entry.total_bytes = sum(info.bytes for info in m.files.values())
            entry.shards, entry.world_size, entry.dp_size = len(m.files), m.world_size, m.dp_size
            entry.abandoned = abandoned_reason(m, fences)
        entries.append(entry)
    pending = []
    for path in tmp_dirs:
        files = [f for f in fs.find(path, detail=True).values() if f.get("type") == "file"]
        step = parse_step(path.rsplit("/", 1)[-1].removesuffix(".tmp"))
        pending.append(PendingEntry(step if step is not None else -1, path, len(files),
                                    sum(int(f.get("size") or 0) for f in files)))
    problem = None
    if steps and latest is None:
        problem = f"there is no `{LATEST}` file (a job resuming here still uses the newest step)"
    elif latest is not None and latest not in steps:
        problem = f"`{LATEST}` names step {latest}, which is not a committed checkpoint"
    problem = fence_problem or problem
    return Listing(url, entries, pending, latest, problem)


# -- inspect / verify ------------------------------------------------------------------------


@dataclass
class ShardCheck:
    name: str
    status: Literal["OK", "CORRUPT", "MISSING"]
    bytes: int  # what was read (0 when missing)
    detail: str = ""


@dataclass
class WeightsSummary:
    parameters: int  # each tied or shared matrix counted once, as Transformer.num_params()
    tensors: int
    bytes: int
    dtypes: dict[str, int]  # dtype -> elements
    tied: list[str] = field(default_factory=list)


@dataclass
class Inspection:
    root: str
    step: int
    path: str
    manifest: Manifest
    latest: bool
    weights: WeightsSummary | None = None
    weights_error: str | None = None  # the model shard could not be read or verified
    checks: list[ShardCheck] | None = None  # with verify=True

    @property
    def corrupt(self) -> list[str]:
        return [c.name for c in self.checks or [] if c.status != "OK"]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def verify_shards(fs: fsspec.AbstractFileSystem, root: str, step: int,
                  manifest: Manifest) -> list[ShardCheck]:
    """Re-hash every file the manifest lists (streamed, not loaded) against its checksum; on a
    local disk a file that is not a regular file at its own name is CORRUPT, never read."""
    checks, where = [], step_dir(fs, root, step)
    for name, info in sorted(manifest.files.items()):
        path = f"{where}/{name}"
        try:
            size, ok = stream_check(fs, path, info.checksum, _HASH_CHUNK, expected=info.bytes)
        except FileNotFoundError:
            checks.append(ShardCheck(name, "MISSING", 0, "listed in the manifest, not on storage"))
            continue
        except UnsafePath:  # never followed nor waited on: a link may lead anywhere, a FIFO blocks
            checks.append(ShardCheck(name, "CORRUPT", 0, "a symbolic link, FIFO or device, not a regular "
                                     "file: put the shard itself there"))
            continue
        if size != info.bytes:
            checks.append(ShardCheck(name, "CORRUPT", size, f"{size} bytes, the manifest says {info.bytes}"))
        elif not ok:
            checks.append(ShardCheck(name, "CORRUPT", size, "its checksum differs from the manifest's"))
        else:
            checks.append(ShardCheck(name, "OK", size))
    return checks


def load_model_weights(fs: fsspec.AbstractFileSystem, root: str, step: int,
                       manifest: Manifest) -> dict[str, torch.Tensor]:
    """The model state_dict of a committed step, whole whatever layout wrote it (the pieces
    of FSDP and tensor parallelism put together), every record's checksum verified on the way."""
    where = step_dir(fs, root, step)
    if manifest.format < 2:
        raise ManifestError(f"{where} was written by an earlier longrun "
                            "(checkpoint format 1); read it with that longrun")
    try:
        metadata, records = table_of(manifest.files)
    except ValueError as exc:
        raise ManifestError(f"{where}: {exc}") from None
    weights = read_whole(fs, where, metadata, records, "model.")
    if not weights:
        raise ManifestError(f"{where} holds no model weights")
    return weights


def summarize_weights(weights: dict[str, Any], model: dict[str, Any]) -> WeightsSummary:
    tensors = {k: v for k, v in weights.items() if isinstance(v, torch.Tensor)}
    tied = [k for k in TIED_KEYS if k in tensors] if model.get("tie_embeddings") else []
    if len(tied) < 2:
        tied = []
    seen: set[tuple[str, int, int]] = set()
    parameters = nbytes = 0
    dtypes: dict[str, int] = {}
    for key, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        dtypes[dtype] = dtypes.get(dtype, 0) + t.numel()
        nbytes += t.numel() * t.element_size()
        ident = (str(t.device), t.untyped_storage().data_ptr(), t.storage_offset())
        if ident in seen or (tied and key == tied[1]):
            continue  # the same matrix under a second name
        seen.add(ident)
        parameters += t.numel()
    return WeightsSummary(parameters, len(tensors), nbytes, dtypes, tied)


def inspect_checkpoint(url: str, step: int | None = None, *, verify: bool = False) -> Inspection:
    """The manifest of a committed step (default: the newest), a summary of its weights and,
    with `verify`, every shard re-checked against its checksum."""
    fs, root = open_root(url)
    step = resolve_step(fs, root, step)
    manifest = read_manifest(fs, root, step)
    result = Inspection(url, step, step_dir(fs, root, step), manifest,
                        read_latest(fs, root) == step)
    if verify:
        result.checks = verify_shards(fs, root, step, manifest)
    try:
        result.weights = summarize_weights(load_model_weights(fs, root, step, manifest),
                                           manifest.model)
    except Exception as exc:  # corrupt, missing, or not a state_dict: reported, not raised
        result.weights_error = str(exc) or type(exc).__name__
    return result
