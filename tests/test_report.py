"""`longrun report`: the figures, the HTML and the command, on journals written here with
JournalWriter (the controller's own writer), then the HTML as a real browser draws it."""

from __future__ import annotations

import math
import random
import re
import struct

import pytest
from browser import open_page

from longrun.observability import report_figures as figs
from longrun.observability.journal import JournalWriter, read_journal
from longrun.observability.report import CHARTS, ReportError, header, load, render, write_report

T0 = 1_700_000_000.0


class Sim:
    """Writes a job's journal as its controller would: transitions, events and step records,
    on a clock that only moves forward."""

    def __init__(self, run_dir, t0: float = T0, seed: int = 0):
        self.writer = JournalWriter(run_dir)
        self.t, self.attempt, self.state = t0, 0, None
        self.rng = random.Random(seed)

    def move(self, to: str, reason: str, after: float = 0.0) -> None:
        self.t += after
        self.writer.event({"at": self.t, "attempt": self.attempt, "type": "transition", "from": self.state,
                           "to": to, "reason": reason})
        self.state = to

    def event(self, kind: str, reason: str, after: float = 0.0, **extra) -> None:
        self.t += after
        self.writer.event({"at": self.t, "attempt": self.attempt, "type": kind, "reason": reason, **extra})

    def start(self, resume_step: int, source: str, setup_s: float = 2.0) -> None:
        """PLACING through RUNNING, then the restore of `resume_step` from `source`."""
        for to, reason, after in (("PLACING", f"placing attempt {self.attempt}", 0.5),
                                  ("DIAGNOSING", "self-checks on every node", setup_s),
                                  ("RENDEZVOUS", "the ranks meet", setup_s * 1.5),
                                  ("RUNNING", "every rank joined", setup_s)):
            self.move(to, reason, after)
        self.event("resumed", f"attempt {self.attempt} restored step {resume_step} from {source}", after=1.0,
                   step=resume_step, source=source)

    def train(self, first: int, last: int, step_s: float = 1.0, ckpt_every: int = 0, ckpt_s: float = 0.0,
              snapshot_every: int = 0, tokens_per_s: float = 8192.0) -> None:
        for step in range(first, last + 1):
            checkpoint_s = ckpt_s if ckpt_every and step % ckpt_every == 0 else 0.0
            snapshot_s = 0.2 if snapshot_every and step % snapshot_every == 0 else 0.0
            seconds = step_s * self.rng.uniform(0.95, 1.05) + checkpoint_s + snapshot_s
            self.t += seconds
            loss = 2.0 + 8.0 * math.exp(-step / 150) + self.rng.gauss(0, 0.05)
            trained_s = seconds - checkpoint_s - snapshot_s  # throughput is of the step, not its saves
            rate = tokens_per_s * self.rng.uniform(0.93, 1.0) * step_s / trained_s
            self.writer.step(self.attempt, {
                "step": step, "end": self.t, "seconds": seconds, "checkpoint_s": checkpoint_s,
                "snapshot_s": snapshot_s, "data_s": 0.01, "loss": loss, "grad_norm": 1.0, "lr": 3e-4,
                "tokens": int(tokens_per_s * step_s), "tokens_per_s": rate, "mfu": None,
                "step_time_s": seconds, "data_wait_s": 0.01, "memory_bytes": 2**30})

    def fault(self, kind: str, rank: int, node: str, step: int, reason: str, detect_s: float = 2.0) -> None:
        self.event("fault", reason, after=detect_s, fault=kind, rank=rank, node=node, step=step)
        self.event("decision", f"restart: {kind} on rank {rank}", action="restart")
        self.move("RECOVERING", f"{kind} on rank {rank}: restarting", after=0.5)
        self.attempt += 1


