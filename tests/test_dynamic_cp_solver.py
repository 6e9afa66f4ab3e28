"""The dynamic context-parallel planner: its invariants (every sequence once, budget kept, ranks
partitioned into aligned power-of-two groups, lock-step micro-batches, determinism), its
cost model, and that it beats a static-CP packer on a Megatron-like batch."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from longrun.config import config_from_dict
from longrun.config.sections import ModelSection
from longrun.trainer.cp.planner import (
    CostModel,
    Plan,
    SequenceTooLongError,
    megatron_lengths,
    padded_tokens_per_rank,
    plan_dynamic,
    plan_static,
)

COST = CostModel(
    linear_s_per_token=1e-6,
    attn_s_per_token2=1e-9,
    ring_block_s_per_token2=1.2e-9,
    p2p_latency_s=1e-4,
    p2p_s_per_byte=1e-9,
    kv_bytes_per_token=256,
    n_layers=4,
    micro_batch_overhead_s=1e-3,
)
PROPERTY = settings(max_examples=60, deadline=None)


def longest_fitting(max_cp: int, budget: int) -> int:
    """Longest sequence some group of size <= max_cp can hold within the budget."""
    best, c = budget, 2
    while c <= max_cp:
        best = max(best, 2 * c * (budget // 2))
        c *= 2
    return best


def largest_power_of_two(n: int) -> int:
    return 1 << (n.bit_length() - 1)


@st.composite
def batches(draw):
    """(lengths, n_ranks, budget) where every sequence fits the largest allowed CP size."""
    n_ranks = draw(st.integers(1, 16))
    budget = draw(st.integers(256, 4096))
    top = min(3000, longest_fitting(largest_power_of_two(n_ranks), budget))
    lengths = draw(st.lists(st.integers(1, top), min_size=1, max_size=300))
    return lengths, n_ranks, budget


def check_plan(plan: Plan, lengths: list[int], n_ranks: int, budget: int, max_cp: int) -> None:
    placed = collections.Counter()
    for mb in plan.micro_batches:
        assert any(g.sequences for g in mb.groups), "an empty micro-batch wastes a step"
        covered: list[int] = []
        for g in mb.groups:
            assert g.cp & (g.cp - 1) == 0 and 1 <= g.cp <= max_cp
            assert g.first_rank % g.cp == 0 and g.first_rank + g.cp <= n_ranks
            covered.extend(g.ranks)
            placed.update(g.sequences)
            assert sum(padded_tokens_per_rank(lengths[i], g.cp) for i in g.sequences) <= budget
            assert g.predicted_s == pytest.approx(COST.group_time([lengths[i] for i in g.sequences], g.cp))
        assert sorted(covered) == list(range(n_ranks)), "groups must partition the ranks"
    assert placed == collections.Counter(range(len(lengths))), "every sequence exactly once"
    # Lock-step: every rank takes part in every micro-batch.
    for rank in range(n_ranks):
        assert len(plan.for_rank(rank)) == len(plan.micro_batches)
        assert all(rank in g.ranks for g in plan.for_rank(rank))
    recomputed = sum(
        max(COST.group_time([lengths[i] for i in g.sequences], g.cp) for g in mb.groups)
        for mb in plan.micro_batches
    )
    assert plan.predicted_s == pytest.approx(recomputed, rel=1e-12)


@PROPERTY
@given(batches())
def test_dynamic_plan_invariants(batch):
    lengths, n_ranks, budget = batch
    plan = plan_dynamic(lengths, n_ranks, budget, COST)
    check_plan(plan, lengths, n_ranks, budget, largest_power_of_two(n_ranks))
    # Deterministic: the same batch, even as an array, gives an equal plan.
    assert plan_dynamic(np.array(lengths), n_ranks, budget, COST) == plan


@PROPERTY
@given(batches(), st.integers(0, 4))
def test_dynamic_plan_respects_max_cp(batch, log_cp):
    lengths, n_ranks, budget = batch
    max_cp = min(1 << log_cp, largest_power_of_two(n_ranks))
    lengths = [min(n, longest_fitting(max_cp, budget)) for n in lengths]
    plan = plan_dynamic(lengths, n_ranks, budget, COST, max_cp=max_cp)
    check_plan(plan, lengths, n_ranks, budget, max_cp)


@PROPERTY
@given(batches(), st.integers(0, 4))
def test_static_plan_invariants(batch, log_cp):
    lengths, n_ranks, budget = batch
    cp = 1 << log_cp
    while n_ranks % cp:
        cp //= 2
    # A static system has one CP size: cap lengths at what that size holds.
    lengths = [min(n, budget if cp == 1 else 2 * cp * (budget // 2)) for n in lengths]
    plan = plan_static(lengths, n_ranks, budget, COST, cp)
    check_plan(plan, lengths, n_ranks, budget, cp)
    assert all(g.cp == cp for mb in plan.micro_batches for g in mb.groups if g.sequences)
    assert plan_static(lengths, n_ranks, budget, COST, cp) == plan


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dynamic_beats_static_on_megatron_lengths(seed):
    lengths = megatron_lengths(512, np.random.default_rng(seed))
    dynamic = plan_dynamic(lengths, 16, 2048, COST)
    static = plan_static(lengths, 16, 2048, COST, 4)
    assert dynamic.predicted_s <= static.predicted_s
    # Short sequences should mostly avoid communication altogether.
    assert dynamic.summary()["sequences_per_cp"][1] > len(lengths) // 2


def test_non_power_of_two_world_uses_aligned_blocks():
    # 12 ranks (dp 3 x cp 4): a size-8 group fits only at rank 0, so two sequences that need
    # 8 ranks each cannot share a micro-batch.
    lengths = [8000, 8000, 300, 200]
    plan = plan_dynamic(lengths, 12, 1024, COST)
    check_plan(plan, lengths, 12, 1024, 8)
    big = [g for mb in plan.micro_batches for g in mb.groups if g.cp == 8]
    assert len(big) == 2 and all(g.first_rank == 0 for g in big)


def test_too_long_sequence_names_index_and_limit():
    # 4 ranks, budget 1024: a size-4 group holds 2 * 4 * 512 = 4096 tokens of one sequence.
    with pytest.raises(SequenceTooLongError) as info:
        plan_dynamic([100, 4096, 4097], 4, 1024, COST)
    message = str(info.value)
    assert "sequence 2" in message and "4097" in message and "4096" in message
    assert "token_budget" in message and "max_cp" in message
    assert (info.value.index, info.value.limit, info.value.max_cp) == (2, 4096, 4)
    with pytest.raises(SequenceTooLongError, match="sequence 0 has 2049 tokens"):
        plan_static([2049], 4, 1024, COST, 2)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_cp"):
        plan_dynamic([10], 8, 1024, COST, max_cp=3)
    with pytest.raises(ValueError, match="max_cp"):
        plan_dynamic([10], 4, 1024, COST, max_cp=8)
    with pytest.raises(ValueError, match="dividing n_ranks"):
        plan_static([10], 12, 1024, COST, 8)
    with pytest.raises(ValueError, match="sequence 1 has length 0"):
        plan_dynamic([3, 0], 2, 1024, COST)
    assert plan_dynamic([], 4, 1024, COST).micro_batches == ()


def test_plan_accessors():
    lengths = [5000, 900, 800, 50]
    plan = plan_dynamic(lengths, 8, 2048, COST)
    summary = plan.summary()
    assert summary["micro_batches"] == len(plan.micro_batches)
    assert sum(summary["sequences_per_cp"].values()) == len(lengths)
    assert summary["predicted_s"] == plan.predicted_s
    json.dumps(summary)
    with pytest.raises(IndexError):
        plan.for_rank(8)
    first = plan.micro_batches[0]
    assert first.group_of(0).first_rank == 0
    assert first.predicted_s == max(g.predicted_s for g in first.groups)


def test_cost_model_round_trip(tmp_path):
    path = tmp_path / "cost.json"
    COST.save(path)
    assert CostModel.load(path) == COST
    assert CostModel.from_json(COST.to_json()) == COST


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[]",
        json.dumps({"format": "something else"}),
        COST.to_json().replace("n_layers", "layers"),
    ],
)
def test_corrupt_cost_model_file_names_its_path(tmp_path, text):
    path = tmp_path / "cost.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=str(path)):
        CostModel.load(path)
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match=str(path)):
        CostModel.load(path)


def test_cost_model_refuses_bad_values():
    with pytest.raises(ValueError, match="p2p_latency_s"):
        CostModel(1e-6, 1e-9, 1e-9, -1.0, 1e-9, 256, 4, 1e-3)
    with pytest.raises(ValueError, match="n_layers"):
        CostModel(1e-6, 1e-9, 1e-9, 1e-4, 1e-9, 256, 0, 1e-3)


def test_cost_model_for_model_fills_constants():
    model = ModelSection(dim=128, n_heads=4, n_kv_heads=2, n_layers=3)
    cost = CostModel.for_model(
        model,
        linear_s_per_token=1e-6,
        attn_s_per_token2=1e-9,
        ring_block_s_per_token2=1e-9,
        p2p_latency_s=1e-5,
        p2p_s_per_byte=1e-10,
        micro_batch_overhead_s=1e-3,
        element_size=2,
    )
    assert cost.kv_bytes_per_token == 2 * 2 * 32 * 2 and cost.n_layers == 3


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_group_time_grows_with_length(cp):
    times = [COST.group_time([n], cp) for n in range(1, 9000, 37)]
    assert all(np.diff(times) >= 0)
    assert COST.group_time([], cp) == 0.0
    assert COST.group_time([1000, 2000], cp) > COST.group_time([2000], cp)


def test_group_time_formula():
    # cp 1: overhead + linear + attention over sum L^2.
    assert COST.group_time([100, 200], 1) == pytest.approx(1e-3 + 300e-6 + (100**2 + 200**2) * 1e-9)
    # cp 2, free communication: overhead + linear over per-rank tokens + 2 ring steps.
    free = CostModel(1e-6, 1e-9, 1.2e-9, 0.0, 0.0, 256, 4, 1e-3)
    s = padded_tokens_per_rank(1000, 2)
    assert s == 500
    assert free.group_time([1000], 2) == pytest.approx(1e-3 + s * 1e-6 + 2 * 1.2e-9 * s * s)


def test_slow_links_make_splitting_a_short_sequence_lose():
    slow = CostModel(1e-6, 1e-9, 1.2e-9, 1e-2, 1e-9, 256, 4, 1e-3)
    assert slow.group_time([512], 2) > slow.group_time([512], 1)
    # With free links, splitting a long sequence halves its attention.
    free = CostModel(1e-6, 1e-9, 1.2e-9, 0.0, 0.0, 256, 4, 1e-3)
    assert free.group_time([8192], 2) < free.group_time([8192], 1)


def test_padded_tokens_per_rank():
    assert padded_tokens_per_rank(1000, 1) == 1000
    assert padded_tokens_per_rank(1000, 2) == 500
    assert padded_tokens_per_rank(1001, 2) == 502  # padded to 1004, 4 chunks of 251
    assert padded_tokens_per_rank(1, 4) == 2


def test_megatron_lengths():
    a = megatron_lengths(10_000, np.random.default_rng(0))
    assert a.dtype == np.int64 and a.min() >= 128 and a.max() <= 8192
    assert np.array_equal(a, megatron_lengths(10_000, np.random.default_rng(0)))
    # Long-tailed: most sequences are short, a few hit the cap.
    assert np.median(a) < a.mean() and (a == 8192).any()


def test_the_trainer_plans_the_next_global_batch_in_its_data_thread(monkeypatch):
    """Planning runs in the prefetch thread, ahead of the step that trains the batch."""
    import threading

    import longrun.trainer.cp.batches as cp_batches
    from longrun.config import config_from_dict
    from longrun.trainer import Trainer

    cfg = config_from_dict({
        "job": {"name": "plan-ahead", "seed": 1}, "cluster": {"device": "cpu"},
        "parallelism": {"dynamic_cp": True},
        "model": {"dim": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64},
        "data": {"source": "synthetic", "micro_batch_tokens": 64, "prefetch": 2},
        "training": {"steps": 2, "grad_accum": 2, "warmup_steps": 1},
    })
    threads = []
    real = cp_batches.plan_global_batch

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(cp_batches, "plan_global_batch", recording)
    setup = cp_batches.one_rank_setup(COST, cfg.dims)
    with Trainer(cfg, "cpu", context_parallel=setup, progress=False) as trainer:
        metrics = trainer.train()
    assert metrics.step == 2 and np.isfinite(metrics.loss)
    assert len(threads) >= 3  # steps 1, 2 and at least the next one, planned ahead
    assert set(threads) == {"longrun-prefetch"}


def test_bad_context_parallel_setups_are_refused_with_the_reason():
    """The CP package creates no process group: a setup wider than one rank needs commgroup's
    groups, which need a world; an attention object needs a layout of its group's size."""
    import torch

    from longrun.commgroup import form_groups, single_node_layout
    from longrun.parallel.dims import ParallelDims
    from longrun.trainer.cp.attention import ContextParallelAttention, CPGroups
    from longrun.trainer.cp.batches import one_rank_setup
    from longrun.trainer.cp.layout import ShardLayout

    with pytest.raises(ValueError, match="needs a span of 1 rank, got 4; form the groups with commgroup"):
        one_rank_setup(COST, ParallelDims(dp=2, cp=2))
    with pytest.raises(RuntimeError, match="needs an initialised world of 4 ranks"):
        form_groups(single_node_layout(ParallelDims(dp=2, cp=2, cp_impl="ulysses")), 0)
    with pytest.raises(ValueError, match="layout for CP 2 used with a CP group of 1"):
        ContextParallelAttention(ShardLayout(np.array([5, 9]), 2, True), CPGroups.alone(),
                                 torch.device("cpu"))


