"""Controller jobs run every context-parallel attention: `longrun run` with 4 CPU workers and
cp_impl ulysses (dp 2 x cp 2) or usp (cp 4: Ulysses pairs, rings across them, sub-groups that
commgroup forms with the attempt's other groups) trains the same global batches as ring
attention, so it logs the same losses and ends with the same weights as the ring run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
import yaml

STEPS = 4
JOB = {
    "job": {"name": "cpimpl", "seed": 5},
    "cluster": {"device": "cpu", "nodes": 1, "workers_per_node": 4},
    "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 128},
    "data": {"source": "synthetic", "micro_batch_tokens": 64, "prefetch": 1,
             "synthetic": {"min_len": 8, "max_len": 128, "mean": 48, "sigma": 1.0}},
    "training": {"steps": STEPS, "lr": 3e-3, "warmup_steps": 1},
    "checkpoint": {"interval_steps": STEPS, "async_save": False},
}
# Every layout spans the same 4 ranks, so all draw the same global batches.
LAYOUTS = {"ring": (2, 2), "ulysses": (2, 2), "usp": (1, 4)}  # cp_impl -> (dp, cp)


def _cli(*args, cwd, timeout=280) -> subprocess.CompletedProcess:
    env = os.environ | {"OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0"}
    return subprocess.run([sys.executable, "-m", "longrun.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_job(impl: str, root) -> tuple[dict[int, set[float]], dict[str, torch.Tensor]]:
    """Run the job with `impl` to its end: (step -> losses the ranks logged, final weights)."""
    dp, cp = LAYOUTS[impl]
    out_dir = root / impl
    out_dir.mkdir()
    config = out_dir / "job.yaml"
    config.write_text(yaml.safe_dump(JOB | {
        "job": JOB["job"] | {"output_dir": str(out_dir)},
        "parallelism": {"dp": dp, "cp": cp, "cp_impl": impl}}))
    run = _cli("run", config, cwd=out_dir)
    log = run.stdout + run.stderr
    assert run.returncode == 0 and "state SUCCEEDED" in log, log
    losses: dict[int, set[float]] = {}
    for step, loss in re.findall(rf"step\s+(\d+)/{STEPS}\s+loss\s+([0-9.]+)", log):
        losses.setdefault(int(step), set()).add(float(loss))
    assert sorted(losses) == list(range(1, STEPS + 1)), log
    weights = out_dir / "weights.pt"
    export = _cli("checkpoint", "export", out_dir / "cpimpl" / "checkpoints", "--out", weights, cwd=out_dir)
    assert export.returncode == 0, export.stdout + export.stderr
    return losses, torch.load(weights)


@pytest.fixture(scope="module")
def ring_run(tmp_path_factory):
    return run_job("ring", tmp_path_factory.mktemp("cp-ring"))


@pytest.mark.timeout(600)
# Both are `slow` (the suite's time): the default run checks Ulysses and USP attention and a
# whole training step against the ring's in tests/test_context_parallel.py, and the groups a USP
# worker forms in tests/test_worker_setup.py.
@pytest.mark.slow
@pytest.mark.parametrize("impl", ["ulysses", "usp"])
def test_a_ulysses_or_usp_job_trains_like_the_ring_job(impl, ring_run, tmp_path):
    ring_losses, ring_weights = ring_run
    losses, weights = run_job(impl, tmp_path)
    for step, logged in losses.items():
        assert len(logged) == 1, (step, logged)  # every rank logs the same loss
        (mine,), (ring,) = logged, ring_losses[step]
        assert mine == pytest.approx(ring, abs=2e-4), (step, mine, ring)  # 4 decimals logged
    assert weights.keys() == ring_weights.keys()
    for name, w in weights.items():
        torch.testing.assert_close(w, ring_weights[name], rtol=0, atol=1e-4, msg=name)
