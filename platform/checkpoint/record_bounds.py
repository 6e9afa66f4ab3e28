"""What a manifest's records may claim, checked before anything is allocated for them.

A restore or an export allocates each record's tensor (`record_read.py`) and each whole tensor
(`resharding.read_whole`; the optimizer state a job lacks, `restore.extra_buffers`) from the
shapes the manifest gives, before a byte is read. A damaged or hostile manifest could name any
shape (`[2**40, 4096]`) and have that allocation exhaust the host's memory. So a record must fit
what the manifest itself says of its file: its tensor's bytes (shape times dtype) lie inside the
record, the record inside its file's `bytes`, and no two records of a file overlap. The pieces
of a whole tensor cover it exactly once (`dcp_format.coverage_problem`), so nothing allocated
exceeds the files' bytes; the readers compare those with the files on storage before they
allocate (`record_read.py`).
"""

from __future__ import annotations

import math
from typing import Any

_LARGEST = (1 << 63) - 1  # what a torch.Size (int64) holds


def is_count(value: Any) -> bool:
    """Whether `value` is an int (not a bool) a byte count or a dimension may be."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _LARGEST


def _counts(value: Any) -> bool:
    return isinstance(value, list) and all(is_count(v) for v in value)


def record_problem(item: dict[str, Any], file_bytes: int, itemsize: int) -> str | None:
    """Why the manifest record `item` (`ShardInfo.items`, of a tensor whose dtype is `itemsize`
    bytes) does not fit in a file of `file_bytes` bytes (a phrase), or None."""
    offset, length = item.get("offset"), item.get("length")
    if not (is_count(offset) and is_count(length)):
        return f"has no byte offset and length (offset {offset!r}, length {length!r})"
    if offset + length > file_bytes:
        return f"reaches byte {offset + length} of a file the manifest says holds {file_bytes}"
    sizes, offsets, shape = item.get("sizes"), item.get("offsets"), item.get("global_shape")
    if not (_counts(sizes) and _counts(offsets) and _counts(shape)) or \
            not len(sizes) == len(offsets) == len(shape):
        return (f"has a shape that is not a list of counts (sizes {sizes!r}, offsets {offsets!r}, "
                f"global_shape {shape!r})")
    nbytes = math.prod(sizes) * itemsize
    data = item.get("data")
    if data is None:  # an older record, read whole: it holds its tensor's bytes and more
        room = length
    elif isinstance(data, list) and len(data) == 2 and _counts(data) and data[0] + data[1] <= length:
        room = data[1]
        if nbytes != room:
            return f"is a {tuple(sizes)} tensor of {nbytes} bytes, but says its data holds {room}"
    else:
        return f"places its data at {data!r}, outside its {length} bytes"
    if nbytes > room:
        return f"is a {tuple(sizes)} tensor of {nbytes} bytes, more than its record's {room}"
    return None


def overlap_problem(items: list[dict[str, Any]]) -> str | None:
    """Why the records of one file (each passed `record_problem`) are not disjoint, or None."""
    end = 0
    for item in sorted(items, key=lambda i: i["offset"]):
        if item["offset"] < end:
            return f"has records that overlap at byte {item['offset']}"
        end = item["offset"] + item["length"]
    return None
