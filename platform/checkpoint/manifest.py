"""What a committed checkpoint holds: its shard files, their checksums, and what they fit.

A step directory holds:
- the model and optimizer tensors in torch's distributed-checkpoint format (`dcp_format.py`):
  `__<rank>_0.distcp` per rank that holds pieces nobody else writes (each piece is written once,
  by the first rank holding it), and DCP's `.metadata`; any layout can read them back
  (`resharding.py`);
- `train-state.pt`, written by rank 0: the step, the LR schedule, the data position (one
  position in one global order) and the structure of the model and optimizer state with its
  plain values (hyper-parameters), tensors left out;
- `rank-NNNNN.pt` per rank: its RNG streams.

The manifest is JSON, written last (it is what makes a step exist: `layout.py`): every file
with its checksum and size (and, for a DCP file, each record's place and checksum, so a reader
that reads only some byte ranges still verifies what it reads), the step, the config
fingerprint, the model the tensors fit, the parallel layout they were written at (for
information: any layout restores them), the job's tokenizer and data and training settings (a
resume that changes them is refused unless accepted: `config/identity.py`) and the lineage
(which loss-spike rollbacks it came after, `lineage.py`).
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from longrun.checkpoint import checksum
from longrun.checkpoint.record_bounds import is_count
from longrun.checkpoint.stored import open_stored, size_of
from longrun.safe_files import UnsafeName, checked_member_name

FORMAT_VERSION = 2  # 2: tensors in DCP's format, any layout; 1: pieces per layout (read by none)
_READABLE = (1, 2)  # format 1 manifests are read to say why they cannot be resumed
TRAIN_STATE = "train-state.pt"
GLOBAL_KEYS = ("step", "scheduler", "data")  # the same on every rank, written once by rank 0
PER_RANK_KEYS = ("rng",)  # each rank's own


def rank_shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


# Under pipeline parallelism each stage's first rank writes the structure of its stage's model
# and optimizer state (rank 0's is in TRAIN_STATE): see stage_structure.py.
STAGE_STATE_PREFIX = "train-state-stage-"


def stage_state_name(stage: int) -> str:
    return f"{STAGE_STATE_PREFIX}{stage:03d}.pt"


# Model fields that say where the weights started, not what they are: a job resumes from its
# checkpoint whatever they say (and checkpoints from before they existed lack them).
_NOT_THE_SHAPE = ("init_from",)


def _shape_of(model: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in model.items() if k not in _NOT_THE_SHAPE}


class ManifestError(ValueError):
    """A manifest that is missing, truncated or not one of ours."""


@dataclass
class ShardInfo:
    # The file's checksum (`checksum.py`: "xxh3_128:<hex>"). Manifests written before xxh3 call
    # it "sha256" and hold a bare SHA-256; they are read through `from_dict`. Renamed rather
    # than kept: a tool that reads the field as a SHA-256 of the file fails on the missing
    # name instead of finding a digest that is not one.
    checksum: str
    bytes: int
    # A DCP data file's records: fqn, path, offsets, sizes, global_shape, dtype, offset,
    # length, checksum and, where written by this longrun, data ([start, length] of the tensor's
    # bytes within the record: `records.py`) (`dcp_format.py`); None for other files.
    items: list[dict[str, Any]] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardInfo:
        """A file's entry as JSON holds it, of this longrun's manifests or of earlier ones."""
        data = dict(data)
        if "sha256" in data and "checksum" not in data:
            data["checksum"] = data.pop("sha256")
        info = cls(**data)
        # Checked here, once: every reader sums, compares and slices by these.
        if not isinstance(info.checksum, str) or not is_count(info.bytes) or \
                not (info.items is None or isinstance(info.items, list)):
            raise TypeError("a file's checksum, bytes or items are not a string, a count and a list")
        return info


@dataclass
class Manifest:
    step: int
    world_size: int
    dp_size: int
    model: dict[str, Any]  # the model section the weights were trained with
    config_fingerprint: str
    files: dict[str, ShardInfo] = field(default_factory=dict)
    created_unix: float = 0.0
    format: int = FORMAT_VERSION
    # The parallel degrees it was written at ({"dp", "fsdp", "cp", "tp", "pp"}); empty in
    # checkpoints from before sharded training, which were all written with whole weights.
    layout: dict[str, int] = field(default_factory=dict)
    # The tokenizer the model was trained with (config/vocabulary.py `tokenizer_record`: its
    # path or 'byte', and sha256), so an export can ship it; None in older checkpoints.
    tokenizer: dict[str, Any] | None = None
    # The job's data and training settings (config/identity.py `job_identity`), which a resume
    # must not change unsaid; None in checkpoints from before they were recorded.
    identity: dict[str, Any] | None = None
    # How many loss-spike rollbacks had fenced checkpoints off when the attempt that wrote it
    # started (`lineage.py`): a fence abandons the checkpoints at or after its step written at
    # an older lineage. 0 in checkpoints from before fences existed.
    lineage: int = 0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str = "manifest") -> Manifest:
        try:
            data = json.loads(raw)
            if data.get("format") not in _READABLE:
                raise ManifestError(f"{where}: format {data.get('format')!r}, "
                                    f"this longrun reads format {FORMAT_VERSION}")
            step_dir = posixpath.dirname(where) or "its step directory"
            data["files"] = {checked_member_name(k, step_dir, where): ShardInfo.from_dict(v)
                             for k, v in data["files"].items()}
            manifest = cls(**data)
            if not (isinstance(manifest.model, dict) and isinstance(manifest.layout, dict)
                    and isinstance(manifest.tokenizer, dict | None)):
                raise TypeError("its model, layout or tokenizer is not a mapping")
            return manifest
        except ManifestError:
            raise
        except UnsafeName as exc:  # "../x", "/etc/x": never joined to the step directory
            raise ManifestError(str(exc)) from None
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ManifestError(f"{where} is not a valid checkpoint manifest ({exc})") from None

    def incompatibility(self, model: dict[str, Any]) -> str | None:
        """Why this checkpoint cannot be loaded into a job with this model, or None. The
        parallel layout does not matter: the tensors restore at any layout."""
        if self.format < 2:
            return ("it was written by an earlier longrun (checkpoint format 1, whose pieces only "
                    "load at the layout that wrote them); resume it with that longrun")
        model, ours = _shape_of(model), _shape_of(self.model)
        if model != ours:
            diff = sorted(k for k in {*model, *ours} if model.get(k) != ours.get(k))
            shown = ", ".join(f"{k}: checkpoint {self.model.get(k)!r} vs job {model.get(k)!r}"
                              for k in diff)
            return f"the checkpoint holds a different model ({shown})"
        return None


class HashingWriter:
    """Wraps a binary file: everything written goes through the checksum and is counted."""

    def __init__(self, f: Any):
        self._f = f
        self._hash = checksum.hasher()
        self.bytes = 0
        # torch.save's zip writer replaces an exception from write() with its own opaque
        # "unexpected pos" error; the original (e.g. ENOSPC) is kept here to be re-raised.
        self.error: BaseException | None = None

    def write(self, data: bytes | memoryview) -> int:
        self._hash.update(data)
        self.bytes += len(data)
        try:
            return self._f.write(data)
        except BaseException as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self._f.flush()

    def info(self) -> ShardInfo:
        return ShardInfo(checksum.tagged(self._hash), self.bytes)


def stream_check(fs: Any, path: str, stored: str, chunk: int = 8 << 20,
                 expected: int | None = None) -> tuple[int, bool]:
    """(size, whether it matches `stored`) of a file read in chunks: never the whole file in
    memory; hashed with the algorithm that made `stored` (SHA-256 for old checkpoints). On a
    local disk a link or a FIFO at `path` is refused (UnsafePath: `stored.py`), never followed.
    A file whose size is not `expected` (when given) is not read at all."""
    with open_stored(fs, path) as f:
        return hash_check(f, stored, chunk, expected)


def hash_check(f: IO[bytes], stored: str, chunk: int = 8 << 20,
               expected: int | None = None) -> tuple[int, bool]:
    """`stream_check` of a file just opened."""
    size = size_of(f)
    if expected is not None and size is not None and size != expected:
        return size, False
    h, size = checksum.verifier(stored), 0
    while data := f.read(chunk):
        h.update(data)
        size += len(data)
    return size, checksum.matches(stored, h)
