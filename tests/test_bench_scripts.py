"""The GPU benchmark must skip cleanly where there is no GPU, and its code path must run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "mfu_gpu.py"), *args],
                          capture_output=True, text=True, timeout=240)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the benchmark would run")
def test_mfu_benchmark_skips_without_a_gpu():
    out = _run()
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"skipped": "no CUDA device"}
    assert "no CUDA" in out.stderr


def test_mfu_benchmark_dry_run_exercises_the_measurement_path():
    out = _run("--device", "cpu", "--tiny")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["dry_run"] is True and result["tokens_per_s"] > 0 and 0 < result["mfu"] < 1
    assert result["attention"].startswith("bucketed_sdpa")
