"""Checkpoints of a path a loss-spike rollback abandoned are fenced for good: no later restart
restores the spiked weights (not only the attempt that answered the spike), and retention never
deletes the newest commit because leftovers of the abandoned path carry higher step numbers."""

from __future__ import annotations

import checkpoint_workers as w
import fsspec
import torch

from longrun.checkpoint import Checkpointer, layout
from longrun.checkpoint.lineage import (
    FENCES,
    Fence,
    add_fence,
    current_lineage,
    fence_of,
    fenced_steps,
    read_fences,
)
from longrun.checkpoint.manifest import Manifest
from longrun.controller.keepers import newest_committed_step
from longrun.controller.precheck import checkpoint_problem, fence_rollback
from longrun.trainer import Trainer


def _attempt(cfg, *, before_step=None, steps=0):
    """One attempt of a worker: restore (before `before_step`), train `steps` more steps with
    checkpoints, commit. Returns (restored step or None, the step reached, its weights)."""
    with Trainer(cfg, progress=False) as trainer:
        ckpt = Checkpointer(cfg)
        restored = ckpt.restore(trainer, before_step=before_step)
        trainer.before_update.append(ckpt.before_update)
        if steps:
            trainer.train(steps=steps, on_step=ckpt.on_step(trainer))
        ckpt.close()
        return (restored.step if restored else None), trainer.step, w.weights(trainer)


def test_a_rollback_fences_the_spiked_path_for_every_later_restart_and_retention_keeps_the_new(tmp_path):
    cfg = w.config(str(tmp_path / "ckpt"), training={"steps": 8},
                   checkpoint={"interval_steps": 2, "keep_last": 2})
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    _attempt(cfg, steps=8)
    assert layout.committed_steps(fs, root) == [6, 8]
    # A loss spike at step 5: the controller restarts from before it, fencing what is after.
    fence_rollback(cfg, 5, "loss spike at step 5")
    assert [f.from_step for f in read_fences(fs, root)] == [5]
    # What the controller compares memory snapshots against: not the fenced 8.
    assert newest_committed_step(cfg) == 0 and newest_committed_step(cfg, before_step=5) == 0
    # The rollback's attempt finds nothing before step 5 and starts afresh; it dies before
    # its first checkpoint. An ordinary restart after it must not resume the spiked step 8.
    assert _attempt(cfg, before_step=5, steps=1)[0] is None
    assert _attempt(cfg)[0] is None
    # The new path commits step 2: the newest commit survives retention although the
    # abandoned 6 and 8 have higher numbers; they go instead.
    restored, reached, new_weights = _attempt(cfg, steps=2)
    assert restored is None and reached == 2
    assert layout.committed_steps(fs, root) == [2]
    resumed, _, weights = _attempt(cfg)
    assert newest_committed_step(cfg) == 2
    assert resumed == 2 and all(torch.equal(new_weights[k], v) for k, v in weights.items())
    manifest = Manifest.from_json(fs.cat_file(f"{root}/{layout.step_dir_name(2)}/{layout.MANIFEST}"))
    assert manifest.lineage == 1


def test_the_new_path_recommits_the_fenced_steps_and_those_are_restored(tmp_path):
    cfg = w.config(str(tmp_path / "ckpt"), training={"steps": 8},
                   checkpoint={"interval_steps": 2, "keep_last": 4})
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    _attempt(cfg, steps=6)
    assert layout.committed_steps(fs, root) == [2, 4, 6]
    fence_rollback(cfg, 5, "loss spike at step 5")
    assert _attempt(cfg, before_step=5)[0] == 4
    assert fenced_steps(fs, root) == {6}
    assert _attempt(cfg)[0] == 4  # an ordinary restart: still not the fenced step 6
    restored, reached, weights6 = _attempt(cfg, before_step=5, steps=2)
    assert (restored, reached) == (4, 6) and fenced_steps(fs, root) == set()  # 6 of the new path
    resumed, _, weights = _attempt(cfg)
    assert resumed == 6 and all(torch.equal(weights6[k], v) for k, v in weights.items())


