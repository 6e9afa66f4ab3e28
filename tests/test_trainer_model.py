"""The decoder over packed documents: isolation between documents, causality, GQA, parameter
and FLOP accounting, initialisation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from longrun.config.sections import ModelSection
from longrun.trainer.model import PackedLayout, Transformer, packed_causal_attention


def _model(**overrides) -> Transformer:
    torch.manual_seed(0)
    fields = {"dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64} | overrides
    return Transformer(ModelSection(**fields)).eval()


def _pack(lengths: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (sum(lengths),), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return tokens, positions, cu


def _reference_attention(q, k, v, lengths):
    """Dense block-diagonal causal mask: the definition, independent of the bucketing."""
    t = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = (doc[:, None] == doc[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize(
    "lengths", [[1], [7], [3, 5, 4, 9, 1, 16, 2], [40, 1, 1, 2, 33, 17, 8, 8, 8], [64] * 3]
)
def test_packed_attention_matches_block_diagonal_reference(kv_heads, lengths):
    g = torch.Generator().manual_seed(1)
    t = sum(lengths)
    q = torch.randn(t, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(t, kv_heads, 8, generator=g, requires_grad=True)
    v = torch.randn(t, kv_heads, 8, generator=g, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    layout = PackedLayout.from_cu_seqlens(cu, t, q.device)
    out = packed_causal_attention(q, k, v, layout)
    ref = _reference_attention(q, k, v, lengths)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # Gradients too: the padding inside the buckets must contribute nothing.
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_attention_never_crosses_documents():
    model = _model()
    lengths = [5, 9, 7]  # documents 0 and 2 share a length bucket, 1 is in another
    tokens, positions, cu = _pack(lengths)
    base = model(tokens, positions, cu)
    for doc in range(3):
        lo, hi = int(cu[doc]), int(cu[doc + 1])
        changed = tokens.clone()
        changed[lo:hi] = (changed[lo:hi] + 1) % 256
        out = model(changed, positions, cu)
        assert not torch.allclose(out[lo:hi], base[lo:hi]), "perturbing a document must matter"
        others = torch.ones(len(tokens), dtype=torch.bool)
        others[lo:hi] = False
        torch.testing.assert_close(out[others], base[others], atol=1e-6, rtol=0)


def test_packed_equals_each_document_alone():
    """Positions restart per document: a document's logits do not depend on its neighbours
    or on where in the stream it sits."""
    model = _model(n_kv_heads=2)
    lengths = [12, 3, 30, 1, 8]
    tokens, positions, cu = _pack(lengths, seed=3)
    packed = model(tokens, positions, cu)
    for doc, n in enumerate(lengths):
        lo = int(cu[doc])
        alone = model(tokens[lo : lo + n], torch.arange(n),
                      torch.tensor([0, n], dtype=torch.int32))
        torch.testing.assert_close(packed[lo : lo + n], alone, atol=1e-5, rtol=1e-5)


def test_causality_within_a_document():
    model = _model()
    tokens, positions, cu = _pack([20, 11])
    base = model(tokens, positions, cu)
    p = 8
    changed = tokens.clone()
    changed[p] = (changed[p] + 7) % 256
    out = model(changed, positions, cu)
    torch.testing.assert_close(out[:p], base[:p], atol=1e-6, rtol=0)
    assert not torch.allclose(out[p], base[p])
    assert not torch.allclose(out[p + 1 : 20], base[p + 1 : 20])


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_grouped_query_attention_shapes(kv_heads):
    model = _model(n_kv_heads=kv_heads)
    attn = model.layers[0].attention
    head_dim = 64 // 4
    assert attn.wq.weight.shape == (4 * head_dim, 64)
    assert attn.wk.weight.shape == (kv_heads * head_dim, 64)
    assert attn.wv.weight.shape == (kv_heads * head_dim, 64)
    tokens, positions, cu = _pack([10, 6])
    assert model(tokens, positions, cu).shape == (16, 260)
    full = _model(n_kv_heads=4).num_params()
    saved = 2 * 2 * (4 - kv_heads) * head_dim * 64  # n_layers x (wk, wv)
    assert model.num_params() == full - saved


def test_tied_and_untied_parameter_counts():
    tied, untied = _model(tie_embeddings=True), _model(tie_embeddings=False)
    table = 260 * 64
    assert untied.num_params() - tied.num_params() == table
    assert tied.output.weight is tied.tok_embeddings.weight
    assert tied.num_params(exclude_embedding=True) == tied.num_params() - table
    assert untied.num_params(exclude_embedding=True) == untied.num_params() - table
    # Both do the same matmuls, so they cost the same FLOPs per token.
    assert tied.flops_per_token(64) == untied.flops_per_token(64)


def test_flops_per_token_follows_palm():
    model = _model(tie_embeddings=False)
    cfg = model.cfg
    n = model.num_params(exclude_embedding=True)
    expected = 6 * n + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 48
    assert model.flops_per_token(48) == pytest.approx(expected)
    assert model.flops_per_token(64) > model.flops_per_token(32)


def test_hidden_dim_and_init_scales():
    model = _model(n_layers=4, dim=128)
    ff = model.layers[0].feed_forward
    assert ff.w1.weight.shape == (model.cfg.hidden_dim, 128) == (384, 128)
    wq, wo = model.layers[0].attention.wq.weight, model.layers[0].attention.wo.weight
    assert wq.std().item() == pytest.approx(0.02, rel=0.1)
    assert wo.std().item() == pytest.approx(0.02 / math.sqrt(2 * 4), rel=0.1)
    assert ff.w2.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.1)
    assert torch.equal(model.norm.weight, torch.ones(128))


def test_bad_packing_inputs_are_rejected():
    model = _model()
    tokens, positions, cu = _pack([4, 4])
    with pytest.raises(ValueError, match="end at the number of tokens"):
        model(tokens, positions, torch.tensor([0, 4, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="1-D"):
        model(tokens[None], positions[None], cu)
    long_tokens, long_pos, long_cu = _pack([65])
    with pytest.raises(ValueError, match="max_seq_len"):
        model(long_tokens, long_pos.clamp(max=63), long_cu)
