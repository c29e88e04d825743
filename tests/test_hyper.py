"""HyperAttention (torch path): structure, exactness limits, causality, accuracy, seeds, gradients."""
import math

import pytest
import torch
from helpers import logits

from longpatch.errors import ConfigError
from longpatch.methods import get_method
from longpatch.methods.hyper import attention_lse_reference, gray_rank, lsh_directions, lsh_sort_keys
from longpatch.ops import exact_attention, hyper_attention


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def rand_qkv(b, hq, hk, n, d, dtype=torch.float32, seed=0, nq=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq or n, d, generator=g).to(dtype)
    k = torch.randn(b, hk, n, d, generator=g).to(dtype)
    v = torch.randn(b, hk, n, d, generator=g).to(dtype)
    return q, k, v


def heavy_hitter_qkv(n, d, heads=2, seed=0, strength=10.0, noise=0.05, shift=700):
    """Every query q_i = strength * u_i (u_i a random unit vector) has one dominant key, a noisy copy of
    u_i placed ``shift`` positions earlier (k_j ~ u_{j+shift}); all other keys are diffuse. Use
    scale=1. The regime HyperAttention is built for: LSH must find the heavy key, sampling the rest."""
    g = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(1, heads, n, d, generator=g), dim=-1)
    k = torch.roll(u, -shift, dims=2) + noise * torch.randn(1, heads, n, d, generator=g) / math.sqrt(d)
    v = torch.randn(1, heads, n, d, generator=g)
    return strength * u, k, v


# ----------------------------------------------------------------------------- sortLSH

@pytest.mark.parametrize("bits", [1, 2, 3, 5, 7, 10])
def test_gray_rank_orders_buckets_one_bit_apart(bits):
    buckets = torch.arange(2 ** bits)
    rank = gray_rank(buckets, bits)
    assert sorted(rank.tolist()) == list(range(2 ** bits))  # a permutation of the positions
    order = buckets[torch.argsort(rank)]  # buckets listed by sort key
    flips = (order[1:] ^ order[:-1]).tolist()
    assert all(f > 0 and f & (f - 1) == 0 for f in flips)  # neighbours differ in exactly one bit
    i = torch.arange(2 ** bits)
    assert torch.equal(gray_rank(i ^ (i >> 1), bits), i)  # inverse of the Gray code G(i) = i ^ i>>1


def test_gray_rank_is_not_the_gray_code():
    # The reference implementation sorted by gray(bucket); that ordering puts buckets 2 and 3 (one
    # bit apart) at ranks 3 and 2 but buckets 1 and 2 (two bits apart) next to each other.
    codes = torch.tensor([1, 2, 3])
    assert gray_rank(codes, 2).tolist() == [1, 3, 2]


def test_lsh_sort_keys_shapes_and_similarity():
    dirs = lsh_directions(32, 7, seed=3)
    assert dirs.shape == (32, 7) and dirs.dtype == torch.float32
    assert torch.equal(dirs, lsh_directions(32, 7, seed=3))
    assert not torch.equal(dirs, lsh_directions(32, 7, seed=4))
    x = torch.randn(2, 3, 50, 32)
    keys = lsh_sort_keys(x, dirs)
    assert keys.shape == (2, 3, 50) and keys.dtype == torch.int64 and int(keys.max()) < 2 ** 7
    assert torch.equal(lsh_sort_keys(2.5 * x, dirs), keys)  # angular hash: scale-free


# ----------------------------------------------------------------------------- exact limits

@pytest.mark.parametrize("causal", [True, False])
def test_min_seq_len_at_least_n_is_exact_attention(causal):
    q, k, v = rand_qkv(1, 4, 2, 300, 16)
    out = hyper_attention(q, k, v, causal=causal, min_seq_len=300)
    assert torch.equal(out, exact_attention(q, k, v, causal=causal))
    out, lse = hyper_attention(q, k, v, causal=causal, min_seq_len=4096, return_lse=True)
    ref_o, ref_l = attention_lse_reference(q, k, v, causal=causal, scale=16 ** -0.5)
    torch.testing.assert_close(out, ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_l, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [1000, 1537])
