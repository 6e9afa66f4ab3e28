"""bf16 parameters with fp32 master weights (issue 40, `parallel/precision.py`): on CUDA with
training.dtype bfloat16 FSDP2 holds the weights' bf16 copies wherever it shards; a process alone
keeps autocast (measured faster), and so does the CPU, bit for bit as before. The CUDA path is
checked here on the CPU by forcing its decision."""

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


def test_a_process_alone_keeps_autocast_even_where_cuda_casts_parameters(tmp_path):
    """Forced on (what CUDA gets): alone, FSDP2 would only copy (measured slower on an H200,
    precision.py), so the weights stay fp32 and autocast casts them: the same losses as the
    CPU's own bf16, bit for bit."""
    [(_, layout, losses, autocast_losses, masters, grads, computed, autocast)] = run_world(
        w.bf16_parameters, 1, tmp_path, args=({},), timeout=300)
    assert layout == ("DataParallel", False)
    assert masters == ["torch.float32"] and grads == ["torch.float32"]
    assert computed == ["torch.bfloat16"] and autocast
    assert losses == autocast_losses


def test_fsdp_over_several_ranks_computes_in_bf16_parameters_and_keeps_fp32_masters(tmp_path):
    """Forced on (what CUDA gets): where FSDP2 shards, it gathers the weights in bf16, its
    matmuls see bf16 weights without autocast, master weights and gradients stay fp32, and the
    losses follow autocast's (the same model, cast elsewhere) closely."""
    out = run_world(w.bf16_parameters, 2, tmp_path, args=({"fsdp": 2},), timeout=300)
    for _, layout, losses, autocast_losses, masters, grads, computed, autocast in out:
        assert layout == ("ShardedModel", True)
        assert masters == ["torch.float32"] and grads == ["torch.float32"]
        assert computed == ["torch.bfloat16"] and not autocast
        assert losses[0] == pytest.approx(autocast_losses[0], rel=2e-2)
        assert losses[-1] < losses[0]  # it trains
        assert losses == pytest.approx(autocast_losses, rel=5e-2)
