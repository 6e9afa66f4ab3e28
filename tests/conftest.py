from __future__ import annotations

import os
from pathlib import Path

import pytest

from longrun.services import EmbeddedRedis

REPO_ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# A test's own `ray.init()` must not write ~/.ray/auth_token: with it there, Ray turns token auth on
# for every later head on this machine (services/ray_head.py).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="module")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_client(redis_server):
    client = redis_server.client()
    client.flushdb()
    yield client
    client.close()



@pytest.fixture
def cli(capsys, monkeypatch):
    """Run `longrun ARGS...` in this process: (exit code, stdout, stderr)."""
    from longrun.cli import main

    monkeypatch.setenv("COLUMNS", "250")  # rich wraps at the terminal width: keep messages on one line

    def run(*args):
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err
    return run
