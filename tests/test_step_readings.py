"""No host synchronisation inside a step (issue 40): the loss, the gradient norm and the
non-finite check stay on the device and are read one step late; a non-finite step is skipped on
the device, so it never reaches the weights, the optimizer's state or a step's hooks (which is
where checkpoints are taken)."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from longrun.config import config_from_dict
from longrun.trainer import NonFiniteLossError, Trainer

# What makes the host wait for a device value: a tensor's number read on the host.
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__bool__,
          torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.numpy}


def _cfg(steps=6, **training):
    return config_from_dict({
        "job": {"name": "t", "seed": 1},
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 128},
        "data": {"micro_batch_tokens": 512, "prefetch": 2, "source": "synthetic"},
        "training": {"steps": steps, "lr": 3e-3, "warmup_steps": 2, "grad_accum": 2} | training,
    })


def _state(trainer: Trainer) -> dict:
    """Everything a checkpoint of this moment would hold, copied."""
    return copy.deepcopy(trainer.state_dict())


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


class _HostReads(TorchFunctionMode):
    """Records every host read of a floating-point or boolean tensor (the values a device
    computes; integer tensors are the host's own bookkeeping, e.g. document boundaries) with the
    longrun source file that asked for it."""

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS and args and (args[0].is_floating_point() or args[0].dtype == torch.bool):
            frame = sys._getframe(1)
            while frame is not None and "/longrun/" not in frame.f_code.co_filename \
                    and "/platform/" not in frame.f_code.co_filename:
                frame = frame.f_back
            where = frame.f_code.co_filename.rsplit("/", 2)[-1] if frame is not None else "?"
            self.reads.append((where, func.__name__))
        return func(*args, **(kwargs or {}))


def test_a_step_reads_nothing_from_the_device_but_the_previous_steps_numbers(monkeypatch):
    """Inside `train()` the only host reads of device values are the one-step-late reads of
    `readings.py` (one per step), and no device synchronisation is asked for; the
    synchronisations are counted through CUDA-free stand-ins, so this runs on a CPU."""
    synchronised = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: synchronised.append("device"))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: synchronised.append("event"))
    with Trainer(_cfg(steps=4), "cpu", progress=False) as trainer:
        trainer.read_late = True
        trainer.train(steps=1)  # the first step builds the optimizer's state: not the subject
        seen = []
        with _HostReads() as mode:
            trainer.train(steps=3, on_step=seen.append)
    assert [m.step for m in seen] == [2, 3, 4]
    assert synchronised == []
    assert mode.reads == [("readings.py", "tolist")] * 3, mode.reads


def test_a_steps_hooks_run_after_the_next_steps_backward_with_the_trainer_still_at_its_step():
    """Read late, step k's numbers and hooks come while step k+1 runs (after its backward, before
    its optimizer), and what the hooks see (step, weights, optimizer, data position, metrics) is
    bit for bit what reading at once shows."""
    runs = {}
    for late in (False, True):
        with Trainer(_cfg(), "cpu", progress=False) as trainer:
            trainer.read_late = late
            events: list[str] = []
            trainer.on_phase = lambda phase, events=events: events.append(phase)
            seen = []

            def hook(m, trainer=trainer, events=events, seen=seen):
                events.append(f"hook {m.step}")
                seen.append((m.step, m.loss, m.grad_norm, m.lr, m.tokens, trainer.step, _state(trainer)))

            trainer.train(on_step=hook)
            runs[late] = (events, seen, _state(trainer))
    (eager_events, eager_seen, eager_end), (late_events, late_seen, late_end) = runs[False], runs[True]
    assert _equal(eager_seen, late_seen) and _equal(eager_end, late_end)
    assert [s[0] for s in late_seen] == [s[5] for s in late_seen] == list(range(1, 7))
    # Step 1's hook: eagerly before step 2 starts; read late, after step 2's backward.
    first_hook = late_events.index("hook 1")
    assert late_events[first_hook - 1] == "sync" and late_events[first_hook + 1] == "optimizer"
    assert late_events.count("optimizer") == 6 and late_events[-1] == "hook 6"
    assert eager_events[eager_events.index("hook 1") + 1] == "data"


def test_a_non_finite_step_is_named_a_step_late_and_never_reaches_weights_or_hooks():
    """A NaN loss at step 4: the update is skipped on the device; the error, raised while step 5
    runs, names step 4 and leaves the trainer at step 3 (weights, optimizer, schedule, data);
    step 4's hooks (a checkpoint among them) never ran. Repaired, training goes on as if the NaN
    had never been."""
    bad_step = 4
    with Trainer(_cfg(), "cpu", progress=False) as unbroken:
        unbroken.train()
        want = _state(unbroken)
    with Trainer(_cfg(), "cpu", progress=False) as trainer:
        trainer.read_late = True
        real_loss = trainer._summed_token_loss
        launched = []

        def poisoned(model, inputs, attention=None):
            launched.append(trainer.step + 1)
            loss = real_loss(model, inputs, attention)
            return loss * float("nan") if trainer.step + 1 == bad_step else loss

        trainer._summed_token_loss = poisoned
        states = {}
        with pytest.raises(NonFiniteLossError) as err:
            trainer.train(on_step=lambda m: states.setdefault(m.step, _state(trainer)))
        assert err.value.step == bad_step and sorted(states) == [1, 2, 3]
        assert launched[-1] == bad_step + 1  # found out while the next step ran
        assert trainer.step == bad_step - 1 and _equal(_state(trainer), states[bad_step - 1])
        trainer._summed_token_loss = real_loss
        trainer.train()
        assert trainer.step == 6 and _equal(_state(trainer), want)


def test_the_device_skips_a_non_finite_update_leaving_weights_and_moments_as_they_were():
    from longrun.trainer.guard import guarded_step, non_finite

    weight = torch.nn.Parameter(torch.randn(4, 3))
    gain = torch.nn.Parameter(torch.randn(3))
    optimizer = torch.optim.AdamW([{"params": [weight], "weight_decay": 0.1},
                                   {"params": [gain], "weight_decay": 0.0}], lr=1e-2, fused=True)
    for _ in range(2):
        weight.grad, gain.grad = torch.randn(4, 3), torch.randn(3)
        guarded_step(optimizer, non_finite(torch.tensor(1.0), torch.tensor(2.0)))
    before = copy.deepcopy((weight.detach(), gain.detach(), optimizer.state_dict()))
    weight.grad, gain.grad = torch.full((4, 3), float("inf")), torch.randn(3)
    flag = non_finite(torch.tensor(3.0), torch.tensor(float("inf")))
    assert flag.item() == 1.0
    guarded_step(optimizer, flag)
    assert _equal(before, (weight.detach(), gain.detach(), optimizer.state_dict()))
    guarded_step(optimizer, non_finite(torch.tensor(3.0), torch.tensor(1.0)))  # a finite one steps
    assert not torch.equal(before[1], gain.detach())
