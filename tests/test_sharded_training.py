"""Sharded training on gloo: FSDP2, HSDP, tensor (and sequence) parallel, their compositions
with each other and with (dynamic) context parallelism give the loss and gradients of one
process, hold a piece of each weight per rank, and resume bitwise from their own checkpoints."""

from __future__ import annotations

import fsspec
import pytest
import sharded_workers as w
import torch
from worlds import run_world

from longrun.checkpoint.catalog import load_model_weights
from longrun.checkpoint.dcp_format import METADATA_FILE, data_file_name
from longrun.checkpoint.manifest import TRAIN_STATE, rank_shard_name
from longrun.checkpoint.restore import read_manifest

# (parallelism, the share of the parameters each rank holds)
LAYOUTS = {
    "fsdp4": ({"fsdp": 4}, 1 / 4),
    "hsdp2x2": ({"dp": 2, "fsdp": 2}, 1 / 2),
    "tp2xfsdp2": ({"fsdp": 2, "tp": 2}, 1 / 4),
    "tp2xcp2-ring": ({"cp": 2, "tp": 2}, 1 / 2),
    "tp2xdp2": ({"dp": 2, "tp": 2}, 1 / 2),
    "fsdp2xdynamic-cp": ({"fsdp": 2, "cp": 2, "dynamic_cp": True}, 1 / 2),
}
DEFAULT_RESUMES = ("fsdp4", "tp2xfsdp2", "fsdp2xdynamic-cp")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gradients_equal_one_process(name, tmp_path):
    parallelism, share = LAYOUTS[name]
    out = run_world(w.gradients_match_one_process, 4, tmp_path, args=(parallelism, "none"))
    for rank, loss, ref_loss, worst_rel_err, params, grads in out:
        assert worst_rel_err < 1e-5, (rank, worst_rel_err)
        assert loss == pytest.approx(ref_loss, rel=1e-5), rank
        # Each rank holds its piece of every parameter and gradient (uneven splits: a few rows).
        assert share * 0.9 < params < share * 1.15, (rank, params)
        assert share * 0.9 < grads < share * 1.15, (rank, grads)


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_activation_checkpointing_keeps_the_gradients(ac, tmp_path):
    """Recomputing a block in backward (whole, or its cheap ops) changes no gradient, composed
    with TP x FSDP."""
    out = run_world(w.gradients_match_one_process, 4, tmp_path, args=({"fsdp": 2, "tp": 2}, ac))
    for rank, loss, ref_loss, worst_rel_err, *_held in out:
        assert worst_rel_err < 1e-5, (rank, worst_rel_err)
        assert loss == pytest.approx(ref_loss, rel=1e-5), rank


# By default one layout per kind of piece (FSDP shards, TP x FSDP boxes, CP with FSDP); the other
# compositions are `slow` (their gradients are still checked by default, above).
@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in DEFAULT_RESUMES else pytest.mark.slow)
                                  for n in LAYOUTS])
def test_each_layout_resumes_bitwise_from_its_own_checkpoint(name, tmp_path, redis_server):
    parallelism, _ = LAYOUTS[name]
    root = str(tmp_path / "ckpt")
    out = run_world(w.resume_from_own_checkpoint, 4, tmp_path,
                    args=(parallelism, redis_server.url, root, f"resume-{name}"))
    assert [(rank, step, bitwise) for rank, step, bitwise, *_ in out] == [(r, 2, True) for r in range(4)]
    # Each piece of the weights written once, by the first rank of its replica group: one data
    # file per piece; one RNG file per rank.
    pieces = sorted({shard for *_, shard, _ in out})
    writers = sorted(rank for rank, _, _, _, replica_rank in out if replica_rank == 0)
    fs, base = fsspec.core.url_to_fs(root)
    manifest = read_manifest(fs, base, 2)
    assert sorted(manifest.files) == sorted([METADATA_FILE, TRAIN_STATE]
                                            + [data_file_name(r) for r in writers]
                                            + [rank_shard_name(r) for r in range(4)])
    degree = parallelism.get("fsdp", 1) * parallelism.get("tp", 1)
    assert len(pieces) == len(writers) == degree
    assert manifest.layout["fsdp"] == parallelism.get("fsdp", 1)
    assert manifest.layout["tp"] == parallelism.get("tp", 1)
    # The pieces put back together are the whole weights of the run, bit for bit.
    whole = load_model_weights(fs, base, 4, read_manifest(fs, base, 4))
    straight = torch.load(tmp_path / "straight.pt", weights_only=True)
    assert whole.keys() == straight.keys()
    assert all(torch.equal(whole[k], straight[k]) for k in straight)


def test_calibrating_dynamic_cp_leaves_no_gradient_behind(tmp_path):
    """HSDP over the CP ranks: calibration passes are no step's last micro-batch; a run that
    calibrated must train exactly like a run that loaded the calibration."""
    out = run_world(w.calibrated_then_loaded, 4, tmp_path, args=({"fsdp": 2, "cp": 2, "dynamic_cp": True},
                                                                 str(tmp_path / "calibration")))
    assert out == [(rank, True, True) for rank in range(4)]


def test_a_corrupted_piece_falls_back_to_the_previous_checkpoint(tmp_path, redis_server):
    """A flipped byte in the last piece of the newest checkpoint (TP 2 x FSDP 2): every rank
    falls back to the step before, and the run still ends bitwise equal to the straight one."""
    out = run_world(w.resume_from_own_checkpoint, 4, tmp_path,
                    args=({"fsdp": 2, "tp": 2}, redis_server.url, str(tmp_path / "ckpt"), "corrupt", True))
    assert [(rank, step, bitwise) for rank, step, bitwise, *_ in out] == [(r, 2, True) for r in range(4)]


def test_a_sharded_layout_resumes_bitwise_from_memory_snapshots(tmp_path):
    """TP 2 x FSDP 2: each rank's snapshot holds its own pieces, and they go back where they were."""
    out = run_world(w.resume_from_memory_snapshot, 4, tmp_path, args=({"fsdp": 2, "tp": 2},))
    assert out == [(rank, True) for rank in range(4)]
