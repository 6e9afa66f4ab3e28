"""Bench scripts: each documents the command that runs it; the GPU benchmark skips cleanly where
there is no GPU and its code path runs; a multi-process bench runs its world end to end."""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from longrun.config.sections import ModelSection
from longrun.trainer.model import Transformer

BENCH = Path(__file__).resolve().parents[1] / "bench"


SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))


def _run(*args: str, script: str = "mfu_gpu.py") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args],
                          capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_bench_starts_with_the_command_that_runs_it(script):
    doc = ast.get_docstring(ast.parse((BENCH / script).read_text()), clean=False)
    assert doc, f"bench/{script} has no docstring"
    commands = [line.strip() for line in doc.splitlines() if line.startswith("    ")]
    assert commands and f"python bench/{script}" in commands[0], (script, commands[:1])
    assert "the last line on stdout is one JSON object" in " ".join(doc.split())


def test_a_multi_process_bench_runs_its_world_end_to_end():
    # bench/overlap.py spawns its ranks through longrun.testing.worlds; tiny sizes, one round.
    out = _run("--dim", "64", "--layers", "1", "--tokens", "64", "--rounds", "1", script="overlap.py")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["world"] == 2 and result["params"] > 0 and result["longrun_step_s"] > 0
    # The model it timed is the one asked for, and its ratios are of the times it reports.
    with torch.device("meta"):
        model = Transformer(ModelSection(dim=64, n_layers=1, n_heads=1, max_seq_len=64))
    assert result["params"] == model.num_params() and result["tokens_per_rank"] == 64
    ratio = result["after_step_s"] / result["longrun_step_s"]
    rounding = ratio * (5e-5 / result["after_step_s"] + 5e-5 / result["longrun_step_s"]) + 6e-4
    assert result["ratio"] == pytest.approx(ratio, abs=rounding)
    hidden = (result["after_step_s"] - result["longrun_step_s"]) / result["comm_s"]
    # (each to within what rounding the times to 0.1 ms and the ratios to 0.001 allows)
    slack = (1e-4 + abs(hidden) * 5e-5) / result["comm_s"] + 6e-4
    assert result["hidden_fraction"] == pytest.approx(hidden, abs=slack)


@pytest.mark.slow  # the suite's time: restoring at another layout is tests/test_resharding.py's
def test_the_resharding_bench_saves_at_fsdp4_and_restores_at_fsdp2():
    # bench/reshard.py: a world of 4 saves (longrun, DCP async and sync), a world of 2 restores
    # (longrun, dcp.load of both directories) and checks every restore bit for bit; one rep.
    out = _run("--quick", "--reps", "1", script="reshard.py")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert (result["save_fsdp"], result["restore_fsdp"], result["bitwise_equal"]) == (4, 2, True)
    assert min(result["restore_s"], result["dcp_load_s"], result["dcp_load_longrun_files_s"]) > 0
    assert min(result["blocking_s"], result["dcp_sync_s"], result["dcp_async_blocking_s"]) > 0
    # Each FSDP 2 rank reads only the records its half overlaps, not the whole checkpoint.
    assert all(0 < read < 0.75 * result["longrun_bytes"] for read in result["bytes_read_per_rank"])


