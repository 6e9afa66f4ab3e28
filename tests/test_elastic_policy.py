"""Elastic continuation's pure parts: which layouts a smaller job can have (dp shrinks first,
then fsdp; never cp, tp or pp), the scaling policy's decisions and their reasons, the smaller
config the controller derives (global batch pinned), and the config checks on min_nodes."""

from __future__ import annotations

import pytest

from longrun.config import ConfigError, config_from_dict
from longrun.controller.elastic import Sizing, candidate_sizes, layout_key, resized
from longrun.controller.keepers import Keepers
from longrun.health.scaling import Resize, ScalingPolicy, shrunk_degrees


@pytest.mark.parametrize("dp, fsdp, fixed, workers, want", [
    (4, 1, 1, 3, (3, 1)),  # plain data parallel: one replica fewer
    (4, 2, 1, 6, (3, 2)),  # HSDP: replicas go first, the shard size stays
    (2, 4, 1, 6, (2, 3)),  # dp cannot take it alone (6 / 4): fsdp shrinks too
    (1, 4, 1, 3, (1, 3)),  # FSDP only: fsdp is all there is to shrink
    (2, 2, 1, 3, None),  # 3 = 3 x 1 needs dp 3 > 2: neither degree may grow
    (2, 1, 4, 4, (1, 1)),  # tp x cp = 4: one replica left
    (2, 1, 4, 6, None),  # 6 ranks cannot hold whole tp x cp groups of 4
    (4, 2, 1, 8, (4, 2)),  # no shrink at all
])
def test_shrunk_degrees_shrink_dp_first_then_fsdp(dp, fsdp, fixed, workers, want):
    assert shrunk_degrees(dp, fsdp, fixed, workers) == want


POLICY = ScalingPolicy(configured=4, min_nodes=2, shrink_after_s=60.0, sizes=frozenset({2, 3}))


def test_the_policy_waits_within_shrink_after_s_then_continues_on_what_is_there():
    wait = POLICY.short(available=3, waited_s=10)
    assert wait.action is Resize.WAIT and wait.nodes == 4
    assert "3 of 4 node(s)" in wait.reason and "recovery.shrink_after_s = 60 s" in wait.reason
    shrink = POLICY.short(available=3, waited_s=60)
    assert (shrink.action, shrink.nodes) == (Resize.SHRINK, 3)
    assert "continue on 3 (recovery.min_nodes = 2)" in shrink.reason
    assert POLICY.short(available=None, waited_s=1e6).action is Resize.WAIT  # Ray cannot say: no guess
    for d in (wait, shrink):
        assert d.reason.endswith(".") and "\n" not in d.reason


def test_the_policy_picks_the_largest_size_the_layout_can_take():
    policy = ScalingPolicy(configured=4, min_nodes=1, shrink_after_s=0.0, sizes=frozenset({1, 2}))
    d = policy.short(available=3, waited_s=0)
    assert (d.action, d.nodes) == (Resize.SHRINK, 2)  # 3 nodes cannot be laid out


def test_the_policy_gives_up_below_min_nodes_and_says_why():
    below = POLICY.short(available=1, waited_s=61)
    assert below.action is Resize.GIVE_UP
    assert "only 1 of 4 node(s)" in below.reason and "fewer than recovery.min_nodes (2)" in below.reason
    no_layout = ScalingPolicy(configured=4, min_nodes=2, shrink_after_s=0.0, sizes=frozenset({2}))
    d = no_layout.short(available=3, waited_s=0)
    assert (d.action, d.nodes) == (Resize.SHRINK, 2)
    none = ScalingPolicy(configured=4, min_nodes=3, shrink_after_s=0.0, sizes=frozenset())
    d = none.short(available=3, waited_s=0)
    assert d.action is Resize.GIVE_UP and "cannot shrink to any size" in d.reason


def test_min_nodes_equal_to_the_job_waits_then_gives_up_and_unset_gives_up_at_once():
    full = ScalingPolicy(configured=3, min_nodes=3, shrink_after_s=60.0, sizes=frozenset())
    assert full.short(available=2, waited_s=59).action is Resize.WAIT
    late = full.short(available=2, waited_s=60)
    assert late.action is Resize.GIVE_UP and "recovery.min_nodes (3)" in late.reason
    rigid = ScalingPolicy(configured=3, min_nodes=None, shrink_after_s=60.0)
    now = rigid.short(available=2, waited_s=0)
    assert now.action is Resize.GIVE_UP and "not elastic (recovery.min_nodes is unset)" in now.reason


