"""A dynamic-CP cost model for H100s from published figures, for planning on paper.

    cost = h100_cost_model(model_cfg)                  # CP groups inside a node (NVLink)
    cost = h100_cost_model(model_cfg, link="ib")       # CP groups across nodes (400 Gb/s)

The calibration (`calibration.py`) measures the machine it runs on; on this project's CPU
machines that says little about a GPU cluster, whose compute is far faster relative to its
links and launch overheads. This model takes the coefficients from what NVIDIA and the
kernels' authors publish instead. Each figure and where it comes from:

- **Dense bf16 GEMMs, 650 TFLOP/s**: the H100 SXM's peak is 989 TFLOP/s (NVIDIA H100 Tensor
  Core GPU datasheet); large training GEMMs sustain about two thirds of it (Llama 3's training
  reached 380-430 TFLOP/s per GPU end to end, attention and communication included: Dubey et al.
  2024, Table 4).
- **Causal attention, 620 TFLOP/s forward, 520 backward**: FlashAttention-3 (Shah et al. 2024)
  reports up to 740 TFLOP/s forward in bf16 on H100 (75% of peak), around 600-650 for causal
  masks at head dim 128, and a backward 1.5-1.75x FlashAttention-2's (about 500).
  Forward attention does 4 x d x L^2 FLOPs per layer for a full mask (QK^T and PV), half of it
  causal; backward 2.5x the forward's.
- **Links**: NVLink 4 gives 900 GB/s per GPU (450 each way; NVIDIA), of which NCCL's send/recv
  sustains about 350 GB/s; 400 Gb/s InfiniBand NDR per GPU (ConnectX-7) is 50 GB/s, about 45
  sustained. Latency per transfer: 10 us over NVLink, 20 us over InfiniBand (NCCL's small-message
  figures).
- **Launch overheads**: about 10 kernels per layer forward and 20 backward at ~4 us each, per
  micro-batch; a ring step adds a send/recv pair and an attention kernel per layer each way.

The result is a model, not a measurement: `bench/dynamic_cp.py --calibration h100-paper`
reports what it predicts and says so.
"""

from __future__ import annotations

from typing import Literal

from longrun.config.sections import ModelSection
from longrun.trainer.cp.cost import CostModel

GEMM_FLOPS = 650e12
ATTN_FWD_FLOPS = 620e12
ATTN_BWD_FLOPS = 520e12
BWD_OVER_FWD_ATTN = 2.5  # backward's attention FLOPs over the forward's (FlashAttention's count)
# (bytes per second sustained, seconds per transfer) by link
LINKS = {"nvlink": (350e9, 10e-6), "ib": (45e9, 20e-6)}
KERNEL_S = 4e-6
KERNELS_PER_LAYER = 30  # forward and backward together
RING_KERNELS_PER_LAYER = 6  # per ring step: a send/recv pair and a block kernel, each way
SPLIT_BLOCK_PENALTY = 1.1  # a ring step's blocks are smaller than a whole sequence's: less efficient


def h100_cost_model(model: ModelSection, *, link: Literal["nvlink", "ib"] = "nvlink") -> CostModel:
    """The cost model of `model` on H100 SXM GPUs in bf16, CP groups talking over `link`."""
    matmul_params = _matmul_params(model)
    linear = 6.0 * matmul_params / GEMM_FLOPS  # forward + backward, per token
    # Causal attention per layer, forward: 4 x n_heads x head_dim x L^2 / 2 FLOPs; backward 2.5x.
    fwd_flops_per_l2 = 2.0 * model.n_heads * model.head_dim
    attn = model.n_layers * fwd_flops_per_l2 * (1.0 / ATTN_FWD_FLOPS + BWD_OVER_FWD_ATTN / ATTN_BWD_FLOPS)
    bandwidth, latency = LINKS[link]
    return CostModel.for_model(
        model,
        linear_s_per_token=linear,
        attn_s_per_token2=attn,
        # A ring step pairs this rank's s queries with a peer's s keys, half of them masked on
        # average under the zigzag split: the same FLOPs per s^2 as a whole causal sequence.
        ring_block_s_per_token2=attn * SPLIT_BLOCK_PENALTY,
        p2p_latency_s=latency,
        p2p_s_per_byte=1.0 / bandwidth,
        micro_batch_overhead_s=model.n_layers * KERNELS_PER_LAYER * KERNEL_S,
        ring_step_overhead_s=model.n_layers * RING_KERNELS_PER_LAYER * KERNEL_S,
        element_size=2,  # bf16 K and V
    )


def _matmul_params(m: ModelSection) -> int:
    """Parameters in matmuls (the output layer even when tied; not the embedding lookup)."""
    kv = m.kv_heads * m.head_dim
    block = 2 * m.dim * m.n_heads * m.head_dim + 2 * m.dim * kv + 3 * m.dim * m.hidden_dim
    return m.n_layers * block + m.vocab_size * m.dim
