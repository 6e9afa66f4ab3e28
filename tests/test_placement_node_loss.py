"""Placing workers while nodes come and go, on a simulated 3-node cluster: an evicted node is
placed again alone, and the warm spares on the job's other nodes serve their ranks; while Ray
still lists a lost node as alive (its health checks have not given up yet), a reservation
pinned to a node that dies is chosen again among the live ones instead of waiting out its
timeout, and a warm spare that died before its attempt started costs its rank a fresh worker,
not a restart. And a reservation waiting on busy nodes is given up as soon as the job is asked to
stop."""

from __future__ import annotations

import threading
import time

import pytest
import ray
from clusters import simulated_cluster
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from longrun.config import config_from_dict
from longrun.controller.placement import (
    PlacementCancelled,
    PlacementImpossible,
    alive_nodes,
    bundle_nodes,
    place,
)
from longrun.controller.workers import RayLauncher


def job(name: str = "placement-loss", memory_interval_steps: int = 0):
    return config_from_dict({
        "job": {"name": name},
        "cluster": {"nodes": 2, "workers_per_node": 2, "device": "cpu"},
        "parallelism": {"dp": 4},
        "checkpoint": {"memory_interval_steps": memory_interval_steps},
    })


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(3, 2) as (c, workers):
        yield c, workers


@ray.remote(num_cpus=2)
class Occupier:
    """Holds a node's every CPU, as another job's workers would."""

    def ready(self) -> bool:
        return True


def occupy(node_id: str):
    actor = Occupier.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
    ray.get(actor.ready.remote(), timeout=60)
    return actor


def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.1)  # polling Ray's control store, which has no notification for it


def answers_dead(actor) -> bool:
    try:
        ray.get(actor.node_id.remote(), timeout=60)
    except RayActorError:
        return True
    return False


def pending_group(name: str) -> bool:
    return any(g["name"] == name and g["state"] == "PENDING"
               for g in ray.util.placement_group_table().values())


@pytest.mark.timeout(300)
def test_an_evicted_node_is_placed_again_alone_and_the_other_nodes_spares_take_their_ranks(cluster):
    cfg = job("evict-one")
    launcher = RayLauncher(spares=True)
    url = "redis://127.0.0.1:1/0"
    try:
        first = launcher(cfg, attempt=0, redis_url=url, evicted=(), resume_before_step=None, timeout_s=60)
        launcher.warm_spares()
        ray.get(launcher._warming, timeout=120)
        spares = list(launcher._spares)
        bad, kept = first.node_ids
        first_group = launcher.placement.groups[0].id.hex()
        first.stop()

        second = launcher(cfg, attempt=1, redis_url=url, evicted=[bad], resume_before_step=None, timeout_s=60)
        placement = second.placement
        new = placement.node_ids[0]
        assert new not in (bad, kept) and placement.node_ids[1] == kept
        # Ranks 2-3 (the kept node) are served by their warm spares; ranks 0-1 start fresh.
        assert all(actor is spare for actor, spare in zip(second.actors[2:], spares[2:], strict=True))
        assert not any(actor is spare for actor in second.actors[:2] for spare in spares)
        where = ray.get([a.node_id.remote() for a in second.actors], timeout=60)
        assert where == bundle_nodes(placement) == [new, new, kept, kept]
        # The kept node's ranks are still in the job's first group; the new node has its own.
        assert len(placement.groups) == 2 and placement.groups[0].id.hex() == first_group
        assert [g for g, _ in placement.slots] == [1, 1, 0, 0]
        groups = [g.id.hex() for g in placement.groups]
        second.stop()

        # The kept node evicted too leaves one eligible node of three: a clear error, and a
        # failed re-placement lets everything go (nothing of the job stays reserved).
        launcher.warm_spares()
        ray.get(launcher._warming, timeout=120)
        with pytest.raises(PlacementImpossible, match="has 1 such node"):
            launcher(cfg, attempt=2, redis_url=url, evicted=[bad, kept], resume_before_step=None, timeout_s=5)
        assert launcher.placement is None and launcher._spares == []
        states = {g["placement_group_id"]: g["state"] for g in ray.util.placement_group_table().values()}
        assert all(states.get(g) == "REMOVED" for g in groups), states
    finally:
        launcher.release()


