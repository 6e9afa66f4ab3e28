"""`longrun submit/status/logs/stop/list` against a real Ray head's Jobs API (on loopback),
and clear errors for an unreachable cluster and a bad config.

The head runs on a python that cannot import longrun (as a user's cluster often does): a fresh
venv that sees this venv's packages (torch, ray, ...) but not the editable install of longrun.
Every job here runs only because `longrun submit` ships longrun with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from longrun.services.ports import free_port


def longrun(*args, cwd, timeout=600, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longrun.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def cluster_python(tmp_path_factory):
    """A python with longrun's dependencies and without longrun (testing/hosts.py)."""
    from longrun.testing.hosts import python_without_longrun

    return python_without_longrun(tmp_path_factory.mktemp("cluster-venv"))


@pytest.fixture(scope="module")
def head(cluster_python, redis_server):
    from longrun.services import EmbeddedRay

    # EmbeddedRay starts `ray start` with sys.executable and puts its folder first on the head's
    # PATH, so the jobs' `python3` is that interpreter too: here, the one without longrun.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "executable", str(cluster_python))
        # The cluster's own Redis password, as an operator sets it on every node (KubeRay: a
        # Secret): a submitted job's config only refers to it.
        patch.setenv("LONGRUN_REDIS_PASSWORD", redis_server.password)
        ray_head = EmbeddedRay(num_cpus=2, include_dashboard=True).start()
    try:
        # The head demands its token (services/ray_head.py): the commands here run as a user who
        # holds it, as one holding a cluster's token sets RAY_AUTH_MODE and RAY_AUTH_TOKEN.
        with pytest.MonkeyPatch.context() as patch:
            for name, value in ray_head.client_env.items():
                patch.setenv(name, value)
            yield ray_head
    finally:
        ray_head.stop()


