"""Names, units, labels and bounded vocabularies of the worker and controller metrics."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from longrun.config.sections import RecoverySection
from longrun.controller.state import JobState
from longrun.health.monitor import FaultKind
from longrun.health.policy import PRECEDENCE
from longrun.observability import vocab
from longrun.observability.metrics import ControllerMetrics, WorkerMetrics, init_phases

# The node by name and, as a second label, by Ray id (here the same: no name was given).
WORKER_IDENTITY = {"job": "demo", "attempt": "2", "rank": "1", "node": "node-a", "node_id": "node-a"}

# name -> (type, extra labels beyond the identity labels)
WORKER_FAMILIES = {
    "longrun_train_step": ("gauge", set()),
    "longrun_train_loss": ("gauge", set()),
    "longrun_train_grad_norm": ("gauge", set()),
    "longrun_validation_loss": ("gauge", set()),
    "longrun_train_learning_rate": ("gauge", set()),
    "longrun_train_tokens": ("counter", set()),  # the parser strips _total from the family name
    "longrun_train_tokens_per_second": ("gauge", set()),
    "longrun_train_step_duration_seconds": ("histogram", set()),
    "longrun_train_data_wait_seconds": ("histogram", set()),
    "longrun_train_mfu_ratio": ("gauge", set()),
    "longrun_train_memory_bytes": ("gauge", set()),
    "longrun_train_state_bytes": ("gauge", {"kind", "layout"}),
    "longrun_train_phase_duration_seconds": ("histogram", {"phase"}),
    "longrun_checkpoint_blocking_seconds": ("histogram", set()),
    "longrun_checkpoint_write_seconds": ("histogram", set()),
    "longrun_checkpoint_last_step": ("gauge", set()),
    "longrun_checkpoint_last_commit_timestamp_seconds": ("gauge", set()),
    "longrun_checkpoint_restore_seconds": ("gauge", {"source"}),
    "longrun_dynamic_cp_group_size": ("histogram", set()),
    "longrun_dynamic_cp_predicted_step_seconds": ("gauge", set()),
    "longrun_dynamic_cp_measured_step_seconds": ("gauge", set()),
    "longrun_group_init_seconds": ("gauge", {"phase"}),
    "longrun_memory_dropped_snapshots": ("counter", set()),
    "longrun_memory_snapshot_interval_steps": ("gauge", set()),
}
CONTROLLER_FAMILIES = {
    "longrun_job_state": ("stateset", {"longrun_job_state"}),
    "longrun_job_attempt": ("gauge", set()),
    "longrun_job_step": ("gauge", set()),
    "longrun_job_planned_steps": ("gauge", set()),
    "longrun_job_restarts": ("counter", {"cause"}),
    "longrun_job_faults": ("counter", {"kind"}),
    "longrun_fault_detection_seconds": ("histogram", set()),
    "longrun_recovery_duration_seconds": ("histogram", set()),
    "longrun_job_evicted_nodes": ("gauge", set()),
    "longrun_job_steps_lost": ("counter", set()),
    "longrun_job_last_fault_steps_lost": ("gauge", set()),
    "longrun_heartbeat_age_seconds": ("gauge", {"rank", "node", "node_id"}),
    "longrun_heartbeat_timestamp_seconds": ("gauge", {"rank", "node", "node_id"}),
    "longrun_diagnostics_ok": ("gauge", {"node", "node_id", "check"}),
    "longrun_diagnostics_duration_seconds": ("gauge", {"node", "node_id", "check"}),
    "longrun_group_init_seconds": ("gauge", {"phase"}),
    "longrun_elastic_resizes": ("counter", {"direction"}),
    "longrun_job_nodes": ("gauge", set()),
    "longrun_job_world_size": ("gauge", set()),
    "longrun_goodput_ratio": ("gauge", set()),
    "longrun_job_seconds_total": ("gauge", {"bucket"}),  # a gauge: see controller_metrics.py
    "longrun_straggler_slowdown_ratio": ("gauge", set()),
    "longrun_slow_ranks": ("gauge", {"blame"}),
}


def families(registry) -> dict:
    # The openmetrics parser keeps types such as stateset; the text one calls it a gauge.
    from prometheus_client.openmetrics.exposition import generate_latest as om_latest
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse

    return {f.name: f for f in om_parse(om_latest(registry).decode())}


def busy_worker() -> WorkerMetrics:
    w = WorkerMetrics("demo", 1, attempt=2, node="node-a")
    w.observe_step(SimpleNamespace(step=7, loss=2.0, grad_norm=1.0, lr=1e-3, tokens=100, tokens_per_s=50.0,
                                   step_time_s=2.0, data_wait_s=0.1, mfu=0.4, memory_bytes=123, val_loss=2.5))
    for phase in ("data", "forward", "backward", "sync", "optimizer"):
        w.observe_phase(phase, 0.1)
    w.observe_checkpoint(blocking_s=0.01, write_s=3.0)
    w.checkpoint_committed(7, 1_700_000_000.0)
    w.observe_cp_plan([1, 2, 8, 8], predicted_s=1.5, measured_s=1.7)
    w.observe_group_init("world_init", 0.3)
    w.observe_state("fsdp2.tp2", {"parameters": 400, "gradients": 400, "optimizer": 800})
    w.observe_restore("storage", 1.5)
    w.snapshot_dropped(7, "a slow keeper")
    w.snapshot_interval(3)
    return w


def test_state_bytes_are_labelled_by_kind_and_layout():
    w = busy_worker()
    w.observe_state("fsdp2.tp2", {"activations_maybe": 5})  # not a state kind: "other"
    samples = families(w.registry)["longrun_train_state_bytes"].samples
    held = {(dict(s.labels)["kind"], dict(s.labels)["layout"]): s.value for s in samples}
    assert held == {("parameters", "fsdp2.tp2"): 400, ("gradients", "fsdp2.tp2"): 400,
                    ("optimizer", "fsdp2.tp2"): 800, ("other", "fsdp2.tp2"): 5}


def test_worker_series_have_the_expected_names_types_and_labels():
    found = families(busy_worker().registry)
    assert {name: f.type for name, f in found.items()} == {n: t for n, (t, _) in WORKER_FAMILIES.items()}
    for name, family in found.items():
        extra = WORKER_FAMILIES[name][1]
        assert family.samples, name
        for sample in family.samples:
            labels = dict(sample.labels)
            labels.pop("le", None)
            assert set(labels) == set(WORKER_IDENTITY) | extra, (name, labels)
            assert all(labels[k] == v for k, v in WORKER_IDENTITY.items()), (name, labels)


def test_worker_text_exposition_uses_unit_suffixes():
    text = generate_latest(busy_worker().registry).decode()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert "longrun_train_tokens_total" in names
    assert not any(n.endswith("_created") for n in names)  # unit-less timestamps are switched off
    for f in text_string_to_metric_families(text):
        if f.type in ("histogram", "counter"):
            assert f.name.endswith(("_seconds", "_size", "_tokens", "_snapshots")), f.name


def test_worker_phases_buckets_and_init_phases():
    w = busy_worker()
    w.observe_phase("tp_group_17_allreduce", 0.2)  # not in the vocabulary
    found = families(w.registry)
    phases = {dict(s.labels)["phase"] for s in found["longrun_train_phase_duration_seconds"].samples}
    assert phases == {"data", "forward", "backward", "sync", "optimizer", "other"}
    les = [dict(s.labels)["le"] for s in found["longrun_dynamic_cp_group_size"].samples
           if s.name.endswith("_bucket")]
    assert les == ["1.0", "2.0", "4.0", "8.0", "16.0", "32.0", "64.0", "128.0", "256.0", "512.0", "+Inf"]
    counts = {dict(s.labels)["le"]: s.value for s in found["longrun_dynamic_cp_group_size"].samples
              if s.name.endswith("_bucket")}
    assert (counts["1.0"], counts["2.0"], counts["4.0"], counts["8.0"]) == (1, 2, 2, 4)


def test_init_phases_cover_every_init_timings_field():
    from longrun.commgroup.init import InitTimings

    timings = InitTimings(store_connect_s=0.1, arrival_s=0.2, world_init_s=0.3,
                          groups_s={"tp_0": 0.25, "dp_0": 0.5}, total_s=1.5)
    phases = init_phases(timings)
    assert phases == {"store_connect": 0.1, "arrival": 0.2, "world_init": 0.3, "groups": 0.75, "total": 1.5}
    fields = {f.name.removesuffix("_s") for f in dataclasses.fields(InitTimings)}
    assert fields == set(phases) and set(phases) < set(vocab.INIT_PHASES)
    w = WorkerMetrics("demo", 0)
    w.observe_init_timings(timings)
    samples = families(w.registry)["longrun_group_init_seconds"].samples
    got = {dict(s.labels)["phase"]: s.value for s in samples}
    assert got == phases


def test_controller_series_have_the_expected_names_types_and_labels():
    c = ControllerMetrics("demo")
    c.heartbeat_age(0, "node-a", 1.5)
    c.diagnostics("node-a", "compute", True, 0.2)
    c.group_init("total", 2.0)
    found = families(c.registry)
    assert {name: f.type for name, f in found.items()} == {n: t for n, (t, _) in CONTROLLER_FAMILIES.items()}
    for name, family in found.items():
        for sample in family.samples:
            labels = dict(sample.labels)
            labels.pop("le", None)
            # No attempt label: controller series span attempts.
            assert set(labels) == {"job"} | CONTROLLER_FAMILIES[name][1], (name, labels)
            assert labels["job"] == "demo"


def test_job_state_is_an_enum_of_every_controller_state():
    c = ControllerMetrics("demo")

    def states():
        samples = families(c.registry)["longrun_job_state"].samples
        return {dict(s.labels)["longrun_job_state"]: s.value for s in samples}

    assert set(states()) == {s.value for s in JobState}
    assert states()["PENDING"] == 1 and sum(states().values()) == 1
    c.set_state(JobState.RECOVERING)
    c.set_state("RUNNING")
    assert states()["RUNNING"] == 1 and sum(states().values()) == 1
    with pytest.raises(ValueError, match="unknown job state"):
        c.set_state("BROKEN")


def test_causes_and_kinds_exist_at_zero_and_stay_bounded():
    c = ControllerMetrics("demo")

    def counts(name, label):
        return {dict(s.labels)[label]: s.value for s in families(c.registry)[name].samples
                if s.name.endswith("_total")}

    assert counts("longrun_job_restarts", "cause") == dict.fromkeys(vocab.FAULT_KINDS, 0.0)
    assert counts("longrun_job_faults", "kind") == dict.fromkeys(vocab.FAULT_KINDS, 0.0)
    c.restart("hang")
    c.restart("diagnostics")  # an alias of the policy's name
    c.restart("Traceback (most recent call last): ...")  # never a label value
    c.fault("straggler")
    restarts = counts("longrun_job_restarts", "cause")
    assert (restarts["hang"], restarts["diagnostics_failed"], restarts["other"]) == (1, 1, 1)
    assert set(restarts) == set(vocab.FAULT_KINDS)
    assert counts("longrun_job_faults", "kind")["straggler"] == 1


def test_the_vocabularies_know_every_kind_the_health_code_produces():
    assert set(PRECEDENCE) <= set(vocab.FAULT_KINDS)
    assert {k.value for k in FaultKind} <= set(vocab.FAULT_KINDS)
    checks = RecoverySection.model_fields["diagnostics"].default_factory()
    assert set(checks) <= set(vocab.DIAGNOSTIC_CHECKS)
    assert {"data", "forward", "backward", "sync", "optimizer", "checkpoint"} <= set(vocab.PHASES)
    # The phases a worker times through its hooks between the restore and the first step.
    assert {"build", "init", "calibration"} <= set(vocab.PHASES)


def test_forget_ranks_removes_the_heartbeat_series():
    c = ControllerMetrics("demo")
    c.heartbeat_age(0, "node-a", 0.5)
    c.heartbeat_age(1, "node-b", 0.7)
    c.heartbeat_age(1, "node-b", 0.9, sent_at=1000.0)  # the same series, updated
    samples = families(c.registry)["longrun_heartbeat_age_seconds"].samples
    assert {(dict(s.labels)["rank"], s.value) for s in samples} == {("0", 0.5), ("1", 0.9)}
    assert families(c.registry)["longrun_heartbeat_timestamp_seconds"].samples[0].value == 1000.0
    c.forget_ranks()
    assert not families(c.registry)["longrun_heartbeat_timestamp_seconds"].samples
    assert "longrun_heartbeat_age_seconds" not in families(c.registry) or \
        not families(c.registry)["longrun_heartbeat_age_seconds"].samples
    c.heartbeat_age(2, "node-c", 0.1)  # the next attempt reports again
    assert len(families(c.registry)["longrun_heartbeat_age_seconds"].samples) == 1


def test_controller_values():
    c = ControllerMetrics("demo")
    c.set_attempt(3)
    c.set_step(40, 100)
    c.set_evicted(1)
    c.detection(4.0)
    c.recovery(12.0, steps_lost=3)
    c.recovery(2.0, steps_lost=0)
    c.diagnostics("node-a", "memory", False, 0.05)
    found = families(c.registry)

    def value(name, sample_name=None, **labels):
        for s in found[name].samples:
            if s.name == (sample_name or name) and all(dict(s.labels).get(k) == v for k, v in labels.items()):
                return s.value
        raise KeyError(name)

    assert value("longrun_job_attempt") == 3
    assert (value("longrun_job_step"), value("longrun_job_planned_steps")) == (40, 100)
    assert value("longrun_job_evicted_nodes") == 1
    assert value("longrun_fault_detection_seconds", "longrun_fault_detection_seconds_sum") == 4.0
    assert value("longrun_recovery_duration_seconds", "longrun_recovery_duration_seconds_count") == 2
    assert value("longrun_job_steps_lost", "longrun_job_steps_lost_total") == 3
    assert value("longrun_job_last_fault_steps_lost") == 0
    assert value("longrun_diagnostics_ok", node="node-a", check="memory") == 0
    assert value("longrun_diagnostics_duration_seconds", node="node-a", check="memory") == 0.05


def test_several_exporters_share_a_process_without_collisions():
    # Private registries: two workers and a controller in one process (tests, local runs).
    a, b, c = WorkerMetrics("demo", 0), WorkerMetrics("demo", 1), ControllerMetrics("demo")
    assert a.registry is not b.registry is not c.registry
    assert "longrun_train_step" in families(a.registry) and "longrun_job_state" in families(c.registry)


def test_goodput_series_cover_every_bucket_and_follow_the_account():
    from longrun.goodput.accounting import BUCKETS

    c = ControllerMetrics("demo")

    def seconds():
        samples = families(c.registry)["longrun_job_seconds_total"].samples
        return {dict(s.labels)["bucket"]: s.value for s in samples}

    assert seconds() == dict.fromkeys(BUCKETS, 0.0)  # there before the first second is accounted
    c.set_goodput({"productive": 45.0, "startup": 5.0})
    assert families(c.registry)["longrun_goodput_ratio"].samples[0].value == 0.9
    c.set_goodput({"productive": 40.0, "redone": 5.0, "startup": 5.0})  # a fault's lost work moved
    assert seconds() == dict.fromkeys(BUCKETS, 0.0) | {"productive": 40.0, "redone": 5.0, "startup": 5.0}
    assert families(c.registry)["longrun_goodput_ratio"].samples[0].value == 0.8
    c.set_goodput({"productive": 40.0, "redone": 5.0, "startup": 5.0}, wall_s=80.0)  # the clock's wall
    assert families(c.registry)["longrun_goodput_ratio"].samples[0].value == 0.5
