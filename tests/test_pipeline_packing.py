"""Issue 38's pipeline without padding, the data side (no processes): under pipeline parallelism
the draw packs each step's global batch into exactly the job's count of micro-batches per rank,
none empty and none over data.micro_batch_tokens, and holds back the document that would not
pack, for the next step and for a resume. (The pipeline running them: test_pipeline.py.)"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from longrun.config import config_from_dict
from longrun.config.sections import LengthDistribution
from longrun.data.byte_tokenizer import ByteTokenizer
from longrun.data.documents import DocumentSampler, SyntheticCorpus
from longrun.data.fixed_bins import FixedBins, pipeline_batches
from longrun.trainer.feed import StepFeed
from longrun.trainer.step import pipeline_step


class Lengths:
    """A corpus of documents of the given lengths (document i is i's tokens, i + 1 each)."""

    def __init__(self, lengths):
        self.chunk_lengths = np.asarray(lengths, dtype=np.int64)

    def __len__(self):
        return len(self.chunk_lengths)

    def __getitem__(self, i):
        return np.full(int(self.chunk_lengths[i]), i + 1, dtype=np.int64)


def in_order(corpus) -> DocumentSampler:
    return DocumentSampler(len(corpus), seed=0, shuffle=False)


def draw(corpus, sampler, count, capacity, n):
    return list(itertools.islice(pipeline_batches(corpus, sampler, count, capacity), n))


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 64), per_rank=st.integers(1, 6), span=st.integers(1, 4),
       lengths=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=60))
def test_every_rank_gets_exactly_its_count_of_micro_batches_none_empty_none_over(capacity, per_rank, span,
                                                                                 lengths):
    corpus = Lengths([max(1, round(f * capacity)) for f in lengths])
    order = in_order(corpus)
    count = per_rank * span
    batches = draw(corpus, in_order(corpus), count, capacity, 4)
    for batch, following in itertools.pairwise(batches):
        # The documents in the one global order, none skipped; the one that ended the batch
        # starts the next.
        assert batch.indices.tolist() == [next(order) for _ in batch.indices]
        resumed = in_order(corpus)
        resumed.load_state_dict(batch.sampler_state)
        assert next(resumed) == following.indices[0]
        bins = batch.micro_batches
        assert len(bins) == count and all(bins)  # exactly the count, none empty
        assert Counter(i for b in bins for i in b) == Counter(range(len(batch.indices)))  # each once
        assert all(sum(int(batch.lengths[i]) for i in b) <= capacity for b in bins)
        # Dealt among the span: every rank the job's count, each micro-batch real tokens, and
        # together the global batch's loss tokens.
        works = [pipeline_step(batch, corpus, rank, span) for rank in range(span)]
        assert {len(work.micro_batches) for work in works} == {per_rank}
        assert not any(mb.idle for work in works for mb in work.micro_batches)
        assert sorted(i for work in works for mb in work.micro_batches for i in mb.documents.doc_ids) == \
            sorted(batch.indices.tolist())
        assert sum(mb.documents.n_tokens for work in works for mb in work.micro_batches) == batch.loss_tokens


def test_the_draw_holds_back_the_document_that_would_not_pack():
    # Two bins of 10. First-fit takes 6 and 6; 5 fits neither, nor do 6, 6, 5 largest first.
    corpus = Lengths([6, 6, 5, 3, 2, 9])
    first, second = draw(corpus, in_order(corpus), 2, 10, 2)
    assert first.indices.tolist() == [0, 1] and first.micro_batches == ((0,), (1,))
    # The position after the batch is the one before the held document: it is drawn again.
    again = in_order(corpus)
    again.load_state_dict(first.sampler_state)
    assert next(again) == 2
    # 5, 3, 2 fill one bin and 9 takes the other; the next 6 waits again.
    assert second.indices.tolist() == [2, 3, 4, 5] and second.micro_batches == ((0, 1, 2), (3,))
    again.load_state_dict(second.sampler_state)
    assert next(again) == 0


