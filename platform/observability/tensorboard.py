"""The job's TensorBoard event files, from one writer: the controller's.

Every rank knows the loss, but one curve per rank would be 64 identical curves; the lowest
rank's step records reach the controller through the step ledger, and the controller writes
them here, to `<output_dir>/<job>/tb/` (`tensorboard --logdir` that directory). Written with
TensorBoard's own event file writer and protos, which need neither TensorFlow nor torch (the
controller never imports torch; tensorboardX and torch.utils.tensorboard both would).

A step redone after a fault is not written again: its curve would be drawn a second time over
the first (same step, on CPU the same values). The newest step written is found at start in
the journal (observability/journal.py), so a controller started again on the same job (a SIGTERM
and a rerun) continues the curves instead of redrawing them.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Mapping
from typing import Any

from longrun.observability.journal import newest_trained_step

log = logging.getLogger(__name__)

# metric name in a step record -> TensorBoard tag (grouped by the part before the slash)
SCALARS = {
    "loss": "train/loss", "val_loss": "validation/loss", "grad_norm": "train/grad_norm", "lr": "train/lr",
    "tokens_per_s": "throughput/tokens_per_s", "mfu": "throughput/mfu",
    "step_time_s": "time/step_s", "data_wait_s": "time/data_wait_s",
    "memory_bytes": "memory/peak_bytes",
}


def tensorboard_dir(run_dir: str | os.PathLike) -> str:
    return os.path.join(run_dir, "tb")


class TensorBoardWriter:
    def __init__(self, run_dir: str | os.PathLike, *, flush_secs: float = 10.0, written: int | None = None):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.dir = tensorboard_dir(run_dir)
        # The newest step whose curves are drawn (`written`: already read from the journal).
        self.written = newest_trained_step(run_dir) if written is None else written
        # Event files are named by the second they were opened and the host: a second
        # controller started within the same second would truncate the first's file.
        self.writer = EventFileWriter(self.dir, flush_secs=flush_secs,
                                      filename_suffix=f".{uuid.uuid4().hex[:8]}")

    def step(self, step: int, metrics: Mapping[str, Any] | None, *, checkpoint_s: float = 0.0,
             validation_s: float = 0.0, wall: float | None = None) -> bool:
        """Write `step`'s scalars unless a step at or after it was written; whether it was."""
        if metrics is None or step <= self.written:
            return False
        values = [(tag, metrics[name]) for name, tag in SCALARS.items() if metrics.get(name) is not None]
        if checkpoint_s > 0:
            values.append(("time/checkpoint_blocking_s", checkpoint_s))
        if validation_s > 0:
            values.append(("time/validation_s", validation_s))
        self._scalars(values, step, wall)
        self.written = step
        return True

    def restored(self, seconds: float, source: str) -> None:
        self._scalars([(f"time/restore_{source}_s", seconds)], self.written)

    def event(self, line: str, wall: float | None = None) -> None:
        """A fault, restart, resize or state change, as text at the newest step written."""
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

        text = TensorProto(dtype="DT_STRING", string_val=[line.encode()],
                           tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        summary = Summary(value=[Summary.Value(tag="events", metadata=meta, tensor=text)])
        self._write(summary, self.written, wall)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

    def _scalars(self, values: list[tuple[str, float]], step: int, wall: float | None = None) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values])
        self._write(summary, step, wall)

    def _write(self, summary, step: int, wall: float | None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        at = time.time() if wall is None else wall
        self.writer.add_event(Event(wall_time=at, step=step, summary=summary))