def test_sampling_every_key_recovers_exact_attention(causal, n):
    # With sample_size >= n every out-of-block key is sampled with weight N_out/m_out = 1 and every
    # own-block sample is masked: any double counting, counted padding or wrong merge shows up here.
    q, k, v = rand_qkv(2, 4, 2, n, 32)
    out, lse = hyper_attention(q, k, v, causal=causal, block_size=64, sample_size=10 ** 6, min_seq_len=100,
                               return_lse=True)
    ref_o, ref_l = attention_lse_reference(q, k, v, causal=causal, scale=32 ** -0.5)
    torch.testing.assert_close(out, ref_o, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, ref_l, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_sampled_part_stands_for_exactly_the_keys_outside_the_block(causal):
    # All keys equal: every score in a row is the same, so the exact LSE is s + log(#visible keys).
    # The sampled part must weigh its m_out samples by N_out / m_out (the keys outside the query's
    # block), so the estimate is exact whatever the sample; nk/m or n/m weights would not be.
    n, d = 1000, 16
    q = torch.randn(1, 2, n, d)
    k = torch.randn(1, 1, 1, d).expand(1, 2, n, d).contiguous()
    v = torch.randn(1, 2, n, d)
    out, lse = hyper_attention(q, k, v, causal=causal, block_size=64, sample_size=37, min_seq_len=100,
                               return_lse=True)
    s = (q * k).sum(-1) * d ** -0.5
    visible = torch.arange(1, n + 1, dtype=torch.float32) if causal else torch.full((n,), float(n))
    torch.testing.assert_close(lse, s + visible.log(), atol=1e-4, rtol=1e-5)


def test_causal_queries_shorter_than_keys_align_bottom_right():
    q, k, v = rand_qkv(1, 2, 2, 1000, 16, nq=700)
    out = hyper_attention(q, k, v, causal=True, block_size=32, sample_size=10 ** 6, min_seq_len=64)
    torch.testing.assert_close(out, exact_attention(q, k, v, causal=True), atol=2e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- approximation

def test_causality_future_keys_do_not_change_the_past():
    q, k, v = rand_qkv(1, 2, 2, 1500, 16)
    kw = dict(causal=True, block_size=32, sample_size=32, min_seq_len=64, seed=5)
    out = hyper_attention(q, k, v, **kw)
    t = 777
    k2, v2 = k.clone(), v.clone()
    k2[:, :, t:] = torch.randn_like(k2[:, :, t:]) * 3
    v2[:, :, t:] = torch.randn_like(v2[:, :, t:]) * 3
    out2 = hyper_attention(q, k2, v2, **kw)
    assert torch.equal(out[:, :, :t], out2[:, :, :t])
    assert not torch.allclose(out[:, :, t:], out2[:, :, t:])


@pytest.mark.parametrize("causal", [False, True])
def test_heavy_hitters_error_small_and_shrinking(causal):
    n, d, shift = 2048, 32, 700
    errs = {}
    for size in (32, 128, 512):
        e = []
        for seed in range(2):
            q, k, v = heavy_hitter_qkv(n, d, seed=seed, shift=shift)
            ref = exact_attention(q, k, v, causal=causal, scale=1.0)
            out = hyper_attention(q, k, v, causal=causal, scale=1.0, block_size=size, sample_size=size, min_seq_len=128,
                                  seed=seed)
            # rows >= shift: their heavy key exists under both masks
            e.append(rel_err(out[:, :, shift:], ref[:, :, shift:]))
        errs[size] = sum(e) / len(e)
    assert errs[512] < 0.7 * errs[128] and errs[128] < 0.7 * errs[32], errs
    assert errs[512] < (0.3 if not causal else 0.12), errs
    assert errs[32] > 1e-2, errs  # the approximation is really in use


@pytest.mark.parametrize("causal", [False, True])
def test_sortlsh_finds_heavy_hitters(causal):
    # Zero directions put every row in one bucket: blocks are then plain position blocks, which never
    # hold a heavy key 700 positions away. The Gray-ordered LSH must do much better.
    n, d, shift = 2048, 32, 700
    q, k, v = heavy_hitter_qkv(n, d, seed=3, shift=shift)
    ref = exact_attention(q, k, v, causal=causal, scale=1.0)
    kw = dict(causal=causal, scale=1.0, block_size=128, sample_size=128, min_seq_len=128, seed=3)
    lsh = rel_err(hyper_attention(q, k, v, **kw)[:, :, shift:], ref[:, :, shift:])
    blind = rel_err(hyper_attention(q, k, v, lsh_dirs=torch.zeros(d, 7), **kw)[:, :, shift:], ref[:, :, shift:])
    assert lsh < 0.5 * blind, (lsh, blind)


def test_sampling_reduces_error_at_fixed_block():
    q, k, v = heavy_hitter_qkv(2048, 32, seed=1)
    ref = exact_attention(q, k, v, causal=False, scale=1.0)

    def err(m):
        return sum(rel_err(hyper_attention(q, k, v, causal=False, scale=1.0, block_size=64, sample_size=m,
                                           min_seq_len=128, seed=s), ref) for s in range(3)) / 3

    assert err(1024) < 0.8 * err(64)


# ----------------------------------------------------------------------------- layout, dtypes, seeds

@pytest.mark.parametrize("causal", [True, False])
def test_gqa_equals_repeated_kv(causal):
    q, k, v = rand_qkv(2, 6, 2, 700, 16)
    kw = dict(causal=causal, block_size=64, sample_size=48, min_seq_len=128, seed=1)
    out = hyper_attention(q, k, v, **kw)
    rep = hyper_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), **kw)
    torch.testing.assert_close(out, rep, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n", [129, 515, 1001])
def test_ragged_lengths_give_finite_outputs(n):
    q, k, v = rand_qkv(1, 2, 1, n, 16)
    for causal in (True, False):
        out, lse = hyper_attention(q, k, v, causal=causal, block_size=64, sample_size=20, min_seq_len=64,
                                   return_lse=True)
        assert out.shape == q.shape and lse.shape == q.shape[:3]
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_matches_fp32(dtype):
    q, k, v = rand_qkv(1, 2, 2, 900, 32, dtype=dtype)
    for causal in (True, False):
        kw = dict(causal=causal, block_size=64, sample_size=64, min_seq_len=128, seed=2, return_lse=True)
        out, lse = hyper_attention(q, k, v, **kw)
        ref, ref_lse = hyper_attention(q.float(), k.float(), v.float(), **kw)  # same hashes: same inputs
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert rel_err(out, ref) < 2e-2
        assert (lse - ref_lse).abs().max() < 5e-2


def test_seed_determinism():
    q, k, v = rand_qkv(1, 2, 2, 1200, 16)
    for causal in (True, False):
        kw = dict(causal=causal, block_size=64, sample_size=32, min_seq_len=128)
        a = hyper_attention(q, k, v, seed=7, **kw)
        assert torch.equal(a, hyper_attention(q, k, v, seed=7, **kw))
        assert not torch.equal(a, hyper_attention(q, k, v, seed=8, **kw))
        assert torch.equal(hyper_attention(q, k, v, **kw), hyper_attention(q, k, v, seed=0, **kw))  # None -> 0
        # explicit directions = the ones drawn from the seed; the seed still drives the sampling
        dirs = lsh_directions(16, 7, seed=7)
        assert torch.equal(a, hyper_attention(q, k, v, seed=7, lsh_dirs=dirs, **kw))
        assert not torch.equal(a, hyper_attention(q, k, v, seed=9, lsh_dirs=dirs, **kw))


# ----------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("causal", [True, False])
def test_gradients_flow_and_match_exact_when_exact(causal):
    q, k, v = rand_qkv(1, 4, 2, 600, 16)
    q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = hyper_attention(q1, k1, v1, causal=causal, block_size=32, sample_size=10 ** 6, min_seq_len=64,
                               return_lse=True)
    go = torch.randn_like(out)
    ((out * go).sum() + lse.sum()).backward()
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    ref_o, ref_l = attention_lse_reference(q2, k2, v2, causal=causal, scale=0.25)
    ((ref_o * go).sum() + ref_l.sum()).backward()
    for a, b in ((q1, q2), (k1, k2), (v1, v2)):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-3)


