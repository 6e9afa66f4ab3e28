"""bf16 parameters with fp32 master weights (issue 40, `parallel/precision.py`): on CUDA with
training.dtype bfloat16 FSDP2 holds the weights' bf16 copies at every layout, a process alone
included; everywhere else (the CPU) the weights stay fp32 and bf16 is autocast's, bit for bit as
before. The CUDA path is checked here on the CPU by forcing its decision."""

from __future__ import annotations

import compile_workers as w
import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from worlds import run_world

from longrun.parallel.precision import casts_parameters, mixed_precision


def test_only_cuda_with_bfloat16_casts_the_parameters():
    assert casts_parameters(torch.device("cuda", 0), "bfloat16")
    assert not casts_parameters(torch.device("cuda", 0), "float32")
    assert not casts_parameters(torch.device("cpu"), "bfloat16")
    policy = mixed_precision(torch.device("cuda", 0), "bfloat16")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision(torch.device("cpu"), "bfloat16") == MixedPrecisionPolicy()


def test_a_process_alone_computes_in_bf16_parameters_and_keeps_fp32_masters(tmp_path):
    """Forced on (what CUDA gets): the process trains alone through FSDP2 on a one-rank mesh,
    its matmuls see bf16 weights without autocast, its master weights and gradients stay fp32,
    and its losses follow autocast's (the same model, cast elsewhere) closely."""
    [(_, layout, losses, autocast_losses, masters, grads, computed, autocast)] = run_world(
        w.bf16_parameters_alone, 1, tmp_path, timeout=300)
    assert layout == ("ShardedModel", True)
    assert masters == ["torch.float32"] and grads == ["torch.float32"]
    assert computed == ["torch.bfloat16"] and not autocast
    assert losses[0] == pytest.approx(autocast_losses[0], rel=2e-2)
    assert losses[-1] < losses[0]  # it trains
    assert losses == pytest.approx(autocast_losses, rel=5e-2)


def test_alone_the_gradients_are_reduced_once_per_step_with_the_same_weights(tmp_path):
    """Alone, FSDP2 has nothing to exchange: micro-batches before a step's last keep their bf16
    weights gathered and their gradients unsharded, and the last reduces once. Three steps of
    three micro-batches end with the weights of reducing after every micro-batch, bit for bit,
    with a third of the reductions."""
    [(_, same_names, differ, collectives)] = run_world(w.one_rank_fsdp_deferral, 1, tmp_path, timeout=300)
    assert same_names and differ == []
    units = collectives[1]["reduce"] // 9  # FSDP units reduced per micro-batch without deferral
    assert units >= 2
    assert collectives[0]["reduce"] == 3 * units
