"""NSA (torch path): a per-token dense oracle for all three branches, the references against the fast
path, causality, exactness when the branches cover everything, decode with state, gradients, the
trainable module and patched models."""
from types import SimpleNamespace

import pytest
import torch
from helpers import logits

from longpatch import patch_model
from longpatch.errors import ConfigError
from longpatch.methods import blocksparse, get_method
from longpatch.methods import nsa as nsa_mod
from longpatch.methods.exact import exact_attention
from longpatch.methods.nsa import (
    NSAAttention,
    compressed_attention_reference,
    nsa_attention,
    nsa_compress,
    nsa_reference,
    selected_attention_reference,
    selection_scores_reference,
    topk_blocks,
    window_attention_reference,
)
from longpatch.methods.nsa import cpu as nsa_cpu
from longpatch.methods.nsa import method as nsa_method
from longpatch.methods.nsa import op as nsa_op
from longpatch.testing.tiny import tiny_model

NSA = get_method("nsa")

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(compress_block=8, compress_stride=4, select_block=8, num_selected=3, window=12, init_blocks=1,
             local_blocks=1)


def rand(b, hq, hk, nq, nk, d=8, dtype=torch.float32, grad=False):
    q = torch.randn(b, hq, nq, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(b, hk, nk, d, dtype=dtype, requires_grad=grad)
    v = torch.randn(b, hk, nk, d, dtype=dtype, requires_grad=grad)
    return q, k, v


CASES = [  # hq, hk, nq, nk
    (2, 2, 40, 40),     # MHA (group 1)
    (4, 2, 45, 45),     # group 2, ragged last block
    (4, 1, 37, 37),     # group 4
    (16, 1, 33, 33),    # group 16 (ChatGLM2's 32/2)
    (4, 2, 13, 50),     # chunked decode: queries start mid-block
    (4, 1, 1, 61),      # one token against a cache
]


@pytest.mark.parametrize("hq,hk,nq,nk", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # fast path / reference composition
def test_matches_per_token_oracle(hq, hk, nq, nk, dtype):
    q, k, v = rand(2, hq, hk, nq, nk, dtype=dtype)
    gates = (0.2, 0.5, 0.3)
    out, lse = nsa_attention(q, k, v, gates=gates, return_lse=True, backend="torch", **SMALL)
    ref, _, ref_lse, _ = nsa_reference(q, k, v, gates=gates, **SMALL)
    assert out.dtype == dtype and lse.shape == (2, hq, nq, 3)
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, **tol)


def test_reference_primitives_match_oracle():
    q, k, v = rand(1, 4, 2, 30, 57, dtype=torch.float64)
    _, branches, ref_lse, chosen = nsa_reference(q, k, v, **SMALL)
    kw = dict(scale=8 ** -0.5, kv_len=57)
    blocks = dict(compress_block=8, compress_stride=4)
    kc, vc = nsa_compress(k, v, **blocks)
    o_c, l_c = compressed_attention_reference(q, kc, vc, **blocks, **kw)
    torch.testing.assert_close(o_c, branches[0])
    torch.testing.assert_close(l_c, ref_lse[..., 0])
    scores = selection_scores_reference(q, kc, l_c, **blocks, select_block=8, init_blocks=1, local_blocks=1, **kw)
    assert scores.shape == (1, 2, 30, 8) and scores.dtype == torch.float32
    idx = topk_blocks(scores, 3)
    for (bi, hi, r), sel in chosen.items():
        assert idx[bi, hi, r].tolist() == sel + [-1] * (3 - len(sel))
    o_s, l_s = selected_attention_reference(q, k, v, idx, select_block=8, **kw)
    torch.testing.assert_close(o_s, branches[1])
    o_w, l_w = window_attention_reference(q, k, v, window=12, **kw)
    torch.testing.assert_close(o_w, branches[2])
    torch.testing.assert_close(l_w, ref_lse[..., 2])


def test_compress_blocks_and_counts():
    k = torch.arange(2 * 50, dtype=torch.float32).view(1, 2, 50, 1)
    kc, vc = nsa_compress(k, -k, compress_block=8, compress_stride=4)
    assert kc.shape == (1, 2, (50 - 8) // 4 + 1, 1)
    torch.testing.assert_close(kc[0, 0, :, 0], torch.tensor([i * 4 + 3.5 for i in range(kc.shape[2])]))
    torch.testing.assert_close(vc, -kc)
    assert nsa_compress(k[:, :, :7], k[:, :, :7], compress_block=8, compress_stride=4)[0].shape[2] == 0


@pytest.mark.parametrize("hq,hk,nq,nk,gates", [(16, 1, 300, 300, (0.3, 0.4, 0.3)), (8, 2, 150, 333, (1, 0, 0)),
                                                (2, 2, 64, 64, (0, 0, 1))])
def test_fast_path_equals_reference_composition(hq, hk, nq, nk, gates):
    """Bigger shapes than the oracle can afford: the fused CPU path against the readable references
    (float64, which always take the reference composition)."""
    params = dict(compress_block=16, compress_stride=8, select_block=16, num_selected=5, window=40)
    q, k, v = rand(2, hq, hk, nq, nk, d=16)
    out, lse = nsa_attention(q, k, v, gates=gates, return_lse=True, **params)
    ref, ref_lse = nsa_attention(q.double(), k.double(), v.double(), gates=gates, return_lse=True, **params)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=1e-5)


def test_fast_path_small_windows(monkeypatch):
    """Many windows of rows and window chunks (batched and one-by-one pieces) on small shapes."""
    monkeypatch.setattr(nsa_cpu, "_PAIR_ELEMS", 1)
    monkeypatch.setattr(nsa_cpu, "_WIN_CHUNK", 8)
    monkeypatch.setattr(nsa_cpu, "_CMP_ELEMS", 64)
    monkeypatch.setattr(blocksparse, "_TILE_ROWS", 4)
    q, k, v = rand(1, 4, 2, 70, 90)
    out, lse = nsa_attention(q, k, v, return_lse=True, **SMALL)
    ref, ref_lse = nsa_attention(q.double(), k.double(), v.double(), return_lse=True, **SMALL)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=1e-5)


