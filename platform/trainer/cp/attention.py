"""Context-parallel attention: ring (zigzag), Ulysses and their hybrid USP, with overlap.

Each rank of a CP group holds a slice of every document (`cp/layout.py`); attention still has
to see whole documents. Three ways to get there:

- **Ring.** K and V blocks travel around the group; each rank attends its queries to one
  block per step and merges the partial results through their log-sum-exp (the blockwise
  softmax of flash attention), so no rank holds the whole sequence's K/V. The transfer of the
  next block is posted *before* the current block is computed: communication runs under
  compute. Backward sends K/V around again, and the dK/dV of each block travel one step
  behind it, every rank adding its share, until they arrive back at the block's owner.
- **Ulysses.** One all-to-all turns "my tokens, all heads" into "all tokens, my heads"; each
  rank then runs ordinary attention over whole documents for H/cp heads, and a second
  all-to-all turns it back. Cheap on fast links, but the degree is bounded by the head count.
- **USP.** Ulysses inside groups of `u` ranks (usually one node: the all-to-all wants
  bandwidth), ring across the cp/u such groups. Works for any head count and topology.

Masks are computed from each token's (document, position), not from where it sits, so the
same block kernel serves every split: within a document a query sees keys at positions not
after its own; padding is never a key.

The block kernel here is plain PyTorch math in float32 (scores, masked softmax, log-sum-exp),
which runs anywhere, including gloo on CPU where the tests run; K/V travel in their own dtype
and are upcast per block. It materialises a block's scores, so on a GPU it is the place for a
fused kernel that returns the log-sum-exp (flash attention's varlen forward and backward); the
ring, the overlap and the merge do not change.

Message order: NCCL ignores tags and matches point-to-point messages by their order per pair
of peers, and a send may block until its receive is posted, so every send is posted in one
batch with the receive that its ring neighbours post at the same point. Per neighbour pair the
order is K/V of step 0, dK/dV of step 0, K/V of step 1, ... on both sides. gloo matches by
tag; K/V and dK/dV carry different ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from longrun.trainer.cp.layout import ShardLayout, TokenStream

CPImpl = Literal["ring", "ulysses", "usp"]
_KV_TAG, _DKV_TAG = 17, 18  # distinct tags: gloo matches messages by (peer, tag)


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


# --- the ring -----------------------------------------------------------------------------------


@dataclass
class Ring:
    """A ring of attention participants: `streams[i]` is what member i holds (its queries and
    its K/V block); this process is member `rank`. group None: a ring of one (no transfers)."""

    group: dist.ProcessGroup | None
    rank: int
    streams: tuple[TokenStream, ...]
    device: torch.device
    _buckets: dict[int, list[Bucket]] = field(default_factory=dict, repr=False)

    @property
    def size(self) -> int:
        return len(self.streams)

    def buckets(self, src: int) -> list[Bucket]:
        """This member's queries against member `src`'s keys (computed once per micro-batch,
        shared by all layers, forward and backward)."""
        if src not in self._buckets:
            self._buckets[src] = attention_buckets(self.streams[self.rank], self.streams[src],
                                                   self.device)
        return self._buckets[src]

    def _peer(self, offset: int) -> int:
        return dist.get_global_rank(self.group, (self.rank + offset) % self.size)

    def post(self, send: Tensor | None, recv: Tensor | None, tag: int) -> list[dist.Work]:
        """Send to the next member and/or receive from the previous one, without waiting."""
        ops = []
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send, self._peer(1), self.group, tag))
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, recv, self._peer(-1), self.group, tag))
        return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()


def _heads_first(x: Tensor, kv_heads: int) -> Tensor:
    """[T, H, D] -> float32 [KV, H/KV, T, D]: the query heads grouped by the K/V head they share."""
    t, h, d = x.shape
    return x.float().view(t, kv_heads, h // kv_heads, d).permute(1, 2, 0, 3).contiguous()


class _RingAttention(torch.autograd.Function):
    # The trainer runs forward under autocast and backward outside it; the kernel must compute
    # the same scores in both (the saved log-sum-exp has to match them), so autocast is off
    # inside and the precision is chosen here: float32 math, K/V on the wire in their dtype.

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ring: Ring) -> Tensor:
        with torch.autocast(q.device.type, enabled=False):
            t, h, d = q.shape
            kvh = k.shape[1]
            qh = _heads_first(q, kvh)
            kv = torch.stack((k, v)).permute(0, 2, 1, 3).contiguous()  # [2, KV, T, D]
            out = torch.zeros_like(qh)
            lse = torch.full(qh.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
            for step in range(ring.size):
                src = (ring.rank - step) % ring.size
                works, nxt = [], None
                if step < ring.size - 1:  # the next block is on the wire while this one computes
                    nxt = kv.new_empty(2, kvh, len(ring.streams[(src - 1) % ring.size]), d)
                    works = ring.post(kv, nxt, _KV_TAG)
                block_forward(qh, kv[0], kv[1], ring.buckets(src), d ** -0.5, out, lse)
                _wait(works)
                if nxt is not None:
                    kv = nxt
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.ring = ring
            return out.permute(2, 0, 1, 3).reshape(t, h, d).to(q.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor):
        with torch.autocast(dout.device.type, enabled=False):
            return _RingAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring: Ring = ctx.ring
        t, h, d = q.shape
        kvh = k.shape[1]
        qh, do = _heads_first(q, kvh), _heads_first(dout, kvh)
        delta = (do * out).sum(-1)
        dq = torch.zeros_like(qh)
        kv = torch.stack((k, v)).permute(0, 2, 1, 3).contiguous()
        dkv_works: list[dist.Work] = []
        incoming: Tensor | None = None  # dK/dV accumulated so far for the block held next
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            kv_works, nxt = [], None
            if step < ring.size - 1:
                nxt = kv.new_empty(2, kvh, len(ring.streams[(src - 1) % ring.size]), d)
                kv_works = ring.post(kv, nxt, _KV_TAG)
            mine = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            block_backward(qh, kv[0], kv[1], do, ring.buckets(src), d ** -0.5, lse, delta, dq,
                           mine[0], mine[1])
            _wait(dkv_works)  # the previous step's send has left; this block's sum has come
            if incoming is not None:
                mine += incoming
            if ring.size > 1:
                # On to the next member (the block's owner after the last step), in one batch
                # with the receive of what the previous member sends at this same point: the
                # sum for the block held next, or at the end this member's own.
                after = (ring.rank - step - 1) % ring.size
                incoming = mine.new_empty(2, kvh, len(ring.streams[after]), d)
                dkv_works = ring.post(mine, incoming, _DKV_TAG)
            else:
                incoming = mine
            _wait(kv_works)
            if nxt is not None:
                kv = nxt
        _wait(dkv_works)
        dq_out = dq.permute(2, 0, 1, 3).reshape(t, h, d).to(q.dtype)
        dk_out = incoming[0].permute(1, 0, 2).to(k.dtype)
        dv_out = incoming[1].permute(1, 0, 2).to(v.dtype)
        return dq_out, dk_out, dv_out, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, ring: Ring) -> Tensor:
    """Causal attention of this member's queries q [T, H, D] over the whole ring's keys
    k/v [T, KV, D] (KV divides H); returns [T, H, D] in q's dtype."""
    return _RingAttention.apply(q, k, v, ring)


