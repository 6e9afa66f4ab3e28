"""Opening a checkpoint's files without following what a writer of the directory planted there.

A checkpoint root may hold what someone else wrote (a colleague's run, a copy off shared
storage). On a local or shared POSIX disk every file longrun reads under it (`manifest.json`,
`latest`, `fences.json`, the shards) is opened as a regular file at its own name
(`safe_files.open_regular_file`): a symbolic link (to /dev/zero, to a FIFO, to a file outside
the checkpoint) or a FIFO is refused with `UnsafePath` instead of being followed or waited on.
The names themselves come from the manifest and are plain names in their step directory
(`Manifest.from_json`). An object store holds neither links nor FIFOs: there fsspec reads.

    with open_stored(fs, path) as f: ...     # a binary file
    raw = read_stored(fs, path)              # the whole file
"""

from __future__ import annotations

import os
from typing import IO

import fsspec
from fsspec.implementations.local import LocalFileSystem

from longrun.safe_files import open_regular_file, read_regular_file

_OWN_FDS = "/proc/self/fd"


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def open_stored(fs: fsspec.AbstractFileSystem, path: str) -> IO[bytes]:
    """`path` opened to read: a regular file only on a local disk (UnsafePath otherwise)."""
    if is_local(fs):
        return open_regular_file(path)
    return fs.open(path, "rb")


def read_stored(fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    """The whole of `path`, opened as `open_stored` opens it."""
    if is_local(fs):
        return read_regular_file(path)
    return fs.cat_file(path)


def size_of(f: IO[bytes]) -> int | None:
    """The size of the open file `f` (None where fsspec does not say): a file that is not the
    size its manifest says is refused before it is read, however large it is."""
    try:
        return os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError):  # fsspec's files have no descriptor
        size = getattr(f, "size", None)
        return size if isinstance(size, int) else None


def same_file(f: IO[bytes], path: str) -> str:
    """A path that opens the very file `f` holds open (Linux: /proc/self/fd/N), for a reader that
    takes only a path (torch.load's mmap): the file verified through `f` is the file loaded,
    whatever is put at `path` meanwhile. `path` itself where /proc is missing."""
    return f"{_OWN_FDS}/{f.fileno()}" if os.path.isdir(_OWN_FDS) else path
