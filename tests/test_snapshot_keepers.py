"""The controller's side of memory snapshots without Ray (issue 26, holes 2, 9 and 10a): a stop
between attempts commits what the keepers hold and says so; a resize commits the old layout's
snapshots before the keepers forget them; keepers on nodes the job left are let go."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest
from controller_fakes import Launcher, drive_to_running, job, make_rig

from longrun.config import config_from_dict
from longrun.controller import keepers as keepers_mod
from longrun.controller.elastic import layout_key
from longrun.controller.keepers import Keepers
from longrun.controller.state import JobState
from longrun.controller.workers import RankEnded, RayLauncher


class KeepingLauncher(Launcher):
    """A launcher whose keepers hold a snapshot newer than the newest checkpoint."""

    def __init__(self, clock, outcome):
        super().__init__(clock)
        self.outcome, self.persisted = outcome, []

    def persist_snapshots(self, *, before_step, timeout_s):
        self.persisted.append({"before_step": before_step, "released": self.released})
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


def _stopped_while_recovering(redis_url, outcome):
    make, _, clock, _ = make_rig(redis_url)
    launcher = KeepingLauncher(clock, outcome)
    c = make(job(f"snap-stop-{uuid.uuid4().hex[:8]}"))
    c.launch = launcher
    drive_to_running(c)
    launcher.groups[0].script.append([RankEnded(2, kind="dead", detail="rank 2's process died")])
    assert c.step() is JobState.RECOVERING
    c.request_preemption("SIGTERM")  # the scheduler's, during the backoff
    assert c.step() is JobState.PREEMPTED
    return c, launcher


@pytest.mark.parametrize("outcome, says", [
    ((12, 8), "the memory snapshot of step 12 (newer than the newest checkpoint, step 8) is committed"),
    ((None, 8), "no memory snapshot is newer than the newest committed checkpoint (step 8)"),
    (TimeoutError("keepers too slow"), "could not be saved (TimeoutError: keepers too slow)"),
])
def test_a_stop_between_attempts_commits_the_snapshots_and_says_what_was_kept(redis_server, outcome, says):
    c, launcher = _stopped_while_recovering(redis_server.url, outcome)
    assert launcher.persisted == [{"before_step": None, "released": 0}]  # before the keepers go
    assert says in c.summary["reason"]
    assert "nothing trained" not in c.summary["reason"]


def test_a_keepers_tag_tells_the_job_its_data_and_its_layout_apart(tmp_path):
    from longrun.controller.keepers import keeper_tag

    base = _elastic(tmp_path, 3)
    assert keeper_tag(base) == keeper_tag(_elastic(tmp_path, 3))
    assert keeper_tag(base) != keeper_tag(_elastic(tmp_path, 2))  # another layout's pieces
    assert keeper_tag(base) != keeper_tag(_elastic(tmp_path / "other", 3))  # another checkpoint dir
    reseeded = config_from_dict(base.model_dump(mode="json") | {"job": base.job.model_dump() | {"seed": 9}})
    assert keeper_tag(base) != keeper_tag(reseeded)  # the same name and layout, other data


def test_keepers_on_nodes_the_job_left_are_let_go(monkeypatch):
    killed = []
    monkeypatch.setattr(keepers_mod.ray, "kill", lambda actor, no_restart=True: killed.append(actor))
    keepers = Keepers("j")
    keepers._actors = {"node-a": "keeper-a", "node-b": "keeper-b", "evicted": "keeper-x"}
    keepers.prune(["node-a", "node-b"])
    assert killed == ["keeper-x"] and set(keepers._actors) == {"node-a", "node-b"}


def test_the_launcher_prunes_keepers_once_the_attempt_trains():
    launcher = RayLauncher(spares=False)
    pruned = []
    launcher.keepers = SimpleNamespace(prune=lambda nodes: pruned.append(tuple(nodes)))
    launcher.placement = SimpleNamespace(node_ids=("node-a", "node-b"))
    launcher.warm_spares()  # the listeners call it when the attempt trains (it has restored)
    assert pruned == [("node-a", "node-b")]


def _elastic(tmp_path, nodes):
    return config_from_dict({
        "job": {"name": "snap-resize", "output_dir": str(tmp_path)},
        "cluster": {"nodes": nodes, "workers_per_node": 2, "device": "cpu"},
        "parallelism": {"dp": 2 * nodes},
        "checkpoint": {"memory_interval_steps": 1},
        "recovery": {"min_nodes": 2},
    })


def test_a_resize_commits_the_old_layouts_snapshots_before_they_are_dropped(tmp_path):
    old, new = _elastic(tmp_path, 3), _elastic(tmp_path, 2)
    launcher = RayLauncher(spares=False)
    launcher.placement = SimpleNamespace(node_ids=("node-a", "node-b"))
    keepers = launcher.keepers = Keepers(old.job.name)
    calls = []
    keepers.ensure = lambda nodes: None
    keepers.drop_after = lambda step: calls.append(("drop_after", step))
    keepers.plan = lambda *a, **k: calls.append(("plan",))
    keepers.persist = lambda **kw: calls.append(("persist", keepers.layout, kw["newer_than"])) or 7
    keepers.adopt(layout_key(old), old)
    plans = launcher._snapshot_plans(new, None)
    # The old layout's newest snapshot was committed first (then the new one restores it by
    # resharding, from storage), and only then were the keepers' snapshots dropped.
    assert calls[0] == ("persist", layout_key(old), 0)
    assert ("drop_after", -1) in calls and ("plan",) not in calls
    assert calls[-1] == ("drop_after", 7)  # what follows the committed step is another path's
    assert all(p["restore"] is None for p in plans) and keepers.layout == layout_key(new)


def test_every_node_commits_a_share_of_the_ranks_its_keeper_holds():
    """Issue 39: committing what the keepers hold is spread over the nodes (one committer each,
    at once), each rank written where a keeper holding it lives."""
    from longrun.controller.snapshot_commit import assign

    nodes = ["a", "b", "c"]  # 2 ranks each; a rank is held by its node's keeper and the next one's
    holders = {r: sorted({nodes[r // 2], nodes[(r // 2 + 1) % 3]}) for r in range(6)}
    restore = {"step": 8, "keepers": {str(r): [f"k-{n}" for n in names] for r, names in holders.items()}}
    by_node = assign(restore, {f"k-{n}": n for n in nodes})
    assert sorted(len(ranks) for ranks in by_node.values()) == [2, 2, 2]
    assert all(node in holders[r] for node, ranks in by_node.items() for r in ranks)
    assert sorted(r for ranks in by_node.values() for r in ranks) == list(range(6))
    gone = {f"k-{n}": n for n in ("a", "b")}  # node c's keeper went with its node
    assert {r for ranks in assign(restore, gone).values() for r in ranks} == set(range(6))
    with pytest.raises(ValueError, match="no live keeper holds rank 2"):
        assign(restore, {"k-a": "a"})
