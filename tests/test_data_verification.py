"""Start-up does not grow with the data set: opening prepared shards hashes nothing; a data set
is verified once (the mark `data prepare` and `data inspect --verify` record), a shard no mark
vouches for is hashed when a rank first reads from it, and only the shards a rank reads; a
corrupted shard is still named before its tokens are returned.

The slow read is injected: `file_sha256` is replaced by one that blocks until the test lets it
go, standing in for a data set too large to hash inside the setup phase's hang ceiling.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from longrun.data import shards as shards_module
from longrun.data.errors import DataError
from longrun.data.prepare import prepare
from longrun.data.shards import TokenShards, file_sha256
from longrun.data.verification import MARK

SHARDS = 12
DOCS_PER_SHARD = 3
WAIT_S = 60  # a backstop so a broken build fails instead of hanging; events end every wait


@pytest.fixture
def prepared(tmp_path) -> Path:
    """A byte-tokenised data set of SHARDS shards, with the mark `data prepare` leaves."""
    lines = [json.dumps({"text": f"document {i} " + "text " * (i % 9 + 1)})
             for i in range(SHARDS * DOCS_PER_SHARD)]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    prepare([str(tmp_path / "docs.jsonl")], "byte", str(out), workers=0, progress=False,
            shard_documents=DOCS_PER_SHARD)
    return out


def damage(path: Path, offset: int) -> None:
    """Flip a bit of `path` as a later write would: same size, a newer modification time (set
    explicitly: two writes within one tick of the kernel's coarse clock share an mtime)."""
    before = os.stat(path)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))


class SlowRead:
    """`file_sha256` as a read that never ends until released: each call announces itself
    (`started`, and the path in `paths`) and then waits for `release`."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.paths: list[str] = []

    def __call__(self, path) -> str:
        self.paths.append(Path(path).name)
        self.started.set()
        self.release.wait(WAIT_S)
        return file_sha256(path)


def run_until_done_or_hashing(fn: Callable[[], object], slow: SlowRead) -> tuple[bool, object]:
    """Run `fn` in a thread; (finished, its result) as soon as it finishes or starts to hash.
    The thread is always let go and joined before returning."""
    done = threading.Event()
    result: list[object] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # handed to the test
            result.append(exc)
        finally:
            done.set()
            slow.started.set()  # wake the waiter below whichever came first

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    slow.started.wait(WAIT_S)
    finished = done.is_set()
    slow.release.set()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    return finished, result[0]


@pytest.fixture
def slow(monkeypatch) -> SlowRead:
    injected = SlowRead()
    monkeypatch.setattr(shards_module, "file_sha256", injected)
    return injected


def test_a_verified_data_set_starts_without_reading_a_shard(prepared, slow):
    assert (prepared / MARK).exists()
    finished, opened = run_until_done_or_hashing(lambda: TokenShards(prepared), slow)
    assert finished and slow.paths == [], f"start-up hashed {slow.paths}"
    assert isinstance(opened, TokenShards) and opened.unverified_shards == 0
    # Reading, too, trusts the mark: no shard is hashed again.
    opened.read(opened.num_documents - 1, 0, 1)
    assert slow.paths == []


def test_without_a_mark_start_up_hashes_nothing_and_a_rank_hashes_only_what_it_reads(prepared, slow):
    (prepared / MARK).unlink()  # e.g. a data set prepared by an older longrun
    finished, opened = run_until_done_or_hashing(lambda: TokenShards(prepared), slow)
    assert finished and slow.paths == [], f"start-up hashed {slow.paths}"
    assert opened.unverified_shards == SHARDS
    shard = 7
    doc = shard * DOCS_PER_SHARD + 1
    want = opened.read(doc, 0, 5).tolist()
    assert slow.paths == ["shard-00007.bin", "shard-00007.idx"]
    # Once per shard: another document of the same shard reads without hashing again.
    assert opened.read(doc, 0, 5).tolist() == want
    opened.read(doc - 1, 0, 1)
    assert slow.paths == ["shard-00007.bin", "shard-00007.idx"]
    assert opened.unverified_shards == SHARDS - 1


def test_a_shard_written_after_the_mark_is_found_before_its_tokens_are_returned(prepared):
    entry = json.loads((prepared / "manifest.json").read_text())["shards"][4]
    path = prepared / f"{entry['name']}.bin"
    damage(path, 0)
    opened = TokenShards(prepared)  # opens: sizes are right, and nothing is hashed
    assert opened.unverified_shards == 1
    assert opened.read(0, 0, 3).size == 3  # shards the mark vouches for read as before
    with pytest.raises(DataError, match=f"shard {path} is corrupt.*expected sha256 {entry['bin_sha256']}"):
        opened.read(4 * DOCS_PER_SHARD, 0, 1)


def test_the_error_reaches_training_from_the_prefetch_thread(prepared):
    import numpy as np

    from longrun.data.packing import Prefetcher

    damage(prepared / "shard-00002.bin", -1)
    opened = TokenShards(prepared)
    reads = (opened.read(d, 0, 1) for d in range(opened.num_documents))
    with Prefetcher(reads, depth=2) as feed:
        good = [next(feed) for _ in range(2 * DOCS_PER_SHARD)]  # shards 0 and 1
        assert all(isinstance(t, np.ndarray) for t in good)
        assert feed.thread is not None and feed.thread is not threading.current_thread()
        with pytest.raises(DataError, match=r"shard-00002\.bin is corrupt"):
            next(feed)


def test_a_mark_of_another_manifest_vouches_for_nothing(prepared):
    manifest = json.loads((prepared / "manifest.json").read_text())
    manifest["note"] = "re-prepared"
    (prepared / "manifest.json").write_text(json.dumps(manifest))
    assert TokenShards(prepared).unverified_shards == SHARDS


def test_inspect_verify_hashes_everything_and_records_the_mark(prepared, cli):
    (prepared / MARK).unlink()
    stat = os.stat(prepared / "shard-00000.bin")
    code, out, err = cli("data", "inspect", prepared, "--verify")
    assert code == 0, err
    assert f"all {SHARDS} shards match their sha256" in out
    assert TokenShards(prepared).unverified_shards == 0
    # Bit rot keeps size and mtime: only --verify, which hashes everything, sees it.
    path = prepared / "shard-00000.bin"
    data = bytearray(path.read_bytes())
    data[1] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    code, _, err = cli("data", "inspect", prepared, "--verify")
    assert code == 2 and f"shard {path} is corrupt" in err


def test_verify_takes_one_of_its_modes(prepared):
    with pytest.raises(ValueError, match="verify must be one of"):
        TokenShards(prepared, verify=True)
