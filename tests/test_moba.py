"""MoBA (torch path): equality with a dense-mask oracle, decode with state, patched models."""

import pytest
import torch
from helpers import dense_attention, logits

import longpatch
from longpatch import patch_model, patched
from longpatch.errors import ConfigError
from longpatch.methods import get_method
from longpatch.methods import moba as moba_mod
from longpatch.methods.moba import cpu as moba_cpu
from longpatch.methods.moba import method as moba_method
from longpatch.methods.moba.naive import moba_reference
from longpatch.ops import exact_attention, moba_attention, moba_chunk_means
from longpatch.testing.tiny import tiny_model

MOBA = get_method("moba")


pytestmark = pytest.mark.usefixtures("one_thread")


def rand(b, hq, hk, nq, nk, d=16, dtype=torch.float32, grad=False):
    q = torch.randn(b, hq, nq, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(b, hk, nk, d, dtype=dtype, requires_grad=grad)
    v = torch.randn(b, hk, nk, d, dtype=dtype, requires_grad=grad)
    return q, k, v


CASES = [  # hq, hk, nq, nk, chunk, topk, causal, shared
    (2, 2, 64, 64, 16, 2, True, False),
    (4, 2, 100, 100, 16, 3, True, False),   # ragged last chunk, GQA
    (4, 2, 100, 100, 16, 3, True, True),    # shared selection
    (4, 1, 77, 77, 8, 4, True, False),      # MQA, many chunks
    (2, 2, 50, 50, 7, 5, True, True),       # odd chunk size
    (4, 2, 37, 100, 8, 4, True, False),     # chunked decode: queries start mid-chunk
    (2, 1, 1, 77, 8, 3, True, False),       # one token against a cache
    (2, 2, 70, 70, 16, 3, False, False),    # non-causal
    (4, 2, 30, 70, 16, 2, False, True),     # non-causal, q_len < kv_len
    (2, 1, 90, 70, 16, 2, False, False),    # non-causal, q_len > kv_len: some queries have no position
]


@pytest.mark.parametrize("hq,hk,nq,nk,chunk,topk,causal,shared", CASES)
def test_matches_dense_oracle(hq, hk, nq, nk, chunk, topk, causal, shared):
    q, k, v = rand(2, hq, hk, nq, nk)
    out, lse = moba_attention(q, k, v, causal=causal, chunk_size=chunk, topk=topk, shared_selection=shared,
                              return_lse=True, backend="torch")
    ref, ref_lse = moba_reference(q, k, v, chunk, topk, causal=causal, shared=shared)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=1e-5)


def test_scale_is_honoured():
    q, k, v = rand(1, 2, 1, 64, 64)
    out = moba_attention(q, k, v, chunk_size=16, topk=2, scale=0.37)
    ref, _ = moba_reference(q, k, v, 16, 2, scale=0.37)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("nq,nk", [(96, 96), (40, 96)])
def test_topk_covering_all_chunks_is_exact(causal, nq, nk):
    q, k, v = rand(2, 4, 2, nq, nk)
    ref = exact_attention(q, k, v, causal=causal)
    torch.testing.assert_close(moba_attention(q, k, v, causal=causal, chunk_size=16, topk=6), ref, atol=2e-6, rtol=1e-5)
    # the op short-cuts this case to exact attention; the sparse machinery gives the same answer
    plan = moba_cpu.Plan(q, k, 16, 6, causal, None, 0.25, False)
    torch.testing.assert_close(moba_cpu.torch_forward(q, k, v, plan)[0], ref, atol=2e-6, rtol=1e-5)


def test_topk_one_is_own_chunk_only():
    q, k, v = rand(1, 2, 2, 50, 50)
    vis = torch.zeros(50, 50, dtype=torch.bool)
    for c in range(0, 50, 16):
        vis[c:c + 16, c:c + 16] = True
    ref, _ = dense_attention(q, k, v, causal=True, mask=vis)
    torch.testing.assert_close(moba_attention(q, k, v, chunk_size=16, topk=1).double(), ref, atol=2e-6, rtol=1e-5)


