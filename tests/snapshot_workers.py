"""Spawned ranks for tests/test_snapshot_commit.py: sharded training whose memory snapshots are
kept in files, to be committed as a checkpoint by the test and restored at another layout."""

from __future__ import annotations

import traceback

from sharded_workers import _full_state, _trainer, layout_config
from trainer_workers import _join


def snapshot_at_layout(rank: int, world: int, init_file: str, results, parallelism: dict, root: str,
                       steps: int) -> None:
    """Train `steps` steps at `parallelism`; this rank's memory snapshot goes to
    `root`/../snapshot-<rank>.bin (its digest beside it); rank 0 keeps the whole state (gathered)
    in `root`/../saved.pt, as `save_at_layout` does for a storage checkpoint."""
    try:
        dist = _join(rank, world, init_file)
        import torch

        from longrun.checkpoint.memory import serialize
        from longrun.checkpoint.sharding import localize
        from longrun.commgroup import form_groups, single_node_layout

        cfg = layout_config(parallelism, world, checkpoint={"dir": root}, training={"steps": steps})
        groups = form_groups(single_node_layout(cfg.dims), rank)
        with _trainer(cfg, groups) as trainer:
            trainer.train()
            blob, digest = serialize(*localize(trainer.state_dict()))
            full = _full_state(trainer)
        with open(f"{root}/../snapshot-{rank}.bin", "wb") as f:
            f.write(blob)
        with open(f"{root}/../snapshot-{rank}.sha256", "w") as f:
            f.write(digest)
        if rank == 0:
            torch.save(full, f"{root}/../saved.pt")
        results.put((rank, "saved"))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
