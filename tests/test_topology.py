"""Rank layout properties, checked over many shapes with hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from longrun.commgroup.topology import GROUP_KINDS, NodeSpec, ParallelDims, make_layout

pow2 = st.sampled_from([1, 2, 4, 8])


@st.composite
def layouts(draw):
    dims = ParallelDims(dp=draw(st.integers(1, 6)), cp=draw(pow2), tp=draw(pow2), pp=draw(st.integers(1, 3)))
    # Node sizes that tp divides (the realistic case) or not (tp larger than a node).
    per_node = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16) if dims.world_size % d == 0]))
    n_nodes = dims.world_size // per_node
    racks = draw(st.lists(st.sampled_from("abc"), min_size=n_nodes, max_size=n_nodes))
    nodes = [NodeSpec(name=f"n{i:03d}", rack=r) for i, r in enumerate(racks)]
    draw(st.randoms()).shuffle(nodes)
    return make_layout(nodes, per_node, dims)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_every_rank_in_exactly_one_group_of_each_kind(layout):
    world = set(range(layout.world_size))
    d = layout.dims
    sizes = {"tp": d.tp, "cp": d.cp, "pp": d.pp, "dp": d.dp, "dp_cp": d.dp * d.cp}
    for kind in GROUP_KINDS:
        groups = layout.groups[kind]
        members = [r for g in groups for r in g]
        assert sorted(members) == sorted(world), kind
        assert all(len(g) == sizes[kind] for g in groups), kind
        assert len(groups) * sizes[kind] == layout.world_size


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_sizes_multiply_to_the_world_and_coords_round_trip(layout):
    d = layout.dims
    assert d.dp * d.cp * d.tp * d.pp == layout.world_size
    for rank in range(layout.world_size):
        assert layout.rank_of(layout.coords(rank)) == rank


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_tp_stays_inside_a_node_when_it_fits(layout):
    if layout.workers_per_node % layout.dims.tp == 0:
        assert not layout.tp_crosses_nodes()


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_groups_vary_only_their_own_dimension(layout):
    for kind in ("tp", "cp", "pp", "dp"):
        for group in layout.groups[kind]:
            coords = [layout.coords(r) for r in group]
            for other in ("tp", "cp", "pp", "dp"):
                if other != kind:
                    assert len({getattr(c, other) for c in coords}) == 1


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_dynamic_cp_groups_partition_each_dp_cp_group(layout):
    span = layout.dims.dp * layout.dims.cp
    assert 1 in layout.dynamic_cp_groups
    for size, groups in layout.dynamic_cp_groups.items():
        assert size & (size - 1) == 0 and span % size == 0
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size))
        for g in groups:
            parent = layout.group_of("dp_cp", g[0])
            assert set(g) <= set(parent)
            assert all(layout.dynamic_cp_group_of(size, r) == g for r in g)
    # Groups no larger than cp stay inside one model replica.
    for size, groups in layout.dynamic_cp_groups.items():
        if size <= layout.dims.cp:
            for g in groups:
                assert len({layout.coords(r).dp for r in g}) == 1


def test_nodes_are_ordered_by_zone_and_rack():
    nodes = [NodeSpec("z", rack="r2"), NodeSpec("a", rack="r1"), NodeSpec("m", rack="r1")]
    layout = make_layout(nodes, 2, ParallelDims(dp=3, tp=2))
    assert [n.name for n in layout.nodes] == ["a", "m", "z"]
    assert layout.node_of(0).name == "a" and layout.node_of(5).name == "z"
    assert layout.local_rank(3) == 1


def test_llama_style_example():
    # 2 nodes x 8 GPUs, tp 8, cp 2, dp 1: TP is the node, CP pairs across the two nodes.
    layout = make_layout([NodeSpec("a"), NodeSpec("b")], 8, ParallelDims(dp=1, cp=2, tp=8))
    assert layout.groups["tp"] == [list(range(8)), list(range(8, 16))]
    assert layout.groups["cp"][0] == [0, 8]


@pytest.mark.parametrize("nodes, per_node, dims, needle", [
    ([NodeSpec("a")], 4, ParallelDims(dp=2), "must match"),
    ([NodeSpec("a"), NodeSpec("a")], 1, ParallelDims(dp=2), "unique"),
    ([NodeSpec("a")], 0, ParallelDims(dp=1), "workers_per_node"),
])
def test_bad_layouts(nodes, per_node, dims, needle):
    with pytest.raises(ValueError, match=needle):
        make_layout(nodes, per_node, dims)


def test_group_lookup_rejects_unknown_ranks_and_sizes():
    layout = make_layout([NodeSpec("a")], 4, ParallelDims(dp=2, cp=2))
    with pytest.raises(KeyError, match="not in the world of 4"):
        layout.group_of("tp", 4)
    with pytest.raises(KeyError, match="no dynamic-CP groups of size 8"):
        layout.dynamic_cp_group_of(8, 0)


def test_bad_dims():
    with pytest.raises(ValueError, match="tp must be >= 1"):
        ParallelDims(tp=0)
