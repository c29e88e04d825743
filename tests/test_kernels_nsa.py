"""NSA's Triton kernels under TRITON_INTERPRET=1, against a dense float64 oracle and the PyTorch twins.

The oracle below builds each branch's per-token visibility mask explicitly (fine at these tiny
sizes) and runs plain softmax attention in float64; gradients come from autograd through it. The
twins (``longpatch.methods.nsa.*_reference``) are a second, independent check.

The interpreter is slow (every Triton op is a numpy call with Python overhead, per program), so the
shapes are tiny and each main case exercises all four kernels at once.
"""
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - e.g. a GPU run with interpretation off
    pytest.skip("kernel tests run on CPU under TRITON_INTERPRET=1", allow_module_level=True)

from longpatch.kernels import nsa as K  # noqa: E402
from longpatch.methods import nsa as M  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# compress block / stride, select block, window: small, so that tiny sequences hold several blocks.
# window 34: in the 70-token case, position 64 (first row of a 32-row tile) is the last to see key 31
# (end of a key tile), the boundary of the dK/dV row range.
GEO = dict(l=16, s=8, sel=32, win=34)


# ------------------------------------------------------------------------------------------------
# dense oracle (float64, explicit per-token masks)
# ------------------------------------------------------------------------------------------------

def _pos(nq, kv_len):
    return torch.arange(kv_len - nq, kv_len)


def _masked_attention(q, k, v, vis, scale):
    """softmax attention with a bool mask vis broadcastable to [b, hq, nq, nk]; empty rows: 0, -inf."""
    g = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(g, 1)
    v = v.double().repeat_interleave(g, 1)
    s = q.double() @ k.transpose(-1, -2) * scale
    vis = vis.expand(s.shape)
    empty = ~vis.any(-1, keepdim=True)
    # a finite dummy row for empty rows keeps autograd free of NaN; torch.where then drops it
    s = s.masked_fill(~vis, float("-inf")).masked_fill(empty, 0.0)
    out = torch.where(empty, 0.0, torch.softmax(s, -1) @ v)
    lse = torch.where(empty[..., 0], float("-inf"), torch.logsumexp(s, -1))
    return out, lse


def _cmp_visible(nq, kv_len, nc, l, s):
    t = _pos(nq, kv_len)[:, None]
    i = torch.arange(nc)[None, :]
    return i * s + l - 1 <= t  # [nq, nc]


def oracle_compressed(q, kc, vc, *, scale, compress_block, compress_stride, kv_len):
    vis = _cmp_visible(q.shape[2], kv_len, kc.shape[2], compress_block, compress_stride)
    return _masked_attention(q, kc, vc, vis, scale)


def oracle_window(q, k, v, *, scale, window, kv_len):
    t = _pos(q.shape[2], kv_len)[:, None]
    n = torch.arange(k.shape[2])[None, :]
    return _masked_attention(q, k, v, (n <= t) & (n > t - window) & (n < kv_len), scale)


