import pytest
import torch
from helpers import dense_attention

from longpatch.ops import exact_attention, merge_lse


@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("nq,nk", [(37, 37), (5, 37), (1, 20)])
def test_exact_matches_dense_oracle(hq, hk, causal, nq, nk):
    q, k, v = torch.randn(2, hq, nq, 16), torch.randn(2, hk, nk, 16), torch.randn(2, hk, nk, 16)
    ref, ref_lse = dense_attention(q, k, v, causal=causal)
    out = exact_attention(q, k, v, causal=causal)
    out2, lse = exact_attention(q, k, v, causal=causal, return_lse=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_exact_with_mask_and_scale():
    q, k, v = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    mask = torch.rand(1, 1, 9, 9) > 0.3
    mask[..., 0] = True  # every row sees key 0 (causal keeps it)
    ref, ref_lse = dense_attention(q, k, v, causal=True, scale=0.3, mask=mask)
    out = exact_attention(q, k, v, causal=True, scale=0.3, attn_mask=mask)
    out2, lse = exact_attention(q, k, v, causal=True, scale=0.3, attn_mask=mask, return_lse=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_exact_bf16_close_to_fp32():
    q, k, v = torch.randn(1, 4, 64, 32), torch.randn(1, 2, 64, 32), torch.randn(1, 2, 64, 32)
    ref = exact_attention(q, k, v)
    out = exact_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    out2, _ = exact_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), return_lse=True)
    assert out.dtype == torch.bfloat16 and out2.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 3e-2
    assert (out2.float() - ref).abs().max() < 3e-2


def test_merge_lse_is_exact_union():
    q, k, v = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8)
    o1, l1 = exact_attention(q, k[:, :, :12], v[:, :, :12], causal=False, return_lse=True)
    o2, l2 = exact_attention(q, k[:, :, 12:], v[:, :, 12:], causal=False, return_lse=True)
    o, l = merge_lse(o1, l1, o2, l2)
    ref, ref_lse = exact_attention(q, k, v, causal=False, return_lse=True)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l, ref_lse, atol=1e-5, rtol=1e-5)
    # an empty side (lse = -inf) contributes nothing
    empty = torch.full_like(l1, float("-inf"))
    o3, l3 = merge_lse(o1, l1, torch.zeros_like(o1), empty)
    torch.testing.assert_close(o3, o1)
    torch.testing.assert_close(l3, l1)


def test_bad_shapes_and_backend():
    q = torch.randn(1, 3, 4, 8)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        exact_attention(q, torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        exact_attention(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
    with pytest.raises(ValueError, match="backend"):
        exact_attention(q, q, q, backend="cuda")


def test_lse_reference_path_with_mask_and_strided_q():
    """A mask forces the row-blocked reference; q strided as transformers passes it ([b, n, h, d].T)."""
    q = torch.randn(1, 12, 4, 8).transpose(1, 2)  # [b, h, n, d], not contiguous
    k, v = torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    mask = torch.ones(1, 1, 12, 12, dtype=torch.bool)
    out, lse = exact_attention(q, k, v, causal=True, attn_mask=mask, return_lse=True)
    ref, ref_lse = dense_attention(q, k, v, causal=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
