"""A new user's report, round 4: MoBA's backward on the layout a model hands over (transposed views), method
buffers that a cast of the model must leave as drawn, and ``Method.exact_params`` callable for every method."""
import pytest
import torch
import transformers
from helpers import logits

from longpatch import patch_model, redraw_buffers
from longpatch.methods import Method, available_methods
from longpatch.methods.exact import exact_attention
from longpatch.methods.moba import moba_attention
from longpatch.methods.moba.naive import moba_reference
from longpatch.methods.nsa import nsa_attention, nsa_reference

pytestmark = pytest.mark.usefixtures("one_thread")


def _transposed(b, hq, hk, n, d):
    """q, k, v as a model hands them over: [b, n, heads, d] projections viewed [b, heads, n, d] (not contiguous)."""
    q = torch.randn(b, n, hq, d).transpose(1, 2).requires_grad_()
    k = torch.randn(b, n, hk, d).transpose(1, 2).requires_grad_()
    v = torch.randn(b, n, hk, d).transpose(1, 2).requires_grad_()
    assert not q.is_contiguous() and not k.is_contiguous()
    return q, k, v


def _contiguous_leaves(*ts):
    return [t.detach().contiguous().requires_grad_() for t in ts]


def _grads(outs, weights, inputs):
    loss = sum((o.double() * w).sum() for o, w in zip(outs, weights))
    return torch.autograd.grad(loss, inputs)


# --------------------------------------------------------------------------- A: backward on transposed views

@pytest.mark.parametrize("causal,shared", [(True, False), (True, True), (False, False)])
def test_moba_backward_on_transposed_views_matches_contiguous_and_reference(causal, shared):
    """The report's shapes (GQA: 4 query heads over 2 KV heads, the default gate selection): the backward
    used to view a zeros_like of a strided slice (RuntimeError); now its gradients equal those of the same op
    on contiguous copies and those of the dense definition (moba_reference, float64)."""
    q, k, v = _transposed(1, 4, 2, 256, 64)
    kw = dict(chunk_size=64, topk=2, causal=causal, shared_selection=shared, return_lse=True, backend="torch")
    out, lse = moba_attention(q, k, v, **kw)
    weights = (torch.randn(out.shape, dtype=torch.float64), torch.randn(lse.shape, dtype=torch.float64))
    got = _grads((out, lse), weights, (q, k, v))

    qc, kc, vc = _contiguous_leaves(q, k, v)
    out_c, lse_c = moba_attention(qc, kc, vc, **kw)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    for a, b in zip(got, _grads((out_c, lse_c), weights, (qc, kc, vc))):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)

    qr, kr, vr = _contiguous_leaves(q, k, v)
    ref, ref_lse = moba_reference(qr, kr, vr, 64, 2, causal=causal, shared=shared)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, _grads((ref, ref_lse), weights, (qr, kr, vr))):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_moba_backward_on_transposed_views_the_report_verbatim():
    q = torch.randn(1, 256, 4, 64).transpose(1, 2).requires_grad_()
    k = torch.randn(1, 256, 2, 64).transpose(1, 2).requires_grad_()
    v = k.detach().clone().requires_grad_()
    moba_attention(q, k, v, chunk_size=64, topk=2).sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_moba_backward_on_transposed_views_matches_exact_attention_where_moba_is_exact():
    """An independent reference: with 4 chunks and topk=3, a query in chunks 0..2 selects its own chunk and
    every chunk before it, so its row is exact causal attention. With a loss on those rows only, MoBA's
    gradients (transposed views, GQA, the gate) equal exact attention's."""
    q, k, v = _transposed(1, 4, 2, 128, 32)
    out = moba_attention(q, k, v, chunk_size=32, topk=3, backend="torch")  # topk < 4 chunks: MoBA's own path
    w = torch.randn(out.shape, dtype=torch.float64)
    w[:, :, 96:] = 0  # the last chunk's queries choose 2 of 3 past chunks: not exact
    got = _grads((out,), (w,), (q, k, v))
    qe, ke, ve = _contiguous_leaves(q, k, v)
    ref = exact_attention(qe, ke, ve, causal=True, backend="torch")
    torch.testing.assert_close(out[:, :, :96], ref[:, :, :96], atol=1e-5, rtol=1e-5)
    for a, b in zip(got, _grads((ref,), (w,), (qe, ke, ve))):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")  # nsa_reference
