"""Validation (issue 43): a pass over held-out data every `validation.interval_steps` steps, on
every rank at the job's layout. Its data never meets the training stream, its loss agrees across
layouts and is bitwise the same after a SIGKILL and a resume, it leaves training untouched, and
it reaches the progress line, TensorBoard, the journal and report, `longrun status`, Prometheus
and its own goodput bucket."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import validation_workers as vw
from browser import open_page
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from worlds import run_world

from longrun.config import ConfigError, config_from_dict
from longrun.config.identity import identity_changes, job_identity
from longrun.controller.job_state import JobRecordStore
from longrun.controller.listeners import ProgressRecord
from longrun.controller.state import JobState, JobStateMachine
from longrun.controller.user_view import JournalListener, ProgressLines, TensorBoardListener
from longrun.goodput.accounting import BUCKETS, GoodputAccount, Restore, StepRecord
from longrun.job_view import read_log, read_record
from longrun.observability.journal import JournalWriter
from longrun.observability.metrics import WorkerMetrics
from longrun.observability.report import write_report
from longrun.observability.tensorboard import TensorBoardWriter, tensorboard_dir
from longrun.trainer import Trainer
from longrun.worker.hooks import StepHooks

TESTS = Path(__file__).parent
BASE = {"job": {"name": "val"}, "training": {"steps": 10}}


def tiny(validation: dict | None = None, **sections):
    """A tiny synthetic job whose longer documents are cut into several chunks."""
    raw = {"job": {"name": "val", "seed": 3}, "cluster": {"device": "cpu"},
           "model": {"dim": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 32},
           "data": {"source": "synthetic", "micro_batch_tokens": 128, "prefetch": 1,
                    "synthetic": {"min_len": 8, "max_len": 96, "mean": 30, "sigma": 0.8}},
           "training": {"steps": 10, "lr": 3e-3, "warmup_steps": 1}}
    if validation is not None:
        raw["validation"] = validation
    for name, values in sections.items():
        raw[name] = raw.get(name, {}) | values
    return config_from_dict(raw)


# -- the settings -------------------------------------------------------------------------------


def test_off_by_default_so_a_job_without_it_trains_and_resumes_as_before():
    cfg = config_from_dict(BASE)
    assert not cfg.validation.enabled
    assert not any(key.startswith("validation") for key in job_identity(cfg))
    with Trainer(tiny(), progress=False) as trainer:
        assert trainer.validator is None
        assert trainer.train(steps=1).val_loss is None


@pytest.mark.parametrize("validation, training, field, needle", [
    ({"interval_steps": 5}, {}, "validation", "set validation.path"),
    ({"interval_steps": 5, "path": "/x", "held_out": 0.1}, {}, "validation", "not both"),
    ({"held_out": 0.1}, {}, "validation", "no validation.interval_steps"),
    ({"interval_steps": 5, "held_out": 0.9}, {}, "validation.held_out", "less than or equal to 0.5"),
    ({"interval_steps": 20, "held_out": 0.1}, {"steps": 10}, "validation.interval_steps",
     "set it to at most 10"),
])
def test_bad_settings_are_refused_naming_what_to_change(validation, training, field, needle):
    raw = {"job": {"name": "val"}, "training": {"steps": 10} | training, "validation": validation}
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    [(path, why)] = info.value.problems
    assert path == field and needle in why, info.value.problems
    assert "\n" not in why


def test_a_validation_path_beside_synthetic_data_is_refused():
    with pytest.raises(ConfigError, match=r"remove validation\.path and set validation\.held_out"):
        tiny({"interval_steps": 5, "path": "/somewhere"})


def test_only_the_held_out_share_is_part_of_the_jobs_identity():
    """Holding documents out changes what trains (a resume must accept it); when and how much
    validation runs does not, and never blocks a resume."""
    plain = tiny()
    held = tiny({"interval_steps": 5, "held_out": 0.1})
    more = tiny({"interval_steps": 2, "held_out": 0.1, "steps": 3})
    assert [c.key for c in identity_changes(job_identity(plain), None, held, None)] == ["validation.held_out"]
    assert identity_changes(job_identity(held), None, more, None) == []


# -- the data -----------------------------------------------------------------------------------


def test_held_out_documents_are_never_trained_and_a_pass_follows_every_fifth_step():
    cfg = tiny({"interval_steps": 5, "held_out": 0.1, "steps": 2})
    with Trainer(cfg, progress=False) as trainer:
        losses, val_losses, trained, validated = vw.train_and_validate(trainer)
        train_view, held_view = trainer.corpus, trainer.validator.corpus
        # Split by source document: a document cut into several chunks is wholly on one side.
        base = train_view.base
        assert (np.bincount(base.chunk_documents) > 1).any(), "no document spans chunks: nothing tested"
        train_docs = {base.document_of(int(i)) for i in train_view.items}
        held_docs = {base.document_of(int(i)) for i in held_view.items}
        assert train_docs.isdisjoint(held_docs)
        assert len(train_view) + len(held_view) == len(base)
        assert len(held_docs) == math.ceil(0.1 * base.num_documents)
    assert sorted(val_losses) == [5, 10] and sorted(losses) == list(range(1, 11))
    assert validated and validated <= held_docs and trained and trained.isdisjoint(validated)
    assert all(math.isfinite(v) for v in val_losses.values())


def _text_dir(root: Path, n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    root.mkdir()
    words = ["alpha", "beta", "gamma", "delta", "train", "valid", "loss", "step"]
    for i in range(n):
        (root / f"doc{i:03d}.txt").write_text(" ".join(rng.choice(words, size=int(rng.integers(5, 40)))))
    return str(root)


def test_a_validation_path_leaves_training_bitwise_untouched(tmp_path):
    """Validation on its own data: the training losses are those of the job without validation,
    bit for bit (no RNG, data position or weight is touched), and the passes see only that data."""
    data = {"source": "text", "path": _text_dir(tmp_path / "train", 40, 1), "include": ["*.txt"],
            "micro_batch_tokens": 128, "prefetch": 1, "synthetic": {}}
    val_dir = _text_dir(tmp_path / "valid", 8, 2)
    with Trainer(tiny(data=data), progress=False) as trainer:
        plain = [trainer.train_step().loss for _ in range(6)]
    with Trainer(tiny({"interval_steps": 3, "path": val_dir}, data=data), progress=False) as trainer:
        metrics = [trainer.train_step() for _ in range(6)]
        assert trainer.validator.corpus.root == Path(val_dir)
    assert [m.loss for m in metrics] == plain
    assert [m.step for m in metrics if m.val_loss is not None] == [3, 6]


# -- layouts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("parallelism", [{"fsdp": 2}, {"tp": 2}, {"cp": 2}], ids=["fsdp2", "tp2", "cp2"])
def test_every_layout_computes_the_losses_of_one_process(parallelism, tmp_path):
    """Ten steps validated every five at dp 1 (one process) and at a two-rank layout: the same
    global batches, so the same validation losses within float tolerance, on every rank."""
    with Trainer(vw.validated_config({}, 1), "cpu", progress=False) as alone:
        _, want, trained, validated = vw.train_and_validate(alone)
    assert sorted(want) == [5, 10] and trained.isdisjoint(validated)
    out = run_world(vw.layout_validates, 2, tmp_path, args=(parallelism,))
    for rank, _losses, got, trained_here, _ in out:
        assert sorted(got) == [5, 10], rank
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=1e-4), (rank, step)
        assert trained_here.isdisjoint(validated)
    assert out[0][2] == out[1][2]  # every rank reports the one reduced number
    # Each rank evaluates its share of the same held-out batches (a CP slice names none).
    shares = [validated_here for *_, validated_here in out]
    assert set().union(*shares) <= validated
    if "fsdp" in parallelism:
        assert set().union(*shares) == validated


def test_pipeline_stages_validate_with_the_last_stage_computing_the_loss(tmp_path):
    out = run_world(vw.pipeline_validates, 2, tmp_path)
    for rank, loss, reference, losses_every_2, losses_every_4, val_every_2, val_every_4 in out:
        assert loss == pytest.approx(reference, rel=1e-5), rank
        # How often validation ran changes nothing of training, nor what a pass computes.
        assert losses_every_2 == losses_every_4, rank
        assert val_every_2 == val_every_4, rank
    assert out[0][1] == out[1][1]  # the first stage reports the last stage's loss


# -- resume -------------------------------------------------------------------------------------


def _run(root: Path, kill_after: int | None = None) -> subprocess.CompletedProcess:
    args = [sys.executable, str(TESTS / "validation_workers.py"), str(root)]
    return subprocess.run(args + ([str(kill_after)] if kill_after else []), capture_output=True, text=True,
                          timeout=300)


def _val_lines(out: str) -> dict[int, str]:
    return {int(step): value for _, step, value in (line.split() for line in out.splitlines()
                                                     if line.startswith("val "))}


def test_a_job_resumed_after_sigkill_computes_the_same_validation_losses_bitwise(tmp_path):
    straight = _run(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr
    want = _val_lines(straight.stdout)
    assert sorted(want) == [5, 10]
    killed = _run(tmp_path / "faulty", kill_after=7)  # step 4's checkpoint committed, step 5 validated
    assert killed.returncode == -9, killed.stderr
    assert _val_lines(killed.stdout) == {5: want[5]}
    resumed = _run(tmp_path / "faulty")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.splitlines()[0] == "resumed 4"  # the restore path, in a new process
    assert _val_lines(resumed.stdout) == want  # step 5 validated again, and step 10: bit for bit


# -- where it shows -----------------------------------------------------------------------------


def _records(tmp_path) -> list[StepRecord]:
    """A real validated run's step records as the lowest rank's ledger carries them."""
    cfg = tiny({"interval_steps": 5, "held_out": 0.1})
    records: list[StepRecord] = []
    with Trainer(cfg, progress=False) as trainer:
        trainer.train(on_step=lambda m: records.append(StepRecord(
            m.step, 1000.0 + m.step, m.step_time_s + m.validation_s, validation_s=m.validation_s,
            metrics=m.report())))
    return records


def test_val_loss_reaches_the_progress_line_tensorboard_and_the_report(tmp_path):
    records = _records(tmp_path)
    val = {r.step: r.metrics["val_loss"] for r in records if "val_loss" in r.metrics}
    assert sorted(val) == [5, 10] and all(r.validation_s > 0 for r in records if r.step in val)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("job:\n  name: val\n")
    lines: list[str] = []
    tb = TensorBoardWriter(run_dir)
    cfg = tiny({"interval_steps": 5, "held_out": 0.1})
    journal = JournalWriter(run_dir)
    listeners = [ProgressLines(cfg, lines.append, lambda: "single"), TensorBoardListener(tb),
                 JournalListener(journal, None, str(run_dir))]
    for listener in listeners:
        listener.steps(0, records)
    journal.event({"type": "transition", "from": "RUNNING", "to": "SUCCEEDED", "reason": "done",
                   "attempt": 0, "at": 1011.0})
    tb.close()
    # The progress line: after a validated step only.
    shown = {int(line.split()[1].split("/")[0]): line for line in lines}
    assert f"val_loss {val[5]:.4f}" in shown[5] and "val_loss" not in shown[4]
    assert read_log(shown[10]).val_loss == pytest.approx(val[10], abs=1e-4)
    # TensorBoard, read back by its own reader.
    acc = EventAccumulator(tensorboard_dir(run_dir))
    acc.Reload()
    assert {e.step: e.value for e in acc.Scalars("validation/loss")} == pytest.approx(val)
    assert [e.step for e in acc.Scalars("time/validation_s")] == [5, 10]
    # The report: a second, dashed curve on the loss chart, drawn by a real browser.
    path = write_report(run_dir, tmp_path / "report.html")
    with open_page() as view:
        view.page.goto(path.as_uri(), wait_until="load")
        view.page.wait_for_selector("#loss-curve.js-plotly-plot .main-svg")
        traces = view.page.locator("#loss-curve g.trace.scatter")
        assert traces.count() == 2  # attempt 0 and validation
        assert view.page.locator("#loss-curve g.trace.scatter path.point").count() == 2  # its two passes
        assert "validation" in view.page.locator("#loss-curve .legend").text_content()
        assert view.errors == [] and view.remote == []


def test_status_and_prometheus_show_the_newest_validation_loss(redis_client, redis_server):
    store = JobRecordStore(redis_client, "val")
    store.update(steps=10, world_size=1)
    store.record_transition(JobStateMachine().transition(JobState.PLACING, "placing"), 0)
    records = [StepRecord(s, 1000.0 + s, 0.5, metrics={"loss": 3.0} | ({"val_loss": 4.0 - s / 10}
                                                                        if s % 5 == 0 else {}))
               for s in range(1, 12)]
    ProgressRecord(store).steps(0, records)
    started_ms = int(time.time() * 1000) - 60_000
    view, why = read_record(redis_server.url, "val", started_ms=started_ms, ended_ms=None)
    assert why == "" and (view.val_loss, view.val_step) == (pytest.approx(3.0), 10)
    worker = WorkerMetrics("val", 0)
    with Trainer(tiny({"interval_steps": 1, "held_out": 0.1}), progress=False) as trainer:
        m = trainer.train(steps=1)
    worker.observe_step(m)
    [family] = [f for f in text_string_to_metric_families(generate_latest(worker.registry).decode())
                if f.name == "longrun_validation_loss"]
    assert [s.value for s in family.samples] == [pytest.approx(m.val_loss)]


def test_validation_seconds_are_a_goodput_bucket_of_their_own():
    account = GoodputAccount(started_at=0.0)
    account.moved(JobState.PLACING, 0.0, attempt=0)
    account.moved(JobState.RUNNING, 1.0, attempt=0)
    account.began(0, Restore(step=None, source="none", seconds=0.0, at=2.0))
    account.steps(0, [StepRecord(1, 3.0, 1.0), StepRecord(2, 5.5, 2.5, validation_s=1.5, checkpoint_s=0.25)])
    buckets = account.buckets()
    assert "validation" in BUCKETS and buckets["validation"] == pytest.approx(1.5)
    assert buckets["checkpoint"] == pytest.approx(0.25) and buckets["productive"] == pytest.approx(1.75)
    assert StepRecord.from_json(StepRecord(2, 5.5, 2.5, validation_s=1.5).to_json()).validation_s == 1.5


def test_a_passs_seconds_ride_on_its_steps_ledger_record():
    """StepHooks puts the trainer's validation seconds on the step record the pass followed, and
    only there (the goodput account reads them from it)."""
    class Ledger:
        def __init__(self):
            self.records: list[tuple[int, float]] = []

        def step(self, step, metrics=None, validation_s=0.0, **blocked) -> None:
            self.records.append((step, validation_s, metrics.get("val_loss")))

    class Beat:
        def update(self, **fields) -> None: ...

    hooks = StepHooks(Beat(), WorkerMetrics("val", 0))
    hooks.ledger = Ledger()
    with Trainer(tiny({"interval_steps": 2, "held_out": 0.1}), progress=False) as trainer:
        hooks.trainer = trainer
        trainer.train(steps=3, on_step=hooks.after_step)
    seconds = {step: s for step, s, _ in hooks.ledger.records}
    assert seconds[2] > 0 and seconds[1] == seconds[3] == 0.0
    assert [step for step, _, val in hooks.ledger.records if val is not None] == [2]
