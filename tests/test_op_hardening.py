"""Wrong results and crashes: float64 paths, HyperAttention's exactness rule, pickling
a patched model, argument checks shared by the ops, and NaN/inf isolation."""

import pytest
import torch
from helpers import dense_attention

from longpatch.ops import (
    exact_attention,
    hyper_attention,
    linear_attention,
    moba_attention,
    moba_chunk_means,
    nsa_attention,
    performer_attention,
    sparse_attention,
)


def qkv(nq, nk, d=8, hq=4, hk=2, dtype=torch.float64, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, nq, d, generator=g, dtype=dtype)
    k = torch.randn(1, hk, nk, d, generator=g, dtype=dtype)
    v = torch.randn(1, hk, nk, d, generator=g, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


# ------------------------------------------------------------------- hyper on float64

HYPER_APPROX = dict(block_size=8, sample_size=64, min_seq_len=16)  # every key sampled: exact


@pytest.mark.parametrize("causal", [False, True])
def test_hyper_float64_with_every_key_sampled_is_exact_with_and_without_grad(causal):
    q, k, v = qkv(48, 48)
    ref = dense_attention(q, k, v, causal=causal)[0]
    with torch.no_grad():
        out = hyper_attention(q, k, v, causal=causal, **HYPER_APPROX)
    assert out.dtype == torch.float64 and rel(out, ref) < 1e-12
    qg, kg, vg = qkv(48, 48, grad=True)
    out = hyper_attention(qg, kg, vg, causal=causal, **HYPER_APPROX)
    assert rel(out, ref) < 1e-12


@pytest.mark.parametrize("causal", [False, True])
def test_hyper_float64_gradcheck_with_the_approximation_active(causal):
    inputs = qkv(24, 24, d=4, hq=2, hk=1, grad=True)
    params = dict(block_size=4, sample_size=8, min_seq_len=8, causal=causal)  # real sampling: ratio weights
    assert torch.autograd.gradcheck(lambda q, k, v: hyper_attention(q, k, v, **params), inputs, fast_mode=True)
    out, lse = hyper_attention(*inputs, return_lse=True, **params)
    assert lse.dtype == torch.float64  # the LSE keeps float64 precision too


# ------------------------------------------------------------------- sparse on float64

@pytest.mark.parametrize("causal", [True, False])
def test_sparse_float64_is_computed_in_float64(causal):
    q, k, v = qkv(40, 40, grad=True)
    params = dict(causal=causal, window=96, global_tokens=3, random_blocks=1, block=8)  # the window covers all
    out = sparse_attention(q, k, v, **params)
    assert out.dtype == torch.float64
    assert rel(out, dense_attention(q, k, v, causal=causal)[0]) < 1e-13
    small = qkv(20, 20, d=4, hq=2, hk=1, grad=True, seed=1)
    assert torch.autograd.gradcheck(lambda a, b, c: sparse_attention(a, b, c, **params), small, fast_mode=True)


# ------------------------------------------------------------------- hyper's exactness rule

def test_hyper_pieces_shorter_than_min_seq_len_are_exact():
    """n = 40, min_seq_len = 16: the square [0, 20) splits into halves of 10 < 16 rows, so it is one
    exact leaf; the rectangle (20 queries x 20 keys) is approximated. With q_len = 8 < min_seq_len
    against 40 keys, the prefix rectangle is exact too: the whole call is."""
    q, k, v = qkv(40, 40, dtype=torch.float32)
    params = dict(block_size=4, sample_size=4, min_seq_len=16)
    out = hyper_attention(q, k, v, causal=True, **params)
    ref = dense_attention(q, k, v, causal=True)[0]
    assert rel(out[:, :, :20], ref[:, :, :20]) < 1e-6
    assert rel(out[:, :, 20:], ref[:, :, 20:]) > 1e-3  # the approximation is active beyond
    out = hyper_attention(q[:, :, -8:], k, v, causal=True, **params)
    assert rel(out, ref[:, :, -8:]) < 1e-6


# pickling a patched model: tests/test_contract.py (every method, llama and chatglm2)


# ------------------------------------------------------------------- argument checks

def test_moba_rejects_more_chunk_means_than_full_chunks():
    q, k, v = qkv(70, 70, dtype=torch.float32)
    means = moba_chunk_means(k, 16)  # 4 full chunks
    moba_attention(q, k, v, chunk_size=16, topk=2, chunk_means=means)
    too_many = torch.cat([means, means[:, :, :1]], dim=2)
    with pytest.raises(ValueError, match=r"(?=.*chunk_means)(?=.*5 chunks)(?=.*at most 4)"):
        moba_attention(q, k, v, chunk_size=16, topk=2, chunk_means=too_many)


def test_nsa_rejects_negative_gates():
    q, k, v = qkv(16, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"(?=.*gates)(?=.*-0\.5)(?=.*>= 0)"):
        nsa_attention(q, k, v, gates=(1.0, -0.5, 0.5))


@pytest.mark.parametrize("op", [hyper_attention, sparse_attention, performer_attention])
def test_ops_reject_negative_seeds(op):
    q, k, v = qkv(16, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"(?=.*seed)(?=.*-1)(?=.*>= 0)"):
        op(q, k, v, seed=-1)


OPS = [exact_attention, hyper_attention, moba_attention, nsa_attention, sparse_attention, linear_attention,
       performer_attention]


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("which", [0, 1, 2])
def test_ops_reject_mixed_dtypes(op, which):
    t = qkv(16, 16, dtype=torch.float32)
    t[which] = t[which].double()
    with pytest.raises(ValueError, match=r"(?=.*dtype)(?=.*float64)(?=.*float32)"):
        op(*t)


# ------------------------------------------------------------------- NaN / inf isolation

CALLS = {
    "exact": lambda q, k, v: exact_attention(q, k, v),
    "hyper": lambda q, k, v: hyper_attention(q, k, v, block_size=8, sample_size=8, min_seq_len=32),
    "moba": lambda q, k, v: moba_attention(q, k, v, chunk_size=16, topk=3),
    "nsa": lambda q, k, v: nsa_attention(q, k, v, compress_block=16, compress_stride=8, select_block=16,
                                         num_selected=4, window=32, gates=(0.0, 0.75, 0.25)),
    "nsa_gates": lambda q, k, v: nsa_attention(q, k, v, compress_block=16, compress_stride=8, select_block=16,
                                               num_selected=4, window=32, gates=(0.2, 0.5, 0.3)),
    "sparse": lambda q, k, v: sparse_attention(q, k, v, window=24, global_tokens=4, random_blocks=1, block=16),
    "linear": lambda q, k, v: linear_attention(q, k, v),
    "performer": lambda q, k, v: performer_attention(q, k, v, num_features=32),
}


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["k", "v", "kv"])
def test_rows_before_a_non_finite_key_or_value_do_not_depend_on_it(name, bad, where, one_thread):
    p = 77
    q, k, v = qkv(200, 200, d=16, dtype=torch.float32)
    ref = CALLS[name](q, k, v)
    k2, v2 = k.clone(), v.clone()
    for t, tag in ((k2, "k"), (v2, "v")):
        if tag in where:
            t[:, 1, p, 3] = bad
    out = CALLS[name](q, k2, v2)
    assert torch.isfinite(out[:, :, :p]).all()
    torch.testing.assert_close(out[:, :, :p], ref[:, :, :p], atol=1e-5, rtol=1e-5)
    # the rows of the other KV head never see a bad row at all
    torch.testing.assert_close(out[:, :2], ref[:, :2], atol=1e-5, rtol=1e-5)
    if name in ("exact", "linear", "performer"):  # every later row sees position p: the NaN shows
        assert not torch.isfinite(out[:, 2:, p:]).any(-1).all()