def test_ties_go_to_the_most_recent_chunk():
    """Identical keys make every gate score equal: the own chunk + the latest past chunks win."""
    n, c = 64, 8
    q = torch.randn(1, 1, n, 16)
    k = torch.ones(1, 1, n, 16)
    v = (torch.arange(n) // c).float().view(1, 1, n, 1).expand(1, 1, n, 16).contiguous()  # value = chunk index
    out = moba_attention(q, k, v, chunk_size=c, topk=3)
    for p in range(n):
        own = p // c
        chosen = [x for x in (own - 2, own - 1) if x >= 0]
        keys = [x for ch in chosen for x in range(ch * c, ch * c + c)] + list(range(own * c, p + 1))
        assert out[0, 0, p, 0].item() == pytest.approx(sum(j // c for j in keys) / len(keys), abs=1e-5)


def test_causal_future_keys_do_not_matter():
    q, k, v = rand(1, 4, 2, 80, 80)
    out = moba_attention(q, k, v, chunk_size=8, topk=3)
    t = 43
    k2, v2 = k.clone(), v.clone()
    k2[:, :, t + 1:] = 100 * torch.randn_like(k2[:, :, t + 1:])
    v2[:, :, t + 1:] = torch.randn_like(v2[:, :, t + 1:])
    out2 = moba_attention(q, k2, v2, chunk_size=8, topk=3)
    assert torch.equal(out[:, :, :t + 1], out2[:, :, :t + 1])


def test_chunk_means_argument():
    q, k, v = rand(2, 4, 2, 90, 90)
    ref = moba_attention(q, k, v, chunk_size=16, topk=3)
    means = moba_chunk_means(k, 16)
    assert means.shape == (2, 2, 5, 16) and means.dtype == torch.float32
    torch.testing.assert_close(means, k[:, :, :80].reshape(2, 2, 5, 16, 16).mean(3))
    for given in (means, means[:, :, :2]):  # all full chunks, or a prefix (the rest from k)
        torch.testing.assert_close(moba_attention(q, k, v, chunk_size=16, topk=3, chunk_means=given), ref,
                                   atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="chunk_means"):
        moba_attention(q, k, v, chunk_size=16, chunk_means=means[:, :1])


def test_argument_checks():
    q, k, v = rand(1, 2, 2, 8, 8)
    with pytest.raises(ValueError, match="topk"):
        moba_attention(q, k, v, topk=0)
    with pytest.raises(ValueError, match="chunk_size"):
        moba_attention(q, k, v, chunk_size=0)
    with pytest.raises(ConfigError, match="topk"):
        MOBA.resolve_params({"topk": 0})


def test_small_windows_and_backward_tiles(monkeypatch):
    """Tiny temporary-memory budgets split the work into many windows and tiles: same answers."""
    q, k, v = rand(1, 4, 2, 100, 100, dtype=torch.float64, grad=True)
    ref = moba_attention(q, k, v, chunk_size=16, topk=3)
    gref = torch.autograd.grad(ref.sum(), (q, k, v))
    monkeypatch.setattr(moba_cpu, "_PAIR_ROWS", 64)
    monkeypatch.setattr(moba_cpu, "_BWD_ELEMS", 600)
    monkeypatch.setattr(moba_cpu, "_GATE_ELEMS", 50)
    out = moba_attention(q, k, v, chunk_size=16, topk=3)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), gref):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("causal,shared,nq",
                         [(True, False, 70), (True, True, 70), (False, False, 70), (True, False, 25)])
def test_gradients_match_oracle(causal, shared, nq):
    q, k, v = rand(1, 4, 2, nq, 70, dtype=torch.float64, grad=True)
    out, lse = moba_attention(q, k, v, causal=causal, chunk_size=16, topk=3, shared_selection=shared, return_lse=True)
    ref, ref_lse = moba_reference(q, k, v, 16, 3, causal=causal, shared=shared)
    do, dl = torch.randn_like(ref), torch.randn_like(ref_lse)
    got = torch.autograd.grad((out * do).sum() + (lse.double() * dl).sum(), (q, k, v))
    want = torch.autograd.grad((ref * do).sum() + (ref_lse * dl).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)  # the returned LSE is float32


def test_never_scores_n_by_n(monkeypatch):
    """Every attention call sees at most one chunk of keys; the gate at most n/chunk means."""
    seen = []
    real = moba_cpu.attend

    def spy(q, k, v, scale, **kw):
        seen.append(k.shape[-2])
        return real(q, k, v, scale, **kw)

    monkeypatch.setattr(moba_cpu, "attend", spy)
    q, k, v = rand(1, 2, 2, 256, 256)
    moba_attention(q, k, v, chunk_size=32, topk=3)
    assert seen and max(seen) <= 32


# --------------------------------------------------------------------------- decode

def _decode(q, k, v, state, **params):
    return MOBA.decode(q, k, v, causal=True, scale=None, backend="torch", buffers={}, state=state, **params)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("views", [True, False])  # one-token path: fused calls on views / the gather fallback
def test_stepwise_decode_equals_prefill_and_reuses_chunk_means(shared, views, monkeypatch):
    if not views:
        monkeypatch.setattr(moba_cpu, "spans_ok", lambda *a: False)
    params = dict(chunk_size=8, topk=3, shared_selection=shared)
    q, k, v = rand(2, 4, 2, 70, 70)
    full = moba_attention(q, k, v, **params)
    rows = []
    real = moba_mod.moba_chunk_means

    def counting(x, c):
        rows.append(x.shape[2] // c * c)
        return real(x, c)

    for module in (moba_cpu, moba_method):  # the decode state's means and the op's own
        monkeypatch.setattr(module, "moba_chunk_means", counting)
    state = {}
    _decode(q[:, :, :20], k[:, :, :20], v[:, :, :20], state, **params)  # a "prefill" of 20 tokens
    outs = [_decode(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], state, **params) for t in range(20, 70)]
    torch.testing.assert_close(torch.cat(outs, 2), full[:, :, 20:], atol=2e-6, rtol=1e-5)
    assert state["means"].shape == (2, 2, 70 // 8, 16)
    assert sum(rows) == 70 // 8 * 8  # every chunk mean computed exactly once


def test_chunked_decode_equals_prefill():
    params = dict(chunk_size=8, topk=3)
    q, k, v = rand(1, 4, 2, 64, 64)
    full = moba_attention(q, k, v, **params)
    state = {}
    outs = [_decode(q[:, :, s:s + 5], k[:, :, :s + 5], v[:, :, :s + 5], state, **params) for s in range(4, 64, 5)]
    torch.testing.assert_close(torch.cat(outs, 2), full[:, :, 4:], atol=2e-6, rtol=1e-5)


def test_decode_state_rebuilt_when_cache_changes():
    """Beam-search reordering (or a different sequence) invalidates cached means: detected, rebuilt."""
    params = dict(chunk_size=8, topk=2)
    q, k, v = rand(2, 2, 2, 41, 41)
    state = MOBA.init_state(k[:, :, :40], v[:, :, :40], **params)
    assert state["means"].shape[2] == 5
    perm = torch.tensor([1, 0])
    kp, vp, qp = k[perm], v[perm], q[perm]
    out = _decode(qp[:, :, 40:], kp, vp, state, **params)
    ref = moba_attention(qp, kp, vp, **params)[:, :, 40:]
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(state["means"], moba_chunk_means(kp, 8))


def test_init_state_gives_the_decode_answer():
    params = dict(chunk_size=16, topk=3)
    q, k, v = rand(1, 2, 1, 1, 200)
    state = MOBA.init_state(k, v, **params)
    ref = moba_attention(q, k, v, **params)
    torch.testing.assert_close(_decode(q, k, v, state, **params), ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(_decode(q, k, v, {}, **params), ref, atol=2e-6, rtol=1e-5)


# --------------------------------------------------------------------------- patched models

def test_generate_with_topk_covering_everything_equals_unpatched():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 40))
    ref = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    with patched(model, {"method": "moba", "layers": "all", "params": {"chunk_size": 8, "topk": 16}}):
        out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        stats = model.longpatch.stats()["patched"]
        assert stats["method"]["calls"] == 4 * 8  # prefill + 7 decode steps, 4 layers: all on MoBA
        assert "exact" not in stats
    assert torch.equal(out, ref)


def test_generate_sparse_decode_equals_prefill_and_keeps_state():
    """A sparse (topk < chunks) patched model: each decode step's logits equal those of one prefill
    of the final sequence, and the layers' decode state holds the means of the full chunks."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 50))
    patch_model(model, {"method": "moba", "layers": 2, "params": {"chunk_size": 8, "topk": 2}})
    gen = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    assert gen.sequences.shape == (1, 60)
    assert model.longpatch.stats()["patched"]["method"]["calls"] == 2 * 10
    for route in model.longpatch.routes:
        if route.method is not None:
            assert route.state["means"].shape[2] == 59 // 8  # the cache length at the last step
    full = logits(model, gen.sequences[:, :-1])
    steps = torch.stack(gen.logits, 1)
    torch.testing.assert_close(steps, full[:, 49:], atol=1e-4, rtol=1e-4)
    dense = tiny_model("llama")
    assert not torch.allclose(logits(dense, gen.sequences[:, :-1])[:, 49:], steps, atol=1e-3)  # really sparse


def test_chatglm2_incremental_decode_equals_prefill():
    """ChatGLM2's layout (K/V groups, legacy tuple cache): sparse decode steps match one prefill."""
    model = tiny_model("chatglm2")
    ids = torch.randint(0, 256, (1, 40))
    patch_model(model, {"method": "moba", "layers": "all", "params": {"chunk_size": 8, "topk": 2}})
    with torch.no_grad():
        full, _ = model(ids, use_cache=True)
        out, cache = model(ids[:, :30], use_cache=True)
        steps = []
        for t in range(30, 40):
            out, cache = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(out[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 30:40], atol=1e-4, rtol=1e-4)
    assert model.longpatch.stats()["patched"]["method"]["calls"] == 4 * 12


def test_registered_in_ops_and_methods():
    assert longpatch.ops.moba_attention is moba_attention
    assert MOBA.stateful and MOBA.decode is not None and MOBA.init_state is not None
    assert MOBA.resolve_params({}) == {"chunk_size": moba_mod.DEFAULT_CHUNK_SIZE, "topk": moba_mod.DEFAULT_TOPK,
                                       "shared_selection": False, "selection": "gate", "mass": None, "max_share": None,
                                       "estimate_queries": 64, "score_stride": 16, "local_blocks": 1,
                                       "decode_topk": 8, "decode_page": None, "decode_prefill": True,
                                       "final_topk": None}


def test_decode_bench_runs(tmp_path):
    from longpatch.bench.decode import run_decode_bench
    rows = run_decode_bench(methods=("moba",), cache_lens=(300,), heads=2, kv_heads=1, head_dim=16, repeats=1,
                            out_dir=tmp_path, method_params={"moba": {"chunk_size": 32, "topk": 2}}, progress=False)
    assert len(rows) == 1 and rows[0]["cache_len"] == 300 and rows[0]["speedup"] > 0
    assert rows[0]["err_random"] > 0 and rows[0]["init_state_ms"] is not None
    assert (tmp_path / "decode_bench.json").is_file() and (tmp_path / "decode_bench.png").is_file()
