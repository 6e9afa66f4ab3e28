"""The checkpoint directory layout: only directories with a manifest count; a committed step is
never written over (a second save of it is a revision); what is not committed is swept."""

from __future__ import annotations

import fsspec
import pytest

from longrun.checkpoint import layout


@pytest.fixture(params=["file", "memory"])
def fs_root(request, tmp_path):
    if request.param == "file":
        yield fsspec.filesystem("file"), str(tmp_path / "ckpt")
        return
    fs = fsspec.filesystem("memory")
    root = f"/ckpt-{id(request)}"
    yield fs, root
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _commit(fs, root, step, manifest=True):
    d = f"{root}/{layout.step_dir_name(step)}"
    fs.makedirs(d, exist_ok=True)
    fs.pipe_file(f"{d}/rank-0.pt", b"x")
    if manifest:
        fs.pipe_file(f"{d}/{layout.MANIFEST}", b"{}")


def test_names_sort_and_parse():
    assert layout.step_dir_name(120) == "step-00000120"
    assert layout.tmp_dir_name(7) == "step-00000007.tmp"
    assert layout.parse_step("step-00000120") == 120
    assert layout.parse_step("step-00000120.tmp") is None
    assert layout.parse_step("latest") is None
    assert sorted([layout.step_dir_name(s) for s in (100, 9, 20)]) == [
        layout.step_dir_name(s) for s in (9, 20, 100)]
    with pytest.raises(ValueError):
        layout.step_dir_name(-1)


def test_only_committed_steps_count(fs_root):
    fs, root = fs_root
    assert layout.committed_steps(fs, root) == []
    _commit(fs, root, 10)
    _commit(fs, root, 30)
    _commit(fs, root, 20, manifest=False)  # crashed before the manifest: not a checkpoint
    fs.makedirs(f"{root}/{layout.tmp_dir_name(40)}", exist_ok=True)
    fs.pipe_file(f"{root}/{layout.tmp_dir_name(40)}/{layout.MANIFEST}", b"{}")
    assert layout.committed_steps(fs, root) == [10, 30]
    assert layout.uncommitted_dirs(fs, root) == [f"{root}/{layout.step_dir_name(20)}",
                                                 f"{root}/{layout.tmp_dir_name(40)}"]


def test_latest_pointer(fs_root):
    fs, root = fs_root
    assert layout.read_latest(fs, root) is None
    fs.makedirs(root, exist_ok=True)
    layout.write_latest(fs, root, 10)
    layout.write_latest(fs, root, 30)
    assert layout.read_latest(fs, root) == 30
    assert not fs.exists(f"{root}/{layout.LATEST}.tmp")


def _names(fs, root):
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))


def test_retention_keeps_the_newest_committed_and_ignores_tmp_in_the_count(fs_root):
    fs, root = fs_root
    for step in (10, 20, 30):
        _commit(fs, root, step)
    _commit(fs, root, 35, manifest=False)  # half-committed (object store): abandoned
    for step in (5, 40):
        fs.makedirs(f"{root}/{layout.tmp_dir_name(step)}", exist_ok=True)
        fs.pipe_file(f"{root}/{layout.tmp_dir_name(step)}/rank-0.pt", b"x")
    removed = layout.apply_retention(fs, root, keep_last=2, committed=38)
    # Two committed are kept although a .tmp is newer; abandoned dirs older than the commit
    # go; step 40's .tmp may be a save other ranks are still writing, so it stays.
    assert _names(fs, root) == ["step-00000020", "step-00000030", "step-00000040.tmp"]
    assert len(removed) == 3
    # Without a commit in progress every abandoned directory goes; keep_last=1 still keeps 30.
    layout.apply_retention(fs, root, keep_last=1)
    assert _names(fs, root) == ["step-00000030"]
    with pytest.raises(ValueError, match="keep_last"):
        layout.apply_retention(fs, root, keep_last=0)


def test_a_second_save_of_a_committed_step_is_a_revision_that_replaces_it_once_committed(fs_root):
    fs, root = fs_root
    _commit(fs, root, 6)
    # Saving step 6 again (the new path after a rollback) must not write over the committed one.
    assert layout.save_dir_name(fs, root, 6) == "step-00000006.1"
    assert layout.save_dir_name(fs, root, 7) == "step-00000007"
    fs.makedirs(f"{root}/step-00000006.1", exist_ok=True)
    fs.pipe_file(f"{root}/step-00000006.1/rank-0.pt", b"new")  # half written: step 6 is the old one
    assert layout.step_dir(fs, root, 6) == f"{root}/step-00000006"
    assert layout.save_dir_name(fs, root, 6) == "step-00000006.1"  # the half-written one is redone
    fs.pipe_file(f"{root}/step-00000006.1/{layout.MANIFEST}", b"{}")
    assert layout.committed_steps(fs, root) == [6]
    assert layout.step_dir(fs, root, 6) == f"{root}/step-00000006.1"
    assert layout.parse_step("step-00000006.1") == 6 and layout.parse_dir("step-00000006.1") == (6, 1)
    layout.write_latest(fs, root, 6, "step-00000006.1")
    assert layout.read_latest(fs, root) == 6
    # Retention after the commit: the replaced revision goes, the new one stays.
    layout.apply_retention(fs, root, keep_last=3, committed=6)
    assert [n for n in _names(fs, root) if n != layout.LATEST] == ["step-00000006.1"]


def test_sweeping_removes_every_uncommitted_directory_and_nothing_committed(fs_root):
    fs, root = fs_root
    _commit(fs, root, 10)
    _commit(fs, root, 20, manifest=False)
    _commit(fs, root, 30, manifest=False)  # newer than every commit: retention would keep it
    fs.makedirs(f"{root}/{layout.tmp_dir_name(5)}", exist_ok=True)
    fs.pipe_file(f"{root}/{layout.tmp_dir_name(5)}/rank-0.pt", b"x")
    removed = layout.sweep_uncommitted(fs, root)
    assert sorted(p.rsplit("/", 1)[-1] for p in removed) == [
        "step-00000005.tmp", "step-00000020", "step-00000030"]
    assert _names(fs, root) == ["step-00000010"]
