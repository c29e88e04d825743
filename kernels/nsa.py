"""Triton kernels for NSA (Native Sparse Attention): the three branches and the block scores.

Layout everywhere: q [b, hq, nq, d], k/v [b, hk, nk, d], hq a multiple of hk (GQA group
g = hq / hk, any g); K/V are never repeated. The queries are the last nq of ``kv_len`` positions:
query row i sits at absolute position t = kv_len - nq + i. Every attention returns (out, lse) with
out in q's dtype and lse float32 [b, hq, nq]; a row that sees no key gets out 0 and lse -inf. All
attentions are differentiable in q, k, v through out *and* lse (dS = P * (dP - delta) with
delta = rowsum(dO * O) - dLSE), so the three branches can be merged or gated by their LSEs.

* ``compressed_attention``: attention over the compressed keys; block i (keys [i*s, i*s + l)) is
  visible to position t iff i*s + l - 1 <= t.
* ``window_attention``: keys in (t - window, t].
  Both are one "band" kernel family: key n is visible iff n*STRIDE + OFF <= t and n > t - WIN
  (compressed: STRIDE = s, OFF = l - 1, no window; window: STRIDE = 1, OFF = 0). Flash-style,
  with the rows of a tile being (position, head) pairs of one KV head's group, position-major, so
  a tile holds the whole group for a few positions (decoding with g = 16 is one tile); the key loop
  visits only the key tiles inside the tile's band, and the dK/dV pass only the row tiles that can
  see its key tile.
* ``selection_scores``: importance of every selection block for every query position, summed over
  the query heads of the GQA group (one selection per group), forced blocks +inf, future -inf.
  Compressed probabilities are mapped to selection blocks with a 0/1 overlap matrix (one dot).
* ``selected_attention``: group-centric as in the paper. One program per (batch, KV head, query
  position) holds all g query heads of the group as the rows of one tile ([g, d], padded to >= 16
  rows for tl.dot, so any g works) and fetches each selected K/V block once for the whole group.
  The backward is deterministic (no atomics): dQ per query position like the forward, dK/dV per
  selected block from an inverted index (the query positions that selected each block, built with
  a torch sort) so that every key row is written by exactly one program, in a fixed order.

Every kernel works for any group size g (1, 2, 3, 4, 16, ...; tiles are padded and masked, never
"g must be a multiple of 16"), ragged lengths (no length needs to be a multiple of any block),
nq < kv_len (chunked prefill, decoding with nq = 1), fp32 or bf16/fp16 inputs (fp32 accumulation),
and strided q/k/v views (the head dim must be contiguous, else a copy is made).

The readable PyTorch twins are the ``*_reference`` functions of ``longpatch.methods.nsa``; tests
pair the two under ``TRITON_INTERPRET=1`` (kernels on CPU tensors).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import LOG2E, interpreted, max_combine, prep, row_delta, sum_combine

# Notes on style, mostly for the CPU interpreter (TRITON_INTERPRET=1), which the tests use:
# * The kernels call no @triton.jit helper (not even tl.zeros / tl.max / tl.sum, which are jit
#   functions of triton.language.standard): every nested jit call re-patches triton.language,
#   milliseconds each, several times per loop step. Tiles are cast once to the compute dtype CDT and
#   every tl.dot takes the constexpr input precision DOT; row reductions call tl.reduce with
#   Triton's own combine functions, which the interpreter reduces with numpy (same code on a GPU).
# * Offsets are int64 (program ids cast at the top): long contexts overflow int32 element offsets
#   (b * stride_b reaches 2**31 at b=16, 8 KV heads, 128k tokens, d=128), and the interpreter skips
#   its per-operation int32 overflow checks on 64-bit integers.


def _compute(q: torch.Tensor) -> dict:
    """Compute dtype of the tiles and dot precision.

    fp32 inputs: exact fp32 dots ("ieee", no tf32). bf16/fp16 on a GPU: native tensor-core dots with
    fp32 accumulation. Anything in the CPU interpreter: upcast to fp32, because the interpreter
    computes bf16/fp16 dots wrongly.
    """
    if q.dtype in (torch.float32, torch.float64) or interpreted(q.device):
        return dict(CDT=tl.float32, DOT="ieee")
    # DOT None: the backend's default, meaningless for half inputs (and "tf32" is not allowed on every backend)
    return dict(CDT=tl.float16 if q.dtype == torch.float16 else tl.bfloat16, DOT=None)


# --------------------------------------------------------------------------------------------------
# band kernels: compressed attention and sliding window
# --------------------------------------------------------------------------------------------------
#
# Rows are the (query position, query head) pairs of one KV head's group, position-major: row
# r = pos * g + head. A row tile thus holds every head of the group for a few consecutive positions
# (group-centric: decoding with g = 16 is one tile, not 16 tiles of one valid row each), its
# positions are the contiguous range [r0 // g, (r1 - 1) // g], and the rows that can see a key tile
# form one contiguous range too, so both directions skip whole tiles outside the band.

@triton.jit
def _band_fwd_kernel(Q, K, V, O, Lse,
                     sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
                     HQ, HK, GROUP, NQ, NK, D, SHIFT, STRIDE, OFF, WIN, qk_scale,
                     CDT: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // HK
    hk = pid_bh % HK
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = offs_r < NQ * GROUP
    d_ok = offs_d < D
    pos = offs_r // GROUP
    h = hk * GROUP + offs_r % GROUP
    t = SHIFT + pos
    rd_mask = r_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h[:, None] * sqh + pos[:, None] * sqm + offs_d[None, :], mask=rd_mask, other=0.0).to(CDT)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    # the key tiles that some row of this tile can see: skip everything outside the band
    t_lo = SHIFT + (pid_m * BLOCK_M) // GROUP
    t_hi = SHIFT + (tl.minimum(pid_m * BLOCK_M + BLOCK_M, NQ * GROUP) - 1) // GROUP
    # integer division truncates toward zero in Triton: guard the negative case explicitly
    n_end = tl.minimum(tl.where(t_hi >= OFF, (t_hi - OFF) // STRIDE + 1, 0), NK)
    n_start = tl.maximum(t_lo - WIN + 1, 0) // BLOCK_N * BLOCK_N
    for start_n in range(n_start, n_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < NK
        kt = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :],
                     mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(CDT)
        vt = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :],
                     mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(CDT)
        s = tl.dot(q, tl.trans(kt), input_precision=DOT) * qk_scale  # log2 domain
        # key n visible iff it exists, lies wholly at or before t (n*STRIDE + OFF <= t), is in the window
        visible = (r_ok[:, None] & n_ok[None, :] & (offs_n[None, :] * STRIDE + OFF <= t[:, None])
                   & (offs_n[None, :] > t[:, None] - WIN))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, max_combine))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet: no NaN
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, sum_combine)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT)
        m_i = m_new
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(O + b * sob + h[:, None] * soh + pos[:, None] * som + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=rd_mask)
    tl.store(Lse + (b * HQ + h) * NQ + pos, lse, mask=r_ok)


@triton.jit
def _band_bwd_dq_kernel(Q, K, V, DO, Lse, Delta, DQ,
                        sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm, sgb, sgh, sgm,
                        HQ, HK, GROUP, NQ, NK, D, SHIFT, STRIDE, OFF, WIN, qk_scale, scale,
                        CDT: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // HK
    hk = pid_bh % HK
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = offs_r < NQ * GROUP
    d_ok = offs_d < D
    pos = offs_r // GROUP
    h = hk * GROUP + offs_r % GROUP
    t = SHIFT + pos
    rd_mask = r_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h[:, None] * sqh + pos[:, None] * sqm + offs_d[None, :], mask=rd_mask, other=0.0).to(CDT)
    do = tl.load(DO + b * sdb + h[:, None] * sdh + pos[:, None] * sdm + offs_d[None, :],
                 mask=rd_mask, other=0.0).to(CDT)
    rows = (b * HQ + h) * NQ + pos
    lse = tl.load(Lse + rows, mask=r_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # empty rows: p = 0
    delta = tl.load(Delta + rows, mask=r_ok, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    dq = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    t_lo = SHIFT + (pid_m * BLOCK_M) // GROUP
    t_hi = SHIFT + (tl.minimum(pid_m * BLOCK_M + BLOCK_M, NQ * GROUP) - 1) // GROUP
    n_end = tl.minimum(tl.where(t_hi >= OFF, (t_hi - OFF) // STRIDE + 1, 0), NK)
    n_start = tl.maximum(t_lo - WIN + 1, 0) // BLOCK_N * BLOCK_N
    for start_n in range(n_start, n_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < NK
        kt = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :],
                     mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(CDT)
        vt = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :],
                     mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(CDT)
        s = tl.dot(q, tl.trans(kt), input_precision=DOT) * qk_scale
        visible = (r_ok[:, None] & n_ok[None, :] & (offs_n[None, :] * STRIDE + OFF <= t[:, None])
                   & (offs_n[None, :] > t[:, None] - WIN))
        p = tl.where(visible, tl.math.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(vt), input_precision=DOT)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), kt, input_precision=DOT)
    tl.store(DQ + b * sgb + h[:, None] * sgh + pos[:, None] * sgm + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty),
             mask=rd_mask)


@triton.jit
def _band_bwd_dkdv_kernel(Q, K, V, DO, Lse, Delta, DK, DV,
                          sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm, sgb, sgh, sgn,
                          HQ, HK, GROUP, NQ, NK, D, SHIFT, STRIDE, OFF, WIN, qk_scale, scale,
                          CDT: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    # One program per key tile of one KV head: it visits only the (position, head) row tiles that
    # can see this key tile, every head of the group at once, and owns its dK/dV rows (no atomics).
    pid_n = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // HK
    hk = pid_bh % HK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < NK
    d_ok = offs_d < D
    kd_mask = n_ok[:, None] & d_ok[None, :]
    kt = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :], mask=kd_mask, other=0.0).to(CDT)
    vt = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :], mask=kd_mask, other=0.0).to(CDT)
    dk = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    dv = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    n_first = pid_n * BLOCK_N
    n_last = tl.minimum(n_first + BLOCK_N, NK) - 1
    # first position that sees key n_first, one past the last position whose window still holds n_last
    p_start = tl.maximum(n_first * STRIDE + OFF - SHIFT, 0)
    p_end = tl.minimum(NQ, n_last + WIN - SHIFT)
    r_start = p_start * GROUP // BLOCK_M * BLOCK_M
    for r0 in range(r_start, p_end * GROUP, BLOCK_M):
        offs_r = r0 + tl.arange(0, BLOCK_M)
        r_ok = offs_r < NQ * GROUP
        pos = offs_r // GROUP
        h = hk * GROUP + offs_r % GROUP
        t = SHIFT + pos
        rd_mask = r_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + b * sqb + h[:, None] * sqh + pos[:, None] * sqm + offs_d[None, :], mask=rd_mask,
                    other=0.0).to(CDT)
        do = tl.load(DO + b * sdb + h[:, None] * sdh + pos[:, None] * sdm + offs_d[None, :], mask=rd_mask,
                     other=0.0).to(CDT)
        rows = (b * HQ + h) * NQ + pos
        lse = tl.load(Lse + rows, mask=r_ok, other=0.0)
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        delta = tl.load(Delta + rows, mask=r_ok, other=0.0)
        s = tl.dot(q, tl.trans(kt), input_precision=DOT) * qk_scale
        visible = (r_ok[:, None] & n_ok[None, :] & (offs_n[None, :] * STRIDE + OFF <= t[:, None])
                   & (offs_n[None, :] > t[:, None] - WIN))
        p = tl.where(visible, tl.math.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(vt), input_precision=DOT)
        ds = p * (dp - delta[:, None])
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT)
    # dK and dV are fresh contiguous tensors of the same shape: one set of strides serves both
    g_off = b * sgb + hk * sgh + offs_n[:, None] * sgn + offs_d[None, :]
    tl.store(DK + g_off, (dk * scale).to(DK.dtype.element_ty), mask=kd_mask)
    tl.store(DV + g_off, dv.to(DV.dtype.element_ty), mask=kd_mask)


def _gpu_block(dtype: torch.dtype, block_d: int) -> int:
    """Key/row tile size on a GPU, within ~100 KB of shared memory (sm_86/89 allow 99 KB per block).

    Compiled for sm_80, the largest of these kernels (band dQ) needs with tiles of 64 / 32 / 16:
    bf16 d=64: 32 / 16 KB, d=128: 56 / 32 KB, d=256: - / 56 KB; fp32 (exact "ieee" dots, much more
    staging) d=64: 112 / 52 KB, d=128: 208 / 100 / 49 KB, d=256: - / 196 / 97 KB.
    """
    if dtype in (torch.float32, torch.float64):
        return 32 if block_d <= 64 else 16
    return 64 if block_d <= 64 else 32


def _band_blocks(d: int, q: torch.Tensor) -> tuple[int, int, int]:
    block_d = max(16, triton.next_power_of_2(d))
    if interpreted(q.device):
        return 32, 32, block_d  # the interpreter: moderate tiles (and the tests reach the band skipping)
    block = _gpu_block(q.dtype, block_d)
    return block, block, block_d


def _band_forward(q, k, v, nk, geom, scale):
    B, HQ, NQ, D = q.shape
    HK = k.shape[1]
    o = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, HQ, NQ, device=q.device, dtype=torch.float32)
    bm, bn, bd = _band_blocks(D, q)
    if NQ:
        _band_fwd_kernel[(triton.cdiv(NQ * (HQ // HK), bm), B * HK)](
            q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
            HQ, HK, HQ // HK, NQ, nk, D, *geom, scale * LOG2E,
            **_compute(q), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd)
    return o, lse


def _band_backward(q, k, v, nk, geom, scale, o, lse, do, dlse):
    B, HQ, NQ, D = q.shape
    HK = k.shape[1]
    do = do.contiguous()
    delta = row_delta(do, o, dlse)
    dq = torch.zeros(q.shape, device=q.device, dtype=q.dtype)
    # zeros: key rows past nk (a preallocated cache) get no gradient and no program writes them
    dk = torch.zeros(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.zeros(v.shape, device=v.device, dtype=v.dtype)
    if NQ == 0:
        return dq, dk, dv
    bm, bn, bd = _band_blocks(D, q)
    common = dict(**_compute(q), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    _band_bwd_dq_kernel[(triton.cdiv(NQ * (HQ // HK), bm), B * HK)](
        q, k, v, do, lse, delta, dq, *strides, *dq.stride()[:3],
        HQ, HK, HQ // HK, NQ, nk, D, *geom, scale * LOG2E, scale, **common)
    if nk > 0:
        _band_bwd_dkdv_kernel[(triton.cdiv(nk, bn), B * HK)](
            q, k, v, do, lse, delta, dk, dv, *strides, *dk.stride()[:3],
            HQ, HK, HQ // HK, NQ, nk, D, *geom, scale * LOG2E, scale, **common)
    return dq, dk, dv


class _BandAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, nk, geom, scale):
        q, k, v = prep(q), prep(k), prep(v)
        o, lse = _band_forward(q, k, v, nk, geom, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.nk, ctx.geom, ctx.scale = nk, geom, scale
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = _band_backward(q, k, v, ctx.nk, ctx.geom, ctx.scale, o, lse, do.to(o.dtype), dlse)
        return dq, dk, dv, None, None, None


def _check(q, k, v, kv_len, name):
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{name}: bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"{name}: q heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]}), same batch")
    if q.shape[2] > kv_len:
        raise ValueError(f"{name}: the queries are the last positions: q_len {q.shape[2]} > kv_len {kv_len}")


def _scale(scale, d):
    return d ** -0.5 if scale is None else float(scale)


def compressed_attention(q, k_cmp, v_cmp, *, scale=None, compress_block: int = 32, compress_stride: int = 16,
                         kv_len: int):
    """Attention of q over the compressed blocks: (out [b, hq, nq, d] q.dtype, lse [b, hq, nq] float32).

    k_cmp/v_cmp [b, hk, nc, d]: compressed block i summarises keys [i*s, i*s + l); the query at
    position t = kv_len - nq + row sees it iff i*s + l - 1 <= t (the block lies wholly in its past).
    Rows that see no block (t < l - 1) get out 0, lse -inf. Differentiable in q, k_cmp, v_cmp.
    """
    _check(q, k_cmp, v_cmp, kv_len, "compressed_attention")
    l, s = int(compress_block), int(compress_stride)
    if l < 1 or s < 1:
        raise ValueError(f"compressed_attention: compress_block ({l}) and compress_stride ({s}) must be >= 1")
    # no window constraint: any WIN > kv_len keeps n > t - WIN true for every n >= 0
    geom = (int(kv_len) - q.shape[2], s, l - 1, int(kv_len) + 1)
    return _BandAttention.apply(q, k_cmp, v_cmp, k_cmp.shape[2], geom, _scale(scale, q.shape[-1]))


def window_attention(q, k, v, *, scale=None, window: int = 512, kv_len: int | None = None):
    """Sliding-window attention: position t sees keys (t - window, t]. Returns (out, lse float32).

    k/v [b, hk, >= kv_len, d] (rows past kv_len are ignored); differentiable in q, k, v.
    """
    kv_len = k.shape[2] if kv_len is None else int(kv_len)
    _check(q, k, v, kv_len, "window_attention")
    if kv_len > k.shape[2] or window < 1:
        raise ValueError(f"window_attention: need kv_len <= k.shape[2] and window >= 1; got {kv_len}, {window}")
    geom = (kv_len - q.shape[2], 1, 0, int(window))
    return _BandAttention.apply(q, k, v, kv_len, geom, _scale(scale, q.shape[-1]))


# --------------------------------------------------------------------------------------------------
# selection scores
# --------------------------------------------------------------------------------------------------

@triton.jit
def _scores_kernel(Q, KC, Lse, Out,
                   sqb, sqh, sqm, skb, skh, skn,
                   HQ, HK, GROUP, NQ, NC, NS, D, SHIFT, CMP_L, CMP_S, SEL, INIT, LOCAL, qk_scale,
                   CDT: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per (query tile, selection-block tile, batch x KV head): it loads each compressed
    # key tile once and the query heads of the whole group against it, sums their probabilities
    # over the group, then maps compressed blocks to selection blocks with a 0/1 overlap matrix.
    pid_m = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1).to(tl.int64)
    pid_bh = tl.program_id(2).to(tl.int64)
    b = pid_bh // HK
    hk = pid_bh % HK
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_j = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < NQ
    d_ok = offs_d < D
    t = SHIFT + offs_m
    t_hi = SHIFT + tl.minimum(pid_m * BLOCK_M + BLOCK_M, NQ) - 1
    j0 = pid_s * BLOCK_S
    j1 = tl.minimum(j0 + BLOCK_S, NS)
    # compressed blocks overlapping selection blocks [j0, j1): i*s + l > j0*l' and i*s < j1*l';
    # and visible to the last row of the tile: i*s + l - 1 <= t_hi
    x = j0 * SEL - CMP_L
    c_start = tl.where(x >= 0, x // CMP_S + 1, 0) // BLOCK_C * BLOCK_C
    c_end = tl.minimum((j1 * SEL + CMP_S - 1) // CMP_S, NC)
    c_end = tl.minimum(c_end, tl.where(t_hi >= CMP_L - 1, (t_hi - CMP_L + 1) // CMP_S + 1, 0))
    kc_base = KC + b * skb + hk * skh
    acc = tl.full([BLOCK_M, BLOCK_S], 0.0, tl.float32)
    for start_c in range(c_start, c_end, BLOCK_C):
        offs_c = start_c + tl.arange(0, BLOCK_C)
        c_ok = offs_c < NC
        kc = tl.load(kc_base + offs_c[:, None] * skn + offs_d[None, :],
                     mask=c_ok[:, None] & d_ok[None, :], other=0.0).to(CDT)
        visible = m_ok[:, None] & c_ok[None, :] & (offs_c[None, :] * CMP_S + CMP_L - 1 <= t[:, None])
        p_sum = tl.full([BLOCK_M, BLOCK_C], 0.0, tl.float32)
        for g in range(0, GROUP):
            h = hk * GROUP + g
            q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                        mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(CDT)
            lse = tl.load(Lse + (b * HQ + h) * NQ + offs_m, mask=m_ok, other=float("-inf"))
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
            s = tl.dot(q, tl.trans(kc), input_precision=DOT) * qk_scale
            p_sum += tl.where(visible, tl.math.exp2(s - lse2[:, None]), 0.0)
        c_lo = offs_c * CMP_S
        overlap = (c_lo[:, None] < (offs_j[None, :] + 1) * SEL) & (offs_j[None, :] * SEL < c_lo[:, None] + CMP_L)
        # exact fp32: the scores feed a top-k, keep them as close to the reference as possible
        acc += tl.dot(p_sum, overlap.to(tl.float32), input_precision="ieee")
    own = t // SEL
    jj = offs_j[None, :]
    forced = (jj < INIT) | ((jj > own[:, None] - LOCAL) & (jj <= own[:, None]))
    acc = tl.where(forced, float("inf"), acc)
    acc = tl.where(jj * SEL > t[:, None], float("-inf"), acc)  # the future wins over forcing
    tl.store(Out + (pid_bh * NQ + offs_m[:, None]) * NS + jj, acc, mask=m_ok[:, None] & (jj < NS))


# (query rows, compressed blocks, selection blocks) per tile; every one >= 16 for tl.dot. None: 32
# each (16 for fp32 with d > 128: 96 KB of shared memory at 32). A module attribute so that tests
# can shrink it to reach several tiles at tiny sizes.
_SCORE_BLOCKS = None


def selection_scores(q, k_cmp, lse_cmp, *, scale=None, compress_block: int = 32, compress_stride: int = 16,
                     select_block: int = 64, kv_len: int, init_blocks: int = 1, local_blocks: int = 2):
    """Importance of every selection block for every query position: float32 [b, hk, nq, ns].

    ns = ceil(kv_len / select_block). Score of block j at position t = sum over the query heads of
    the GQA group of exp(scale q.k_cmp_i - lse_cmp) over the compressed blocks i visible at t that
    overlap block j. The first ``init_blocks`` blocks and the ``local_blocks`` blocks ending with
    t's own block get +inf; blocks starting after t get -inf (also when they would be forced).
    No gradient.
    """
    if q.dim() != 4 or k_cmp.dim() != 4 or q.shape[1] % k_cmp.shape[1] or q.shape[-1] != k_cmp.shape[-1]:
        raise ValueError(f"selection_scores: bad shapes q {tuple(q.shape)}, k_cmp {tuple(k_cmp.shape)}")
    B, HQ, NQ, D = q.shape
    HK, NC = k_cmp.shape[1], k_cmp.shape[2]
    kv_len = int(kv_len)
    if NQ > kv_len or tuple(lse_cmp.shape) != (B, HQ, NQ):
        raise ValueError(f"selection_scores: need q_len <= kv_len and lse_cmp [b, hq, nq]; got {NQ}, {kv_len}, "
                         f"{tuple(lse_cmp.shape)}")
    l, s, sel = int(compress_block), int(compress_stride), int(select_block)
    ns = math.ceil(kv_len / sel)
    out = torch.empty(B, HK, NQ, ns, device=q.device, dtype=torch.float32)
    if NQ == 0 or ns == 0:
        return out
    with torch.no_grad():
        q, k_cmp = prep(q.detach()), prep(k_cmp.detach())
        lse_cmp = lse_cmp.detach().float().contiguous()
        block_d = max(16, triton.next_power_of_2(D))
        big = q.dtype in (torch.float32, torch.float64) and block_d > 128 and not interpreted(q.device)
        bm, bc, bs = _SCORE_BLOCKS or ((16, 16, 16) if big else (32, 32, 32))
        grid = (triton.cdiv(NQ, bm), triton.cdiv(ns, bs), B * HK)
        _scores_kernel[grid](q, k_cmp, lse_cmp, out, *q.stride()[:3], *k_cmp.stride()[:3],
                             HQ, HK, HQ // HK, NQ, NC, ns, D, kv_len - NQ, l, s, sel,
                             int(init_blocks), int(local_blocks), _scale(scale, D) * LOG2E,
                             **_compute(q), BLOCK_M=bm, BLOCK_C=bc, BLOCK_S=bs, BLOCK_D=block_d)
    return out


# --------------------------------------------------------------------------------------------------
# selected attention (group-centric)
# --------------------------------------------------------------------------------------------------
#
# Key tiles are gathered from the selection: a tile holds SLOTS selected blocks x BLOCK_N keys of
# each (key r of the tile: slot r // BLOCK_N, offset r % BLOCK_N inside the block), and the loop runs
# over slot chunks and over the BLOCK_N-key sub-tiles of a block. On a GPU SLOTS = 1 (a tile is one
# BLOCK_N-key piece of one block); in the interpreter all slots and a whole block go in one tile, because
# there the cost is per Triton operation, not per element. Empty slots (-1), keys after the query
# and keys past kv_len are masked out of the tile (they are never loaded).

@triton.jit
def _sel_fwd_kernel(Q, K, V, Idx, O, Lse,
                    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
                    HQ, HK, GROUP, NQ, NK, D, S, SHIFT, SEL, qk_scale,
                    CDT: tl.constexpr, DOT: tl.constexpr, SLOTS: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per (query position, batch x KV head): the rows of the tile are the g query heads
    # of the group at that position, so each selected K/V block is read once for the whole group.
    i = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // HK
    hk = pid_bh % HK
    t = SHIFT + i
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, SLOTS * BLOCK_N)
    k_slot = offs_k // BLOCK_N
    k_off = offs_k % BLOCK_N
    g_ok = offs_g < GROUP
    d_ok = offs_d < D
    h = hk * GROUP + offs_g
    gd_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h[:, None] * sqh + i * sqm + offs_d[None, :], mask=gd_mask, other=0.0).to(CDT)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    idx_base = Idx + (pid_bh * NQ + i) * S
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    for s0 in range(0, S, SLOTS):
        slot = s0 + k_slot
        j = tl.load(idx_base + slot, mask=slot < S, other=-1).to(tl.int64)
        for n0 in range(0, SEL, BLOCK_N):
            w = n0 + k_off
            kpos = j * SEL + w
            # causal inside the current block, the ragged tail, empty slots
            k_ok = (j >= 0) & (w < SEL) & (kpos <= t) & (kpos < NK)
            kd_mask = k_ok[:, None] & d_ok[None, :]
            kt = tl.load(k_base + kpos[:, None] * skn + offs_d[None, :], mask=kd_mask, other=0.0).to(CDT)
            vt = tl.load(v_base + kpos[:, None] * svn + offs_d[None, :], mask=kd_mask, other=0.0).to(CDT)
            s = tl.dot(q, tl.trans(kt), input_precision=DOT) * qk_scale  # log2 domain
            s = tl.where(g_ok[:, None] & k_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, max_combine))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.reduce(p, 1, sum_combine)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT)
            m_i = m_new
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(O + b * sob + h[:, None] * soh + i * som + offs_d[None, :], out.to(O.dtype.element_ty), mask=gd_mask)
    tl.store(Lse + (b * HQ + h) * NQ + i, lse, mask=g_ok)


@triton.jit
def _sel_bwd_dq_kernel(Q, K, V, Idx, DO, Lse, Delta, DQ,
                       sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm, sgb, sgh, sgm,
                       HQ, HK, GROUP, NQ, NK, D, S, SHIFT, SEL, qk_scale, scale,
                       CDT: tl.constexpr, DOT: tl.constexpr, SLOTS: tl.constexpr, BLOCK_G: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # dQ of the group's heads at one position: the forward's loop again, with P from the saved LSE
    i = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // HK
    hk = pid_bh % HK
    t = SHIFT + i
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, SLOTS * BLOCK_N)
    k_slot = offs_k // BLOCK_N
    k_off = offs_k % BLOCK_N
    g_ok = offs_g < GROUP
    d_ok = offs_d < D
    h = hk * GROUP + offs_g
    gd_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h[:, None] * sqh + i * sqm + offs_d[None, :], mask=gd_mask, other=0.0).to(CDT)
    do = tl.load(DO + b * sdb + h[:, None] * sdh + i * sdm + offs_d[None, :], mask=gd_mask, other=0.0).to(CDT)
    rows = (b * HQ + h) * NQ + i
    lse = tl.load(Lse + rows, mask=g_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # empty rows: p = 0
    delta = tl.load(Delta + rows, mask=g_ok, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    idx_base = Idx + (pid_bh * NQ + i) * S
    dq = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    for s0 in range(0, S, SLOTS):
        slot = s0 + k_slot
        j = tl.load(idx_base + slot, mask=slot < S, other=-1).to(tl.int64)
        for n0 in range(0, SEL, BLOCK_N):
            w = n0 + k_off
            kpos = j * SEL + w
            k_ok = (j >= 0) & (w < SEL) & (kpos <= t) & (kpos < NK)
            kd_mask = k_ok[:, None] & d_ok[None, :]
            kt = tl.load(k_base + kpos[:, None] * skn + offs_d[None, :], mask=kd_mask, other=0.0).to(CDT)
            vt = tl.load(v_base + kpos[:, None] * svn + offs_d[None, :], mask=kd_mask, other=0.0).to(CDT)
            s = tl.dot(q, tl.trans(kt), input_precision=DOT) * qk_scale
            p = tl.where(g_ok[:, None] & k_ok[None, :], tl.math.exp2(s - lse2[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(vt), input_precision=DOT)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(kt.dtype), kt, input_precision=DOT)
    tl.store(DQ + b * sgb + h[:, None] * sgh + i * sgm + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=gd_mask)


@triton.jit
def _sel_bwd_dkdv_kernel(Q, K, V, DO, Lse, Delta, Users, UserStart, DK, DV,
                         sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm, sgb, sgh, sgn,
                         HQ, HK, GROUP, NQ, NK, NS, D, SHIFT, SEL, USERS_PER_TILE, qk_scale, scale,
                         CDT: tl.constexpr, DOT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    # One program per (key sub-tile of a selection block, batch x KV head x block): it walks the
    # query positions that selected the block (inverted index) and owns its dK/dV rows. A row tile
    # holds several (position, head) pairs: row r is head r % g of user r // g, so the group's heads
    # share the K/V tile and small groups still fill the tile (no per-position padding to 16).
    # the many (batch x KV head x block) cells on grid axis 0 (axes 1 and 2 stop at 65535)
    pid = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    j = pid % NS
    pid_bh = pid // NS
    b = pid_bh // HK
    hk = pid_bh % HK
    u0 = tl.load(UserStart + pid)
    u1 = tl.load(UserStart + pid + 1)
    w = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = j * SEL + w
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = (w < SEL) & (offs_n < NK)
    d_ok = offs_d < D
    kd_mask = n_ok[:, None] & d_ok[None, :]
    kt = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :], mask=kd_mask, other=0.0).to(CDT)
    vt = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :], mask=kd_mask, other=0.0).to(CDT)
    dk = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    dv = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    r_user = offs_r // GROUP
    h = hk * GROUP + offs_r % GROUP
    for ub in range(u0, u1, USERS_PER_TILE):
        u = ub + r_user
        r_ok = (r_user < USERS_PER_TILE) & (u < u1)
        i = tl.load(Users + u, mask=r_ok, other=0).to(tl.int64)
        rd_mask = r_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + b * sqb + h[:, None] * sqh + i[:, None] * sqm + offs_d[None, :],
                    mask=rd_mask, other=0.0).to(CDT)
        do = tl.load(DO + b * sdb + h[:, None] * sdh + i[:, None] * sdm + offs_d[None, :], mask=rd_mask,
                     other=0.0).to(CDT)
        rows = (b * HQ + h) * NQ + i
        lse = tl.load(Lse + rows, mask=r_ok, other=0.0)
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        delta = tl.load(Delta + rows, mask=r_ok, other=0.0)
        s = tl.dot(q, tl.trans(kt), input_precision=DOT) * qk_scale
        visible = r_ok[:, None] & n_ok[None, :] & (offs_n[None, :] <= SHIFT + i[:, None])
        p = tl.where(visible, tl.math.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(vt), input_precision=DOT)
        ds = p * (dp - delta[:, None])
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT)
    g_off = b * sgb + hk * sgh + offs_n[:, None] * sgn + offs_d[None, :]
    tl.store(DK + g_off, (dk * scale).to(DK.dtype.element_ty), mask=kd_mask)
    tl.store(DV + g_off, dv.to(DV.dtype.element_ty), mask=kd_mask)


def _sel_blocks(d: int, group: int, sel: int, slots: int, q: torch.Tensor) -> dict:
    """Tile sizes of the selected-attention kernels (every tl.dot dimension >= 16)."""
    block_d = max(16, triton.next_power_of_2(d))
    block_g = max(16, triton.next_power_of_2(group))  # tl.dot needs >= 16 rows: pad with masked heads
    if interpreted(q.device):
        # few, large tiles: the interpreter pays per operation; one tile of every slot x a whole block
        block_n = max(16, min(128, triton.next_power_of_2(sel)))
        n_slots = max(1, min(triton.next_power_of_2(max(slots, 1)), 256 // block_n))
        block_r = max(64, block_g)
    else:
        block = _gpu_block(q.dtype, block_d)
        block_n = max(16, min(block, triton.next_power_of_2(sel)))
        n_slots = 1
        block_r = max(block, block_g)
    return dict(SLOTS=n_slots, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_R=block_r)


def _users(idx: torch.Tensor, ns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverted index: for every (batch x KV head, block) the query positions that selected it.

    Returns (users, start): users[start[c]:start[c + 1]] are the positions of cell c = bh * ns + j,
    in increasing order (a stable sort), so the dK/dV sums run in a fixed order: deterministic.
    """
    B, HK, NQ, S = idx.shape
    pos = torch.arange(NQ, device=idx.device).view(1, 1, NQ, 1).expand(B, HK, NQ, S)
    bh = torch.arange(B * HK, device=idx.device).view(B, HK, 1, 1).expand(B, HK, NQ, S)
    valid = (idx >= 0) & (idx < ns)
    cell = (bh * ns + idx.long())[valid]
    order = torch.sort(cell, stable=True).indices
    users = pos[valid][order].to(torch.int32).contiguous()
    counts = torch.bincount(cell, minlength=B * HK * ns)
    start = torch.zeros(B * HK * ns + 1, device=idx.device, dtype=torch.int32)
    start[1:] = torch.cumsum(counts, 0)
    return users, start


