"""Two-stage asynchronous checkpoints: exact resume, crash safety under SIGKILL, corruption
fallback, full disks, retention and refusal of mismatched checkpoints."""

from __future__ import annotations

import errno
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar

import checkpoint_workers as w
import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem
from worlds import run_world

from longrun.checkpoint import (
    Checkpointer,
    CheckpointMismatchError,
    CheckpointWriteError,
    layout,
    restore_latest,
)
from longrun.checkpoint.catalog import verify_shards
from longrun.checkpoint.dcp_format import METADATA_FILE, data_file_name
from longrun.checkpoint.manifest import TRAIN_STATE, rank_shard_name
from longrun.checkpoint.restore import read_manifest
from longrun.trainer import Trainer

TESTS = Path(__file__).parent


def _train(cfg, steps=None, ckpt_cfg=None):
    """Train with checkpoints on; returns (trainer weights, checkpointer)."""
    with Trainer(cfg, progress=False) as trainer:
        ckpt = Checkpointer(ckpt_cfg or cfg)
        trainer.before_update.append(ckpt.before_update)
        trainer.train(steps=steps, on_step=ckpt.on_step(trainer))
        ckpt.close()
        return w.weights(trainer), ckpt


def _restore(cfg):
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    with Trainer(cfg, progress=False) as trainer:
        return restore_latest(fs, root, model=cfg.model.model_dump(mode="json"),
                              template=trainer.state_dict)


# --- resume ----------------------------------------------------------------------------------


def test_resume_from_a_checkpoint_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    cfg = w.config(str(tmp_path / "ckpt"))
    with Trainer(cfg, progress=False) as straight:
        straight.train()
        want = w.weights(straight)
    _train(cfg, steps=5)  # checkpoint at step 3; steps 4 and 5 are lost with the "crash"
    with Trainer(cfg, progress=False) as resumed:
        ckpt = Checkpointer(cfg)
        restored = ckpt.restore(resumed)
        assert restored.step == 3 and resumed.step == 3 and restored.skipped == []
        resumed.before_update.append(ckpt.before_update)
        resumed.train(on_step=ckpt.on_step(resumed))
        ckpt.close()
        got = w.weights(resumed)
    assert all(torch.equal(got[k], want[k]) for k in want)
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    assert layout.committed_steps(fs, root) == [3, 6, 8]
    assert layout.read_latest(fs, root) == 8


def test_world_of_four_resumes_bitwise_reading_the_model_once(tmp_path, redis_server):
    root = str(tmp_path / "ckpt")
    out = run_world(w.resume_across_attempts, 4, tmp_path, args=(redis_server.url, root))
    assert sorted(out) == [(r, 3, True) for r in range(4)]
    fs, base = fsspec.core.url_to_fs(root)
    manifest = read_manifest(fs, base, 8)
    # The replicated state is written once for the data-parallel group (by rank 0), not once
    # per rank; every rank writes its own RNG streams.
    assert sorted(manifest.files) == sorted([METADATA_FILE, data_file_name(0), TRAIN_STATE]
                                            + [rank_shard_name(r) for r in range(4)])
    assert manifest.world_size == 4 and manifest.dp_size == 4


# --- crash safety ----------------------------------------------------------------------------


