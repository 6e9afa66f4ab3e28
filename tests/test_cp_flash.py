"""The flash block kernel of context parallelism (`trainer/cp/flash.py`): ring, Ulysses and USP
over real gloo processes equal SDPA on the gathered documents, forward and gradients, with
packed documents of odd lengths and GQA, in float32 and bf16, and the flash op really ran
(counted by the profiler); the segments it attends reproduce the causal, per-document mask
exactly; the kernel choice falls back to the math kernel only with a reason."""

from __future__ import annotations

import itertools
import logging

import cp_workers as w
import numpy as np
import pytest
import torch
from worlds import run_world

from longrun.trainer.cp.attention import ContextParallelAttention, CPGroups
from longrun.trainer.cp.flash import FLASH, MATH, block_kernel, flash_unavailable, one_block, segments
from longrun.trainer.cp.layout import ShardLayout, TokenStream
from longrun.trainer.cp.ring import Ring, ring_attention

# (impl, cp, zigzag, n_heads, kv_heads, ulysses_size); GQA in every case
CASES = [
    ("ring", 4, True, 4, 2, 1),
    ("ring", 4, False, 4, 2, 1),
    ("ulysses", 4, True, 8, 2, 4),  # fewer KV heads than the Ulysses degree
    ("usp", 4, True, 4, 2, 2),  # Ulysses 2 inside, ring 2 across
]


def _check(out, cases, tolerance):
    assert len(out) == 4 * len(cases)
    for rank, case, e in out:
        assert e["finite"], (rank, case)
        # the flash op did the attention, forward and backward, on every rank
        assert e["flash_forward"] > 0 and e["flash_backward"] > 0, (rank, case, e)
        for name in ("out", "dq", "dk", "dv"):
            assert e[name] < tolerance, (rank, case, name, e[name])
        assert e["pad_kv_grad"] == 0.0, (rank, case)  # padding is never a key
        assert e["pad_out"] == 0.0, (rank, case)  # padding queries see nothing


def test_flash_cp_attention_equals_sdpa_on_the_whole_sequence_in_float32(tmp_path):
    out = run_world(w.attention_matches_reference, 4, tmp_path, per_rank=len(CASES),
                    args=(CASES, "flash", "float32"), timeout=300)
    _check(out, CASES, 1e-5)  # float32 kernel against a float64 reference


def test_flash_cp_attention_equals_sdpa_on_the_whole_sequence_in_bf16(tmp_path):
    cases = [CASES[0], CASES[3]]
    out = run_world(w.attention_matches_reference, 4, tmp_path, per_rank=len(cases),
                    args=(cases, "flash", "bfloat16"), timeout=300)
    assert {e["dtype"] for _, _, e in out} == {"torch.bfloat16"}
    # bf16 products and outputs (8 bits of mantissa) against float64 on the same inputs
    _check(out, cases, 2e-2)


FLASH_OPS = {"cpu": w.FLASH_OPS,
             "cuda": ("aten::_flash_attention_forward", "aten::_flash_attention_backward")}


@pytest.mark.parametrize("device,dtype,tolerance", [
    ("cpu", torch.float32, 1e-5), ("cpu", torch.bfloat16, 2e-2),
    pytest.param("cuda", torch.bfloat16, 2e-2, marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="the varlen flash path needs a CUDA device")),
])
def test_one_rank_flash_attention_equals_sdpa_per_document(device, dtype, tolerance):
    """A ring of one holding each document's second half before its first: the second half
    sees the first whole and itself causally (bottom-right), the first half itself. On CUDA
    this is the varlen path, which no CPU test reaches."""
    lengths = [*w.LENGTHS, 301]
    starts = np.cumsum([0, *lengths[:-1]])
    order = np.concatenate([np.r_[s + n // 2:s + n, s:s + n // 2]
                            for s, n in zip(starts, lengths, strict=True)])
    doc = np.repeat(np.arange(len(lengths)), lengths)
    stream = TokenStream(doc, order - starts[doc], np.array(lengths))
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(sum(lengths), n, 64, generator=g, dtype=torch.float64).to(dtype).double()
                     for n in (8, 2, 2, 8))
    ref_q, ref_k, ref_v = (x.clone().requires_grad_() for x in (q, k, v))
    ref = w.reference_attention(ref_q, ref_k, ref_v, lengths)
    (ref * dout).sum().backward()
    rows = torch.from_numpy(order)
    lq, lk, lv, ldo = (x[rows].to(device, dtype) for x in (q, k, v, dout))
    lq, lk, lv = (x.requires_grad_() for x in (lq, lk, lv))
    ring = Ring(None, 0, (stream,), torch.device(device))
    assert flash_unavailable(lq.device, dtype, 64) is None  # or the reason it falls back
    assert block_kernel(ring.kernel, lq) is FLASH
    with torch.profiler.profile() as prof:
        out = ring_attention(lq, lk, lv, ring)
        (out * ldo).sum().backward()
    ran = [e.name for e in prof.events()]
    assert all(ran.count(op) > 0 for op in FLASH_OPS[device]), sorted(set(ran))
    for name, mine, want in (("out", out, ref), ("dq", lq.grad, ref_q.grad), ("dk", lk.grad, ref_k.grad),
                             ("dv", lv.grad, ref_v.grad)):
        assert w._rel_err(mine.detach().cpu(), want.detach(), rows) < tolerance, name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the varlen flash path needs a CUDA device"))])
