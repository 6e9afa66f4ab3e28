"""Causal attention over packed documents: one 1-D stream of several documents, each token
attending only to earlier tokens of its own document.

    layout = PackedLayout.from_cu_seqlens(cu_seqlens, n_tokens, device)   # once per forward
    out = layout.attend(q, k, v)                                          # q [T, H, D], k/v [T, KV, D]

On CUDA in half precision torch's varlen flash kernel does it in one call; elsewhere (and as a
fallback) a few padded, batched SDPA calls over documents grouped by length. The attention
layers only see an `AttentionLayout`: this one, a context-parallel one (`cp/attention.py`), or
either padded for sequence parallelism (`PaddedLayout`).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)


@dataclass
class PackedLayout:
    """Where the documents of a packed stream are; built once per forward, shared by layers."""

    cu_seqlens: Tensor  # int32 [n_docs + 1], on the compute device (what varlen kernels take)
    bounds: np.ndarray  # the same on the host, int64
    max_seqlen: int

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Tensor, n_tokens: int, device: torch.device):
        bounds = cu_seqlens.detach().cpu().numpy().astype(np.int64)
        lengths = np.diff(bounds)
        if bounds.ndim != 1 or len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != n_tokens:
            raise ValueError(
                f"cu_seqlens must be 1-D, start at 0 and end at the number of tokens ({n_tokens}); "
                f"got {bounds.tolist()[:8]}{'...' if len(bounds) > 8 else ''}"
            )
        if (lengths <= 0).any():
            raise ValueError("cu_seqlens must be strictly increasing (no empty documents)")
        cu = cu_seqlens.to(device=device, dtype=torch.int32)
        return cls(cu_seqlens=cu, bounds=bounds, max_seqlen=int(lengths.max()))

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return packed_causal_attention(q, k, v, self)

    @cached_property
    def buckets(self) -> tuple[list[tuple[Tensor, int, int]], Tensor]:
        """Documents grouped by length rounded up to a power of two. Per group: a gather index
        [n * L] into the stream (each document padded to the group's longest length L by
        repeating its last token), n and L. Plus `inverse`: for every stream token, its row in
        the concatenation of the groups' padded outputs."""
        starts, lengths = self.bounds[:-1], np.diff(self.bounds)
        keys = np.ceil(np.log2(lengths)).astype(np.int64)
        groups, inverse, offset = [], np.empty(self.bounds[-1], dtype=np.int64), 0
        for key in np.unique(keys):  # sorted: a deterministic order
            ids = np.flatnonzero(keys == key)
            n, width = len(ids), int(lengths[ids].max())
            col = np.arange(width)
            gather = starts[ids, None] + np.minimum(col, lengths[ids, None] - 1)
            real = col < lengths[ids, None]
            inverse[gather[real]] = offset + np.flatnonzero(real.ravel())
            groups.append((torch.from_numpy(gather.ravel()).to(self.cu_seqlens.device), n, width))
            offset += n * width
        return groups, torch.from_numpy(inverse).to(self.cu_seqlens.device)


def _bucketed_sdpa(q: Tensor, k: Tensor, v: Tensor, layout: PackedLayout) -> Tensor:
    """Block-diagonal causal attention as a few padded, batched SDPA calls.

    Why this shape (measured on 2 CPU cores, fwd+bwd, T = 512..8192): one SDPA per document
    pays a call per document per layer and is 4-20x slower when a micro-batch holds many short
    documents; one SDPA with a dense [T, T] block-diagonal mask (or all documents padded to the
    longest) does T^2 (or n * max_len^2) work, up to 5x slower with a long-tailed mix. Grouping
    documents by power-of-two length bounds the padding waste to < 4x of the causal work and
    the number of calls to log2(max_seq_len) + 1: within 1.3x of the better of the two in every
    case measured. Padding sits after each document's real tokens, so `is_causal` alone keeps
    real queries off it; padded rows are dropped and contribute exactly zero gradient."""
    groups, inverse = layout.buckets
    outs = []
    for gather, n, width in groups:
        qs, ks, vs = (
            x.index_select(0, gather).view(n, width, x.shape[1], x.shape[2]).transpose(1, 2)
            for x in (q, k, v)
        )
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        outs.append(o.transpose(1, 2).reshape(n * width, q.shape[1], q.shape[2]))
    return torch.cat(outs).index_select(0, inverse)


def _find_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, set()
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


_VARLEN, _VARLEN_PARAMS = _find_varlen()
_varlen_broken = False


def _varlen(q: Tensor, k: Tensor, v: Tensor, layout: PackedLayout) -> Tensor:
    # Causal is spelled window_size=(-1, 0) in newer torch, is_causal=True in older ones.
    causal = {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMS else {"is_causal": True}
    if "enable_gqa" in _VARLEN_PARAMS:
        causal["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    cu, m = layout.cu_seqlens, layout.max_seqlen
    return _VARLEN(q, k, v, cu, cu, m, m, **causal)


def attention_backend(device: torch.device | str) -> str:
    """The kernel packed attention uses on `device` in half precision right now:
    "varlen_flash" (torch.nn.attention.varlen) or "bucketed_sdpa", with the reason for the
    latter after a colon (for benchmarks and logs)."""
    if torch.device(device).type != "cuda":
        return "bucketed_sdpa: not CUDA"
    if _VARLEN is None:
        return "bucketed_sdpa: this torch has no varlen_attn"
    if _varlen_broken:
        return "bucketed_sdpa: varlen_attn failed on this GPU"
    return "varlen_flash"


def packed_causal_attention(q: Tensor, k: Tensor, v: Tensor, layout: PackedLayout) -> Tensor:
    """Causal attention within each document of a packed stream. q [T, H, D], k/v [T, KV, D]
    with KV dividing H (grouped-query). Returns [T, H, D].

    On CUDA in half precision the varlen flash kernel does exactly this in one call; if torch
    lacks it or it fails (an unsupported GPU), the bucketed SDPA path is used from then on."""
    global _varlen_broken
    if (
        _VARLEN is not None
        and not _varlen_broken
        and q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
    ):
        try:
            return _varlen(q, k, v, layout)
        except (RuntimeError, NotImplementedError) as exc:
            _varlen_broken = True
            log.warning("varlen flash attention unavailable (%s); using bucketed SDPA", exc)
    return _bucketed_sdpa(q, k, v, layout)


class AttentionLayout(Protocol):
    """What the attention layers need to know about the tokens: how to attend them. A
    `PackedLayout` (whole documents in this process) or a context-parallel one
    (`cp.attention.ContextParallelAttention`: slices of documents spread over a group)."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


@dataclass
class PaddedLayout:
    """`inner` over the first `n` tokens of a stream padded at its end (for sequence
    parallelism, see `Transformer.sequence_multiple`): padding attends to nothing and is
    attended by nothing; its output rows are zero."""

    inner: AttentionLayout
    n: int

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = self.inner.attend(q[: self.n], k[: self.n], v[: self.n])
        return F.pad(out, (0, 0, 0, 0, 0, q.shape[0] - self.n))
