"""Skipped steps (the policy's data skip windows) still go through the step hooks: the
heartbeat moves on, and a checkpoint due inside the window, the last step's included, is
written; no training metrics are observed for a step that trained nothing."""

from __future__ import annotations

import checkpoint_workers as w
import fsspec
import torch

from longrun.checkpoint import Checkpointer, layout, restore_latest
from longrun.trainer import Trainer
from longrun.worker.hooks import StepHooks


class RecordingBeat:
    def __init__(self):
        self.steps: list[int] = []

    def update(self, **fields) -> None:
        if "step" in fields:
            self.steps.append(fields["step"])


class RecordingMetrics:
    """Every WorkerMetrics call the hooks make; observe_step's steps kept apart."""

    def __init__(self):
        self.observed_steps: list[int] = []

    def observe_step(self, m) -> None:
        self.observed_steps.append(m.step)

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def test_a_checkpoint_due_inside_a_skip_window_is_written_and_heartbeats_move_on(tmp_path):
    # Checkpoints every 2 steps; steps 4 and 5 (the last) are skipped: both are due.
    cfg = w.config(str(tmp_path / "ckpt"), training={"steps": 5},
                   checkpoint={"interval_steps": 2, "async_save": False})
    beat, metrics = RecordingBeat(), RecordingMetrics()
    with Trainer(cfg, progress=False) as trainer:
        ckpt = Checkpointer(cfg)
        hooks = StepHooks(beat, metrics, checkpointer=ckpt).attach(trainer)
        trainer.skip_steps = frozenset({4, 5})
        trainer.train(on_step=hooks.after_step)
        ckpt.close()
        final_data = trainer.state_dict()["data"]
        final_weights = w.weights(trainer)
    fs, root = fsspec.core.url_to_fs(cfg.checkpoint_dir)
    assert layout.committed_steps(fs, root) == [2, 4, 5]
    assert beat.steps == [1, 2, 3, 4, 5]  # progress through the window, step by step
    assert metrics.observed_steps == [1, 2, 3]  # nothing trained at 4 and 5: no loss, no step time
    # The final checkpoint is the final state: step 5, its data position, the weights of step 3.
    with Trainer(cfg, progress=False) as fresh:
        restored = restore_latest(fs, root, model=cfg.model.model_dump(mode="json"),
                                  template=fresh.state_dict)
        fresh.load_state_dict(restored.state)
        assert restored.step == 5 and fresh.step == 5
        assert fresh.state_dict()["data"] == final_data
        assert all(torch.equal(final_weights[k], v) for k, v in w.weights(fresh).items())
