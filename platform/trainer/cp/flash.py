"""The flash block kernel of context-parallel attention: one rank's queries against one block of
keys through a fused kernel that returns the log-sum-exp; no score block is ever materialised.

- **CUDA**: torch's varlen flash attention (`torch.nn.attention.varlen.varlen_attn` with
  `return_aux`). Every (query segment, the keys it sees) pair below is one sequence of a varlen
  batch: one call for the segments with a causal edge, one for those that see their keys whole.
- **CPU**: the flash-for-CPU SDPA op (`aten::_scaled_dot_product_flash_attention_for_cpu`),
  which takes no sequence boundaries: one call per segment (documents are contiguous runs, so a
  segment is a slice of the local queries).

What a query sees comes from each token's (document, position), as in `cp/kernel.py`, but as
runs instead of masks. A stream's valid tokens fall into runs of one document at consecutive
positions (zigzag gives two per document and rank; Ulysses' union of ranks a few more). Cut a
query run at the key runs' ends: in each piece every query sees some key runs whole and at most
one key run up to its own position. Put that one last and the piece is causal attention aligned
at the bottom right (the last query sees every key); padding is in no run. The host finds the
runs (one vectorised pass over the tokens, no mask) and pairs them per document, once per
micro-batch; the token-level gather indices and sequence offsets are built on the device.

Blocks are merged through their log-sum-exp as in the math kernel. Backward re-runs the flash
backward per block with the *merged* output and log-sum-exp (flash's backward takes them as
inputs): P = exp(S - lse) is then the final softmax restricted to the block, so each block's
dQ/dK/dV are exactly its share and simply add up. Flash on CUDA wants bf16/fp16 and a head
size it supports; `block_kernel` checks that once per (device, dtype, head size) with a tiny
forward and backward against the math kernel, and under "auto" falls back to the math kernel
(`cp/kernel.py`) with the reason logged.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from longrun.trainer.cp.kernel import Grads, MathKernel, Partial
from longrun.trainer.cp.layout import TokenStream

log = logging.getLogger(__name__)

KernelChoice = Literal["auto", "flash", "math"]
KERNEL_CHOICES: tuple[str, ...] = ("auto", "flash", "math")


# --- which queries meet which keys, as runs ----------------------------------------------------


def _runs(s: TokenStream) -> dict[int, list[tuple[int, int, int]]]:
    """Document -> its runs in `s` (first local row, first position, length): valid tokens of
    one document at consecutive rows and positions."""
    idx = np.flatnonzero(s.valid)
    if len(idx) == 0:
        return {}
    doc, pos = s.doc[idx], s.pos[idx]
    cut = (np.diff(idx) != 1) | (np.diff(doc) != 0) | (np.diff(pos) != 1)
    starts = np.concatenate(([0], np.flatnonzero(cut) + 1)).tolist()
    ends = [*starts[1:], len(idx)]
    runs: dict[int, list[tuple[int, int, int]]] = {}
    for a, b in zip(starts, ends, strict=True):
        runs.setdefault(int(doc[a]), []).append((int(idx[a]), int(pos[a]), b - a))
    return runs


@dataclass(frozen=True)
class Segment:
    """Consecutive local queries and the key runs they see: every run whole, except, when
    `causal`, the last one, which ends at the last query's position (bottom-right causal)."""

    q_row: int
    q_len: int
    keys: tuple[tuple[int, int], ...]  # (first local key row, length)
    causal: bool

    @property
    def k_len(self) -> int:
        return sum(n for _, n in self.keys)


def segments(q: TokenStream, k: TokenStream) -> list[Segment]:
    """This block's queries against its keys, split so that each query is in at most one
    segment and each segment is one flash call (or one sequence of a varlen call)."""
    q_runs, k_runs = _runs(q), _runs(k)
    out = []
    for d, runs in q_runs.items():
        keys = k_runs.get(d)
        if not keys:
            continue
        for row, qa, n in runs:
            qb = qa + n
            cuts = sorted({qa, qb} | {x for _, ka, m in keys for x in (ka, ka + m) if qa < x < qb})
            for s, e in itertools.pairwise(cuts):
                whole = tuple((kr, m) for kr, ka, m in keys if ka + m <= s)
                # the key run holding position s ends at or after e (its end is a cut): it is
                # seen up to each query's own position
                edge = tuple((kr, e - ka) for kr, ka, m in keys if ka <= s < ka + m)
                if whole or edge:
                    out.append(Segment(row + s - qa, e - s, whole + edge, bool(edge)))
    return out