def test_the_clusters_python_has_the_dependencies_but_not_longrun(cluster_python, tmp_path):
    deps = subprocess.run([cluster_python, "-c", "import torch, ray, pydantic, redis"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert deps.returncode == 0, deps.stderr
    bare = subprocess.run([cluster_python, "-m", "longrun.cli", "--version"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert bare.returncode == 1 and "No module named 'longrun'" in bare.stderr, bare.stderr


def test_submit_then_follow_status_and_list(head, cluster_python, repo_root, tmp_path):
    address = head.dashboard_url
    out = longrun("submit", repo_root / "examples" / "tiny.yaml", "--address", address, "--no-wait",
                  "--set", "training.steps=6", "--set", "training.warmup_steps=1",
                  "--set", f"job.output_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"longrun-tiny-\d{8}-\d{6}-[0-9a-f]{6}", job_id), out.stdout
    assert re.search(r"with longrun 0\.\S+ \(source [0-9a-f]{12}, \d+ KiB\)", out.stderr), out.stderr

    follow = longrun("logs", job_id, "--address", address, "--follow", cwd=tmp_path)
    assert follow.returncode == 0, follow.stderr
    assert "state SUCCEEDED" in follow.stdout and "done: 6 steps" in follow.stdout, follow.stdout
    # The preflight ran the shipped copy, on the head's python, which has no longrun of its own.
    shipped = re.search(r"longrun 0\.\S+ \(source [0-9a-f]{12}\) shipped with the job, running from (\S+)",
                        follow.stdout)
    assert shipped and "py_modules_files" in shipped.group(1), follow.stdout
    ran_with = re.search(r"python: (\S+) \(Python", follow.stdout).group(1)
    assert Path(ran_with).parent == cluster_python.parent, follow.stdout

    status = longrun("status", job_id, "--address", address, cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert f"job {job_id}: ray SUCCEEDED" in status.stdout
    assert "controller: SUCCEEDED" in status.stdout and "step 6/6" in status.stdout
    assert "evicted nodes: none" in status.stdout
    assert "source: the controller's log (the job's Redis is embedded in its controller" in status.stdout
    assert re.search(r"longrun 0\.\S+ \(source [0-9a-f]{12}\), shipped with the job", status.stdout)

    listed = longrun("list", "--address", address, cwd=tmp_path)
    assert job_id in listed.stdout and "SUCCEEDED" in listed.stdout

    stopped = longrun("stop", job_id, "--address", address, cwd=tmp_path)
    assert stopped.returncode == 0 and "already ended" in stopped.stdout


def test_status_reads_the_job_record_from_the_configured_redis(head, repo_root, tmp_path, redis_server):
    address = head.dashboard_url
    password = redis_server.password
    out = longrun("submit", repo_root / "examples" / "tiny.yaml", "--address", address, "--no-wait",
                  "--set", "training.steps=4", "--set", "training.warmup_steps=1",
                  "--set", f"cluster.redis_url={redis_server.url}",
                  "--set", f"job.output_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip().splitlines()[-1]
    follow = longrun("logs", job_id, "--address", address, "--follow", cwd=tmp_path)
    assert "state SUCCEEDED" in follow.stdout, follow.stdout

    from ray.job_submission import JobSubmissionClient

    # This process imported Ray with auth off (conftest): the token goes in the header itself.
    info = JobSubmissionClient(address, headers={"Authorization": f"Bearer {head.auth_token}"}) \
        .get_job_info(job_id)
    shown = f"redis://:***@127.0.0.1:{redis_server.port}/0"
    assert info.metadata["longrun.redis"] == shown
    assert password not in json.dumps([info.metadata, info.runtime_env, info.entrypoint])
    # Nor in what the cluster unpacked (the shipped config holds a reference) or logged.
    leaked = []
    for path in head.temp_dir.rglob("*"):
        with contextlib.suppress(OSError):  # Ray's sockets, files that come and go
            if path.is_file() and password.encode() in path.read_bytes():
                leaked.append(str(path))
    assert leaked == [], leaked

    # status sends the password only to the Redis the operator names, not the metadata's host.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LONGRUN_REDIS")}
    no_url = longrun("status", job_id, "--address", address, cwd=tmp_path,
                     env={**env, "LONGRUN_REDIS_PASSWORD": password})
    assert no_url.returncode == 0, no_url.stderr
    assert (f"source: the controller's log (the job's Redis {shown} needs its password, which status "
            "sends only to the Redis you configure") in no_url.stdout, no_url.stdout
    assert "controller: SUCCEEDED" in no_url.stdout

    reference = f"redis://:${{LONGRUN_REDIS_PASSWORD}}@127.0.0.1:{redis_server.port}/0"
    record = longrun("status", job_id, "--address", address, cwd=tmp_path,
                     env={**env, "LONGRUN_REDIS_PASSWORD": password, "LONGRUN_REDIS_URL": reference})
    assert record.returncode == 0, record.stderr
    assert f"source: the job record in Redis at {shown}" in record.stdout, record.stdout
    assert "controller: SUCCEEDED (finished 4 steps" in record.stdout and "step 4/4" in record.stdout
    assert re.search(r"\d\d:\d\d:\d\d state SUCCEEDED: finished 4 steps", record.stdout), record.stdout
    assert password not in no_url.stdout + no_url.stderr + record.stdout + record.stderr


def test_submit_to_an_unreachable_cluster_is_a_clear_error(repo_root, tmp_path):
    address = f"http://127.0.0.1:{free_port()}"
    out = longrun("submit", repo_root / "examples" / "tiny.yaml", "--address", address,
                  "--set", f"job.output_dir={tmp_path}", cwd=tmp_path, timeout=120)
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
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-m", "longrun.cli", "list"], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 1 and "pass --address" in out.stderr


def test_two_submissions_of_a_job_within_a_second_get_different_ids():
    from longrun.submit import submission_id_for

    ids = {submission_id_for("tiny") for _ in range(50)}  # well within one second
    assert len(ids) == 50
    assert all(re.fullmatch(r"longrun-tiny-\d{8}-\d{6}-[0-9a-f]{6}", i) for i in ids)
