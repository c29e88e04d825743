"""Sparse attention (torch path): every pattern equals a dense-mask oracle; decode; patched models."""
import pytest
import torch
from helpers import dense_attention, logits

from longpatch import patch_model, patched
from longpatch.errors import ConfigError
from longpatch.methods import get_method
from longpatch.methods import sparse as sp
from longpatch.methods.sparse import SparsePattern, random_key_blocks, sparse_attention, union_key_positions
from longpatch.testing.tiny import tiny_model

SPARSE = get_method("sparse")

pytestmark = pytest.mark.usefixtures("one_thread")


def sparse_mask(nq, nk, *, causal=True, window=4, global_tokens=0, dilation=1, random_blocks=0, block=8, seed=0):
    """Bool [nq, nk] visibility from the pattern's definition, entry by entry (no decomposition).

    Query row i is at position p = nk - nq + i. It sees key j when: j < G (global key); or, non-causal,
    0 <= p < G (a global query sees everything); or j is in its window: p - j = t * dilation with
    0 <= t < window (causal) or |t| <= window // 2 (non-causal); or j lies in one of the random blocks
    of its query block p // block (the draw itself is ``random_key_blocks``, tested on its own below).
    Causal: additionally j <= p.
    """
    nkb = -(-nk // block)
    vis = torch.zeros(nq, nk, dtype=torch.bool)
    for i in range(nq):
        p = nk - nq + i
        rand = set()
        if random_blocks:
            rand = set(random_key_blocks(torch.tensor([p // block]), nkb, random_blocks, seed, causal)[0].tolist())
        for j in range(nk):
            dist = p - j
            on_grid = dist % dilation == 0
            t = dist // dilation
            in_window = on_grid and (0 <= t < window if causal else abs(t) <= window // 2)
            ok = j < global_tokens or in_window or (j // block) in rand
            if not causal and 0 <= p < global_tokens:
                ok = True
            if causal and j > p:
                ok = False
            vis[i, j] = ok
    return vis


def spec(**pattern):
    """Every pattern parameter explicit (the op's defaults differ from the oracle's)."""
    return {**dict(window=4, global_tokens=0, dilation=1, random_blocks=0, block=8, seed=0), **pattern}


def oracle(q, k, v, causal=True, **pattern):
    mask = sparse_mask(q.shape[2], k.shape[2], causal=causal, **spec(**pattern))
    return dense_attention(q, k, v, causal=False, mask=mask)


def rand(b, hq, hk, nq, nk, d=16, dtype=torch.float32):
    return (torch.randn(b, hq, nq, d).to(dtype), torch.randn(b, hk, nk, d).to(dtype),
            torch.randn(b, hk, nk, d).to(dtype))


CASES = [  # b, hq, hk, nq, nk, causal, pattern
    (1, 2, 2, 70, 70, True, dict(window=8)),                                   # band only
    (1, 2, 2, 70, 70, True, dict(window=5, dilation=3)),                       # dilated
    (1, 2, 1, 70, 70, True, dict(window=6, global_tokens=5)),                  # global + window, MQA
    (1, 4, 2, 70, 70, True, dict(window=1, random_blocks=2, block=8)),         # random (+ self)
    (2, 4, 2, 90, 90, True, dict(window=6, global_tokens=3, dilation=2, random_blocks=2, block=8, seed=7)),
    (1, 4, 2, 33, 90, True, dict(window=6, global_tokens=5, dilation=3, random_blocks=3, block=8)),  # ragged
    (1, 2, 2, 300, 300, True, dict(window=70, global_tokens=4, random_blocks=1, block=16)),  # batched tiles
    (1, 2, 2, 70, 70, False, dict(window=7, global_tokens=3)),                 # non-causal band + global
    (1, 4, 2, 50, 70, False, dict(window=6, global_tokens=3, dilation=2, random_blocks=2, block=8)),
    (1, 2, 1, 90, 70, False, dict(window=6, global_tokens=3, dilation=2, random_blocks=2, block=8)),  # nq > nk
    (1, 2, 2, 40, 40, True, dict(window=100, global_tokens=50)),               # window/global beyond n
    (1, 4, 2, 60, 60, True, dict(window=4, global_tokens=2, random_blocks=3, block=1)),   # random keys per query
    (1, 2, 2, 40, 40, False, dict(window=4, random_blocks=3, block=1)),
]


@pytest.mark.parametrize("b,hq,hk,nq,nk,causal,pattern", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_dense_mask_oracle(b, hq, hk, nq, nk, causal, pattern, dtype):
    q, k, v = rand(b, hq, hk, nq, nk, dtype=dtype)
    out, lse = sparse_attention(q, k, v, causal=causal, return_lse=True, backend="torch", **spec(**pattern))
    ref, ref_lse = oracle(q, k, v, causal, **pattern)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == q.shape
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)


def test_dense_limit_equals_exact_attention():
    """A window covering everything is exact causal attention."""
    q, k, v = rand(1, 4, 2, 50, 50)
    out = sparse_attention(q, k, v, window=64, global_tokens=0, backend="torch")
    torch.testing.assert_close(out.double(), dense_attention(q, k, v)[0], atol=2e-5, rtol=2e-5)


def test_random_key_blocks_definition():
    qb = torch.arange(0, 40)
    sel = random_key_blocks(qb, 40, 3, seed=1, causal=True)
    for b, row in zip(qb.tolist(), sel.tolist()):
        got = [c for c in row if c >= 0]
        assert len(got) == min(3, b) and len(set(got)) == len(got)  # distinct; all of them when few
        assert all(0 <= c < b for c in got)  # strictly past blocks
    nc = random_key_blocks(qb, 40, 3, seed=1, causal=False)
    for b, row in zip(qb.tolist(), nc.tolist()):
        assert len(set(row)) == 3 and b not in row and all(0 <= c < 40 for c in row)
    assert torch.equal(sel, random_key_blocks(qb, 40, 3, seed=1, causal=True))  # deterministic
    assert torch.equal(sel[5:9], random_key_blocks(qb[5:9], 40, 3, seed=1, causal=True))  # per block
    assert not torch.equal(sel, random_key_blocks(qb, 40, 3, seed=2, causal=True))
    # the cache length does not change a causal draw (decode equals prefill)
    assert torch.equal(sel, random_key_blocks(qb, 90, 3, seed=1, causal=True))
    qb = torch.arange(1000, 3000)
    pick = random_key_blocks(qb, 4000, 1, seed=0, causal=True)[:, 0]
    counts = torch.bincount(pick * 5 // qb, minlength=5)  # where in [0, qb) the pick falls, 5 bins
    assert counts.min() > 300  # roughly uniform over the past blocks (400 expected per bin)


@pytest.mark.parametrize("pattern", [dict(window=8, global_tokens=4),
                                     dict(window=5, global_tokens=4, dilation=3),
                                     dict(window=4, global_tokens=2, random_blocks=2, block=8, seed=3)])
def test_decode_equals_last_prefill_row(pattern):
    q, k, v = rand(2, 4, 2, 90, 90)
    full = sparse_attention(q, k, v, backend="torch", **spec(**pattern))
    for t in (3, 40, 89):  # a step inside the global prefix, mid-sequence, the last one
        step, lse = sparse_attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], backend="torch",
                                     return_lse=True, **spec(**pattern))
        torch.testing.assert_close(step, full[:, :, t:t + 1], atol=1e-5, rtol=1e-5)
        ref, ref_lse = oracle(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], **pattern)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_decode_cost_does_not_grow_with_the_cache(monkeypatch):
    """One decode step reads at most window + G + random keys, whatever the cache length."""
    seen = []
    real = sp.attend

    def spy(q, k, v, scale, **kw):
        seen.append(k.shape[-2])
        return real(q, k, v, scale, **kw)

    monkeypatch.setattr(sp, "attend", spy)
    q, k, v = rand(1, 2, 1, 1, 3000)
    for pattern in (dict(window=16, global_tokens=4), dict(window=16, global_tokens=4, dilation=5, random_blocks=2)):
        seen.clear()
        sparse_attention(q, k, v, backend="torch", block=8, **pattern)
        assert 0 < sum(seen) <= 16 + 4 + 2 * 8


def test_never_scores_n_by_n(monkeypatch):
    """Every fused call sees a bounded key span, never the whole sequence."""
    calls = []
    real = sp.attend

    def spy(q, k, v, scale, **kw):
        calls.append((q.shape[-2], k.shape[-2]))
        return real(q, k, v, scale, **kw)

    monkeypatch.setattr(sp, "attend", spy)
    n = 2048
    q, k, v = rand(1, 1, 1, n, n)
    out = sparse_attention(q, k, v, window=32, global_tokens=4, random_blocks=1, block=16, backend="torch")
    assert torch.isfinite(out).all()
    assert max(kl for _, kl in calls) <= 64 + 32 and max(m * kl for m, kl in calls) < n * n // 8


def test_causal_future_keys_do_not_matter():
    q, k, v = rand(1, 2, 2, 80, 80)
    pattern = dict(window=6, global_tokens=3, dilation=2, random_blocks=2, block=8)
    out = sparse_attention(q, k, v, backend="torch", **spec(**pattern))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 50:] += 5 * torch.randn_like(k2[:, :, 50:])
    v2[:, :, 50:] += 5 * torch.randn_like(v2[:, :, 50:])
    out2 = sparse_attention(q, k2, v2, backend="torch", **spec(**pattern))
    assert torch.equal(out[:, :, :50], out2[:, :, :50])
    assert not torch.allclose(out[:, :, 50:], out2[:, :, 50:])


def test_gradients_match_the_oracle():
    q, k, v = (t.double().requires_grad_() for t in rand(1, 4, 2, 40, 40))
    pattern = dict(window=5, global_tokens=3, dilation=2, random_blocks=1, block=8)
    out, lse = sparse_attention(q, k, v, backend="torch", return_lse=True, **spec(**pattern))
    ref, ref_lse = oracle(q, k, v, **pattern)
    do, dl = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out * do).sum() + (lse * dl).sum(), (q, k, v))
    want = torch.autograd.grad((ref * do).sum() + (ref_lse * dl).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_gradients_through_the_fused_kernel():
    q, k, v = (t.requires_grad_() for t in rand(1, 2, 1, 300, 300))  # float32: batched fused tiles
    pattern = dict(window=70, global_tokens=4)
    out = sparse_attention(q, k, v, backend="torch", **spec(**pattern))
    ref, _ = oracle(q, k, v, **pattern)
    do = torch.randn_like(out)
    got = torch.autograd.grad((out * do).sum(), (q, k, v))
    want = torch.autograd.grad((ref * do).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_method_params_and_validation():
    assert SPARSE.resolve_params({}) == {"window": 1024, "global_tokens": 64, "dilation": 1, "random_blocks": 0,
                                         "block": 64, "seed": None}
    assert SPARSE.decode is not None and SPARSE.exact_params is not None
    for bad in ({"window": 0}, {"dilation": 0}, {"global_tokens": -1}, {"random_blocks": -2}, {"block": 0},
                {"seed": -1}, {"window": 2.5}, {"random_per_query": 3}):
        with pytest.raises(ConfigError):
            SPARSE.resolve_params(bad)
    q, k, v = rand(1, 2, 2, 8, 8)
    with pytest.raises(ValueError, match="window"):
        sparse_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="dilation"):
        sparse_attention(q, k, v, dilation=True)


def test_empty_inputs():
    q, k, v = rand(1, 2, 2, 0, 0)
    out, lse = sparse_attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == (1, 2, 0)


# --------------------------------------------------------------------------- patched models

def test_window_covering_everything_equals_unpatched():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 40))
    ref = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with patched(model, {"method": "sparse", "layers": "all", "params": {"window": 64, "global_tokens": 0}}):
        out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert model.longpatch.stats()["patched"]["method"]["calls"] == 4 * 6
    assert torch.equal(out, ref)


def test_patched_model_prefills_and_generates_with_decode_equal_to_prefill():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 45))
    patch_model(model, {"method": "sparse", "layers": 2,
                        "params": {"window": 8, "global_tokens": 2, "dilation": 2, "random_blocks": 1, "block": 8}})
    gen = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    assert gen.sequences.shape == (1, 53)
    assert model.longpatch.stats()["patched"]["method"]["calls"] == 2 * 8  # prefill + 7 decode steps
    full = logits(model, gen.sequences[:, :-1])
    steps = torch.stack(gen.logits, 1)
    torch.testing.assert_close(steps, full[:, 44:], atol=1e-4, rtol=1e-4)
    dense = tiny_model("llama")
    assert not torch.allclose(logits(dense, gen.sequences[:, :-1])[:, 44:], steps, atol=1e-3)  # really sparse