def oracle_selected(q, k, v, idx, *, scale, select_block, kv_len):
    b, hk, nq, _ = idx.shape
    n = torch.arange(k.shape[2])
    chosen = ((n // select_block).view(1, 1, 1, -1, 1) == idx.long().unsqueeze(-2)).any(-1)  # [b, hk, nq, nk]
    vis = chosen & (n[None, :] <= _pos(nq, kv_len)[:, None]) & (n < kv_len)
    return _masked_attention(q, k, v, vis.repeat_interleave(q.shape[1] // hk, 1), scale)


def oracle_scores(q, kc, lse_cmp, *, scale, compress_block, compress_stride, select_block, kv_len,
                  init_blocks, local_blocks):
    b, hq, nq, _ = q.shape
    hk, nc = kc.shape[1], kc.shape[2]
    l, s, sel = compress_block, compress_stride, select_block
    g = hq // hk
    ns = math.ceil(kv_len / sel)
    logit = q.double() @ kc.double().repeat_interleave(g, 1).transpose(-1, -2) * scale
    p = torch.exp(logit - lse_cmp.double().unsqueeze(-1))
    p = torch.where(_cmp_visible(nq, kv_len, nc, l, s) & torch.isfinite(lse_cmp).unsqueeze(-1), p, 0.0)
    i = torch.arange(nc)[:, None]
    j = torch.arange(ns)[None, :]
    overlap = ((i * s < (j + 1) * sel) & (j * sel < i * s + l)).double()
    sc = (p @ overlap).view(b, hk, g, nq, ns).sum(2)
    t = _pos(nq, kv_len)[:, None]
    own = t // sel
    forced = (j < init_blocks) | ((j > own - local_blocks) & (j <= own))
    sc = torch.where(forced, float("inf"), sc)
    return torch.where(j * sel > t, float("-inf"), sc)  # the future wins over forcing


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def _rand(*shape, dtype, gen):
    return torch.randn(*shape, generator=gen).to(dtype).requires_grad_()


def _random_idx(b, hk, nq, kv_len, sel, S, gen):
    """Distinct block ids per row, some -1 slots, some blocks in the future (they must see nothing)."""
    ns = math.ceil(kv_len / sel)
    idx = torch.stack([torch.randperm(ns, generator=gen)[:S] for _ in range(b * hk * nq)]).view(b, hk, nq, -1)
    if idx.shape[-1] < S:
        idx = torch.cat([idx, idx.new_full((b, hk, nq, S - idx.shape[-1]), -1)], -1)
    drop = torch.rand(idx.shape, generator=gen) < 0.25
    return torch.where(drop, -1, idx)


def _with_idx(fn, idx):
    """fn(q, k, v, idx, **kw) as f(q, k, v, **kw), keeping fn's name for failure messages."""
    def bound(q, k, v, **kw):
        return fn(q, k, v, idx, **kw)
    bound.__name__ = fn.__name__
    return bound


def _loss(out, lse, w, u):
    # out and lse both carry a gradient; -inf rows of lse (nothing visible) contribute nothing
    return (out.to(w.dtype) * w).sum() + (torch.where(torch.isfinite(lse), lse.to(u.dtype), 0.0) * u).sum()


def _tol(dtype):
    """(forward, gradient) tolerances: fp32 end to end, or bf16 inputs with fp32 accumulation."""
    if dtype == torch.float32:
        return dict(atol=2e-5, rtol=1e-4), dict(atol=1e-4, rtol=1e-3)
    return dict(atol=3e-2, rtol=3e-2), dict(atol=1e-1, rtol=5e-2)


def _check_branch(kernel, refs, inputs, kw, gen):
    """Kernel forward (out, lse and its -inf pattern) and backward through both outputs, against each
    reference in refs (the dense oracle, the twin) with autograd through the reference."""
    dtype = inputs[0].dtype
    out, lse = kernel(*inputs, **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == inputs[0].shape
    assert lse.shape == inputs[0].shape[:3]
    assert (out[~torch.isfinite(lse)] == 0).all()
    w = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    u = torch.randn(lse.shape, generator=gen, dtype=torch.float64)
    diff = [x for x in inputs if x.requires_grad]
    got = torch.autograd.grad(_loss(out, lse, w, u), diff)
    fwd_tol, bwd_tol = _tol(dtype)
    for ref in refs:
        ref_out, ref_lse = ref(*inputs, **kw)
        assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse)), ref.__name__
        fin = torch.isfinite(ref_lse)
        name = ref.__name__
        torch.testing.assert_close(out.double(), ref_out.double(), **fwd_tol, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(lse[fin].double(), ref_lse[fin].double(), **fwd_tol,
                                   msg=lambda m, name=ref.__name__: f"{name}: {m}")
        want = torch.autograd.grad(_loss(ref_out, ref_lse, w, u), diff)
        for a, b in zip(got, want):
            assert a.dtype == dtype
            torch.testing.assert_close(a.double(), b.double(), **bwd_tol,
                                       msg=lambda m, name=name: f"{name} grad: {m}")
    return out, lse


def _check_scores(q, kc, lse_cmp, kw):
    with torch.no_grad():
        sc = K.selection_scores(q, kc, lse_cmp, **kw)
        refs = [oracle_scores(q, kc, lse_cmp, **kw), M.selection_scores_reference(q, kc, lse_cmp, **kw)]
    b, hq, nq, _ = q.shape
    assert sc.shape == (b, kc.shape[1], nq, math.ceil(kw["kv_len"] / kw["select_block"])) and sc.dtype == torch.float32
    for ref in refs:
        assert torch.equal(sc == float("inf"), ref == float("inf"))
        assert torch.equal(sc == float("-inf"), ref == float("-inf"))
        fin = torch.isfinite(ref)
        torch.testing.assert_close(sc[fin].double(), ref[fin].double(), atol=2e-5, rtol=1e-4)
    return sc


# ------------------------------------------------------------------------------------------------
# the four kernels on a few shapes
# ------------------------------------------------------------------------------------------------

CASES = [
    # b, hq, hk, nq, kv_len, d, dtype
    (2, 4, 2, 16, 100, 16, torch.float32),    # GQA 2, chunked prefill, ragged (100 = 3 * 32 + 4),
                                              # window key tiles skipped (forward and dK/dV)
    (1, 1, 1, 70, 70, 32, torch.float32),     # g = 1, prefill, d = 32, the first rows see no compressed block
    (2, 16, 1, 1, 90, 16, torch.float32),     # decode, one KV head shared by 16 query heads
    (1, 8, 2, 24, 61, 16, torch.bfloat16),    # GQA 4, bf16 in / fp32 accumulation
]


@pytest.mark.parametrize("b,hq,hk,nq,kv_len,d,dtype", CASES)
def test_nsa_kernels_match_oracle_and_twins(b, hq, hk, nq, kv_len, d, dtype):
    gen = torch.Generator().manual_seed(1000 * hq + nq)
    l, s, sel, win = GEO["l"], GEO["s"], GEO["sel"], GEO["win"]
    scale = 0.3
    nc = M.num_compressed(kv_len, l, s)
    q = _rand(b, hq, nq, d, dtype=dtype, gen=gen)
    k = _rand(b, hk, kv_len, d, dtype=dtype, gen=gen)
    v = _rand(b, hk, kv_len, d, dtype=dtype, gen=gen)
    kc = _rand(b, hk, nc, d, dtype=dtype, gen=gen)
    vc = _rand(b, hk, nc, d, dtype=dtype, gen=gen)

    cmp_kw = dict(scale=scale, compress_block=l, compress_stride=s, kv_len=kv_len)
    _, lse_cmp = _check_branch(K.compressed_attention, [oracle_compressed, M.compressed_attention_reference],
                               (q, kc, vc), cmp_kw, gen)

    # the scores from the kernel's own compressed LSE, as the method chains them
    _check_scores(q, kc, lse_cmp.detach(), dict(cmp_kw, select_block=sel, init_blocks=1, local_blocks=2))

    idx = _random_idx(b, hk, nq, kv_len, sel, 3, gen)
    sel_kw = dict(scale=scale, select_block=sel, kv_len=kv_len)
    _check_branch(_with_idx(K.selected_attention, idx),
                  [_with_idx(oracle_selected, idx), _with_idx(M.selected_attention_reference, idx)],
                  (q, k, v), sel_kw, gen)

    win_kw = dict(scale=scale, window=win, kv_len=kv_len)
    _check_branch(K.window_attention, [oracle_window, M.window_attention_reference], (q, k, v), win_kw, gen)


# ------------------------------------------------------------------------------------------------
# targeted checks
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("l,s,sel,init_blocks,local_blocks", [
    (8, 4, 8, 2, 1),     # several tiles of every kind (rows, compressed blocks, selection blocks)
    (16, 16, 16, 0, 0),  # l = s = l': one compressed block per selection block, nothing forced
    (12, 4, 20, 1, 3),   # l' not a multiple of s: compressed blocks straddle selection borders
])
def test_selection_scores_tiles_and_geometries(monkeypatch, l, s, sel, init_blocks, local_blocks):
    monkeypatch.setattr(K, "_SCORE_BLOCKS", (16, 16, 16))
    gen = torch.Generator().manual_seed(l * 100 + sel)
    b, hq, hk, nq, kv_len, d = 1, 6, 2, 37, 150, 16  # g = 3: not a power of two
    nc = M.num_compressed(kv_len, l, s)
    q = torch.randn(b, hq, nq, d, generator=gen)
    kc = torch.randn(b, hk, nc, d, generator=gen)
    vc = torch.randn(b, hk, nc, d, generator=gen)
    _, lse = K.compressed_attention(q, kc, vc, scale=0.5, compress_block=l, compress_stride=s, kv_len=kv_len)
    kw = dict(scale=0.5, compress_block=l, compress_stride=s, select_block=sel, kv_len=kv_len,
              init_blocks=init_blocks, local_blocks=local_blocks)
    sc = _check_scores(q, kc, lse, kw)
    if init_blocks == local_blocks == 0:
        assert not (sc == float("inf")).any()


@pytest.mark.parametrize("tiles", ["interpreter", "gpu-like"])
def test_selected_sub_tiles_int32_ids_strided_views(monkeypatch, tiles):
    """select_block 40, int32 ids, q/k/v as [b, n, h, d] views transposed to [b, h, n, d] (the HF
    layout), a cache longer than kv_len. "gpu-like" forces the GPU tiling at small sizes: one slot per
    tile, 40-key blocks in 16-key sub-tiles (the last one half masked), a dK/dV row tile of 16 rows =
    5 positions x 3 heads + 1 masked row."""
    if tiles == "gpu-like":
        real = K._sel_blocks
        monkeypatch.setattr(K, "_sel_blocks", lambda *a: dict(real(*a), SLOTS=1, BLOCK_N=16, BLOCK_R=16))
    gen = torch.Generator().manual_seed(3)
    b, hq, hk, nq, kv_len, d, sel = 1, 6, 2, 6, 110, 16, 40  # g = 3: not a power of two
    base = [torch.randn(b, n, h, d, generator=gen).requires_grad_()
            for n, h in ((nq, hq), (kv_len + 6, hk), (kv_len + 6, hk))]
    q, k, v = (x.transpose(1, 2) for x in base)
    assert not q.is_contiguous()
    idx = torch.tensor([[0, 2, -1], [1, -1, 2]]).repeat(nq // 2 + 1, 1)[:nq].view(1, 1, nq, 3).repeat(b, hk, 1, 1)
    idx = idx.to(torch.int32)
    kw = dict(scale=0.25, select_block=sel, kv_len=kv_len)
    out, lse = K.selected_attention(q, k, v, idx, **kw)
    ref_out, ref_lse = oracle_selected(q, k, v, idx, **kw)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-4)
    w, u = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    got = torch.autograd.grad(_loss(out, lse, w, u), base)
    want = torch.autograd.grad(_loss(ref_out, ref_lse, w.double(), u.double()), base)
    for a, e in zip(got, want):
        torch.testing.assert_close(a.double(), e.double(), atol=1e-4, rtol=1e-3)
    assert (got[1][:, kv_len:] == 0).all()  # cache rows past kv_len: no gradient


def test_nothing_visible_gives_zero_and_minus_inf():
    """kv_len < compress_block: no compressed block at all; window rows are never empty."""
    q = torch.randn(1, 2, 5, 16, requires_grad=True)
    kc = torch.zeros(1, 1, 0, 16, requires_grad=True)
    out, lse = K.compressed_attention(q, kc, kc, scale=0.25, compress_block=16, compress_stride=8, kv_len=10)
    assert (out == 0).all() and (lse == float("-inf")).all()
    (gq,) = torch.autograd.grad((out * 2).sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum(), (q,))
    assert (gq == 0).all()
    sc = K.selection_scores(q, kc, lse, scale=0.25, compress_block=16, compress_stride=8, select_block=4,
                            kv_len=10, init_blocks=1, local_blocks=1)
    ref = oracle_scores(q, kc, lse, scale=0.25, compress_block=16, compress_stride=8, select_block=4, kv_len=10,
                        init_blocks=1, local_blocks=1)
    assert torch.equal(sc.double(), ref)


def test_triton_selection_scores_ranked_in_row_tiles(monkeypatch):
    """The scoring kernel called a tile of query rows at a time (``naive.compose``, for memory): the
    rows are the last ones of a shorter prefix, so the kernel's position offset carries the tile."""
    from longpatch.methods.nsa import naive

    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, h, 70, 16, generator=gen) for h in (4, 2, 2))
    kw = dict(compress_block=16, compress_stride=8, select_block=16, num_selected=3, window=16, return_lse=True)
    with torch.no_grad():
        whole = M.nsa_attention(q, k, v, backend="triton", **kw)
        monkeypatch.setattr(naive, "SCORE_ELEMS", 2 * 5 * 9)  # kv heads x blocks x 9 rows: 8 tiles
        tiled = M.nsa_attention(q, k, v, backend="triton", **kw)
    assert torch.equal(whole[0], tiled[0]) and torch.equal(whole[1], tiled[1])


def test_triton_backend_equals_torch_backend():
    """The whole method on the two backends: topk_blocks on the kernel scores, the gated sum, and the
    gradients of q, k, v through every branch."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, 64, 16, generator=gen).requires_grad_() for h in (4, 1, 1))
    kw = dict(compress_block=16, compress_stride=8, select_block=16, num_selected=3, window=16, return_lse=True)
    o1, l1 = M.nsa_attention(q, k, v, backend="triton", **kw)
    o2, l2 = M.nsa_attention(q, k, v, backend="torch", **kw)
    torch.testing.assert_close(o1, o2, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(l1, l2, atol=2e-5, rtol=1e-4)
    w, u = torch.randn(o1.shape, generator=gen), torch.randn(l1.shape, generator=gen)
    g1 = torch.autograd.grad(_loss(o1, l1, w, u), (q, k, v))
    g2 = torch.autograd.grad(_loss(o2, l2, w, u), (q, k, v))
    for a, e in zip(g1, g2):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-3)


# ------------------------------------------------------------------------------------------------
# GPU compilation (no GPU needed): catches what the interpreter does not check
# ------------------------------------------------------------------------------------------------

_COMPILE_SCRIPT = r"""
import inspect, os, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton.backends
if "constexprs" not in inspect.signature(ASTSource.__init__).parameters or "nvidia" not in triton.backends.backends:
    sys.exit(77)  # another Triton API, or no CUDA backend: skip
from longpatch.kernels import nsa as K

INTS = {"HQ", "HK", "GROUP", "NQ", "NK", "NC", "NS", "D", "S", "SHIFT", "STRIDE", "OFF", "WIN", "SEL", "INIT",
        "LOCAL", "CMP_L", "CMP_S", "USERS_PER_TILE"}


def signature(kernel, dt, consts):
    sig = {}
    for n in kernel.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in ("Idx", "Users", "UserStart"):
            sig[n] = "*i32"
        elif n in ("Lse", "Delta", "Out"):
            sig[n] = "*fp32"
        elif n in ("qk_scale", "scale"):
            sig[n] = "fp32"
        elif n[0].isupper() and n not in INTS:
            sig[n] = "*" + dt
        else:
            sig[n] = "i32"
    return sig


for dt, cdt, dot in (("fp32", tl.float32, "ieee"), ("bf16", tl.bfloat16, None)):
    c = dict(CDT=cdt, DOT=dot)
    band = dict(c, BLOCK_M=32, BLOCK_N=32, BLOCK_D=64)
    sel = dict(c, SLOTS=1, BLOCK_G=16, BLOCK_N=32, BLOCK_D=64)
    for kernel, consts in ((K._band_fwd_kernel, band), (K._band_bwd_dq_kernel, band), (K._band_bwd_dkdv_kernel, band),
                           (K._scores_kernel, dict(c, BLOCK_M=32, BLOCK_C=32, BLOCK_S=32, BLOCK_D=64)),
                           (K._sel_fwd_kernel, sel), (K._sel_bwd_dq_kernel, sel),
                           (K._sel_bwd_dkdv_kernel, dict(c, BLOCK_R=32, BLOCK_N=32, BLOCK_D=64))):
        compiled = triton.compile(ASTSource(kernel, signature(kernel, dt, consts), consts),
                                  target=GPUTarget("cuda", 80, 32))
        assert compiled.metadata.shared <= 99 * 1024, (kernel.__name__, dt, compiled.metadata.shared)
        print("compiled", dt, kernel.__name__, compiled.metadata.shared)
"""


@pytest.mark.slow
def test_kernels_compile_for_sm80():
    """Every kernel, fp32 and bf16, through Triton's CUDA pipeline down to a cubin (ptxas ships with
    Triton), with the shared memory the tile sizes promise. A subprocess: the interpreter mode of
    this session replaces triton.jit."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    if run.returncode == 77:
        pytest.skip("this Triton has another compile API or no CUDA backend")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("compiled") == 14
