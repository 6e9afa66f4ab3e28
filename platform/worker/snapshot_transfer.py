"""Peer memory snapshots over Ray, a chunk at a time: to the keepers and back.

    send = snapshot_sender(rank, ["keeper-a", "keeper-b"], timeout_s=30)   # send(step, blob, digest)
    snapshot, problems = fetch_snapshot(rank, step, keepers)   # every part of its shard, verified

A send puts one chunk (the digest's chunk size, `checkpoint/snapshot_blob.py`) into the object
store and hands it to both keepers, with at most `WINDOW` chunks in flight: the object store
holds a few chunks of a snapshot at a time, never a second whole copy, and the keepers copy each
chunk into place as it lands. A keeper that takes no chunk for `timeout_s` fails the send
(`SendTimeout`): the snapshot is lost, training is not held (`checkpoint/memory.py`). A keeper
that dies is left out and the send goes on to the others, so one lost keeper costs neither this
snapshot nor the rest of the attempt's; the next sends look it up again, and reach the new keeper
the controller starts in its place.

A fetch reads a blob back the same way, checking each chunk's xxh3 as it lands, from the first
keeper that holds a good copy (this node's, then the peer's); `fetch_snapshot` fetches a
rank's own blob and, where its shard's bytes are divided among replicas, each replica's part.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayActorError

from longrun.checkpoint.snapshot_blob import (
    CHUNK_BYTES,
    Blob,
    SnapshotError,
    check_chunk,
    chunk_digests,
    read_parts,
)
from longrun.controller.snapshot_keeper import KEEPER_NAMESPACE

log = logging.getLogger(__name__)

WINDOW = 4  # chunks in flight per send or fetch, at most
# A send keeps at most this share of its node's Ray object store in flight: a keeper's node also
# takes chunks from the ranks of the node before it, and a store past 80% spills to disk while
# the put that filled it waits. Ray's test clusters give a node 150 MiB; a real one, 30% of RAM.
STORE_SHARE = 1 / 8
FETCH_TIMEOUT_S = 120.0


class SendTimeout(RuntimeError):
    """A keeper did not take a snapshot's chunk in time (the snapshot is dropped)."""


class KeepersGone(RuntimeError):
    """Every keeper a rank sends to is gone: its snapshots are off until the next attempt."""


class SnapshotUnavailable(RuntimeError):
    """No keeper has a good copy of some rank's snapshot."""