# --- Ulysses: all-to-all between "my tokens, all heads" and "all tokens, my heads" -------------


def _all_to_all(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _SeqToHeads(torch.autograd.Function):
    """[T, H, D] on each of u members -> [u*T, H/u, D]: every member's tokens (member-major)
    for this member's slice of heads."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _seq_to_heads(grad, ctx.group), None


def _seq_to_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    u = dist.get_world_size(group)
    t, h, d = x.shape
    chunks = x.reshape(t, u, h // u, d).transpose(0, 1).contiguous()  # chunk j goes to member j
    return _all_to_all(chunks, group).reshape(u * t, h // u, d)


def _heads_to_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    u = dist.get_world_size(group)
    n, hu, d = x.shape
    back = _all_to_all(x.reshape(u, n // u, hu, d).contiguous(), group)  # [j] = my tokens, j's heads
    return back.transpose(0, 1).reshape(n // u, u * hu, d)


# --- putting it together ------------------------------------------------------------------------


@dataclass(frozen=True)
class CPGroups:
    """The process groups one CP group of `size` ranks attends with. ring: the whole CP group
    (ulysses None); ulysses: the whole group all-to-all (ring None); usp: `ulysses` holds this
    rank's u consecutive CP ranks, `ring` the ranks at the same offset in the other such
    groups. CP-rank j = ring_index * u + ulysses_index."""

    impl: CPImpl
    size: int
    rank: int  # in the CP group
    ulysses_size: int
    ulysses: dist.ProcessGroup | None
    ring: dist.ProcessGroup | None


def usp_ulysses_size(cp: int, n_heads: int) -> int:
    """Default Ulysses degree for USP: the largest power of two u with u*u <= cp dividing
    n_heads, so both dimensions are used (CP 4 -> 2 x 2, CP 8 -> 2 x 4)."""
    u = 1
    while (2 * u) * (2 * u) <= cp and cp % (2 * u) == 0 and n_heads % (2 * u) == 0:
        u *= 2
    return u


def build_cp_groups(cp_ranks: list[list[int]], rank: int, impl: CPImpl, *, ulysses_size: int = 1,
                    new_group=dist.new_group) -> CPGroups | None:
    """Create (collectively: every rank of the default group calls this with the same
    `cp_ranks`, the global ranks of every CP group, each increasing) the groups of `impl` and
    return this rank's, or None if it is in no group."""
    mine: CPGroups | None = None
    for ranks in cp_ranks:
        size = len(ranks)
        u = {"ring": 1, "ulysses": size, "usp": ulysses_size}[impl]
        if size % u:
            raise ValueError(f"a Ulysses degree of {u} does not divide the CP size {size}")
        whole = new_group(ranks) if impl != "usp" else None
        uly_groups = [new_group(ranks[i:i + u]) for i in range(0, size, u)] if impl == "usp" else []
        ring_groups = [new_group(ranks[j::u]) for j in range(u)] if impl == "usp" else []
        if rank not in ranks:
            continue
        j = ranks.index(rank)
        if impl == "ring":
            mine = CPGroups(impl, size, j, 1, None, whole)
        elif impl == "ulysses":
            mine = CPGroups(impl, size, j, size, whole, None)
        else:
            mine = CPGroups(impl, size, j, u, uly_groups[j // u], ring_groups[j % u])
    return mine


class ContextParallelAttention:
    """Attention for one micro-batch on one rank of a CP group; what the model's attention
    layers call instead of single-process attention. Built per micro-batch (the masks depend
    on the documents) and shared by all layers."""

    def __init__(self, layout: ShardLayout, groups: CPGroups, device: torch.device):
        if layout.cp != groups.size:
            raise ValueError(f"layout for CP {layout.cp} used with a CP group of {groups.size}")
        self.layout, self.groups = layout, groups
        u = groups.ulysses_size
        ring_index = groups.rank // u
        # Each ring member holds the (document-major) union of its Ulysses group's tokens.
        members = []
        self._order: Tensor | None = None
        self._inverse: Tensor | None = None
        for r in range(groups.size // u):
            own = layout.streams[r * u:(r + 1) * u]
            if u == 1:
                members.append(own[0])
                continue
            stream, order = own[0].concat_doc_major(list(own[1:]))
            members.append(stream)
            if r == ring_index:
                self._order = torch.from_numpy(order).to(device)
                self._inverse = torch.from_numpy(np.argsort(order)).to(device)
        self.ring = Ring(groups.ring if groups.size // u > 1 else None, ring_index, tuple(members),
                         device)
        # Every step's masks now, before the first layer runs (not inside its ring loop).
        for src in range(self.ring.size):
            self.ring.buckets(src)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [T, H, D], k/v [T, KV, D]: this rank's shard; returns its attention output."""
        g = self.groups
        if g.ulysses_size == 1:
            return ring_attention(q, k, v, self.ring)
        u = g.ulysses_size
        if k.shape[1] % u:  # KV heads do not split u ways: repeat each just enough that they do
            rep = u // math.gcd(k.shape[1], u)  # divides H/KV because u divides H
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        q, k, v = (_SeqToHeads.apply(x, g.ulysses) for x in (q, k, v))
        q, k, v = (x.index_select(0, self._order) for x in (q, k, v))
        o = ring_attention(q, k, v, self.ring).index_select(0, self._inverse)
        return _HeadsToSeq.apply(o, g.ulysses)
