"""Tokenizer, corpora, the resumable sampler, packing and the prefetcher."""

from __future__ import annotations

import json
import logging
import threading
import time

import numpy as np
import pytest
import torch

from longrun.config import config_from_dict
from longrun.config.sections import LengthDistribution
from longrun.data.byte_tokenizer import ByteTokenizer
from longrun.data.documents import (
    DataError,
    DocumentSampler,
    FileCorpus,
    JsonlCorpus,
    SyntheticCorpus,
    build_corpus,
)
from longrun.data.packing import (
    IGNORE_INDEX,
    Prefetcher,
    build_micro_batch,
    packed_micro_batches,
)

TOK = ByteTokenizer()


# --- tokenizer -------------------------------------------------------------------------------


def test_tokenizer_round_trip_including_non_ascii():
    text = "def f(x):\n    return 'héllo wörld' + \"日本語\" + '🚀'\t\x00"
    ids = TOK.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8")) > len(text)
    assert TOK.decode(ids) == text
    framed = TOK.encode(text, bos=True, eos=True)
    assert framed[0] == TOK.BOS and framed[-1] == TOK.EOS
    assert TOK.decode([*framed, TOK.PAD]) == text  # special ids decode to nothing


def test_tokenizer_validates_vocab_and_ids():
    with pytest.raises(ValueError, match="at least 259"):
        ByteTokenizer(258)
    assert ByteTokenizer(259).vocab_size == 259
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TOK.decode([65, 260])
    assert TOK.decode([0xE6, 0x97]) == "\ufffd"  # a cut multi-byte character is replaced


# --- corpora ---------------------------------------------------------------------------------


def _write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_chunks_reassemble_into_framed_documents(tmp_path):
    texts = ["a" * 10, "b" * 8, "ü" * 25, "c", ""]  # "ü" is 2 bytes: 50 bytes of content
    corpus = JsonlCorpus(_write_jsonl(tmp_path / "d.jsonl", texts), 10, TOK)
    assert corpus.num_documents == 5
    chunks = [corpus[i] for i in range(len(corpus))]
    assert all(1 <= len(c) <= 10 for c in chunks)
    stream = np.concatenate(chunks).tolist()
    expected = [i for t in texts for i in TOK.encode(t, bos=True, eos=True)]
    assert stream == expected
    # "a"*10 framed is 12 tokens: two chunks, only the first with BOS, only the second EOS.
    assert chunks[0][0] == TOK.BOS and TOK.EOS not in chunks[0].tolist()
    assert chunks[1].tolist() == [ord("a"), TOK.EOS]
    assert corpus.num_tokens == len(expected)


def test_jsonl_line_without_text_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"txt": "typo"}\n')
    with pytest.raises(DataError, match=r"line 3 has no \"text\""):
        JsonlCorpus(path, 16, TOK)
    path.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        JsonlCorpus(path, 16, TOK)


def _data_cfg(path, **data):
    return config_from_dict({"job": {"name": "t"}, "data": {"path": str(path), **data}})