def test_a_flash_block_equals_the_math_block_where_queries_start_inside_a_key_run(device):
    """Queries at positions 8..23 of a document against keys at 0..15 of it: 8..15 see a key run
    that starts before them up to themselves, 16..23 see it whole; the flash kernel (on the CPU
    a whole tile and a diagonal tile) equals the math kernel, forward and backward."""
    lengths = np.array([24, 5])
    q_stream = TokenStream(np.r_[np.zeros(16, np.int64), np.ones(5, np.int64)], np.r_[8:24, 0:5], lengths)
    k_stream = TokenStream(np.r_[np.zeros(16, np.int64), np.ones(3, np.int64)], np.r_[0:16, 2:5], lengths)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(t, n, 64, generator=g).to(device, dtype) for t, n in ((21, 4), (19, 2),
                                                                                       (19, 2), (21, 4)))
    dev = torch.device(device)
    got = one_block(FLASH, FLASH.plan(q_stream, k_stream, dev), q, k, v, do)
    want = one_block(MATH, MATH.plan(q_stream, k_stream, dev), q, k, v, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        err = float((a.float() - b.float()).abs().max() / b.float().abs().max())
        assert err < (1e-5 if device == "cpu" else 2e-2), (name, err)


def _visible(seg_list, n_queries):
    """Query row -> the key rows its segment lets it see (bottom-right causal on the last run)."""
    seen = {}
    for s in seg_list:
        keys = [r for row, n in s.keys for r in range(row, row + n)]
        for i in range(s.q_len):
            assert s.q_row + i not in seen, "a query in two segments of one block"
            hidden = s.q_len - 1 - i if s.causal else 0  # the edge run's last keys
            seen[s.q_row + i] = set(keys[:len(keys) - hidden])
    assert all(0 <= r < n_queries for r in seen)
    return seen


@pytest.mark.parametrize("cp,zigzag,u", [(2, True, 1), (4, True, 1), (4, False, 1), (4, True, 2),
                                         (4, True, 4), (8, True, 2)])
def test_segments_reproduce_the_causal_document_mask_exactly(cp, zigzag, u):
    layout = ShardLayout(np.array([*w.LENGTHS, 301]), cp, zigzag)
    # what each ring member holds: under Ulysses its group's tokens, document-major
    members = [layout.streams[r].concat_doc_major(list(layout.streams[r + 1:r + u]))[0]
               for r in range(0, cp, u)]
    for q, k in itertools.product(members, repeat=2):
        want = {i: {j for j in range(len(k))
                    if k.valid[j] and k.doc[j] == q.doc[i] and k.pos[j] <= q.pos[i]}
                for i in range(len(q)) if q.valid[i]}
        got = _visible(segments(q, k), len(q))
        assert {i: s for i, s in got.items() if s} == {i: s for i, s in want.items() if s}
        assert all(got[i] for i in got)  # no segment holds a query that sees nothing


def test_the_kernel_choice_falls_back_only_with_a_reason(caplog):
    q = torch.zeros(4, 2, 8)
    assert block_kernel("auto", q) is FLASH and block_kernel("flash", q) is FLASH
    assert block_kernel("math", q) is MATH
    nowhere = torch.zeros(4, 2, 8, device="meta")
    with caplog.at_level(logging.WARNING, logger="longrun.trainer.cp.flash"):
        assert block_kernel("auto", nowhere) is MATH
    assert "falls back to the float32 math kernel: no flash kernel on meta" in caplog.text
    with pytest.raises(ValueError, match="flash CP kernel cannot run here: no flash kernel on meta"):
        block_kernel("flash", nowhere)
    with pytest.raises(ValueError, match="must be one of"):
        block_kernel("fast", q)
    with pytest.raises(ValueError, match="must be one of"):
        ContextParallelAttention(ShardLayout(np.array([5]), 1), CPGroups.alone(),
                                 torch.device("cpu"), "fast")
