"""Which committed checkpoints lie on the job's live path: the fences rollbacks lay.

After a loss spike the policy restores the newest checkpoint *before* the bad step and trains
on from there. Every checkpoint committed at or after that step holds weights of the
abandoned path (the spike's), and some may still be committed by the dying attempt's writer
after the rollback was decided. A later ordinary restart must never restore one, yet the new
path will commit checkpoints at the very same steps. So the abandoned ones are fenced:

    <root>/fences.json    {"fences": [{"from_step": 25, "reason": "...", "created_unix": ...}, ...]}

in the order the rollbacks happened, and every manifest records its `lineage`: how many fences
existed when the attempt that wrote it started. Fence i (1-based) abandons every checkpoint of
step >= its `from_step` whose lineage is below i: the old path's checkpoints, late commits
included (their lineage is older), and not the new path's (written with lineage >= i).
Checkpoints from before fences existed have lineage 0. The restore, the controller's precheck
and retention honour the fences; nothing here imports torch (the controller writes them).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass

import fsspec

from longrun.checkpoint.layout import MANIFEST, committed_dirs
from longrun.checkpoint.manifest import Manifest, ManifestError
from longrun.checkpoint.stored import read_stored
from longrun.safe_files import UnsafePath

log = logging.getLogger(__name__)

FENCES = "fences.json"


class FenceError(ValueError):
    """fences.json is unreadable: which checkpoints are abandoned is unknown."""


@dataclass(frozen=True)
class Fence:
    from_step: int  # checkpoints at this step or later, of an older lineage, are abandoned
    reason: str = ""
    created_unix: float = 0.0


def read_fences(fs: fsspec.AbstractFileSystem, root: str) -> list[Fence]:
    """The fences under `root`, oldest first ([] when there are none)."""
    path = f"{root}/{FENCES}"
    try:
        raw = read_stored(fs, path)
        return [Fence(**entry) for entry in json.loads(raw)["fences"]]
    except FileNotFoundError:
        return []
    except UnsafePath as exc:  # a link or a FIFO in its place: never followed
        raise FenceError(str(exc)) from None
    except (ValueError, TypeError, KeyError) as exc:
        raise FenceError(f"{path} is not a valid fence record ({exc}); it lists the checkpoints a "
                         "loss-spike rollback abandoned: restore it, or move the checkpoints at or "
                         "after the rolled-back step out of the way and delete it") from None


def current_lineage(fs: fsspec.AbstractFileSystem, root: str) -> int:
    """The lineage an attempt starting now writes its checkpoints with."""
    return len(read_fences(fs, root))


def add_fence(fs: fsspec.AbstractFileSystem, root: str, from_step: int, reason: str = "") -> int:
    """Abandon every checkpoint at step >= `from_step` written so far (and any still being
    committed by an attempt that started before now). Returns the new lineage. Written to a
    temporary file and moved over, like `latest`: the record is whole or the old one."""
    fences = [*read_fences(fs, root), Fence(from_step, reason, time.time())]
    tmp = f"{root}/{FENCES}.tmp"
    fs.pipe_file(tmp, json.dumps({"fences": [asdict(f) for f in fences]}, indent=1).encode())
    fs.mv(tmp, f"{root}/{FENCES}")
    return len(fences)


def fence_of(step: int, lineage: int, fences: list[Fence]) -> Fence | None:
    """The first fence that abandons a checkpoint of `step` written at `lineage`, or None."""
    for number, fence in enumerate(fences, start=1):
        if lineage < number and step >= fence.from_step:
            return fence
    return None


def abandoned_reason(manifest: Manifest, fences: list[Fence]) -> str | None:
    """Why a committed checkpoint lies off the live path (one phrase), or None."""
    fence = fence_of(manifest.step, manifest.lineage, fences)
    if fence is None:
        return None
    return (f"abandoned by the rollback to before step {fence.from_step}"
            + (f" ({fence.reason})" if fence.reason else ""))


def fenced_steps(fs: fsspec.AbstractFileSystem, root: str) -> set[int]:
    """Committed steps a fence abandons. Only manifests at or after the earliest fence are
    read; one that cannot be read counts as not fenced (the restore will judge it)."""
    fences = read_fences(fs, root)
    if not fences:
        return set()
    first = min(f.from_step for f in fences)
    fenced = set()
    for step, names in sorted(committed_dirs(fs, root).items()):
        if step < first:
            continue
        path = f"{root}/{names[0]}/{MANIFEST}"  # the newest revision is the step's checkpoint
        try:
            manifest = Manifest.from_json(read_stored(fs, path), where=path)
        except (ManifestError, OSError):
            continue
        if fence_of(step, manifest.lineage, fences) is not None:
            fenced.add(step)
    return fenced
