"""Is the checkpoint directory the same directory on every node?

Every rank writes its pieces under `checkpoint.dir` and the coordinator commits them; a restart
on any node reads them back. That holds only if the path names one shared store (NFS, a
shared volume, an object store) on every node. A path that exists on each node's own disk
(`/tmp/ckpt`, a hostPath) works on one host and fails on many: the commit names pieces that
sit on other nodes' disks, and a restore finds nothing. So before a node first trains, one of
its workers writes a probe file there, and the controller, which reads the same directory for
its precheck, looks for every node's probe; a missing one refuses the job before a step is
trained, naming the node.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import fsspec

PROBES = ".longrun-probes"


def _probe_path(checkpoint_dir: str, token: str, node: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, root = fsspec.core.url_to_fs(checkpoint_dir)
    return fs, f"{root.rstrip('/')}/{PROBES}/{token}-{node}"


def write_probe(checkpoint_dir: str, token: str, node: str) -> None:
    """On a worker of `node`: leave this node's probe for `token` under the checkpoint directory."""
    fs, path = _probe_path(checkpoint_dir, token, node)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, node.encode())


def unseen_probes(checkpoint_dir: str, token: str, nodes: Iterable[str]) -> list[str]:
    """On the controller: the nodes whose probe for `token` it cannot read back (the directory
    is not one they share with it). When every probe was seen, they are removed (the directory
    holds only checkpoints again); one job has one controller, so no other probes are there."""
    unseen = []
    for node in nodes:
        fs, path = _probe_path(checkpoint_dir, token, node)
        try:
            if fs.cat_file(path) != node.encode():
                unseen.append(node)
        except OSError:  # not there (FileNotFoundError), or unreadable: not shared either way
            unseen.append(node)
    if not unseen:
        fs, root = fsspec.core.url_to_fs(checkpoint_dir)
        with contextlib.suppress(OSError):
            fs.rm(f"{root.rstrip('/')}/{PROBES}", recursive=True)
    return unseen
