"""The set-up scripts behave as the README promises."""

from __future__ import annotations

import os
import subprocess


def _run(repo_root, *argv, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run([str(repo_root / argv[0]), *argv[1:]], cwd=repo_root, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_bootstrap_is_idempotent(repo_root):
    out = _run(repo_root, "scripts/bootstrap")
    assert out.returncode == 0, out.stderr
    assert "installing" not in out.stdout + out.stderr  # everything was already in place
    assert "[bootstrap] ready: torch 2.13.0" in out.stdout


def test_scripts_test_fails_when_pytest_collects_nothing(repo_root):
    out = _run(repo_root, "scripts/test", "-k", "no_test_is_called_this", "-q", "-p", "no:cacheprovider")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "pytest collected no tests" in out.stderr
