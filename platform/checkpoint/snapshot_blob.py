"""What one rank's peer memory snapshot is, as bytes: a share of its shard, then its own values.

    plan = plan_snapshot(state, where, Part(index=1, count=2, ranks=(3, 7)))  # nothing copied yet
    staged = SnapshotBuffer().fill(plan)         # the host copy (on the CPU: `staged.copy()`)
    digest = chunk_digest(staged.blob())         # xxh3 per chunk, checked chunk by chunk on read
    state, where, header = read_parts(rank, get) # every part of the shard, verified, reassembled

The ranks of a replica group (dp x cp: `worker/setup.py`'s `Replicas`) hold the same model and
optimizer pieces. Their snapshots divide those among them instead of each sending all of it:
the model's and optimizer's tensors are laid out, in the state's order, in one "shared" region
(identical on every replica), and part i of n holds bytes [bounds[i], bounds[i+1]) of it.
Everything else (the step, the scheduler, the data position, the RNG streams, which differ per
rank) is the rank's "own" region and header. A blob is

    [its range of the shared region][own tensors][header][trailer]

each tensor slice `ALIGN`-aligned, so a reassembled shared region is viewed, not copied, into
the tensors. The header (`torch.save` of plain values) holds the state's structure, every
tensor's dtype, shape and place, where each DTensor piece sits in the whole (`sharding.py`), the
part's index and its replicas' ranks, and a fingerprint of the shared layout that every part of
a shard must share. A restore reads its own blob and its replicas' (`read_parts`): all of them
verified, or none of it is used.

Checksums are xxh3 per `CHUNK_BYTES` chunk (`checksum.py`), so a blob is sent, received and
verified a chunk at a time and no step needs the whole of it twice.
"""

from __future__ import annotations

import io
import json
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from longrun.checkpoint import checksum
from longrun.checkpoint.dcp_format import DCP_KEYS
from longrun.checkpoint.snapshot import HostCopy, map_tree

Blob = Any  # bytes-like: bytes, bytearray or a uint8 numpy array (what crosses Ray)
GetBlob = Callable[[int], tuple[Blob, str]]  # global rank -> (its snapshot blob, its digest)
# (the shared region with this rank's part in place, the parts' bounds, this rank's header) -> None,
# the other parts filled in
Exchange = Callable[[Tensor, list[int], dict[str, Any]], None]

ALIGN = 64  # every tensor's slice starts here: any dtype can view it
CHUNK_BYTES = 64 << 20  # the unit of checksums and of transfers to and from the keepers
MAGIC = b"LRSNAP02"
_TRAILER = struct.Struct("<Q8s")  # header length, magic
_TENSOR = "__longrun_snapshot_tensor__"  # a tensor's place in the header's structure
_CHUNKED = "chunks"  # a digest: "chunks/<chunk bytes>/<tagged digest>,<tagged digest>,..."