def _rows(runs: list[tuple[int, int]], device: torch.device) -> Tensor:
    """The local rows of (first row, length) runs, concatenated, built on the device."""
    starts = torch.tensor([r for r, _ in runs], dtype=torch.int64).to(device, non_blocking=True)
    lengths = torch.tensor([n for _, n in runs], dtype=torch.int64).to(device, non_blocking=True)
    total = sum(n for _, n in runs)
    shift = starts - (torch.cumsum(lengths, 0) - lengths)
    return torch.arange(total, device=device) + torch.repeat_interleave(shift, lengths,
                                                                        output_size=total)


def _select(runs: tuple[tuple[int, int], ...], device: torch.device) -> slice | Tensor:
    """One run is a slice (a view, no copy); several are gathered by index."""
    if len(runs) == 1:
        row, n = runs[0]
        return slice(row, row + n)
    return _rows(list(runs), device)


def _take(x: Tensor, rows: slice | Tensor) -> Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def _add(acc: Tensor, rows: slice | Tensor, x: Tensor) -> None:
    """acc[rows] += x, in acc's (float32) precision."""
    if isinstance(rows, slice):
        acc[rows] += x
    else:
        acc.index_add_(0, rows, x.to(acc.dtype))


def merge(p: Partial, rows: slice | Tensor, o: Tensor, lse: Tensor) -> None:
    """Fold one block's output o [n, H, D] and log-sum-exp [n, H] for the queries `rows` into
    the running ones. Every query in a segment sees a key, so `lse` is finite."""
    old = _take(p.lse, rows)
    new = torch.logaddexp(old, lse)
    merged = _take(p.out, rows) * torch.exp(old - new).unsqueeze(-1) \
        + o.float() * torch.exp(lse - new).unsqueeze(-1)
    if isinstance(rows, slice):
        p.out[rows], p.lse[rows] = merged, new
    else:
        p.out.index_copy_(0, rows, merged)
        p.lse.index_copy_(0, rows, new)


# --- CPU: the flash-for-CPU SDPA op, one call per tile -----------------------------------------


@dataclass(frozen=True)
class _Tile:
    q: slice
    k: slice | Tensor
    causal: bool  # top-left aligned: a square diagonal


class CpuFlashPlan:
    """A block's segments as the CPU op's calls. The op's causal mask is aligned top-left, so
    a causal segment is two tiles: its keys before the first query's position, seen whole, and
    the square diagonal; the two merge like any two blocks."""

    def __init__(self, segs: list[Segment], device: torch.device):
        self.tiles: list[_Tile] = []
        for s in segs:
            q = slice(s.q_row, s.q_row + s.q_len)
            whole = s.keys
            if s.causal:
                row, n = s.keys[-1]
                whole = s.keys[:-1] + (((row, n - s.q_len),) if n > s.q_len else ())
                self.tiles.append(_Tile(q, slice(row + n - s.q_len, row + n), True))
            if whole:
                self.tiles.append(_Tile(q, _select(whole, device), False))

    def forward(self, p: Partial, k: Tensor, v: Tensor) -> None:
        scale = k.shape[-1] ** -0.5
        for t in self.tiles:
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                _bhld(p.x[t.q]), _bhld(_take(k, t.k)), _bhld(_take(v, t.k)), 0.0, t.causal,
                scale=scale)
            merge(p, t.q, o[0].transpose(0, 1), lse[0].transpose(0, 1))

    def backward(self, g: Grads, k: Tensor, v: Tensor, dk: Tensor, dv: Tensor) -> None:
        scale = k.shape[-1] ** -0.5
        for t in self.tiles:
            dq_t, dk_t, dv_t = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _bhld(g.do[t.q]), _bhld(g.x[t.q]), _bhld(_take(k, t.k)), _bhld(_take(v, t.k)),
                _bhld(g.out[t.q]), g.lse[t.q].t().contiguous()[None], 0.0, t.causal, scale=scale)
            _add(g.dq, t.q, dq_t[0].transpose(0, 1))
            _add(dk, t.k, dk_t[0].transpose(0, 1))
            _add(dv, t.k, dv_t[0].transpose(0, 1))