def test_each_patched_layer_draws_its_own_random_blocks():
    model = tiny_model("llama")
    patch_model(model, {"method": "sparse", "layers": 2, "params": {"window": 8, "global_tokens": 2,
                                                                      "random_blocks": 1, "block": 4, "seed": 5}})
    bufs = [t for k, t in model.named_buffers() if k.endswith("longpatch_seed")]
    assert len(bufs) == 2 and int(bufs[0]) != int(bufs[1])
    # the buffer is what the layer uses: another seed changes the output
    ids = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        before = model(ids).logits
        bufs[0].fill_(12345)
        assert not torch.equal(before, model(ids).logits)


@pytest.mark.parametrize("params", [dict(window=7, global_tokens=5, dilation=1, random_blocks=2, block=4),
                                    dict(window=5, global_tokens=0, dilation=3, random_blocks=3, block=6),
                                    dict(window=64, global_tokens=9, dilation=2, random_blocks=0, block=8)])
def test_attended_pairs_count_each_querys_union(params):
    """``attended_pairs`` (bench attention's pairs / ideal columns) equals the sizes of the key sets
    ``union_key_positions`` builds query by query (the decode path's own construction)."""
    n = 90
    full = dict(get_method("sparse").resolve_params({}), **params, seed=3)
    pat = SparsePattern(window=full["window"], global_tokens=full["global_tokens"], dilation=full["dilation"],
                        random_blocks=full["random_blocks"], block=full["block"], seed=3, causal=True)
    want = sum(len(union_key_positions(p, n, pat)) for p in range(n))
    q, k = torch.zeros(1, 2, n, 4), torch.zeros(1, 1, n, 4)
    assert get_method("sparse").attended_pairs(q, k, True, full) == 2 * want
    assert get_method("sparse").attended_pairs(q, k, False, full) is None
