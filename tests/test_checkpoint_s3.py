"""Checkpoints on an object store for real: `checkpoint.dir: s3://bucket/prefix` against moto's
S3 server on loopback (s3fs underneath, the endpoint from AWS_ENDPOINT_URL). A resume from the
bucket is bitwise; the commit copies nothing (counted by the server); retention deletes only
old steps; a save killed mid-write is never restored and is swept."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import checkpoint_workers as w
import fsspec
import pytest
import torch
from s3_server import s3_server

from longrun.checkpoint import Checkpointer, layout, restore_latest
from longrun.checkpoint.catalog import verify_shards
from longrun.checkpoint.restore import read_manifest
from longrun.trainer import Trainer

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        server.bucket("ckpt")
        yield server


def _objects(fs, root: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(p.removeprefix(root + "/") for p in fs.find(root))


def test_a_resume_from_the_bucket_is_bitwise_and_nothing_is_copied(s3, tmp_path):
    cfg = w.config("s3://ckpt/resume", checkpoint={"interval_steps": 3, "keep_last": 2})
    with Trainer(cfg, progress=False) as straight:
        straight.train()
        want = w.weights(straight)
    with Trainer(cfg, progress=False) as first:  # checkpoints at 3; steps 4 and 5 die with it
        ckpt = Checkpointer(cfg)
        first.before_update.append(ckpt.before_update)
        first.train(steps=5, on_step=ckpt.on_step(first))
        ckpt.close()
    with Trainer(cfg, progress=False) as resumed:
        ckpt = Checkpointer(cfg)
        assert ckpt.restore(resumed).step == 3
        resumed.before_update.append(ckpt.before_update)
        resumed.train(on_step=ckpt.on_step(resumed))
        ckpt.close()
        got = w.weights(resumed)
    assert all(torch.equal(got[k], want[k]) for k in want)
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    # Retention kept the newest two and deleted only the older step, whole.
    assert layout.committed_steps(fs, root) == [6, 8] and layout.read_latest(fs, root) == 8
    assert {p.split("/")[0] for p in _objects(fs, root)} == {"step-00000006", "step-00000008", "latest"}
    for step in (6, 8):
        assert all(c.status == "OK" for c in verify_shards(fs, root, step, read_manifest(fs, root, step)))
    # Four commits, and not one byte went through S3's copy (a "rename" there).
    assert s3.copies == []


def _wait_for_commit_after(fs, root, step, proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the trainer exited with {proc.returncode}"
        steps = layout.committed_steps(fs, root)
        if steps and steps[-1] > step:
            return steps[-1]
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint after step {step} within {timeout} s")


def _kill_while_saving(fs, root, proc, timeout=120.0) -> None:
    """SIGKILL `proc` as soon as the bucket shows a step directory without a manifest: one of
    its saves being written (the sweep before each run removed every other). Polled: another
    process writes it. The save may still commit before the signal lands; the caller counts."""
    deadline = time.monotonic() + timeout
    while not layout.uncommitted_dirs(fs, root):
        assert proc.poll() is None, f"the trainer exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"no save in progress seen within {timeout} s"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)


def test_a_save_killed_mid_write_is_never_restored_and_is_swept(s3):
    url = "s3://ckpt/killed"
    cfg = w.config(url, model={"dim": 256, "n_layers": 4, "n_heads": 4})
    fs, root = fsspec.core.url_to_fs(url)
    newest, landed = 0, 0
    for _ in range(3):  # until a kill lands mid-save (the first, nearly always: it is aimed)
        if landed:
            break
        proc = subprocess.Popen([sys.executable, str(TESTS / "checkpoint_workers.py"), url],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == f"resumed {newest}"
            _wait_for_commit_after(fs, root, newest, proc)
            _kill_while_saving(fs, root, proc)
        finally:
            proc.kill()
            proc.wait()
        debris = layout.uncommitted_dirs(fs, root)
        landed += bool(debris)
        with Trainer(cfg, progress=False) as trainer:
            restored = restore_latest(fs, root, model=cfg.model.model_dump(mode="json"),
                                      template=trainer.state_dict)
        committed = layout.committed_steps(fs, root)
        # The newest committed step restores without a fall-back; a half-written one is not a step.
        assert restored is not None and restored.skipped == [] and restored.step == committed[-1] > newest
        # What the controller does before the next attempt (`precheck.sweep_partial_saves`): the
        # killed save's files go, every committed step stays.
        assert layout.sweep_uncommitted(fs, root) == debris
        assert layout.uncommitted_dirs(fs, root) == [] and layout.committed_steps(fs, root) == committed
        newest = restored.step
    assert landed, "no kill landed mid-save; the test did not test anything"
    assert s3.copies == []