def _bhld(x: Tensor) -> Tensor:
    """Token-major [L, H, D] -> the op's [1, H, L, D] (a view)."""
    return x.transpose(0, 1)[None]


# --- CUDA: varlen flash attention, one call per kind of segment --------------------------------


@dataclass(frozen=True)
class _Batch:
    """Segments of one kind as one varlen batch: gathered query and key rows, offsets."""

    causal: bool
    q_rows: Tensor
    k_rows: Tensor
    cu_q: Tensor  # int32 [n + 1]
    cu_k: Tensor
    max_q: int
    max_k: int


class VarlenPlan:
    def __init__(self, segs: list[Segment], device: torch.device):
        self.batches = []
        for causal in (True, False):
            mine = [s for s in segs if s.causal == causal]
            if not mine:
                continue
            q_len = [s.q_len for s in mine]
            k_len = [s.k_len for s in mine]

            def offsets(lengths):
                return torch.tensor(np.concatenate(([0], np.cumsum(lengths))),
                                    dtype=torch.int32).to(device, non_blocking=True)

            self.batches.append(_Batch(
                causal, _rows([(s.q_row, s.q_len) for s in mine], device),
                _rows([run for s in mine for run in s.keys], device), offsets(q_len),
                offsets(k_len), max(q_len), max(k_len)))

    def forward(self, p: Partial, k: Tensor, v: Tensor) -> None:
        for b in self.batches:
            o, lse = _varlen_forward(p.x.index_select(0, b.q_rows), k.index_select(0, b.k_rows),
                                     v.index_select(0, b.k_rows), b)
            merge(p, b.q_rows, o, lse.t())

    def backward(self, g: Grads, k: Tensor, v: Tensor, dk: Tensor, dv: Tensor) -> None:
        for b in self.batches:
            dq_b, dk_b, dv_b = torch.ops.aten._flash_attention_backward(
                g.do.index_select(0, b.q_rows), g.x.index_select(0, b.q_rows),
                k.index_select(0, b.k_rows), v.index_select(0, b.k_rows),
                g.out.index_select(0, b.q_rows), g.lse.index_select(0, b.q_rows).t().contiguous(),
                b.cu_q, b.cu_k, b.max_q, b.max_k, 0.0, b.causal,
                torch.zeros(2, dtype=torch.uint64, device=g.x.device),  # no dropout: unused
                torch.empty(0, device=g.x.device), scale=k.shape[-1] ** -0.5)
            _add(g.dq, b.q_rows, dq_b)
            _add(dk, b.k_rows, dk_b)
            _add(dv, b.k_rows, dv_b)


