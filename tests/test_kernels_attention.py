"""Triton attention kernels vs their PyTorch twin, run on CPU tensors by Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported; tests/conftest.py is expected to set
it for the whole session, and this module sets it too in case it runs first.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - e.g. a GPU run with interpretation off
    pytest.skip("kernel tests run on CPU under TRITON_INTERPRET=1", allow_module_level=True)

from longpatch.kernels.attention import flash_attention  # noqa: E402
from longpatch.methods.hyper import attention_lse_reference, hyper_attention  # noqa: E402
from longpatch.ops import exact_attention  # noqa: E402

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _inputs(b, hq, hk, lq, lk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_()  # noqa: E731
    return mk(b, hq, lq, d), mk(b, hk, lk, d), mk(b, hk, lk, d)


def _loss(o, lse, go, gl):
    finite = torch.isfinite(lse)
    return (o.float() * go).sum() + (torch.where(finite, lse, torch.zeros_like(lse)) * gl).sum()


CASES = [
    # b, hq, hk, lq, lk, d, causal, with key bias
    (1, 4, 2, 77, 77, 16, True, False),     # GQA, ragged square
    (2, 2, 1, 50, 130, 32, True, True),     # q shorter than kv: bottom-right alignment
    (1, 2, 2, 130, 70, 16, False, True),    # q longer than kv, non-causal, masked keys
    (1, 2, 2, 90, 60, 16, True, False),     # causal with q longer: the first rows see no key
    (1, 2, 2, 200, 200, 32, False, False),  # several key tiles
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_flash_attention_matches_twin_forward_and_backward(case, dtype):
    b, hq, hk, lq, lk, d, causal, with_bias = case
    q, k, v = _inputs(b, hq, hk, lq, lk, d, dtype)
    bias = None
    if with_bias:
        bias = torch.randn(b, 1, lk)
        bias[..., 3::7] = float("-inf")
    o, lse = flash_attention(q, k, v, causal=causal, scale=0.3, return_lse=True, key_bias=bias)
    ref_o, ref_lse = attention_lse_reference(q, k, v, causal=causal, scale=0.3, bias=bias)
    assert o.dtype == dtype and lse.dtype == torch.float32 and o.shape == q.shape
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
    if not torch.isfinite(ref_lse).all():
        assert (o[~torch.isfinite(lse)] == 0).all()
    torch.testing.assert_close(o.float(), ref_o.float(), **TOL[dtype])
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin], ref_lse[fin], **TOL[torch.float32 if dtype == torch.float32 else dtype])

    go = torch.randn(o.shape)
    gl = torch.randn(lse.shape)
    grads = torch.autograd.grad(_loss(o, lse, go, gl), (q, k, v))
    ref_grads = torch.autograd.grad(_loss(ref_o, ref_lse, go, gl), (q, k, v))
    for got, want in zip(grads, ref_grads):
        tol = dict(atol=1e-4, rtol=1e-3) if dtype == torch.float32 else dict(atol=1e-1, rtol=5e-2)
        torch.testing.assert_close(got.float(), want.float(), **tol)


def test_strided_views_with_gaps():
    # The causal leaves pass views like big[:, :, a:b] of transposed tensors: strides with gaps.
    g = torch.Generator().manual_seed(5)
    base = [torch.randn(1, 150, 2, 16, generator=g).requires_grad_() for _ in range(3)]
    q, k, v = (t.transpose(1, 2)[:, :, 20:120] for t in base)  # [1, 2, 100, 16], non-contiguous
    o, lse = flash_attention(q, k, v, causal=True, scale=0.25, return_lse=True)
    grads = torch.autograd.grad((o * o).sum() + lse.sum(), base)
    ref_o, ref_lse = attention_lse_reference(q, k, v, causal=True, scale=0.25)
    ref_grads = torch.autograd.grad((ref_o * ref_o).sum() + ref_lse.sum(), base)
    torch.testing.assert_close(o, ref_o, atol=2e-5, rtol=1e-4)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)


def test_exact_attention_triton_backend():
    q, k, v = _inputs(1, 4, 2, 70, 70, 16, torch.float32, seed=1)
    for causal in (True, False):
        got = exact_attention(q, k, v, causal=causal, backend="triton")
        torch.testing.assert_close(got, exact_attention(q, k, v, causal=causal, backend="torch"), atol=2e-5, rtol=1e-4)
        o, lse = exact_attention(q, k, v, causal=causal, backend="triton", return_lse=True)
        ref_o, ref_lse = attention_lse_reference(q, k, v, causal=causal, scale=0.25)
        torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_hyper_triton_equals_torch_path(causal):
    # Same seed, same samples, same blocks: the two backends differ only in the attention kernel.
    q, k, v = _inputs(1, 4, 2, 300, 300, 16, torch.float32, seed=2)
    kw = dict(causal=causal, block_size=32, sample_size=24, min_seq_len=96, seed=3, return_lse=True)
    o1, l1 = hyper_attention(q, k, v, backend="triton", **kw)
    g1 = torch.autograd.grad((o1.square()).sum() + l1.sum(), (q, k, v))
    o2, l2 = hyper_attention(q, k, v, backend="torch", **kw)
    g2 = torch.autograd.grad((o2.square()).sum() + l2.sum(), (q, k, v))
    torch.testing.assert_close(o1, o2, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(l1, l2, atol=2e-5, rtol=1e-5)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_hyper_triton_bf16_runs_close_to_fp32():
    q, k, v = _inputs(1, 2, 2, 200, 200, 32, torch.bfloat16, seed=4)
    kw = dict(causal=True, block_size=32, sample_size=32, min_seq_len=64, seed=1)
    out = hyper_attention(q, k, v, backend="triton", **kw)
    ref = hyper_attention(q.float(), k.float(), v.float(), backend="torch", **kw)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).norm() / ref.norm()) < 2e-2
