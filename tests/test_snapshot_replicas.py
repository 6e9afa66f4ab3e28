"""One copy per shard (issue 39): on an 8-rank CPU job at dp 2 x fsdp 4, the two replicas of each
shard divide its snapshot, so the bytes sent per snapshot are one copy of the state, not two; a
restore from those parts is bitwise (each rank reading its own part and the replicas swapping
theirs over their group, as a worker restores); a snapshot one rank must skip is skipped by all; and the
parts commit as a checkpoint written by two "nodes" at once, restored whole at another layout."""

from __future__ import annotations

import threading

import pytest
import sharded_workers as w
import snapshot_workers as sw
from worlds import run_world

from longrun.checkpoint.commit import LocalCommitLedger
from longrun.checkpoint.memory_commit import commit_snapshots
from longrun.checkpoint.snapshot_blob import read_parts

LAYOUT = {"dp": 2, "fsdp": 4}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """The 8 ranks' rows (see `snapshots_of_replicas`) and the folder of their parts."""
    tmp = tmp_path_factory.mktemp("replicas")
    (tmp / "ckpt").mkdir()
    root = str(tmp / "ckpt")
    rows = run_world(sw.snapshots_of_replicas, 8, tmp, args=(LAYOUT, root), timeout=600)
    return rows, tmp


def test_replicas_send_one_copy_of_the_state_and_restore_it_bitwise(replicas):
    rows, _ = replicas
    by_rank = {row[0]: row for row in rows}
    assert sorted(by_rank) == list(range(8))
    for rank, sent, skipped, *_ in rows:
        # Step 2 was due while rank 0's first send was held: every rank skipped it.
        assert (sent, skipped) == ([1, 3], 1), (rank, sent, skipped)
    # dp is outermost: rank r and r + 4 hold the same fsdp shard, parts 0 and 1 of it.
    assert {r: by_rank[r][3] for r in range(8)} == {r: r // 4 for r in range(8)}
    one_copy = sum(row[5] for row in rows if row[3] == 0)  # each shard's model and optimizer once
    assert sum(row[4] for row in rows) == one_copy  # the parts' shares: one copy, not two
    assert sum(row[6] for row in rows) < 1.5 * one_copy  # whole blobs, each with its own values
    assert all(row[7] for row in rows), "a restored state differs from the trained one"
    # A worker's restore: each rank reads its own blob only; the parts swapped over the replicas'
    # group give the same state, bit for bit.
    assert all(row[8] for row in rows), "a state restored by swapping parts differs from the trained one"
    assert {row[0]: row[9] for row in rows} == {r: [r] for r in range(8)}
    # Rank 4 offered step 1's part: it and its replica (rank 0) refused, on both sides; no other did.
    refused = {row[0]: row[10] for row in rows if row[10] is not None}
    assert sorted(refused) == [0, 4], refused
    assert all("step 1" in why for why in refused.values()), refused


def test_replicas_parts_commit_from_two_nodes_at_once_and_restore_whole(replicas, redis_server):
    _, tmp = replicas
    root = str(tmp / "ckpt")
    cfg = w.layout_config(LAYOUT, 8, checkpoint={"dir": root}, training={"steps": 3})

    def get(rank: int):
        return (tmp / f"part-{rank}-3.bin").read_bytes(), (tmp / f"part-{rank}-3.digest").read_text()

    def read(rank: int) -> dict:
        state, where, header = read_parts(rank, get, full=None)  # replicas' parts for part 0 only
        return {"state": state, "where": where, "part": header["part"][0]}

    ledger, failures = LocalCommitLedger(), []

    def node(ranks: list[int]) -> None:
        try:
            commit_snapshots(cfg, 3, read, ranks=ranks, ledger=ledger)
        except Exception as exc:
            failures.append(exc)

    nodes = [threading.Thread(target=node, args=(ranks,)) for ranks in ([0, 1, 2, 3], [4, 5, 6, 7])]
    for t in nodes:
        t.start()
    for t in nodes:
        t.join(300)
    assert failures == []
    (tmp / "restore").mkdir()
    (row,) = run_world(w.restore_at_layout, 1, tmp / "restore", args=({}, redis_server.url, root, "sharded"))
    rank, step, same, _, _, resharded, skipped = row
    assert (rank, step, resharded, skipped) == (0, 3, True, [])
    assert same, "the restored state differs from the snapshotted one"