def test_a_fence_catches_late_commits_of_the_old_path_only():
    first = [Fence(25)]
    assert fence_of(30, 0, first) == Fence(25)  # the old path, committed after the rollback
    assert fence_of(30, 1, first) is None  # the new path at the same step
    assert fence_of(24, 0, first) is None  # shared history: before the bad step
    both = [*first, Fence(12)]  # a second rollback, to before step 12
    assert fence_of(30, 1, both) == Fence(12) and fence_of(12, 1, both) == Fence(12)
    assert fence_of(30, 0, both) == Fence(25)  # the first fence that applies is named
    assert fence_of(11, 1, both) is None and fence_of(40, 2, both) is None


def _manifest(fs, root, step, *, lineage=0, model=None):
    path = f"{root}/{layout.step_dir_name(step)}"
    fs.makedirs(path, exist_ok=True)
    m = Manifest(step=step, world_size=1, dp_size=1, model=model or {"dim": 64}, config_fingerprint="x",
                 lineage=lineage)
    fs.pipe_file(f"{path}/{layout.MANIFEST}", m.to_json())


def test_retention_never_deletes_the_newest_commit_and_drops_fenced_ones(tmp_path):
    fs, root = fsspec.core.url_to_fs(str(tmp_path / "r"))
    for step in (4, 6, 8):
        _manifest(fs, root, step)
    add_fence(fs, root, 6)
    _manifest(fs, root, 5, lineage=1)  # the new path's first commit, below the leftovers
    removed = layout.apply_retention(fs, root, 1, committed=5, fenced=fenced_steps(fs, root))
    assert layout.committed_steps(fs, root) == [5] and len(removed) == 3
    # An unfenced leftover with a higher number (say, unreadable at the last restore) does not
    # push the newest commit out either.
    for step in (4, 9):
        _manifest(fs, root, step, lineage=1)
    _manifest(fs, root, 7, lineage=1)
    layout.apply_retention(fs, root, 2, committed=7)
    assert layout.committed_steps(fs, root) == [7, 9]


def test_the_precheck_judges_the_newest_unfenced_checkpoint_and_a_broken_record_stops_the_job(tmp_path):
    cfg = w.config(str(tmp_path / "ckpt"))
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    fence_rollback(cfg, 3, "spike")  # no checkpoint root yet: nothing to fence, nothing written
    assert not fs.exists(root)
    model = cfg.model.model_dump(mode="json")
    _manifest(fs, root, 2, model=model)
    _manifest(fs, root, 8, model=model | {"dim": 128})  # another model: the precheck would fail the job...
    assert "different model" in checkpoint_problem(cfg)
    fence_rollback(cfg, 3, "spike")  # ...but it is on the abandoned path
    assert checkpoint_problem(cfg) is None and current_lineage(fs, root) == 1
    fs.pipe_file(f"{root}/{FENCES}", b"{not json")
    assert "not a valid fence record" in checkpoint_problem(cfg)


def test_the_controller_fences_when_it_decides_a_rollback(tmp_path, redis_server):
    from controller_fakes import drive_to_running, job, make_rig

    from longrun.controller.state import JobState
    from longrun.controller.workers import RankEnded

    make, launcher, *_ = make_rig(redis_server.url)
    cfg = job("ckpt-fence", output_dir=str(tmp_path))
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    _manifest(fs, root, 8, model=cfg.model.model_dump(mode="json"))
    c = make(cfg)
    drive_to_running(c)
    assert read_fences(fs, root) == []
    launcher.groups[0].script.append([RankEnded(1, kind="nan", step=6, detail="rank 1 raised NonFinite")])
    assert c.step() is JobState.RECOVERING
    assert [f.from_step for f in read_fences(fs, root)] == [6] and fenced_steps(fs, root) == {8}