@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("nq", [63, 1])
def test_nonfinite_isolation_with_lse_per_branch(b, nq):
    """NSA's LSE holds one value per branch ([b, hq, nq, 3]): the rows that attend to a NaN key get NaN
    in all three, the others keep theirs (this used to raise on the LSE's extra dimension)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, 4, nq, 16, generator=g)
    k, v = torch.randn(b, 2, 63, 16, generator=g), torch.randn(b, 2, 63, 16, generator=g)
    # every branch in the output (the op's default g_cmp = 0 leaves the compressed branch out of it)
    kw = dict(return_lse=True, compress_block=8, compress_stride=4, select_block=8, num_selected=3, window=8,
              gates=(1 / 3, 1 / 3, 1 / 3))
    out_ref, lse_ref = nsa_attention(q, k, v, **kw)
    k[0, 0, 21, 5] = float("nan")
    out, lse = nsa_attention(q, k, v, **kw)
    assert lse.shape == lse_ref.shape == (b, 4, nq, 3)
    hit = torch.isnan(out).any(-1)  # [b, hq, nq]
    assert hit.any() and torch.equal(torch.isnan(lse).all(-1), hit)
    torch.testing.assert_close(lse[~hit], lse_ref[~hit])
    torch.testing.assert_close(out[:, 2:], out_ref[:, 2:])  # the other KV head never sees it
    if b == 2:
        torch.testing.assert_close(out[1], out_ref[1])  # nor does the other batch row


# ------------------------------------------------------------------- issue 42: params beyond the input, one scale rule

BIG = 10 ** 23  # past int64: an OverflowError before, and a window of it allocated gigabytes


@pytest.mark.parametrize("causal", [True, False])
def test_sparse_sizes_past_the_input_are_clamped_to_it(causal):
    from longpatch.methods.sparse import SparsePattern

    q, k, v = qkv(40, 40)
    everything = exact_attention(q, k, v, causal=causal)
    for window in (81, 10 ** 6, BIG):  # every key (non-causal: 39 on each side): exact
        out = sparse_attention(q, k, v, causal=causal, window=window, global_tokens=0)
        torch.testing.assert_close(out, everything)
    only_self = sparse_attention(q, k, v, causal=causal, window=3, dilation=BIG, global_tokens=0)
    torch.testing.assert_close(only_self, sparse_attention(q, k, v, causal=causal, window=1, global_tokens=0))
    all_blocks = dict(causal=causal, window=1, global_tokens=0, block=8)
    torch.testing.assert_close(sparse_attention(q, k, v, random_blocks=BIG, **all_blocks),
                               sparse_attention(q, k, v, random_blocks=5, **all_blocks))
    torch.testing.assert_close(sparse_attention(q, k, v, causal=causal, global_tokens=BIG), everything)
    fitted = SparsePattern(window=BIG, global_tokens=BIG, dilation=BIG, random_blocks=BIG, block=BIG,
                           causal=causal).fitted(40, 40)
    assert max(fitted.window, fitted.global_tokens, fitted.dilation, fitted.random_blocks, fitted.block) <= 161


def test_nsa_sizes_past_the_input_are_clamped_to_it():
    from longpatch.methods.nsa.blocks import fit_params

    q, k, v = qkv(40, 40)
    small = dict(compress_block=8, compress_stride=4, select_block=8)
    torch.testing.assert_close(nsa_attention(q, k, v, num_selected=BIG, **small),
                               nsa_attention(q, k, v, num_selected=5, **small))  # 5 blocks of 8: every block
    torch.testing.assert_close(nsa_attention(q, k, v, window=BIG, **small), nsa_attention(q, k, v, window=40, **small))
    torch.testing.assert_close(nsa_attention(q, k, v, compress_block=BIG, compress_stride=BIG, select_block=BIG),
                               nsa_attention(q, k, v, compress_block=41, compress_stride=41, select_block=41))
    assert max(fit_params(40, BIG, BIG, BIG, BIG, BIG, BIG, BIG)) <= 41


ALL_OPS = [exact_attention, hyper_attention, linear_attention, moba_attention, nsa_attention, performer_attention,
           sparse_attention]


@pytest.mark.parametrize("op", ALL_OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("scale", [0, -1.0, float("nan"), float("inf"), "abc", True])
def test_every_op_takes_one_scale_rule(op, scale):
    q, k, v = qkv(16, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^scale: got .*allowed: a positive finite number"):
        op(q, k, v, scale=scale)


@pytest.mark.parametrize("op", ALL_OPS, ids=lambda f: f.__name__)
def test_op_argument_errors_are_one_clear_line(op):
    q, k, v = qkv(16, 16, dtype=torch.float32)
    cases = [((q.tolist(), k, v), {}, "must be torch tensors"),
             ((q[..., :0], k[..., :0], v[..., :0]), {}, "head_dim must be >= 1"),
             (tuple(t.to("meta") for t in (q, k, v)), {}, "meta tensors"),
             ((q, k, v), {"causal": "yes"}, "causal must be True or False")]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match) as e:
            op(*args, **kw)
        assert "\n" not in str(e.value)
    empty = op(q[:0], k[:0], v[:0], causal=True)  # an empty batch is an empty answer
    assert empty.shape == (0, *q.shape[1:])


def test_exact_attn_mask_of_the_wrong_shape_is_one_line():
    q, k, v = qkv(16, 16, dtype=torch.float32)
    for mask in (torch.ones(3, 5, dtype=torch.bool), [[1]], torch.ones(1, 2, 16, 16, dtype=torch.int64)):
        with pytest.raises(ValueError, match="attn_mask must be a bool or float tensor broadcastable"):
            exact_attention(q, k, v, attn_mask=mask)


def test_nsa_default_gates_are_the_methods():
    from longpatch.methods import get_method

    q, k, v = qkv(40, 40)
    params = get_method("nsa").resolve_params({"compress_block": 8, "compress_stride": 4, "select_block": 8,
                                               "num_selected": 3, "window": 8})
    assert params["gates"] == [0.0, 0.75, 0.25]
    torch.testing.assert_close(nsa_attention(q, k, v, **{n: params[n] for n in ("compress_block", "compress_stride",
                                                                                "select_block", "num_selected",
                                                                                "window")}),
                               nsa_attention(q, k, v, **{n: p for n, p in params.items() if n not in ("seed",)}))
