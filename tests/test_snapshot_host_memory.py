"""Peer memory snapshots and the host (issue 26, holes 3 and 4; issue 39): the budget counts every
copy a node holds and is checked before anything is allocated; the worker makes one copy, the
blob it sends; a slow keeper costs snapshots (skipped, counted), never a stalled step."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from longrun.checkpoint.memory import HOST_COPIES_PER_RANK, MemorySnapshots, read_snapshot, state_bytes


def _trainer(step: int = 1):
    trainer = SimpleNamespace(step=step)
    weights = {"w": torch.arange(1024.0), "b": torch.ones(16)}
    trainer.state_dict = lambda: {"step": trainer.step, "model": weights}
    return trainer


def test_over_budget_snapshots_turn_off_before_any_host_buffer_is_allocated(monkeypatch):
    trainer = _trainer()
    size = state_bytes(trainer.state_dict())
    allocated: list[int] = []
    real_empty = torch.empty

    def spying_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.numel() * t.element_size() >= 1024:  # a host buffer, not a header's scratch
            allocated.append(t.numel() * t.element_size())
        return t

    monkeypatch.setattr(torch, "empty", spying_empty)
    sent = []
    # Room for the keepers' copies, not for every copy the node holds.
    snaps = MemorySnapshots(lambda *a: sent.append(a), every=1, host_budget_bytes=4 * size)
    assert not snaps.take(trainer) and not snaps.enabled
    assert allocated == [] and snaps.buffer.nbytes == 0 and sent == []


def test_a_snapshot_in_budget_is_one_copy_of_exactly_its_size_sent_as_is():
    trainer = _trainer()
    size = state_bytes(trainer.state_dict())
    got = []
    snaps = MemorySnapshots(lambda step, blob, digest: got.append((step, blob, digest)), every=1,
                            host_budget_bytes=HOST_COPIES_PER_RANK * size)
    assert snaps.take(trainer)
    snaps.wait()
    (step, blob, digest), = got
    assert step == 1 and snaps.buffer.nbytes == size  # allocated: what is used, no more
    # What is sent is the buffer itself (no BytesIO, getvalue or other copy in between).
    assert np.shares_memory(np.asarray(blob), snaps.buffer._flat.numpy())
    state = read_snapshot(blob, digest)
    assert state["step"] == 1 and torch.equal(state["model"]["w"], torch.arange(1024.0))
    trainer.step = 2  # the next one reuses the buffer
    flat = snaps.buffer._flat
    assert snaps.take(trainer)
    snaps.wait()
    assert snaps.buffer._flat is flat and read_snapshot(got[1][1], got[1][2])["step"] == 2


def test_a_snapshot_due_while_the_previous_is_sent_is_skipped_and_counted_never_waited_for():
    """Issue 39: the step goes on at once; the snapshot it was due is skipped and counted."""
    release, sent, dropped = threading.Event(), [], []

    def send(step, blob, digest):
        if step == 1:  # a keeper that does not answer until the test says so
            release.wait(30)  # (bounded only so that a take that waits fails instead of hanging)
        sent.append(read_snapshot(blob, digest)["step"])

    snaps = MemorySnapshots(send, every=1, on_drop=lambda step, why: dropped.append((step, why)))
    trainer = _trainer()
    assert snaps.take(trainer) and snaps.busy
    trainer.step = 2
    assert not snaps.take(trainer)  # skipped: its send is held until after this returned
    assert not release.is_set() and sent == []  # so it did not wait for the first send
    assert snaps.skipped == snaps.dropped == 1 and snaps.enabled
    assert dropped == [(2, "this rank's previous snapshot is still being sent")]
    release.set()
    snaps.wait()
    trainer.step = 3
    assert snaps.take(trainer)  # training went on, and so do the snapshots
    snaps.wait()
    assert sent == [1, 3] and snaps.taken == 2


def test_a_send_gives_up_on_keepers_that_take_no_chunk(monkeypatch):
    from longrun.checkpoint.snapshot_blob import chunk_digest
    from longrun.worker import snapshot_transfer as transfer

    waits, cancelled = [], []

    class Keeper:
        put_chunk = SimpleNamespace(remote=lambda *args: object())

    def wait(refs, num_returns, timeout=None):
        waits.append(timeout)
        if timeout is None:
            raise AssertionError("waited on the keepers without a timeout")
        return [], refs  # nothing taken in time

    monkeypatch.setattr(transfer.ray, "get_actor", lambda name, namespace=None: Keeper())
    monkeypatch.setattr(transfer.ray, "put", lambda chunk: object())
    monkeypatch.setattr(transfer.ray, "wait", wait)
    monkeypatch.setattr(transfer.ray, "cancel", cancelled.append)
    send = transfer.snapshot_sender(0, ["a", "b"], timeout_s=1.5)
    blob = bytes(range(256)) * 4
    with pytest.raises(transfer.SendTimeout, match=r"1\.5 s"):
        send(1, blob, chunk_digest(blob, chunk_bytes=64))  # 16 chunks: the window fills first
    assert waits == [1.5] and len(cancelled) == 2 * (transfer.WINDOW + 1)


def test_a_send_is_sized_to_its_nodes_object_store():
    """The hour soak at 512 MB: 64 MiB chunks, four in flight to each of two keepers, filled a
    test node's 150 MiB object store; it spilled to disk while the put that filled it waited, and
    ranks went silent long enough to be declared dead. Chunks and window now fit the store."""
    from longrun.checkpoint.snapshot_blob import CHUNK_BYTES
    from longrun.worker.snapshot_transfer import STORE_SHARE, WINDOW, transfer_sizes

    assert transfer_sizes(None) == (CHUNK_BYTES, WINDOW)  # not known: the largest
    assert transfer_sizes(64 << 30) == (CHUNK_BYTES, WINDOW)  # a real node's store: the largest
    for store in (150 << 20, 1 << 30, 40 << 20):
        chunk, window = transfer_sizes(store)
        assert chunk % (1 << 20) == 0 and 1 <= window <= WINDOW
        assert chunk * window <= store * STORE_SHARE, store


def test_a_send_keeps_no_more_than_its_window_in_flight(monkeypatch):
    from longrun.checkpoint.snapshot_blob import chunk_digest
    from longrun.worker import snapshot_transfer as transfer

    in_flight, most = set(), [0]

    class Keeper:
        @staticmethod
        def _put(*args):
            ref = object()
            in_flight.add(ref)
            most[0] = max(most[0], len(in_flight))
            return ref
        put_chunk = SimpleNamespace(remote=_put)

    def wait(refs, num_returns, timeout=None):
        done = refs[:num_returns]  # the oldest finish first
        in_flight.difference_update(done)
        return done, refs[num_returns:]

    monkeypatch.setattr(transfer.ray, "get_actor", lambda name, namespace=None: Keeper())
    monkeypatch.setattr(transfer.ray, "put", lambda chunk: object())
    monkeypatch.setattr(transfer.ray, "wait", wait)
    monkeypatch.setattr(transfer.ray, "get", lambda ref: None)
    send = transfer.snapshot_sender(0, ["a", "b"], timeout_s=5, window=2)
    blob = bytes(range(256)) * 4
    send(1, blob, chunk_digest(blob, chunk_bytes=64))  # 16 chunks to two keepers
    assert not in_flight and most[0] == 2 * (2 + 1)  # the window, plus the chunk just handed out