def test_gradients_of_the_approximation_are_finite():
    q, k, v = heavy_hitter_qkv(1000, 16, shift=300)
    q.requires_grad_()
    k.requires_grad_()
    out = hyper_attention(q, k, v, causal=True, block_size=64, sample_size=32, min_seq_len=128)
    out.square().sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0
    assert torch.isfinite(k.grad).all() and k.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- method registry

def test_registered_method_and_buffers():
    m = get_method("hyper")
    params = m.resolve_params({"block_size": 64, "sample_size": 32, "min_seq_len": 128})
    assert params == {"block_size": 64, "sample_size": 32, "lsh_num_projs": 7, "min_seq_len": 128, "seed": None}
    with pytest.raises(ConfigError):
        m.resolve_params({"block_size": 0})
    with pytest.raises(ConfigError):
        m.resolve_params({"bucket_size": 64})
    bufs = m.make_buffers(head_dim=16, **params)
    assert set(bufs) == {"lsh_dirs"} and bufs["lsh_dirs"].shape == (16, 7)
    assert torch.equal(bufs["lsh_dirs"], lsh_directions(16, 7, seed=0))  # seed None -> 0
    q, k, v = rand_qkv(1, 2, 2, 500, 16)
    out = m.prefill(q, k, v, causal=True, scale=None, backend="auto", buffers=bufs, **params)
    assert torch.equal(out, hyper_attention(q, k, v, causal=True, block_size=64, sample_size=32, min_seq_len=128))
    assert m.decode is None


