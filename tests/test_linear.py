"""Linear attention (torch path): the quadratic reference, RNN decode == prefill, the method."""
import pytest
import torch
from helpers import logits

import longpatch.methods.linear as lin
from longpatch import patch_model
from longpatch.errors import ConfigError
from longpatch.methods import get_method
from longpatch.methods.linear import linear_attention, linear_features
from longpatch.testing.tiny import tiny_model

LINEAR = get_method("linear")
pytestmark = pytest.mark.usefixtures("one_thread")


def quadratic_reference(q, k, v, causal=True, feature_map="elu+1"):
    """φ(Q)φ(K)ᵀ (masked bottom-right) V / row sums, the n x n way, float64, K/V repeated per head."""
    g = q.shape[1] // k.shape[1]
    qf = linear_features(q.double(), feature_map)
    kf = linear_features(k.double(), feature_map).repeat_interleave(g, 1)
    a = qf @ kf.transpose(-1, -2)
    nq, nk = q.shape[2], k.shape[2]
    if causal:
        a = a * torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
    return (a @ v.double().repeat_interleave(g, 1)) / a.sum(-1, keepdim=True)


def rand(b, hq, hk, nq, nk, d=16, dv=None, dtype=torch.float32, grad=False):
    q = torch.randn(b, hq, nq, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(b, hk, nk, d, dtype=dtype, requires_grad=grad)
    v = torch.randn(b, hk, nk, dv or d, dtype=dtype, requires_grad=grad)
    return q, k, v


CASES = [  # hq, hk, nq, nk, causal, feature_map, dv
    (2, 2, 100, 100, True, "elu+1", 16),     # ragged last chunk (64 + 36)
    (4, 2, 130, 130, True, "elu+1", 8),      # GQA, several chunks, dv != d
    (4, 1, 37, 150, True, "elu+1", 16),      # queries are the last 37 positions: a prefix state
    (2, 1, 1, 77, True, "elu+1", 16),        # one token against a cache
    (2, 2, 70, 70, False, "elu+1", 16),
    (4, 2, 90, 40, False, "elu+1", 16),      # non-causal, q_len > kv_len
    (2, 2, 80, 80, True, "relu", 16),
]


@pytest.mark.parametrize("hq,hk,nq,nk,causal,fm,dv", CASES)
def test_matches_quadratic_reference(hq, hk, nq, nk, causal, fm, dv):
    q, k, v = rand(2, hq, hk, nq, nk, dv=dv)
    out = linear_attention(q, k, v, causal=causal, feature_map=fm)
    assert out.shape == (2, hq, nq, dv) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), quadratic_reference(q, k, v, causal, fm), atol=2e-6, rtol=1e-5)


def test_small_segments_carry_the_state(monkeypatch):
    """The chunk-summary cumsum runs in segments when memory asks; the carried state is exact."""
    monkeypatch.setattr(lin, "_SEGMENT_ELEMS", 1)
    q, k, v = rand(1, 2, 1, 200, 200)
    torch.testing.assert_close(linear_attention(q, k, v).double(), quadratic_reference(q, k, v), atol=2e-6, rtol=1e-5)


def test_bf16_matches_fp32():
    q, k, v = rand(1, 4, 2, 96, 96)
    ref = linear_attention(q, k, v)
    out = linear_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_causal_future_keys_do_not_matter():
    q, k, v = rand(1, 2, 2, 90, 90)
    out = linear_attention(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 50:] += 3.0
    v2[:, :, 50:] -= 1.0
    torch.testing.assert_close(linear_attention(q, k2, v2)[:, :, :50], out[:, :, :50])


def test_gradients_match_reference():
    q, k, v = rand(1, 4, 2, 70, 70, dtype=torch.float64, grad=True)
    out = linear_attention(q, k, v)
    ref = quadratic_reference(q, k, v)
    w = torch.randn_like(ref)
    g1 = torch.autograd.grad((out * w).sum(), (q, k, v))
    g2 = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-7)