@pytest.mark.timeout(300)
def test_a_reservation_pinned_to_a_node_that_dies_is_chosen_again_among_the_live(cluster):
    c, workers = cluster
    by_id = {w.node_id: w for w in workers}
    # Nodes in the order placement considers them: the job's just-released node `lost` (counted
    # free, though another job's actor fills it), a free one, and a busy one.
    lost, free, busy = (n.node_id for n in alive_nodes() if n.node_id in by_id)
    blockers = [occupy(lost), occupy(busy)]
    result: dict = {}

    def placing():
        try:
            result["placement"] = place(job(), timeout_s=240, name="pinned-to-lost", held=[lost])
        except Exception as exc:  # reported by the assertion below
            result["error"] = exc
    thread = threading.Thread(target=placing, daemon=True)
    thread.start()
    wait_until(lambda: pending_group("pinned-to-lost"), "the reservation pending on the held node")
    ray.kill(blockers[1])  # the busy node frees up: room enough without the lost one
    c.remove_node(by_id[lost])
    thread.join(240)
    assert not thread.is_alive() and "error" not in result, result
    placement = result["placement"]
    try:
        assert sorted(placement.node_ids) == sorted([free, busy])
        assert sorted(set(bundle_nodes(placement))) == sorted([free, busy])
    finally:
        placement.remove()


@pytest.mark.timeout(300)
def test_a_warm_spare_that_died_costs_its_rank_a_fresh_worker_not_a_restart(cluster):
    # The first test's nodes are what is left: whichever two are alive and free.
    wait_until(lambda: sum(n.available.get("CPU", 0) for n in alive_nodes()) >= 4, "two free nodes")
    cfg = job("spare-died")
    launcher = RayLauncher(spares=True)
    try:
        first = launcher(cfg, attempt=0, redis_url="redis://127.0.0.1:1/0", evicted=(),
                         resume_before_step=None, timeout_s=60)
        launcher.warm_spares()
        ray.get(launcher._warming, timeout=120)
        spares = list(launcher._spares)
        dead = spares[3]
        ray.kill(dead, no_restart=True)  # after its warm-up answered: it looks ready
        # ray.kill goes through Ray's control store while a call goes straight to the actor, so
        # a call made just after the kill may still be answered: wait until the spare says dead.
        wait_until(lambda: answers_dead(dead), "the killed spare answering as dead")
        first.stop()
        second = launcher(cfg, attempt=1, redis_url="redis://127.0.0.1:1/0", evicted=(),
                          resume_before_step=None, timeout_s=60)
        assert dead not in second.actors
        # The other spares serve their ranks (a launch that failed on the dead one started all
        # four afresh).
        assert all(actor is spare for actor, spare in zip(second.actors[:3], spares[:3], strict=True))
        where = ray.get([a.node_id.remote() for a in second.actors], timeout=60)
        assert where == bundle_nodes(second.placement)
        second.stop()
    finally:
        launcher.release()


@pytest.mark.timeout(300)
def test_a_pending_reservation_is_given_up_when_the_job_is_asked_to_stop(cluster):
    # Whatever nodes the tests before left: all of them busy with another job's actors.
    wait_until(lambda: sum(n.available.get("CPU", 0) for n in alive_nodes()) >= 4, "the nodes free")
    blockers = [occupy(n.node_id) for n in alive_nodes() if n.total.get("CPU", 0) >= 2]
    stop = threading.Event()
    result: dict = {}

    def placing():
        try:
            result["placement"] = place(job(), timeout_s=240, name="asked-to-stop", cancelled=stop.is_set)
        except Exception as exc:  # reported by the assertions below
            result["error"] = exc
    thread = threading.Thread(target=placing, daemon=True)
    try:
        thread.start()
        wait_until(lambda: pending_group("asked-to-stop"), "the reservation pending on busy nodes")
        stop.set()  # the scheduler's SIGTERM, as the controller hears it
        thread.join(60)  # far below the placement's own 240 s timeout
        assert not thread.is_alive(), "the pending reservation did not hear the stop"
        assert isinstance(result.get("error"), PlacementCancelled), result
        assert not pending_group("asked-to-stop")  # removed, not left to grab the nodes later
    finally:
        for blocker in blockers:
            ray.kill(blocker)