class _SelectedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, idx, scale, sel, kv_len):
        q, k, v = prep(q), prep(k), prep(v)
        B, HQ, NQ, D = q.shape
        HK = k.shape[1]
        S = idx.shape[-1]
        blk = _sel_blocks(D, HQ // HK, sel, S, q)
        o = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        lse = torch.empty(B, HQ, NQ, device=q.device, dtype=torch.float32)
        if NQ:
            _sel_fwd_kernel[(NQ, B * HK)](
                q, k, v, idx, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
                HQ, HK, HQ // HK, NQ, kv_len, D, S, kv_len - NQ, sel, scale * LOG2E,
                **_compute(q), SLOTS=blk["SLOTS"], BLOCK_G=blk["BLOCK_G"], BLOCK_N=blk["BLOCK_N"],
                BLOCK_D=blk["BLOCK_D"])
        ctx.save_for_backward(q, k, v, idx, o, lse)
        ctx.scale, ctx.sel, ctx.kv_len = scale, sel, kv_len
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, idx, o, lse = ctx.saved_tensors
        scale, sel, kv_len = ctx.scale, ctx.sel, ctx.kv_len
        B, HQ, NQ, D = q.shape
        HK = k.shape[1]
        G = HQ // HK
        S = idx.shape[-1]
        ns = triton.cdiv(kv_len, sel)
        do = torch.zeros_like(o) if do is None else do.to(o.dtype).contiguous()
        delta = row_delta(do, o, dlse)
        dq = torch.zeros(q.shape, device=q.device, dtype=q.dtype)
        # zeros: keys nobody selected (and cache rows past kv_len) get no program
        dk = torch.zeros(k.shape, device=k.device, dtype=k.dtype)
        dv = torch.zeros(v.shape, device=v.device, dtype=v.dtype)
        if NQ == 0 or ns == 0 or S == 0:
            return dq, dk, dv, None, None, None, None
        blk = _sel_blocks(D, G, sel, S, q)
        strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
        _sel_bwd_dq_kernel[(NQ, B * HK)](
            q, k, v, idx, do, lse, delta, dq, *strides, *dq.stride()[:3],
            HQ, HK, G, NQ, kv_len, D, S, kv_len - NQ, sel, scale * LOG2E, scale,
            **_compute(q), SLOTS=blk["SLOTS"], BLOCK_G=blk["BLOCK_G"], BLOCK_N=blk["BLOCK_N"], BLOCK_D=blk["BLOCK_D"])
        users, start = _users(idx, ns)
        _sel_bwd_dkdv_kernel[(B * HK * ns, triton.cdiv(sel, blk["BLOCK_N"]))](
            q, k, v, do, lse, delta, users, start, dk, dv, *strides, *dk.stride()[:3],
            HQ, HK, G, NQ, kv_len, ns, D, kv_len - NQ, sel, blk["BLOCK_R"] // G, scale * LOG2E, scale,
            **_compute(q), BLOCK_R=blk["BLOCK_R"], BLOCK_N=blk["BLOCK_N"], BLOCK_D=blk["BLOCK_D"])
        return dq, dk, dv, None, None, None, None


def selected_attention(q, k, v, idx, *, scale=None, select_block: int = 64, kv_len: int | None = None):
    """Attention of every query over the key blocks selected for its position: (out, lse float32).

    idx [b, hk, nq, S] int64/int32: selection block ids per query position, shared by the query
    heads of one GQA group; -1 marks an empty slot (ids must not repeat within a row: a repeated
    block would count twice). Query t sees the keys of its blocks at positions <= t (causal inside
    its own block) and < kv_len. Differentiable in q, k, v (out and lse); deterministic backward.
    """
    kv_len = k.shape[2] if kv_len is None else int(kv_len)
    _check(q, k, v, kv_len, "selected_attention")
    B, HQ, NQ, _ = q.shape
    HK = k.shape[1]
    if idx.dim() != 4 or tuple(idx.shape[:3]) != (B, HK, NQ):
        raise ValueError(f"selected_attention: idx must be [b, hk, nq, S] = [{B}, {HK}, {NQ}, S]; "
                         f"got {tuple(idx.shape)}")
    if kv_len > k.shape[2] or select_block < 1:
        raise ValueError(f"selected_attention: need kv_len <= k.shape[2] ({k.shape[2]}) and select_block >= 1; "
                         f"got {kv_len}, {select_block}")
    idx = idx.detach().to(device=q.device, dtype=torch.int32).contiguous()
    return _SelectedAttention.apply(q, k, v, idx, _scale(scale, q.shape[-1]), int(select_block), kv_len)


__all__ = ["compressed_attention", "selection_scores", "selected_attention", "window_attention"]
