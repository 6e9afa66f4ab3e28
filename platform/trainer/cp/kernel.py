"""The block kernel of context-parallel attention: one rank's queries against one block of keys.

Masks are computed from each token's (document, position), not from where it sits, so the
same kernel serves every split (`cp/layout.py`): within a document a query sees keys at
positions not after its own; padding is never a key. Per document held on both sides, the
query run meets the key run; runs of similar width are padded and batched into one matmul
(`attention_buckets`).

The kernel is plain PyTorch math in float32 (scores, masked softmax, log-sum-exp), which runs
anywhere and on any dtype; K/V travel in their own dtype and are upcast per block. It
materialises a block's scores and builds its masks with numpy on the host, so it is the
fallback and the baseline (`bench/cp_kernel.py`): the ring's default is the flash kernel
(`cp/flash.py`) wherever that applies. `MathKernel` puts it behind the block-kernel interface
the ring drives (`cp/ring.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from longrun.trainer.cp.layout import TokenStream

# --- which queries meet which keys ----------------------------------------------------------------


def _bucket_width(n: int) -> int:
    """n rounded up to the next 2^k or 1.5 x 2^k: at most 1.5x padding per side (2.25x of a
    block's work in the worst case, ~1.2x on average), and the number of distinct widths
    (batched calls) stays logarithmic."""
    p = 1 << max(n - 1, 0).bit_length()
    return 3 * p // 4 if 3 * p // 4 >= n and p >= 4 else p


@dataclass(frozen=True)
class Bucket:
    """`n` (query run, key run) pairs of one document each, padded to width `w` and batched
    into one matmul. Rows are indices into the local query / key tensors; padding repeats a
    real row and is masked out."""

    n: int
    w: int
    q_rows: Tensor  # int64 [n * w]
    k_rows: Tensor  # int64 [n * w]
    hidden: Tensor  # bool [n, w, w]: query i may NOT see key j
    q_real: Tensor  # int64: positions in [n * w] that are real query rows
    k_real: Tensor  # int64: positions in [n * w] that are real key rows
    q_dest: Tensor  # int64: the local query row of each of those
    k_dest: Tensor  # int64: the local key row of each of those


def attention_buckets(q: TokenStream, k: TokenStream, device: torch.device) -> list[Bucket]:
    """How this block's queries attend its keys: per document held on both sides, its query
    run against its key run, masked by position (causal) and validity, grouped by width.
    Documents with nothing visible are dropped (e.g. a later chunk's keys for earlier queries)."""
    k_segments = k.segments
    runs = [(qs, k_segments[d]) for d, qs in q.segments.items() if d in k_segments]
    by_width: dict[int, list[tuple[slice, slice]]] = {}
    for qs, ks in runs:
        width = _bucket_width(max(qs.stop - qs.start, ks.stop - ks.start))
        by_width.setdefault(width, []).append((qs, ks))
    buckets = []
    for w in sorted(by_width):
        group = by_width[w]
        col = np.arange(w)

        def rows(slices, col=col):
            starts = np.array([sl.start for sl in slices])
            lengths = np.array([sl.stop - sl.start for sl in slices])
            return starts[:, None] + np.minimum(col, lengths[:, None] - 1), col < lengths[:, None]

        q_rows, q_in = rows([qs for qs, _ in group])
        k_rows, k_in = rows([ks for _, ks in group])
        q_ok, k_ok = q_in & q.valid[q_rows], k_in & k.valid[k_rows]
        mask = (q.pos[q_rows][:, :, None] >= k.pos[k_rows][:, None, :]) & q_ok[:, :, None] & k_ok[:, None, :]
        keep = mask.any(axis=(1, 2))
        if not keep.any():
            continue
        q_rows, k_rows, q_in, k_in, mask = q_rows[keep], k_rows[keep], q_in[keep], k_in[keep], mask[keep]

        def tensor(x):
            return torch.from_numpy(np.ascontiguousarray(x)).to(device)

        q_real, k_real = np.flatnonzero(q_in.ravel()), np.flatnonzero(k_in.ravel())
        buckets.append(Bucket(
            n=int(keep.sum()), w=w, q_rows=tensor(q_rows.ravel()), k_rows=tensor(k_rows.ravel()),
            hidden=tensor(~mask), q_real=tensor(q_real), k_real=tensor(k_real),
            q_dest=tensor(q_rows.ravel()[q_real]), k_dest=tensor(k_rows.ravel()[k_real]),
        ))
    return buckets


# --- the block kernel (heads-first layout: q [KV, G, T, D], k/v [KV, T, D]) ---------------------


def _gather(q: Tensor, k: Tensor, v: Tensor, b: Bucket) -> tuple[Tensor, Tensor, Tensor]:
    """The bucket's query and key runs, padded and batched; K/V upcast to q's float32."""
    kvh, g, _, d = q.shape
    qb = q.index_select(2, b.q_rows).view(kvh, g, b.n, b.w, d)
    kb = k.index_select(1, b.k_rows).to(q.dtype).view(kvh, 1, b.n, b.w, d)
    vb = v.index_select(1, b.k_rows).to(q.dtype).view(kvh, 1, b.n, b.w, d)
    return qb, kb, vb


def block_forward(q: Tensor, k: Tensor, v: Tensor, buckets: list[Bucket], scale: float,
                  out: Tensor, lse: Tensor) -> None:
    """Attend q to this block of keys and merge into the running (out, lse) in place."""
    kvh, g, _, d = q.shape
    for b in buckets:
        qb, kb, vb = _gather(q, k, v, b)
        s = torch.matmul(qb, kb.transpose(-1, -2)) * scale
        s = s.masked_fill(b.hidden, float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows with no visible key
        p = torch.exp(s - m)
        denom = p.sum(-1, keepdim=True)
        o_blk = torch.matmul(p, vb) / denom.clamp(min=torch.finfo(p.dtype).tiny)
        lse_blk = (m + torch.log(denom)).squeeze(-1)  # -inf where nothing was visible
        rows = b.q_dest
        o_blk = o_blk.view(kvh, g, b.n * b.w, d).index_select(2, b.q_real)
        lse_blk = lse_blk.view(kvh, g, b.n * b.w).index_select(2, b.q_real)
        old = lse.index_select(2, rows)
        new = torch.logaddexp(old, lse_blk)
        ref = torch.where(torch.isinf(new), torch.zeros_like(new), new)
        a, c = torch.exp(old - ref).unsqueeze(-1), torch.exp(lse_blk - ref).unsqueeze(-1)
        out.index_copy_(2, rows, out.index_select(2, rows) * a + o_blk * c)
        lse.index_copy_(2, rows, new)


def block_backward(q: Tensor, k: Tensor, v: Tensor, do: Tensor, buckets: list[Bucket], scale: float,
                   lse: Tensor, delta: Tensor, dq: Tensor, dk: Tensor, dv: Tensor) -> None:
    """Flash-attention backward for one block given the *final* lse and delta = rowsum(dO*O):
    accumulates into dq (this rank's queries) and dk/dv (this block's keys)."""
    kvh, g, _, d = q.shape
    no_key = torch.full((), float("inf"), device=q.device)
    for b in buckets:
        qb, kb, vb = _gather(q, k, v, b)
        dob = do.index_select(2, b.q_rows).view(kvh, g, b.n, b.w, d)
        row_lse = lse.index_select(2, b.q_rows).view(kvh, g, b.n, b.w, 1)
        row_delta = delta.index_select(2, b.q_rows).view(kvh, g, b.n, b.w, 1)
        s = (torch.matmul(qb, kb.transpose(-1, -2)) * scale).masked_fill(b.hidden, float("-inf"))
        p = torch.exp(s - torch.where(torch.isinf(row_lse), no_key, row_lse))
        ds = p * (torch.matmul(dob, vb.transpose(-1, -2)) - row_delta)
        dv.index_add_(1, b.k_dest, torch.matmul(p.transpose(-1, -2), dob).sum(1)
                      .view(kvh, b.n * b.w, d).index_select(1, b.k_real))
        dk.index_add_(1, b.k_dest, (torch.matmul(ds.transpose(-1, -2), qb).sum(1) * scale)
                      .view(kvh, b.n * b.w, d).index_select(1, b.k_real))
        dq.index_add_(2, b.q_dest, (torch.matmul(ds, kb) * scale)
                      .view(kvh, g, b.n * b.w, d).index_select(2, b.q_real))


# --- behind the ring's block-kernel interface (token-major: q [T, H, D], k/v [T, KV, D]) -------


class Partial(NamedTuple):
    """A rank's queries in a kernel's layout and the attention merged over the blocks so far."""

    x: Tensor
    out: Tensor  # float32
    lse: Tensor  # float32; -inf where nothing was visible yet


class Grads(NamedTuple):
    """What a kernel's backward needs per block: the queries, the output gradient, the *merged*
    output and log-sum-exp, and dq accumulated in float32 over the blocks."""

    x: Tensor
    do: Tensor
    out: Tensor
    lse: Tensor
    dq: Tensor
    delta: Tensor | None = None  # rowsum(dO * O), where the kernel wants it precomputed


def heads_first(x: Tensor, kv_heads: int) -> Tensor:
    """[T, H, D] -> float32 [KV, H/KV, T, D]: the query heads grouped by the K/V head they share."""
    t, h, d = x.shape
    return x.float().view(t, kv_heads, h // kv_heads, d).permute(1, 2, 0, 3).contiguous()


def _token_major(x: Tensor, like: Tensor) -> Tensor:
    kvh, g, t, d = x.shape
    return x.permute(2, 0, 1, 3).reshape(t, kvh * g, d).to(like.dtype)


class MathKernel:
    """The float32 block kernel above; K/V blocks arrive token-major and are read through
    transposed views (no copy), dK/dV are accumulated into such views."""

    name = "math"

    def plan(self, q: TokenStream, k: TokenStream, device: torch.device) -> list[Bucket]:
        return attention_buckets(q, k, device)

    def forward_start(self, q: Tensor, kv_heads: int) -> Partial:
        x = heads_first(q, kv_heads)
        return Partial(x, torch.zeros_like(x),
                       torch.full(x.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device))

    def forward_block(self, p: Partial, k: Tensor, v: Tensor, plan: list[Bucket]) -> None:
        block_forward(p.x, k.transpose(0, 1), v.transpose(0, 1), plan, p.x.shape[-1] ** -0.5,
                      p.out, p.lse)

    def output(self, p: Partial, q: Tensor) -> Tensor:
        return _token_major(p.out, q)

    def backward_start(self, q: Tensor, dout: Tensor, out: Tensor, lse: Tensor) -> Grads:
        kv_heads = out.shape[0]
        x, do = heads_first(q, kv_heads), heads_first(dout, kv_heads)
        return Grads(x, do, out, lse, torch.zeros_like(x), delta=(do * out).sum(-1))

    def backward_block(self, g: Grads, k: Tensor, v: Tensor, plan: list[Bucket], dk: Tensor,
                       dv: Tensor) -> None:
        block_backward(g.x, k.transpose(0, 1), v.transpose(0, 1), g.do, plan, g.x.shape[-1] ** -0.5,
                       g.lse, g.delta, g.dq, dk.transpose(0, 1), dv.transpose(0, 1))

    def dq(self, g: Grads, q: Tensor) -> Tensor:
        return _token_major(g.dq, q)
