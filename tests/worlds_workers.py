"""Targets for tests/test_worlds.py (imported by spawned children); torch-free, so they start fast."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path


def report(rank, world, init_file, results, per_rank=1):
    """Put `per_rank` results naming this rank, the world and this process."""
    for i in range(per_rank):
        results.put((rank, i, world, init_file, os.getpid()))


def hold(rank, world, init_file, results):
    """Say it is up, then stay silent until killed."""
    results.put((rank, "up", os.getpid()))
    threading.Event().wait()


def die(rank, world, init_file, results):
    """Say it is up, then die from SIGKILL, unplanned by the parent."""
    results.put((rank, "up", os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)


def fail(rank, world, init_file, results):
    raise ValueError(f"rank {rank} cannot go on")


def quiet(rank, world, init_file, results):
    """Return without putting anything."""


def flood(rank, world, init_file, results):
    """Say it is up, then send 1 MiB results for ever: with a pipe's 64 KiB buffer and no reader,
    it is almost always in the middle of a send when it is killed."""
    results.put((rank, "up", os.getpid()))
    while True:
        results.put((rank, "flood", b"x" * 2**20))


def report_when_released(rank, world, init_file, results, release_file):
    """Say it is up; report once `release_file` exists (the parent creates it after a kill)."""
    results.put((rank, "up", os.getpid()))
    while not Path(release_file).exists():
        time.sleep(0.01)  # polling for the parent's signal, not standing in for it
    results.put((rank, "released", os.getpid()))


def environment(rank, world, init_file, results, name):
    """Report the value of environment variable `name` in this rank, and where it runs."""
    results.put((rank, os.environ.get(name), os.getcwd(), os.getpid()))
