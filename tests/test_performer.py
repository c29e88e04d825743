"""Performer / FAVOR+ (torch path): the estimator's statistics, the op against its quadratic form,
stabilisation, decode == prefill, the layer buffer and redraw.

The statistical tests use fixed seeds: each is a deterministic computation, and the margins are
several standard errors (or a factor >= 2) wide.
"""
import math

import pytest
import torch
from helpers import logits

import longpatch.methods.performer as perf
from longpatch import patch_model, redraw_buffers
from longpatch.errors import ConfigError
from longpatch.methods import get_method
from longpatch.methods.performer import (
    gaussian_projection,
    performer_attention,
    performer_features,
    softmax_kernel_estimate,
)
from longpatch.ops import exact_attention
from longpatch.testing.tiny import tiny_model

PERFORMER = get_method("performer")
pytestmark = pytest.mark.usefixtures("one_thread")


def rand(b, hq, hk, nq, nk, d=16, sigma=1.0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g) * sigma
    k = torch.randn(b, hk, nk, d, generator=g) * sigma
    v = torch.randn(b, hk, nk, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def mse(a, b):
    return float(((a.double() - b.double()) ** 2).mean())


# --------------------------------------------------------------------------- projections

def test_orthogonal_projection_blocks():
    w = gaussian_projection(40, 16, seed=3)
    assert w.shape == (40, 16) and w.dtype == torch.float32
    for s in (0, 16, 32):  # rows of a block are orthogonal; the last block is partial
        blk = w[s:s + 16].double()
        gram = blk @ blk.t()
        off = gram - torch.diag(torch.diagonal(gram))
        assert off.abs().max() < 1e-4 * gram.diagonal().max()
    assert torch.equal(w, gaussian_projection(40, 16, seed=3))
    assert not torch.equal(w, gaussian_projection(40, 16, seed=4))
    # chi(d) row norms: E|w|² = d, as for i.i.d. Gaussian rows (not unit rows)
    big = gaussian_projection(4096, 16, seed=0)
    assert abs(float((big.double() ** 2).sum(1).mean()) - 16) < 0.5


def _per_direction_estimates(x, y, w, feature_type):
    """m = 1 estimates of exp(x·y), one per direction of w: each row of w alone is an unbiased
    estimator, because every row is marginally N(0, I)."""
    fx, _ = performer_features(x, w, feature_type)
    fy, _ = performer_features(y, w, feature_type)
    c = (fx * fy).squeeze(0)
    m = w.shape[0]
    if c.numel() == 2 * m:  # hyperbolic and trig: two features per direction
        c = c[:m] + c[m:]
    return c * m


@pytest.mark.parametrize("feature_type", ["positive", "hyperbolic", "trig"])
@pytest.mark.parametrize("orthogonal", [True, False])
def test_kernel_estimate_is_unbiased(feature_type, orthogonal):
    """The mean of independent draws converges to exp(x·y). 3000 independent orthogonal blocks
    (one seeded draw of 3000·d directions = 3000 draws of m = d features) give the mean and its
    standard error."""
    d, blocks = 4, 3000
    x = torch.tensor([[0.5, -0.3, 0.2, 0.4]])
    y = torch.tensor([[0.1, 0.45, -0.2, 0.3]])
    true = math.exp(float(x @ y.t()))
    w = gaussian_projection(d * blocks, d, seed=11, orthogonal=orthogonal)
    per_block = _per_direction_estimates(x, y, w, feature_type).double().view(blocks, d).mean(1)
    mean, se = float(per_block.mean()), float(per_block.std() / math.sqrt(blocks))
    assert se < 0.02 * true
    assert abs(mean - true) < 4 * se


def test_mean_over_seeds_converges():
    x = torch.tensor([[0.4, -0.2, 0.3, 0.1, 0.0, 0.2, -0.4, 0.3]])
    y = torch.tensor([[0.2, 0.3, -0.1, 0.4, 0.2, -0.3, 0.1, 0.2]])
    true = math.exp(float(x @ y.t()))
    est = torch.stack([softmax_kernel_estimate(x, y, gaussian_projection(8, 8, seed=s)) for s in range(300)]).double()
    err10 = abs(float(est[:10].mean()) - true)
    err300 = abs(float(est.mean()) - true)
    assert err300 < 3 * float(est.std()) / math.sqrt(300) and err300 < err10


def test_positive_beats_trig_when_the_kernel_is_small():
    """Lemma 2: MSE(positive) = exp(|x+y|²) SM² (1 − exp(−|x+y|²)) / m -> 0 as x + y -> 0 (the kernel
    exp(x·y) small), while the trig MSE stays ~ (1 − exp(−|x−y|²))² / (2m) times the same."""
    x = torch.tensor([[0.8, -0.5, 0.3, 0.6]])
    y = -x + 0.05
    true = math.exp(float(x @ y.t()))
    assert true < 0.3
    err = {}
    for ft in ("positive", "trig"):
        est = torch.stack([softmax_kernel_estimate(x, y, gaussian_projection(8, 4, seed=s, orthogonal=False), ft)
                           for s in range(300)]).double()
        err[ft] = float(((est - true) ** 2).mean())
    assert err["positive"] < 0.01 * err["trig"]


def _output_mse(m, orthogonal, seeds, sigma=0.3, feature_type="positive"):
    q, k, v = rand(2, 1, 1, 256, 256, sigma=sigma, seed=5)
    ex = exact_attention(q, k, v, causal=False)
    return sum(mse(performer_attention(q, k, v, causal=False, num_features=m, orthogonal=orthogonal, seed=s,
                                       feature_type=feature_type), ex) for s in seeds) / len(seeds)


def test_output_mse_falls_as_features_grow():
    errs = [_output_mse(m, True, range(6)) for m in (8, 32, 128)]
    assert errs[0] > 2 * errs[1] > 4 * errs[2]


def test_orthogonal_beats_iid_at_equal_features():
    for m in (16, 32):
        assert _output_mse(m, True, range(30)) < 0.92 * _output_mse(m, False, range(30))


# --------------------------------------------------------------------------- the op

def quadratic_form(q, k, v, w, feature_type, causal, scale=None):
    """D̂⁻¹ (Q' K'ᵀ masked) V with the plain (unstabilised) features, float64, K/V repeated."""
    g = q.shape[1] // k.shape[1]
    r = math.sqrt(q.shape[-1] ** -0.5 if scale is None else scale)
    qf, _ = performer_features(q.double() * r, w.double(), feature_type)
    kf, _ = performer_features(k.double() * r, w.double(), feature_type)
    a = qf @ kf.repeat_interleave(g, 1).transpose(-1, -2)
    nq, nk = q.shape[2], k.shape[2]
    if causal:
        a = a * torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
    return (a @ v.double().repeat_interleave(g, 1)) / a.sum(-1, keepdim=True)


CASES = [  # hq, hk, nq, nk, causal, feature_type
    (2, 2, 100, 100, True, "positive"),
    (4, 2, 130, 130, True, "hyperbolic"),
    (4, 1, 37, 150, True, "positive"),      # queries are the last 37 positions
    (2, 1, 1, 77, True, "positive"),
    (2, 2, 70, 70, False, "positive"),
    (4, 2, 50, 90, False, "hyperbolic"),
]


@pytest.mark.parametrize("hq,hk,nq,nk,causal,ft", CASES)
def test_op_equals_its_quadratic_form(hq, hk, nq, nk, causal, ft):
    """Stabilisation and chunking change nothing: the op is exactly D̂⁻¹(Q'K'ᵀ)V of its features."""
    q, k, v = rand(2, hq, hk, nq, nk, sigma=0.7)
    w = gaussian_projection(48, 16, seed=2)
    out = performer_attention(q, k, v, causal=causal, projection=w, feature_type=ft)
    torch.testing.assert_close(out.double(), quadratic_form(q, k, v, w, ft, causal), atol=1e-5, rtol=1e-4)


def test_trig_equals_its_quadratic_form_in_float64():
    """trig's denominator can approach 0 (the paper's point), so compare in float64."""
    q, k, v = rand(1, 2, 1, 60, 60, sigma=0.5, dtype=torch.float64)
    w = gaussian_projection(64, 16, seed=2)
    out = performer_attention(q, k, v, projection=w, feature_type="trig")
    torch.testing.assert_close(out, quadratic_form(q, k, v, w, "trig", True), atol=1e-9, rtol=1e-7)


def test_scale_is_the_softmax_temperature():
    q, k, v = rand(1, 2, 2, 64, 64, sigma=0.5)
    w = gaussian_projection(32, 16, seed=1)
    out = performer_attention(q, k, v, projection=w, scale=0.1)
    r = math.sqrt(0.1 / 0.25)  # scale^½ goes to both sides: x = q·scale^½, y = k·scale^½
    torch.testing.assert_close(out, performer_attention(q * r, k * r, v, projection=w), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), quadratic_form(q, k, v, w, "positive", True, 0.1), atol=1e-5, rtol=1e-4)


