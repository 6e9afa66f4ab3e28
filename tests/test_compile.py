"""`training.compile` (issue 40): each block (or the whole model) through torch.compile, on
the CPU's inductor. A compiled tiny job trains like the eager one, recompiles at most a few
times whatever the packing does to the shapes, and resumes bitwise from its own state; compiled
blocks compose with FSDP, TP, pipeline stages and activation checkpointing (small gloo worlds).

Compiling is slow on two cores (about 20 s for the tiny model's first step): the jobs are tiny
and the worlds the smallest that show each composition."""

from __future__ import annotations

import compile_workers as w
import pytest
import torch
from worlds import run_world

from longrun.config import ConfigError, config_from_dict
from longrun.parallel.compile import compile_counts
from longrun.trainer import Trainer


def _cfg(compile_mode: str, steps: int = 30, **training):
    return config_from_dict({
        "job": {"name": "t", "seed": 1},
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 128},
        "data": {"micro_batch_tokens": 512, "prefetch": 2},  # stdlib text: every stream length differs
        "training": {"steps": steps, "lr": 3e-3, "warmup_steps": 3, "compile": compile_mode} | training,
    })


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_a_compiled_job_trains_like_the_eager_one_without_recompiling():
    """30 steps: the last losses within 1% of eager's; packed streams of a new length every
    micro-batch recompile at most 3 times (dynamic shapes from the first call); the parameter
    names stay the eager model's."""
    with Trainer(_cfg("none"), "cpu", progress=False) as eager:
        eager_losses = [m.loss for m in _run(eager)]
        names = set(_weights(eager))
    torch._dynamo.reset()
    before = compile_counts()
    with Trainer(_cfg("blocks"), "cpu", progress=False) as compiled:
        metrics = _run(compiled)
        assert set(_weights(compiled)) == names
    assert compile_counts().compilations > before.compilations  # it did compile
    recompiles = compile_counts().recompilations - before.recompilations
    assert recompiles <= 3 and metrics[-1].recompiles == compile_counts().recompilations
    last, want = sum(m.loss for m in metrics[-5:]) / 5, sum(eager_losses[-5:]) / 5
    assert abs(last - want) / want < 0.01, (last, want)
    assert eager_losses[0] - want > 1.0  # it learned


def _run(trainer: Trainer) -> list:
    seen = []
    trainer.train(on_step=seen.append)
    return seen


def test_a_compiled_job_resumes_bitwise_from_its_own_state():
    """Straight through 6 compiled steps, or 3, the state saved, dynamo's caches dropped (what a
    new process starts with: its first compiled call sees step 4's shapes) and 3 more: the same
    weights, bit for bit."""
    cfg = _cfg("blocks", steps=6, grad_accum=2)
    torch._dynamo.reset()
    with Trainer(cfg, "cpu", progress=False) as straight:
        straight.train()
        want = _weights(straight)
    torch._dynamo.reset()
    with Trainer(cfg, "cpu", progress=False) as first:
        first.train(steps=3)
        state = first.state_dict()
    torch._dynamo.reset()
    with Trainer(cfg, "cpu", progress=False) as second:
        second.load_state_dict(state)
        second.train()
        got = _weights(second)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_compile_mode_is_checked_where_it_is_set():
    with pytest.raises(ConfigError, match="training.compile"):
        _cfg("everything")
    with pytest.raises(ConfigError, match="training.compile"):
        config_from_dict({"job": {"name": "t"}, "cluster": {"device": "cpu", "workers_per_node": 2},
                          "parallelism": {"pp": 2}, "model": {"tie_embeddings": False},
                          "training": {"compile": "model", "grad_accum": 2}})


# (parallelism, activation checkpointing, compile): each against one eager process
COMPOSED = [({"fsdp": 2}, "selective", "blocks")]
COMPOSED_SLOW = [({"tp": 2}, "full", "blocks"), ({"fsdp": 2}, "none", "model"),
                 ({"dp": 2}, "full", "model")]


@pytest.mark.parametrize("case", COMPOSED + [pytest.param(c, marks=pytest.mark.slow) for c in COMPOSED_SLOW],
                         ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def test_compiled_blocks_compose_with_sharding_and_checkpointing(tmp_path, case):
    parallelism, ac, mode = case
    out = run_world(w.compiled_step_matches_one_process, 2, tmp_path, args=(parallelism, ac, mode),
                    timeout=600)
    for _, loss, ref_loss, worst, compiled in out:
        assert compiled
        assert loss == pytest.approx(ref_loss, rel=1e-4)
        assert worst < 1e-3


@pytest.mark.slow
def test_compiled_blocks_run_in_every_pipeline_stage(tmp_path):
    out = run_world(w.compiled_pipeline_matches_eager, 2, tmp_path, timeout=600)
    for _, losses, ref_losses, compiled in out:
        assert compiled
        assert losses == pytest.approx(ref_losses, rel=1e-4)
