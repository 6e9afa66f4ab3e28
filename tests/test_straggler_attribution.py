"""Stragglers found and explained (health/stragglers.py): the what-if slowdown, each slow rank's
cause (node, data, stage, rank), the policy acting on a slow node only, and what operators see
(the status line, the Prometheus gauges). Pure or in-process: no Ray, no Redis."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client.openmetrics.exposition import generate_latest as om_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse

from longrun.config import config_from_dict
from longrun.config.sections import RecoverySection
from longrun.controller.listeners import EventLog, Listeners, MetricsListener, ProgressRecord
from longrun.health.policy import Action, Incident, decide
from longrun.health.stragglers import BLAMES, NodeIndex, SlowRank, StragglerReport, attribute
from longrun.job_view import ControllerView, read_log, view_of_record
from longrun.observability.controller_metrics import ControllerMetrics

FACTOR = 1.5
PER_NODE = 8
NOW = 1000.0


def job(ranks: int, *, seed: int = 0, jitter: float = 0.02):
    """Step times around 1 s, work costs around 1, nodes of eight ranks named n0, n1, ..."""
    rng = np.random.default_rng(seed)
    times = 1.0 + rng.uniform(-jitter, jitter, ranks)
    costs = 1.0 + rng.uniform(-jitter, jitter, ranks)
    nodes = [f"n{r // PER_NODE}" for r in range(ranks)]
    return times, costs, nodes


def blames(report: StragglerReport) -> dict[int, str]:
    return {s.rank: s.blame for s in report.slow}


# --- attribution ------------------------------------------------------------------------------------

def test_a_slow_node_at_4096_ranks_is_found_and_named():
    times, costs, nodes = job(4096)
    times[24:32] *= 1.6  # node n3: every rank slow together, its data normal
    report = attribute(times, nodes, None, costs, FACTOR)
    assert blames(report) == dict.fromkeys(range(24, 32), "node")
    assert {s.node for s in report.slow} == {"n3"}
    assert "node n3: 8 of its 8 ranks (ranks 24-31) slow together" in report.slow[0].detail
    assert "node n3 (ranks 24-31) slow together 1.6" in report.sentence()
    named = report.sentence({"n3": "gpu-3 (10.0.0.3)"})  # as a person reads the node
    assert "node gpu-3 (10.0.0.3) (ranks 24-31) slow together 1.6" in named
    assert report.by_blame() == {"node": 8, "data": 0, "stage": 0, "rank": 0}
    # The same with the node index built once per attempt.
    again = attribute(times, NodeIndex.of(nodes), None, costs, FACTOR)
    assert [s.rank for s in again.slow] == list(range(24, 32)) and again.sentence() == report.sentence()


def test_most_of_a_node_slow_is_the_node_but_two_of_eight_are_not():
    times, costs, nodes = job(64)
    times[8:13] *= 1.7  # 5 of node n1's 8 ranks
    times[16:18] *= 1.7  # 2 of node n2's 8 ranks
    report = attribute(times, nodes, None, costs, FACTOR)
    assert blames(report) == {**dict.fromkeys(range(8, 13), "node"), 16: "rank", 17: "rank"}


def test_a_rank_slow_from_its_data_is_data_and_nothing_is_evicted():
    times, costs, nodes = job(256)
    times[7] *= 1.5 * 1.02  # just over the line: its micro-batches cost 1.5x the median
    costs[:] = 1.0
    costs[7] = 1.5
    report = attribute(times, nodes, None, costs, FACTOR)
    [slow] = report.slow
    assert (slow.rank, slow.blame, slow.node) == (7, "data", "n0")
    assert slow.cost_ratio == pytest.approx(1.5, rel=0.05)
    assert "rank 7's data costs 1.5" in report.sentence()
    incident = Incident("straggler", rank=7, node="n0", step=40, at=NOW, detail=slow.detail, blame="data")
    d = decide([incident], [], recovery(evict_stragglers=True), now=NOW, spare_nodes=4, can_shrink=True)
    assert d.action is Action.CONTINUE and d.evict_nodes == ()
    assert "1 slow from their data" in d.reason and "nothing is evicted" in d.reason


def test_a_whole_node_with_costly_data_is_the_data_not_the_node():
    times, costs, nodes = job(64)
    times[8:16] *= 1.6
    costs[8:16] *= 1.6
    assert set(blames(attribute(times, nodes, None, costs, FACTOR)).values()) == {"data"}


def test_a_cost_far_below_the_slowdown_does_not_explain_it():
    times, costs, nodes = job(64)
    times[9] *= 2.0
    costs[9] *= 1.2  # explains a fifth of the excess
    assert blames(attribute(times, nodes, None, costs, FACTOR)) == {9: "rank"}


def test_a_slow_pipeline_stage_is_the_stage():
    times, costs, nodes = job(512)
    stages = np.repeat(np.arange(4), 128)  # pp = 4, sixteen nodes per stage
    times[stages == 2] *= 1.7
    report = attribute(times, nodes, stages, costs, FACTOR)
    assert set(blames(report)) == set(range(256, 384)) and set(blames(report).values()) == {"stage"}
    assert report.stages[0][0] == 2 and report.stages[0][1] == pytest.approx(1.7, rel=0.05)
    assert report.slow[0].stage == 2 and "an uneven split, not a node" in report.slow[0].detail
    assert "pipeline stage 2 (ranks 256-383) 1.7" in report.sentence()
    # With two stages the job's median sits between them; the stage is found all the same.
    stages = np.repeat(np.arange(2), 256)
    times, costs, nodes = job(512, jitter=0.0)
    times[stages == 1] *= 2.0
    report = attribute(times, nodes, stages, costs, FACTOR)
    assert report.by_blame()["stage"] == 256 and report.slowdown == pytest.approx(2.0 / 1.5 - 1, rel=0.05)


def test_a_slow_node_inside_a_pipeline_is_the_node_and_a_one_node_stage_needs_its_cost():
    times, costs, nodes = job(512)
    stages = np.repeat(np.arange(4), 128)
    times[128:136] *= 1.8  # one node of stage 1
    assert set(blames(attribute(times, nodes, stages, costs, FACTOR)).values()) == {"node"}
    # A small pipeline, one node per stage: a slow stage is its node, unless its work costs more.
    times, costs, nodes = job(32)
    stages = np.repeat(np.arange(4), 8)
    times[stages == 3] *= 1.8
    assert set(blames(attribute(times, nodes, stages, costs, FACTOR)).values()) == {"node"}
    costs[stages == 3] *= 1.8  # the split gave the last stage more layers (a pipeline rank's FLOPs)
    assert set(blames(attribute(times, nodes, stages, costs, FACTOR)).values()) == {"stage"}


def test_a_single_slow_rank_with_normal_data_is_the_rank():
    times, costs, nodes = job(64, jitter=0.0)
    times[13] *= 1.9
    report = attribute(times, nodes, None, costs, FACTOR)
    [slow] = report.slow
    assert (slow.rank, slow.blame, slow.node) == (13, "rank", "n1")
    assert "the 7 other rank(s) on node n1 are not slow with it" in slow.detail
    assert "rank 13 on node n1 slow alone 1.9" in report.sentence()
    # Said to a person: the node by host and address where the attempt knows it.
    assert "rank 13 on node gpu-1 (10.0.0.1) slow alone 1.9" in report.sentence({"n1": "gpu-1 (10.0.0.1)"})
    # One rank per node: nothing shows the node slow "together".
    alone = attribute(times, [f"h{r}" for r in range(64)], None, costs, FACTOR)
    assert blames(alone) == {13: "rank"} and "it is alone on node h13" in alone.slow[0].detail


def test_the_what_if_slowdown():
    times = np.array([1.0, 1.0, 1.0, 1.1, 1.3, np.nan])
    report = attribute(times, ["a"] * 6, None, None, FACTOR)
    assert (report.step_time_s, report.median_s) == (1.3, 1.0)
    assert report.slowdown == pytest.approx(0.3) and report.slow == () and report.ranks == 5
    assert report.sentence() == ("runs 30% slower than with every rank at the median (1.30 s vs 1.00 s); "
                                 "no rank is slower than 1.5x the median")


def test_no_stragglers_and_nothing_known():
    times, costs, nodes = job(4096, jitter=0.001)
    report = attribute(times, nodes, np.full(4096, -1), costs, FACTOR)
    assert report.slowdown == pytest.approx(0.0, abs=0.01) and report.slow == ()
    assert report.by_blame() == dict.fromkeys(BLAMES, 0)
    empty = attribute(np.full(8, np.nan), [None] * 8, None, None, FACTOR)
    assert (empty.slowdown, empty.ranks, empty.sentence()) == (0.0, 0, "no step times reported yet")
    few = attribute(np.array([1.0, 5.0]), ["a", "b"], None, None, FACTOR)  # two times: no median to judge by
    assert few.slow == () and few.slowdown == pytest.approx(5.0 / 3.0 - 1)
    with pytest.raises(ValueError, match="3 entries for 2"):
        attribute(np.array([1.0, 2.0]), ["a", "b", "c"], None, None, FACTOR)


def test_the_sentence_stays_one_bounded_line():
    times, costs, nodes = job(1024)
    for node in range(6):  # six slow nodes, a data rank and a lone rank
        times[node * 16:node * 16 + 8] *= 1.6 + 0.05 * node
    times[500] *= 1.7
    costs[500] *= 1.8
    times[900] *= 1.9
    sentence = attribute(times, nodes, None, costs, FACTOR).sentence()
    assert "\n" not in sentence and sentence.count(";") == 4 and sentence.endswith("and 4 more")
    assert sentence.index("node n10 ") < sentence.index("node n8 ")  # the slowest node first
    assert "node n0 " not in sentence


# --- the policy -------------------------------------------------------------------------------------

def recovery(**overrides) -> RecoverySection:
    return RecoverySection(**{"evict_stragglers": True} | overrides)


def node_incidents(node: str = "n3", blame: str | None = "node") -> list[Incident]:
    return [Incident("straggler", rank=r, node=node, step=40, at=NOW, blame=blame,
                     detail=f"node {node}: 8 of its 8 ranks (ranks 24-31) slow together, 1.60x the median")
            for r in range(24, 32)]


def test_a_slow_node_is_evicted_where_a_spare_or_a_shrink_can_take_its_place():
    d = decide(node_incidents(), [], recovery(), now=NOW, spare_nodes=1)
    assert d.action is Action.EVICT_AND_RESTART and d.evict_nodes == ("n3",)
    assert d.cause.blame == "node" and d.cause.node == "n3"
    assert "evict n3 and restart, since 1 spare node(s) can take their place" in d.reason
    assert "self-checks" in d.reason and "8 straggler(s) (ranks 24, 25," in d.reason
    shrink = decide(node_incidents(), [], recovery(), now=NOW, spare_nodes=0, can_shrink=True)
    assert shrink.evict_nodes == ("n3",) and "elastic" in shrink.reason
    stay = decide(node_incidents(), [], recovery(), now=NOW, spare_nodes=0)
    assert stay.action is Action.CONTINUE and "no spare node can take the place of n3" in stay.reason
    off = decide(node_incidents(), [], recovery(evict_stragglers=False), now=NOW, spare_nodes=3)
    assert off.action is Action.CONTINUE and "recovery.evict_stragglers = false" in off.reason


@pytest.mark.parametrize("blame", ["data", "stage", "rank"])
def test_data_stage_and_lone_ranks_are_only_reported(blame):
    slow = [Incident("straggler", rank=r, node=f"n{r}", step=40, at=NOW, blame=blame) for r in (3, 5)]
    d = decide(slow, [], recovery(), now=NOW, spare_nodes=8, can_shrink=True)
    assert d.action is Action.CONTINUE and d.evict_nodes == () and d.backoff_s == 0
    assert "2 straggler(s) (ranks 3, 5)" in d.reason and d.reason.endswith(".") and "\n" not in d.reason


def test_a_slow_node_is_acted_on_whatever_rank_comes_first():
    incidents = [Incident("straggler", rank=2, node="n0", at=NOW, blame="data"), *node_incidents()]
    d = decide(incidents, [], recovery(), now=NOW, spare_nodes=2)
    assert d.evict_nodes == ("n3",) and d.cause.rank == 24
    # Two slow nodes, one spare: the one that can be replaced goes, the other stays reported.
    two = node_incidents("n3") + node_incidents("n7")
    assert decide(two, [], recovery(), now=NOW, spare_nodes=1).evict_nodes == ("n3",)


# --- what operators see -----------------------------------------------------------------------------

class FakeRecord:
    def __init__(self):
        self.events, self.fields = [], {}

    def event(self, kind, attempt, message, **extra):
        self.events.append((kind, attempt, message, extra))

    def update(self, **fields):
        self.fields.update(fields)

    def evicted(self):
        return {}


def slow_node_report() -> StragglerReport:
    times, costs, nodes = job(64)
    times[24:32] *= 1.6
    return attribute(times, nodes, None, costs, FACTOR)


def test_the_listeners_put_the_report_in_status_the_event_log_and_prometheus():
    cfg = config_from_dict({"job": {"name": "slow"}})
    record, progress, printed = FakeRecord(), FakeRecord(), []
    metrics = ControllerMetrics("slow")
    listeners = Listeners([EventLog(record, printed.append), MetricsListener(metrics, record, cfg),
                           ProgressRecord(progress)])
    attempt = SimpleNamespace(number=2, group=None)  # not placed: its nodes have no names
    report = slow_node_report()
    listeners.stragglers(attempt, report, NOW)
    listeners.stragglers(attempt, slow_node_report(), NOW + 1)  # nothing new: no second event
    [(kind, number, message, extra)] = record.events
    assert (kind, number, message) == ("stragglers", 2, report.sentence())
    assert extra["slow_ranks"]["node"] == 8 and extra["slowdown"] > 0.5
    assert printed == [f"stragglers: {report.sentence()}"]
    assert progress.fields["stragglers"] == report.sentence()

    def gauges():
        found = {f.name: f for f in om_parse(om_latest(metrics.registry).decode())}
        slow = {dict(s.labels)["blame"]: s.value for s in found["longrun_slow_ranks"].samples}
        return found["longrun_straggler_slowdown_ratio"].samples[0].value, slow

    slowdown, slow = gauges()
    assert slowdown == pytest.approx(report.slowdown)
    assert slow == {"node": 8, "data": 0, "stage": 0, "rank": 0}
    # Cleared: an event says so; the gauges and the record's line go back when the attempt ends.
    times, costs, nodes = job(64)
    listeners.stragglers(attempt, attribute(times, nodes, None, costs, FACTOR), NOW + 2)
    assert record.events[-1][2].endswith("no rank is slower than 1.5x the median")
    listeners.ended(attempt)
    assert gauges() == (0.0, dict.fromkeys(BLAMES, 0)) and progress.fields["stragglers"] == ""


def test_data_that_comes_and_goes_is_news_at_most_every_five_minutes():
    record, attempt = FakeRecord(), SimpleNamespace(number=0, group=None)
    log = EventLog(record, lambda line: None)
    data = StragglerReport(1.5, 1.0, 0.5, (SlowRank(7, "n0", None, "data", 1.5, "costly", 1.5),), FACTOR, 64)
    calm = StragglerReport(1.02, 1.0, 0.02, (), FACTOR, 64)
    for n, report in enumerate([data, calm, data, calm]):
        log.stragglers(attempt, report, NOW + n)
    assert len(record.events) == 1
    log.stragglers(attempt, calm, NOW + 301)
    assert len(record.events) == 2


def test_status_shows_the_report_from_the_record_and_from_the_log(monkeypatch, capsys):
    sentence = slow_node_report().sentence()
    status = {"state": "RUNNING", "attempt": 1, "step": 12, "evicted": {}, "events": [],
              "fields": {"reason": "training", "stragglers": sentence}}
    assert view_of_record(status, "the record").stragglers == sentence
    assert view_of_record({**status, "fields": {"stragglers": ""}}, "the record").stragglers is None
    log = f"state RUNNING: training\nstragglers: {sentence}\n"
    assert read_log(log).stragglers == sentence

    from longrun import submit
    from longrun.cli import jobs

    view = ControllerView(state="RUNNING", attempt=1, step="12/100", stragglers=sentence)
    monkeypatch.setattr(submit, "status", lambda *a, **k: {"id": "raysubmit_1", "ray_status": "RUNNING",
                                                           "message": "", "controller": view, "longrun": ""})
    assert jobs.cmd_status(argparse.Namespace(id="raysubmit_1", address="http://x:8265", redis_url=None)) == 0
    assert f"stragglers: {sentence}" in " ".join(capsys.readouterr().out.split())


# --- the trainer's side: what a rank's data costs -----------------------------------------------------

def test_a_planned_step_costs_what_the_planner_predicts_and_the_worker_beats_it():
    from longrun.trainer.cp.batches import one_rank_setup, plan_step
    from longrun.trainer.cp.cost import CostModel
    from longrun.trainer.step import planned_step
    from longrun.worker.hooks import StepHooks

    cost = CostModel(linear_s_per_token=1e-6, attn_s_per_token2=1e-9, ring_block_s_per_token2=1e-9,
                     p2p_latency_s=0.0, p2p_s_per_byte=0.0, kv_bytes_per_token=8.0, n_layers=2,
                     micro_batch_overhead_s=1e-3)
    setup = one_rank_setup(cost)
    docs = [np.arange(n, dtype=np.int64) % 50 + 3 for n in (40, 200, 90)]
    step = plan_step(docs, setup, token_budget=256)
    work = planned_step(step, setup, "cpu")
    # One rank: its groups are the whole plan.
    assert work.cost == pytest.approx(step.plan.predicted_s) and work.cost > 0

    beats = []

    class Beat:
        def update(self, **fields):
            beats.append(fields)

    class Trainer:
        last_plan, layout, last_work_cost = None, "single", 0.25

        def state_bytes(self):
            return {"parameters": 1}

    class Metrics:
        def observe_step(self, m): ...
        def observe_state(self, layout, held): ...

    hooks = StepHooks(Beat(), Metrics())
    hooks.trainer = Trainer()
    hooks.after_step(SimpleNamespace(step=3, loss=2.0, step_time_s=0.5, tokens_per_s=1.0, memory_bytes=0,
                                     report=lambda: {}))
    assert beats[-1]["work_cost"] == 0.25 and beats[-1]["step"] == 3