def test_large_norms_stay_finite():
    """Max subtraction: |x|² ~ 100 would overflow exp() unstabilised."""
    q, k, v = rand(1, 2, 2, 96, 96, sigma=12.0)
    for ft in ("positive", "hyperbolic"):
        assert torch.isfinite(performer_attention(q, k, v, num_features=32, feature_type=ft)).all()


def test_beats_uniform_attention_at_small_norms():
    """With small |q|, |k| (low estimator variance) and many features the estimate is closer to
    softmax than the uniform average of the values. (At larger norms it is not: see docs/performer.md.)"""
    q, k, v = rand(1, 2, 2, 256, 256, sigma=0.5)
    ex = exact_attention(q, k, v, causal=False)
    uniform = v.mean(2, keepdim=True).expand_as(v)
    assert mse(performer_attention(q, k, v, causal=False, num_features=1024), ex) < 0.5 * mse(uniform, ex)


def test_bf16_and_gradients():
    q, k, v = rand(1, 4, 2, 80, 80, sigma=0.5)
    ref = performer_attention(q, k, v, num_features=32)
    out = performer_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), num_features=32)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=5e-2)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    w = gaussian_projection(32, 16)
    got = torch.autograd.grad(performer_attention(qd, kd, vd, projection=w).sum(), (qd, kd, vd))
    want = torch.autograd.grad(quadratic_form(qd, kd, vd, w, "positive", True).sum(), (qd, kd, vd))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-8, rtol=1e-6)


