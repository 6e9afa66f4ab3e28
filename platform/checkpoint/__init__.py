"""Never losing work, never blocking long: two-stage asynchronous checkpoints.

Stage 1 (`snapshot.py`) copies the training state into reusable host buffers; stage 2
(`writer.py`) writes, checksums and commits it in the background (`commit.py` collects every
rank's report, `layout.py` names directories and keeps retention); `restore.py` finds the
newest whole checkpoint and loads it once per data-parallel group. `Checkpointer` ties them
to the trainer.
"""

import importlib
from typing import Any

# Imported on first use (PEP 562): the manifest and the layout are torch-free, and the
# controller reads them before it places a worker; it must not pay for (or ever import)
# torch, which the checkpointer, snapshot, writer and restore need.
_WHERE = {
    "Checkpointer": "checkpointer",
    "CommitAborted": "commit", "LocalCommitLedger": "commit", "RedisCommitLedger": "commit",
    "Manifest": "manifest", "ManifestError": "manifest",
    "CheckpointMismatchError": "restore", "CorruptShardError": "restore", "Restored": "restore",
    "restore_latest": "restore",
    "HostStager": "snapshot", "Snapshot": "snapshot",
    "CheckpointWriteError": "writer", "CheckpointWriter": "writer", "SaveResult": "writer",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)


__all__ = [
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "CheckpointWriter",
    "Checkpointer",
    "CommitAborted",
    "CorruptShardError",
    "HostStager",
    "LocalCommitLedger",
    "Manifest",
    "ManifestError",
    "RedisCommitLedger",
    "Restored",
    "SaveResult",
    "Snapshot",
    "restore_latest",
]