def test_a_document_that_fits_only_packed_largest_first_is_taken():
    # First-fit in draw order leaves 2 and 5 free and the 7 fits neither; packed again largest
    # first (7 + 3, 5 + 5) everything fits. The 1 then fits nowhere: 20 tokens fill both bins.
    bins = FixedBins(2, 10)
    assert [bins.add(n) for n in (3, 5, 5, 7)] == [True] * 4
    assert bins.bins() == ((0, 3), (1, 2))
    assert not bins.add(1)
    assert bins.bins() == ((0, 3), (1, 2)) and bins.lengths == [3, 5, 5, 7]  # nothing changed
    with pytest.raises(ValueError, match=r"data\.micro_batch_tokens"):
        FixedBins(2, 10).add(11)


CORPUS = SyntheticCorpus(LengthDistribution(min_len=3, max_len=200, mean=40.0, sigma=1.0), 64,
                         ByteTokenizer(), seed=1, num_docs=400)


def test_a_draw_resumed_from_a_batch_position_draws_the_same_batches():
    straight = draw(CORPUS, DocumentSampler(len(CORPUS), seed=3), 8, 128, 10)
    resumed = DocumentSampler(len(CORPUS), seed=3)
    resumed.load_state_dict(straight[4].sampler_state)
    for a, b in zip(straight[5:], draw(CORPUS, resumed, 8, 128, 5), strict=True):
        assert a.indices.tolist() == b.indices.tolist()
        assert a.micro_batches == b.micro_batches and a.sampler_state == b.sampler_state


def pipeline_config(parallelism: dict, workers: int, grad_accum: int):
    return config_from_dict({
        "job": {"name": "packed", "seed": 5}, "cluster": {"device": "cpu", "workers_per_node": workers},
        "parallelism": parallelism,
        "model": {"dim": 32, "n_layers": 4, "n_heads": 2, "max_seq_len": 64, "tie_embeddings": False},
        "data": {"source": "synthetic", "micro_batch_tokens": 128, "prefetch": 2},
        "training": {"grad_accum": grad_accum, "pp_schedule": "interleaved_1f1b"}})


def _steps(cfg, ranks, n, state=None):
    """n steps of every rank's feed: each step's micro-batch counts, idle ones, the documents of
    the step over the span (each micro-batch's), and the common position after it."""
    feeds = [StepFeed(cfg, CORPUS, DocumentSampler(len(CORPUS), seed=5), cp=None, device="cpu",
                      rank=r, ranks=ranks) for r in range(ranks)]
    for feed in feeds:
        if state is not None:
            feed.load_state_dict(state)
    out = []
    for _ in range(n):
        works = [feed.next()[0] for feed in feeds]
        for feed, work in zip(feeds, works, strict=True):
            feed.done(work)
        assert all(feed.state == feeds[0].state for feed in feeds)
        idle = sum(mb.idle for w in works for mb in w.micro_batches)
        documents = sorted(mb.documents.doc_ids for w in works for mb in w.micro_batches if not mb.idle)
        out.append(([len(w.micro_batches) for w in works], idle, documents, feeds[0].state))
    for feed in feeds:
        feed.close()
    return out


def test_a_pipeline_feed_runs_the_jobs_count_every_step_and_resumes_at_another_span():
    # pp 2 x dp 2, interleaved: 4 micro-batches per rank. Split, then packed per rank, these
    # global batches needed 5 on some rank at some steps (6 with the interleaved rounding).
    cfg = pipeline_config({"pp": 2, "dp": 2, "pp_virtual_stages": 2}, 4, grad_accum=4)
    straight = _steps(cfg, 2, 8)
    for counts, idle, documents, _ in straight:
        assert counts == [4, 4] and idle == 0
        assert all(sum(int(CORPUS.chunk_lengths[i]) for i in mb) <= 128 for mb in documents)
    # The same 8 micro-batches at one rank of 8 (dp 1): the same global batches, resumed anywhere.
    alone = pipeline_config({"pp": 2, "pp_virtual_stages": 2}, 2, grad_accum=8)
    resumed = _steps(alone, 1, 3, straight[4][3])
    assert [(d, s) for _, _, d, s in resumed] == [(d, s) for _, _, d, s in straight[5:]]
