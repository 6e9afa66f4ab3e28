"""Shipping longrun with a submitted job, and the preflight that checks the cluster's python
before the shipped copy runs: run for real in subprocesses, on a staged copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from longrun import shipping
from longrun.preflight import MANIFEST, PreflightError, check_python, installed, source_digest


@pytest.fixture
def shipped(tmp_path):
    """(the job's working dir with the manifest and a config, the folder on PYTHONPATH)."""
    modules, job = tmp_path / "modules", tmp_path / "job"
    job.mkdir()
    shipment = shipping.stage(modules)
    shipping.write_manifest(shipment, job)
    return job, modules, shipment


def preflight(job: Path, modules: Path, *args, flags=()) -> subprocess.CompletedProcess:
    """The job's entrypoint as Ray runs it: in the working dir, the shipped folder on PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": str(modules)}
    return subprocess.run([sys.executable, *flags, "-m", "longrun.preflight", *map(str, args)], cwd=job,
                          env=env, capture_output=True, text=True, timeout=120)


def test_stage_copies_longrun_without_caches_under_its_import_name(shipped):
    _, modules, shipment = shipped
    root = Path(shipment.path)
    assert root == modules / "longrun"
    assert (root / "preflight.py").is_file() and (root / "cli" / "__init__.py").is_file()
    assert not list(root.rglob("__pycache__")) and not list(root.rglob("*.pyc"))
    assert not (root / "__init__.py").exists()  # a namespace package, as installed
    assert shipment.digest == source_digest(shipping.longrun_root())  # the running source, exactly
    names = " ".join(shipment.requires)
    assert "torch" in names and "pydantic" in names and "grafana-client" not in names
    assert "pytest" not in names  # extras are not asked of the cluster


def test_preflight_runs_the_shipped_copy_and_prints_what_runs(shipped, repo_root):
    job, modules, shipment = shipped
    out = preflight(job, modules, "config", "validate", repo_root / "examples" / "tiny.yaml")
    assert out.returncode == 0, out.stderr
    first, second, *_ = out.stdout.splitlines()
    assert first.startswith(f"longrun {shipment.version} (source {shipment.digest[:12]}) shipped with "
                            f"the job, running from {modules / 'longrun'}")
    assert f"python: {sys.executable}" in second and "torch 2." in second and "ray 2." in second
    assert "valid config for job tiny" in out.stdout


def test_preflight_names_what_to_install_where_on_a_bare_python(shipped):
    job, modules, shipment = shipped
    # -S: no site-packages at all, as on a cluster node whose python has none of longrun's needs.
    out = preflight(job, modules, "doctor", flags=("-S",))
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"lacks what longrun {shipment.version} needs: torch" in out.stderr
    assert f"{sys.executable} -m pip install 'torch" in out.stderr
    assert "on every node of the cluster" in out.stderr and "--python" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""  # refused before longrun.cli ran


def test_preflight_refuses_a_copy_that_is_not_the_one_submitted(shipped):
    job, modules, _ = shipped
    (modules / "longrun" / "kinds.py").write_text("# changed after submit\n", encoding="utf-8")
    out = preflight(job, modules, "--version")
    assert out.returncode == 1 and "is not the one submitted" in out.stderr, out.stderr


def test_preflight_without_a_manifest_says_what_it_is_for(shipped):
    job, modules, _ = shipped
    (job / MANIFEST).unlink()
    out = preflight(job, modules, "--version")
    assert out.returncode == 1 and "this entrypoint runs jobs that `longrun submit` made" in out.stderr


def test_requirements_are_checked_by_version():
    found, unmet = installed(["pyyaml>=6.0", "pyyaml<1", "no-such-package-here>=1"])
    assert found["pyyaml"].startswith("6.")
    assert unmet == [f"pyyaml<1 (has {found['pyyaml']})", "no-such-package-here>=1"]


def test_an_old_python_is_refused_with_the_version_needed():
    check_python(">=3.11")
    with pytest.raises(PreflightError, match=r"longrun needs Python >=99.0; .* --python"):
        check_python(">=99.0")


def test_the_manifest_is_json_without_the_local_path(shipped):
    job, _, shipment = shipped
    manifest = json.loads((job / MANIFEST).read_text())
    assert manifest["digest"] == shipment.digest and "path" not in manifest
    assert manifest["requires_python"] == ">=3.11"
