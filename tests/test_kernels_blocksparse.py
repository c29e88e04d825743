"""The block-sparse executor's Triton kernel under TRITON_INTERPRET=1, against the torch path
(``block_sparse_prefill``) and a dense masked softmax written from ``block_mask_reference``."""
import math

import pytest
import torch

pytest.importorskip("triton")

import longpatch.kernels.blocksparse as KB  # noqa: E402
from longpatch.kernels.blocksparse import block_sparse_attention  # noqa: E402
from longpatch.methods.blocksparse import block_mask_reference, block_sparse_prefill  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def random_blocks(b, hk, n, block, S, seed=0, empty=()):
    """Per (batch, KV head, query block i): a random subset of range(i) of at most S blocks, at random
    slots among -1 padding. Query blocks in ``empty`` get an empty list."""
    g = torch.Generator().manual_seed(seed)
    nb = math.ceil(n / block)
    out = torch.full((b, hk, nb, S), -1, dtype=torch.long)
    for bi in range(b):
        for h in range(hk):
            for i in range(nb):
                if i in empty:
                    continue
                size = int(torch.randint(0, min(i, S) + 1, (1,), generator=g))
                pick = torch.randperm(i, generator=g)[:size]
                slots = torch.randperm(S, generator=g)[:size]
                out[bi, h, i, slots] = pick
    return out


def qkv(b, hq, hk, n, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g).to(dtype) for h in (hq, hk, hk)]


def dense_reference(q, k, v, blocks, block, scale):
    """softmax over the keys of block_mask_reference, in float64: (out, lse)."""
    hq, hk, n = q.shape[1], k.shape[1], q.shape[2]
    mask = block_mask_reference(blocks, n, block).repeat_interleave(hq // hk, dim=1)
    kk = k.double().repeat_interleave(hq // hk, dim=1)
    vv = v.double().repeat_interleave(hq // hk, dim=1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ vv, lse


CASES = [  # b, hq, hk, n, S
    (1, 2, 2, 64, 2),    # hq == hk, n a multiple of the block
    (2, 4, 2, 75, 3),    # GQA, ragged last block, batch 2
    (1, 4, 2, 80, 5),    # S larger than most rows' choices: mostly -1 padding
    (1, 2, 1, 40, 1),    # hk = 1
]


@pytest.mark.parametrize("b,hq,hk,n,S", CASES)
def test_forward_matches_torch_path_and_dense(b, hq, hk, n, S):
    q, k, v = qkv(b, hq, hk, n, 16)
    blocks = random_blocks(b, hk, n, 16, S, seed=n)
    scale = 16 ** -0.5
    out, lse = block_sparse_attention(q, k, v, blocks, 16, scale)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    ref, ref_lse = block_sparse_prefill(q, k, v, blocks, 16, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-5, rtol=1e-5)
    dense, dense_lse = dense_reference(q, k, v, blocks, 16, scale)
    torch.testing.assert_close(out, dense.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, dense_lse.float(), atol=1e-5, rtol=1e-5)


def test_empty_lists_and_all_padding():
    """Rows whose list is empty (all -1) attend to their own block only; S = 0 works too."""
    q, k, v = qkv(1, 4, 2, 70, 16, seed=1)
    blocks = random_blocks(1, 2, 70, 16, 3, seed=2, empty=(2, 4))
    assert (blocks[:, :, [0, 2, 4]] == -1).all()
    out, lse = block_sparse_attention(q, k, v, blocks, 16, 0.3)
    ref, ref_lse = dense_reference(q, k, v, blocks, 16, 0.3)
    torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-5, rtol=1e-5)
    none = torch.full((1, 2, 5, 0), -1, dtype=torch.long)
    out0, lse0 = block_sparse_attention(q, k, v, none, 16, 0.3)
    ref0, ref_lse0 = dense_reference(q, k, v, none, 16, 0.3)
    torch.testing.assert_close(out0, ref0.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse0, ref_lse0.float(), atol=1e-5, rtol=1e-5)


def test_strided_inputs_odd_head_dim_and_split_blocks(monkeypatch):
    """Non-contiguous q/k/v, a head dim that is no power of two, and a block of 32 split into two
    16-row tiles (the multi-tile path of larger blocks)."""
    monkeypatch.setattr(KB, "_MAX_TILE", 16)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 72, 4, 20, generator=g).transpose(1, 2)  # [1, 4, 72, 20], strided
    kv = torch.randn(1, 72, 2, 2, 20, generator=g)
    k, v = kv[:, :, :, 0].transpose(1, 2), kv[:, :, :, 1].transpose(1, 2)
    blocks = random_blocks(1, 2, 72, 32, 2, seed=4)
    out, lse = block_sparse_attention(q, k, v, blocks, 32, 0.25)
    ref, ref_lse = dense_reference(q, k, v, blocks, 32, 0.25)
    torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    q, k, v = qkv(1, 4, 2, 64, 16, dtype=dtype, seed=5)
    blocks = random_blocks(1, 2, 64, 16, 2, seed=6)
    out, lse = block_sparse_attention(q, k, v, blocks, 16, 0.25)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref, ref_lse = dense_reference(q, k, v, blocks, 16, 0.25)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse, ref_lse.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("hq,hk,n", [(4, 2, 75), (2, 2, 48)])
def test_gradients_match_torch_path(hq, hk, n):
    q, k, v = (t.requires_grad_() for t in qkv(1, hq, hk, n, 16, seed=7))
    blocks = random_blocks(1, hk, n, 16, 2, seed=8)
    out, lse = block_sparse_attention(q, k, v, blocks, 16, 0.25)
    ref, ref_lse = block_sparse_prefill(q, k, v, blocks, 16, 0.25)
    do, dl = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out * do).sum() + (lse * dl).sum(), (q, k, v))
    want = torch.autograd.grad((ref * do).sum() + (ref_lse.float() * dl).sum(), (q, k, v))
    for a, w in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block,tile,d", [(32, 16, 16), (24, 64, 20)])