def test_the_checkpoint_bench_times_the_copy_behind_a_real_step_and_reports_its_memory():
    # bench/checkpoint.py on a tiny model, two reps: every method saves and restores (each
    # restore checked against the weights the save held, though a step changed them since), and
    # longrun's and DCP's asynchronous staging each count the next update's wait for the copy.
    out = _run("--dim", "256", "--layers", "2", "--reps", "2", script="checkpoint.py")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    methods = result["methods"]
    assert set(methods) == {"longrun", "sync", "dcp", "dcp_cached", "dcp_async_staging", "memcpy", "disk"}
    assert all(len(times) == 2 for times in result["raw_blocking_s"].values())
    # Blocking is save()'s return plus the update's wait, from the same reps (each rounded to 0.1 ms).
    assert result["blocking_s"] == pytest.approx(result["save_return_s"] + result["update_wait_s"], abs=2e-4)
    for name in ("longrun", "dcp_async_staging"):
        row = methods[name]
        assert row["blocking_s"] == pytest.approx(row["save_return_s"] + row["update_wait_s"], abs=2e-4)
        assert row["update_wait_s"] >= 0 and row["step_s"] > 0 and row["e2e_s"] > 0 and row["restore_s"] > 0
    assert result["step_s"] == methods["longrun"]["step_s"] and result["step_alone_s"] > 0
    assert result["dcp_async_staging_blocking_s"] == methods["dcp_async_staging"]["blocking_s"]
    # The headline blocking is against the fastest DCP variant, each with its copy's whole cost.
    dcps = ("dcp", "dcp_cached", "dcp_async_staging")
    assert result["blocking_dcp_best"] in dcps
    assert methods[result["blocking_dcp_best"]]["blocking_s"] == min(methods[m]["blocking_s"] for m in dcps)
    # The disk floor read twice, cold: into touched buffers and into fresh memory; both ratios kept.
    assert methods["disk"]["restore_fresh_s"] == result["disk_read_fresh_s"] > 0
    for ratio, floor in (("restore_vs_disk", "disk_read_s"), ("restore_vs_disk_fresh", "disk_read_fresh_s")):
        expected = result["restore_s"] / result[floor]
        # (to within what rounding the times to 0.1 ms and the ratio to 1e-4 allows)
        rounding = expected * (5e-5 / result["restore_s"] + 5e-5 / result[floor]) + 5e-5
        assert result[ratio] == pytest.approx(expected, abs=rounding), ratio
    for key in ("state_gb", "blocking_vs_sync", "e2e_vs_dcp", "restore_vs_dcp_load", "e2e_vs_disk"):
        assert result[key] > 0, key  # the issue's headline keys stay
    # Peak memory: the process's own, at least what it held before building the state plus the state.
    assert result["peak_rss_bytes"] >= result["baseline_rss_bytes"] + result["state_bytes"]
    assert result["peak_rss_vs_state"] == pytest.approx(result["peak_rss_bytes"] / result["state_bytes"],
                                                        rel=1e-3)


def test_the_goodput_model_scales_the_llama3_failure_rate_and_cites_its_inputs():
    # bench/goodput_model.py is arithmetic: run it as shipped and with the failure rate doubled.
    out = _run(script="goodput_model.py")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["gpus"] == [1024, 16384, 100000]
    # 419 interruptions in 54 days on 16,384 GPUs, per GPU: one every 3.09 h at 16k, 16x that at 1k.
    assert result["mtbf_h"][1] == pytest.approx(54 * 24 / 419, rel=1e-3)
    assert result["mtbf_h"][0] == pytest.approx(16 * result["mtbf_h"][1], rel=1e-3)
    for system, goodput in result["goodput"].items():
        assert all(0 < g < 1 for g in goodput), system
        assert goodput[2] < goodput[1], system  # faults every 30 min cost more than every 3 h
    # The searched best interval agrees with Young/Daly's sqrt(2 C MTBF) where the grid allows it.
    for best, young in zip(result["storage_interval_s"]["baseline"], result["young_daly_s"]["baseline"],
                           strict=True):
        assert best == pytest.approx(young, rel=0.1)
    # Every measured input names the row of docs/benchmarks.md (or the config default) it comes from.
    inputs = out.stdout.split("## Inputs")[1].split("## Assumptions")[0]
    for flag in ("crash-detect-s", "warm-restart-s", "cold-restart-s", "memory-restore-gbs",
                 "storage-restore-gbs", "snapshot-block-gbs", "ckpt-block-gbs", "heartbeat-timeout-s"):
        row = next(line for line in inputs.splitlines() if line.startswith(f"| {flag} |"))
        assert "'" in row.split("|")[3] or "HealthSection" in row, row
    doubled = _run("--interruptions", "838", "--gpus", "16384", "--cold-restart-s", "9",
                   script="goodput_model.py")
    assert doubled.returncode == 0, doubled.stderr
    again = json.loads(doubled.stdout.strip().splitlines()[-1])
    assert again["mtbf_h"][0] == pytest.approx(result["mtbf_h"][1] / 2, rel=1e-3)
    assert again["goodput"]["baseline"][0] < result["goodput"]["baseline"][1]
    assert "| cold-restart-s | 9 s (overridden) |" in doubled.stdout  # a replaced measurement says so


