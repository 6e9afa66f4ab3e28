"""Checksums of what a checkpoint or a memory snapshot holds: xxHash3, computed on the bytes as
they are written or read, never in a pass of their own.

    h = hasher()                    # xxh3_128
    h.update(chunk); ...
    digest = tagged(h)              # "xxh3_128:9b1f..."
    verifier(digest).update(...)    # the hasher a stored digest was made with (SHA-256 for old ones)

Why not SHA-256, which longrun used first: a checksum here guards against torn writes, bit rot
and a wrong file, not against an adversary (the files are ours, loaded with
`weights_only=True`), and SHA-256 in one thread ran at 0.38 GB/s on this machine, the speed at
which every save committed and every restore read. xxh3_128 ran at 8.9 GB/s on the same bytes
(the `xxhash` package's C implementation), so hashing hides behind the disk instead of setting
its pace. 128 bits keep collisions out of reach at any number of files.

A digest names its algorithm ("xxh3_128:<hex>"); a bare 64-hex digest is a SHA-256 from a
checkpoint written before, which still verifies.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import xxhash

ALGORITHM = "xxh3_128"
LEGACY = "sha256"  # untagged digests: what longrun wrote before xxh3


class Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


def hasher() -> Hasher:
    """A fresh hasher of the current algorithm."""
    return xxhash.xxh3_128()


def tagged(h: Hasher) -> str:
    """The digest of `h` with its algorithm's name ("xxh3_128:<hex>")."""
    return f"{ALGORITHM}:{h.hexdigest()}"


def digest(data: bytes | bytearray | memoryview) -> str:
    """The tagged digest of `data`."""
    h = hasher()
    h.update(data)
    return tagged(h)


def algorithm_of(stored: str) -> str:
    """Which algorithm made a stored digest."""
    name, sep, _ = stored.partition(":")
    return name if sep else LEGACY


def verifier(stored: str) -> Hasher:
    """A fresh hasher of the algorithm that made `stored`, to check bytes against it."""
    name = algorithm_of(stored)
    if name == ALGORITHM:
        return xxhash.xxh3_128()
    if name == LEGACY:
        return hashlib.sha256()
    raise ValueError(f"unknown checksum algorithm {name!r} in {stored!r}")


def matches(stored: str, h: Hasher) -> bool:
    """Whether the bytes `h` saw (a `verifier(stored)`) are the ones `stored` was made from."""
    return (tagged(h) if algorithm_of(stored) == ALGORITHM else h.hexdigest()) == stored
