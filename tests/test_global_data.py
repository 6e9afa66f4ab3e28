"""Issue 18's data side: one global batch per step, drawn from the one global order by every
rank and split among them, so a step's documents and the data position do not depend on the
number of ranks (the multi-process ledger: test_global_data_worlds.py)."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from longrun.config import config_from_dict
from longrun.config.sections import LengthDistribution
from longrun.data.byte_tokenizer import ByteTokenizer
from longrun.data.documents import DataError, DocumentSampler, SyntheticCorpus
from longrun.data.mixture import MixtureSampler
from longrun.data.packing import global_batches
from longrun.trainer.feed import StepFeed
from longrun.trainer.step import data_parallel_step, split_among_ranks

MICRO, GLOBAL = 128, 1000  # a global budget no multiple of the micro one, nor of any rank count
CORPUS = SyntheticCorpus(LengthDistribution(min_len=3, max_len=200, mean=40.0, sigma=1.0), 64,
                         ByteTokenizer(), seed=1, num_docs=400)


def config(**training):
    return config_from_dict({
        "job": {"name": "global-data", "seed": 5}, "cluster": {"device": "cpu"},
        "model": {"dim": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64},
        "data": {"source": "synthetic", "micro_batch_tokens": MICRO, "prefetch": 2},
        "training": {"global_batch_tokens": GLOBAL} | training,
    })


def first_batches(sampler, n, budget=GLOBAL):
    return list(itertools.islice(global_batches(CORPUS, sampler, budget), n))


def trained_ids(work) -> list[int]:
    return [i for mb in work.micro_batches if not mb.idle for i in mb.documents.doc_ids]


# --- the global batch ----------------------------------------------------------------------------


def test_a_global_batch_is_next_fit_in_the_global_order_and_reads_no_tokens(monkeypatch):
    def no_reading(*_):
        raise AssertionError("choosing a global batch must not read tokens")

    monkeypatch.setattr(CORPUS, "_read", no_reading)
    order = DocumentSampler(len(CORPUS), seed=3)
    batches = first_batches(DocumentSampler(len(CORPUS), seed=3), 30)
    lengths = CORPUS.chunk_lengths
    for batch, following in itertools.pairwise(batches):
        assert batch.indices.tolist() == [next(order) for _ in batch.indices]  # in order, none skipped
        assert batch.tokens <= GLOBAL < batch.tokens + lengths[following.indices[0]]  # next-fit
        assert batch.loss_tokens == batch.tokens - len(batch.indices)


def test_the_global_batch_and_its_split_depend_on_seed_position_and_budget_only():
    # Reaching a position by drawing or by loading it gives the same batches onward.
    before = first_batches(DocumentSampler(len(CORPUS), seed=3), 12)
    loaded = DocumentSampler(len(CORPUS), seed=3)
    loaded.load_state_dict(before[6].sampler_state)
    for a, b in zip(before[7:], first_batches(loaded, 5), strict=True):
        assert a.indices.tolist() == b.indices.tolist() and a.sampler_state == b.sampler_state
    # ... and another seed or budget other ones.
    assert first_batches(DocumentSampler(len(CORPUS), seed=4), 1)[0].indices.tolist() != \
        first_batches(DocumentSampler(len(CORPUS), seed=3), 1)[0].indices.tolist()
    assert len(first_batches(DocumentSampler(len(CORPUS), seed=3), 1, budget=2 * GLOBAL)[0].indices) > \
        len(before[0].indices)
    # The split is computed from the lengths alone: the same on every call (every rank).
    for batch in before:
        assert split_among_ranks(batch.lengths, 3) == split_among_ranks(batch.lengths.copy(), 3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_splitting_a_global_batch_over_1_to_4_ranks_trains_each_document_once(seed):
    for batch in first_batches(DocumentSampler(len(CORPUS), seed=seed), 10):
        for ranks in (1, 2, 3, 4):
            works = [data_parallel_step(batch, CORPUS, rank, ranks, MICRO) for rank in range(ranks)]
            counts = Counter(i for work in works for i in trained_ids(work))
            assert sorted(counts) == sorted(batch.indices.tolist()) and set(counts.values()) == {1}
            # Lock-step: every rank runs as many micro-batches (idle ones pad), each within the
            # budget, and every rank knows the global loss-token count without asking.
            assert len({len(work.micro_batches) for work in works}) == 1
            for work in works:
                assert work.loss_tokens == batch.loss_tokens
                assert work.sampler_state == batch.sampler_state
                for mb in work.micro_batches:
                    assert mb.idle or len(mb.documents.tokens) <= MICRO
                    if not mb.idle:  # the tokens are the documents' own
                        want = np.concatenate([CORPUS[i] for i in mb.documents.doc_ids])
                        assert mb.documents.tokens.tolist() == want.tolist()
            assert sum(mb.documents.n_tokens for work in works for mb in work.micro_batches
                       if not mb.idle) == batch.loss_tokens


def test_the_split_balances_the_ranks_by_tokens():
    lengths = np.array([50, 10, 40, 30, 20, 60])
    shares = split_among_ranks(lengths, 3)
    assert [int(lengths[s].sum()) for s in shares] == [70, 70, 70]
    assert shares == [[1, 5], [0, 4], [2, 3]]  # each in global order
    assert split_among_ranks(np.array([5]), 3) == [[0], [], []]  # more ranks than documents


# --- the position: one, global, at any world size -------------------------------------------------


def _feeds(cfg, sampler_factory, ranks, state=None):
    feeds = [StepFeed(cfg, CORPUS, sampler_factory(), cp=None, device="cpu", rank=r, ranks=ranks)
             for r in range(ranks)]
    if state is not None:
        for feed in feeds:
            feed.load_state_dict(state)
    return feeds


def _steps(feeds, n):
    """n steps of every feed: the global documents of each step and the common position."""
    out = []
    for _ in range(n):
        works = [feed.next()[0] for feed in feeds]
        for feed, work in zip(feeds, works, strict=True):
            feed.done(work)
        assert all(feed.state == feeds[0].state for feed in feeds)  # one position on every rank
        out.append(sorted(i for work in works for i in trained_ids(work)))
    for feed in feeds:
        feed.close()
    return out


SAMPLERS = {
    "one dataset": lambda: DocumentSampler(len(CORPUS), seed=5),
    "mixture": lambda: MixtureSampler([150, 250], [0.3, 0.7], seed=5),
}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_a_position_saved_at_4_ranks_resumes_at_3_with_the_same_global_batches(name):
    cfg, make = config(), SAMPLERS[name]
    straight = _steps(_feeds(cfg, make, 4), 8)
    first = _feeds(cfg, make, 4)
    assert _steps(first, 3) == straight[:3]
    state = first[0].state
    assert not {"dp_rank", "dp_size"} & set(state)  # nothing of the layout in it
    for ranks in (3, 1, 2):
        assert _steps(_feeds(cfg, make, ranks, state), 5) == straight[3:]


def test_a_per_rank_position_of_an_earlier_longrun_is_refused_by_the_feed():
    feed = _feeds(config(), SAMPLERS["one dataset"], 1)[0]
    old = {"epoch": 0, "index": 12, "seed": 5, "num_docs": len(CORPUS), "dp_rank": 0, "dp_size": 4}
    with pytest.raises(DataError, match="earlier longrun with per-rank data positions"):
        feed.load_state_dict(old)
    with pytest.raises(DataError, match="seed"):
        feed.load_state_dict(old | {"dp_size": 1, "seed": 6})
    feed.load_state_dict(old | {"dp_size": 1})  # one rank's old position is a global one
    assert feed.state == {"epoch": 0, "index": 12, "seed": 5, "num_docs": len(CORPUS)}


# --- config ------------------------------------------------------------------------------------


def test_the_global_batch_defaults_to_the_configured_layouts_and_may_be_pinned():
    def cfg(parallelism, **training):
        workers = 1
        for n in parallelism.values():
            workers *= n
        return config_from_dict({
            "job": {"name": "g"}, "cluster": {"device": "cpu", "workers_per_node": workers},
            "parallelism": parallelism, "model": {"max_seq_len": 256},
            "data": {"source": "synthetic", "micro_batch_tokens": 512}, "training": training})

    assert cfg({}).global_batch_tokens == 512
    assert cfg({"dp": 2, "fsdp": 2}, grad_accum=3).global_batch_tokens == 512 * 3 * 4
    assert cfg({"dp": 2, "cp": 2, "tp": 2}).global_batch_tokens == 512 * 4  # tp shares the data
    assert cfg({"dp": 4}, grad_accum=3, global_batch_tokens=777).global_batch_tokens == 777


def test_a_global_batch_smaller_than_a_micro_batch_is_refused_naming_the_fields():
    with pytest.raises(ValueError) as err:
        config(global_batch_tokens=MICRO - 1)
    message = str(err.value)
    assert "training.global_batch_tokens" in message and "data.micro_batch_tokens" in message
    with pytest.raises(ValueError, match=r"training.global_batch_tokens.*max_seq_len \(1024\)"):
        config_from_dict({
            "job": {"name": "g"}, "cluster": {"device": "cpu", "workers_per_node": 4},
            "parallelism": {"cp": 4}, "model": {"max_seq_len": 1024},
            "data": {"source": "synthetic", "micro_batch_tokens": 256},
            "training": {"global_batch_tokens": 512}})
