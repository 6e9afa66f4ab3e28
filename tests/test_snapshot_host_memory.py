"""Peer memory snapshots and the host (issue 26, holes 3 and 4): the budget counts every copy a
node holds and is checked before anything is allocated; the worker makes one copy, the blob it
sends; a slow keeper costs snapshots (dropped, counted), never a stalled step."""

from __future__ import annotations

import threading
import time
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


def test_a_slow_keeper_drops_snapshots_but_never_holds_a_step():
    release, sent, dropped = threading.Event(), [], []

    def send(step, blob, digest):
        if step == 1:
            assert release.wait(60), "never released"
        sent.append(read_snapshot(blob, digest)["step"])

    snaps = MemorySnapshots(send, every=1, wait_s=0.2, on_drop=lambda step, why: dropped.append(step))
    trainer = _trainer()
    assert snaps.take(trainer)  # its send hangs (a keeper that does not answer)
    trainer.step = 2
    started = time.monotonic()
    assert not snaps.take(trainer)  # dropped after waiting wait_s, not held until the send ends
    assert time.monotonic() - started < 30  # the bound is wait_s: far below, even on a loaded machine
    assert dropped == [2] and snaps.dropped == 1 and snaps.enabled
    release.set()
    snaps.wait()
    trainer.step = 3
    assert snaps.take(trainer)  # training went on, and so do the snapshots
    snaps.wait()
    assert sent == [1, 3]


def test_a_send_gives_up_on_keepers_that_do_not_take_it(monkeypatch):
    from longrun.worker import snapshots

    waits = []

    class Keeper:
        put = SimpleNamespace(remote=lambda *args: object())

    def get(refs, timeout=None):
        waits.append(timeout)
        if timeout is None:
            raise AssertionError("waited on the keepers without a timeout")
        raise snapshots.ray.exceptions.GetTimeoutError("not in time")

    monkeypatch.setattr(snapshots.ray, "get_actor", lambda name: Keeper())
    monkeypatch.setattr(snapshots.ray, "put", lambda blob: object())
    monkeypatch.setattr(snapshots.ray, "get", get)
    monkeypatch.setattr(snapshots.ray, "cancel", lambda ref: None)
    send = snapshots.snapshot_sender(0, ["a", "b"], timeout_s=1.5)
    with pytest.raises(snapshots.SendTimeout, match=r"1\.5 s"):
        send(1, b"blob", "digest")
    assert waits == [1.5]
