from __future__ import annotations

import os
from pathlib import Path

import pytest

from longrun.services import EmbeddedRedis

REPO_ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ranks of the tests' gloo worlds fork from one server that imported torch and the training stack
# once, instead of spawning an interpreter that imports them (about 2 CPU-seconds a rank, several
# hundred ranks a suite): longrun/testing/worlds.py. Inherited by the bench scripts tests run.
os.environ.setdefault("LONGRUN_WORLD_START", "forkserver")
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
    from longrun.cli.common import console, out

    # rich wraps at the terminal width: keep messages on one line. COLUMNS alone is not enough: a
    # console made while COLUMNS was set (an xdist worker has it) keeps that width for good.
    monkeypatch.setenv("COLUMNS", "250")
    for shown in (console, out):
        monkeypatch.setattr(shown, "_width", 250)

    def run(*args):
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err
    return run


# `scripts/test` runs the suite in three phases. First the modules below, spread over two
# pytest-xdist workers: they run gloo worlds (rendezvous through a file, no port), their own
# embedded Redis on a free port, or nothing but this process, so two of them may share the
# machine. Then every other module, marked `alone`: they start Ray (whose defaults are
# machine-wide: the dashboard's port 8265, the address file a bare `ray.init()` attaches to
# under the Ray directory), network namespaces, or time heartbeats, hangs and restarts. They run
# on two workers that share nothing but the CPUs (each in a network namespace and a Ray
# directory of its own: scripts/netns-python), every test of a module on the same worker; so a
# test of theirs reads only what it started (its own processes, not every Ray on the machine).
# Last, one at a time, the `solo` modules (SOLO_MODULES). A new module is `alone` until it is
# listed here.
PARALLEL_MODULES = frozenset({
    "test_checkpoint", "test_checkpoint_cli", "test_checkpoint_layout", "test_ckpt_coverage",
    "test_ckpt_device", "test_ckpt_lineage", "test_ckpt_skipped_steps", "test_commgroup_init",
    "test_compile", "test_context_parallel", "test_cp_flash", "test_data_at_scale", "test_data_bad_records",
    "test_data_prepare", "test_data_verification", "test_dryrun", "test_dynamic_cp_solver",
    "test_elastic_policy", "test_global_data", "test_global_data_worlds", "test_goodput_accounting",
    "test_goodput_hooks", "test_goodput_ledger", "test_hf_interop", "test_hostile_checkpoint_dir",
    "test_job_view", "test_memory_plan", "test_meta_init", "test_parallel_dims", "test_parallel_precision",
    "test_pipeline", "test_pipeline_packing", "test_reshard_resume", "test_resharding",
    "test_restart_history", "test_sharded_training", "test_startup_groups", "test_step_readings",
    "test_token_training", "test_tokenizers", "test_topology", "test_trainer_data",
    "test_trainer_loop", "test_trainer_model", "test_trainer_parallel", "test_user_view",
    "test_validation", "test_worker_hooks", "test_worker_setup", "test_worlds",
})


# Alone, and with the machine to themselves: the bounded soak compares the goodput its job
# accounted with its own clock, which counts the start-up of every `longrun run` (a busier machine
# slows that and only that: 0.587 against 0.627 beside another worker); the many-hosts cluster
# runs four hosts' Ray nodes and a job on two cores (beside another worker, its reference job's
# gloo mesh once failed to connect).
SOLO_MODULES = frozenset({"test_soak", "test_many_hosts"})


# The longest modules first (by their seconds one at a time on the 2-core machine, 2026-11-29):
# two workers fed in collection order end together only when the long ones do not come last.
LONGEST_FIRST = (
    "test_controller_recovery", "test_memory_snapshots", "test_preemption_run", "test_soak",
    "test_many_hosts", "test_pipeline_job", "test_elastic_run", "test_submit", "test_bench_scripts",
    "test_placement_node_loss", "test_observability_job", "test_services", "test_cli",
    "test_sharded_training", "test_pipeline", "test_resharding", "test_hostile_checkpoint_dir",
    "test_validation", "test_global_data_worlds", "test_meta_init", "test_context_parallel",
    "test_reshard_resume", "test_checkpoint",
)


def pytest_collection_modifyitems(config, items):
    def module(item) -> str:
        return item.module.__name__.rpartition(".")[2]

    for item in items:
        if module(item) not in PARALLEL_MODULES:
            item.add_marker(pytest.mark.alone)
        if module(item) in SOLO_MODULES:
            item.add_marker(pytest.mark.solo)
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(module(item), len(first)))  # stable: the rest keep their order
