"""What a committed checkpoint holds: its shard files, their checksums, and what they fit.

A checkpoint is split by what is replicated. The ranks of a replica group (data-parallel
replicas and CP ranks) hold the same piece of the model, optimizer and LR schedule, so one rank
per group writes it once (`model-NNNNN.pt`: one file per piece, `model-00000.pt` alone where
every rank holds whole weights; under FSDP and tensor parallelism one per shard, holding only
that shard and where it sits in the whole) and recovery reads it once and broadcasts; every
rank writes its own small `rank-NNNNN.pt` (sampler position, RNG streams).

The manifest is JSON, written last: the shard list with SHA-256 and sizes, the step, the
config fingerprint, and the model and parallel layout the shards fit, so a mismatched restore
is refused with a message instead of failing deep inside `load_state_dict`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT_VERSION = 1
REPLICATED_KEYS = ("step", "model", "optimizer", "scheduler")  # equal on every DP rank
PER_RANK_KEYS = ("step", "data", "rng")  # this rank's own


def model_shard_name(index: int = 0) -> str:
    return f"model-{index:05d}.pt"


def rank_shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def split_state(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A trainer state -> (replicated part, per-rank part)."""
    missing = [k for k in {*REPLICATED_KEYS, *PER_RANK_KEYS} if k not in state]
    if missing:
        raise KeyError(f"the training state lacks {sorted(missing)}")
    return ({k: state[k] for k in REPLICATED_KEYS}, {k: state[k] for k in PER_RANK_KEYS})


_PIECES = ("fsdp", "tp", "pp")  # the degrees that cut the weights into pieces


def _shown(layout: dict[str, int]) -> str:
    return " x ".join(f"{k} {layout.get(k, 1)}" for k in ("dp", "fsdp", "cp", "tp", "pp"))


# Model fields that say where the weights started, not what they are: a job resumes from its
# checkpoint whatever they say (and checkpoints from before they existed lack them).
_NOT_THE_SHAPE = ("init_from",)


def _shape_of(model: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in model.items() if k not in _NOT_THE_SHAPE}


class ManifestError(ValueError):
    """A manifest that is missing, truncated or not one of ours."""


@dataclass
class ShardInfo:
    sha256: str
    bytes: int


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

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str = "manifest") -> Manifest:
        try:
            data = json.loads(raw)
            if data.get("format") != FORMAT_VERSION:
                raise ManifestError(f"{where}: format {data.get('format')!r}, "
                                    f"this longrun reads format {FORMAT_VERSION}")
            data["files"] = {k: ShardInfo(**v) for k, v in data["files"].items()}
            return cls(**data)
        except ManifestError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ManifestError(f"{where} is not a valid checkpoint manifest ({exc})") from None

    def incompatibility(self, model: dict[str, Any], world_size: int, dp_size: int,
                        layout: dict[str, int] | None = None) -> str | None:
        """Why these shards cannot be loaded into a job with this model and layout, or None."""
        model, ours = _shape_of(model), _shape_of(self.model)
        if model != ours:
            diff = sorted(k for k in {*model, *ours} if model.get(k) != ours.get(k))
            shown = ", ".join(f"{k}: checkpoint {self.model.get(k)!r} vs job {model.get(k)!r}"
                              for k in diff)
            return f"the checkpoint holds a different model ({shown})"
        # Older checkpoints record no layout: they were all written with whole weights.
        if layout is not None and any(self.layout.get(k, 1) != layout.get(k, 1) for k in _PIECES):
            return (f"the checkpoint's weights are in pieces for {_shown(self.layout)}; this job "
                    f"runs {_shown(layout)}; resharding is not supported, run with the same layout")
        if (world_size, dp_size) != (self.world_size, self.dp_size):
            return (f"the checkpoint was written by {self.world_size} ranks (dp {self.dp_size}); "
                    f"this job has {world_size} (dp {dp_size}); resharding is not supported, "
                    "run with the same layout")
        return None


class HashingWriter:
    """Wraps a binary file: everything written goes through SHA-256 and is counted."""

    def __init__(self, f: Any):
        self._f = f
        self._hash = hashlib.sha256()
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
        return ShardInfo(self._hash.hexdigest(), self.bytes)


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stream_sha256(fs: Any, path: str, chunk: int = 8 << 20) -> tuple[int, str]:
    """(size, SHA-256) of a file read in chunks: never the whole file in memory."""
    digest, size = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while data := f.read(chunk):
            digest.update(data)
            size += len(data)
    return size, digest.hexdigest()