def test_bad_arguments():
    q, k, v = rand_qkv(1, 2, 2, 100, 16)
    with pytest.raises(ValueError):
        hyper_attention(q, k, v, block_size=0)
    with pytest.raises(ValueError):
        hyper_attention(q, k, v, min_seq_len=10, lsh_dirs=torch.randn(8, 7))
    with pytest.raises(ValueError):
        hyper_attention(q, k[:, :, :50], v[:, :, :50], causal=True)  # q longer than kv under causal
    assert math.isclose(float(hyper_attention(q, k, v, min_seq_len=1000).norm()),
                        float(exact_attention(q, k, v).norm()), rel_tol=1e-6)


def test_attention_bench_smoke(tmp_path):
    import json

    from longpatch.bench.attention import run_attention_bench

    rows = run_attention_bench(methods=("exact", "hyper"), seq_lens=(300,), causal_modes=(True, False), head_dim=16,
                               repeats=1, out_dir=tmp_path, progress=False, memory=False,
                               method_params={"hyper": {"block_size": 32, "sample_size": 16, "min_seq_len": 64}})
    assert [(r["method"], r["causal"]) for r in rows] == [("exact", True), ("hyper", True), ("exact", False),
                                                          ("hyper", False)]
    hyper = [r for r in rows if r["method"] == "hyper"]
    assert all(r["speedup_fwd"] > 0 and r["err_random"] > 0 and r["params"]["block_size"] == 32 for r in hyper)
    saved = json.loads((tmp_path / "attention_bench.json").read_text())
    assert len(saved["rows"]) == 4 and saved["meta"]["threads"] >= 1
    assert (tmp_path / "attention_bench.png").stat().st_size > 1000


def test_thread_count_is_restored():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, k, v = rand_qkv(1, 2, 2, 600, 16)
        hyper_attention(q, k, v, causal=True, block_size=32, sample_size=16, min_seq_len=64)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(n)


# --------------------------------------------------------------------------- patched models

_PATCH = {"method": "hyper", "layers": 2,
          "params": {"block_size": 16, "sample_size": 16, "min_seq_len": 64, "seed": 3}}


@pytest.mark.parametrize("name", ["llama", "phi", "chatglm2"])
def test_patched_tiny_models_prefill_beyond_min_seq_len(name):
    from longpatch import patch_model
    from longpatch.testing.tiny import tiny_model

    model = tiny_model(name)
    ids = torch.randint(0, 256, (1, 300))
    ref = logits(model, ids)
    patch_model(model, _PATCH)
    out = logits(model, ids)
    stats = model.longpatch.stats()["patched"]
    assert stats["method"]["calls"] == 2 and "exact" not in stats
    assert torch.isfinite(out).all()
    # the approximation is active, yet a random-weight model's logits stay close
    assert 0 < (out - ref).abs().max() < 0.5 * ref.abs().max()


def test_lsh_directions_are_a_seeded_layer_buffer():
    from longpatch import patch_model
    from longpatch.testing.tiny import tiny_model

    ids = torch.randint(0, 256, (1, 300))
    a, b = tiny_model("llama"), tiny_model("llama")
    patch_model(a, _PATCH)
    patch_model(b, _PATCH)
    dirs = {k: t for k, t in b.named_buffers() if k.endswith("longpatch_lsh_dirs")}
    assert len(dirs) == 2 and next(iter(dirs.values())).shape == (16, 7)
    assert torch.equal(logits(a, ids), logits(b, ids))  # same seed: identical runs
    # the buffer is what the layer uses: other directions change the output
    with torch.no_grad():
        for t in dirs.values():
            t.copy_(torch.randn_like(t))
    assert not torch.equal(logits(a, ids), logits(b, ids))


def test_each_patched_layer_draws_its_own_directions():
    from longpatch import patch_model
    from longpatch.testing.tiny import tiny_model

    model = tiny_model("llama")
    patch_model(model, _PATCH)
    dirs = [t for k, t in model.named_buffers() if k.endswith("longpatch_lsh_dirs")]
    assert len(dirs) == 2 and not torch.equal(dirs[0], dirs[1])
