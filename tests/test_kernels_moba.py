"""MoBA's Triton block-sparse kernel under TRITON_INTERPRET=1, paired with its PyTorch twin."""
import pytest
import torch

pytest.importorskip("triton")

from longpatch.kernels.moba import pairs_attention  # noqa: E402
from longpatch.methods import moba as M  # noqa: E402
from longpatch.methods.moba import cpu as moba_cpu  # noqa: E402
from longpatch.ops import moba_attention, moba_chunk_means  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _pairs(q, k, chunk, topk, causal, shared=False):
    scale = q.shape[-1] ** -0.5
    plan = moba_cpu.Plan(q, k, chunk, topk, causal, None, scale, shared)
    return M.selection_pairs(q, k, plan), scale


CASES = [  # b, hq, hk, nq, nk, d, chunk, topk, causal, dtype
    (1, 2, 2, 64, 64, 16, 16, 2, True, torch.float32),
    (2, 4, 2, 75, 75, 32, 16, 3, True, torch.float32),     # ragged, GQA, d=32
    (1, 4, 1, 23, 90, 16, 32, 2, True, torch.float32),     # queries start mid-chunk (chunked decode)
    (1, 2, 1, 1, 90, 16, 16, 3, True, torch.float32),      # one token
    (1, 2, 2, 70, 70, 16, 16, 3, False, torch.float32),    # non-causal
    (1, 2, 1, 50, 40, 16, 16, 2, False, torch.float32),    # non-causal, q_len > kv_len
    (1, 2, 2, 64, 64, 16, 16, 2, True, torch.bfloat16),
]


@pytest.mark.parametrize("b,hq,hk,nq,nk,d,chunk,topk,causal,dtype", CASES)
def test_kernel_matches_twin(b, hq, hk, nq, nk, d, chunk, topk, causal, dtype):
    q = torch.randn(b, hq, nq, d).to(dtype)
    k = torch.randn(b, hk, nk, d).to(dtype)
    v = torch.randn(b, hk, nk, d).to(dtype)
    pairs, scale = _pairs(q, k, chunk, topk, causal)
    out, lse = pairs_attention(q, k, v, pairs, scale=scale, causal=causal)
    ref, ref_lse = M.pairs_attention_reference(q, k, v, pairs, scale, causal)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)


def test_kernel_gradients_match_twin():
    q = torch.randn(1, 4, 60, 16, requires_grad=True)
    k = torch.randn(1, 2, 60, 16, requires_grad=True)
    v = torch.randn(1, 2, 60, 16, requires_grad=True)
    pairs, scale = _pairs(q.detach(), k.detach(), 16, 2, True)
    out, lse = pairs_attention(q, k, v, pairs, scale=scale, causal=True)
    ref, ref_lse = M.pairs_attention_reference(q, k, v, pairs, scale, True)
    do, dl = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out * do).sum() + (lse * dl).sum(), (q, k, v))
    want = torch.autograd.grad((ref * do).sum() + (ref_lse * dl).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal,shared,nq",
                         [(True, False, 80), (True, True, 80), (False, False, 80), (True, False, 30)])
def test_triton_backend_equals_torch_backend(causal, shared, nq):
    """The whole op, forward and backward (output and LSE), on the two backends."""
    q = torch.randn(2, 4, nq, 16, requires_grad=True)
    k = torch.randn(2, 2, 80, 16, requires_grad=True)
    v = torch.randn(2, 2, 80, 16, requires_grad=True)
    kw = dict(causal=causal, chunk_size=16, topk=3, shared_selection=shared, return_lse=True)
    o1, l1 = moba_attention(q, k, v, backend="triton", **kw)
    o2, l2 = moba_attention(q, k, v, backend="torch", **kw)
    torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)
    do, dl = torch.randn_like(o1), torch.randn_like(l1)
    g1 = torch.autograd.grad((o1 * do).sum() + (l1 * dl).sum(), (q, k, v))
    g2 = torch.autograd.grad((o2 * do).sum() + (l2 * dl).sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def test_triton_decode_with_chunk_means():
    """A one-token step takes the gather path on every backend; with gradients it takes the kernel:
    the two agree."""
    q = torch.randn(1, 4, 1, 16)
    k = torch.randn(1, 2, 150, 16)
    v = torch.randn(1, 2, 150, 16)
    means = moba_chunk_means(k, 16)
    out = moba_attention(q, k, v, chunk_size=16, topk=3, chunk_means=means, backend="triton")
    torch.testing.assert_close(out, moba_attention(q, k, v, chunk_size=16, topk=3, backend="torch"),
                               atol=1e-5, rtol=1e-5)
    kernel = moba_attention(q.clone().requires_grad_(), k, v, chunk_size=16, topk=3, chunk_means=means,
                            backend="triton")
    torch.testing.assert_close(kernel.detach(), out, atol=1e-5, rtol=1e-5)


def test_triton_path_runs_one_kv_group_per_kernel_call(monkeypatch):
    """The per-pair partial outputs are float32 rows of d values, topk per query: the kernel sees one
    (batch row, KV head) group's pairs at a time, so they never take the whole call's memory at once."""
    import longpatch.kernels.moba as km

    seen = []

    def spy(q, k, v, pairs, **kw):
        seen.append(sorted(set(pairs["seg_kv"].tolist())))
        return pairs_attention(q, k, v, pairs, **kw)

    monkeypatch.setattr(km, "pairs_attention", spy)
    q = torch.randn(2, 4, 64, 16)
    k = torch.randn(2, 2, 64, 16)
    v = torch.randn(2, 2, 64, 16)
    out = moba_attention(q, k, v, chunk_size=16, topk=2, backend="triton")
    assert seen == [[0], [1], [2], [3]]  # b * hk groups, flat index b * hk + h, one per call
    torch.testing.assert_close(out, moba_attention(q, k, v, chunk_size=16, topk=2, backend="torch"),
                               atol=1e-5, rtol=1e-5)
