"""Placement: workers reserved node by node in one placement group, never on evicted or
dead nodes, and a job the cluster can never hold is a clear error, not an eternal PENDING."""

from __future__ import annotations

import time

import pytest
from clusters import simulated_cluster

from longrun.config import config_from_dict
from longrun.controller.placement import (
    NodeInfo,
    PlacementImpossible,
    bundle_nodes,
    choose_nodes,
    place,
    placeable_nodes,
    spare_nodes,
)


def job(nodes: int = 2, per_node: int = 2):
    return config_from_dict({"job": {"name": "place"}, "cluster": {
        "nodes": nodes, "workers_per_node": per_node, "device": "cpu"},
        "parallelism": {"dp": nodes * per_node}})


def node(i: int, total: float = 2, free: float | None = None) -> NodeInfo:
    return NodeInfo(f"id{i}", f"10.0.0.{i}", {"CPU": total}, {"CPU": total if free is None else free})


def test_choose_nodes_skips_evicted_and_small_nodes_and_prefers_free_ones():
    nodes = [node(1, free=0), node(2, total=1), node(3), node(4)]
    chosen = choose_nodes(job(), nodes, evicted=["id4"])
    # id2 can never hold 2 workers; id4 is evicted; id3 is free now, so it comes first.
    assert [n.node_id for n in chosen] == ["id3", "id1"]


def test_choose_nodes_for_a_partial_re_placement_returns_only_the_missing_nodes():
    nodes = [node(1, free=0), node(2, free=0), node(3, free=0), node(4)]
    # The job keeps id2 (its own node, busy with its workers) and needs one node besides it.
    assert [n.node_id for n in choose_nodes(job(), nodes, evicted=["id1"], taken=["id2"])] == ["id4"]
    # Counted as a whole placement would be: id2 is the job's own, id3 is busy, id1 evicted.
    with pytest.raises(PlacementImpossible) as info:
        choose_nodes(job(nodes=3), nodes, evicted=["id1", "id4"], taken=["id2"])
    assert "has 2 such node(s)" in str(info.value)
    assert (info.value.available, info.value.existing) == (1, 2)


def test_nodes_placed_again_take_the_old_ones_places_and_a_group_no_rank_uses_goes(monkeypatch):
    from longrun.controller import placement as placing

    made, removed = [], []

    def reserve(cfg, nodes, name, *args):
        made.append(tuple(n.node_id for n in nodes))
        return f"group{len(made)}"

    monkeypatch.setattr(placing, "alive_nodes", lambda: [node(1), node(2), node(3), node(4)])
    monkeypatch.setattr(placing, "_reserve", reserve)
    monkeypatch.setattr(placing, "remove_placement_group", removed.append)
    first = placing.Placement(["group0"], ("id1", "id2"), 2, {"id1": "one", "id2": "two"})
    assert first.slots == [(0, 0), (0, 1), (0, 2), (0, 3)]

    second = placing.place_again(first, job(), [0], evicted=["id1"])
    assert made == [("id3",)] and second.node_ids == ("id3", "id2")
    assert second.groups == ["group0", "group1"] and removed == []
    assert second.slots == [(1, 0), (1, 1), (0, 2), (0, 3)]  # ranks 2-3 keep their bundles
    assert second.names == {"id3": "10.0.0.3", "id2": "two"}
    assert first.node_ids == ("id1", "id2") and first.groups == ["group0"]  # left as it was

    # Node 2 goes too: no rank is left in the job's first group, which is removed.
    third = placing.place_again(second, job(), [1], evicted=["id1", "id2"])
    assert made[-1] == ("id4",) and third.node_ids == ("id3", "id4")
    assert removed == ["group0"] and third.groups == ["group1", "group2"]
    assert third.slots == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_choose_nodes_explains_an_impossible_job():
    with pytest.raises(PlacementImpossible) as info:
        choose_nodes(job(nodes=3), [node(1), node(2), node(3, total=1)], evicted=["id1"])
    msg = str(info.value)
    assert "needs 3 node(s) with 2 CPU each" in msg and "has 1 such node(s)" in msg
    assert "1 evicted" in msg


def test_spare_nodes_count_free_resources_not_totals():
    # id1 and id2 run the job; id3 is free; id4 is alive but another job holds its cores.
    nodes = [node(1, free=0), node(2, free=0), node(3), node(4, free=0), node(5, free=1)]
    assert spare_nodes(job(), nodes, own=["id1", "id2"]) == 1  # id4 busy, id5 too small now
    assert spare_nodes(job(), nodes, evicted=["id3"], own=["id1", "id2"]) == 0
    # With no placement of its own, the job needs cluster.nodes free nodes first.
    assert spare_nodes(job(), [node(1), node(2), node(3), node(4, free=0)]) == 1


def test_placeable_nodes_count_the_jobs_own_just_released_nodes_as_free():
    nodes = [node(1, free=0), node(2, free=0), node(3), node(4, free=0)]
    assert placeable_nodes(job(), nodes) == 1
    # id1 and id2 are the placement the job just gave back: Ray's view of them trails the release.
    assert placeable_nodes(job(), nodes, held=["id1", "id2"]) == 3
    assert placeable_nodes(job(), nodes, evicted=["id3"], held=["id1"]) == 1


def test_an_impossible_job_says_how_many_nodes_could_be_placed_now_and_how_many_exist():
    with pytest.raises(PlacementImpossible) as info:
        choose_nodes(job(nodes=3), [node(1), node(2, free=0), node(3, total=1)])
    assert (info.value.available, info.value.existing) == (1, 2)
    with pytest.raises(PlacementImpossible) as info:
        choose_nodes(job(nodes=3), [node(1), node(2, free=0)], held=["id2"])
    assert (info.value.available, info.value.existing) == (2, 2)


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(3, 2) as (c, workers):
        yield c, workers


def test_placement_on_a_three_node_cluster(cluster):
    import ray

    c, workers = cluster
    first = place(job(), timeout_s=60)
    try:
        on = bundle_nodes(first)
        # Ranks 0-1 share a node, ranks 2-3 share another: the order the topology assumes.
        assert on == [first.node_ids[0]] * 2 + [first.node_ids[1]] * 2
        assert len(set(first.node_ids)) == 2
        assert [first.node_of(r) for r in range(4)] == on
    finally:
        first.remove()

    evicted = first.node_ids[0]
    second = place(job(), evicted=[evicted], timeout_s=60)
    try:
        assert evicted not in bundle_nodes(second)

        @ray.remote(num_cpus=1)
        def where():
            return ray.get_runtime_context().get_node_id()

        got = ray.get([where.options(scheduling_strategy=second.strategy(r)).remote() for r in range(4)])
        assert got == bundle_nodes(second)  # each rank's actor runs where its bundle is
    finally:
        second.remove()

    with pytest.raises(PlacementImpossible, match="has 2 such node"):
        place(job(nodes=3), evicted=[evicted], timeout_s=5)

    # A node that leaves the cluster is not chosen again.
    gone = next(w for w in workers if w.node_id != evicted)
    c.remove_node(gone)
    deadline = time.monotonic() + 60  # until the GCS has noticed the node is gone
    while any(n["Alive"] for n in ray.nodes() if n["NodeID"] == gone.node_id):
        assert time.monotonic() < deadline, "Ray never marked the removed node dead"
        time.sleep(0.1)
    with pytest.raises(PlacementImpossible):
        place(job(nodes=2), evicted=[evicted], timeout_s=5)
