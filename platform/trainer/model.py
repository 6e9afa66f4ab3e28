"""Llama-style decoder over packed variable-length sequences.

The input is one 1-D stream of tokens holding several documents back to back, described by
`cu_seqlens` (cumulative document lengths, int32, `[0, l0, l0+l1, ..., T]`) and `positions`
(each token's offset inside its own document). Packing instead of padding wastes no compute
on pad tokens, and the same shapes are what varlen flash kernels and context parallelism take.

Tokens never attend across documents; how that is computed is `packed_causal_attention`.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longrun.config.sections import ModelSection

if TYPE_CHECKING:
    from longrun.trainer.cp.attention import ContextParallelAttention

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32: under bf16 autocast the mean of squares loses too many bits.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


class Rotary(nn.Module):
    """cos/sin tables for positions 0..max_seq_len-1, looked up by each token's position
    inside its document, so every document sees positions starting at 0."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
        # Not persistent: derived from the config, so checkpoints stay weights-only.
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        # [T, 1, head_dim/2]: broadcast over heads.
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[i], x[i + D/2]) of `x` [T, H, D] (the "rotate half" layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


# --- attention over packed documents ---------------------------------------------------------


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


# --- the decoder -----------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, cfg: ModelSection):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layout: AttentionLayout) -> Tensor:
        t = x.shape[0]
        q = self.wq(x).view(t, self.n_heads, self.head_dim)
        k = self.wk(x).view(t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(t, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.wo(layout.attend(q, k, v).reshape(t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelSection):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.hidden_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layout: AttentionLayout) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, layout)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelSection):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, 0.02) everywhere; the projections that write into the residual stream
        (attention wo, MLP w2) scaled by 1/sqrt(2 n_layers), so the stream's variance does not
        grow with depth (GPT-2). Draws from torch's global RNG in a fixed module order."""
        std, out_std = 0.02, 0.02 / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        for block in self.layers:
            attn, ff = block.attention, block.feed_forward
            for lin in (attn.wq, attn.wk, attn.wv, ff.w1, ff.w3):
                nn.init.normal_(lin.weight, std=std)
            for lin in (attn.wo, ff.w2):
                nn.init.normal_(lin.weight, std=out_std)
            block.attention_norm.weight.fill_(1.0)
            block.ffn_norm.weight.fill_(1.0)
        self.norm.weight.fill_(1.0)
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.output.weight, std=std)

    def forward(self, tokens: Tensor, positions: Tensor, cu_seqlens: Tensor | None = None, *,
                context_parallel: ContextParallelAttention | None = None) -> Tensor:
        """tokens, positions: LongTensor [T]; cu_seqlens: int32 [n_docs + 1]. Positions must
        be below max_seq_len (documents are chunked to it). Returns logits [T, vocab].

        Under context parallelism the tokens are this rank's shard (`cp_layout.LocalShard`)
        and `context_parallel` says how to attend across the group; cu_seqlens is unused."""
        if tokens.dim() != 1 or positions.shape != tokens.shape:
            raise ValueError(
                f"tokens and positions must be 1-D and of equal length (a packed stream); got "
                f"{tuple(tokens.shape)} and {tuple(positions.shape)}"
            )
        layout: AttentionLayout
        if context_parallel is not None:
            layout, longest = context_parallel, int(context_parallel.layout.lengths.max())
        elif cu_seqlens is None:
            raise ValueError("cu_seqlens is required without context parallelism")
        else:
            layout = PackedLayout.from_cu_seqlens(cu_seqlens, tokens.shape[0], tokens.device)
            longest = layout.max_seqlen
        if longest > self.cfg.max_seq_len:
            raise ValueError(
                f"a document of {longest} tokens exceeds model.max_seq_len "
                f"({self.cfg.max_seq_len}); chunk documents to max_seq_len"
            )
        cos, sin = self.rotary(positions)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, layout)
        return self.output(self.norm(h))

    def flops_of_documents(self, lengths: np.ndarray) -> float:
        """Training FLOPs of one packed micro-batch of documents of these lengths: per token,
        with the attention term at sum(l^2) / sum(l), which makes it exact for packed documents."""
        lens = np.asarray(lengths, dtype=np.float64)
        return self.flops_per_token((lens**2).sum() / lens.sum()) * lens.sum()

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count (a tied matrix counted once). exclude_embedding drops the input
        embedding table, which is a lookup, not a matmul."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_embeddings.weight.numel() if exclude_embedding else n

    def flops_per_token(self, seq_len: int | float) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6N for the matmuls
        plus 12 * n_layers * n_heads * head_dim * seq_len for attention scores and values.
        N counts the output projection even when tied (it is a matmul; the lookup is not).
        For packed documents pass sum(l^2) / sum(l): then this is exact per token."""
        c = self.cfg
        n = self.num_params(exclude_embedding=True)
        if c.tie_embeddings:
            n += self.output.weight.numel()
        return 6.0 * n + 12.0 * c.n_layers * c.n_heads * c.head_dim * seq_len
