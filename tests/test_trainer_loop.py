"""The step loop: learning, the LR schedule, loss normalisation, NaN detection, metrics and
bitwise-exact resume."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch

from longrun.config import config_from_dict
from longrun.config.sections import TrainingSection
from longrun.data.packing import build_micro_batch
from longrun.trainer import (
    NonFiniteError,
    NonFiniteGradientError,
    NonFiniteLossError,
    ProgressPrinter,
    StepMetrics,
    Trainer,
    build_scheduler,
    lr_schedule,
)


def _cfg(training=None, data=None, **sections):
    raw = {
        "job": {"name": "t", "seed": 1},
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 128},
        "data": {"micro_batch_tokens": 512, "prefetch": 2} | (data or {}),
        "training": {"steps": 30, "lr": 3e-3, "warmup_steps": 3} | (training or {}),
    }
    return config_from_dict(raw | sections)


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


# --- schedule --------------------------------------------------------------------------------


def test_schedule_warmup_peak_and_floor():
    t = TrainingSection(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    lr = lr_schedule(t)
    assert lr(0) == pytest.approx(1e-3 / 11)
    assert lr(9) == pytest.approx(1e-3 * 10 / 11)
    assert lr(10) == pytest.approx(1e-3)  # the end of warmup: the peak
    assert lr(99) == pytest.approx(1e-4)  # the last step: the floor
    assert lr(150) == pytest.approx(1e-4)
    assert lr(10 + 89 // 2) == pytest.approx(1e-4 + 0.5 * 9e-4, rel=0.02)  # cosine midpoint
    decay = [lr(s) for s in range(10, 100)]
    assert all(a >= b for a, b in itertools.pairwise(decay))
    assert lr_schedule(TrainingSection(steps=5, lr=1.0, warmup_steps=0))(0) == 1.0


@pytest.mark.parametrize("kind", ["cosine", "linear", "wsd", "constant"])
def test_lambda_lr_factory_follows_the_function(kind):
    t = TrainingSection(steps=20, lr=2e-3, warmup_steps=4, min_lr_ratio=0.0, lr_schedule=kind, decay_steps=6)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=t.lr)
    sched, lr = build_scheduler(opt, t), lr_schedule(t)
    for step in range(25):
        assert opt.param_groups[0]["lr"] == pytest.approx(lr(step))
        opt.step()
        sched.step()


# --- training --------------------------------------------------------------------------------


def test_loss_goes_down_on_stdlib_text():
    steps = []
    with Trainer(_cfg(), progress=False) as trainer:
        trainer.train(on_step=steps.append)
    assert [m.step for m in steps] == list(range(1, 31))
    first, last = steps[0].loss, sum(m.loss for m in steps[-5:]) / 5
    assert first == pytest.approx(5.56, abs=0.4)  # ln(260): an untrained byte model
    assert last < first - 1.0, [round(m.loss, 3) for m in steps]
    lr = lr_schedule(trainer.cfg.training)
    for m in steps:
        assert m.lr == pytest.approx(lr(m.step - 1))
        assert 0 < m.tokens <= 512 and m.tokens_per_s > 0
        assert 0 <= m.data_wait_s <= m.step_time_s
        assert m.mfu is None and m.memory_bytes > 0 and m.grad_norm > 0


def test_metrics_with_accumulation_peak_flops_and_hooks():
    seen_a, seen_b = [], []
    cfg = _cfg({"steps": 3, "grad_accum": 3, "grad_clip": 0.0}, {"source": "synthetic"})
    with Trainer(cfg, progress=False, peak_flops=1e12) as trainer:
        last = trainer.train(steps=2, on_step=[seen_a.append, seen_b.append])
        assert trainer.step == 2 and seen_a == seen_b == [seen_a[0], last]
        assert 512 < last.tokens <= 3 * 512
        assert 0 < last.mfu < 1
        assert trainer.train().step == 3  # default: up to training.steps


def test_loss_is_normalised_per_token_not_per_micro_batch():
    """Two micro-batches or the same documents in one: the same loss and gradient."""
    with Trainer(_cfg(), progress=False) as trainer:
        full = (trainer.corpus[i] for i in range(len(trainer.corpus)))
        docs = list(itertools.islice((d for d in full if len(d) == 128), 6))
        parts = [build_micro_batch(docs[:1]), build_micro_batch(docs[1:])]  # 127 vs 635 tokens
        loss_split, flops_split = trainer.forward_backward(parts)
        grads_split = [p.grad.clone() for p in trainer.model.parameters()]
        trainer.optimizer.zero_grad()
        loss_one, flops_one = trainer.forward_backward([build_micro_batch(docs)])
        assert loss_split == pytest.approx(loss_one, rel=1e-5)
        assert flops_split == pytest.approx(flops_one)
        for a, p in zip(grads_split, trainer.model.parameters(), strict=True):
            torch.testing.assert_close(a, p.grad, atol=1e-6, rtol=1e-4)


def test_nan_loss_raises_before_the_update_and_rewinds_the_data():
    cfg = _cfg({"steps": 3})
    with Trainer(cfg, progress=False) as trainer:
        trainer.train(steps=1)
        weight = trainer.model.layers[1].feed_forward.w2.weight
        good = weight[0, 0].item()
        with torch.no_grad():
            weight[0, 0] = float("nan")
        before, data_before = _weights(trainer), trainer.state_dict()["data"]
        with pytest.raises(NonFiniteLossError, match="at step 2") as err:
            trainer.train_step()
        assert err.value.step == 2 and err.value.loss != err.value.loss  # NaN
        assert trainer.step == 1 and trainer.state_dict()["data"] == data_before
        after = _weights(trainer)
        assert all(torch.equal(before[k].nan_to_num(), after[k].nan_to_num()) for k in before)
        # Repaired, the retry trains on the same micro-batches as an unbroken run would.
        with torch.no_grad():
            weight[0, 0] = good
        trainer.train(steps=2)
        retried = _weights(trainer)
    with Trainer(cfg, progress=False) as unbroken:
        unbroken.train(steps=3)
        assert all(torch.equal(retried[k], v) for k, v in _weights(unbroken).items())


def test_inf_gradient_with_finite_loss_raises_before_the_update():
    cfg = _cfg({"steps": 3})
    with Trainer(cfg, progress=False) as trainer:
        trainer.train(steps=1)
        weight = trainer.model.layers[0].feed_forward.w1.weight
        handle = weight.register_hook(lambda grad: grad * float("inf"))
        before = _weights(trainer)
        with pytest.raises(NonFiniteGradientError, match=r"gradient norm is .* at step 2") as err:
            trainer.train_step()
        assert err.value.step == 2 and not math.isfinite(err.value.grad_norm)
        assert isinstance(err.value, NonFiniteError)
        assert trainer.step == 1
        assert all(torch.equal(before[k], v) for k, v in _weights(trainer).items())
        handle.remove()
        trainer.train(steps=1)
        assert trainer.step == 2


def test_bfloat16_autocast_trains():
    cfg = _cfg({"steps": 2, "dtype": "bfloat16", "warmup_steps": 0})
    with Trainer(cfg, progress=False) as trainer:
        m = trainer.train()
    assert m.step == 2 and 3.0 < m.loss < 7.0


def test_progress_line_format(capsys):
    with Trainer(_cfg({"steps": 4, "log_every": 2}), progress=True) as trainer:
        trainer.train()
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2  # steps 2 and 4
    pattern = (r"step 4/4  loss \d+\.\d{4}  grad_norm \d+\.\d\d  lr \d\.\de-\d\d  "
               r"tok/s [\d,]+  mem \d+\.\d\dGiB  elapsed 0:00:\d\d  eta 0:00:00  layout single")
    assert re.fullmatch(pattern, lines[-1]), lines[-1]


def test_progress_printer_eta_with_a_fake_clock():
    now = [100.0]
    out = []
    printer = ProgressPrinter(100, every=10, write=out.append, clock=lambda: now[0])
    for step in range(11, 31):  # resumed at step 10: counts only the steps it saw
        now[0] += 0.5
        printer(StepMetrics(step, 4.1234, 1.234, 3e-4, 12345, 12345.0, 0.5, 0.01, 0.42, 2**30))
    assert out == [
        "step 20/100  loss 4.1234  grad_norm 1.23  lr 3.0e-04  tok/s 12,345  mfu 42.0%  "
        "mem 1.00GiB  elapsed 0:00:05  eta 0:00:40",
        "step 30/100  loss 4.1234  grad_norm 1.23  lr 3.0e-04  tok/s 12,345  mfu 42.0%  "
        "mem 1.00GiB  elapsed 0:00:10  eta 0:00:35",
    ]


# --- determinism and resume ------------------------------------------------------------------


def test_resume_is_bitwise_equal_to_an_uninterrupted_run():
    cfg = _cfg({"steps": 6, "grad_accum": 2, "warmup_steps": 2}, {"prefetch": 3})
    with Trainer(cfg, progress=False) as straight:
        straight.train()
        expected = _weights(straight)

    with Trainer(cfg, progress=False) as first:
        first.train(steps=3)
        state = first.state_dict()
    with Trainer(cfg, progress=False) as second:
        second.load_state_dict(state)
        assert second.step == 3
        second.train()
        resumed = _weights(second)
        assert second.step == 6

    assert expected.keys() == resumed.keys()
    for name in expected:
        assert torch.equal(expected[name], resumed[name]), name

    with Trainer(_cfg({"steps": 6, "grad_accum": 2, "warmup_steps": 2}, {"prefetch": 3},
                      job={"name": "t", "seed": 2}), progress=False) as other_seed:
        other_seed.train()
        assert not torch.equal(_weights(other_seed)["norm.weight"], expected["norm.weight"])


def test_non_finite_errors_survive_pickling():
    """They travel from a Ray worker to the controller, which reads their step."""
    import pickle

    from longrun.trainer import NonFiniteGradientError, NonFiniteLossError

    for err in (NonFiniteLossError(4, float("nan")), NonFiniteGradientError(7, float("inf"))):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and back.step == err.step and str(back) == str(err)


def test_skipped_steps_consume_their_data_without_training():
    """The policy's answer to a spike that repeats at the same data: the step's data is
    drawn and thrown away, the step and the schedule move on, and the steps after it see
    exactly the data they would have seen."""
    cfg = _cfg(training={"steps": 6, "grad_accum": 2})
    with Trainer(cfg, progress=False) as plain:
        seen_plain = []
        plain.train(on_step=lambda m: seen_plain.append((m.step, plain.feed.state, m.lr)))
    with Trainer(cfg, progress=False) as skipping:
        skipping.skip_steps = frozenset({1, 4})
        seen_skip = []
        before = _weights(skipping)
        skipping.train(steps=1)
        assert skipping.step == 1 and all(torch.equal(before[k], v) for k, v in _weights(skipping).items())
        skipping.train(on_step=lambda m: seen_skip.append((m.step, skipping.feed.state, m.lr)))
    assert [s for s, _, _ in seen_skip] == [2, 3, 5, 6]
    # The same data positions and learning rates as the plain run at those steps.
    assert [(d, lr) for s, d, lr in seen_skip] == [(d, lr) for s, d, lr in seen_plain if s in (2, 3, 5, 6)]
    assert skipping.step == 6 and skipping.state_dict()["data"] == plain.state_dict()["data"]


def test_a_step_reports_its_phases_in_order():
    """What the heartbeat shows while a rank works: the waits for data, then each part of the
    step. Under context parallelism the wait is for a planned global batch: phase "plan"."""
    from longrun.trainer.cp.batches import one_rank_setup
    from longrun.trainer.cp.planner import CostModel

    def one_step_phases(trainer: Trainer) -> list[str]:
        seen: list[str] = []
        trainer.on_phase = seen.append
        trainer.train(steps=1)
        return [p for i, p in enumerate(seen) if i == 0 or seen[i - 1] != p]  # runs collapsed

    plain_cfg = _cfg(training={"steps": 2, "warmup_steps": 1, "grad_accum": 2})
    with Trainer(plain_cfg, "cpu", progress=False) as plain:
        assert one_step_phases(plain) == ["data", "forward", "backward", "forward", "backward", "sync",
                                          "optimizer"]
    cfg = _cfg(training={"steps": 2, "warmup_steps": 1}, parallelism={"dynamic_cp": True})
    cost = CostModel.for_model(cfg.model, linear_s_per_token=1e-6, attn_s_per_token2=1e-9,
                               ring_block_s_per_token2=1e-9, p2p_latency_s=1e-4, p2p_s_per_byte=1e-9,
                               micro_batch_overhead_s=1e-3)
    setup = one_rank_setup(cost, cfg.dims)
    with Trainer(cfg, "cpu", context_parallel=setup, progress=False) as planned:
        phases = one_step_phases(planned)
        assert phases[0] == "plan" and "data" not in phases
        assert phases[-2:] == ["sync", "optimizer"]


# --- activation checkpointing ----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_recomputes_without_changing_the_training(mode):
    """Recomputing blocks in backward gives the same weights, bit for bit, and the parameter
    names stay those of the plain model (checkpoints do not depend on it)."""
    with Trainer(_cfg({"steps": 3}), progress=False) as plain:
        plain.train()
        want = _weights(plain)
    with Trainer(_cfg({"steps": 3, "activation_checkpointing": mode}), progress=False) as recomputed:
        recomputed.train()
        got = _weights(recomputed)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_an_infinite_priming_loss_on_an_idle_micro_batch_leaves_a_finite_step_finite():
    """An idle micro-batch joins the gradient synchronisation with a zero-weight pass; were its
    loss infinite, `inf * 0.0` is NaN: the step's loss must not see it, its gradient stays 0."""
    from longrun.trainer.step import MicroBatchWork, StepWork

    with Trainer(_cfg(), progress=False) as trainer:
        docs = [trainer.corpus[i] for i in range(4)]
        mb = build_micro_batch(docs)
        tokens = mb.n_tokens
        trainer.forward_backward(StepWork([MicroBatchWork(mb, mb)], loss_tokens=tokens, sampler_state=None))
        alone = [p.grad.clone() for p in trainer.model.parameters()]
        loss_alone = trainer.forward_backward(
            StepWork([MicroBatchWork(mb, mb)], loss_tokens=tokens, sampler_state=None))[0]
        real_priming = trainer._priming_loss
        trainer._priming_loss = lambda model: real_priming(model) + float("inf")
        trainer.optimizer.zero_grad(set_to_none=True)
        loss, _ = trainer.forward_backward(
            StepWork([MicroBatchWork(mb, mb), MicroBatchWork(None, None)], loss_tokens=tokens,
                     sampler_state=None))
        assert math.isfinite(loss) and loss == pytest.approx(loss_alone, rel=1e-6)
        for a, p in zip(alone, trainer.model.parameters(), strict=True):
            torch.testing.assert_close(a, p.grad, atol=1e-6, rtol=1e-5)