def test_busy_nodes_are_not_gone_the_policy_waits_for_them_instead_of_giving_up():
    # 4 nodes exist, 3 are busy (another job holds them): 1 can be placed, fewer than min_nodes.
    busy = POLICY.short(available=1, waited_s=1e6, existing=4)
    assert (busy.action, busy.nodes) == (Resize.WAIT, 4)
    assert "3 more are busy" in busy.reason and "busy is not gone" in busy.reason
    # What can be placed now is what the job continues on: 3 exist, 2 of them free.
    d = POLICY.short(available=2, waited_s=60, existing=3)
    assert (d.action, d.nodes) == (Resize.SHRINK, 2)
    # Nodes that do not exist still end the job (existing defaults to available).
    assert POLICY.short(available=1, waited_s=61, existing=1).action is Resize.GIVE_UP
    assert POLICY.short(available=1, waited_s=61).action is Resize.GIVE_UP
    full = ScalingPolicy(configured=3, min_nodes=3, shrink_after_s=0.0, sizes=frozenset())
    assert full.short(available=2, waited_s=100, existing=3).action is Resize.WAIT
    assert full.short(available=2, waited_s=100, existing=2).action is Resize.GIVE_UP


def test_the_policy_grows_back_only_to_the_configured_size():
    assert POLICY.running(current=4, available=4).action is Resize.KEEP
    partial = POLICY.running(current=2, available=3)  # a resize costs a save and a restart
    assert (partial.action, partial.nodes) == (Resize.KEEP, 2) and "keep running on 2" in partial.reason
    assert POLICY.running(current=2, available=None).action is Resize.KEEP
    grow = POLICY.running(current=2, available=4)
    assert (grow.action, grow.nodes) == (Resize.GROW, 4) and "grow from 2" in grow.reason


def job(nodes=4, per_node=2, min_nodes=2, **parallelism):
    return config_from_dict({
        "job": {"name": "elastic"},
        "cluster": {"nodes": nodes, "workers_per_node": per_node, "device": "cpu"},
        "parallelism": parallelism or {"dp": nodes * per_node},
        "data": {"source": "synthetic", "micro_batch_tokens": 256},
        "training": {"grad_accum": 2},
        "health": {"faults": [{"rank": r, "step": 3, "kind": "kill"} for r in (1, nodes * per_node - 1)]},
        "recovery": {"min_nodes": min_nodes, "shrink_after_s": 30},
    })


def test_the_smaller_config_shrinks_dp_pins_the_global_batch_and_keeps_the_rest():
    cfg = job(dp=4, fsdp=2)
    assert cfg.global_batch_tokens == 256 * 2 * 8
    smaller = resized(cfg, 3)
    assert (smaller.cluster.nodes, smaller.world_size) == (3, 6)
    assert (smaller.parallelism.dp, smaller.parallelism.fsdp) == (3, 2)
    assert smaller.training.global_batch_tokens == 256 * 2 * 8  # the configured job's, not 6 ranks'
    assert smaller.global_batch_tokens == cfg.global_batch_tokens
    assert smaller.recovery.min_nodes is None  # one fixed size: the controller chooses
    assert [f.rank for f in smaller.health.faults] == [1]  # rank 7 does not exist in 6 ranks
    assert smaller.model == cfg.model and smaller.checkpoint_dir == cfg.checkpoint_dir
    assert layout_key(smaller) != layout_key(cfg) and resized(cfg, 4) is cfg


def test_the_smaller_config_shrinks_fsdp_when_dp_cannot_take_it():
    cfg = job(nodes=4, per_node=1, min_nodes=1, fsdp=4)
    smaller = resized(cfg, 3)
    assert (smaller.parallelism.dp, smaller.parallelism.fsdp) == (1, 3)
    assert candidate_sizes(cfg) == {1, 2, 3}


def test_tp_and_cp_never_shrink():
    cfg = job(nodes=4, per_node=2, min_nodes=2, dp=2, tp=2, cp=2)
    assert candidate_sizes(cfg) == {2}  # 3 nodes = 6 ranks: no whole tp x cp group of 4 fits
    smaller = resized(cfg, 2)
    assert (smaller.parallelism.dp, smaller.parallelism.tp, smaller.parallelism.cp) == (1, 2, 2)
    with pytest.raises(ValueError, match="cannot be laid out"):
        resized(cfg, 3)


