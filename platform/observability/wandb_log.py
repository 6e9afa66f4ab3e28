"""The job's curves in Weights & Biases, where the `wandb` package is installed
(`observability.wandb: offline | online`; off by default).

Like TensorBoard (tensorboard.py) it is written by the controller alone, from the lowest rank's
step records, one W&B run per job (its id is the job's name, resumed by a rerun), and a step
redone after a fault is not logged again (W&B's steps only go forward). Offline, the run lives
in `<output_dir>/<job>/wandb/` for `wandb sync` later: nothing leaves the machine.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from longrun.observability.journal import newest_trained_step
from longrun.observability.tensorboard import SCALARS


def run_id(job: str) -> str:
    """W&B allows letters, digits, '-' and '_' in a run id."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", job)


class WandbRun:
    def __init__(self, job: str, run_dir: str | os.PathLike, mode: str, config: Mapping[str, Any],
                 written: int | None = None):
        import wandb  # ImportError where it is not installed: the job goes on without it

        self.written = newest_trained_step(run_dir) if written is None else written
        os.makedirs(run_dir, exist_ok=True)
        self.run = wandb.init(project="longrun", name=job, id=run_id(job), resume="allow", dir=str(run_dir),
                              mode=mode, config=dict(config), settings=wandb.Settings(silent=True))

    def step(self, step: int, metrics: Mapping[str, Any] | None) -> bool:
        if metrics is None or step <= self.written:
            return False
        self.run.log({tag: metrics[name] for name, tag in SCALARS.items() if metrics.get(name) is not None},
                     step=step)
        self.written = step
        return True

    def event(self, line: str) -> None:
        """An event, as text at the newest step logged."""
        self.run.log({"events": line}, step=max(self.written, 0))

    def close(self) -> None:
        self.run.finish()