class SnapshotError(ValueError):
    """A memory snapshot that does not match its checksum or cannot be read."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Part:
    """Which share of its shard's model and optimizer bytes a rank's snapshot holds: `index`
    of `count`, among `ranks` (the replica group's global ranks, by part index; empty: alone)."""

    index: int = 0
    count: int = 1
    ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count or (self.ranks and len(self.ranks) != self.count):
            raise ValueError(f"part {self.index} of {self.count} among ranks {self.ranks}")


ALONE = Part()  # a shard no replica shares: the whole of it in one snapshot


def part_bounds(shared_bytes: int, count: int) -> list[int]:
    """Where each of `count` parts of a shared region starts (aligned), and its end."""
    return [shared_bytes * i // count // ALIGN * ALIGN for i in range(count)] + [shared_bytes]


@dataclass
class Plan:
    """What one snapshot holds, before anything is copied."""

    shared: list[tuple[Tensor, int]]  # (tensor, its offset in the shared region)
    own: list[tuple[Tensor, int]]  # (tensor, its offset in the own region)
    shared_bytes: int  # the whole shared region (every part of the shard)
    start: int  # this part's range of it
    end: int
    own_bytes: int
    header: bytes

    @property
    def own_at(self) -> int:
        return _aligned(self.end - self.start)

    @property
    def data_bytes(self) -> int:
        return self.own_at + self.own_bytes

    @property
    def nbytes(self) -> int:
        return self.data_bytes + len(self.header) + _TRAILER.size

    @property
    def whole_bytes(self) -> int:
        """What one rank holds of the state: the whole shared region and its own values."""
        return self.shared_bytes + self.own_bytes + len(self.header) + _TRAILER.size


def plan_snapshot(state: Any, where: dict[str, dict[str, Any]], part: Part = ALONE) -> Plan:
    """`state` (local tensors: `sharding.localize`) laid out as `part` of its shard's snapshot."""
    regions: dict[str, list[tuple[Tensor, int]]] = {"shared": [], "own": []}
    sizes = {"shared": 0, "own": 0}
    specs: list[dict[str, Any]] = []
    seen: dict[tuple, int] = {}

    def mark(path: str, t: Tensor) -> dict[str, int]:
        t = t.detach()
        # The model's and optimizer's tensors are the same on every replica; the rest is the rank's.
        region = "shared" if path.split("/")[1:2] and path.split("/")[1] in DCP_KEYS else "own"
        # Tied weights (the embedding doubling as the output layer) are views of one storage:
        # one slice, and the restored state names one tensor twice, as torch.save would.
        alias = (t.untyped_storage().data_ptr(), t.device, t.storage_offset(), tuple(t.shape),
                 t.stride(), t.dtype, region)
        if alias not in seen or t.numel() == 0:
            seen[alias] = len(specs)
            nbytes = t.numel() * t.element_size()
            regions[region].append((t, sizes[region]))
            specs.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                          "region": region, "offset": sizes[region], "bytes": nbytes})
            sizes[region] += _aligned(nbytes)
        return {_TENSOR: seen[alias]}

    tree = map_tree(state, mark)
    bounds = part_bounds(sizes["shared"], part.count)
    layout = [(s["dtype"], s["shape"], s["offset"]) for s in specs if s["region"] == "shared"]
    header = {"state": tree, "tensors": specs, "where": where, "part": [part.index, part.count],
              "replicas": list(part.ranks), "shared_bytes": sizes["shared"],
              "range": [bounds[part.index], bounds[part.index + 1]],
              "layout": checksum.digest(json.dumps(layout).encode())}
    buf = io.BytesIO()
    torch.save(header, buf)
    return Plan(regions["shared"], regions["own"], sizes["shared"], bounds[part.index],
                bounds[part.index + 1], sizes["own"], buf.getvalue())


def _bytes_of(t: Tensor) -> Tensor:
    """`t`'s bytes as a flat uint8 tensor (a view where `t` is contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


@dataclass
class Staged(HostCopy):
    """A snapshot being copied into its buffer: on a GPU on a side stream (`_event`), on the
    CPU by whoever calls `copy()` (the send thread: the copy overlaps the next step's forward
    and backward). `wait()` returns once the copy is done; `blob()` is the bytes."""

    flat: Tensor
    nbytes: int

    def blob(self) -> Blob:
        """The snapshot's bytes, a view of the buffer (valid until the next `fill`)."""
        self.wait()
        return self.flat[:self.nbytes].numpy()


class SnapshotBuffer:
    """One flat host buffer, reused by every snapshot of the same size (pinned for GPU state)."""

    def __init__(self) -> None:
        self._flat: Tensor | None = None
        self._stream: torch.cuda.Stream | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self._flat is None else self._flat.numel()

    def fill(self, plan: Plan, *, defer: bool = False) -> Staged:
        """Copy `plan`'s bytes into the buffer: now on the CPU unless `defer` (then by
        `Staged.copy()`), on a side stream for GPU state."""
        on_gpu = any(t.is_cuda for t, _ in plan.shared + plan.own)
        if self._flat is None or self._flat.numel() != plan.nbytes or self._flat.is_pinned() != on_gpu:
            self._flat = None  # the old buffer goes before the new one comes
            # Exactly the size used; pinned makes the device-to-host copy asynchronous.
            self._flat = torch.empty(plan.nbytes, dtype=torch.uint8, pin_memory=on_gpu)
        flat = self._flat

        def copy_all() -> None:
            for src, offset in plan.shared:  # the part of each tensor inside this part's range
                lo, hi = max(plan.start, offset), min(plan.end, offset + src.numel() * src.element_size())
                if lo < hi:
                    if src.is_cuda:
                        src.record_stream(torch.cuda.current_stream())
                    flat[lo - plan.start:hi - plan.start].copy_(_bytes_of(src)[lo - offset:hi - offset],
                                                                non_blocking=src.is_cuda)
            for src, offset in plan.own:
                if src.numel():
                    start = plan.own_at + offset
                    dst = flat[start:start + src.numel() * src.element_size()].view(src.dtype).view(src.shape)
                    dst.copy_(src, non_blocking=src.is_cuda)
            tail = plan.header + _TRAILER.pack(len(plan.header), MAGIC)
            flat[plan.data_bytes:].copy_(torch.frombuffer(bytearray(tail), dtype=torch.uint8))

        if not on_gpu:
            if defer:
                return Staged(flat, plan.nbytes, _copy=copy_all)
            copy_all()
            return Staged(flat, plan.nbytes)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        # The side stream must see every kernel that produced the state (the optimizer step).
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            copy_all()
            event = torch.cuda.Event()
            event.record(self._stream)
        return Staged(flat, plan.nbytes, _event=event)

    def release(self) -> None:
        self._flat = None