def test_text_source_errors(tmp_path):
    cfg = _data_cfg(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_corpus(cfg.data, cfg.model, TOK, 0)
    (tmp_path / "empty").mkdir()
    cfg = _data_cfg(tmp_path / "empty")
    with pytest.raises(DataError, match="no non-empty files matching"):
        build_corpus(cfg.data, cfg.model, TOK, 0)
    (tmp_path / "notes.txt").write_text("x")
    cfg = _data_cfg(tmp_path / "notes.txt")
    with pytest.raises(DataError, match=r"not \.jsonl"):
        build_corpus(cfg.data, cfg.model, TOK, 0)


def test_directory_files_are_recursive_filtered_and_sorted(tmp_path):
    for rel, text in {"z.py": "z", "a/b/c.py": "c", "a/a.py": "a", "a/x.txt": "x",
                      "a/empty.py": "", ".git/h.py": "h", "m.md": "m"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    corpus = FileCorpus(tmp_path, ["*.py", "*.md"], 32, TOK)
    assert [str(f) for f in corpus.files] == ["a/a.py", "a/b/c.py", "m.md", "z.py"]
    assert corpus[0].tolist() == [TOK.BOS, ord("a"), TOK.EOS]


def test_files_with_nul_bytes_are_skipped_with_one_warning(tmp_path, caplog):
    (tmp_path / "good.py").write_text("x = 1\n")
    (tmp_path / "blob.py").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    with caplog.at_level(logging.WARNING, logger="longrun.data.documents"):
        corpus = FileCorpus(tmp_path, ["*.py"], 32, TOK)
    assert [str(f) for f in corpus.files] == ["good.py"]
    assert [str(f) for f in corpus.skipped_binary] == ["blob.py"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "blob.py" in warnings[0].getMessage()
    assert "not text" in warnings[0].getMessage()


def test_only_invalid_utf8_files_is_an_error_naming_them(tmp_path):
    (tmp_path / "latin1.py").write_bytes("s = 'caf\u00e9'\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"not text.*latin1\.py"):
        FileCorpus(tmp_path, ["*.py"], 32, TOK)


def test_multibyte_character_cut_by_the_sniff_boundary_is_kept(tmp_path, caplog):
    data = ("a" * 8191 + "é" * 100).encode("utf-8")  # byte 8192 is the middle of an "é"
    (tmp_path / "long.py").write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="longrun.data.documents"):
        corpus = FileCorpus(tmp_path, ["*.py"], 1 << 14, TOK)
    assert [str(f) for f in corpus.files] == ["long.py"] and corpus.skipped_binary == []
    assert corpus.num_tokens == len(data) + 2
    assert not caplog.records
    (tmp_path / "long.py").write_bytes(data[:8192])  # the whole file ends mid-character
    with pytest.raises(DataError, match="not text"):
        FileCorpus(tmp_path, ["*.py"], 1 << 14, TOK)


def test_stdlib_corpus_is_the_standard_library():
    cfg = config_from_dict({"job": {"name": "t"}})
    corpus = build_corpus(cfg.data, cfg.model, TOK, 0)
    names = {str(f) for f in corpus.files}
    assert "os.py" in names and "json/__init__.py" in names
    assert not any("site-packages" in n or "dist-packages" in n for n in names)
    assert corpus.num_documents > 500
    assert max(len(corpus[i]) for i in range(0, len(corpus), 97)) == cfg.model.max_seq_len


def test_synthetic_lengths_follow_the_lognormal_mean():
    dist = LengthDistribution(min_len=2, max_len=10**6, mean=200.0, sigma=0.5)
    corpus = SyntheticCorpus(dist, 4096, TOK, seed=7, num_docs=20000)
    assert corpus.lengths.min() >= 2 and corpus.lengths.max() <= 10**6
    assert corpus.lengths.mean() == pytest.approx(200.0, rel=0.03)
    clipped = SyntheticCorpus(LengthDistribution(), 256, TOK, seed=7, num_docs=500)
    assert clipped.lengths.min() >= 128 and clipped.lengths.max() <= 8192
    again = SyntheticCorpus(LengthDistribution(), 256, TOK, seed=7, num_docs=500)
    assert all(np.array_equal(clipped[i], again[i]) for i in (0, 17, len(clipped) - 1))
    assert all(len(clipped[i]) <= 256 for i in range(len(clipped)))
    stream = np.concatenate([clipped[i] for i in range(10)])
    body = stream[(stream != TOK.BOS) & (stream != TOK.EOS)]
    assert body.max() < 256 and len(np.unique(body)) > 200  # random bytes, no specials inside


# --- sampler ---------------------------------------------------------------------------------


def _take(sampler, n):
    return [next(sampler) for _ in range(n)]


def test_sampler_is_deterministic_and_reshuffles_per_epoch():
    a, b = DocumentSampler(50, seed=3), DocumentSampler(50, seed=3)
    first = _take(a, 100)
    assert first == _take(b, 100)
    assert sorted(first[:50]) == sorted(first[50:]) == list(range(50))  # epochs are permutations
    assert first[:50] != first[50:]
    assert _take(DocumentSampler(50, seed=4), 50) != first[:50]


def test_the_sampler_is_one_global_order_that_names_no_rank():
    """Every rank draws from the same order (`step.py` splits each global batch): each epoch
    visits every document once, and the position holds nothing of a layout."""
    sampler = DocumentSampler(11, seed=0)
    for _epoch in range(3):
        assert sorted(_take(sampler, 11)) == list(range(11))  # no document left out or repeated
    assert set(sampler.state_dict()) == {"epoch", "index", "seed", "num_docs"}
    with pytest.raises(DataError, match="no documents"):
        DocumentSampler(0, seed=0)


def test_a_per_rank_position_of_an_earlier_longrun_is_refused():
    old = {"epoch": 0, "index": 3, "seed": 0, "num_docs": 11, "dp_rank": 1, "dp_size": 2}
    with pytest.raises(DataError, match="earlier longrun with per-rank data positions"):
        DocumentSampler(11, seed=0).load_state_dict(old)
    # One rank's position was already a position in the one global order: it still loads.
    alone = DocumentSampler(11, seed=0)
    alone.load_state_dict(old | {"dp_rank": 0, "dp_size": 1})
    expected = DocumentSampler(11, seed=0)
    _take(expected, 3)
    assert _take(alone, 20) == _take(expected, 20)


@pytest.mark.parametrize("consumed", [0, 7, 20, 21, 45])
def test_sampler_resumes_exactly(consumed):
    live = DocumentSampler(21, seed=9)
    _take(live, consumed)
    state = live.state_dict()
    expected = _take(live, 40)
    restored = DocumentSampler(21, seed=9)
    restored.load_state_dict(state)
    assert _take(restored, 40) == expected
    with pytest.raises(DataError, match="num_docs"):
        DocumentSampler(22, seed=9).load_state_dict(state)
    with pytest.raises(DataError, match="seed"):
        DocumentSampler(21, seed=8).load_state_dict(state)


# --- packing ---------------------------------------------------------------------------------


def test_build_micro_batch_targets_positions_and_cu_seqlens():
    mb = build_micro_batch([np.array([1, 2, 3]), np.array([7]), np.array([4, 5])])
    assert mb.tokens.tolist() == [1, 2, 3, 7, 4, 5]
    assert mb.targets.tolist() == [2, 3, IGNORE_INDEX, IGNORE_INDEX, 5, IGNORE_INDEX]
    assert mb.positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert mb.cu_seqlens.dtype == torch.int32 and mb.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert (mb.n_docs, mb.n_tokens, mb.max_seqlen) == (3, 3, 3)


def _synthetic(num_docs=300, max_seq_len=64):
    dist = LengthDistribution(min_len=3, max_len=200, mean=40.0, sigma=1.0)
    return SyntheticCorpus(dist, max_seq_len, TOK, seed=1, num_docs=num_docs)


def test_packing_respects_the_budget_and_loses_nothing():
    corpus = _synthetic()
    batches = packed_micro_batches(corpus, DocumentSampler(len(corpus), seed=2), 100)
    reference = DocumentSampler(len(corpus), seed=2)
    fills = []
    for mb in (next(batches) for _ in range(40)):
        assert len(mb.tokens) <= 100
        fills.append(len(mb.tokens))
        lengths = np.diff(mb.cu_seqlens.numpy())
        assert lengths.sum() == len(mb.tokens) and mb.n_docs == len(lengths)
        assert mb.n_tokens == int((mb.targets != IGNORE_INDEX).sum())
        for lo, n in zip(mb.cu_seqlens[:-1].tolist(), lengths, strict=True):
            doc = mb.tokens[lo : lo + n]
            assert doc.tolist() == corpus[next(reference)].tolist()  # sampler order, whole
            assert mb.targets[lo : lo + n - 1].tolist() == doc[1:].tolist()
            assert mb.targets[lo + n - 1] == IGNORE_INDEX
            assert mb.positions[lo : lo + n].tolist() == list(range(n))
    assert np.mean(fills) > 70  # next-fit keeps micro-batches mostly full


def test_document_longer_than_budget_is_an_error():
    corpus = _synthetic(max_seq_len=64)
    batches = packed_micro_batches(corpus, DocumentSampler(len(corpus), seed=0), 32)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        for _ in range(100):
            next(batches)


def _same(a, b):
    return torch.equal(a.tokens, b.tokens) and torch.equal(a.cu_seqlens, b.cu_seqlens)


@pytest.mark.parametrize("consumed", [1, 5, 13])
def test_resume_from_the_consumed_micro_batch_while_prefetching(consumed):
    corpus = _synthetic()
    straight = packed_micro_batches(corpus, DocumentSampler(len(corpus), seed=5), 128)
    expected = [next(straight) for _ in range(consumed + 10)]

    sampler = DocumentSampler(len(corpus), seed=5)
    with Prefetcher(packed_micro_batches(corpus, sampler, 128), depth=4) as pre:
        got = [next(pre) for _ in range(consumed)]
        state = got[-1].sampler_state
    assert all(_same(a, b) for a, b in zip(got, expected, strict=False))
    assert sampler.state_dict() != state  # the thread ran ahead; its state is not the one

    resumed = DocumentSampler(len(corpus), seed=5)
    resumed.load_state_dict(state)
    rest = packed_micro_batches(corpus, resumed, 128)
    assert all(_same(next(rest), mb) for mb in expected[consumed:])


# --- prefetcher ------------------------------------------------------------------------------


def _failing(n):
    yield from range(n)
    raise KeyError("boom in the data thread")


@pytest.mark.parametrize("depth", [0, 1, 4])
def test_prefetcher_propagates_the_source_exception(depth):
    pre = Prefetcher(_failing(3), depth=depth)
    assert [next(pre) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(KeyError, match="boom in the data thread"):
        next(pre)
    pre.close()
    assert pre.thread is None or not pre.thread.is_alive()


def _timed_source(n, spans):
    """Items 0..n-1; the span of each item's production (perf_counter before, after) appended."""
    for i in range(n):
        start = time.perf_counter()
        sum(range(20_000))  # some work, so the span is not empty
        spans.append((start, time.perf_counter()))
        yield i


def test_prefetcher_preserves_order_reports_waits_and_ends():
    with Prefetcher(iter(range(10)), depth=3) as pre:
        assert list(pre) == list(range(10))
        assert pre.last_wait_s >= 0.0
    assert list(Prefetcher(iter(range(5)), depth=0)) == list(range(5))


@pytest.mark.parametrize("depth", [0, 3])
def test_prefetcher_wait_is_the_consumers_own_wait(depth):
    # `last_wait_s` is how long the consumer's next() took: never more than the call itself,
    # and inline (depth 0) at least the source's work for that item, which runs inside the call.
    spans = []
    with Prefetcher(_timed_source(6, spans), depth=depth) as pre:
        for i in range(6):
            before = time.perf_counter()
            assert next(pre) == i
            call = time.perf_counter() - before
            assert pre.last_wait_s <= call
            if depth == 0:
                made = spans[i][1] - spans[i][0]
                assert made > 0 and pre.last_wait_s >= made


def test_prefetcher_close_stops_a_blocked_producer():
    produced = []

    def endless():
        i = 0
        while True:
            produced.append(i)
            yield i
            i += 1

    before = threading.active_count()
    pre = Prefetcher(endless(), depth=2, name="test-prefetch")
    assert next(pre) == 0
    pre.close()
    assert not pre.thread.is_alive()
    assert threading.active_count() == before
    assert len(produced) <= 2 + 3  # bounded: queue depth, one in hand, one being put
    with pytest.raises(RuntimeError, match="closed"):
        next(pre)


def test_prefetch_depth_does_not_change_the_stream():
    corpus = _synthetic()

    def stream(depth):
        src = packed_micro_batches(corpus, DocumentSampler(len(corpus), seed=1), 96)
        with Prefetcher(src, depth=depth) as pre:
            return [next(pre) for _ in range(12)]
    assert all(_same(a, b) for a, b in zip(stream(0), stream(5), strict=True))
