"""The `longrun` command line, run as a user would: a separate process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid

import pytest
import yaml
from clusters import MARK, marked_processes


def longrun(*args, cwd=None, env=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "longrun.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_commands():
    out = longrun("--help")
    assert out.returncode == 0
    for command in ("run", "config", "doctor"):
        assert command in out.stdout


def test_config_validate_good_and_bad(repo_root, tmp_path):
    ok = longrun("config", "validate", repo_root / "examples" / "tiny.yaml")
    assert ok.returncode == 0 and "valid config for job tiny" in ok.stdout
    bad = longrun("config", "validate", repo_root / "examples" / "tiny.yaml",
                  "--set", "parallelism.dp=2", "--set", "training.lr=fast")
    assert bad.returncode == 2
    assert "training.lr:" in bad.stderr
    missing = longrun("config", "validate", tmp_path / "nope.yaml")
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_config_show_prints_the_resolved_config(repo_root):
    out = longrun("config", "show", repo_root / "examples" / "tiny.yaml", "--set", "training.steps=3",
                  "--set", "training.warmup_steps=1")
    assert out.returncode == 0, out.stderr
    shown = yaml.safe_load(out.stdout)
    assert shown["training"]["steps"] == 3
    assert shown["recovery"]["max_restarts"] == 10  # a default, filled in


def test_doctor_passes_here_and_explains_what_is_missing():
    out = longrun("doctor")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "redis-server" in out.stdout and "prometheus" in out.stdout and "ready" in out.stdout
    # Without the server binaries on PATH, doctor fails and says how to install them.
    env = {**os.environ, "PATH": os.path.dirname(sys.executable), "COLUMNS": "250"}
    out = longrun("doctor", env=env)
    assert out.returncode == 1
    assert "apt-get install -y redis-server" in out.stdout
    assert "missing or broken" in out.stdout


def test_run_trains_the_tiny_job_end_to_end(repo_root, tmp_path):
    mark = uuid.uuid4().hex
    common = ("--set", f"job.output_dir={tmp_path}", "--set", "training.warmup_steps=2",
              "--set", "checkpoint.interval_steps=5")
    out = longrun("run", repo_root / "examples" / "tiny.yaml", *common, "--set", "training.steps=12",
                  cwd=tmp_path, env={**os.environ, MARK: mark})
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "state SUCCEEDED" in log and "done: 12 steps" in log
    losses = [float(x) for x in re.findall(r"step\s+\d+/12\s+loss\s+([0-9.]+)", log)]
    assert len(losses) == 12, log
    assert losses[-1] < losses[0] - 0.5, losses  # it learns
    resolved = yaml.safe_load((tmp_path / "tiny" / "config.yaml").read_text())
    assert resolved["training"]["steps"] == 12
    assert marked_processes(mark) == []  # embedded Redis and Ray are gone
    # Checkpoints at 5, 10 and the last step; keep_last 2 in tiny.yaml.
    checkpoints = tmp_path / "tiny" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-00000010", "step-00000012"]

    # Asked for more steps, the same job resumes from its newest checkpoint.
    out = longrun("run", repo_root / "examples" / "tiny.yaml", *common, "--set", "training.steps=14",
                  cwd=tmp_path)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "resumed from the checkpoint of step 12" in log
    assert re.findall(r"step\s+(\d+)/14\s+loss", log) == ["13", "14"], log
    assert "done: 14 steps (resumed from step 12)" in log


def test_run_refuses_a_bad_config_before_starting_anything(repo_root, tmp_path):
    out = longrun("run", repo_root / "examples" / "tiny.yaml", "--set", "model.n_heads=3", cwd=tmp_path)
    assert out.returncode == 2
    assert "model: dim (128) must be divisible by n_heads (3)" in out.stderr
    assert not (tmp_path / "runs").exists()


# Valid configs this longrun cannot run: each refused by `run` before any service starts, and
# by `config validate` with the same sentence (validate never passes what run refuses).
UNRUNNABLE = [
    (("parallelism.dynamic_cp=true",), "nothing to split"),
    (("cluster.device_memory_gb=0.001",), "exceeds 90% of cluster.device_memory_gb (0.001 GB)"),
]


@pytest.mark.parametrize(("overrides", "reason"), UNRUNNABLE, ids=["dynamic-cp-alone", "memory"])
def test_run_and_validate_refuse_what_the_controller_cannot_run(repo_root, tmp_path, overrides, reason):
    sets = [arg for o in overrides for arg in ("--set", o)]
    out = longrun("run", repo_root / "examples" / "tiny.yaml", *sets, "--set", f"job.output_dir={tmp_path}",
                  cwd=tmp_path)
    assert out.returncode == 1 and reason in out.stderr, out.stderr
    assert "starting an embedded" not in out.stderr  # refused before starting any service
    checked = longrun("config", "validate", repo_root / "examples" / "tiny.yaml", *sets, cwd=tmp_path)
    assert checked.returncode == 2 and reason in checked.stderr, checked.stderr


def test_config_plan_shows_each_pipeline_rank_and_the_bubble(repo_root, tmp_path):
    example = repo_root / "examples" / "llama-70b-pp.yaml"
    out = longrun("config", "plan", example, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "the fullest pipeline rank: 0" in text
    assert "pipeline: interleaved_1f1b, 4 ranks x 2 stage(s)" in text
    # One row per pipeline rank: 20 blocks each, the first keeping 5.5 micro-batches in flight.
    assert "│ 0 │ 20 │" in text and "│ 5.5 │" in text and "│ 3 │ 20 │" in text
    assert "bubble: 8.6% of each step idle per rank" in text and "fits" in text


def test_config_plan_of_a_small_job_reads_in_megabytes(repo_root, tmp_path):
    out = longrun("config", "plan", repo_root / "examples" / "tiny.yaml", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "(1 rank: dp 1" in text and "┃ MB ┃" in text
    assert "│ parameters │ 0.00 │" not in text and "│ parameters │ 1.71 │" in text


def test_config_plan_prints_the_memory_per_rank_and_names_the_knob(repo_root, tmp_path):
    example = repo_root / "examples" / "llama-8b-64gpu.yaml"
    out = longrun("config", "plan", example, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for part in ("parameters", "gradients", "optimizer state", "activations (16384 tokens)", "total"):
        assert part in out.stdout
    assert "fits" in out.stdout
    # Too little memory for it: refused, with the change that would make it fit.
    out = longrun("config", "plan", example, "--set", "cluster.device_memory_gb=30", cwd=tmp_path)
    assert out.returncode == 2
    assert "set training.activation_checkpointing: " in out.stderr, out.stderr


