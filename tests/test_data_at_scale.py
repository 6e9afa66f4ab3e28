"""Data at scale (issue 38): a job of thousands of ranks opens its data without every rank
parsing the whole .jsonl or holding arrays of one entry per document.

The indexes (a .jsonl file's line offsets and lengths, prepared shards' document lengths, the
chunk table, each epoch's permutation) are built once, by the first process to open the data,
written beside it atomically, and memory-mapped by every other; a changed data file or a
damaged index file is rebuilt, never trusted. The draws are what they were: the permutation a
rank maps is `default_rng([seed, epoch]).permutation(n)`.

Ranks starting at once are subprocesses released together by a line on their stdin; the lock
decides who builds, so the assertions hold whatever the timing.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from longrun.config import config_from_dict
from longrun.data.byte_tokenizer import ByteTokenizer
from longrun.data.documents import DataError, DocumentSampler, JsonlCorpus, build_corpus
from longrun.data.index_cache import SIDECAR, IndexCache
from longrun.data.mixture import MixtureSampler, build_sampler
from longrun.data.orders import SHARED_MIN_ITEMS, SharedOrders
from longrun.data.shards import FORMAT, ShardWriter, TokenShards, write_manifest
from longrun.data.token_corpus import TokenCorpus, open_token_corpus
from longrun.data.verification import shard_stamps, write_mark

TOK = ByteTokenizer()
SEED = 7


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def write_tokens(out: Path, n_docs: int, *, shards: int = 2, seed: int = 0) -> Path:
    """A prepared, verified directory of `n_docs` tiny documents (1-3 tokens), made by the
    shard writer."""
    out.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    entries = []
    for i, docs in enumerate(np.array_split(np.arange(n_docs), shards)):
        writer = ShardWriter(out, i, np.dtype("<u2"))
        lengths = rng.integers(1, 4, size=len(docs))
        writer.add(rng.integers(3, 100, size=int(lengths.sum())), lengths)
        entries.append(writer.finish())
    manifest = {"format": FORMAT, "dtype": "uint16", "documents": n_docs, "complete": True,
                "tokenizer": {"sha256": "test", "vocab_size": 128, "bos": 0, "eos": 1, "pad": 2,
                              "kind": "bpe"},
                "tokens": sum(e["tokens"] for e in entries), "shards": entries}
    # Verified, as `data prepare` leaves it: reading hashes nothing.
    write_mark(out, write_manifest(out, manifest), shard_stamps(out, manifest), by="test")
    return out


def index_files(directory: Path) -> dict[str, tuple[int, int]]:
    """The index files under `directory` (not the lock files): name -> (inode, mtime_ns)."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in directory.glob("*.lri")}


def built_kinds(cache: IndexCache) -> list[str]:
    return sorted(p.name.split("-")[0] for p in cache.built)


def framed(texts: list[str]) -> list[int]:
    return [i for t in texts for i in TOK.encode(t, bos=True, eos=True)]


# --- the text source's .jsonl ----------------------------------------------------------------