def test_the_h100_paper_model_counts_the_real_models_matmuls_and_prices_the_links():
    """The on-paper H100 cost model (bench/dynamic_cp.py --calibration h100-paper) counts the
    same matmul parameters as the real decoder, and a slower link only adds exposed transfer."""
    from longrun.trainer.cp.published import GEMM_FLOPS, h100_cost_model
    from longrun.trainer.model import Transformer

    cfg = config_from_dict({"job": {"name": "paper"}, "model": {
        "dim": 128, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 256, "tie_embeddings": False}})
    nvlink, ib = h100_cost_model(cfg.model), h100_cost_model(cfg.model, link="ib")
    matmuls = sum(p.numel() for name, p in Transformer(cfg.model).named_parameters()
                  if p.dim() == 2 and not name.startswith("tok_embeddings"))  # not the lookup, nor norms
    assert nvlink.linear_s_per_token == pytest.approx(6 * matmuls / GEMM_FLOPS)
    assert nvlink.kv_bytes_per_token == 2 * 2 * 32 * 2  # K and V, 2 KV heads of 32, bf16
    assert ib.p2p_s_per_byte > nvlink.p2p_s_per_byte and ib.attn_s_per_token2 == nvlink.attn_s_per_token2
    lengths = np.array([4096, 4096])
    assert ib.group_time(lengths, 4) > nvlink.group_time(lengths, 4)
    assert ib.group_time(lengths, 1) == nvlink.group_time(lengths, 1)  # no ring: no link
