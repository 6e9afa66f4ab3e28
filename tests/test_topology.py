"""Rank layout properties, checked over many shapes with hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from longrun.commgroup.topology import GROUP_KINDS, NodeSpec, make_layout, single_node_layout
from longrun.parallel.dims import ParallelDims

pow2 = st.sampled_from([1, 2, 4, 8])


@st.composite
def layouts(draw):
    dims = ParallelDims(dp=draw(st.integers(1, 6)), fsdp=draw(st.sampled_from([1, 1, 2])), cp=draw(pow2),
                        tp=draw(pow2), pp=draw(st.integers(1, 3)), dynamic_cp=draw(st.booleans()),
                        cp_impl=draw(st.sampled_from(["ring", "ulysses", "usp"])),
                        heads=draw(st.sampled_from([None, 1, 2, 4, 6, 8, 16])))
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
    sizes = {"tp": d.tp, "cp": d.cp, "pp": d.pp, "fsdp": d.fsdp, "dp": d.dp, "replicate": d.dp * d.cp,
             "dp_cp": d.dp * d.fsdp * d.cp}
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
    assert d.dp * d.fsdp * d.cp * d.tp * d.pp == layout.world_size
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
    for kind in ("tp", "cp", "pp", "fsdp", "dp"):
        for group in layout.groups[kind]:
            coords = [layout.coords(r) for r in group]
            for other in ("tp", "cp", "pp", "fsdp", "dp"):
                if other != kind:
                    assert len({getattr(c, other) for c in coords}) == 1


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_replicate_groups_hold_one_shard_of_each_replica(layout):
    """The HSDP mesh's outer dimension: the ranks with the same FSDP shard (and tp, pp)
    position across replicas and CP ranks; with the shard group they tile the span."""
    for group in layout.groups["replicate"]:
        coords = [layout.coords(r) for r in group]
        assert len({(c.fsdp, c.tp, c.pp) for c in coords}) == 1
        assert len({(c.dp, c.cp) for c in coords}) == len(group)
    for rank in range(layout.world_size):
        span = set(layout.group_of("dp_cp", rank))
        tiles = {r for s in layout.group_of("fsdp", rank) for r in layout.group_of("replicate", s)}
        assert tiles == span


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_the_mesh_is_the_groups_and_replicas_share_a_shard_index(layout):
    """Every line of the [replicate][shard][tp] mesh along one axis is a group of that kind, so
    a device mesh can be built on the groups already formed; ranks of one replicate group
    hold the same piece of the weights, and the pieces of one span's replica are all different."""
    if layout.dims.pp > 1:
        return
    mesh = layout.mesh()
    flat = [r for plane in mesh for row in plane for r in row]
    assert sorted(flat) == list(range(layout.world_size))
    d = layout.dims
    for plane in mesh:
        for s, row in enumerate(plane):
            assert row == layout.group_of("tp", row[0])
            for t, rank in enumerate(row):
                assert [p[s][t] for p in mesh] == layout.group_of("replicate", rank)
                assert [plane[k][t] for k in range(d.fsdp)] == layout.group_of("fsdp", rank)
                assert layout.shard_index(rank) == s * d.tp + t
    for group in layout.groups["replicate"]:
        assert len({layout.shard_index(r) for r in group}) == 1


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_dynamic_cp_groups_partition_each_dp_cp_group(layout):
    span = layout.dims.span
    assert 1 in layout.dynamic_cp_groups
    for size, groups in layout.dynamic_cp_groups.items():
        assert size & (size - 1) == 0 and span % size == 0
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size))
        for g in groups:
            parent = layout.group_of("dp_cp", g[0])
            assert set(g) <= set(parent)
            assert all(layout.dynamic_cp_group_of(size, r) == g for r in g)
    # Groups no larger than cp stay inside one model replica (and one shard).
    for size, groups in layout.dynamic_cp_groups.items():
        if size <= layout.dims.cp:
            for g in groups:
                assert len({(layout.coords(r).dp, layout.coords(r).fsdp) for r in g}) == 1
    if layout.dims.cp in layout.dynamic_cp_groups:  # the size-cp sub-groups are the cp groups
        assert sorted(layout.dynamic_cp_groups[layout.dims.cp]) == sorted(layout.groups["cp"])


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_every_named_group_partitions_the_world_in_one_canonical_order(layout):
    names = [name for name, _ in layout.named_groups]
    assert names[:2] == ["tp", "cp"] and len(set(names)) == len(names)
    # No shard communicator where nothing is sharded; under TP the mesh needs one (of one rank).
    assert ("fsdp" in names) == (layout.dims.fsdp > 1 or layout.dims.tp > 1)
    assert "replicate" in names
    for name, groups in layout.named_groups:
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size)), name
    for rank in range(layout.world_size):
        mine = layout.groups_of(rank)
        assert [n for n, _ in mine] == names  # every rank walks the same order
        assert all(rank in members and members == layout.group_of(n, rank) for n, members in mine)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_every_rank_creates_its_communicators_under_the_same_names_in_the_same_order(layout):
    # On NCCL each new group is a split of the world's communicator that every rank makes,
    # matched by position: the k-th communicator of every rank must be the same name's group.
    plans = [layout.communicators_of(rank) for rank in range(layout.world_size)]
    names = [n for n, _ in plans[0]]
    for rank, plan in enumerate(plans):
        assert [n for n, _ in plan] == names, rank
        mine = dict(layout.groups_of(rank))
        assert all(mine[n] == members for n, members in plan)
        # Every group of this rank is the world or one of these communicators, none twice.
        lists = [tuple(m) for _, m in plan]
        assert len(set(lists)) == len(lists) and tuple(range(layout.world_size)) not in lists
        assert {tuple(m) for m in mine.values()} <= set(lists) | {tuple(range(layout.world_size))}
    # Each position is one group name's partition of the world: every rank of the world in one
    # of its groups, so a split's colours are complete.
    for k, name in enumerate(names):
        covered = sorted(r for g in {tuple(p[k][1]) for p in plans} for r in g)
        assert covered == list(range(layout.world_size)), name


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_usp_sub_groups_split_each_cp_group_into_ulysses_blocks_and_rings(layout):
    d = layout.dims
    for size in d.cp_sizes:
        u = d.ulysses_degree(size)
        has = f"uly{size}" in layout.attention_groups
        assert has == (1 < u < size), (size, u)  # pure ring or pure Ulysses: the CP group is enough
        if not has:
            continue
        for cp_group in layout.cp_groups(size):
            ulysses = [g for g in layout.attention_groups[f"uly{size}"] if g[0] in cp_group]
            rings = [g for g in layout.attention_groups[f"ring{size}"] if g[0] in cp_group]
            # CP-rank j = ring_index * u + ulysses_index: blocks of u consecutive CP ranks,
            # rings of the ranks at the same offset in each block.
            assert ulysses == [cp_group[i:i + u] for i in range(0, size, u)]
            assert rings == [cp_group[j::u] for j in range(u)]
    if d.cp_impl == "ring":
        assert layout.attention_groups == {}


def test_a_dynamic_usp_layout_names_its_groups():
    layout = single_node_layout(ParallelDims(dp=2, cp=4, dynamic_cp=True, cp_impl="usp", heads=4))
    assert layout.attention_groups == {
        "uly4": [[0, 1], [2, 3], [4, 5], [6, 7]], "ring4": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "uly8": [[0, 1], [2, 3], [4, 5], [6, 7]], "ring8": [[0, 2, 4, 6], [1, 3, 5, 7]],
    }  # groups of 2 are pure Ulysses (u = 2): no sub-groups
    assert [n for n, _ in layout.groups_of(5)][-4:] == ["uly4", "ring4", "uly8", "ring8"]


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
    with pytest.raises(KeyError, match="no group named 'uly4'"):
        layout.group_of("uly4", 0)
    with pytest.raises(KeyError, match="no CP groups of size 8"):
        layout.cp_groups(8)


def test_bad_dims():
    with pytest.raises(ValueError, match="tp must be >= 1"):
        ParallelDims(tp=0)