def test_the_placement_scale_bench_places_starts_fits_and_cleans_up():
    # bench/placement_scale.py --quick on its own Ray cluster (the head as its one simulated
    # node): groups of 8 and 16 bundles placed as placement.py does, one group per node, and by
    # longrun's place(); 4 and 8 actors started, one replaced; every series fitted and projected
    # to 16,384 workers. (Run inside a private network and /tmp namespace like every Ray test.)
    out = _run("--quick", script="placement_scale.py")
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key, sizes in (("pg_one_s_at", {"8", "16"}), ("pg_per_node_s_at", {"8", "16"}),
                       ("place_s_at", {"8", "16"}), ("actors_s_at", {"4", "8"})):
        assert set(result[key]) == sizes, (key, result[key])
        assert all(v > 0 for v in result[key].values()), (key, result[key])
    for name in ("pg_one", "pg_per_node", "place", "actors"):
        fitted = result["fit"][name]
        assert {"linear", "power", "power_top", "exponent", "exponent_top", "projected_16k"} <= set(fitted), (
            name, fitted)
        assert math.isfinite(fitted["exponent"]) and fitted["projected_16k"] > 0, (name, fitted)
    assert result["projected_16k_place_s"] > 0 and result["projected_16k_start_s"] > 0
    assert result["projected_16k_start_s"] >= result["one_node_start_s"] > 0
    assert result["replace_one_at"] == 8 and result["replace_one_s"] > 0
    assert result["replace_node_pg_one_s"] > 0 and result["replace_node_pg_per_node_s"] > 0
    assert result["actors_pss_gib_at"]["8"] > result["actors_pss_gib_at"]["4"] > 0  # workers were measured
    # Nothing it started outlives it (the GCS and the raylet name its temp dir on their command line).
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        if result["cluster_temp_dir"] in " ".join(proc.info["cmdline"] or []):
            left.append(proc.pid)
    assert not left, left


def _ratio_of_rounded(ratio: float, theirs: float, ours: float, half: float = 0.0005) -> bool:
    """`ratio` (rounded to 0.001) is theirs / ours of the unrounded times, which the bench rounds
    to 1 ms: at a few milliseconds each, that rounding alone moves the ratio by several percent."""
    return (theirs - half) / (ours + half) - half <= ratio <= (theirs + half) / (ours - half) + half


@pytest.mark.slow  # two simulated worlds per kind, spawned: about a minute on 2 cores
def test_the_group_init_store_bench_issues_longruns_protocol_and_reports_the_ratio():
    # bench/group_init.py's store and reform-store measurements at 64 simulated ranks, one rep.
    out = _run("--only", "store", "--only", "reform-store", "--store-ranks", "64", "--store-reps", "1",
               script="group_init.py")
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    store = result["store"]
    assert store["ranks"] == 64 and store["redis_s"] > 0 and store["tcpstore_s"] > 0
    assert _ratio_of_rounded(store["ratio"], store["tcpstore_s"], store["redis_s"])
    # Each baseline is named by the torch function whose store traffic it reproduces, and does
    # what that function does: split_group adds no key per group, new_group one id per distinct
    # group (the same groups longrun would key were they not split), its local barrier the same.
    assert store["baseline"].startswith("torch.distributed.new_group") and "BARRIER=0" in store["baseline"]
    assert store["split_group"]["baseline"] == "torch.distributed.split_group"
    assert store["split_group"]["groups_per_rank"] == 0
    assert store["groups_per_rank"] == store["distinct_groups_per_rank"] > 0
    assert store["barrier_local"]["groups_per_rank"] == store["distinct_groups_per_rank"]
    assert "TORCH_DIST_INIT_BARRIER=1" in store["barrier_local"]["baseline"]
    assert store["world_barrier_round_trips"] == 3 * 64 * store["world_groups"] > 0
    assert result["torch_dist_init_barrier"] == "0"
    # The real count-in: per rank one script and one XREAD, plus torch's world id (one set, at
    # most a read per rank: one the store answers from an earlier XREAD's read-ahead costs none,
    # 127 of 128 in one run); nothing per group. (On the fresh server each script's first EVALSHA is
    # refused, NOSCRIPT, and sent again after one SCRIPT LOAD.)
    commands = store["where"]["redis"]["commands"]
    loads = commands.get("script|load", {"calls": 0})["calls"]
    assert commands["evalsha"]["calls"] - loads == 64 + 1 and 64 < commands["xread"]["calls"] <= 2 * 64
    reform = result["reform_store"]
    assert reform["ranks"] == 64 and reform["rekey_s"] > 0 and reform["tcpstore_s"] > 0
    assert reform["baseline"] == store["baseline"]
    assert _ratio_of_rounded(reform["split_group"]["ratio"], reform["split_group"]["tcpstore_s"],
                             reform["redis_s"])
    assert reform["redis_s"] == pytest.approx(reform["delete_old_attempt_s"] + reform["rekey_s"], abs=0.002)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the benchmark would run")
