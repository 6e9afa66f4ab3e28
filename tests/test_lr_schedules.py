"""The learning-rate schedules a run can choose (`training.lr_schedule`: issue 43): their
shapes, WSD's extension without a jump, through the checkpointed scheduler, and `config show`
(the scheduler following each shape: tests/test_trainer_loop.py)."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import yaml

from longrun.config import ConfigError, config_from_dict
from longrun.config.sections import TrainingSection
from longrun.trainer import Trainer, lr_multiplier, lr_schedule
from longrun.trainer.schedule import describe, shape_of


def _t(**kw) -> TrainingSection:
    return TrainingSection(**({"steps": 100, "lr": 1.0, "warmup_steps": 10, "min_lr_ratio": 0.1} | kw))


@pytest.mark.parametrize("kind", ["cosine", "linear", "wsd", "constant"])
def test_every_schedule_warms_up_alike_and_never_rises_after_the_peak(kind):
    lr = lr_schedule(_t(lr_schedule=kind))
    cosine = lr_schedule(_t())
    assert [lr(s) for s in range(10)] == [cosine(s) for s in range(10)]  # the same warmup
    assert lr(10) == 1.0  # the peak, at the end of warmup
    after = [lr(s) for s in range(10, 130)]
    assert all(a >= b for a, b in itertools.pairwise(after)), kind
    assert lr(99) == pytest.approx(1.0 if kind == "constant" else 0.1)  # the floor at the last step
    assert lr(129) == lr(99)  # and there it stays


def test_cosine_is_the_schedule_every_job_ran_before():
    t = _t()
    lr = lr_schedule(t)
    for step in range(120):
        assert lr(step) == lr_multiplier(step, warmup_steps=10, total_steps=100, min_lr_ratio=0.1)
    assert lr(10 + 89 // 2) == pytest.approx(0.55, rel=0.02)  # the cosine's midpoint


def test_linear_falls_by_equal_steps():
    lr = lr_schedule(_t(lr_schedule="linear"))
    drops = [lr(s) - lr(s + 1) for s in range(10, 99)]
    assert drops == pytest.approx([0.9 / 89] * 89)


def test_wsd_holds_the_peak_then_decays_over_its_last_steps():
    lr = lr_schedule(_t(lr_schedule="wsd", decay_steps=20))
    assert [lr(s) for s in range(10, 80)] == [1.0] * 70  # stable
    assert lr(80) < 1.0 and lr(99) == pytest.approx(0.1)  # decay: steps 80-99
    assert [lr(s) - lr(s + 1) for s in range(80, 99)] == pytest.approx([0.9 / 20] * 19)
    by_fraction = shape_of(_t(lr_schedule="wsd", decay_fraction=0.5))
    assert by_fraction.decay_start == 100 - 45  # half of the 90 steps after warmup


@pytest.mark.parametrize("decay", [{"decay_steps": 20}, {"decay_fraction": 0.2}])
def test_a_wsd_run_extended_before_its_decay_goes_on_at_the_peak(decay):
    short = lr_schedule(_t(lr_schedule="wsd", **decay))
    longer = lr_schedule(_t(lr_schedule="wsd", steps=300, **decay))
    stable_end = shape_of(_t(lr_schedule="wsd", **decay)).decay_start
    assert [short(s) for s in range(stable_end)] == [longer(s) for s in range(stable_end)]
    assert longer(stable_end) == 1.0  # where the short run would have begun to decay
    assert longer(299) == pytest.approx(0.1)
    # A cosine run extended the same way changes its lr at once: what WSD is for.
    assert lr_schedule(_t(steps=300))(50) != lr_schedule(_t())(50)


def _cfg(steps: int) -> object:
    return config_from_dict({
        "job": {"name": "wsd", "seed": 1},
        "model": {"dim": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64},
        "data": {"source": "synthetic", "micro_batch_tokens": 128},
        "training": {"steps": steps, "lr": 1e-2, "warmup_steps": 2, "lr_schedule": "wsd", "decay_steps": 3},
    })


def test_a_resumed_job_with_more_steps_continues_the_stable_phase_from_its_checkpoint():
    with Trainer(_cfg(10), progress=False) as first:
        first.train(steps=5)  # steps 0-4: warmup then the peak; its decay would start at step 7
        state = first.state_dict()
        assert first.optimizer.param_groups[0]["lr"] == 1e-2
    with Trainer(_cfg(40), progress=False) as extended:
        extended.load_state_dict(state)
        seen = []
        extended.train(steps=35, on_step=seen.append)  # steps 6-40, the run's end
    assert [m.step for m in seen][:3] == [6, 7, 8]
    lr = lr_schedule(extended.cfg.training)
    assert [m.lr for m in seen] == pytest.approx([lr(m.step - 1) for m in seen])
    assert [m.lr for m in seen if m.step <= 37] == [1e-2] * 32  # no jump: stable until step 37
    assert seen[-1].lr == pytest.approx(1e-3)  # and the floor at the last step


def test_a_decay_longer_than_the_run_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"training\.decay_steps.*longer than the run"):
        config_from_dict({"job": {"name": "x"}, "training": {
            "steps": 10, "warmup_steps": 4, "lr_schedule": "wsd", "decay_steps": 8}})
    with pytest.raises(ConfigError, match=r"training\.lr_schedule"):
        config_from_dict({"job": {"name": "x"}, "training": {"lr_schedule": "step"}})


def test_config_show_describes_the_schedule_and_stays_loadable(repo_root):
    out = subprocess.run([sys.executable, "-m", "longrun.cli", "config", "show",
                          str(repo_root / "examples" / "tiny.yaml"), "--set", "training.steps=100",
                          "--set", "training.warmup_steps=10", "--set", "training.lr_schedule=wsd",
                          "--set", "training.decay_steps=20"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    shown = yaml.safe_load(out.stdout)
    assert shown["training"]["lr_schedule"] == "wsd"
    line = next(x for x in out.stdout.splitlines() if x.startswith("# learning rate:"))
    assert "linear decay over steps 80-99 (20 steps)" in line
    assert line.endswith(describe(TrainingSection(**shown["training"])))
