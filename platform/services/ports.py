"""Free TCP ports on loopback, for servers longrun starts (Redis, the Ray head) and tests.

A port is chosen now and bound later, often by another process, so something else may take it
in between. The kernel hands out its ephemeral range (32768-60999 by default) to every
outgoing connection and every bind to port 0, and a starting Ray cluster opens hundreds of
connections: a port chosen there by a bind to 0 was taken in between in a suite run (2026-11-29,
`Address already in use` when a job's controller bound the metrics port a test had chosen for
it). So ports are chosen, at random, below the ephemeral range and above Ray's worker ports
(10002-19999): nothing there is handed out behind anyone's back.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 20000  # above Ray's default worker ports (min_worker_port 10002, max_worker_port 19999)
EPHEMERAL_DEFAULT = (32768, 60999)
_rng = random.SystemRandom()  # no seed shared with a forked sibling: two pickers rarely meet


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral ports (Linux's ip_local_port_range), inclusive."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT


def _candidates() -> list[int]:
    """Ports below the ephemeral range and from LOWEST up, in random order; [] where the range
    leaves none (a kernel configured so: the kernel's choice it is)."""
    ports = list(range(LOWEST, ephemeral_range()[0]))
    _rng.shuffle(ports)
    return ports


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that were free a moment ago, outside the kernel's ephemeral range.
    All are held open until all are chosen (a port closed a moment ago may be chosen again)."""
    held: list[socket.socket] = []
    try:
        for port in _candidates():
            if len(held) == count:
                break
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((host, port))
            except OSError:  # in use (or in TIME_WAIT): the next one
                sock.close()
                continue
            held.append(sock)
        while len(held) < count:  # no room outside the ephemeral range: let the kernel choose
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            held.append(sock)
        return [sock.getsockname()[1] for sock in held]
    finally:
        for sock in held:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, outside the kernel's ephemeral range. Callers that
    bind it later retry on a clash."""
    return free_ports(1, host)[0]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
