"""Llama-style decoder over packed variable-length sequences.

The input is one 1-D stream of tokens holding several documents back to back, described by
`cu_seqlens` (cumulative document lengths, int32, `[0, l0, l0+l1, ..., T]`) and `positions`
(each token's offset inside its own document). Packing instead of padding wastes no compute
on pad tokens, and the same shapes are what varlen flash kernels and context parallelism take.

Tokens never attend across documents; how that is computed is `packed_attention.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longrun.config.sections import ModelSection

# The packed attention lives in its own module; these names are also this module's.
from longrun.trainer.packed_attention import (  # noqa: F401
    AttentionLayout,
    PackedLayout,
    PaddedLayout,
    attention_backend,
    packed_causal_attention,
)

if TYPE_CHECKING:
    from longrun.trainer.cp.attention import ContextParallelAttention


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
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        # Not persistent: derived from the config, so checkpoints stay weights-only.
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Compute the tables where the buffers are (again after `to_empty` gave them memory:
        a model built on the meta device has none). Computed on the host in float64, so every
        device gets the same values."""
        if self.cos.is_meta:
            return
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim
        inv_freq = 1.0 / self.theta**exponents
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64), inv_freq)
        self.cos.copy_(angles.cos().float())
        self.sin.copy_(angles.sin().float())

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        # [T, 1, head_dim/2]: broadcast over heads.
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[i], x[i + D/2]) of `x` [T, H, D] (the "rotate half" layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


@dataclass(frozen=True)
class PackedStream:
    """One micro-batch's stream as the decoder's layers take it: tokens and positions (padded at
    the end where asked) and how its tokens attend."""

    tokens: Tensor
    positions: Tensor
    layout: AttentionLayout


@torch.compiler.disable  # host checks and bookkeeping: never traced (training.compile: model)
def packed_stream(cfg: ModelSection, tokens: Tensor, positions: Tensor, cu_seqlens: Tensor | None,
                  context_parallel: ContextParallelAttention | None = None, *, multiple: int = 1,
                  length: int | None = None) -> PackedStream:
    """Check a packed stream and build its attention layout; pad it to `length` tokens (a
    pipeline's fixed micro-batch shape) or else to the next multiple of `multiple` (sequence
    parallelism). Padding attends to nothing and is attended by nothing (`PaddedLayout`)."""
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
    if longest > cfg.max_seq_len:
        raise ValueError(
            f"a document of {longest} tokens exceeds model.max_seq_len "
            f"({cfg.max_seq_len}); chunk documents to max_seq_len"
        )
    n = tokens.shape[0]
    if length is not None and length < n:
        raise ValueError(f"a stream of {n} tokens does not fit the fixed length {length}")
    pad = (length - n) if length is not None else -n % multiple
    if pad:
        layout = PaddedLayout(layout, n)
        tokens, positions = F.pad(tokens, (0, pad)), F.pad(positions, (0, pad))
    return PackedStream(tokens, positions, layout)


# --- the decoder -----------------------------------------------------------------------------


@torch.compiler.disable
def attend(layout: AttentionLayout, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """`layout.attend(q, k, v)`, never traced by `torch.compile` (training.compile): a layout is
    host-side bookkeeping (document boundaries in numpy, a CP ring's transfers) whose shapes
    change every micro-batch, and its kernels (flash, varlen, the CP ring) are fused already.
    Compiled blocks break their graph here: norms, projections, rotary and SwiGLU on each side
    are compiled, the attention runs eagerly (the regional compilation torchtitan uses)."""
    return layout.attend(q, k, v)


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
        # -1 heads: under tensor parallelism each rank computes only its own share of them.
        q = self.wq(x).view(t, -1, self.head_dim)
        k = self.wk(x).view(t, -1, self.head_dim)
        v = self.wv(x).view(t, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.wo(attend(layout, q, k, v).reshape(t, -1))


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


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a model, or of a pipeline stage's part of one (whose `layers`
    is keyed by the whole model's block numbers)."""
    layers = model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


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
        # Streams are padded to a multiple of this many tokens (tensor parallelism sets it to
        # tp: sequence parallelism gives each TP rank an equal share of the tokens).
        self.sequence_multiple = 1
        if not self.tok_embeddings.weight.is_meta:
            self.init_weights()

    def init_weights(self, seed: int | None = None) -> None:
        """The initial weights (`weights_init.py`: per parameter and row, from `seed`; default
        torch's initial seed, so `torch.manual_seed(s); Transformer(cfg)` is reproducible). The
        same values as every sharded layout of the same seed starts with. Built under
        `torch.device("meta")` the model has no storage and is not initialised: the trainer
        shards it first, then fills only this rank's pieces."""
        from longrun.parallel.pieces import local_pieces
        from longrun.trainer.weights_init import init_pieces

        init_pieces(local_pieces(self), self.cfg, torch.initial_seed() if seed is None else seed)

    def forward(self, tokens: Tensor, positions: Tensor, cu_seqlens: Tensor | None = None, *,
                context_parallel: ContextParallelAttention | None = None) -> Tensor:
        """tokens, positions: LongTensor [T]; cu_seqlens: int32 [n_docs + 1]. Positions must
        be below max_seq_len (documents are chunked to it). Returns logits [T, vocab], or
        [T + padding, vocab] when `sequence_multiple` does not divide T (rows past T are
        padding: give them no target).

        Under context parallelism the tokens are this rank's shard (`cp_layout.LocalShard`)
        and `context_parallel` says how to attend across the group; cu_seqlens is unused."""
        stream = packed_stream(self.cfg, tokens, positions, cu_seqlens, context_parallel,
                               multiple=self.sequence_multiple)
        cos, sin = self.rotary(stream.positions)
        h = self.tok_embeddings(stream.tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, stream.layout)
        return self.output(self.norm(h))

    def flops_of_documents(self, lengths: np.ndarray) -> float:
        """Training FLOPs of one packed micro-batch of documents of these lengths (see
        `FlopsModel.of_documents`)."""
        return FlopsModel.of(self).of_documents(lengths)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count (a tied matrix counted once). exclude_embedding drops the input
        embedding table, which is a lookup, not a matmul."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_embeddings.weight.numel() if exclude_embedding else n

    def flops_per_token(self, seq_len: int | float) -> float:
        """Training FLOPs per token (see `FlopsModel.per_token`)."""
        return FlopsModel.of(self).per_token(seq_len)


@dataclass(frozen=True)
class FlopsModel:
    """What a model's training FLOPs depend on, without its weights (a pipeline stage keeps
    only its own blocks, but MFU counts the whole model's work)."""

    cfg: ModelSection
    matmul_params: int  # parameters that take part in a matmul (the output layer even when tied)

    @classmethod
    def of(cls, model: Transformer) -> FlopsModel:
        n = model.num_params(exclude_embedding=True)
        if model.cfg.tie_embeddings:
            n += model.output.weight.numel()
        return cls(model.cfg, n)

    def per_token(self, seq_len: int | float) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6N for the matmuls
        plus 12 * n_layers * n_heads * head_dim * seq_len for attention scores and values.
        N counts the output projection even when tied (it is a matmul; the lookup is not).
        For packed documents pass sum(l^2) / sum(l): then this is exact per token."""
        c = self.cfg
        return 6.0 * self.matmul_params + 12.0 * c.n_layers * c.n_heads * c.head_dim * seq_len

    def of_documents(self, lengths: np.ndarray) -> float:
        """Training FLOPs of one packed micro-batch of documents of these lengths: per token,
        with the attention term at sum(l^2) / sum(l), which makes it exact for packed documents."""
        lens = np.asarray(lengths, dtype=np.float64)
        return self.per_token((lens**2).sum() / lens.sum()) * lens.sum()
