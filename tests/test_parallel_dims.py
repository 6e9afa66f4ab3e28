"""The one parallel-dims object: derived sizes checked over many shapes with hypothesis, the
config building it, and the choices it makes for Ulysses and USP."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from longrun.config import config_from_dict
from longrun.parallel.dims import (
    ParallelDims,
    is_power_of_two,
    padded_tokens_per_rank,
    parallel_dims,
    power_of_two_divisors,
    usp_ulysses_size,
)

PROPERTY = settings(max_examples=200, deadline=None)

dims_st = st.builds(
    ParallelDims, dp=st.integers(1, 12), fsdp=st.integers(1, 4), cp=st.integers(1, 16),
    tp=st.integers(1, 8), pp=st.integers(1, 4), dynamic_cp=st.booleans(),
    cp_impl=st.sampled_from(["ring", "ulysses", "usp"]), heads=st.one_of(st.none(), st.integers(1, 64)))


@PROPERTY
@given(dims_st)
def test_world_and_span_multiply_the_degrees(d):
    assert d.world_size == d.dp * d.fsdp * d.cp * d.tp * d.pp
    assert d.span == d.dp * d.fsdp * d.cp and d.world_size % d.span == 0
    assert d.cp_enabled == (d.cp > 1 or d.dynamic_cp)


@PROPERTY
@given(st.integers(1, 10_000))
def test_power_of_two_divisors_are_every_aligned_block_size(n):
    sizes = power_of_two_divisors(n)
    assert sizes[0] == 1 and all(is_power_of_two(s) and n % s == 0 for s in sizes)
    assert list(sizes) == [1 << k for k in range(len(sizes))]  # no gaps
    assert n % (2 * sizes[-1]) != 0  # the largest: twice it does not divide


@PROPERTY
@given(dims_st)
def test_cp_sizes_are_static_cp_or_the_powers_of_two_dividing_the_span(d):
    if d.dynamic_cp:
        assert d.cp_sizes == power_of_two_divisors(d.span)
        assert d.widest_cp == d.span & -d.span
    else:
        assert d.cp_sizes == (d.cp,) and d.widest_cp == d.cp


@PROPERTY
@given(dims_st)
def test_the_ulysses_degree_divides_the_group_and_the_heads(d):
    for size in {*d.cp_sizes, 1, 2, 4, 8}:
        u = d.ulysses_degree(size)
        assert size % u == 0
        if d.cp_impl == "ring" or size == 1:
            assert u == 1
        if d.heads:
            assert d.heads % u == 0
        if d.cp_impl == "ulysses" and (d.heads is None or d.heads % size == 0):
            assert u == size  # heads to spare: the whole group splits them
        assert d.attention_impl(size) == ("ring" if u == 1 else "ulysses" if u == size else "usp")


@PROPERTY
@given(st.integers(1, 100_000), dims_st)
def test_the_padded_share_holds_a_sequence_in_zigzag_halves(length, d):
    share, w = d.padded_share(length), d.widest_cp
    assert share == padded_tokens_per_rank(length, w)
    if w == 1:
        assert share == length
    else:
        assert share % 2 == 0 and length <= share * w < length + 2 * w


@pytest.mark.parametrize("cp, heads, u", [(4, 4, 2), (8, 8, 2), (16, 16, 4), (4, 1, 1), (2, 8, 1)])
def test_usp_uses_both_dimensions(cp, heads, u):
    assert usp_ulysses_size(cp, heads) == u
    assert ParallelDims(cp=cp, cp_impl="usp", heads=heads).ulysses_degree(cp) == u


def test_a_group_wider_than_the_heads_rings_what_does_not_split():
    d = ParallelDims(dp=4, cp=2, dynamic_cp=True, cp_impl="ulysses", heads=2)
    assert [d.attention_impl(s) for s in d.cp_sizes] == ["ring", "ulysses", "usp", "usp"]
    assert [d.ulysses_degree(s) for s in d.cp_sizes] == [1, 2, 2, 2]


def test_the_config_builds_the_dims_once_and_checks_read_them():
    cfg = config_from_dict({
        "job": {"name": "dims"},
        "cluster": {"workers_per_node": 6},
        "parallelism": {"dp": 3, "cp": 2, "dynamic_cp": True, "cp_impl": "usp"},
        "model": {"max_seq_len": 1000, "n_heads": 4, "dim": 64},
        "data": {"micro_batch_tokens": 500},
    })
    dims = parallel_dims(cfg)
    assert dims == cfg.dims == ParallelDims(dp=3, cp=2, dynamic_cp=True, cp_impl="usp", heads=4)
    assert cfg.world_size == dims.world_size == 6 == cfg.cluster.workers
    assert dims.cp_sizes == (1, 2) and dims.padded_share(1000) == 500


@pytest.mark.parametrize("kwargs, needle", [
    ({"tp": 0}, "tp must be >= 1"),
    ({"fsdp": -1}, "fsdp must be >= 1"),
    ({"cp_impl": "zigzag"}, "cp_impl must be one of"),
])
def test_bad_dims_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ParallelDims(**kwargs)
