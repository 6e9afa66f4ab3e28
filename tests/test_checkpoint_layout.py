"""The checkpoint directory layout: only directories with a manifest and no .tmp count."""

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
    assert layout.abandoned_tmp_dirs(fs, root) == [f"{root}/{layout.tmp_dir_name(40)}"]


def test_latest_pointer(fs_root):
    fs, root = fs_root
    assert layout.read_latest(fs, root) is None
    fs.makedirs(root, exist_ok=True)
    layout.write_latest(fs, root, 10)
    layout.write_latest(fs, root, 30)
    assert layout.read_latest(fs, root) == 30
    assert not fs.exists(f"{root}/{layout.LATEST}.tmp")