def test_gradients_split_tiles_and_odd_sizes(monkeypatch, block, tile, d):
    """Backward with a block split into two tiles, and with a block and head dim that are no powers
    of two (masked tiles)."""
    monkeypatch.setattr(KB, "_MAX_TILE", tile)
    q, k, v = (t.requires_grad_() for t in qkv(1, 4, 2, 72, d, seed=13))
    blocks = random_blocks(1, 2, 72, block, 2, seed=14)
    out, lse = block_sparse_attention(q, k, v, blocks, block, 0.25)
    ref, ref_lse = block_sparse_prefill(q, k, v, blocks, block, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    do, dl = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out * do).sum() + (lse * dl).sum(), (q, k, v))
    want = torch.autograd.grad((ref * do).sum() + (ref_lse.float() * dl).sum(), (q, k, v))
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)


def test_gradient_through_lse_only():
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 1, 40, 16, seed=9))
    blocks = random_blocks(1, 1, 40, 16, 1, seed=10)
    _, lse = block_sparse_attention(q, k, v, blocks, 16, 0.25)
    _, ref_lse = block_sparse_prefill(q, k, v, blocks, 16, 0.25)
    got = torch.autograd.grad(lse.sum(), (q, k, v), allow_unused=True)
    want = torch.autograd.grad(ref_lse.sum(), (q, k, v), allow_unused=True)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, torch.zeros_like(a) if w is None else w, atol=1e-5, rtol=1e-5)


def test_causal_future_keys_do_not_leak():
    q, k, v = qkv(1, 4, 2, 64, 16, seed=11)
    blocks = random_blocks(1, 2, 64, 16, 3, seed=12)
    out, lse = block_sparse_attention(q, k, v, blocks, 16, 0.25)
    for p in (37, 48):  # mid-block and at a block boundary
        k2, v2 = k.clone(), v.clone()
        k2[:, :, p:] = torch.randn_like(k2[:, :, p:]) * 10
        v2[:, :, p:] = torch.randn_like(v2[:, :, p:]) * 10
        out2, lse2 = block_sparse_attention(q, k2, v2, blocks, 16, 0.25)
        assert torch.equal(out2[:, :, :p], out[:, :, :p])
        assert torch.equal(lse2[:, :, :p], lse[:, :, :p])
        assert not torch.equal(out2[:, :, p:], out[:, :, p:])


def test_bad_arguments_raise():
    q, k, v = qkv(1, 3, 2, 32, 16)
    with pytest.raises(ValueError, match="multiple"):
        block_sparse_attention(q, k, v, random_blocks(1, 2, 32, 16, 1), 16, 0.25)
    q, k, v = qkv(1, 2, 2, 32, 16)
    with pytest.raises(ValueError, match="blocks must be"):
        block_sparse_attention(q, k, v, random_blocks(1, 2, 48, 16, 1), 16, 0.25)
    with pytest.raises(ValueError, match="head dim"):
        q, k, v = qkv(1, 2, 2, 16, 512)
        block_sparse_attention(q, k, v, random_blocks(1, 2, 16, 16, 1), 16, 0.25)