def two_attempts(run_dir, *, finish: bool = True, goodput: bool = True) -> Sim:
    """The standard journal: attempt 0 trains to step 24 with checkpoints every 10 steps, rank 1
    dies, attempt 1 restores step 20 from storage and trains to 40."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text("job:\n  name: tiny-two\n  output_dir: runs\n")
    sim = Sim(run_dir)
    sim.move("PENDING", "submitted")
    sim.start(0, "none")
    sim.train(1, 24, ckpt_every=10, ckpt_s=0.5)
    sim.fault("dead", 1, "node-b", 24, "rank 1's process is gone (exit code -9)")
    sim.event("evicted", "node node-b will not be used again", node="node-b")
    sim.start(20, "storage")
    sim.train(21, 22, ckpt_every=10, ckpt_s=0.5)
    sim.event("recovered", "attempt 1 completed its first step", seconds=13.0, resumed_from=20, steps_lost=4)
    sim.train(23, 40, ckpt_every=10, ckpt_s=0.5)
    if finish:
        sim.move("SUCCEEDED", "trained 40 steps", after=0.5)
    if goodput:
        buckets = {"productive": 36.0, "redone": 4.0, "startup": 23.0, "restore_storage": 1.5,
                   "restore_memory": 0.0, "checkpoint": 2.0, "detection": 2.0, "backoff": 5.5,
                   "shutdown": 0.5}
        sim.writer.goodput({"buckets": buckets,
                            "faults": [{"attempt": 0, "kind": "dead", "steps_lost": 4}], "updated_at": sim.t,
                            "last_step": 40, "state": sim.state, "attempt": sim.attempt})
    return sim


@pytest.fixture
def job(tmp_path):
    two_attempts(tmp_path / "tiny")
    return tmp_path / "tiny"


def traces(fig, **match):
    return [t for t in fig.data if all(getattr(t, k) == v for k, v in match.items())]


def test_the_loss_curve_has_one_line_per_attempt_overlapping_where_steps_were_redone(job):
    fig = figs.loss_figure(read_journal(job))
    first, second = traces(fig, name="attempt 0")[0], traces(fig, name="attempt 1")[0]
    assert list(first.x) == list(range(1, 25)) and list(second.x) == list(range(21, 41))
    (marks,) = traces(fig, name="fault: dead")
    assert list(marks.x) == [24] and marks.y[0] == first.y[-1]  # on attempt 0's line, where it died
    assert "rank 1's process is gone" in marks.hovertext[0] and "node-b" in marks.hovertext[0]
    assert [s.x0 for s in fig.layout.shapes] == [24]  # the vertical line at the fault's step


def test_throughput_is_per_attempt_over_time(job):
    fig = figs.throughput_figure(read_journal(job))
    assert [t.name for t in fig.data] == ["attempt 0", "attempt 1"]
    assert fig.data[0].x[0].startswith("2023-11-14 22:1")  # T0 in UTC
    assert list(fig.data[1].customdata) == list(range(21, 41)) and all(y > 0 for y in fig.data[1].y)


def test_the_timeline_has_the_states_the_saves_the_restore_and_the_fault(job):
    journal = read_journal(job)
    fig = figs.timeline_figure(journal)
    bars = {t.name: t for t in fig.data if t.type == "bar"}
    assert {"pending", "placing", "self-checks", "rendezvous", "running", "recovering (backoff)"} <= set(bars)
    running = bars["running"]
    assert len(running.x) == 2  # one span per attempt
    # attempt 0 ran from its RUNNING transition to the RECOVERING one
    moves = [e for e in journal.events if e["type"] == "transition"]
    ran = next(e for e in moves if e["to"] == "RUNNING")["at"]
    recovering = next(e for e in moves if e["to"] == "RECOVERING")["at"]
    assert running.x[0] == pytest.approx((recovering - ran) * 1000) and running.base[0] == figs.when(ran)
    (checkpoints,) = traces(fig, name="checkpoint")
    assert len(checkpoints.x) == 4 and "step 10" in checkpoints.hovertext[0]  # steps 10, 20, 30, 40
    (storage,) = traces(fig, name="restore from storage")
    assert "restored step 20" in storage.hovertext[0]
    (dead,) = traces(fig, name="fault: dead")
    assert set(dead.y) == {"fault: dead"} and "rank 1" in dead.hovertext[0]
    (end,) = traces(fig, name="succeeded")
    assert end.x[0] == figs.when(moves[-1]["at"])
    (evicted,) = traces(fig, name="evicted")  # any other kind of event: a row of its own
    assert set(evicted.y) == {"evicted"} and "node-b will not be used" in evicted.hovertext[0]
    assert list(fig.layout.yaxis.categoryarray)[-1] == "job state"  # the state row is drawn on top


def test_time_by_phase_stacks_the_goodput_buckets_that_are_not_empty(job):
    fig = figs.phase_figure(read_journal(job))
    assert [t.name for t in fig.data] == ["productive", "redone", "startup", "restore storage", "checkpoint",
                                          "detection", "backoff", "shutdown"]
    assert fig.layout.barmode == "stack" and fig.data[0].x == (36.0,)
    assert "48.3%" in fig.data[0].hovertext[0]  # 36 of 74.5 s


def test_the_report_is_one_self_contained_html_file(job, tmp_path):
    path = write_report(job, tmp_path / "out" / "report.html")
    text = path.read_text()
    for chart in CHARTS:
        assert f'id="{chart}"' in text
    assert re.search(r"<script[^>]*\bsrc\s*=", text, re.IGNORECASE) is None  # nothing to fetch
    assert text.count("Plotly.newPlot") == 4 and len(text) > 1_000_000  # plotly.js is inlined, once
    assert "longrun report: tiny-two" in text  # job.name from config.yaml
    head = text.split("<section>")[0]  # the header, before plotly.js (whose text says "as of" too)
    assert "SUCCEEDED at 2023-11-14" in head and "as of" not in head
    assert "goodput 48.3% of 1m 14s" in head and "dead 1" in head


def test_a_running_job_renders_as_of_its_newest_line(tmp_path):
    sim = two_attempts(tmp_path / "tiny", finish=False, goodput=False)
    journal = read_journal(tmp_path / "tiny")
    h = header(journal)
    assert h.state.startswith("running (as of 2023-11-14") and "now RUNNING" in h.reason
    # the newest RUNNING span reaches the newest step: the job has got that far
    running = next(t for t in figs.timeline_figure(journal).data if t.name == "running")
    last_start = next(e for e in reversed(journal.events) if e.get("to") == "RUNNING")["at"]
    assert running.x[-1] == pytest.approx((sim.t - last_start) * 1000)
    text = render(journal)
    assert "running (as of" in text.split("<section>")[0]
    assert "not known" in text  # no goodput yet: said so, and no chart
    assert 'id="time-by-phase"' not in text


def test_a_failed_job_and_a_resumed_one_render(tmp_path):
    sim = Sim(tmp_path / "job")
    sim.start(0, "none")
    sim.train(1, 5)
    sim.move("PREEMPTED", "SIGTERM: saved step 5", after=1.0)
    # A second `longrun run` appends to the same journal, numbering its attempts from 0 again.
    sim.attempt = 0
    sim.start(5, "storage")
    sim.train(3, 4)  # steps going back within one attempt number: a new segment, not a line back
    sim.event("store_outage", "Redis <unreachable> for 3 s", seconds=3.0)
    sim.move("FAILED", "fatal: the data <shard> is missing", after=1.0)
    journal = read_journal(tmp_path / "job")
    loss = figs.loss_figure(journal)
    assert list(loss.data[0].x) == [1, 2, 3, 4, 5, None, 3, 4]
    timeline = figs.timeline_figure(journal)
    assert {"no controller (ended)", "failed", "store_outage"} <= {t.name for t in timeline.data}
    text = render(journal)
    assert "FAILED at" in text and "longrun report: job" in text  # no config.yaml: the directory's name
    assert "the data &lt;shard&gt; is missing" in text and "<shard>" not in text


def test_a_directory_without_a_journal_is_a_clear_error(tmp_path):
    with pytest.raises(ReportError, match=r"has no journal .*pass the job's run directory"):
        load(tmp_path)
    (tmp_path / "journal").mkdir()
    (tmp_path / "journal" / "steps.jsonl").write_text("")
    with pytest.raises(ReportError, match="has no journal"):
        load(tmp_path)
    with pytest.raises(ReportError, match="is not a directory"):
        load(tmp_path / "missing")
    two_attempts(tmp_path / "runs" / "tiny")  # the output directory given for the job's
    with pytest.raises(ReportError, match=r"pass one of the job directories in it: .*runs/tiny"):
        load(tmp_path / "runs")


def test_the_command_writes_the_report_and_refuses_an_empty_directory(cli, job, tmp_path):
    code, out, _ = cli("report", job)
    assert code == 0 and str(job / "report.html") in out and (job / "report.html").stat().st_size > 1_000_000
    code, out, _ = cli("report", job, "--out", tmp_path / "r.html")
    assert code == 0 and (tmp_path / "r.html").exists()
    code, _, err = cli("report", tmp_path / "nothing")
    assert code == 2 and "is not a directory" in err and "Traceback" not in err


def test_long_series_are_thinned_keeping_the_last_step():
    rows = [{"step": i} for i in range(1, 12_346)]
    kept = figs.thin(rows, limit=1000)
    assert len(kept) <= 1001 and kept[0]["step"] == 1 and kept[-1]["step"] == 12_345
    assert figs.thin(rows[:10], limit=1000) == rows[:10]


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_chromium_draws_every_chart_without_errors_or_network(job, tmp_path):
    path = write_report(job, tmp_path / "report.html")
    with open_page() as view:
        view.page.goto(path.as_uri(), wait_until="load")
        for chart in CHARTS:
            view.page.wait_for_selector(f"#{chart}.js-plotly-plot .main-svg")
        page = view.page
        assert page.locator("#loss-curve g.trace.scatter").count() == 3  # two attempts and the fault marks
        assert page.locator("#loss-curve g.trace.scatter path.js-line").count() >= 2
        assert page.locator("#timeline g.trace.bars path").count() >= 8  # the state spans
        assert page.locator("#timeline g.trace.scatter path.point").count() >= 6
        assert page.locator("#time-by-phase g.trace.bars path").count() == 8
        assert "tiny-two" in page.locator("h1").inner_text()
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=True)
        assert view.errors == [] and view.remote == []
    width, height = png_size(shot)
    assert width == 1400 and height > 1500 and shot.stat().st_size > 50_000
