"""The sample ledger (issue 18): runs at 1, 2, 3 and 4 ranks (gloo on CPU) with the same
training.global_batch_tokens train the same documents at every step, each exactly once over
the ranks, and follow the same loss trajectory, under DDP and under FSDP. Each multi-rank run
is compared with one 1-rank reference run (in this process), so each test spawns one world.

`ledger` runs in spawned ranks; the assertions stay in the tests."""

from __future__ import annotations

import itertools
import traceback
from collections import Counter

import pytest
from sharded_workers import _trainer, layout_config
from trainer_workers import _join
from worlds import run_world

GLOBAL_TOKENS = 2048  # the default at 4 ranks (256 tokens x grad_accum 2 x 4), pinned for all
STEPS = 4


def train_and_record(trainer, steps: int | None = None) -> tuple[list[float], list[list[int]], dict]:
    """Train `steps` more steps (default: to the end); per step the loss and the corpus
    indices of the documents this rank trained (read off each micro-batch as it runs), and the
    data position at the end."""
    trained: list[list[int]] = [[]]
    losses: list[float] = []
    run_micro_batch = trainer._micro_batch

    def recording(mb, **kwargs):
        if not mb.idle:
            trained[-1].extend(mb.documents.doc_ids)
        return run_micro_batch(mb, **kwargs)

    trainer._micro_batch = recording
    trainer.train(steps, on_step=lambda m: (losses.append(m.loss), trained.append([])))
    return losses, trained[:-1], trainer.state_dict()["data"]


def config(parallelism: dict, world: int):
    return layout_config(parallelism, world, training={"steps": STEPS, "global_batch_tokens": GLOBAL_TOKENS})


def ledger(rank: int, world: int, init_file: str, results, parallelism: dict) -> None:
    """A rank of a run at `parallelism`: its `train_and_record`."""
    try:
        dist = _join(rank, world, init_file)
        from longrun.commgroup import form_groups, single_node_layout

        cfg = config(parallelism, world)
        with _trainer(cfg, form_groups(single_node_layout(cfg.dims), rank)) as trainer:
            results.put((rank, *train_and_record(trainer)))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))


@pytest.fixture(scope="module")
def one_rank():
    """The reference: the same global batches on one rank, in this process."""
    import torch

    from longrun.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the ranks: the same kernels, the same float order per rank
    try:
        with Trainer(config({}, 1), "cpu", progress=False) as trainer:
            return train_and_record(trainer)
    finally:
        torch.set_num_threads(threads)


def expected_global_batches() -> list[list[int]]:
    """What every run must train: the first STEPS global batches of the one global order."""
    from longrun.trainer import ByteTokenizer, build_corpus
    from longrun.trainer.data import DocumentSampler
    from longrun.trainer.packing import global_batches

    cfg = config({}, 1)
    corpus = build_corpus(cfg.data, cfg.model, ByteTokenizer(), cfg.job.seed)
    batches = global_batches(corpus, DocumentSampler(len(corpus), seed=cfg.job.seed), GLOBAL_TOKENS)
    return [sorted(b.indices.tolist()) for b in itertools.islice(batches, STEPS)]


def test_one_rank_trains_the_global_batches_of_the_global_order(one_rank):
    losses, trained, position = one_rank
    expected = expected_global_batches()
    assert all(len(step) > 8 for step in expected)  # enough documents to share among 4 ranks
    assert [sorted(step) for step in trained] == expected
    assert all(len(set(step)) == len(step) for step in trained)
    assert set(position) == {"epoch", "index", "seed", "num_docs"}
    assert losses[-1] < losses[0]  # and it trains


@pytest.mark.parametrize(("kind", "world"), [("dp", 4), ("dp", 3), ("dp", 2), ("fsdp", 4), ("fsdp", 3)])
def test_a_run_at_n_ranks_trains_the_same_documents_and_losses_as_one_rank(kind, world, one_rank,
                                                                            tmp_path):
    """Together with the 1-rank test: runs at 4, 3 and 2 ranks with the same
    global_batch_tokens train the same documents per step and follow the same trajectory."""
    ref_losses, ref_trained, ref_position = one_rank
    out = run_world(ledger, world, tmp_path, args=({kind: world},), timeout=120)
    for rank, losses, _, position in out:
        # The gradient is that of the global batch's mean token loss whatever the rank count:
        # the same trajectory, up to float summation order; the global loss on every rank.
        assert losses == pytest.approx(ref_losses, rel=1e-4), rank
        assert position == ref_position, rank  # one position, naming no layout
    for step, want in enumerate(ref_trained):
        counts = Counter(i for _, _, trained, _ in out for i in trained[step])
        assert set(counts.values()) == {1}, (step, counts.most_common(3))  # each exactly once
        assert sorted(counts) == sorted(want), step  # the same documents as one rank
        assert all(trained[step] for _, _, trained, _ in out), step  # every rank had work