# local blocks shared with the window (window >= select_block * local_blocks, also exactly equal:
# the last row of each block then has an empty rest-of-window), not shared (window too short),
# no local blocks (own blocks go through the masked bucket), a block size that does not divide
# the window chunk, and query offsets that are not block-aligned
@pytest.mark.parametrize("params,nq,nk", [
    (dict(select_block=8, num_selected=4, window=24, local_blocks=2), 61, 61),
    (dict(select_block=8, num_selected=4, window=16, local_blocks=2), 45, 77),
    (dict(select_block=8, num_selected=4, window=12, local_blocks=2), 50, 50),
    (dict(select_block=8, num_selected=3, window=12, local_blocks=0), 50, 63),
    (dict(select_block=12, num_selected=4, window=30, local_blocks=1, init_blocks=2), 70, 83),
])
def test_fast_path_block_regimes(params, nq, nk, monkeypatch):
    monkeypatch.setattr(nsa_cpu, "_PAIR_ELEMS", 1)  # several windows of rows, cut at odd offsets
    monkeypatch.setattr(nsa_cpu, "_WIN_CHUNK", 8)
    full = {"compress_block": 8, "compress_stride": 4, "init_blocks": 1, **params}
    q, k, v = rand(2, 4, 2, nq, nk)
    out, lse = nsa_attention(q, k, v, return_lse=True, **full)
    ref, ref_lse = nsa_attention(q.double(), k.double(), v.double(), return_lse=True, **full)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=1e-5)


