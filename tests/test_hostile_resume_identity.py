"""Door 8 of issue 42: a different job must not resume a checkpoint silently.

A real short run writes checkpoints; a job with the same name (so the same checkpoint
directory) but other data, tokenizer or training settings is refused before anything starts,
one sentence per difference naming `checkpoint.accept_changes`; with the changes accepted it
resumes and they take effect (the new data from its beginning, the new learning rate at once);
a resume that only raises `training.steps`, or changes the layout with the global batch kept,
goes on as before. Checkpoints from before the identity was recorded still resume, with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import uuid

import pytest
import yaml
from clusters import MARK, marked_processes
from controller_fakes import make_rig
from test_token_training import random_docs, write_prepared

from longrun.checkpoint import Checkpointer
from longrun.checkpoint.layout import MANIFEST, step_dir_name
from longrun.config import load_config
from longrun.controller.precheck import checkpoint_problem
from longrun.controller.state import JobState
from longrun.trainer import Trainer, lr_schedule

SHA_A, SHA_B = "a" * 64, "b" * 64


@pytest.fixture
def job(tmp_path):
    """(the job's YAML file, shards A, shards B): B has other documents, prepared with another
    tokenizer; the job has trained 4 steps on A and committed checkpoints at steps 2 and 4."""
    shards_a = write_prepared(tmp_path / "shards-a", random_docs(80, seed=1), sha=SHA_A)
    shards_b = write_prepared(tmp_path / "shards-b", random_docs(60, seed=2), sha=SHA_B)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({
        "job": {"name": "door8", "seed": 1, "output_dir": str(tmp_path / "runs")},
        "cluster": {"device": "cpu"},
        "model": {"dim": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64},
        "data": {"source": "tokens", "path": str(shards_a), "micro_batch_tokens": 256, "prefetch": 1},
        "training": {"steps": 4, "lr": 3e-3, "warmup_steps": 1},
        "checkpoint": {"interval_steps": 2},
    }))
    restored, reached, *_ = _attempt(load_config(path), steps=4)
    assert (restored, reached) == (None, 4)
    return path, shards_a, shards_b


def _attempt(cfg, *, steps: int):
    """One worker's life: restore what there is, train `steps` steps with checkpoints, commit.
    (restored step or None, the step reached, each step's metrics, the data position reached)."""
    with Trainer(cfg, progress=False) as trainer:
        ckpt = Checkpointer(cfg)
        restored = ckpt.restore(trainer)
        trainer.before_update.append(ckpt.before_update)
        seen: list = []

        def on_step(metrics) -> None:
            seen.append(metrics)
            ckpt.on_step(trainer)(metrics)

        trainer.train(steps=steps, on_step=on_step)
        ckpt.close()
        return (restored.step if restored else None), trainer.step, seen, dict(trainer.feed.state)


def longrun(*args, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The command line, run as a user would: a separate process."""
    return subprocess.run([sys.executable, "-m", "longrun.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=240, env={**os.environ, "COLUMNS": "250", **(env or {})})


def _changed(shards_b) -> list[str]:
    return ["--set", f"data.path={shards_b}", "--set", "job.seed=2", "--set", "training.lr=0.001"]


def _files(directory) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_resume_under_other_data_tokenizer_and_seed_is_refused_naming_each_before_anything_starts(
        job, tmp_path):
    path, shards_a, shards_b = job
    run_dir = tmp_path / "runs" / "door8"
    (run_dir / "config.yaml").write_text(load_config(path).to_yaml())  # as the first `run` left it
    before, mark = _files(run_dir), uuid.uuid4().hex
    out = longrun("run", path, *_changed(shards_b), env={MARK: mark})
    err = out.stderr
    assert out.returncode == 1, err
    assert f"cannot resume from {run_dir}/checkpoints/{step_dir_name(4)}" in err
    assert f'data.path changed from "{shards_a}" to "{shards_b}".' in err
    assert ("data.tokenizer changed from the shards' tokenizer (sha256 aaaaaaaaaaaa...) to the "
            "shards' tokenizer (sha256 bbbbbbbbbbbb...).") in err
    assert "job.seed changed from 1 to 2." in err
    assert "training.lr changed from 0.003 to 0.001." in err
    names = "job.seed, data.path, training.lr, data.tokenizer"
    assert f"checkpoint.accept_changes: [{names}]" in err
    assert f"--set 'checkpoint.accept_changes=[{names}]'" in err
    # Refused before any service started, and nothing written: the run directory still
    # describes the checkpoints it holds.
    assert "redis:" not in err and "ray:" not in err and "Traceback" not in err
    assert _files(run_dir) == before and marked_processes(mark) == []
    # Accepting some of them is not accepting all: the others are still named.
    out = longrun("run", path, *_changed(shards_b), "--set", "checkpoint.accept_changes=[data]")
    err = out.stderr
    assert out.returncode == 1 and "training.lr changed" in err and "data.tokenizer changed" in err
    assert "data.path changed" not in err and "job.seed changed" not in err


def test_the_same_resume_with_the_changes_accepted_proceeds_on_the_new_data_from_its_beginning(job, caplog):
    path, _, shards_b = job
    overrides = [v for v in _changed(shards_b) if v != "--set"]
    accepted = load_config(path, [*overrides, "checkpoint.accept_changes=[data, tokenizer, training.lr]",
                                  "training.steps=6"])
    with caplog.at_level(logging.WARNING, logger="longrun"):
        assert checkpoint_problem(accepted) is None
    assert "resuming from" in caplog.text and "accepted change: job.seed changed from 1 to 2." in caplog.text
    restored, reached, seen, data = _attempt(accepted, steps=2)
    assert (restored, reached) == (4, 6)
    # The new learning rate from the first resumed step; the new data from its beginning (where
    # a fresh run on it stands after as many steps), not the old data's position.
    lr = lr_schedule(accepted.training)
    assert [m.lr for m in seen] == pytest.approx([lr(4), lr(5)])
    with Trainer(accepted, progress=False) as fresh:
        fresh.train(steps=2)
        assert data == dict(fresh.feed.state)
    # Its checkpoints are the new job's: resumed again, nothing needs accepting (and the names
    # left in accept_changes are pointed out, so a later change does not pass unsaid).
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="longrun"):
        assert checkpoint_problem(accepted) is None
    assert "checkpoint.accept_changes names data, tokenizer, training.lr, which" in caplog.text
    plain = load_config(path, [*overrides, "training.steps=6"])
    assert checkpoint_problem(plain) is None


def test_an_accepted_learning_rate_takes_effect_at_once_and_the_data_goes_on_where_it_was(job):
    path, *_ = job
    lower = load_config(path, ["training.lr=0.001", "training.steps=6",
                               "checkpoint.accept_changes=[training.lr]"])
    assert checkpoint_problem(lower) is None
    before = load_config(path, ["training.steps=6"])
    with Trainer(before, progress=False) as straight:
        straight.train(steps=5)
        data_after_5 = dict(straight.feed.state)
    restored, _, seen, data = _attempt(lower, steps=1)
    assert restored == 4 and seen[0].lr == pytest.approx(lr_schedule(lower.training)(4))
    assert seen[0].lr != pytest.approx(lr_schedule(before.training)(4))  # not the checkpoint's
    assert data == data_after_5  # the same data, its position kept


def test_a_resume_that_raises_only_the_steps_and_operational_settings_proceeds(job):
    path, *_ = job
    extended = load_config(path, ["training.steps=7", "checkpoint.interval_steps=3",
                                  "checkpoint.keep_last=1", "data.prefetch=3", "training.log_every=2",
                                  "health.hang_timeout_s=300", "observability.tensorboard=false",
                                  "training.activation_checkpointing=full"])
    assert checkpoint_problem(extended) is None
    restored, reached, seen, _ = _attempt(extended, steps=3)
    assert (restored, reached) == (4, 7)
    assert [m.lr for m in seen] == pytest.approx([lr_schedule(extended.training)(s) for s in (4, 5, 6)])


def test_the_controller_refuses_before_placing_and_a_new_layout_keeping_the_batch_proceeds(
        job, redis_server):
    path, _, shards_b = job
    make, launcher, *_ = make_rig(redis_server.url)
    four_ranks = ["cluster.nodes=2", "cluster.workers_per_node=2", "parallelism.dp=4",
                  "recovery.diagnostics=[]"]
    # Another layout whose default global batch follows it: refused, naming the value to pin.
    c = make(load_config(path, four_ranks), serve_metrics=False)
    assert c.step() is JobState.FAILED and not launcher.calls
    assert ("training.global_batch_tokens changed from 256 to 1024 (it follows the layout while "
            "unset: set training.global_batch_tokens to 256") in c.failure
    c = make(load_config(path, [*four_ranks, f"data.path={shards_b}", "training.global_batch_tokens=256"]),
             serve_metrics=False)
    assert c.step() is JobState.FAILED and not launcher.calls
    assert "data.path changed" in c.failure and "global_batch_tokens" not in c.failure
    # The batch kept: any layout resumes, as before.
    c = make(load_config(path, [*four_ranks, "training.global_batch_tokens=256"]), serve_metrics=False)
    assert c.step() is JobState.PLACING
    assert c.step() is JobState.RENDEZVOUS and len(launcher.calls) == 1


def test_a_checkpoint_from_before_the_identity_resumes_with_a_warning_its_tokenizer_still_compared(
        job, caplog, tmp_path):
    path, _, shards_b = job
    manifest = tmp_path / "runs" / "door8" / "checkpoints" / step_dir_name(4) / MANIFEST
    record = json.loads(manifest.read_text())
    del record["identity"]  # as an earlier longrun wrote it
    manifest.write_text(json.dumps(record))
    other = load_config(path, ["job.seed=9", "training.lr=0.01"])
    with caplog.at_level(logging.WARNING, logger="longrun"):
        assert checkpoint_problem(other) is None
    assert "records no data or training settings (written by an earlier longrun)" in caplog.text
    # The tokenizer was recorded long before: shards of another tokenizer are still refused.
    problem = checkpoint_problem(load_config(path, [f"data.path={shards_b}"]))
    assert "data.tokenizer changed" in problem and "data.path" not in problem


def test_checkpoint_inspect_shows_what_the_checkpoint_was_trained_with(job, cli, tmp_path):
    _, shards_a, _ = job
    code, out, err = cli("checkpoint", "inspect", tmp_path / "runs" / "door8" / "checkpoints")
    assert code == 0, err
    assert "trained with" in out and f'"{shards_a}"' in out
    assert re.search(r"training\.lr\s+0\.003\s*$", out, re.M) and re.search(r"job\.seed\s+1\s*$", out, re.M)


def test_accept_changes_names_only_groups_and_keys_it_knows(job):
    path, *_ = job
    out = longrun("config", "validate", path, "--set", "checkpoint.accept_changes=[data.paht]")
    err = out.stderr
    assert out.returncode == 2
    assert "checkpoint.accept_changes" in err and "'data.paht' cannot be accepted" in err
    assert "(data, tokenizer, training)" in err