def test_seed_and_projection_arguments():
    q, k, v = rand(1, 2, 2, 40, 40)
    a = performer_attention(q, k, v, num_features=16, seed=3)
    assert torch.equal(a, performer_attention(q, k, v, num_features=16, seed=3))
    assert not torch.equal(a, performer_attention(q, k, v, num_features=16, seed=4))
    w = gaussian_projection(16, 16, seed=3)
    assert torch.equal(a, performer_attention(q, k, v, projection=w))
    assert torch.equal(performer_attention(q, k, v, num_features=16, orthogonal=False, seed=3),
                       performer_attention(q, k, v, projection=gaussian_projection(16, 16, seed=3, orthogonal=False)))


def test_argument_checks():
    q, k, v = rand(1, 2, 2, 8, 8)
    with pytest.raises(ValueError, match="feature_type"):
        performer_attention(q, k, v, feature_type="relu")
    with pytest.raises(ValueError, match="num_features"):
        performer_attention(q, k, v, num_features=0)
    with pytest.raises(ValueError, match="projection"):
        performer_attention(q, k, v, projection=torch.randn(8, 7))
    with pytest.raises(ValueError, match="log-sum-exp"):
        performer_attention(q, k, v, return_lse=True)
    with pytest.raises(ConfigError, match="params.num_features"):
        PERFORMER.resolve_params({"num_features": 0})
    with pytest.raises(ConfigError, match="params.feature_type"):
        PERFORMER.resolve_params({"feature_type": "cos"})
    assert PERFORMER.resolve_params({}) == {"num_features": 256, "feature_type": "positive", "orthogonal": True,
                                            "seed": None}


# --------------------------------------------------------------------------- decode

def _step(q, k, v, state, buffers=None, **params):
    return PERFORMER.decode(q, k, v, causal=True, scale=None, backend="torch", buffers=buffers or {}, state=state,
                            **params)


@pytest.mark.parametrize("ft,dtype,tol", [("positive", torch.float32, 2e-6), ("hyperbolic", torch.float32, 2e-6),
                                          ("trig", torch.float64, 1e-9)])
def test_stepwise_decode_equals_prefill(ft, dtype, tol):
    """Keys arriving later with larger log-features raise the stabiliser: the kept sums are
    rescaled, so every step equals the prefill."""
    q, k, v = rand(2, 4, 2, 70, 70, sigma=0.7, dtype=dtype)
    k[:, :, 50:] *= 2.0  # later keys dominate the shift
    params = dict(num_features=32, feature_type=ft)
    full = performer_attention(q, k, v, **params)
    state = {}
    outs = [_step(q[:, :, :20], k[:, :, :20], v[:, :, :20], state, **params)]
    outs += [_step(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], state, **params) for t in range(20, 70)]
    torch.testing.assert_close(torch.cat(outs, 2), full, atol=tol, rtol=tol * 10)
    assert state["length"] == 70 and state["S"].shape == (2, 2, 32 * (1 if ft == "positive" else 2), 16)