@functools.cache
def _parameters(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _varlen_forward(q: Tensor, k: Tensor, v: Tensor, b: _Batch) -> tuple[Tensor, Tensor]:
    """varlen_attn's output and log-sum-exp [H, n], whichever of its keyword spellings this
    torch has (`window_size` (-1, 0) for causal, or an older `is_causal`)."""
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    params = _parameters(varlen_attn)
    kwargs: dict = {"return_aux": AuxRequest(lse=True)}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if b.causal else (-1, -1)
    else:
        kwargs["is_causal"] = b.causal
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    if "scale" in params:
        kwargs["scale"] = q.shape[-1] ** -0.5
    return varlen_attn(q, k, v, b.cu_q, b.cu_k, b.max_q, b.max_k, **kwargs)


# --- the kernel and the choice ------------------------------------------------------------------


class FlashKernel:
    """The block-kernel interface of the ring (`cp/ring.py`, `MathKernel`) on flash calls:
    token-major layout, queries and K/V in the inputs' dtype, out and lse merged in float32."""

    name = "flash"

    def plan(self, q: TokenStream, k: TokenStream, device: torch.device) -> CpuFlashPlan | VarlenPlan:
        segs = segments(q, k)
        return VarlenPlan(segs, device) if device.type == "cuda" else CpuFlashPlan(segs, device)

    def forward_start(self, q: Tensor, kv_heads: int) -> Partial:
        t, h, d = q.shape
        return Partial(q, torch.zeros(t, h, d, dtype=torch.float32, device=q.device),
                       torch.full((t, h), float("-inf"), dtype=torch.float32, device=q.device))

    def forward_block(self, p: Partial, k: Tensor, v: Tensor, plan) -> None:
        plan.forward(p, k.to(p.x.dtype), v.to(p.x.dtype))

    def output(self, p: Partial, q: Tensor) -> Tensor:
        return p.out.to(q.dtype)

    def backward_start(self, q: Tensor, dout: Tensor, out: Tensor, lse: Tensor) -> Grads:
        return Grads(q, dout.to(q.dtype), out.to(q.dtype), lse, torch.zeros(q.shape, dtype=torch.float32,
                                                                            device=q.device))

    def backward_block(self, g: Grads, k: Tensor, v: Tensor, plan, dk: Tensor, dv: Tensor) -> None:
        plan.backward(g, k.to(g.x.dtype), v.to(g.x.dtype), dk, dv)

    def dq(self, g: Grads, q: Tensor) -> Tensor:
        return g.dq.to(q.dtype)


FLASH, MATH = FlashKernel(), MathKernel()


def flash_unavailable(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the flash kernel cannot run on these inputs, or None when it can."""
    if device.type == "cpu":
        if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
            return f"torch {torch.__version__} has no flash-for-CPU SDPA op"
        if dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            return f"the flash-for-CPU op takes floating-point inputs, not {dtype}"
        return None
    if device.type != "cuda":
        return f"no flash kernel on {device.type}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"flash attention on CUDA takes bf16 or fp16 inputs, not {dtype} (train under bf16 autocast)"
    return _varlen_probe(device, dtype, head_dim)


@functools.cache
def _varlen_probe(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """One tiny block (GQA, a causal and a whole segment) through the varlen kernel, forward and
    backward, against the math kernel: the API and the lse layout are what this module
    assumes, or the reason they are not."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if "return_aux" not in _parameters(varlen_attn):
        return f"torch {torch.__version__}'s varlen_attn cannot return the log-sum-exp (no return_aux)"
    lengths = np.array([24])
    q_stream = TokenStream(np.zeros(16, np.int64), np.arange(8, 24), lengths)
    k_stream = TokenStream(np.zeros(16, np.int64), np.arange(16), lengths)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(16, 4, head_dim, device=device, generator=g).to(dtype)
    k, v = (torch.randn(16, 2, head_dim, device=device, generator=g).to(dtype) for _ in range(2))
    do = torch.randn(16, 4, head_dim, device=device, generator=g).to(dtype)
    with torch.autocast(device.type, enabled=False):
        try:
            got = one_block(FLASH, FLASH.plan(q_stream, k_stream, device), q, k, v, do)
        except Exception as exc:  # whatever this torch's kernel refuses is the reason to fall back
            return f"varlen flash attention failed on a probe block: {type(exc).__name__}: {exc}"
        want = one_block(MATH, MATH.plan(q_stream, k_stream, device), q, k, v, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        err = float((a.float() - b.float()).abs().max() / b.float().abs().max())
        if not err < 0.05:
            return (f"varlen flash attention disagrees with the math kernel on a probe block "
                    f"({name} off by {err:.2g})")
    return None


def one_block(kernel, plan, q: Tensor, k: Tensor, v: Tensor, do: Tensor) -> tuple[Tensor, ...]:
    """One block's forward and backward through a kernel's interface, as the ring drives it:
    the output and dq in q's dtype, dk and dv in float32."""
    p = kernel.forward_start(q, k.shape[1])
    kernel.forward_block(p, k, v, plan)
    g = kernel.backward_start(q, do, p.out, p.lse)
    dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (k, v))
    kernel.backward_block(g, k, v, plan, dk, dv)
    return kernel.output(p, q), kernel.dq(g, q), dk, dv


_logged: set[str] = set()


def block_kernel(choice: KernelChoice, q: Tensor) -> FlashKernel | MathKernel:
    """The kernel for these queries: "math" today's float32 kernel; "flash" the flash kernel or
    a refusal saying why not; "auto" flash where it applies, else math with the reason logged."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"the CP block kernel must be one of {KERNEL_CHOICES}, got {choice!r}")
    if choice == "math":
        return MATH
    why = flash_unavailable(q.device, q.dtype, q.shape[-1])
    if why is None:
        return FLASH
    if choice == "flash":
        raise ValueError(f"the flash CP kernel cannot run here: {why}; use kernel 'auto' or 'math'")
    if why not in _logged:
        _logged.add(why)
        log.warning("context-parallel attention falls back to the float32 math kernel: %s", why)
    return MATH