def test_mfu_benchmark_skips_without_a_gpu():
    out = _run()
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"skipped": "no CUDA device"}
    assert "no CUDA" in out.stderr


def test_cp_kernel_benchmark_dry_run_runs_both_kernels_on_both_blocks():
    out = _run("--device", "cpu", "--tokens", "192", "--ring", "2", "--reps", "1",
               script="cp_kernel.py")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["dry_run"] is True and result["dtype"] == "float32"
    assert [r["diagonal"] for r in result["rows"]] == [True, False]
    for row in result["rows"]:
        assert row["flash"]["s"] > 0 and row["math"]["s"] > 0 and row["speedup"] > 0
        assert row["speedup"] == pytest.approx(row["math"]["s"] / row["flash"]["s"], abs=0.006)
        # the same block: flash (float32 on the CPU) agrees with the math kernel
        assert row["flash_vs_math"]["out"] < 1e-5 and row["flash_vs_math"]["dq"] < 1e-5


def test_mfu_benchmark_dry_run_exercises_the_measurement_path():
    out = _run("--device", "cpu", "--tiny")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["dry_run"] is True and result["tokens_per_s"] > 0 and 0 < result["mfu"] < 1
    assert result["attention"].startswith("bucketed_sdpa")


@pytest.mark.slow  # compiles the tiny model's blocks: a minute on two cores
def test_mfu_benchmark_dry_run_takes_a_compiled_memory_budget():
    out = _run("--device", "cpu", "--tiny", "--compile", "blocks", "--ac", "budget", "--ac-budget", "0.3")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    config = result["config"]
    assert (config["compile"], config["activation_checkpointing"], config["activation_memory_budget"]) == (
        "blocks", "budget", 0.3)
    assert result["tokens_per_s"] > 0 and result["recompiles"] is not None


@pytest.mark.slow  # every command of the GPU session on the CPU: about 75 s on two cores
def test_the_prepared_gpu_session_runs_every_command_and_keeps_each_result(tmp_path):
    out = subprocess.run([str(BENCH / "gpu_session.sh")], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "GPU_SESSION_DRY": "1", "OUT": str(tmp_path),
                              "SESSION_BUDGET_S": "1800"})
    assert out.returncode == 0, out.stdout + out.stderr
    steps = [line for line in out.stdout.splitlines() if line.startswith("[gpu] ") and " rc=" in line]
    names = [line.split()[1] for line in steps]
    assert names == ["mfu-blocks", "mfu-blocks-16k", "mfu-ac-full", "mfu-ac-budget-0.5", "mfu-ac-selective",
                     "mfu-ac-budget-0.3", "checkpoint", "cp-kernel"], out.stdout
    assert all(" rc=0 " in line for line in steps), out.stdout
    results = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in names}
    assert results["mfu-ac-budget-0.3"]["config"]["activation_memory_budget"] == 0.3
    assert results["mfu-ac-full"]["config"]["activation_checkpointing"] == "full"
    assert results["checkpoint"]["state_gb"] > 0 and results["cp-kernel"]["rows"]