def test_chunked_decode_and_init_state():
    params = dict(num_features=32)
    q, k, v = rand(1, 4, 2, 64, 64, sigma=0.7)
    full = performer_attention(q, k, v, **params)
    state = {}
    outs = [_step(q[:, :, s:s + 5], k[:, :, :s + 5], v[:, :, :s + 5], state, **params) for s in range(4, 64, 5)]
    torch.testing.assert_close(torch.cat(outs, 2), full[:, :, 4:], atol=2e-6, rtol=1e-5)
    state = PERFORMER.init_state(k, v, **PERFORMER.resolve_params(params))
    torch.testing.assert_close(_step(q[:, :, 63:], k, v, state, **params), full[:, :, 63:], atol=2e-6, rtol=1e-5)


def test_state_rebuilt_when_projection_or_cache_changes():
    q, k, v = rand(1, 2, 1, 41, 41, sigma=0.7)
    w1, w2 = gaussian_projection(16, 16, seed=1), gaussian_projection(16, 16, seed=2)
    state = PERFORMER.init_state(k[:, :, :40], v[:, :, :40], num_features=16, buffers={"projection": w1})
    out = _step(q[:, :, 40:], k, v, state, buffers={"projection": w2}, num_features=16)  # redrawn features
    torch.testing.assert_close(out, performer_attention(q, k, v, projection=w2)[:, :, 40:], atol=2e-6, rtol=1e-5)
    k2 = k.clone()
    k2[:, :, 39] += 1.0  # a different cache
    out = _step(q[:, :, 40:], k2, v, state, buffers={"projection": w2}, num_features=16)
    torch.testing.assert_close(out, performer_attention(q, k2, v, projection=w2)[:, :, 40:], atol=2e-6, rtol=1e-5)


# --------------------------------------------------------------------------- patched models

def test_projection_is_a_layer_buffer_and_redraw_changes_it():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 40))
    patch_model(model, {"method": "performer", "layers": 2, "params": {"num_features": 32, "seed": 7}})
    bufs = dict(model.named_buffers())
    keys = [k for k in bufs if k.endswith("longpatch_projection")]
    assert len(keys) == 2 and bufs[keys[0]].shape == (32, 16)
    # each patched layer (2 and 3 of 4) draws its own features from the configured seed
    mine = [perf.PERFORMER.make_buffers(head_dim=16, num_features=32, seed=7, layer_seed=i)["projection"]
            for i in (2, 3)]
    assert torch.equal(bufs[keys[0]], mine[0]) and torch.equal(bufs[keys[1]], mine[1])
    assert not torch.equal(mine[0], mine[1])
    before = logits(model, ids)
    assert redraw_buffers(model, seed=1) == 2
    after = logits(model, ids)
    sd = {n: t.clone() for n, t in model.named_buffers()}  # redraw works in place
    assert not torch.equal(sd[keys[0]], mine[0])
    assert not torch.equal(sd[keys[0]], sd[keys[1]])  # each layer its own draw
    assert not torch.allclose(before, after)
    redraw_buffers(model)  # from torch's global generator
    assert not torch.equal(dict(model.named_buffers())[keys[0]], sd[keys[0]])


def test_generate_decode_equals_prefill():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 40))
    patch_model(model, {"method": "performer", "layers": 2, "params": {"num_features": 32}})
    gen = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    stats = model.longpatch.stats()["patched"]
    assert stats["method"]["calls"] == 2 * 6 and "exact" not in stats
    full = logits(model, gen.sequences[:, :-1])
    torch.testing.assert_close(torch.stack(gen.logits, 1), full[:, 39:], atol=1e-4, rtol=1e-4)


def test_decode_bench_runs(tmp_path):
    from longpatch.bench.decode import run_decode_bench
    rows = run_decode_bench(methods=("performer",), cache_lens=(300,), heads=2, kv_heads=1, head_dim=16, repeats=1,
                            out_dir=tmp_path, method_params={"performer": {"num_features": 32}}, progress=False)
    assert len(rows) == 1 and rows[0]["speedup"] > 0 and rows[0]["init_state_ms"] is not None


def test_make_buffers_layer_seed():
    a = perf._make_buffers(head_dim=16, num_features=8)["projection"]
    assert torch.equal(a, gaussian_projection(8, 16))
    assert not torch.equal(a, perf._make_buffers(head_dim=16, num_features=8, layer_seed=1)["projection"])