def test_sizing_counts_the_wait_from_the_first_failed_placement():
    sizing = Sizing(job(dp=8))
    decision, smaller = sizing.short(available=3, now=100.0)
    assert decision.action is Resize.WAIT and smaller is None
    decision, smaller = sizing.short(available=3, now=130.0)
    assert decision.action is Resize.SHRINK and smaller.cluster.nodes == 3 and smaller.parallelism.dp == 6
    decision, _ = sizing.short(available=3, now=131.0)  # still short: no new wait
    assert decision.action is Resize.SHRINK
    sizing.placed_in_full()
    assert sizing.short(available=3, now=200.0)[0].action is Resize.WAIT
    assert Sizing.of(job(min_nodes=None)) is None


def test_sizing_counts_a_timed_out_placement_as_time_waited():
    sizing = Sizing(job(dp=8))
    # The full-size try began at 100 and timed out at 130 (shrink_after_s = 30): continue at once.
    decision, smaller = sizing.short(available=3, now=130.0, since=100.0, existing=4)
    assert decision.action is Resize.SHRINK and smaller.cluster.nodes == 3
    sizing.placed_in_full()
    busy, _ = sizing.short(available=1, now=500.0, since=400.0, existing=4)
    assert busy.action is Resize.WAIT and "busy" in busy.reason


@pytest.mark.parametrize("raw, needles", [
    ({"cluster": {"nodes": 2, "workers_per_node": 1}, "parallelism": {"dp": 2}, "recovery": {"min_nodes": 3}},
     ["min_nodes (3) is more than cluster.nodes (2)", "at most 2"]),
    # tp x cp = 4 ranks span two nodes of 2: one node cannot hold a replica.
    ({"cluster": {"nodes": 2, "workers_per_node": 2}, "parallelism": {"dp": 1, "tp": 2, "cp": 2},
      "recovery": {"min_nodes": 1}},
     ["on 1 node(s) the job has 1 x 2 = 2 ranks", "parallelism.dp (1) and parallelism.fsdp (1) shrink",
      "cp x tp x pp = 4", "raise recovery.min_nodes to 2"]),
    ({"cluster": {"nodes": 4, "workers_per_node": 1}, "parallelism": {"dp": 2, "fsdp": 2},
      "recovery": {"min_nodes": 3}},
     ["on 3 node(s)", "no dp <= 2 and fsdp <= 2 give dp x fsdp x 1 = 3", "raise recovery.min_nodes to 1"]),
])
def test_config_refuses_a_min_nodes_the_data_parallel_degrees_cannot_reach(raw, needles):
    raw = {"job": {"name": "t"}} | raw
    raw["cluster"]["device"] = "cpu"
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    problems = dict(info.value.problems)
    assert set(problems) == {"recovery.min_nodes"}, problems
    for needle in needles:
        assert needle in problems["recovery.min_nodes"]


def test_config_accepts_reachable_min_nodes_and_defaults():
    cfg = config_from_dict({"job": {"name": "t"}})
    assert cfg.recovery.min_nodes is None and cfg.recovery.shrink_after_s == 60.0
    ok = config_from_dict({"job": {"name": "t"}, "cluster": {"nodes": 4, "workers_per_node": 2},
                           "parallelism": {"dp": 2, "fsdp": 2, "tp": 2}, "recovery": {"min_nodes": 1}})
    assert candidate_sizes(ok) == {1, 2}  # 3 nodes: 6 ranks / tp 2 = 3 = dp x fsdp has no pair <= 2


def test_keepers_never_plan_across_a_layout_change():
    keepers = Keepers("j")
    dropped: list[int] = []
    keepers.drop_after = dropped.append  # the Ray call: every keeper forgets steps after this one
    first, smaller = layout_key(job(dp=8)), layout_key(resized(job(dp=8), 3))
    assert keepers.adopt(first) is False and dropped == []  # nothing held yet
    assert keepers.adopt(first) is False
    assert keepers.adopt(smaller) is True and dropped == [-1]  # every snapshot of the old layout
    assert keepers.adopt(first) is True and dropped == [-1, -1]
