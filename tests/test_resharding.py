"""Resharding restore: a checkpoint written at one layout loads at another (other FSDP degree,
HSDP, tensor parallel, another world size), each rank reading only the records its pieces
overlap; the whole state it ends with is the saved one, bit for bit. And the files are torch's
distributed-checkpoint format: `torch.distributed.checkpoint.load` reads them as they are."""

from __future__ import annotations

import fsspec
import pytest
import sharded_workers as w
import torch
from worlds import run_world

from longrun.checkpoint.catalog import load_model_weights
from longrun.checkpoint.dcp_format import data_file_name
from longrun.checkpoint.restore import read_manifest

FSDP4 = {"fsdp": 4}
TARGETS = {"fsdp2": ({"fsdp": 2}, 2), "hsdp2x2": ({"dp": 2, "fsdp": 2}, 4),
           "tp2xfsdp2": ({"fsdp": 2, "tp": 2}, 4),
           # Whole weights on one rank: the names are the same as the pieces' (issue 18's shrink
           # to one node ends here).
           "whole": ({}, 1)}


def _world_dir(tmp_path, name):
    """A directory of its own for each world (its rendezvous file lives there)."""
    path = tmp_path / name
    path.mkdir(exist_ok=True)
    return path


def _save(tmp_path, parallelism, world, redis_url, job, interval=3):
    root = str(tmp_path / "ckpt")
    out = run_world(w.save_at_layout, world, _world_dir(tmp_path, "save"),
                    args=(parallelism, redis_url, root, job, interval))
    assert out == [(r, "saved") for r in range(world)]
    return root


def _restore_rows(tmp_path, parallelism, world, root, redis_url, job):
    return run_world(w.restore_at_layout, world, _world_dir(tmp_path, "restore"),
                     args=(parallelism, redis_url, root, job))


def _restore(tmp_path, parallelism, world, root, redis_url, job):
    out = _restore_rows(tmp_path, parallelism, world, root, redis_url, job)
    assert [(rank, step, same) for rank, step, same, *_ in out] == [(r, 3, True) for r in range(world)]
    return out


# By default: to TP x FSDP (boxes cut both ways) and to whole weights on one rank (the shrink to one
# node); FSDP 2 and HSDP 2x2 are `slow`.
@pytest.mark.parametrize("target", [pytest.param(name, marks=[] if name in ("tp2xfsdp2", "whole")
                                                  else pytest.mark.slow) for name in TARGETS])
def test_fsdp4_restores_at_another_layout_bitwise(target, tmp_path, redis_server):
    root = _save(tmp_path, FSDP4, 4, redis_server.url, f"to-{target}")
    parallelism, world = TARGETS[target]
    out = _restore(tmp_path, parallelism, world, root, redis_server.url, f"to-{target}")
    assert all(resharded and skipped == [] for *_, resharded, skipped in out)
    if world == 1:
        return
    # Only the first rank of each replica group reads; the others get the pieces by broadcast.
    for rank, _, _, read, replica_rank, *_ in out:
        assert (read > 0) == (replica_rank == 0), (rank, read, replica_rank)


# Every direction is a few worlds of 4 ranks; tensor parallel x FSDP, the one that cuts the
# weights in two dimensions, runs by default, the others are in the slow set.
@pytest.mark.parametrize("source", [pytest.param(name, marks=[] if name == "tp2xfsdp2" else pytest.mark.slow)
                                    for name in TARGETS])
def test_another_layout_restores_at_fsdp4_bitwise(source, tmp_path, redis_server):
    parallelism, world = TARGETS[source]
    root = _save(tmp_path, parallelism, world, redis_server.url, f"from-{source}")
    out = _restore(tmp_path, FSDP4, 4, root, redis_server.url, f"from-{source}")
    # FSDP 4: each rank holds a quarter of every tensor and reads only the records it overlaps,
    # far less than the checkpoint holds (a record is the unit: whole tensors, written by one
    # rank, are read whole by every rank that holds a slice of them).
    fs, base = fsspec.core.url_to_fs(root)
    total = sum(info.bytes for name, info in read_manifest(fs, base, 3).files.items()
                if name.endswith(".distcp"))
    for rank, _, _, read, *_ in out:
        assert 0 < read <= total, (rank, read, total)
        if world > 1:
            assert read < 0.75 * total, (rank, read, total)


def test_the_checkpoint_loads_with_torch_distributed_checkpoint_as_is(tmp_path, redis_server):
    """`dcp.load` with DCP's own FileSystemReader, no longrun code on the read path: the model
    weights and AdamW moments of a TP 2 x FSDP 2 checkpoint, whole, in one process."""
    import torch.distributed.checkpoint as dcp

    root = _save(tmp_path, {"fsdp": 2, "tp": 2}, 4, redis_server.url, "dcp-load")
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)["tensors"]
    fs, base = fsspec.core.url_to_fs(root)
    step_dir = f"{base}/step-00000003"
    target = {name: torch.zeros_like(t) for name, t in saved.items()}
    dcp.load(target, checkpoint_id=step_dir, no_dist=True)
    assert all(torch.equal(target[k], saved[k]) for k in saved)
    assert any(k.startswith("optimizer.") and k.endswith("exp_avg") for k in saved)
    # The export path reads the same pieces put together.
    whole = load_model_weights(fs, base, 3, read_manifest(fs, base, 3))
    assert all(torch.equal(whole[k], saved[f"model.{k}"]) for k in whole)


def test_a_corrupted_record_of_the_new_layouts_reads_falls_back(tmp_path, redis_server):
    """Checkpoints at steps 1, 2 and 3 at FSDP 4; a byte flipped in the middle of rank 3's file
    of step 3: an FSDP 2 restore finds it (the rank reading that record) and every rank falls
    back to step 2."""
    root = _save(tmp_path, FSDP4, 4, redis_server.url, "corrupt-reshard", interval=1)
    fs, base = fsspec.core.url_to_fs(root)
    path = f"{base}/step-00000003/{data_file_name(3)}"
    raw = bytearray(fs.cat_file(path))
    raw[len(raw) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(raw))
    out = _restore_rows(tmp_path, {"fsdp": 2}, 2, root, redis_server.url, "corrupt-reshard")
    assert [(rank, step, skipped) for rank, step, *_, skipped in out] == [(r, 2, [3]) for r in range(2)]