def test_a_jsonl_corpus_reads_its_lines_when_drawn_and_holds_no_texts(tmp_path):
    texts = [f"document {i}: " + "é\u00e9\\u00e9 \"q\" " * (i % 13) for i in range(20_000)]  # ~1 MB
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    first = JsonlCorpus(path, 48, TOK)
    stream = np.concatenate([first[i] for i in range(len(first))]).tolist()
    assert stream == framed(texts)  # the documents and their chunks are what they were
    held = [v for v in vars(first).values() if isinstance(v, list | tuple) and v
            and isinstance(v[0], str | bytes)]
    assert held == []

    # Another rank opening the indexed file and reading from it allocates nothing that grows
    # with the corpus (numpy reports its allocations to tracemalloc).
    tracemalloc.start()
    try:
        second = JsonlCorpus(path, 48, TOK)
        drawn = [second[i].tolist() for i in range(0, len(second), len(second) // 100)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert drawn == [first[i].tolist() for i in range(0, len(first), len(first) // 100)]
    size = path.stat().st_size
    assert peak < size / 8, f"{peak} bytes allocated to open a {size}-byte corpus"


def test_an_index_is_built_once_and_mapped_by_every_later_open(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [f"text {i} " * (i % 7) for i in range(500)])
    first = JsonlCorpus(path, 16, TOK)
    assert built_kinds(first.index_cache) == ["chunks", "jsonl"]
    files = index_files(tmp_path / SIDECAR)
    assert len(files) == 2

    again = JsonlCorpus(path, 16, TOK)
    assert again.index_cache.built == [] and index_files(tmp_path / SIDECAR) == files
    assert np.array_equal(again.chunk_lengths, first.chunk_lengths)
    # Mapped from the file, read-only: not a private array of the rank.
    assert not again.chunk_lengths.flags.writeable and not again.chunk_lengths.flags.owndata
    assert [again[i].tolist() for i in range(len(again))] == [first[i].tolist() for i in range(len(first))]

    # Another max_seq_len re-chunks from the same document index; the file is not parsed again.
    longer = JsonlCorpus(path, 64, TOK)
    assert built_kinds(longer.index_cache) == ["chunks"]


CHILD = """
import json, sys
from longrun.config import config_from_dict
from longrun.data.byte_tokenizer import ByteTokenizer
from longrun.data.documents import build_corpus
from longrun.data.mixture import build_sampler
cfg = config_from_dict(json.loads(sys.argv[1]))
print("ready", flush=True)
sys.stdin.readline()  # released with the others: every rank opens at once
corpus = build_corpus(cfg.data, cfg.model, ByteTokenizer(), cfg.job.seed)
sampler = build_sampler(cfg.data, corpus, seed=cfg.job.seed)
draws = [next(sampler) for _ in range(300)]
print(json.dumps({"built": sorted(p.name.split("-")[0] for p in corpus.index_cache.built),
                  "draws": draws, "tokens": [corpus[i].tolist() for i in draws[:50]]}))
"""


def _cfg(path: Path, **data) -> object:
    return config_from_dict({"job": {"name": "scale", "seed": SEED}, "model": {"max_seq_len": 64},
                             "data": {"path": str(path), **data}})


def test_ranks_starting_at_once_build_one_index_and_draw_alike(tmp_path):
    # More chunks than SHARED_MIN_ITEMS, so the epoch's order is a shared file too.
    n = SHARED_MIN_ITEMS + 1000
    path = write_jsonl(tmp_path / "d.jsonl", [f"doc {i}" for i in range(n)])
    config = json.dumps({"job": {"name": "scale", "seed": SEED}, "model": {"max_seq_len": 64},
                         "data": {"path": str(path)}})
    ranks = [subprocess.Popen([sys.executable, "-c", CHILD, config], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(6)]
    try:
        for rank in ranks:
            assert rank.stdout.readline().strip() == "ready"
        for rank in ranks:  # the go
            rank.stdin.write("go\n")
            rank.stdin.flush()
        results = [json.loads(rank.communicate(timeout=300)[0]) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    assert all(rank.returncode == 0 for rank in ranks)
    built = sorted(kind for r in results for kind in r["built"])
    assert built == ["chunks", "jsonl", "order"]  # each index built by exactly one rank
    assert len(index_files(tmp_path / SIDECAR)) == 3
    assert all(r["draws"] == results[0]["draws"] and r["tokens"] == results[0]["tokens"] for r in results)
    assert results[0]["draws"] == np.random.default_rng([SEED, 0]).permutation(n)[:300].tolist()
    assert results[0]["tokens"][0] == framed([f"doc {results[0]['draws'][0]}"])


def test_a_changed_file_is_indexed_again(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["alpha", "beta"])
    old = JsonlCorpus(path, 16, TOK)
    # Same size, newer mtime (set explicitly: two writes within a tick share one).
    before = path.stat()
    write_jsonl(path, ["gamma", "delta"])
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    changed = JsonlCorpus(path, 16, TOK)
    assert built_kinds(changed.index_cache) == ["chunks", "jsonl"]
    assert changed[0].tolist() == framed(["gamma"])
    with pytest.raises(DataError, match="changed while training"):
        old[1]  # the rank that indexed the old file is told, not given other text

    with path.open("a") as f:
        f.write(json.dumps({"text": "epsilon"}) + "\n")
    grown = JsonlCorpus(path, 16, TOK)
    assert grown.num_documents == 3 and grown[2].tolist() == framed(["epsilon"])


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 8)


def _no_magic(path: Path) -> None:
    with path.open("r+b") as f:
        f.write(b"\0" * 16)


def _bad_header(path: Path) -> None:
    with path.open("r+b") as f:
        f.seek(30)
        f.write(b"}}}}")


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [_truncate, _no_magic, _bad_header, _empty])
def test_a_damaged_index_file_is_rebuilt_not_trusted(tmp_path, damage, caplog):
    texts = [f"text {i} " * (i % 5 + 1) for i in range(300)]
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    JsonlCorpus(path, 16, TOK)
    (documents,) = (tmp_path / SIDECAR).glob("jsonl-*.lri")
    damage(documents)
    with caplog.at_level(logging.WARNING, logger="longrun.data.index_cache"):
        reopened = JsonlCorpus(path, 16, TOK)
    assert built_kinds(reopened.index_cache) == ["jsonl"]
    assert any("cannot be used" in r.getMessage() for r in caplog.records)
    assert np.concatenate([reopened[i] for i in range(len(reopened))]).tolist() == framed(texts)
    assert JsonlCorpus(path, 16, TOK).index_cache.built == []  # and the rebuilt file is good


def test_an_index_of_other_data_under_the_expected_name_is_not_trusted(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ["one", "two", "three"])
    JsonlCorpus(a, 16, TOK)
    (of_a,) = (tmp_path / SIDECAR).glob("jsonl-*.lri")
    b = write_jsonl(tmp_path / "b.jsonl", ["four", "five"])
    JsonlCorpus(b, 16, TOK)
    (of_b,) = set((tmp_path / SIDECAR).glob("jsonl-*.lri")) - {of_a}
    of_b.write_bytes(of_a.read_bytes())  # b's name, a's index: whole, but of other data
    reopened = JsonlCorpus(b, 16, TOK)
    assert built_kinds(reopened.index_cache) == ["jsonl"]
    assert [reopened[i].tolist() for i in range(2)] == [framed(["four"]), framed(["five"])]


def test_an_unwritable_sidecar_falls_back_to_the_user_cache_and_an_explicit_dir_wins(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", ["x" * 40, "y"])
    (tmp_path / SIDECAR).write_text("not a directory")  # as a read-only data directory would refuse
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    corpus = JsonlCorpus(path, 16, TOK)
    assert built_kinds(corpus.index_cache) == ["chunks", "jsonl"]
    assert len(index_files(tmp_path / "home-cache" / "longrun" / "index")) == 2
    assert JsonlCorpus(path, 16, TOK).index_cache.built == []

    explicit = JsonlCorpus(path, 16, TOK, index_dir=tmp_path / "elsewhere")
    assert built_kinds(explicit.index_cache) == ["chunks", "jsonl"]
    assert len(index_files(tmp_path / "elsewhere")) == 2


def test_a_lone_surrogate_in_a_jsonl_line_is_a_data_error_naming_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "half \\ud800 a pair"}\n')
    with pytest.raises(DataError, match=r"line 2 holds a lone surrogate.*data prepare"):
        JsonlCorpus(path, 16, TOK)


# --- prepared token shards and the per-epoch order -------------------------------------------


def test_a_token_corpus_of_millions_of_documents_is_mapped_not_copied(tmp_path):
    n = 2_000_000
    out = write_tokens(tmp_path / "tokens", n)
    cfg = config_from_dict({"job": {"name": "scale", "seed": SEED}, "model": {"max_seq_len": 64},
                            "data": {"source": "tokens", "path": str(out)}})
    first = open_token_corpus(cfg.data, cfg.model, TOK)
    sampler = build_sampler(cfg.data, first, seed=SEED)
    draws = [next(sampler) for _ in range(1000)]
    assert built_kinds(first.index_cache) == ["chunks", "order", "token"]
    files = index_files(out / SIDECAR)

    tracemalloc.start()  # a second rank: numpy reports its allocations to tracemalloc
    try:
        second = open_token_corpus(cfg.data, cfg.model, TOK)
        second_sampler = build_sampler(cfg.data, second, seed=SEED)
        second_draws = [next(second_sampler) for _ in range(1000)]
        tokens = [second[i] for i in second_draws[:100]]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert second.index_cache.built == [] and index_files(out / SIDECAR) == files
    # One private array of N int64 would be 16 MB; the whole open allocates far less.
    assert peak < n * 8 / 16, f"{peak} bytes allocated by a rank opening {n} documents"
    assert second_draws == draws == np.random.default_rng([SEED, 0]).permutation(n)[:1000].tolist()
    assert [t.tolist() for t in tokens] == [first[i].tolist() for i in draws[:100]]
    # The documents are the shards' own: the mapped index matches what they hold.
    shards = TokenShards(out)
    assert np.array_equal(second._content, shards.lengths)
    assert np.array_equal(second.chunk_lengths, shards.lengths + 2)  # each fits one chunk


def test_the_shared_order_is_the_permutation_every_rank_would_draw_in_every_epoch(tmp_path):
    n = SHARED_MIN_ITEMS + 17
    out = write_tokens(tmp_path / "tokens", n, shards=3)
    corpus = TokenCorpus([TokenShards(out)], 64)
    orders = SharedOrders(corpus.index_cache)
    sampler = DocumentSampler(n, seed=SEED, orders=orders)
    two_epochs = [next(sampler) for _ in range(2 * n)]
    expected = np.concatenate([np.random.default_rng([SEED, e]).permutation(n) for e in (0, 1)])
    assert two_epochs == expected.tolist()
    assert built_kinds(corpus.index_cache).count("order") == 2

    # A rank resuming mid-epoch from a checkpoint maps the same file and continues alike.
    resumed = DocumentSampler(n, seed=SEED, orders=SharedOrders(IndexCache.beside(out)))
    private = DocumentSampler(n, seed=SEED)
    for s in (resumed, private):
        s.load_state_dict({"epoch": 1, "index": 5, "seed": SEED, "num_docs": n})
    assert [next(resumed) for _ in range(50)] == [next(private) for _ in range(50)] == \
        expected[n + 5:n + 55].tolist()
    assert resumed.orders.cache.built == []


def test_a_mixture_draws_alike_from_shared_orders(tmp_path):
    cache = IndexCache([tmp_path / "cache"])
    shared = MixtureSampler([40, 25, 60], [0.5, 0.3, 0.2], seed=SEED,
                            orders=SharedOrders(cache, min_items=1))
    private = MixtureSampler([40, 25, 60], [0.5, 0.3, 0.2], seed=SEED)
    assert [next(shared) for _ in range(400)] == [next(private) for _ in range(400)]
    assert shared.state_dict() == private.state_dict()
    assert len(cache.built) >= 3  # each dataset's epochs, from files


def test_a_backwards_shard_index_is_still_refused_when_the_corpus_opens(tmp_path):
    """A regression guard: the offsets are no longer read whole at open, but indexed once."""
    out = write_tokens(tmp_path / "tokens", 100, shards=1)
    idx = out / "shard-00000.idx"
    offsets = np.fromfile(idx, dtype="<u8")
    offsets[10], offsets[11] = offsets[11], offsets[10] + 1000  # first and last stay right
    offsets.tofile(idx)
    with pytest.raises(DataError, match=r"shard-00000\.idx is corrupt"):
        TokenCorpus([TokenShards(out)], 64)


def test_the_text_source_through_build_corpus_keeps_its_index_beside_the_file(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["a b c", "d e"])
    cfg = _cfg(path)
    corpus = build_corpus(cfg.data, cfg.model, TOK, SEED)
    assert isinstance(corpus, JsonlCorpus) and corpus.index_cache.directories[0] == tmp_path / SIDECAR
    assert len(index_files(tmp_path / SIDECAR)) == 2