def test_fast_path_on_worker_threads_equals_one_thread(monkeypatch):
    """With 2 torch threads the windows run on 2 single-threaded workers: same answer as one
    thread, torch's thread count is restored, and the output tensor is complete."""
    monkeypatch.setattr(nsa_cpu, "_PAIR_ELEMS", 1)
    params = dict(compress_block=16, compress_stride=8, select_block=16, num_selected=5, window=40)
    q, k, v = rand(1, 8, 2, 300, 300, d=16)
    one = nsa_attention(q, k, v, **params)
    torch.set_num_threads(2)
    try:
        two = nsa_attention(q, k, v, **params)
        assert torch.get_num_threads() == 2
        with torch.inference_mode():  # as in an evaluation: the workers write an inference tensor
            three = nsa_attention(q, k, v, **params)
    finally:
        torch.set_num_threads(1)
    torch.testing.assert_close(two, one, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(three, one, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_causal_by_perturbation(dtype):
    q, k, v = rand(1, 4, 2, 60, 60, dtype=dtype)
    out = nsa_attention(q, k, v, **SMALL)
    for t in (0, 17, 40):
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        q2[:, :, t + 1:] += torch.randn_like(q2[:, :, t + 1:])
        k2[:, :, t + 1:] += 3 * torch.randn_like(k2[:, :, t + 1:])
        v2[:, :, t + 1:] += torch.randn_like(v2[:, :, t + 1:])
        out2 = nsa_attention(q2, k2, v2, **SMALL)
        torch.testing.assert_close(out2[:, :, :t + 1], out[:, :, :t + 1], atol=0, rtol=0)
        assert not torch.allclose(out2[:, :, t + 1:], out[:, :, t + 1:])


@pytest.mark.parametrize("nq,nk", [(50, 50), (20, 50)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_covering_branches_are_exact(nq, nk, dtype):
    """num_selected * select_block >= n: the selected branch is exact causal attention; window >= n:
    the window branch is; compress_block = stride = 1: so is the compressed branch."""
    q, k, v = rand(2, 4, 2, nq, nk, dtype=dtype)
    ref = exact_attention(q, k, v, causal=True)
    tol = dict(atol=2e-6, rtol=1e-5)
    few = dict(init_blocks=1, local_blocks=1)
    sel = nsa_attention(q, k, v, select_block=8, num_selected=7, window=4, gates=(0, 1, 0))
    torch.testing.assert_close(sel, ref, **tol)
    win = nsa_attention(q, k, v, select_block=8, num_selected=2, window=nk, gates=(0, 0, 1), **few)
    torch.testing.assert_close(win, ref, **tol)
    cmp_ = nsa_attention(q, k, v, compress_block=1, compress_stride=1, select_block=8, num_selected=2, window=4,
                         gates=(1, 0, 0), **few)
    torch.testing.assert_close(cmp_, ref, **tol)


def test_topk_blocks_order_ties_and_empty_slots():
    inf = float("inf")
    scores = torch.tensor([[[[1.0, 2.0, 2.0, inf, -inf, 0.5]]]])
    assert topk_blocks(scores, 3).tolist() == [[[[1, 2, 3]]]]  # tie 1 vs 2 of score 2.0: the later wins 2 ...
    assert topk_blocks(scores, 2).tolist() == [[[[2, 3]]]]  # ... and with one slot left block 2 beats block 1
    assert topk_blocks(scores, 7).tolist() == [[[[0, 1, 2, 3, 5, -1, -1]]]]  # -inf blocks never chosen
    zeros = torch.zeros(1, 5)
    assert topk_blocks(zeros, 2).tolist() == [[3, 4]]


def test_group_shares_one_selection():
    """All query heads of a KV group use one selection: heads of a group differ only through their
    queries, and a head's output does not change when another group's queries change."""
    q, k, v = rand(1, 4, 2, 48, 48)
    out = nsa_attention(q, k, v, **SMALL)
    q2 = q.clone()
    q2[:, 2:] = torch.randn_like(q2[:, 2:])  # the second group's heads
    torch.testing.assert_close(nsa_attention(q2, k, v, **SMALL)[:, :2], out[:, :2], atol=0, rtol=0)


def test_scale_and_gate_tensor():
    q, k, v = rand(2, 4, 2, 40, 40, dtype=torch.float64)
    gates = torch.rand(2, 4, 40, 3, dtype=torch.float64)
    out = nsa_attention(q, k, v, scale=0.3, gates=gates, **SMALL)
    _, branches, _, _ = nsa_reference(q, k, v, scale=0.3, **SMALL)
    ref = sum(gates[..., i:i + 1] * branches[i] for i in range(3))
    torch.testing.assert_close(out, ref)
    out32 = nsa_attention(q.float(), k.float(), v.float(), scale=0.3, gates=gates.float(), **SMALL)
    torch.testing.assert_close(out32.double(), ref, atol=2e-6, rtol=1e-5)


def test_gradcheck_through_all_branches():
    torch.manual_seed(1)
    q, k, v = rand(1, 2, 1, 24, 24, d=4, dtype=torch.float64, grad=True)
    gates = torch.rand(1, 2, 24, 3, dtype=torch.float64, requires_grad=True)
    params = dict(compress_block=4, compress_stride=2, select_block=4, num_selected=3, window=6)

    def f(q, k, v, gates):
        return nsa_attention(q, k, v, gates=gates, **params)

    assert torch.autograd.gradcheck(f, (q, k, v, gates), eps=1e-6, atol=1e-5)
    # every branch alone carries gradient to q, k and v
    for w in ((1, 0, 0), (0, 1, 0), (0, 0, 1)):
        q.grad = k.grad = v.grad = None
        nsa_attention(q, k, v, gates=w, **params).square().sum().backward()
        assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_errors():
    q, k, v = rand(1, 2, 1, 10, 10)
    with pytest.raises(ValueError, match="causal attention only"):
        nsa_attention(q, k, v, causal=False)
    for bad in (dict(compress_stride=40, compress_block=32), dict(num_selected=2, init_blocks=1, local_blocks=2),
                dict(window=0), dict(select_block=1.5), dict(gates=(1, 2)), dict(gates=torch.ones(1, 2, 10, 2)),
                dict(compress="max"), dict(compressed=(torch.zeros(1, 2, 0, 8), torch.zeros(1, 2, 0, 8))),
                dict(compress_block=4, compress_stride=2, compressed=(torch.zeros(1, 1, 3, 8),) * 2)):
        with pytest.raises(ValueError):
            nsa_attention(q, k, v, **bad)
    with pytest.raises(ConfigError, match="gates"):
        NSA.resolve_params({"gates": [1, 2]})
    with pytest.raises(ConfigError, match="window"):
        NSA.resolve_params({"window": 0})
    with pytest.raises(ConfigError, match="num_selected"):
        NSA.resolve_params({"num_selected": 2})  # init_blocks 1 + local_blocks 2 do not fit


def test_compressed_given_and_callable_compress():
    q, k, v = rand(1, 4, 2, 64, 64)
    ref = nsa_attention(q, k, v, **SMALL)
    kc, vc = nsa_compress(k, v, compress_block=8, compress_stride=4)
    torch.testing.assert_close(nsa_attention(q, k, v, compressed=(kc, vc), **SMALL), ref, atol=0, rtol=0)
    calls = []

    def pool(k, v, compress_block, compress_stride):
        calls.append(k.shape)
        return nsa_compress(k, v, compress_block=compress_block, compress_stride=compress_stride)

    torch.testing.assert_close(nsa_attention(q, k, v, compress=pool, **SMALL), ref, atol=0, rtol=0)
    assert calls == [k.shape]


# --------------------------------------------------------------------------- decode

def _decode(q, k, v, state, **params):
    full = NSA.resolve_params(params)  # the op's default gates are the method's
    return NSA.decode(q, k, v, causal=True, scale=None, backend="torch", buffers={}, state=state, **full)


@pytest.mark.parametrize("hq,hk", [(4, 2), (16, 1), (2, 2)])
def test_stepwise_decode_equals_prefill_and_compresses_each_block_once(hq, hk, monkeypatch):
    params = dict(SMALL)
    q, k, v = rand(2, hq, hk, 60, 60)
    full = nsa_attention(q, k, v, **params)
    pooled = []
    real = nsa_mod.nsa_compress

    def counting(k, v, **kw):
        out = real(k, v, **kw)
        pooled.append(out[0].shape[2])
        return out

    for module in (nsa_op, nsa_method):  # the decode state's pooling and the op's own
        monkeypatch.setattr(module, "nsa_compress", counting)
    state = {}
    _decode(q[:, :, :20], k[:, :, :20], v[:, :, :20], state, **params)
    outs = [_decode(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], state, **params) for t in range(20, 60)]
    torch.testing.assert_close(torch.cat(outs, 2), full[:, :, 20:], atol=2e-6, rtol=1e-5)
    assert state["k_cmp"].shape == (2, hk, (60 - 8) // 4 + 1, 8)
    assert sum(pooled) == (60 - 8) // 4 + 1  # every compressed block pooled exactly once


def test_chunked_decode_and_state_rebuilt_when_cache_changes():
    params = dict(SMALL)
    q, k, v = rand(2, 4, 2, 64, 64)
    full = nsa_attention(q, k, v, **params)
    state = {}
    outs = [_decode(q[:, :, s:s + 5], k[:, :, :s + 5], v[:, :, :s + 5], state, **params) for s in range(4, 64, 5)]
    torch.testing.assert_close(torch.cat(outs, 2), full[:, :, 4:], atol=2e-6, rtol=1e-5)
    perm = torch.tensor([1, 0])  # beam reordering: cached compressed blocks no longer match
    out = _decode(q[perm][:, :, 63:], k[perm], v[perm], state, **params)
    torch.testing.assert_close(out, full[perm][:, :, 63:], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(state["k_cmp"], nsa_compress(k[perm], v[perm], compress_block=8, compress_stride=4)[0])


def test_init_state_gives_the_decode_answer():
    q, k, v = rand(1, 4, 1, 1, 130)
    state = NSA.init_state(k, v, **NSA.resolve_params(SMALL))
    ref = nsa_attention(q, k, v, **SMALL)
    torch.testing.assert_close(_decode(q, k, v, state, **SMALL), ref, atol=0, rtol=0)


# --------------------------------------------------------------------------- trainable module

def _module(**kw):
    torch.manual_seed(3)
    return NSAAttention(hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=8, **{**SMALL, **kw}).double()


def test_module_starts_at_the_training_free_behaviour():
    m = _module(gates=(0.2, 0.5, 0.3))
    q, k, v = rand(1, 4, 2, 40, 40, dtype=torch.float64)
    h = torch.randn(1, 40, 16, dtype=torch.float64)
    ref = nsa_attention(q, k, v, gates=(0.2, 0.5, 0.3), **SMALL)
    torch.testing.assert_close(m(q, k, v, h), ref)


def test_module_gradients_reach_every_parameter():
    m = _module()
    for p in m.parameters():  # move off the initialisation, where the zero layers block gradients
        p.data += 0.05 * torch.randn_like(p)
    q, k, v = rand(1, 4, 2, 40, 40, dtype=torch.float64, grad=True)
    h = torch.randn(1, 40, 16, dtype=torch.float64)
    m(q, k, v, h).square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(t.grad.abs().sum() > 0 for t in (q, k, v))


def test_module_gradcheck():
    torch.manual_seed(2)
    m = NSAAttention(hidden_size=6, num_heads=2, num_kv_heads=1, head_dim=4, compress_block=4, compress_stride=2,
                     select_block=4, num_selected=3, window=6, init_blocks=1, local_blocks=1, mlp_hidden=8).double()
    for p in m.parameters():
        p.data += 0.1 * torch.randn_like(p)
    q, k, v = rand(1, 2, 1, 20, 20, d=4, dtype=torch.float64, grad=True)
    h = torch.randn(1, 20, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v, h: m(q, k, v, h), (q, k, v, h), eps=1e-6, atol=1e-5)


def test_module_decode_with_cached_compression_equals_prefill():
    m = _module().float()
    for p in m.parameters():
        p.data += 0.05 * torch.randn_like(p)
    q, k, v = rand(1, 4, 2, 40, 40)
    h = torch.randn(1, 40, 16)
    with torch.no_grad():
        full = m(q, k, v, h)
        kc, vc = m.compress(k, v)
        step = m(q[:, :, 39:], k, v, h[:, 39:], compressed=(kc, vc))
    torch.testing.assert_close(step, full[:, :, 39:], atol=2e-6, rtol=1e-5)


# --------------------------------------------------------------------------- patched models

PATCH = {"compress_block": 8, "compress_stride": 4, "select_block": 8, "num_selected": 2, "window": 8,
         "init_blocks": 1, "local_blocks": 1}


def test_generate_decode_equals_prefill_and_keeps_state():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 50))
    patch_model(model, {"method": "nsa", "layers": 2, "params": PATCH})
    gen = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    assert gen.sequences.shape == (1, 58)
    assert model.longpatch.stats()["patched"]["method"]["calls"] == 2 * 8
    for route in model.longpatch.routes:
        if route.method is not None:
            assert route.state["k_cmp"].shape[2] == (57 - 8) // 4 + 1
    full = logits(model, gen.sequences[:, :-1])
    torch.testing.assert_close(torch.stack(gen.logits, 1), full[:, 49:], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logits(tiny_model("llama"), gen.sequences[:, :-1])[:, 49:], full[:, 49:], atol=1e-3)


def test_chatglm2_incremental_decode_equals_prefill():
    """ChatGLM2 (K/V groups, legacy tuple cache): sparse decode steps match one prefill."""
    model = tiny_model("chatglm2")
    ids = torch.randint(0, 256, (1, 40))
    patch_model(model, {"method": "nsa", "layers": "all", "params": PATCH})
    with torch.no_grad():
        full, _ = model(ids, use_cache=True)
        out, cache = model(ids[:, :30], use_cache=True)
        steps = []
        for t in range(30, 40):
            out, cache = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(out[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 30:40], atol=1e-4, rtol=1e-4)


def test_registered_method():
    assert NSA.stateful and NSA.decode is not None and NSA.init_state is not None
    assert NSA.resolve_params({}) == {**nsa_mod.DEFAULTS, "gates": list(nsa_mod.TRAINING_FREE_GATES),
                                      "selection": "compressed", "mass": None, "max_share": None,
                                      "estimate_queries": 64,
                                      "score_stride": 16, "decode_topk": 8, "decode_page": None,
                                      "decode_prefill": True, "final_topk": None}


def test_bfloat16_runs():
    q, k, v = rand(1, 4, 2, 80, 80, dtype=torch.bfloat16)
    out = nsa_attention(q, k, v, **SMALL)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_decode_bench_runs(tmp_path):
    from longpatch.bench.decode import run_decode_bench
    params = {"compress_block": 8, "compress_stride": 4, "select_block": 16, "num_selected": 4, "window": 32}
    rows = run_decode_bench(methods=("nsa",), cache_lens=(300,), heads=2, kv_heads=1, head_dim=16, repeats=1,
                            out_dir=tmp_path, method_params={"nsa": params}, progress=False)
    assert len(rows) == 1 and rows[0]["cache_len"] == 300 and rows[0]["init_state_ms"] is not None


def test_non_causal_calls_keep_the_models_attention(caplog):
    from longpatch.routing import LayerRoute

    route = LayerRoute(layer_idx=0, method=get_method("nsa"))
    assert route.choose(100, 100) == "method"
    with caplog.at_level("WARNING", logger="longpatch"):
        assert route.choose(100, 100, causal=False) == "original"
    assert "non-causal" in caplog.text


@pytest.mark.parametrize("g,hk,nk", [(1, 2, 5), (4, 1, 131), (16, 1, 300), (4, 2, 64)])
@pytest.mark.parametrize("gates", [(1 / 3, 1 / 3, 1 / 3), (0.0, 0.75, 0.25), "tensor"])
def test_one_token_decode_path_equals_the_windowed_path(g, hk, nk, gates):
    """A decode step (q_len = 1) takes its own batched path; it must give what the general windowed
    path and the float64 references give, branch LSEs included (nk = 5 has no compressed block)."""
    q, k, v = rand(2, g * hk, hk, 1, nk)
    gt = torch.rand(2, g * hk, 1, 3) if gates == "tensor" else gates
    blocks = dict(compress_block=8, compress_stride=4, select_block=16, num_selected=4, window=24)
    out, lse = nsa_attention(q, k, v, gates=gt, return_lse=True, **blocks)
    kc, vc = nsa_compress(k, v, compress_block=8, compress_stride=4)
    cfg = SimpleNamespace(scale=8 ** -0.5, nk=nk, l=8, s=4, sb=16, num_selected=4, window=24, init_blocks=1,
                          local_blocks=2, cmp_out=True, need_lse=True)
    ref_out, ref_lse = nsa_cpu.fast_forward(q, k, v, kc, vc, cfg, nsa_op._check_gates(gt, q))
    torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-6, rtol=1e-5)
    g64 = gt.double() if isinstance(gt, torch.Tensor) else gt
    ref64 = nsa_attention(q.double(), k.double(), v.double(), gates=g64, **blocks)
    torch.testing.assert_close(out.double(), ref64, atol=1e-5, rtol=1e-5)


def test_attended_pairs_counts_each_branch_per_query():
    """``attended_pairs`` (bench attention's pairs / ideal columns), counted row by row from the
    branches' definitions: compressed blocks seen, selected keys (the own block up to the query),
    window keys, minus the local blocks' keys computed once for both when the window holds them."""
    n, l, s, sb, S, W, lb = 300, 16, 8, 16, 5, 40, 2
    params = dict(get_method("nsa").resolve_params({}), compress_block=l, compress_stride=s, select_block=sb,
                  num_selected=S, window=W, local_blocks=lb)
    q, k = torch.zeros(1, 3, n, 8), torch.zeros(1, 1, n, 8)
    want = 0
    for t in range(n):
        cmp = sum(1 for i in range(n) if i * s + l - 1 <= t)
        own = t // sb
        blocks = list(range(own + 1))[-S:] if own + 1 > S else list(range(own + 1))
        selected = sum(min(sb, t + 1 - j * sb) for j in blocks)
        shared = t + 1 - max(0, (own - lb + 1) * sb) if W >= sb * lb else 0
        want += cmp + selected + min(W, t + 1) - shared
    assert get_method("nsa").attended_pairs(q, k, True, params) == 3 * want
    assert get_method("nsa").attended_pairs(q, k, False, params) is None


def test_decode_best_blocks_matches_topk_blocks():
    """The decode step's 2-op selection key (float bits as int32, valid for the importance values a
    decode step has: +0, positives, +inf, NaN) picks exactly what ``topk_blocks`` picks, ties to the
    later block and NaN as -inf included; None where a pick would be -inf."""
    from longpatch.methods.nsa.blocks import topk_blocks

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        ns = int(torch.randint(8, 40, (1,), generator=g))
        imp = torch.rand(3, ns, generator=g)
        if trial % 4 == 1:  # ties: few distinct values, zeros among them
            imp = (imp * 3).floor() / 3
        if trial % 4 == 2:  # NaN rows or entries
            imp[imp < 0.2] = float("nan")
        if trial % 4 == 3:
            imp[:, :1] = float("inf")
            imp[:, -2:] = float("inf")
        got = nsa_cpu._best_blocks(imp, 8, torch.arange(ns))
        want = topk_blocks(imp, 8)
        if got is None:
            assert bool((want < 0).any())
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("heads", [5, 32])
def test_gated_branch_sum_in_head_chunks_equals_the_whole_tensor_sum(heads):
    """NSA's query-aware branches are summed a few heads at a time for half-precision outputs (four
    float32 copies of the output were 8 GB at 131k on an H100): the same numbers as the whole sum."""
    from longpatch.methods.nsa.op import _gated_sum

    g = torch.Generator().manual_seed(0)
    o_s, o_w = (torch.randn(2, heads, 7, 8, generator=g).bfloat16() for _ in range(2))
    want = (0.9 * o_s.float() + 0.1 * o_w.float()).bfloat16()
    assert torch.equal(_gated_sum(0.9, o_s, 0.1, o_w, torch.float32), want)
    assert torch.equal(_gated_sum(0.9, o_s.float(), 0.1, o_w.float(), torch.float32),
                       0.9 * o_s.float() + 0.1 * o_w.float())


@pytest.mark.parametrize("nq,nk", [(61, 61), (40, 97)])  # prefill; a chunk of queries after a cached prefix
def test_paper_selection_ranked_in_row_tiles_equals_ranked_at_once(nq, nk, monkeypatch):
    """The paper's composition ranks block importances a tile of query rows at a time (whole, they
    were 26 GB of the 42 GB peak at 131k on an H100): tiles of 7 rows give the same output and LSEs."""
    from longpatch.methods.nsa import naive

    q, k, v = rand(2, 4, 2, nq, nk, dtype=torch.float64)
    params = dict(SMALL, gates=(0.3, 0.4, 0.3), return_lse=True)
    whole = nsa_attention(q, k, v, **params)
    monkeypatch.setattr(naive, "SCORE_ELEMS", 2 * 2 * 13 * 7)  # b x kv_heads x blocks (at most 13) x 7 rows
    tiled = nsa_attention(q, k, v, **params)
    assert torch.equal(whole[0], tiled[0]) and torch.equal(whole[1], tiled[1])
