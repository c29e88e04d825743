"""The sparse method's Triton kernel (window + global) under TRITON_INTERPRET=1, paired with the
PyTorch path and the dense-mask oracle of test_sparse."""
import pytest
import torch

pytest.importorskip("triton")

from test_sparse import oracle, rand, spec  # noqa: E402

from longpatch.kernels.sparse import window_global_attention  # noqa: E402
from longpatch.methods import sparse as sp  # noqa: E402
from longpatch.methods.sparse import sparse_attention  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [  # b, hq, hk, nq, nk, causal, pattern, dtype
    (1, 2, 2, 70, 70, True, dict(window=8, global_tokens=3), torch.float32),
    (1, 4, 2, 70, 70, True, dict(window=5, global_tokens=4, dilation=3), torch.float32),       # dilated, GQA
    (2, 2, 1, 64, 64, True, dict(window=40, global_tokens=2), torch.float32),                   # band > tile
    (1, 4, 2, 33, 90, True, dict(window=6, global_tokens=5, dilation=2, random_blocks=2), torch.float32),  # ragged
    (1, 2, 1, 1, 90, True, dict(window=6, global_tokens=5, dilation=3, random_blocks=1), torch.float32),   # one token
    (1, 2, 2, 60, 60, False, dict(window=7, global_tokens=3), torch.float32),                   # non-causal
    (1, 2, 1, 90, 70, False, dict(window=6, global_tokens=3, dilation=2, random_blocks=2), torch.float32),  # nq > nk
    (1, 2, 2, 64, 64, True, dict(window=8, global_tokens=4, dilation=2), torch.bfloat16),
]


@pytest.mark.parametrize("b,hq,hk,nq,nk,causal,pattern,dtype", CASES)
def test_triton_matches_torch_path_and_oracle(b, hq, hk, nq, nk, causal, pattern, dtype):
    q, k, v = rand(b, hq, hk, nq, nk, dtype=dtype)
    kw = dict(causal=causal, return_lse=True, **spec(**pattern))
    out, lse = sparse_attention(q, k, v, backend="triton", **kw)
    ref, ref_lse = sparse_attention(q, k, v, backend="torch", **kw)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
    dense, dense_lse = oracle(q, k, v, causal, **pattern)
    torch.testing.assert_close(out.double(), dense, atol=max(tol, 2e-5), rtol=max(tol, 2e-5))
    torch.testing.assert_close(lse.double(), dense_lse, atol=max(tol, 2e-5), rtol=max(tol, 2e-5))


def test_kernel_alone_is_global_plus_window():
    """The kernel's own output: global keys + window keys >= G, no random blocks, and (non-causal)
    no full rows for the global queries: compare with the torch parts 1 and 2 merged."""
    q, k, v = rand(1, 4, 2, 50, 50, dtype=torch.float32)
    pat = sp.SparsePattern(window=6, global_tokens=4, dilation=2, causal=False)
    out, lse = window_global_attention(q, k, v, window=6, global_tokens=4, dilation=2, causal=False, scale=0.25)
    og, lg = sp._global_part(q[0], k[0], v[0], 0, 4, False, 0.25)
    ow, lw = sp._window_part(q[0], k[0], v[0], 0, pat, 0.25)
    ref, ref_lse = sp.merge_lse(og, lg, ow, lw)
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[0], ref_lse, atol=1e-5, rtol=1e-5)


def test_rows_without_keys_get_minus_inf():
    """G = 0 and queries before the first key of their class (non-causal, nq > nk): empty rows."""
    q, k, v = rand(1, 1, 1, 20, 8, dtype=torch.float32)
    out, lse = window_global_attention(q, k, v, window=3, global_tokens=0, dilation=1, causal=False, scale=0.25)
    assert torch.isneginf(lse[0, 0, :10]).all() and (out[0, 0, :10] == 0).all()
    assert torch.isfinite(lse[0, 0, 11:]).all()


@pytest.mark.parametrize("b,hq,hk,nq,nk,causal,pattern", [
    (1, 4, 2, 40, 40, True, dict(window=5, global_tokens=3, dilation=2)),      # GQA, dilated, global
    (1, 2, 1, 24, 60, True, dict(window=40, global_tokens=2, random_blocks=1)),  # ragged, band > tile
    (1, 2, 2, 50, 40, False, dict(window=5, global_tokens=3, random_blocks=1)),  # non-causal, nq > nk
])
def test_gradients_match_torch_path(b, hq, hk, nq, nk, causal, pattern):
    """Backward kernels (dQ; dK/dV of band and global key tiles), the LSE's gradient included."""
    q, k, v = rand(b, hq, hk, nq, nk, dtype=torch.float32)
    kw = dict(causal=causal, return_lse=True, **spec(**pattern))
    grads = []
    for backend in ("triton", "torch"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = sparse_attention(*leaves, backend=backend, **kw)
        torch.manual_seed(1)
        do, dl = torch.randn_like(out), torch.randn_like(lse)
        loss = (out * do).sum() + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * dl).sum()
        grads.append(torch.autograd.grad(loss, leaves))
    for a, b_ in zip(*grads):
        torch.testing.assert_close(a, b_, atol=2e-5, rtol=2e-5)
