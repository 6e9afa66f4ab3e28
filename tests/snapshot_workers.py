"""Spawned ranks for tests/test_snapshot_commit.py and tests/test_snapshot_replicas.py: sharded
training whose memory snapshots are kept in files, to be restored from at the same layout, or
committed as a checkpoint by the test and restored at another layout."""

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


def snapshots_of_replicas(rank: int, world: int, init_file: str, results, parallelism: dict,
                          root: str) -> None:
    """Issue 39: train 3 steps at `parallelism`, a memory snapshot due at each, each rank sending
    its part of its shard (`root`/../part-<rank>-<step>.bin and its digest). Rank 0's first send
    is held until every rank has tried the second snapshot: all must skip it. Then a fresh
    trainer per rank restores step 3 from its own and its replicas' parts. Reports what each
    rank sent and skipped, its parts' sizes, and whether the restored state equals the trained
    one, bit for bit; rank 0 keeps the whole state in `root`/../saved.pt."""
    try:
        dist = _join(rank, world, init_file)
        import threading

        import torch

        from longrun.checkpoint.memory import MemorySnapshots
        from longrun.checkpoint.sharding import globalize
        from longrun.checkpoint.snapshot_blob import SnapshotError, read_header, read_parts
        from longrun.commgroup import form_groups, single_node_layout
        from longrun.worker.snapshots import job_max, replica_exchange, snapshot_part

        cfg = layout_config(parallelism, world, checkpoint={"dir": root}, training={"steps": 3})
        groups = form_groups(single_node_layout(cfg.dims), rank)
        held, sent = threading.Event(), []

        def send(step, blob, digest):
            if rank == 0 and step == 1:  # a slow keeper, released once every rank tried step 2
                held.wait(120)
            with open(f"{root}/../part-{rank}-{step}.bin", "wb") as f:
                f.write(blob)
            with open(f"{root}/../part-{rank}-{step}.digest", "w") as f:
                f.write(digest)
            sent.append(step)

        snaps = MemorySnapshots(send, every=1, part=snapshot_part(rank, groups.ranks["replicate"]),
                                agree=job_max(groups.world))

        def after(m) -> None:
            snaps.take(trainer)
            if trainer.step == 2:  # step 2 tried on every rank (its agreement is collective)
                held.set()
                snaps.wait()  # so that step 3 finds no send running, whatever the timing

        with _trainer(cfg, groups) as trainer:
            trainer.before_update.append(snaps.before_update)
            trainer.train(on_step=after)
            snaps.wait()
            full = _full_state(trainer)
        if rank == 0:
            torch.save(full, f"{root}/../saved.pt")

        def get(r: int):
            with open(f"{root}/../part-{r}-3.bin", "rb") as f:
                blob = f.read()
            with open(f"{root}/../part-{r}-3.digest") as f:
                return blob, f.read()

        dist.barrier()  # every rank's parts are written
        header = read_header(get(rank)[0])
        with _trainer(cfg, groups) as fresh:
            state, _, _ = read_parts(rank, get)
            fresh.load_state_dict(globalize(state, fresh.state_dict()))
            got = _full_state(fresh)
        plain = ("step", "data", "scheduler")

        def equal(got) -> bool:
            return (got["tensors"].keys() == full["tensors"].keys()
                    and all(torch.equal(got["tensors"][k], full["tensors"][k]) for k in full["tensors"])
                    and [got[k] for k in plain] == [full[k] for k in plain])

        same = equal(got)
        # The restore a worker does: its own blob only, the replicas' parts swapped over their group.
        asked = []

        def own_only(r: int):
            asked.append(r)
            return get(r)

        with _trainer(cfg, groups) as fresh:
            state, _, _ = read_parts(rank, own_only, exchange=replica_exchange(groups.replicate))
            fresh.load_state_dict(globalize(state, fresh.state_dict()))
            exchanged = equal(_full_state(fresh))
        # A replica holding another step's part: its whole replica group refuses, the others go on.
        stale = "1" if rank == 4 else "3"

        def maybe_stale(r: int):
            with open(f"{root}/../part-{r}-{stale}.bin", "rb") as f:
                blob = f.read()
            with open(f"{root}/../part-{r}-{stale}.digest") as f:
                return blob, f.read()

        try:
            read_parts(rank, maybe_stale, exchange=replica_exchange(groups.replicate))
            refused = None
        except SnapshotError as exc:
            refused = str(exc)
        results.put((rank, sent, snaps.skipped, header["part"][0], header["range"][1] - header["range"][0],
                     header["shared_bytes"], len(get(rank)[0]), same, exchanged, asked, refused))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
