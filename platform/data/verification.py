"""The verification mark of a prepared directory: which shard files are known to match their
sha256, so that opening the directory for training hashes nothing.

    verified.json    {"format": "longrun-tokens-verified/1", "manifest_sha256": "...",
                      "by": "data prepare", "files": {"shard-00000.bin": [size, mtime_ns], ...}}

Hashing every shard at every start makes start-up grow with the data set (a few hundred GB
is minutes of reading on every rank of every attempt). A data set is verified once instead:
`data prepare` hashes what it writes (and re-hashes what it resumes), `data inspect --verify`
hashes everything; each records this mark. The mark is keyed by the sha256 of the manifest's
bytes (a re-prepared directory is a different data set) and stamps every file with its size
and modification time: a file written since no longer matches its stamp and is verified again
when a rank first reads from it (`TokenShards`, verify="lazy"). Corruption that keeps a
file's size and mtime (bit rot) is what `data inspect --verify` is for.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from longrun.safe_files import replace_file

MARK = "verified.json"
MARK_FORMAT = "longrun-tokens-verified/1"

Stamps = dict[str, list[int]]  # file name -> [size, mtime_ns]


def stamp(st: os.stat_result) -> list[int]:
    return [int(st.st_size), int(st.st_mtime_ns)]


def manifest_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def shard_stamps(directory: str | os.PathLike, manifest: dict[str, Any]) -> Stamps:
    """The stamps of every file the manifest lists, as they are on disk now."""
    directory = Path(directory)
    return {f"{e['name']}{suffix}": stamp(os.stat(directory / f"{e['name']}{suffix}"))
            for e in manifest["shards"] for suffix in (".bin", ".idx")}


def read_mark(directory: str | os.PathLike, manifest_digest: str) -> Stamps:
    """The stamps recorded for this manifest; empty when there is no mark, or it is of another
    manifest, or unreadable (then everything is verified as it is read: never a false trust)."""
    try:
        mark = json.loads((Path(directory) / MARK).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if (not isinstance(mark, dict) or mark.get("format") != MARK_FORMAT
            or mark.get("manifest_sha256") != manifest_digest or not isinstance(mark.get("files"), dict)):
        return {}
    return {str(k): list(v) for k, v in mark["files"].items() if isinstance(v, list)}


def write_mark(directory: str | os.PathLike, manifest_digest: str, stamps: Stamps, *, by: str) -> None:
    """Record that the files of `stamps` match the manifest of `manifest_digest`; atomically
    (a reader sees the old mark or the new one), so a crash never leaves a partial trust."""
    directory = Path(directory)
    mark = {"format": MARK_FORMAT, "manifest_sha256": manifest_digest, "by": by, "files": stamps}
    replace_file(directory / MARK, json.dumps(mark, indent=1, sort_keys=True) + "\n")
