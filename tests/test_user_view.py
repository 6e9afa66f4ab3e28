"""What the job's user sees, piece by piece: the driver's progress line, the ranks' logs shipped
through Redis into files (a warning every rank logs printed once), TensorBoard without a
second curve over redone steps, and `longrun logs --rank`."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from longrun import keys
from longrun.cli.job_console import JobConsole
from longrun.controller.attempt import Attempt
from longrun.controller.job_state import JobRecordStore
from longrun.controller.listeners import EventLog
from longrun.controller.rank_logs import RankLogs, find_rank_log, rank_log_path, rank_ranges
from longrun.controller.state import JobState, JobStateMachine
from longrun.goodput.accounting import StepRecord
from longrun.health.decisions import Incident
from longrun.job_view import read_record
from longrun.observability.journal import JournalWriter
from longrun.observability.progress import ProgressDisplay, StepLine
from longrun.observability.tensorboard import TensorBoardWriter, tensorboard_dir
from longrun.worker.rank_log import RankLogShipper


def record(step: int, loss: float | None = 4.0, seconds: float = 0.5) -> dict:
    metrics = None if loss is None else {"loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens": 4096,
                                         "tokens_per_s": 8192.0, "mfu": None, "memory_bytes": 2**30,
                                         "step_time_s": seconds, "data_wait_s": 0.0}
    return {"step": step, "end": 1000.0 + step, "seconds": seconds, "metrics": metrics}


# -- the progress line -------------------------------------------------------------------------


def test_progress_lines_every_n_steps_and_the_last_with_eta_and_attempt():
    out: list[str] = []
    display = ProgressDisplay(10, out.append, every=4)
    display.layout = "fsdp2"
    display.steps(0, [record(s) for s in range(1, 7)])
    display.steps(1, [record(s) for s in range(3, 11)])  # redone after a fault: news, marked attempt 1
    assert [line.split("  ")[0] for line in out] == ["step 4/10", "step 4/10", "step 8/10", "step 10/10"]
    assert out[0] == ("step 4/10  loss 4.0000  grad_norm 1.00  lr 1.0e-03  tok/s 8,192  mem 1.00GiB  "
                      "eta 0:00:03  layout fsdp2  attempt 0")  # 6 steps left at 0.5 s each
    assert out[1].endswith("attempt 1") and out[-1].split("eta ")[1].startswith("0:00:00")


def test_a_skipped_step_prints_no_line():
    out: list[str] = []
    ProgressDisplay(4, out.append, every=1).steps(0, [record(1), record(2, loss=None), record(3)])
    assert [line.split("  ")[0] for line in out] == ["step 1/4", "step 3/4"]


# -- the ranks' logs -----------------------------------------------------------------------------


def test_rank_ranges():
    assert rank_ranges([3]) == "rank 3"
    assert rank_ranges([5, 0, 1, 2, 7, 8]) == "ranks 0-2, 5, 7-8"


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_ranks_logs_reach_their_files_and_a_shared_warning_is_printed_once(redis_client, redis_server,
                                                                           tmp_path):
    printed: list[str] = []
    clock = Clock()
    logs = RankLogs("uv", str(tmp_path), redis_client, redis_client, printed.append, hold_s=2.0, clock=clock)
    logs._world = 2
    logs.open(3)  # as at RENDEZVOUS, before the ranks run
    ranks = [RankLogShipper(redis_server.client(), "uv", 3, rank, interval_s=60) for rank in (0, 1)]
    for rank, shipper in enumerate(ranks):
        shipper.put("INFO", f"rank {rank} is up")
        shipper.put("WARNING", f"12:00 WARNING data: 4 files skipped (rank {rank}'s clock)",
                    text="4 files skipped")
        shipper.flush()
    ranks[1].put("WARNING", "only on rank 1", text="only on rank 1")
    ranks[1].flush()
    logs.drain(3)
    # Both ranks logged it: printed at once, with both; rank 1's own waits for the others.
    assert printed == ["warning (ranks 0-1): 4 files skipped"]
    clock.t = 2.5
    logs.drain(3)
    assert printed[1:] == ["warning (rank 1): only on rank 1"]
    ranks[0].put("WARNING", "again", text="4 files skipped")  # once per job, not per occurrence
    ranks[0].flush()
    logs.drain(3, final=True)
    assert len(printed) == 2
    assert (tmp_path / "logs" / "attempt-3" / "rank-1.log").read_text().splitlines() == [
        "rank 1 is up", "12:00 WARNING data: 4 files skipped (rank 1's clock)", "only on rank 1"]
    path, last = logs.last_lines(3, 0)
    assert path == rank_log_path(str(tmp_path), 3, 0) and last[-1] == "again"
    assert redis_client.lrange("longrun:uv:a3:logs", 0, -1) == [b'{"opened": true}']  # consumed, still open


def test_the_shipper_takes_log_records_and_printed_lines_and_gives_the_streams_back(redis_server, tmp_path):
    client = redis_server.client()
    client.flushdb()
    stdout = sys.stdout
    got: list[str] = []
    logs = RankLogs("tee", str(tmp_path), client, client, got.append)
    logs.open(0)
    shipper = RankLogShipper(client, "tee", 0, 2, interval_s=0.05).start()
    try:
        print("a printed line")
        print("no newline yet", end="")
        logging.getLogger("longrun.test").warning("a logged warning")
    finally:
        shipper.close()
    assert sys.stdout is stdout and shipper._handler not in logging.getLogger().handlers
    logs._world = 1
    logs.drain(0, final=True)
    lines = (tmp_path / "logs" / "attempt-0" / "rank-2.log").read_text().splitlines()
    assert lines[0] == "a printed line" and "no newline yet" in lines
    assert any(line.endswith("WARNING longrun.test: a logged warning") for line in lines)
    assert got == ["warning (rank 2): a logged warning"]


def test_a_rank_outliving_its_attempt_does_not_bring_its_keys_back(redis_client, redis_server, tmp_path):
    logs = RankLogs("late", str(tmp_path), redis_client, redis_client, [].append)
    logs.open(1)
    shipper = RankLogShipper(redis_server.client(), "late", 1, 0)
    shipper.put("INFO", "before the end")
    assert shipper.flush()
    logs.drain(1, final=True)
    keys.delete_attempt_keys(redis_client, "late", 1)  # the attempt ended; this rank lives on a moment
    shipper.put("INFO", "after the end")
    shipper.flush()
    assert list(redis_client.scan_iter(match="longrun:late:a1*")) == []
    assert (tmp_path / "logs" / "attempt-1" / "rank-0.log").read_text() == "before the end\n"


def test_a_list_lost_with_a_restarted_redis_is_opened_again(redis_client, redis_server, tmp_path):
    logs = RankLogs("lost", str(tmp_path), redis_client, redis_client, [].append)
    logs.open(0)
    redis_client.flushdb()  # a Redis restarted without its data
    logs.drain(0)
    shipper = RankLogShipper(redis_server.client(), "lost", 0, 0)
    shipper.put("INFO", "after the restart")
    shipper.flush()
    logs.drain(0)
    assert (tmp_path / "logs" / "attempt-0" / "rank-0.log").read_text() == "after the restart\n"


def test_a_full_queue_drops_the_oldest_lines_and_counts_them(redis_server):
    shipper = RankLogShipper(redis_server.client(), "full", 0, 0, max_queued=3)
    for i in range(5):
        shipper.put("INFO", f"line {i}")
    assert shipper.dropped == 2 and '"line": "line 2"' in shipper._queue[0]


def test_logs_rank_finds_the_newest_attempt_or_the_one_asked(cli, tmp_path):
    for attempt, text in ((0, "first life"), (2, "second life")):
        path = rank_log_path(str(tmp_path), attempt, 1)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text + "\n")
    assert find_rank_log(str(tmp_path), 1).endswith("attempt-2/rank-1.log")
    code, out, err = cli("logs", tmp_path, "--rank", "1")
    assert code == 0 and out == "second life\n" and "attempt-2/rank-1.log" in err
    code, out, _ = cli("logs", tmp_path, "--rank", "1", "--attempt", "0")
    assert code == 0 and out == "first life\n"
    code, _, err = cli("logs", tmp_path, "--rank", "7")
    assert code == 1 and "no log of rank 7" in err and "attempts there: 0, 2" in err


# -- TensorBoard -----------------------------------------------------------------------------------


def losses(run_dir) -> list[tuple[int, float]]:
    """(step, loss) of every loss point in the event files, as TensorBoard reads them."""
    acc = EventAccumulator(tensorboard_dir(run_dir))
    acc.Reload()
    return sorted((e.step, round(e.value, 4)) for e in acc.Scalars("train/loss"))


def test_tensorboard_draws_each_step_once_across_a_fault_and_a_second_controller(tmp_path):
    journal = JournalWriter(tmp_path)
    tb = TensorBoardWriter(tmp_path)
    first = [StepRecord(s, 1000.0 + s, 0.5, metrics=record(s, loss=5.0 - s / 10)["metrics"])
             for s in range(1, 6)]
    for r in first:
        tb.step(r.step, r.metrics)
    journal.steps(0, [{"step": r.step, **r.metrics} for r in first])
    # A fault after step 5: attempt 1 restores step 3 and trains 4..7 again.
    for s in range(4, 8):
        tb.step(s, record(s, loss=5.0 - s / 10)["metrics"])
    journal.steps(1, [{"step": s, **record(s, loss=5.0 - s / 10)["metrics"]} for s in range(4, 8)])
    tb.event("attempt 1: fault dead (rank 1): gone")
    tb.close()
    assert losses(tmp_path) == [(s, round(5.0 - s / 10, 4)) for s in range(1, 8)]
    # A second controller of the same job (a SIGTERM and a rerun) continues the curve.
    again = TensorBoardWriter(tmp_path)
    assert again.written == 7
    assert not again.step(6, record(6)["metrics"]) and again.step(8, record(8, loss=4.2)["metrics"])
    again.close()
    assert sorted(s for s, _ in losses(tmp_path)) == list(range(1, 9))  # each step once
    acc = EventAccumulator(tensorboard_dir(tmp_path))
    acc.Reload()
    assert "events" in acc.Tags()["tensors"]


def test_logs_of_a_directory_without_rank_says_what_to_pass(cli, tmp_path):
    code, _, err = cli("logs", tmp_path)
    assert code == 2 and "pass --rank R" in err


# -- a fault names its rank's log, and status shows its last lines --------------------------------


def test_a_dead_ranks_fault_carries_its_log_file_and_last_lines_into_status(redis_client, redis_server,
                                                                             tmp_path):
    printed: list[str] = []
    logs = RankLogs("st", str(tmp_path), redis_client, redis_client, printed.append)
    logs.open(2)
    shipper = RankLogShipper(redis_server.client(), "st", 2, 1)
    for i in range(14):
        shipper.put("INFO", f"line {i}" + ("\nTraceback (most recent call last):" if i == 13 else ""))
    shipper.flush()
    store = JobRecordStore(redis_client, "st")
    store.record_transition(JobStateMachine().transition(JobState.PLACING, "placing"), 2)
    event_log = EventLog(store, printed.append, logs.last_lines)
    event_log.declared(Attempt(2), [Incident("dead", rank=1, detail="rank 1's process died")], 0.0)
    path = rank_log_path(str(tmp_path), 2, 1)
    assert printed[0] == f"fault: rank 1's process died; its last lines are in {path}"
    # The console shows the last 3 (a record's first line); the record keeps 10, whole.
    assert printed[1:] == ["  rank 1| line 11", "  rank 1| line 12", "  rank 1| line 13 ..."]
    now_ms = int(time.time() * 1000)
    view, _ = read_record(redis_server.url, "st", started_ms=now_ms - 60_000, ended_ms=None)
    shown = view.events[-1].splitlines()
    assert shown[0].endswith("fault: rank 1's process died") and shown[1] == f"    log: {path}"
    tail = ["    | line 13", "    | Traceback (most recent call last):"]  # the whole record
    assert shown[2:] == [f"    | line {i}" for i in range(4, 13)] + tail


def test_the_job_console_is_plain_text_when_piped_and_a_live_bar_in_a_terminal():
    step = StepLine("step 5/10  loss 4.0000", step=5, total=10, loss=4.0, eta_s=3.0, attempt=1)
    piped = io.StringIO()
    with JobConsole(Console(file=piped, force_terminal=False, width=200), 10) as shown:
        shown.line("state RUNNING: training")
        shown.line(step)
    assert piped.getvalue() == "state RUNNING: training\nstep 5/10  loss 4.0000\n"
    tty = io.StringIO()
    with JobConsole(Console(file=tty, force_terminal=True, width=200), 10) as shown:
        shown.line("state RUNNING: training")
        shown.line(step)
    text = tty.getvalue()
    assert "\x1b[" in text and "5/10" in text and "attempt 1" in text and "eta 0:00:03" in text


def test_weights_and_biases_offline_logs_each_step_once_in_the_jobs_directory(tmp_path):
    pytest.importorskip("wandb")

    def loss(step: int) -> float:
        return 3.0 + step / 1000 + 1e-7  # a value whose text appears nowhere else in the run file

    # An earlier controller of this job trained steps 1-5 (in its journal); this one resumes at
    # step 3 after a fault: steps 4 and 5 are trained again, and must not be logged again.
    JournalWriter(tmp_path).steps(0, [{"step": s, **record(s, loss=loss(s))["metrics"]} for s in range(1, 6)])
    # In a fresh interpreter, as the controller's own process is (W&B keeps per-process state).
    steps = {step: record(step, loss=loss(step))["metrics"] for step in range(4, 9)}
    code = textwrap.dedent(f"""
        from longrun.observability.wandb_log import WandbRun
        run = WandbRun("wb job", {str(tmp_path)!r}, "offline", {{"training": {{"steps": 8}}}})
        for step, metrics in {steps!r}.items():
            run.step(step, metrics)
        run.event("attempt 1: fault dead (rank 1): gone")
        run.close()
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    files = list(tmp_path.glob("wandb/offline-run-*-wb-job/run-wb-job.wandb"))
    assert len(files) == 1, list(tmp_path.rglob("*"))
    data = files[0].read_bytes()
    counts = {s: data.count(repr(loss(s)).encode()) for s in range(4, 9)}
    assert counts[4] == counts[5] == 0 and counts[6] >= 1 and counts[6] == counts[7] == counts[8], counts
    assert b"train/loss" in data and b"fault dead" in data
