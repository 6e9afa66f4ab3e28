"""A rank for `bench/lose_no_step.py --state-gb N` (not a bench itself): a Ray actor that trains
a model of the asked size, snapshotting to a keeper at the `auto` interval, and records every
step as it finishes, so the bench can kill it at a random moment and count what was lost.

One line per step in `ledger`, appended and flushed before the next step begins (what the
job's step ledger does): step, its seconds, the seconds of the snapshot's take after it, the
seconds it was blocked on snapshots in all (that take, and the wait for the copy before its
optimizer), the interval (once chosen), snapshots skipped, the newest step sent."""

from __future__ import annotations

import json
import os
import time


class Trainee:
    def __init__(self, cfg: dict, keeper: str, ledger: str):
        import torch

        from longrun.checkpoint.memory import MemorySnapshots
        from longrun.config import config_from_dict
        from longrun.trainer import Trainer
        from longrun.worker.snapshot_transfer import snapshot_sender

        torch.set_num_threads(2)
        self.trainer = Trainer(config_from_dict(cfg), progress=False)
        self.snaps = MemorySnapshots(snapshot_sender(0, [keeper], timeout_s=300), None)
        self.ledger, self._blocked = ledger, 0.0
        self.trainer.before_update.append(self._before_update)

    def pid(self) -> int:
        return os.getpid()

    def _before_update(self) -> None:
        started = time.perf_counter()
        self.snaps.before_update()
        self._blocked += time.perf_counter() - started

    def state_bytes(self) -> int:
        """The weights and the optimizer's state: what a snapshot holds (gradients are not)."""
        held = self.trainer.state_bytes()
        return int(held.get("parameters", 0) + held.get("optimizer", 0))

    def baseline(self, steps: int) -> list[float]:
        """Seconds of `steps` steps without snapshots (the first one builds the optimizer's state)."""
        out = []
        for _ in range(steps):
            started = time.perf_counter()
            self.trainer.train_step()
            out.append(time.perf_counter() - started)
        return out

    def run(self, steps: int) -> None:
        """Train with snapshots until killed (or `steps` steps)."""
        with open(self.ledger, "a") as f:
            for _ in range(steps):
                self._blocked = 0.0
                started = time.perf_counter()
                m = self.trainer.train_step()
                step_s = time.perf_counter() - started
                self.snaps.observe_step(step_s)
                taking = time.perf_counter()
                if self.snaps.due(self.trainer.step):
                    self.snaps.take(self.trainer)
                take_s = time.perf_counter() - taking
                row = {"step": m.step, "step_s": step_s, "take_s": take_s,
                       "blocked_s": self._blocked + take_s,
                       "every": self.snaps.every if self.snaps.decided else None,
                       "skipped": self.snaps.skipped, "sent": self.snaps.sent_step}
                f.write(json.dumps(row) + "\n")
                f.flush()