def test_nsa_backward_on_transposed_views_matches_contiguous_and_reference():
    """NSA's gradient path (the differentiable composition of its references) on transposed views: the same
    gradients as on contiguous copies and as the per-token definition (nsa_reference, float64)."""
    q, k, v = _transposed(1, 4, 2, 96, 16)
    params = dict(compress_block=8, compress_stride=4, select_block=8, num_selected=3, window=12, init_blocks=1,
                  local_blocks=1)
    gates = (0.2, 0.5, 0.3)
    out = nsa_attention(q, k, v, gates=gates, backend="torch", **params)
    w = torch.randn(out.shape, dtype=torch.float64)
    got = _grads((out,), (w,), (q, k, v))
    qc, kc, vc = _contiguous_leaves(q, k, v)
    out_c = nsa_attention(qc, kc, vc, gates=gates, backend="torch", **params)
    assert torch.equal(out, out_c)
    for a, b in zip(got, _grads((out_c,), (w,), (qc, kc, vc))):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    qr, kr, vr = _contiguous_leaves(q, k, v)
    ref, *_ = nsa_reference(qr, kr, vr, gates=gates, **params)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, _grads((ref,), (w,), (qr, kr, vr))):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- B: casts leave the random draws

def _tiny_llama():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024,
                                       attn_implementation="sdpa")
        return transformers.LlamaForCausalLM(cfg).eval()


CAST_CASES = {
    # min_seq_len 64 at 300 tokens: hyper approximates (checked below), it does not fall back to exact
    "hyper": ({"block_size": 16, "sample_size": 16, "min_seq_len": 64, "seed": 3}, "longpatch_lsh_dirs"),
    "performer": ({"num_features": 32, "seed": 3}, "longpatch_projection"),
}


@pytest.mark.parametrize("name", sorted(CAST_CASES))
def test_patch_then_cast_equals_cast_then_patch(name):
    params, buffer = CAST_CASES[name]
    cfg = {"method": name, "layers": "all", "params": params}
    ids = torch.randint(0, 256, (1, 300))
    after = patch_model(_tiny_llama(), cfg).to(torch.bfloat16)  # patch, then cast
    before = patch_model(_tiny_llama().to(torch.bfloat16), cfg)  # cast, then patch
    for model in (after, before):
        drawn = [t for k, t in model.named_buffers() if k.endswith(buffer)]
        assert len(drawn) == 2 and all(t.dtype == torch.float32 for t in drawn)  # drawn float32, kept float32
    want = logits(before, ids)
    assert want.dtype == torch.bfloat16
    # the same weights, the same draws, the same ops: bitwise (the cast buffers gave logits up to 8.0 apart)
    torch.testing.assert_close(logits(after, ids), want, atol=0, rtol=0)
    assert set(after.longpatch.breakdown()["patched"]["prefill"]) == {"method"}  # the approximation ran
    # a redraw after the cast writes a float32 draw in place: the same seed gives the patch's draw again
    assert redraw_buffers(after, seed=3) == 2
    torch.testing.assert_close(logits(after, ids), want, atol=0, rtol=0)


def test_method_buffers_move_device_but_keep_dtype():
    from longpatch.routing import MethodBuffers

    holder = MethodBuffers()
    holder.register_buffer("longpatch_x", torch.randn(4, 3), persistent=False)
    holder.register_buffer("longpatch_i", torch.arange(3), persistent=False)
    holder.to(torch.bfloat16)
    holder.half()
    holder.double()
    assert holder.longpatch_x.dtype == torch.float32 and holder.longpatch_i.dtype == torch.int64
    holder.to("meta", torch.bfloat16)  # a cast and a move at once: the move applies
    assert holder.longpatch_x.device.type == "meta" and holder.longpatch_x.dtype == torch.float32
    assert holder.longpatch_i.device.type == "meta"


# --------------------------------------------------------------------------- C: exact_params is callable

@pytest.mark.parametrize("name", sorted(available_methods()))
def test_exact_params_is_callable_for_every_method(name):
    """docs/methods.md: ``exact_params(n, params)`` -> the param changes that make the method exact on up to n
    tokens, or None where no setting does. It used to be None (not callable) for linear and performer."""
    method = available_methods()[name]
    assert callable(method.exact_params)
    defaults = method.resolve_params(None)
    change = method.exact_params(4096, defaults)
    assert change is None or isinstance(change, dict)
    if change is not None:
        assert set(change) <= set(method.params)
        method.resolve_params({**defaults, **change})  # valid params
    if name in ("linear", "performer"):
        assert change is None


def test_a_method_declared_without_exact_params_gets_a_callable_one():
    from longpatch.methods.base import no_exact_params

    def prefill(q, k, v, **_):
        return q

    for m in (Method("t_none", "test", prefill), Method("t_none2", "test", prefill, exact_params=None)):
        assert m.exact_params is no_exact_params and m.exact_params(8, {}) is None
