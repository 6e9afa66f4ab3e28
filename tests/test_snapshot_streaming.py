"""Peer memory snapshots at real size (issue 39), without Ray: a shard's bytes divided among its
replicas and reassembled bitwise, every chunk checked with xxh3, and keepers that take chunks of
many ranks at once, in any order, holding a bounded number of buffers per rank."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from longrun.checkpoint.memory import SnapshotError, open_snapshot
from longrun.checkpoint.snapshot_blob import Part, chunk_digest, read_header, read_parts, serialize, verify
from longrun.controller.snapshot_keeper import KEEP_STEPS, SnapshotKeeper

REPLICAS = (10, 11, 12)  # the global ranks of one replica group


def _state(rank: int, step: int = 5, scale: float = 1.0) -> dict:
    """What a rank of a replica group holds: the same model and optimizer as its replicas (a
    tied weight among them), its own RNG."""
    emb = torch.arange(1000.0).reshape(100, 10) * scale
    return {"step": step,
            "model": {"emb": emb, "out": emb, "norm": torch.ones(10, dtype=torch.bfloat16)},
            "optimizer": {"state": {"emb": {"exp_avg": emb / 3, "step": torch.tensor(5.0)}},
                          "param_groups": [{"lr": 0.1, "params": ["emb"]}]},
            "rng": {"torch": torch.full((7,), rank, dtype=torch.uint8)}}


def _parts(step: int = 5) -> dict[int, tuple[bytes, str]]:
    return {r: serialize(_state(r, step), part=Part(i, len(REPLICAS), REPLICAS))
            for i, r in enumerate(REPLICAS)}


def test_replicas_divide_their_shard_and_each_reassembles_it_bitwise():
    blobs = _parts()
    headers = {r: read_header(blob) for r, (blob, _) in blobs.items()}
    shared = headers[10]["shared_bytes"]
    # One copy of the model and optimizer among the three, not three.
    assert sum(h["range"][1] - h["range"][0] for h in headers.values()) == shared
    whole = len(serialize(_state(10))[0])
    assert sum(len(blob) for blob, _ in blobs.values()) < 1.5 * whole  # each with its own values
    for rank in REPLICAS:
        state, _, header = read_parts(rank, blobs.__getitem__)
        want = _state(rank)
        assert header["part"] == [REPLICAS.index(rank), 3]
        for key in ("emb", "norm"):
            got = state["model"][key]
            assert got.dtype == want["model"][key].dtype and torch.equal(got, want["model"][key])
        assert state["model"]["out"] is state["model"]["emb"]  # tied, as torch.save keeps them
        moments = state["optimizer"]["state"]["emb"], want["optimizer"]["state"]["emb"]
        assert all(torch.equal(moments[0][k], moments[1][k]) for k in ("exp_avg", "step"))
        assert state["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
        assert torch.equal(state["rng"]["torch"], want["rng"]["torch"])  # its own streams


def test_a_rank_alone_needs_only_its_own_blob_and_a_part_needs_its_replicas():
    blob, digest = serialize(_state(0))
    assert torch.equal(open_snapshot(blob, digest)[0]["model"]["emb"], _state(0)["model"]["emb"])
    part, part_digest = _parts()[11]
    with pytest.raises(SnapshotError, match="one part of its shard"):
        open_snapshot(part, part_digest)
    # A commit's reader of a replica that writes nothing: its own values, the shared ones shapes only.
    state, _, _ = read_parts(11, {11: (part, part_digest)}.__getitem__, full=None)
    assert state["model"]["emb"].is_meta and torch.equal(state["rng"]["torch"], _state(11)["rng"]["torch"])


def test_parts_of_other_steps_or_layouts_do_not_reassemble():
    blobs = _parts()
    blobs[12] = _parts(step=6)[12]  # a replica's part of another step
    with pytest.raises(SnapshotError, match="rank 12's snapshot is not part 2"):
        read_parts(10, blobs.__getitem__)
    blobs = _parts()
    other = {"step": 5, "model": {"emb": torch.zeros(99, 10)}, "optimizer": {}, "rng": {}}
    blobs[11] = serialize(other, part=Part(1, 3, REPLICAS))
    with pytest.raises(SnapshotError, match="not part 1"):
        read_parts(10, blobs.__getitem__)


def test_every_chunk_is_checked():
    blob, _ = serialize(_state(0))
    digest = chunk_digest(blob, chunk_bytes=1024)
    assert digest.startswith("chunks/1024/xxh3_128:") and digest.count(",") == -(-len(blob) // 1024) - 1
    verify(blob, digest)
    bad = bytearray(blob)
    bad[3000] ^= 1
    with pytest.raises(SnapshotError, match=r"does not match its checksum \(chunk 2\)"):
        verify(bad, digest)
    with pytest.raises(SnapshotError, match="does not match its checksum"):
        verify(blob[:-1], digest)


def _send(keeper: SnapshotKeeper, rank: int, step: int, blob: bytes, size: int = 1024, order=None) -> str:
    digest = chunk_digest(blob, chunk_bytes=size)
    offsets = list(range(0, len(blob), size))
    for offset in order(offsets) if order else offsets:
        keeper.put_chunk(rank, step, offset, blob[offset:offset + size], len(blob), digest)
    return digest


def test_a_keeper_takes_chunks_of_many_ranks_at_once_in_any_order():
    keeper = SnapshotKeeper()
    blobs = {rank: serialize(_state(rank, scale=rank + 1))[0] for rank in range(4)}
    digests = {}

    def one(rank: int) -> None:
        digests[rank] = _send(keeper, rank, 5, blobs[rank], order=lambda o: o[::-1] if rank % 2 else o)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert keeper.holdings() == {r: [5] for r in range(4)}
    for rank, blob in blobs.items():
        assert keeper.describe(rank, 5) == (len(blob), digests[rank])
        got = np.concatenate([keeper.get_chunk(rank, 5, o, 1024) for o in range(0, len(blob), 1024)])
        assert got.tobytes() == blob


def test_a_keeper_lists_only_complete_snapshots_and_holds_a_bounded_number():
    keeper = SnapshotKeeper()
    blob = serialize(_state(0))[0]
    for step in (1, 2):
        _send(keeper, 0, step, blob)
    digest = chunk_digest(blob, chunk_bytes=1024)
    keeper.put_chunk(0, 3, 0, blob[:1024], len(blob), digest)  # step 3 starts to arrive
    # Room for it was made at once (the oldest went), and it is not listed until complete.
    assert keeper.holdings() == {0: [2]}
    assert keeper.nbytes() == 2 * len(blob) == KEEP_STEPS * len(blob)
    keeper.put_chunk(0, 1, 0, blob[:1024], len(blob), digest)  # a late chunk of an older send
    assert keeper.holdings() == {0: [2]} and keeper.nbytes() == 2 * len(blob)
    _send(keeper, 0, 3, blob)  # the rest of step 3 (its first chunk again: ignored)
    assert keeper.holdings() == {0: [2, 3]}
    keeper.put_chunk(0, 4, 0, blob[:1024], len(blob), digest)
    assert keeper.holdings() == {0: [3]}
    keeper.drop_after(2)  # a rollback to step 2: steps 3 and 4, sent or arriving, are another path's
    assert keeper.holdings() == {0: []} and keeper.nbytes() == 0


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_a_keeper_gives_the_memory_of_dropped_snapshots_back():
    # Four ranks' 16 MiB parts arriving in chunks over many threads, as a keeper serves them,
    # step after step: it holds KEEP_STEPS of each (128 MiB), and its memory stays there. On
    # the heap, parts below glibc's 32 MiB mmap ceiling left holes in the threads' arenas that
    # the next parts did not fit: +256 MiB over 60 steps.
    keeper, part, chunk = SnapshotKeeper(), 16 << 20, 4 << 20
    data = np.arange(part, dtype=np.uint64).astype(np.uint8)
    with ThreadPoolExecutor(32) as pool:
        for step in range(40):
            calls = [pool.submit(keeper.put_chunk, rank, step, o, data[o:o + chunk], part, "d")
                     for rank in range(4) for o in range(0, part, chunk)]
            for call in calls:
                call.result()
            if step == 4:
                settled = _rss_mib()
    assert keeper.nbytes() == 4 * KEEP_STEPS * part
    assert keeper.holdings() == {rank: [38, 39] for rank in range(4)}
    grown = _rss_mib() - settled
    assert grown < 32, f"the keeper's memory grew {grown:.0f} MiB while it held the same 128 MiB"


def test_a_restore_asks_its_own_nodes_keeper_first_and_gives_up_together(monkeypatch):
    # restore_from_memory fetches this rank's blob from `prefer` (the keeper on its own node)
    # before the others the plan lists; a rank that finds no copy returns None before loading.
    import longrun.worker.snapshots as snapshots

    asked = []

    def fetch_blob(rank, step, names):
        asked.append((rank, step, names))
        return None, [f"{name}: gone" for name in names]

    monkeypatch.setattr(snapshots, "fetch_blob", fetch_blob)
    plan = {"step": 7, "keepers": {"0": ["keeper-a", "keeper-b"], "1": ["keeper-b", "keeper-c"]}}
    assert snapshots.restore_from_memory(None, 0, plan, None, prefer="keeper-b") is None
    assert snapshots.restore_from_memory(None, 1, plan, None, prefer="keeper-x") is None
    assert asked == [(0, 7, ["keeper-b", "keeper-a"]), (1, 7, ["keeper-b", "keeper-c"])]
