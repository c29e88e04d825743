"""The chunked causal linear-attention Triton kernel under TRITON_INTERPRET=1, paired with its
PyTorch twin, and the linear / performer ops on the two backends."""
import pytest
import torch

pytest.importorskip("triton")

from longpatch.kernels.linear import causal_prefix_attention  # noqa: E402
from longpatch.methods import get_method  # noqa: E402
from longpatch.methods.linear import causal_prefix_reference, linear_attention  # noqa: E402
from longpatch.methods.performer import performer_attention  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [  # b, hq, hk, n, m, dv, init, v dtype
    (1, 2, 2, 64, 16, 16, False, torch.float32),
    (2, 4, 2, 75, 40, 24, True, torch.float32),    # GQA, ragged n, m and dv not powers of two, prefix state
    (1, 2, 1, 128, 80, 16, False, torch.float32),  # two feature blocks (partial numerators summed)
    (1, 1, 1, 3, 16, 8, True, torch.float32),      # shorter than a chunk
    (1, 2, 2, 50, 16, 16, False, torch.bfloat16),  # bf16 values (features stay float32)
]


@pytest.mark.parametrize("b,hq,hk,n,m,dv,init,dtype", CASES)
def test_kernel_matches_twin(b, hq, hk, n, m, dv, init, dtype):
    qf, kf = torch.rand(b, hq, n, m), torch.rand(b, hk, n, m)
    v = torch.randn(b, hk, n, dv).to(dtype)
    s0 = torch.randn(b, hk, m, dv) if init else None
    z0 = torch.rand(b, hk, m) if init else None
    num, den = causal_prefix_attention(qf, kf, v, s0, z0)
    ref_num, ref_den = causal_prefix_reference(qf, kf, v, s0, z0)
    assert num.dtype == den.dtype == torch.float32
    torch.testing.assert_close(num, ref_num, atol=1e-5 * float(ref_num.abs().max()), rtol=1e-5)
    torch.testing.assert_close(den, ref_den, atol=1e-5 * float(ref_den.abs().max()), rtol=1e-5)


@pytest.mark.parametrize("causal,nq", [(True, 90), (True, 30), (False, 90)])
def test_linear_op_backends_agree(causal, nq):
    q, k, v = torch.randn(2, 4, nq, 16), torch.randn(2, 2, 90, 16), torch.randn(2, 2, 90, 16)
    a = linear_attention(q, k, v, causal=causal, backend="triton")
    torch.testing.assert_close(a, linear_attention(q, k, v, causal=causal, backend="torch"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("feature_type", ["positive", "hyperbolic"])
def test_performer_op_backends_agree(feature_type):
    q, k, v = torch.randn(1, 4, 100, 16) * 0.7, torch.randn(1, 2, 100, 16) * 0.7, torch.randn(1, 2, 100, 16)
    kw = dict(num_features=24, feature_type=feature_type)
    a = performer_attention(q, k, v, backend="triton", **kw)
    torch.testing.assert_close(a, performer_attention(q, k, v, backend="torch", **kw), atol=1e-5, rtol=1e-5)


def test_triton_decode_state_equals_torch_prefill():
    m = get_method("linear")
    q, k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 1, 40, 16), torch.randn(1, 1, 40, 16)
    state = {}
    run = dict(causal=True, scale=None, backend="triton", buffers={}, state=state)
    outs = [m.prefill(q[:, :, :32], k[:, :, :32], v[:, :, :32], **run)]
    outs += [m.decode(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], **run) for t in range(32, 40)]
    torch.testing.assert_close(torch.cat(outs, 2), linear_attention(q, k, v, backend="torch"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hq,hk,init,z_given", [(2, 2, False, False), (4, 2, True, True), (2, 1, True, False)])
def test_kernel_gradients_match_twin(hq, hk, init, z_given):
    """The backward is three more passes of the same kernel (one causal, two on the reversed
    sequence); every input's gradient, the prefix state's included, against autograd of the twin."""
    b, n, m, dv = 2, 70, 24, 20
    qf = torch.rand(b, hq, n, m, requires_grad=True)
    kf = torch.rand(b, hk, n, m, requires_grad=True)
    v = torch.randn(b, hk, n, dv, requires_grad=True)
    s0 = torch.randn(b, hk, m, dv, requires_grad=True) if init else None
    z0 = torch.rand(b, hk, m, requires_grad=True) if z_given else None
    inputs = [t for t in (qf, kf, v, s0, z0) if t is not None]
    num, den = causal_prefix_attention(qf, kf, v, s0, z0)
    ref_num, ref_den = causal_prefix_reference(qf, kf, v, s0, z0)
    wn, wd = torch.randn_like(ref_num), torch.randn_like(ref_den)
    got = torch.autograd.grad((num * wn).sum() + (den * wd).sum(), inputs)
    want = torch.autograd.grad((ref_num * wn).sum() + (ref_den * wd).sum(), inputs)
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, atol=2e-6 * float(r.abs().max()), rtol=1e-5)


def test_performer_gradients_on_both_backends():
    q = (torch.randn(1, 4, 50, 16) * 0.7).requires_grad_()
    k = (torch.randn(1, 2, 50, 16) * 0.7).requires_grad_()
    v = torch.randn(1, 2, 50, 16, requires_grad=True)
    g1 = torch.autograd.grad(performer_attention(q, k, v, num_features=16, backend="triton").sum(), (q, k, v))
    g2 = torch.autograd.grad(performer_attention(q, k, v, num_features=16, backend="torch").sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