def test_argument_checks():
    q, k, v = rand(1, 2, 2, 8, 8)
    with pytest.raises(ValueError, match="feature_map"):
        linear_attention(q, k, v, feature_map="softmax")
    with pytest.raises(ValueError, match="log-sum-exp"):
        linear_attention(q, k, v, return_lse=True)
    with pytest.raises(ConfigError, match="params.feature_map"):
        LINEAR.resolve_params({"feature_map": "exp"})
    assert LINEAR.resolve_params({}) == {"feature_map": "elu+1"}


# --------------------------------------------------------------------------- decode (the RNN form)

def _step(q, k, v, state, **params):
    return LINEAR.decode(q, k, v, causal=True, scale=None, backend="torch", buffers={}, state=state, **params)


def test_rnn_decode_equals_prefill_and_folds_only_new_keys(monkeypatch):
    q, k, v = rand(2, 4, 2, 70, 70)
    full = linear_attention(q, k, v)
    rows = []
    real = lin.prefix_sums

    def counting(kf, vv):
        rows.append(kf.shape[2])
        return real(kf, vv)

    monkeypatch.setattr(lin, "prefix_sums", counting)
    state = {}
    outs = [_step(q[:, :, :20], k[:, :, :20], v[:, :, :20], state)]  # a "prefill" of 20 tokens
    outs += [_step(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], state) for t in range(20, 70)]
    torch.testing.assert_close(torch.cat(outs, 2), full, atol=2e-6, rtol=1e-5)
    assert state["length"] == 70 and state["S"].shape == (2, 2, 16, 16) and state["z"].shape == (2, 2, 16)
    assert sum(rows) == 70  # every key folded into (S, z) exactly once: O(d²) per step, not O(cache)


def test_chunked_decode_equals_prefill():
    q, k, v = rand(1, 4, 2, 64, 64)
    full = linear_attention(q, k, v)
    state = {}
    outs = [_step(q[:, :, s:s + 5], k[:, :, :s + 5], v[:, :, :s + 5], state) for s in range(4, 64, 5)]
    torch.testing.assert_close(torch.cat(outs, 2), full[:, :, 4:], atol=2e-6, rtol=1e-5)


def test_state_rebuilt_when_cache_changes():
    q, k, v = rand(2, 2, 2, 41, 41)
    state = LINEAR.init_state(k[:, :, :40], v[:, :, :40])
    perm = torch.tensor([1, 0])  # beam reordering: the state belongs to the other sequence now
    out = _step(q[perm][:, :, 40:], k[perm], v[perm], state)
    torch.testing.assert_close(out, linear_attention(q[perm], k[perm], v[perm])[:, :, 40:], atol=2e-6, rtol=1e-5)
    cropped = _step(q[:, :, 29:30], k[:, :, :30], v[:, :, :30], state)  # the cache shrank
    torch.testing.assert_close(cropped, linear_attention(q[:, :, :30], k[:, :, :30], v[:, :, :30])[:, :, 29:],
                               atol=2e-6, rtol=1e-5)
    assert state["length"] == 30


def test_init_state_gives_the_decode_answer():
    q, k, v = rand(1, 2, 1, 1, 200)
    state = LINEAR.init_state(k, v)
    ref = linear_attention(q, k, v)
    torch.testing.assert_close(_step(q, k, v, state), ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(_step(q, k, v, {}), ref, atol=2e-6, rtol=1e-5)


# --------------------------------------------------------------------------- patched models

def test_generate_decode_equals_prefill_and_keeps_state():
    """Each decode step's logits equal one prefill of the final sequence; the state covers the cache."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 40))
    patch_model(model, {"method": "linear", "layers": 2})
    gen = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    stats = model.longpatch.stats()["patched"]
    assert stats["method"]["calls"] == 2 * 8 and "exact" not in stats
    assert all(r.state["length"] == 47 for r in model.longpatch.routes if r.method is not None)
    full = logits(model, gen.sequences[:, :-1])
    torch.testing.assert_close(torch.stack(gen.logits, 1), full[:, 39:], atol=1e-4, rtol=1e-4)


def test_decode_bench_runs(tmp_path):
    from longpatch.bench.decode import run_decode_bench
    rows = run_decode_bench(methods=("linear",), cache_lens=(300,), heads=2, kv_heads=1, head_dim=16, repeats=1,
                            out_dir=tmp_path, progress=False)
    assert len(rows) == 1 and rows[0]["speedup"] > 0 and rows[0]["init_state_ms"] is not None
