"""Never losing work, never blocking long: two-stage asynchronous checkpoints.

Stage 1 (`snapshot.py`) copies the training state into reusable host buffers; stage 2
(`writer.py`) writes, checksums and commits it in the background (`commit.py` collects every
rank's report, `layout.py` names directories and keeps retention); `restore.py` finds the
newest whole checkpoint and loads it once per data-parallel group. `Checkpointer` ties them
to the trainer.
"""

from longrun.checkpoint.checkpointer import Checkpointer
from longrun.checkpoint.commit import CommitAborted, LocalCommitLedger, RedisCommitLedger
from longrun.checkpoint.manifest import Manifest, ManifestError
from longrun.checkpoint.restore import (
    CheckpointMismatchError,
    CorruptShardError,
    Restored,
    restore_latest,
)
from longrun.checkpoint.snapshot import HostStager, Snapshot
from longrun.checkpoint.writer import CheckpointWriteError, CheckpointWriter, SaveResult

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
