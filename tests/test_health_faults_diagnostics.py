"""Fault injection fires for real (SIGKILL, SIGSTOP, an exception, NaN weights, slow steps),
and the self-check diagnostics pass on a healthy machine and fail, with the reason, on a
broken one."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from longrun.config.sections import FaultSpec
from longrun.health.diagnostics import (
    collective_check,
    compute_check,
    memory_check,
    run_diagnostics,
    store_check,
)
from longrun.health.faults import FaultInjector, InjectedFault
from longrun.services.ports import free_port

_CHILD = textwrap.dedent("""
    import sys
    from longrun.config.sections import FaultSpec
    from longrun.health.faults import FaultInjector
    inj = FaultInjector([FaultSpec(rank=0, step=2, kind=sys.argv[1])], rank=0, attempt=0)
    for step in range(1, 5):
        print(f"step {step}", flush=True)
        inj.after_step(step)
    print("finished", flush=True)
""")


def _child(kind: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CHILD, kind], stdout=subprocess.PIPE, text=True)


def test_kill_fault_sigkills_the_process_at_its_step():
    proc = _child("kill")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -9
    assert out.split("\n")[:2] == ["step 1", "step 2"] and "finished" not in out


def test_hang_fault_stops_the_process():
    proc = _child("hang")
    try:
        assert proc.stdout.readline().strip() == "step 1"
        assert proc.stdout.readline().strip() == "step 2"
        # The process stops itself right after printing step 2: wait for the kernel to say so.
        deadline = time.monotonic() + 30
        state = ""
        while time.monotonic() < deadline:
            with open(f"/proc/{proc.pid}/stat") as f:
                state = f.read().split(")")[-1].split()[0]
            if state == "T":
                break
            time.sleep(0.01)
        assert state == "T", f"process state {state!r}, expected stopped"
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_raise_fault_only_in_its_attempt():
    spec = FaultSpec(rank=1, step=3, kind="raise", attempt=1)
    FaultInjector([spec], rank=1, attempt=0).after_step(3)  # another attempt: nothing
    FaultInjector([spec], rank=0, attempt=1).after_step(3)  # another rank: nothing
    injector = FaultInjector([spec], rank=1, attempt=1)
    injector.after_step(2)
    with pytest.raises(InjectedFault, match="rank 1 at step 3"):
        injector.after_step(3)
    injector.after_step(4)  # fired once only


def test_nan_fault_poisons_the_model_so_the_next_loss_is_nan():
    model = torch.nn.Linear(4, 1)
    FaultInjector([FaultSpec(rank=0, step=1, kind="nan")], rank=0, attempt=0, model=model).after_step(1)
    assert torch.isnan(model(torch.ones(2, 4))).all()


def test_slow_fault_delays_every_later_step():
    injector = FaultInjector([FaultSpec(rank=0, step=2, kind="slow", seconds=0.05)], rank=0, attempt=0)
    injector.after_step(1)
    assert injector.slow_s == 0
    injector.after_step(2)
    start = time.monotonic()
    injector.after_step(3)
    assert injector.slow_s == 0.05 and time.monotonic() - start >= 0.05  # sleep is a lower bound


def test_hold_fault_waits_in_phase_held_until_its_release_file_exists(tmp_path):
    release = tmp_path / "release"
    phases: list[str] = []
    injector = FaultInjector([FaultSpec(rank=0, step=2, kind="hold", release_file=str(release))],
                             rank=0, attempt=0, on_phase=phases.append)
    injector.after_step(1)
    assert phases == []
    held = threading.Thread(target=injector.after_step, args=(2,))
    held.start()
    held.join(timeout=0.5)
    assert held.is_alive() and phases == ["held"]  # still waiting: nothing released it
    release.touch()
    held.join(timeout=10)
    assert not held.is_alive()


def test_hold_fault_needs_a_release_file_and_only_it_takes_one():
    with pytest.raises(ValueError, match="release_file is required"):
        FaultSpec(rank=0, step=1, kind="hold")
    with pytest.raises(ValueError, match="release_file is required"):
        FaultSpec(rank=0, step=1, kind="kill", release_file="/tmp/x")


def test_compute_check_passes_and_catches_a_broken_unit():
    assert compute_check(torch.device("cpu")).ok

    def flaky(a, b):  # one wrong element, as a bad multiplier would produce
        out = a @ b
        out[7, 3] += 1.0
        return out

    bad = compute_check(torch.device("cpu"), matmul=flaky)
    assert not bad.ok and "off by" in bad.detail


def test_memory_check_passes_and_reports_an_allocation_failure():
    assert memory_check(torch.device("cpu"), 64 * 2**20).ok
    huge = memory_check(torch.device("cpu"), 1 << 52)  # 4 PiB
    assert not huge.ok and huge.detail


def test_store_check(redis_server):
    assert store_check(redis_server.url).ok
    dead = store_check(f"redis://127.0.0.1:{free_port()}/0", pings=1)
    assert not dead.ok and "Connection" in dead.detail


def test_collective_check_among_a_nodes_workers():
    store = dist.HashStore()
    results = {}

    def worker(rank):
        results[rank] = collective_check(dist.PrefixStore("diag", store), rank, 3, torch.device("cpu"),
                                         timeout=timedelta(seconds=30))

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(results[r].ok for r in range(3)), results
    assert "expected 6.0" in results[0].detail


def test_run_diagnostics_reports_by_node_and_rejects_unknown_checks(redis_server):
    report = run_diagnostics(["compute", "memory", "store"], node="node-a", rank=2,
                             device=torch.device("cpu"), redis_url=redis_server.url,
                             memory_bytes=2**20)
    assert report.ok and [c.name for c in report.checks] == ["compute", "memory", "store"]
    assert report.reason == "all checks passed"
    with pytest.raises(ValueError, match="unknown diagnostic"):
        run_diagnostics(["gpu-burn"], node="n", rank=0, device=torch.device("cpu"))


def test_fail_save_fault_fails_the_next_save_as_a_full_disk_once(tmp_path):
    import fsspec

    from longrun.checkpoint import (
        CheckpointWriteError,
        CheckpointWriter,
        HostStager,
        LocalCommitLedger,
        Manifest,
    )
    from longrun.checkpoint.layout import committed_steps
    from longrun.checkpoint.manifest import rank_shard_name
    from longrun.checkpoint.writer import SaveJob

    fs = fsspec.filesystem("file")
    writer = CheckpointWriter(fs, str(tmp_path), rank=0, world_size=1, ledger=LocalCommitLedger(),
                              keep_last=2, commit_timeout_s=5.0)
    injector = FaultInjector([FaultSpec(rank=0, step=3, kind="fail_save")], rank=0, attempt=0,
                             on_fail_save=writer.fail_next_save)

    def save(step: int) -> None:
        snapshot = HostStager().stage({rank_shard_name(0): {"x": torch.full((3,), float(step))}})
        writer.submit(SaveJob(step, snapshot, Manifest(step=step, world_size=1, dp_size=1, model={},
                                                       config_fingerprint="f")))
        writer.wait_idle()

    injector.after_step(2)
    save(2)
    writer.raise_if_failed()
    injector.after_step(3)  # armed: the next save fails, this one and no other
    save(4)
    with pytest.raises(CheckpointWriteError, match="No space left on device"):
        writer.raise_if_failed()
    save(6)
    writer.raise_if_failed()
    writer.close()
    assert committed_steps(fs, str(tmp_path)) == [2, 6]
    with pytest.raises(ValueError, match="checkpoint writer"):  # nothing to arm: said, not ignored
        FaultInjector([FaultSpec(rank=0, step=1, kind="fail_save")], rank=0, attempt=0).after_step(1)