def _wait_for_commit_after(fs, root, step, proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the trainer exited with {proc.returncode}"
        steps = layout.committed_steps(fs, root)
        if steps and steps[-1] > step:
            return steps[-1]
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint after step {step} within {timeout} s")


def test_sigkill_mid_save_always_leaves_a_complete_verifying_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    cfg = w.config(root, model={"dim": 256, "n_layers": 4, "n_heads": 4})
    fs, base = fsspec.core.url_to_fs(root)
    rng = random.Random(1234)
    newest = 0
    saw_debris = False
    # At least 5 kills at random points, and more (up to 12) until one lands mid-save: where
    # a kill lands depends on the machine's timing, and the test must exercise that case.
    for kill in range(12):
        if kill >= 5 and saw_debris:
            break
        proc = subprocess.Popen([sys.executable, str(TESTS / "checkpoint_workers.py"), root],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == f"resumed {newest}"
            _wait_for_commit_after(fs, base, newest, proc)
            time.sleep(rng.uniform(0.0, 0.5))  # a random point in the save cycle: the fault
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        saw_debris |= bool(layout.uncommitted_dirs(fs, base))
        restored = _restore(cfg)
        committed = layout.committed_steps(fs, base)
        # The newest committed step verifies (no fall-back was needed) and is never older
        # than what was committed before the kill.
        assert restored is not None and restored.skipped == [], restored and restored.skipped
        assert restored.step == committed[-1] > newest, (kill, committed, newest)
        for step in committed:
            manifest = read_manifest(fs, base, step)
            checks = verify_shards(fs, base, step, manifest)  # every file re-hashed
            assert checks and all(c.status == "OK" for c in checks), checks
        newest = restored.step
    # Not an assertion about the feature, a check that the test exercised it: at least one
    # kill landed while a save was being written.
    assert saw_debris, "no kill landed mid-save; the test did not test anything"


# --- corruption and mismatch -----------------------------------------------------------------


@pytest.fixture
def two_checkpoints(tmp_path):
    cfg = w.config(str(tmp_path / "ckpt"), training={"steps": 6})
    _train(cfg)
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    assert layout.committed_steps(fs, root) == [3, 6]
    return cfg, Path(root)


def test_a_flipped_byte_in_a_shard_falls_back_to_the_previous_checkpoint(two_checkpoints, caplog):
    cfg, root = two_checkpoints
    shard = root / layout.step_dir_name(6) / data_file_name(0)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    restored = _restore(cfg)
    assert restored.step == 3
    assert restored.skipped[0][0] == 6 and "checksum" in restored.skipped[0][1]
    assert "falling back" in caplog.text


def test_a_truncated_manifest_falls_back_to_the_previous_checkpoint(two_checkpoints):
    cfg, root = two_checkpoints
    manifest = root / layout.step_dir_name(6) / layout.MANIFEST
    manifest.write_bytes(manifest.read_bytes()[:40])
    restored = _restore(cfg)
    assert restored.step == 3 and "not a valid checkpoint manifest" in restored.skipped[0][1]


def test_a_checkpoint_of_another_model_shape_is_refused_clearly(two_checkpoints):
    cfg, _ = two_checkpoints
    wider = w.config(cfg.checkpoint_dir, model={"dim": 128})
    expected = r"different model \(dim: checkpoint 64 vs job 128\)"
    with Trainer(wider, progress=False) as trainer, pytest.raises(CheckpointMismatchError, match=expected):
        Checkpointer(wider).restore(trainer)


def test_a_checkpoint_of_the_earlier_format_is_refused_clearly(two_checkpoints):
    cfg, root = two_checkpoints
    path = root / layout.step_dir_name(6) / layout.MANIFEST
    path.write_text(path.read_text().replace('"format": 2', '"format": 1'))
    with pytest.raises(CheckpointMismatchError, match=r"earlier longrun \(checkpoint format 1"):
        _restore(cfg)


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    assert _restore(w.config(str(tmp_path / "empty"))) is None


def test_shards_load_with_weights_only(two_checkpoints):
    _, root = two_checkpoints
    step_dir = root / layout.step_dir_name(6)
    # No arbitrary pickles anywhere: every file longrun reads back loads with weights_only.
    assert set(torch.load(step_dir / rank_shard_name(0), weights_only=True)) == {"rng"}
    state = torch.load(step_dir / TRAIN_STATE, weights_only=True)
    assert set(state) == {"step", "scheduler", "data", "model", "optimizer"} and state["step"] == 6
    assert json.loads((root / layout.step_dir_name(6) / layout.MANIFEST).read_text())["step"] == 6


# --- failing and slow storage ----------------------------------------------------------------


class _QuotaFile(MemoryFile):
    def write(self, data):
        fs = self.fs
        if fs.limit is not None and fs.used() + len(data) > fs.limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        return super().write(data)


class QuotaMemoryFS(MemoryFileSystem):
    """An in-memory store (an object store's commit path: no atomic rename) with a quota."""

    protocol = "quotamem"
    store: ClassVar[dict] = {}
    pseudo_dirs: ClassVar[list] = [""]
    limit: int | None = None
    gate = threading.Event()
    rm_gate = threading.Event()  # tests hold directory removals (retention's bulk) here

    def rm(self, path, recursive=False, maxdepth=None):
        self.rm_gate.wait()
        return super().rm(path, recursive=recursive, maxdepth=maxdepth)

    def used(self) -> int:
        return sum(len(f.getbuffer()) for f in self.store.values())

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode:
            self.gate.wait()  # tests hold writes here to keep a save in flight
            f = _QuotaFile(self, self._strip_protocol(path), kwargs.get("data"))
            f.commit()  # visible at once, like a file being written on a disk
            return f
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("quotamem", QuotaMemoryFS, clobber=True)


@pytest.fixture
def quota_fs(request):
    QuotaMemoryFS.limit = None
    QuotaMemoryFS.gate.set()
    QuotaMemoryFS.rm_gate.set()
    root = f"quotamem://ckpt-{request.node.name}"
    yield root
    QuotaMemoryFS.limit = None
    QuotaMemoryFS.gate.set()
    QuotaMemoryFS.rm_gate.set()
    QuotaMemoryFS.store.clear()


def test_a_full_disk_is_a_clear_error_and_earlier_checkpoints_survive(quota_fs):
    cfg = w.config(quota_fs)
    with Trainer(cfg, progress=False) as trainer:
        ckpt = Checkpointer(cfg)
        trainer.train_step()
        ckpt.save(trainer)
        assert ckpt.flush().committed
        used = QuotaMemoryFS().used()
        QuotaMemoryFS.limit = used + 4096  # the disk is now (nearly) full
        trainer.train_step()
        ckpt.save(trainer)  # training is blocked only for the copy; the write fails behind it
        with pytest.raises(CheckpointWriteError, match="No space left on device"):
            ckpt.flush()
        assert ckpt.writer.last_result.committed is False
        # The failed save freed what it had written at once, so a disk that stays full is not
        # filled further by every retry.
        fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
        assert layout.uncommitted_dirs(fs, root) == [] and QuotaMemoryFS().used() == used
        ckpt.close()
    restored = _restore(cfg)
    assert restored.step == 1 and restored.skipped == []


def test_a_failed_save_on_a_local_disk_leaves_no_partial_step(tmp_path):
    cfg = w.config(str(tmp_path / "ckpt"))
    with Trainer(cfg, progress=False) as trainer:
        ckpt = Checkpointer(cfg)
        trainer.train_step()
        ckpt.save(trainer)
        ckpt.flush()
        ckpt.writer.fail_next_save("a full disk")  # the `fail_save` fault: ENOSPC mid-save
        trainer.train_step()
        ckpt.save(trainer)
        with pytest.raises(CheckpointWriteError, match="No space left on device"):
            ckpt.flush()
        ckpt.close()
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    assert layout.committed_steps(fs, root) == [1] and layout.uncommitted_dirs(fs, root) == []
    assert sorted(os.listdir(root)) == [layout.LATEST, layout.step_dir_name(1)]


def test_a_save_over_a_crashed_saves_leftovers_keeps_its_own_metadata_and_drops_the_rest(tmp_path):
    """A save killed between DCP's `.metadata` and the manifest leaves both behind in `step-N/`
    (no manifest: not a checkpoint); the next save of step N writes into the same directory.
    Its commit must keep the `.metadata` it wrote itself and remove what no rank reported."""
    cfg = w.config(str(tmp_path / "ckpt"))
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    debris = f"{root}/{layout.step_dir_name(1)}"
    fs.makedirs(debris, exist_ok=True)
    fs.pipe_file(f"{debris}/{METADATA_FILE}", b"stale")
    fs.pipe_file(f"{debris}/{data_file_name(5)}", b"a rank of another world")
    with Trainer(cfg, progress=False) as trainer:
        ckpt = Checkpointer(cfg)
        trainer.train_step()
        ckpt.save(trainer)
        assert ckpt.flush().committed
        ckpt.close()
    assert layout.committed_steps(fs, root) == [1]
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(debris, detail=False)}
    assert data_file_name(5) not in names and METADATA_FILE in names
    manifest = read_manifest(fs, root, 1)
    assert METADATA_FILE in manifest.files
    assert all(c.status == "OK" for c in verify_shards(fs, root, 1, manifest))


def test_a_save_due_while_one_is_in_flight_is_skipped_by_policy(quota_fs):
    cfg = w.config(quota_fs, checkpoint={"when_busy": "skip"})
    with Trainer(cfg, progress=False) as trainer:
        ckpt = Checkpointer(cfg)
        QuotaMemoryFS.gate.clear()  # storage stalls: the first save stays in flight
        trainer.train_step()
        assert ckpt.save(trainer) is not None
        trainer.train_step()
        assert ckpt.save(trainer) is None and ckpt.skipped == 1
        QuotaMemoryFS.gate.set()
        assert ckpt.flush().step == 1
        ckpt.close()
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    assert layout.committed_steps(fs, root) == [1]


def test_deleting_an_old_checkpoint_does_not_hold_the_next_save(quota_fs):
    """Retention frees a multi-GB step in seconds (an object store: a request per object): the
    step stops counting at once (its manifest goes first) and the rest goes beside training."""
    cfg = w.config(quota_fs, checkpoint={"keep_last": 1})
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    with Trainer(cfg, progress=False) as trainer:
        ckpt = Checkpointer(cfg)
        trainer.train_step()
        ckpt.save(trainer)
        assert ckpt.flush().committed
        QuotaMemoryFS.rm_gate.clear()  # step 1's removal will hang until released
        trainer.train_step()
        ckpt.save(trainer)
        assert ckpt.writer.wait_idle(timeout=60), "the save waited for the old step's deletion"
        assert ckpt.writer.last_result.committed and ckpt.writer.last_result.step == 2
        assert layout.committed_steps(fs, root) == [2]
        assert fs.exists(f"{root}/{layout.step_dir_name(1)}")  # its bulk still waits at the gate
        QuotaMemoryFS.rm_gate.set()
        assert ckpt.writer.wait_deleted(timeout=60)
        assert not fs.exists(f"{root}/{layout.step_dir_name(1)}")
        ckpt.close()


def test_the_object_store_commit_path_round_trips(quota_fs):
    cfg = w.config(quota_fs, training={"steps": 4}, checkpoint={"interval_steps": 2, "keep_last": 1})
    want, _ = _train(cfg)
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    assert layout.committed_steps(fs, root) == [4]  # retention kept one
    assert not layout.uncommitted_dirs(fs, root)
    with Trainer(cfg, progress=False) as trainer:
        Checkpointer(cfg).restore(trainer)
        got = w.weights(trainer)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_buffers_are_allocated_once_and_reused(tmp_path):
    cfg = w.config(str(tmp_path / "ckpt"))
    with Trainer(cfg, progress=False) as trainer:
        ckpt = Checkpointer(cfg)
        trainer.train_step()
        ckpt.save(trainer)
        ckpt.flush()
        first = {id(t) for t in ckpt.stager._buffers.values()}
        for _ in itertools.repeat(None, 2):
            trainer.train_step()
            ckpt.save(trainer)
            ckpt.flush()
        assert {id(t) for t in ckpt.stager._buffers.values()} == first
        ckpt.close()


def test_a_cpu_save_returns_before_its_copy_and_the_next_update_waits_for_it(tmp_path, monkeypatch):
    """The copy of a CPU state runs in the writer's thread, overlapping the next forward and
    backward; the optimizer update waits for it, so the checkpoint holds the saved step's
    weights, not a mix with the next step's."""
    from longrun.checkpoint.snapshot import Snapshot

    gate = threading.Event()
    copy = Snapshot.copy

    def gated_copy(self):
        gate.wait()
        copy(self)
    monkeypatch.setattr(Snapshot, "copy", gated_copy)
    cfg = w.config(str(tmp_path / "ckpt"))
    with Trainer(cfg, progress=False) as trainer:
        ckpt = Checkpointer(cfg)
        trainer.train_step()
        saved = w.weights(trainer)
        ckpt.save(trainer)
        pending = ckpt._pending
        assert pending is not None and not pending.ready  # save() did not wait for the copy
        copied_before_update = []
        trainer.before_update.append(lambda: copied_before_update.append(pending.ready))
        step = threading.Thread(target=trainer.train_step)
        step.start()
        gate.set()
        step.join()
        assert copied_before_update == [True]
        assert not all(torch.equal(saved[k], v) for k, v in w.weights(trainer).items())  # it trained on
        ckpt.close()
    with Trainer(cfg, progress=False) as fresh:
        assert Checkpointer(cfg).restore(fresh).step == 1
        assert all(torch.equal(w.weights(fresh)[k], saved[k]) for k in saved)


def test_a_rank_that_never_reports_aborts_the_commit_naming_it(tmp_path):
    from longrun.checkpoint import CheckpointWriter, HostStager, LocalCommitLedger, Manifest
    from longrun.checkpoint.writer import SaveJob

    cfg = w.config(str(tmp_path / "ckpt"), checkpoint={"commit_timeout_s": 0.5})
    with pytest.raises(ValueError, match="shared commit ledger"):
        Checkpointer(cfg, rank=0, world_size=2)
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    # Rank 0 of a world of 2 whose rank 1 died: its own shard is written, the commit is not.
    writer = CheckpointWriter(fs, root, rank=0, world_size=2, ledger=LocalCommitLedger(),
                              keep_last=2, commit_timeout_s=0.5)
    snapshot = HostStager().stage({rank_shard_name(0): {"x": torch.ones(3)}})
    manifest = Manifest(step=7, world_size=2, dp_size=2, model={}, config_fingerprint="f")
    writer.submit(SaveJob(7, snapshot, manifest))
    writer.wait_idle()
    with pytest.raises(CheckpointWriteError, match=r"ranks 1 did not report their shards within 0.5 s"):
        writer.raise_if_failed()
    writer.close()
    assert layout.committed_steps(fs, root) == []
    # The aborted save removed what it wrote at once: nothing is left for a sweep.
    assert layout.uncommitted_dirs(fs, root) == []


# --- agreeing on a step ------------------------------------------------------------------------


def test_the_restore_vote_names_a_rank_that_never_answers(redis_client):
    """Ranks vote in the commit ledger on whether they could read and verify a step; a rank
    that never votes (a slow or dead reader) is named after the timeout instead of hanging
    every rank in a collective, and a veto decides at once."""
    from longrun.checkpoint.commit import AgreementTimeout, RedisCommitLedger

    ledgers = [RedisCommitLedger(redis_client, "vote", attempt=0) for _ in range(3)]
    votes: dict[int, bool] = {}
    threads = [threading.Thread(target=lambda r=r: votes.__setitem__(
        r, ledgers[r].agree("restore-5", r, True, 3, timeout_s=30))) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert votes == {0: True, 1: True, 2: True}
    assert ledgers[0].agree("restore-4", 0, False, 3, timeout_s=30) is False  # no wait for 1, 2
    with pytest.raises(AgreementTimeout, match=r"ranks 1, 2 did not finish"):
        ledgers[0].agree("restore-3", 0, True, 3, timeout_s=0.2)


def test_a_restore_that_finds_nothing_usable_leaves_a_fresh_optimizer_fresh(two_checkpoints):
    """Building the state to load into gives the optimizer its state (torch's get_state_dict
    steps it at lr 0); when every checkpoint then proves unusable, the fresh run must stay
    fresh (AdamW's step count decides its bias correction)."""
    cfg, root = two_checkpoints
    for step in (3, 6):
        shard = root / layout.step_dir_name(step) / data_file_name(0)
        data = bytearray(shard.read_bytes())
        data[100] ^= 0xFF
        shard.write_bytes(bytes(data))
    with Trainer(cfg, progress=False) as trainer:
        assert Checkpointer(cfg).restore(trainer) is None
        assert not trainer.optimizer.state


# --- a worker's restore: straight into its unset state -----------------------------------------


def _worker_trainer(cfg):
    """What a worker restores into: its pieces built, no weights set yet (`worker/setup.py`)."""
    return Trainer(cfg, progress=False, init_weights=False)


def test_a_workers_restore_reads_the_records_into_its_state_and_copies_none(two_checkpoints, monkeypatch):
    """Same layout saved and restored: every record is one whole live tensor, so a worker's
    restore reads each into place (no new buffer, no copy after) and ends with the weights
    of the newest step. A trainer that holds set weights still stages every read."""
    from longrun.checkpoint import restore as restore_module

    cfg, _ = two_checkpoints
    want, _ = _train(cfg)  # the same 6 steps again: the newest checkpoint's weights
    seen = []

    def watched(loaded, reads, wanted):
        targets = {w.buffer.data_ptr() for w in wanted}
        seen.append((sum(t.data_ptr() in targets for t in loaded.values()), len(loaded)))
        return apply_reads(loaded, reads, wanted)

    apply_reads = restore_module.apply_reads
    monkeypatch.setattr(restore_module, "apply_reads", watched)
    with _worker_trainer(cfg) as trainer:
        assert Checkpointer(cfg).restore(trainer).step == 6
        in_place, records = seen.pop()
        assert records > 0 and in_place == records
        assert all(torch.equal(v, want[k]) for k, v in w.weights(trainer).items())
    with Trainer(cfg, progress=False) as trainer:  # set weights: staged, copied after agreement
        assert Checkpointer(cfg).restore(trainer).step == 6
        in_place, records = seen.pop()
        assert records > 0 and in_place == 0


def test_a_workers_restore_that_meets_a_corrupt_step_ends_with_the_previous_one_bitwise(two_checkpoints):
    """Read in place, a step whose last record fails its checksum has already written the
    records before it into the live state; the fallback step overwrites every one of them."""
    cfg, root = two_checkpoints
    want = {}
    with Trainer(cfg, progress=False) as reference:  # step 3's weights, through the staged path
        shard = root / layout.step_dir_name(6)
        hidden = shard.rename(shard.with_name("hidden"))
        assert Checkpointer(cfg).restore(reference).step == 3
        want = w.weights(reference)
        hidden.rename(shard)
    data_file = shard / data_file_name(0)
    data = bytearray(data_file.read_bytes())
    data[-200] ^= 0xFF  # near the end: records earlier in the file are read and placed first
    data_file.write_bytes(bytes(data))
    with _worker_trainer(cfg) as trainer:
        restored = Checkpointer(cfg).restore(trainer)
        assert restored.step == 3 and restored.skipped[0][0] == 6
        got = w.weights(trainer)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("options", [{"fused": True}, {"foreach": True}, {"amsgrad": True}],
                         ids=["fused", "foreach", "amsgrad"])
def test_the_optimizer_state_laid_out_for_a_restore_is_the_one_adam_would_make(options):
    """`lay_out_state` makes what torch's lr-0 step would (each key, dtype, shape and device,
    `step` where the kernel wants it) without taking the step; an optimizer that has state,
    or another optimizer, is left alone."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    from longrun.trainer.optim import lay_out_state

    def fresh():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
        return torch.optim.AdamW(model.parameters(), lr=1e-3, **options)

    stepped, laid_out = fresh(), fresh()
    _init_optim_state(stepped)
    assert lay_out_state(laid_out) and not lay_out_state(laid_out)  # once only
    want = [stepped.state[p] for p in stepped.param_groups[0]["params"]]
    got = [laid_out.state[p] for p in laid_out.param_groups[0]["params"]]
    assert [sorted(s) for s in got] == [sorted(s) for s in want]
    for have, need in zip(got, want, strict=True):
        assert all((have[k].dtype, have[k].shape, have[k].device)
                   == (need[k].dtype, need[k].shape, need[k].device) for k in need)
    sgd = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert not lay_out_state(sgd) and not sgd.state


def test_a_restore_into_a_fresh_optimizer_takes_no_step(two_checkpoints, monkeypatch):
    """A restore builds the live state it reads into without torch's step at lr 0 (a pass
    over every parameter and moment, about half of a cold restore at size), and still ends
    with the newest checkpoint's weights and optimizer state bitwise."""
    cfg, _ = two_checkpoints
    with Trainer(cfg, progress=False) as reference:
        assert Checkpointer(cfg).restore(reference).step == 6
        want_optim = {k: v.clone() for k, v in reference.optimizer.state_dict()["state"][0].items()}
        want = w.weights(reference)
    steps = []
    step = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step",
                        lambda self, *a, **k: steps.append(1) or step(self, *a, **k))
    with _worker_trainer(cfg) as trainer:
        assert Checkpointer(cfg).restore(trainer).step == 6
        assert steps == []
        assert all(torch.equal(v, want[k]) for k, v in w.weights(trainer).items())
        got_optim = trainer.optimizer.state_dict()["state"][0]
        assert all(torch.equal(got_optim[k], v) for k, v in want_optim.items())