def transfer_sizes(store_bytes: int | None) -> tuple[int, int]:
    """(bytes per chunk, chunks in flight) for sends through a node whose Ray object store holds
    `store_bytes` (None: not known, the largest): at most STORE_SHARE of the store in flight,
    in whole MiB chunks of at most CHUNK_BYTES."""
    if not store_bytes:
        return CHUNK_BYTES, WINDOW
    budget = int(store_bytes * STORE_SHARE)
    chunk = min(CHUNK_BYTES, max(1 << 20, (budget // WINDOW) >> 20 << 20))
    return chunk, max(1, min(WINDOW, budget // chunk))


def node_object_store_bytes() -> int | None:
    """The capacity of this process's node's Ray object store (None when Ray does not say, or
    this process is not connected to Ray: asking would start a Ray of its own)."""
    if not ray.is_initialized():
        return None
    try:
        node = ray.get_runtime_context().get_node_id()
        for info in ray.nodes():
            if info.get("NodeID") == node:
                return int(info.get("Resources", {}).get("object_store_memory", 0)) or None
    except Exception:  # sizes are a tuning: an unanswered question leaves the defaults
        log.debug("the node's object store size is unknown", exc_info=True)
    return None


def snapshot_sender(rank: int, targets: list[str], timeout_s: float | None = None, window: int = WINDOW):
    """send(step, blob, digest) to the keepers named `targets`; raises SendTimeout when they take
    no chunk within `timeout_s` (a slow keeper never holds the sender for long).

    A keeper that is gone (killed, or lost with its node) is left out, from the chunk where its
    death shows: the others still get every chunk, so the snapshot is whole on them and a later
    restore finds it there. Each send looks a missing keeper up again by its name, which the
    controller gives a new keeper within seconds (`Keepers.revive`), so sends reach it again.
    Only when none can be reached does a send fail (`KeepersGone`); a rank whose keepers
    cannot all be found at first sends to those that can."""
    keepers: dict[str, Any] = {}

    def look_up(name: str, *, first: bool) -> None:
        try:
            keepers[name] = ray.get_actor(name, namespace=KEEPER_NAMESPACE)
        except ValueError as exc:  # Ray's word for a named actor it cannot find
            if first:
                log.warning("snapshot keeper %s not found (%s); rank %d sends to the others", name, exc, rank)
            return
        if not first:
            log.info("snapshot keeper %s is back; rank %d sends to it again", name, rank)

    for name in targets:
        look_up(name, first=True)
    if not keepers:
        raise ValueError(f"none of rank {rank}'s snapshot keepers ({', '.join(targets)}) could be found")

    def send(step: int, blob: Blob, digest: str) -> None:
        for name in targets:
            if name not in keepers:
                look_up(name, first=False)
        if not keepers:
            raise KeepersGone(f"every snapshot keeper of rank {rank} is gone ({', '.join(targets)})")
        data = np.frombuffer(memoryview(blob).cast("B"), dtype=np.uint8)
        size = chunk_digests(digest)[0] or max(data.size, 1)
        pending: dict[Any, str] = {}  # a chunk's put -> the keeper it goes to
        try:
            for offset in range(0, data.size, size):
                ref = ray.put(data[offset:offset + size])  # one copy in the object store, read by all
                for name, keeper in list(keepers.items()):
                    pending[keeper.put_chunk.remote(rank, step, offset, ref, data.size, digest)] = name
                _settle(pending, keepers, window * len(keepers), timeout_s, rank)
            _settle(pending, keepers, 0, timeout_s, rank)
        except SendTimeout:
            for put in pending:  # not waited on any more; a late chunk is ignored by its keeper
                with contextlib.suppress(Exception):  # already running: it may still land
                    ray.cancel(put)
            raise
    return send


def _settle(pending: dict[Any, str], keepers: dict[str, Any], keep: int, timeout_s: float | None,
            rank: int) -> None:
    """Wait until at most `keep` of `pending` are unfinished; a keeper's error is raised, except
    its death, which leaves it out of `keepers` (and its chunks out of `pending`)."""
    while len(pending) > keep:
        done, _ = ray.wait(list(pending), num_returns=len(pending) - keep, timeout=timeout_s)
        if not done:
            raise SendTimeout(f"the keepers took no chunk within {timeout_s:g} s")
        for ref in done:
            name = pending.pop(ref, None)
            if name is None:  # a chunk of a keeper left out since ray.wait returned
                continue
            try:
                ray.get(ref)
            except RayActorError as exc:
                if keepers.pop(name, None) is not None:
                    log.warning("snapshot keeper %s is gone (%s); rank %d sends to %s from now on", name,
                                type(exc).__name__, rank, ", ".join(keepers) or "none")
                for other in [r for r, n in pending.items() if n == name]:
                    del pending[other]
        if not keepers:
            raise KeepersGone(f"every snapshot keeper of rank {rank} is gone")


def fetch_blob(rank: int, step: int, names: list[str]) -> tuple[tuple[np.ndarray, str] | None, list[str]]:
    """(rank `rank`'s snapshot blob of `step` and its digest, read and verified chunk by chunk
    from the first of the keepers `names` with a good copy, or None; the problems met)."""
    problems = []
    for name in names:
        try:
            started = time.perf_counter()
            got = _fetch_from(ray.get_actor(name, namespace=KEEPER_NAMESPACE), rank, step)
            took = time.perf_counter() - started
            megabytes = got[0].size / 1e6
            log.info("rank %d's snapshot of step %d fetched from %s: %.0f MB in %.2f s (%.0f MB/s)", rank,
                     step, name, megabytes, took, megabytes / max(took, 1e-9))
            return got, problems
        except Exception as exc:  # a keeper gone with its node, a checksum off: the next copy
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
    return None, problems


def _fetch_from(keeper, rank: int, step: int) -> tuple[np.ndarray, str]:
    nbytes, digest = ray.get(keeper.describe.remote(rank, step), timeout=FETCH_TIMEOUT_S)
    size, parts = chunk_digests(digest)
    size = size or max(nbytes, 1)
    offsets = range(0, nbytes, size)
    if len(parts) != max(len(offsets), 1):
        raise SnapshotError(f"the snapshot does not match its checksum ({nbytes} bytes, {len(parts)} chunks)")
    out = np.empty(nbytes, dtype=np.uint8)
    queue: deque = deque()
    ahead = iter(offsets)
    for offset in ahead:  # the window's first requests
        queue.append((offset, keeper.get_chunk.remote(rank, step, offset, size)))
        if len(queue) == WINDOW:
            break
    while queue:
        offset, ref = queue.popleft()
        chunk = ray.get(ref, timeout=FETCH_TIMEOUT_S)
        check_chunk(chunk, parts[offset // size], f" (chunk {offset // size})")
        out[offset:offset + len(chunk)] = chunk
        following = next(ahead, None)
        if following is not None:
            queue.append((following, keeper.get_chunk.remote(rank, step, following, size)))
    return out, digest


def preferred_first(names: list[str], prefer: str | None) -> list[str]:
    """`names` with `prefer` (a rank's own node's keeper) moved to the front, if among them."""
    return [prefer] + [n for n in names if n != prefer] if prefer in names else list(names)


def blob_getter(step: int, keepers: dict[str, list[str]], problems: list[str],
                prefer: str | None = None) -> Callable[[int], tuple[np.ndarray, str]]:
    """`read_parts`' `get`: rank r's verified blob of `step` from the keepers holding it
    (`keepers`: str(rank) -> names; `prefer` tried first), each problem met added to `problems`;
    SnapshotUnavailable when none has a good copy."""
    def get(r: int) -> tuple[np.ndarray, str]:
        got, tried = fetch_blob(r, step, preferred_first(keepers.get(str(r), []), prefer))
        problems.extend(tried)
        if got is None:
            raise SnapshotUnavailable(f"rank {r}'s snapshot of step {step}: "
                                      + ("; ".join(tried) or "no keeper holds it"))
        return got
    return get


def fetch_snapshot(rank: int, step: int, keepers: dict[str, list[str]], *, full: bool | None = True,
                   prefer: str | None = None) -> tuple[dict[str, Any] | None, list[str]]:
    """Rank `rank`'s snapshot of `step` ({"state", "where", "part"}) from the keepers holding
    each rank's (`keepers`: str(rank) -> names; `prefer`'s copy tried first), its replicas'
    parts as `read_parts`' `full` says; (None, the problems) when some part has no good copy."""
    problems: list[str] = []
    try:
        state, where, header = read_parts(rank, blob_getter(step, keepers, problems, prefer), full=full,
                                          verified=True)
    except SnapshotUnavailable:
        return None, problems
    except Exception as exc:  # parts that do not fit together
        return None, [*problems, f"{type(exc).__name__}: {exc}"]
    return {"state": state, "where": where, "part": header["part"][0]}, problems
