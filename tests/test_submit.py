"""`longrun submit/status/logs/stop/list` against a real Ray head's Jobs API (on loopback),
and clear errors for an unreachable cluster and a bad config."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from longrun.services.ports import free_port


def longrun(*args, cwd, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longrun.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout)


@pytest.fixture(scope="module")
def head():
    from longrun.services import EmbeddedRay

    with EmbeddedRay(num_cpus=2, include_dashboard=True) as ray_head:
        yield ray_head


def test_submit_then_follow_status_and_list(head, repo_root, tmp_path):
    address = head.dashboard_url
    out = longrun("submit", repo_root / "examples" / "tiny.yaml", "--address", address, "--no-wait",
                  "--set", "training.steps=6", "--set", "training.warmup_steps=1",
                  "--set", f"job.output_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"longrun-tiny-\d{8}-\d{6}", job_id), out.stdout

    follow = longrun("logs", job_id, "--address", address, "--follow", cwd=tmp_path)
    assert follow.returncode == 0, follow.stderr
    assert "state SUCCEEDED" in follow.stdout and "done: 6 steps" in follow.stdout, follow.stdout

    status = longrun("status", job_id, "--address", address, cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert f"job {job_id}: ray SUCCEEDED" in status.stdout
    assert "controller: SUCCEEDED" in status.stdout and "step 6/6" in status.stdout
    assert "evicted nodes: none" in status.stdout

    listed = longrun("list", "--address", address, cwd=tmp_path)
    assert job_id in listed.stdout and "SUCCEEDED" in listed.stdout

    stopped = longrun("stop", job_id, "--address", address, cwd=tmp_path)
    assert stopped.returncode == 0 and "already ended" in stopped.stdout


def test_submit_to_an_unreachable_cluster_is_a_clear_error(repo_root, tmp_path):
    address = f"http://127.0.0.1:{free_port()}"
    out = longrun("submit", repo_root / "examples" / "tiny.yaml", "--address", address, cwd=tmp_path,
                  timeout=120)
    assert out.returncode == 1
    assert f"cannot reach the Ray Jobs API at {address}" in out.stderr


def test_a_bad_config_is_refused_before_contacting_the_cluster(repo_root, tmp_path):
    address = f"http://127.0.0.1:{free_port()}"  # nothing listens: it must not matter
    out = longrun("submit", repo_root / "examples" / "tiny.yaml", "--address", address,
                  "--set", "training.steps=-1", cwd=tmp_path)
    assert out.returncode == 2 and "training.steps" in out.stderr


def test_status_of_an_unknown_job_is_a_clear_error(head, tmp_path):
    out = longrun("status", "longrun-nope-20000101-000000", "--address", head.dashboard_url, cwd=tmp_path)
    assert out.returncode == 1 and "no job 'longrun-nope-20000101-000000'" in out.stderr


def test_commands_without_a_cluster_address_say_how_to_give_one(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-m", "longrun.cli", "list"], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 1 and "pass --address" in out.stderr