# -- checksums -----------------------------------------------------------------------------------
def chunk_digest(blob: Blob, chunk_bytes: int = CHUNK_BYTES) -> str:
    """The blob's digest: xxh3 of each `chunk_bytes` chunk, so each is checked as it arrives."""
    view = memoryview(blob).cast("B")
    parts = [checksum.digest(view[i:i + chunk_bytes]) for i in range(0, max(len(view), 1), chunk_bytes)]
    return f"{_CHUNKED}/{chunk_bytes}/{','.join(parts)}"


def chunk_digests(digest: str) -> tuple[int | None, list[str]]:
    """(chunk size, each chunk's digest) of a blob's digest; (None, [digest]) for a digest of
    the whole blob in one."""
    if not digest.startswith(_CHUNKED + "/"):
        return None, [digest]
    _, size, parts = digest.split("/", 2)
    return int(size), parts.split(",")


def check_chunk(data: Blob, stored: str, where: str = "") -> None:
    """Raise SnapshotError unless `data` is what `stored` (one chunk's digest) was made from."""
    h = checksum.verifier(stored)
    h.update(memoryview(data).cast("B"))
    if not checksum.matches(stored, h):
        raise SnapshotError(f"the snapshot does not match its checksum{where}")


def verify(blob: Blob, digest: str) -> None:
    """Check every chunk of `blob` against `digest`; SnapshotError when one differs."""
    view = memoryview(blob).cast("B")
    size, parts = chunk_digests(digest)
    size = size or max(len(view), 1)
    if len(parts) != max(-(-len(view) // size), 1):
        raise SnapshotError(f"the snapshot does not match its checksum ({len(view)} bytes, "
                            f"{len(parts)} chunks of {size})")
    for i, stored in enumerate(parts):
        check_chunk(view[i * size:(i + 1) * size], stored, f" (chunk {i})" if len(parts) > 1 else "")


# -- reading -------------------------------------------------------------------------------------
def read_header(blob: Blob) -> dict[str, Any]:
    view = memoryview(blob).cast("B")
    try:
        header_len, magic = _TRAILER.unpack(view[len(view) - _TRAILER.size:])
        if magic != MAGIC:
            raise ValueError("not a longrun memory snapshot")
        start = len(view) - _TRAILER.size - header_len
        return torch.load(io.BytesIO(view[start:start + header_len].tobytes()), map_location="cpu",
                          weights_only=True)
    except Exception as exc:
        raise SnapshotError(f"the snapshot cannot be read ({type(exc).__name__}: {exc})") from exc


def _view(blob: Blob, offset: int, nbytes: int) -> Tensor:
    with warnings.catch_warnings():  # a read-only buffer: what is kept is copied out of it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(memoryview(blob).cast("B"), dtype=torch.uint8, count=nbytes, offset=offset)


def read_parts(rank: int, get: GetBlob, *, full: bool | None = True, verified: bool = False,
               exchange: Exchange | None = None
               ) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, Any]]:
    """(state, where, header) of `rank`'s snapshot: its own blob and, when its shard is divided
    among replicas, theirs (`get(global rank)` -> (blob, digest)), each verified unless
    `verified` (`get` checked them as they came) and checked to be parts of one layout. Shared
    tensors are views of one reassembled region. `full=False` reads the rank's own blob only,
    its shared tensors left on the meta device (what a commit needs of a replica's state);
    `full=None` reads the replicas' parts only for part 0 (the replica that writes them).
    `exchange(shared, bounds, header)`: instead of getting the replicas' blobs, the rank's own
    part is placed in the shared region and `exchange` fills in the others' (the replicas, each
    holding its own part, swap them over their group: worker/snapshots.py); `get` is then asked
    for this rank's blob only."""
    blob, digest = get(rank)
    if not verified:
        verify(blob, digest)
    header = read_header(blob)
    index, count = header["part"]
    shared: Tensor | None = None
    if full or (full is None and index == 0):
        shared = torch.empty(header["shared_bytes"], dtype=torch.uint8)
        bounds = part_bounds(header["shared_bytes"], count)
        if exchange is not None:
            lo, hi = bounds[index], bounds[index + 1]
            if hi > lo:
                shared[lo:hi].copy_(_view(blob, 0, hi - lo))
            exchange(shared, bounds, header)
        else:
            for i in range(count):
                other, other_header = blob, header
                if i != index:
                    peer = header["replicas"][i]
                    other, other_digest = get(peer)
                    if not verified:
                        verify(other, other_digest)
                    other_header = read_header(other)
                    step = other_header["state"].get("step")
                    if [other_header[k] for k in ("part", "shared_bytes", "layout")] != [[i, count],
                            header["shared_bytes"], header["layout"]] or step != header["state"].get("step"):
                        raise SnapshotError(f"rank {peer}'s snapshot is not part {i} of rank {rank}'s "
                                            f"(step {step}, part "
                                            f"{other_header['part']})")
                lo, hi = bounds[i], bounds[i + 1]
                if hi > lo:
                    shared[lo:hi].copy_(_view(other, 0, hi - lo))
    own_at = _aligned(header["range"][1] - header["range"][0])
    tensors = [_tensor(spec, blob, own_at, shared) for spec in header["tensors"]]

    def unmark(node: Any) -> Any:
        if isinstance(node, dict):
            if set(node) == {_TENSOR}:
                return tensors[node[_TENSOR]]
            return {k: unmark(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            items = [unmark(v) for v in node]
            return items if isinstance(node, list) else tuple(items)
        return node

    return unmark(header["state"]), header["where"], header


def _tensor(spec: dict[str, Any], blob: Blob, own_at: int, shared: Tensor | None) -> Tensor:
    dtype = getattr(torch, spec["dtype"])
    if not isinstance(dtype, torch.dtype):
        raise SnapshotError(f"unknown dtype {spec['dtype']!r}")
    if spec["region"] == "shared" and shared is None:
        return torch.empty(spec["shape"], dtype=dtype, device="meta")
    if spec["bytes"] == 0:
        return torch.empty(spec["shape"], dtype=dtype)
    if spec["region"] == "shared":  # the reassembled region is ours and aligned: a view
        raw = shared[spec["offset"]:spec["offset"] + spec["bytes"]]
    else:
        raw = _view(blob, own_at + spec["offset"], spec["bytes"]).clone()  # its own, aligned memory
    return raw.view(dtype).view(spec["shape"])


def serialize(state: Any, where: dict[str, dict[str, Any]] | None = None,
              part: Part = ALONE) -> tuple[bytes, str]:
    """A snapshot of `state` (local tensors) as bytes, and its digest (tests, tools)."""
    blob = bytes(SnapshotBuffer().fill(plan_snapshot(state, where or {}, part)).blob())
    return blob, chunk_digest(blob)


def open_snapshot(blob: Blob, digest: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(the state, where its DTensor pieces sit) of a snapshot that is its shard's only part,
    verified first (a snapshot is checked before use, as a checkpoint shard is)."""
    verify(blob, digest)
    if read_header(blob)["part"][1] != 1:
        raise SnapshotError("this snapshot is one part of its shard: read it with its replicas' (read_parts)")
    state, where, _ = read_parts(0, lambda _rank: (blob, digest), verified=True)
    return state, where


def read_snapshot(blob: Blob, digest: str) -> dict[str, Any]:
    """The state in `blob` (tensors of their own, on the CPU), after checking it against `digest`."""
    return open_snapshot(blob, digest)[0]
