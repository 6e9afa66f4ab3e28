"""The job as its user sees it, end to end: a 2-rank `longrun run` whose rank 1 is SIGKILLed at
step 5 and restarted, its console piped to a file as a user's would be.

One job, several readings of it: the console (one progress line per logged step and attempt,
no Ray folding, no escape codes, state lines in order, nodes by host and address, no paragraph of
Ray's on the killed worker, `done:` last), the killed rank's log file named by its fault,
`longrun logs --rank`, TensorBoard (each step's loss once across the restart), the journal, and
`longrun report` drawn by headless Chromium.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from browser import open_page
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from longrun.observability.journal import read_journal

STEPS, LOG_EVERY, KILLED_AT = 10, 2, 5
_STEP = re.compile(r"^step (\d+)/(\d+)  loss [0-9.]+  .*  attempt (\d+)$")
_STATE = re.compile(r"^state ([A-Z]+): ")


def job_config(out_dir: Path) -> dict:
    return {
        "job": {"name": "seen", "output_dir": str(out_dir), "seed": 7},
        "cluster": {"nodes": 1, "workers_per_node": 2, "device": "cpu"},
        "parallelism": {"dp": 2},
        "model": {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "max_seq_len": 64},
        "data": {"source": "text", "path": "stdlib", "include": ["json/*.py"], "micro_batch_tokens": 256},
        "training": {"steps": STEPS, "lr": 1e-3, "warmup_steps": 2, "log_every": LOG_EVERY},
        "checkpoint": {"interval_steps": 3},
        "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5.0,
                   "faults": [{"rank": 1, "step": KILLED_AT, "kind": "kill"}]},
        "recovery": {"restart_backoff_s": 0.5, "diagnostics": []},
    }


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("seen")
    config = out_dir / "job.yaml"
    config.write_text(yaml.safe_dump(job_config(out_dir)))
    console = out_dir / "console.txt"
    with console.open("w") as f:  # piped, as `longrun run job.yaml > console.txt` would be
        run = subprocess.run([sys.executable, "-m", "longrun.cli", "run", str(config)], cwd=out_dir,
                             stdout=f, stderr=subprocess.STDOUT, timeout=300,
                             env=os.environ | {"OMP_NUM_THREADS": "1"})
    text = console.read_text()
    assert run.returncode == 0, text[-4000:]
    return out_dir / "seen", text


def test_the_console_shows_the_job_as_one(job):
    _, text = job
    assert "\x1b" not in text and "repeated" not in text and "TrainWorker" not in text, text
    assert "Unhandled error" not in text, text  # a surviving rank's error, read by the controller
    lines = text.splitlines()
    printed = [(int(m.group(3)), int(m.group(1))) for line in lines if (m := _STEP.match(line))]
    assert len(printed) == len(set(printed)), printed  # one line per step and attempt
    by_attempt: dict[int, list[int]] = {}
    for attempt, step in printed:
        by_attempt.setdefault(attempt, []).append(step)
    assert sorted(by_attempt) == [0, 1], printed
    logged = [s for s in range(1, STEPS + 1) if s % LOG_EVERY == 0 or s == STEPS]
    # Attempt 0 printed the logged steps it finished before the kill; attempt 1 resumed (from a
    # peer's memory snapshot or the step-3 checkpoint) and printed every logged step after it:
    # together, every logged step.
    resumed = re.search(r"^resumed from the (?:checkpoint|memory snapshot) of step (\d+) ", text, re.M)
    assert resumed, text
    assert by_attempt[0] == [s for s in logged if s <= KILLED_AT][:len(by_attempt[0])]
    assert by_attempt[1] == [s for s in logged if s > int(resumed.group(1))]
    assert set(by_attempt[0]) | set(by_attempt[1]) == set(logged)
    states = [m.group(1) for line in lines if (m := _STATE.match(line))]
    assert states == ["PLACING", "RENDEZVOUS", "RUNNING", "RECOVERING", "PLACING", "RENDEZVOUS",
                      "RUNNING", "SUCCEEDED"], states
    # The progress lines come between the states they belong to, the last before SUCCEEDED.
    last_step = max(i for i, line in enumerate(lines) if _STEP.match(line))
    assert last_step < next(i for i, line in enumerate(lines) if line.startswith("state SUCCEEDED"))


def test_the_killed_rank_is_named_with_its_log_file(job, cli):
    run_dir, text = job
    path = run_dir / "logs" / "attempt-0" / "rank-1.log"
    fault = next(line for line in text.splitlines() if line.startswith("fault: rank 1's process died"))
    assert fault.endswith(f"its last lines are in {path}"), fault
    lines = path.read_text().splitlines()
    assert any("world of 2 up" in line for line in lines), lines[:5]
    code, out, _ = cli("logs", run_dir, "--rank", 1, "--attempt", 0)
    assert code == 0 and out.splitlines() == lines
    code, out, _ = cli("logs", run_dir, "--rank", 1)  # the newest attempt: the restarted rank 1
    assert code == 0 and "rank 1 attempt 1" in out
    events = read_journal(run_dir).events
    killed = [e for e in events if e["type"] == "fault" and e["rank"] == 1]
    assert [(e["fault"], e["log_file"]) for e in killed] == [("dead", str(path))]
    assert any(e["type"] == "resumed" and e["attempt"] == 1 and e["source"] in ("storage", "memory")
               for e in events)


def test_the_console_names_the_node_by_host_and_ends_with_done(job):
    """Nodes by host name and address, never Ray's 56-digit id; Ray's own paragraph on the
    worker it saw die (the killed rank) folded away, since the fault says it; `done:` last."""
    _, text = job
    fault = next(line for line in text.splitlines() if line.startswith("fault: rank 1's process died"))
    assert f"; rank 1 was on node {socket.gethostname()} (127.0.0.1), its last lines are in " in fault, fault
    assert not re.search(r"(?<![0-9a-f])[0-9a-f]{56}(?![0-9a-f])", text), text  # no Ray node id
    assert "A worker died or was killed" not in text and "OOM killer" not in text, text
    assert "(raylet)" not in text, text
    assert text.splitlines()[-1].startswith("done: 10 steps"), text[-2000:]


def test_tensorboard_holds_each_steps_loss_once_across_the_restart(job):
    run_dir, text = job
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    steps = sorted(e.step for e in acc.Scalars("train/loss"))
    assert steps == list(range(1, STEPS + 1))  # steps 4 and 5 were trained twice, drawn once
    logged = {int(m.group(1)): float(m.group(2))
              for m in re.finditer(r"^step (\d+)/\d+  loss ([0-9.]+)", text, re.M)}
    values = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert all(abs(values[s] - loss) < 1e-4 for s, loss in logged.items())
    assert "events" in acc.Tags()["tensors"]


def test_the_report_draws_the_loss_across_attempts_and_the_fault(job, cli, tmp_path):
    run_dir, _ = job
    out = tmp_path / "report.html"
    code, _, err = cli("report", run_dir, "--out", out)
    assert code == 0 and out.exists(), err
    with open_page() as view:
        view.page.goto(out.as_uri(), wait_until="load")
        view.page.wait_for_selector("#timeline.js-plotly-plot .main-svg")
        page = view.page
        # One loss curve per attempt, and the fault's mark on it.
        assert page.locator("#loss-curve g.trace.scatter path.js-line").count() >= 2
        assert "fault" in page.locator("#loss-curve").inner_text()
        assert "fault: dead" in page.locator("#timeline").inner_text()
        assert page.locator("#timeline g.trace.bars path").count() >= 6  # the states of both attempts
        page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        assert view.errors == [] and view.remote == []
