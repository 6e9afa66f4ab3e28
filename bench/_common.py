"""What the bench scripts share (not a bench itself): progress lines, argument parsing, free ports.

The scripts run as `python bench/NAME.py`, so bench/ is first on sys.path (in the processes
they spawn too) and `import _common` finds this file."""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys
from collections.abc import Callable


def logger(name: str) -> Callable[[str], None]:
    """Progress goes to stderr, prefixed with the bench's name; stdout ends with the JSON line."""

    def log(msg: str) -> None:
        print(f"[{name}] {msg}", file=sys.stderr, flush=True)

    return log


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser whose --help prints the script's docstring as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def listen_port() -> int:
    """A free port below the ephemeral range. Ports picked now and bound later (say a TCPStore
    per repeat) must not be taken in between by the thousands of outgoing connections gloo
    opens, which draw from the ephemeral range."""
    low = 20000
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = min(low, int(f.read().split()[0]) - 2000)
    except OSError:
        pass
    for _ in range(1000):
        port = random.randrange(max(low - 8000, 1024), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port below the ephemeral range")


def evict(path: str) -> None:
    """Drop the (clean, fsynced) pages of every file under `path` from the page cache, so the
    next read comes from the disk. No root needed."""
    for dirpath, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def packed_micro_batches(tokens: int, count: int, seed: int = 11) -> list:
    """`count` micro-batches of exactly `tokens` tokens each, packed from documents of
    log-normal lengths (a quarter of the budget on average): the same in every process."""
    import numpy as np

    from longrun.data.packing import build_micro_batch

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        docs, left = [], tokens
        while left > 0:
            n = int(min(left, max(2, rng.lognormal(np.log(tokens / 4), 0.8))))
            docs.append(rng.integers(0, 256, size=n))
            left -= n
        out.append(build_micro_batch(docs))
    return out
