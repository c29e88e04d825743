"""Sliding-window + global-token attention in Triton (forward with LSE, backward), for ``method: sparse``.

The key set of a query at position p is the global prefix [0, G) (causal: keys <= p) plus its
(dilated) window keys at positions >= G: with dilation r, the window lives in the residue class of
p modulo r, where it is the contiguous band [s - lo, s + hi] of subsequence indices s (position =
c + r*s; lo = window-1, hi = 0 causal, lo = hi = window//2 non-causal). One launch per residue
class c (one launch when r = 1): a program owns BLOCK_M query rows of the class and runs one
online softmax over

1. the key tiles of the global prefix, then
2. the key tiles of the band of its rows (from max(kmin, s_first - lo) to s_last + hi),

so it reads only O(G + window + BLOCK_M) keys whatever the sequence length. Rows, keys and outputs
are addressed by position with the tensors' strides (no copies of the strided classes, no repeat
of K/V for GQA: query head h reads KV head h // group).

Random blocks and the full rows of non-causal global queries are added in PyTorch by
``longpatch.methods.sparse`` and merged by LSE.

Backward (the LSE has a gradient too: delta = rowsum(dO * O) - dLSE, dS = P * (dP - delta)): dQ per
query tile with the forward's loops; dK/dV per key tile, accumulated in registers over the query
rows that see the tile, for every query head of the KV group. The key tiles partition the keys (the
global prefix; the band keys >= G of each residue class), so no atomics are needed. A global key
tile is seen by every query row, so its program loops over all rows: O(n * G) work in total.

The readable twin is ``longpatch.methods.sparse._torch_sparse`` (random_blocks = 0);
tests pair the two under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import LOG2E, dot, interpreted, row_delta, softmax_step


@triton.jit
def _fwd_kernel(Q, K, V, O, Lse,
                sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
                HQ, GROUP, NQ, I0, MQ, S0, NS, KMIN, LO, HI, NG, POS_C, R, OFF, D, qk_scale,
                CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    hk = h // GROUP
    u = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # index among the class's query rows
    u_ok = u < MQ
    row = I0 + R * u  # query row in q
    s = S0 + u  # subsequence index of the query in its class
    pos = OFF + row  # absolute position (bottom-right alignment)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(Q + b * sqb + h * sqh + row[:, None] * sqm + offs_d[None, :],
                mask=u_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    offs_n0 = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # 1. the global prefix [0, NG)
    g_end = NG
    if CAUSAL:
        g_end = tl.minimum(NG, tl.max(tl.where(u_ok, pos, -1), axis=0) + 1)
    for start in range(0, g_end, BLOCK_N):
        j = start + offs_n0
        j_ok = j < NG
        visible = u_ok[:, None] & j_ok[None, :]
        if CAUSAL:
            visible = visible & (j[None, :] <= pos[:, None])
        kmask = j_ok[:, None] & d_ok[None, :]
        m_i, l_i, acc = softmax_step(q, k_base + j[:, None] * skn + offs_d[None, :],
                                      v_base + j[:, None] * svn + offs_d[None, :], kmask, visible,
                                      m_i, l_i, acc, qk_scale, UPCAST)
    # 2. the band of this tile's rows, keys >= G only (subsequence indices >= KMIN)
    s_first = S0 + pid_m * BLOCK_M
    s_last = S0 + tl.minimum(pid_m * BLOCK_M + BLOCK_M, MQ) - 1
    b_start = tl.maximum(KMIN, s_first - LO)
    b_end = tl.minimum(NS, s_last + HI + 1)
    for start in range(b_start, b_end, BLOCK_N):
        t = start + offs_n0
        t_ok = t < b_end
        kpos = POS_C + R * t
        visible = u_ok[:, None] & t_ok[None, :] & (t[None, :] >= s[:, None] - LO) & (t[None, :] <= s[:, None] + HI)
        kmask = t_ok[:, None] & d_ok[None, :]
        m_i, l_i, acc = softmax_step(q, k_base + kpos[:, None] * skn + offs_d[None, :],
                                      v_base + kpos[:, None] * svn + offs_d[None, :], kmask, visible,
                                      m_i, l_i, acc, qk_scale, UPCAST)
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    tl.store(O + b * sob + h * soh + row[:, None] * som + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=u_ok[:, None] & d_ok[None, :])
    tl.store(Lse + pid_bh * NQ + row, lse, mask=u_ok)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, Lse, Delta, DQ,
                   sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                   HQ, GROUP, NQ, I0, MQ, S0, NS, KMIN, LO, HI, NG, POS_C, R, OFF, D, qk_scale, scale,
                   CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # dQ of BLOCK_M query rows of one residue class: the forward's key loops with P recomputed
    # from the final LSE, dS = P * (dP - delta), delta = rowsum(dO * O) - dLSE.
    # DO, Lse, Delta and DQ are contiguous [b, hq, nq, (d)].
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    hk = h // GROUP
    u = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    u_ok = u < MQ
    row = I0 + R * u
    s = S0 + u
    pos = OFF + row
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    rd_ok = u_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + row[:, None] * sqm + offs_d[None, :], mask=rd_ok, other=0.0)
    g_off = (pid_bh * NQ + row)[:, None] * D + offs_d[None, :]
    do = tl.load(DO + g_off, mask=rd_ok, other=0.0)
    lse = tl.load(Lse + pid_bh * NQ + row, mask=u_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # empty rows: p = 0
    delta = tl.load(Delta + pid_bh * NQ + row, mask=u_ok, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    offs_n0 = tl.arange(0, BLOCK_N)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    g_end = NG
    if CAUSAL:
        g_end = tl.minimum(NG, tl.max(tl.where(u_ok, pos, -1), axis=0) + 1)
    for start in range(0, g_end, BLOCK_N):
        j = start + offs_n0
        j_ok = j < NG
        visible = u_ok[:, None] & j_ok[None, :]
        if CAUSAL:
            visible = visible & (j[None, :] <= pos[:, None])
        kmask = j_ok[:, None] & d_ok[None, :]
        kt = tl.load(k_base + j[:, None] * skn + offs_d[None, :], mask=kmask, other=0.0)
        vt = tl.load(v_base + j[:, None] * svn + offs_d[None, :], mask=kmask, other=0.0)
        p = tl.where(visible, tl.exp2(dot(q, tl.trans(kt), UPCAST) * qk_scale - lse2[:, None]), 0.0)
        ds = p * (dot(do.to(vt.dtype), tl.trans(vt), UPCAST) - delta[:, None])
        dq += dot(ds.to(kt.dtype), kt, UPCAST)
    s_first = S0 + pid_m * BLOCK_M
    s_last = S0 + tl.minimum(pid_m * BLOCK_M + BLOCK_M, MQ) - 1
    b_end = tl.minimum(NS, s_last + HI + 1)
    for start in range(tl.maximum(KMIN, s_first - LO), b_end, BLOCK_N):
        t = start + offs_n0
        t_ok = t < b_end
        kpos = POS_C + R * t
        visible = u_ok[:, None] & t_ok[None, :] & (t[None, :] >= s[:, None] - LO) & (t[None, :] <= s[:, None] + HI)
        kmask = t_ok[:, None] & d_ok[None, :]
        kt = tl.load(k_base + kpos[:, None] * skn + offs_d[None, :], mask=kmask, other=0.0)
        vt = tl.load(v_base + kpos[:, None] * svn + offs_d[None, :], mask=kmask, other=0.0)
        p = tl.where(visible, tl.exp2(dot(q, tl.trans(kt), UPCAST) * qk_scale - lse2[:, None]), 0.0)
        ds = p * (dot(do.to(vt.dtype), tl.trans(vt), UPCAST) - delta[:, None])
        dq += dot(ds.to(kt.dtype), kt, UPCAST)
    tl.store(DQ + g_off, dq * scale, mask=rd_ok)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, Lse, Delta, DK, DV,
                     sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                     HQ, HK, GROUP, NQ, NK, I0, MQ, S0, T0, NT, LO, HI, POS_C, R, OFF, D, qk_scale, scale,
                     GLOBAL: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # dK, dV of one key tile of one KV head, accumulated in registers over the query rows of every
    # head of its group that see the tile (no atomics: the tiles partition the keys).
    # GLOBAL: the tile is global keys [T0 + pid*BLOCK_N, ...) < NT, seen by every query row (causal:
    # rows at positions >= the key). Else: band keys of residue class POS_C, subsequence indices
    # t < NT, seen by the class's rows s in [t - HI, t + LO]. DK/DV are contiguous [b, hk, nk, d].
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HK
    hk = pid_bh % HK
    t = T0 + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = t < NT
    if GLOBAL:
        kpos = t
    else:
        kpos = POS_C + R * t
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kd_ok = t_ok[:, None] & d_ok[None, :]
    kt = tl.load(K + b * skb + hk * skh + kpos[:, None] * skn + offs_d[None, :], mask=kd_ok, other=0.0)
    vt = tl.load(V + b * svb + hk * svh + kpos[:, None] * svn + offs_d[None, :], mask=kd_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    t_first = T0 + pid_n * BLOCK_N
    if GLOBAL:  # query rows i (all classes) at positions OFF + i
        u_start = 0
        if CAUSAL:
            u_start = tl.maximum(0, t_first - OFF)
        u_end = NQ
    else:  # query rows u of the class, subsequence index S0 + u
        u_start = tl.maximum(0, t_first - HI - S0)
        u_end = tl.minimum(MQ, t_first + BLOCK_N - 1 + LO - S0 + 1)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * HQ + h
        for u0 in range(u_start, u_end, BLOCK_M):
            u = u0 + tl.arange(0, BLOCK_M)
            u_ok = u < u_end
            if GLOBAL:
                row = u
            else:
                row = I0 + R * u
            rd_ok = u_ok[:, None] & d_ok[None, :]
            q = tl.load(Q + b * sqb + h * sqh + row[:, None] * sqm + offs_d[None, :], mask=rd_ok, other=0.0)
            g_off = (bh * NQ + row)[:, None] * D + offs_d[None, :]
            do = tl.load(DO + g_off, mask=rd_ok, other=0.0)
            lse = tl.load(Lse + bh * NQ + row, mask=u_ok, other=0.0)
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
            delta = tl.load(Delta + bh * NQ + row, mask=u_ok, other=0.0)
            visible = u_ok[:, None] & t_ok[None, :]
            if GLOBAL:
                if CAUSAL:
                    visible = visible & (kpos[None, :] <= (OFF + row)[:, None])
            else:
                sq = S0 + u
                visible = visible & (t[None, :] >= sq[:, None] - LO) & (t[None, :] <= sq[:, None] + HI)
            p = tl.where(visible, tl.exp2(dot(q, tl.trans(kt), UPCAST) * qk_scale - lse2[:, None]), 0.0)
            dv += dot(tl.trans(p).to(do.dtype), do, UPCAST)
            ds = p * (dot(do.to(vt.dtype), tl.trans(vt), UPCAST) - delta[:, None])
            dk += dot(tl.trans(ds).to(q.dtype), q, UPCAST)
    out_off = ((b * HK + hk) * NK + kpos)[:, None] * D + offs_d[None, :]
    tl.store(DK + out_off, dk * scale, mask=kd_ok)
    tl.store(DV + out_off, dv, mask=kd_ok)


def _blocks(q) -> tuple[int, int]:
    if interpreted(q.device):
        return 32, 32  # the interpreter pays per program: few, moderate tiles
    if q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 64:
        return 64, 64
    # fp32 ("ieee" dots) and wide heads: 64-row tiles need > 100 KB of shared memory in the
    # backward (compiled for sm_80), more than many GPUs have per block
    return 32, 32


def _upcast(q) -> bool:
    return q.dtype in (torch.float32, torch.float64) or interpreted(q.device)


def _classes(nq: int, nk: int, window: int, global_tokens: int, dilation: int, causal: bool):
    """Per residue class c of the dilation (one class when r = 1): (c, i0, mq, s0, ns, kmin, lo, hi)
    = first query row of the class, its number of rows, the subsequence index of that row, the
    class's number of keys, its first key index at a position >= G, and the band (lo, hi)."""
    off = nk - nq
    r = dilation
    lo, hi = (window - 1, 0) if causal else (window // 2, window // 2)
    for c in range(r):
        i0 = (c - off) % r  # first query row whose position is = c (mod r)
        if i0 >= nq:
            continue
        yield (c, i0, -(-(nq - i0) // r), (off + i0 - c) // r, max(0, -(-(nk - c) // r)),
               max(0, -(-(global_tokens - c) // r)), lo, hi)


def _forward(q, k, v, window, global_tokens, dilation, causal, scale):
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((b, hq, nq), float("-inf"), dtype=torch.float32, device=q.device)
    bm, bn = _blocks(q)
    for c, i0, mq, s0, ns, kmin, lo, hi in _classes(nq, nk, window, global_tokens, dilation, causal):
        _fwd_kernel[(triton.cdiv(mq, bm), b * hq)](
            q, k, v, out, lse,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            hq, hq // hk, nq, i0, mq, s0, ns, kmin, lo, hi, min(global_tokens, nk), c, dilation, nk - nq, d,
            scale * LOG2E, CAUSAL=bool(causal), UPCAST=_upcast(q), BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_D=max(16, triton.next_power_of_2(d)))
    return out, lse


def _backward(q, k, v, out, lse, dout, dlse, window, global_tokens, dilation, causal, scale):
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    dout = dout.contiguous()
    delta, lse = row_delta(dout, out, dlse), lse.contiguous()
    dq = torch.zeros((b, hq, nq, d), dtype=torch.float32, device=q.device)
    dk = torch.zeros((b, hk, nk, d), dtype=torch.float32, device=q.device)
    dv = torch.zeros((b, hk, nk, d), dtype=torch.float32, device=q.device)
    bm, bn = _blocks(q)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2))
    meta = dict(CAUSAL=bool(causal), UPCAST=_upcast(q), BLOCK_M=bm, BLOCK_N=bn,
                BLOCK_D=max(16, triton.next_power_of_2(d)))
    ng, off = min(global_tokens, nk), nk - nq
    for c, i0, mq, s0, ns, kmin, lo, hi in _classes(nq, nk, window, global_tokens, dilation, causal):
        _bwd_dq_kernel[(triton.cdiv(mq, bm), b * hq)](
            q, k, v, dout, lse, delta, dq, *strides,
            hq, hq // hk, nq, i0, mq, s0, ns, kmin, lo, hi, ng, c, dilation, off, d, scale * LOG2E, scale, **meta)
        if ns > kmin:  # the class's band keys (positions >= G)
            _bwd_dkdv_kernel[(triton.cdiv(ns - kmin, bn), b * hk)](
                q, k, v, dout, lse, delta, dk, dv, *strides,
                hq, hk, hq // hk, nq, nk, i0, mq, s0, kmin, ns, lo, hi, c, dilation, off, d, scale * LOG2E,
                scale, GLOBAL=False, **meta)
    if ng > 0:  # the global keys, seen by rows of every class
        _bwd_dkdv_kernel[(triton.cdiv(ng, bn), b * hk)](
            q, k, v, dout, lse, delta, dk, dv, *strides,
            hq, hk, hq // hk, nq, nk, 0, nq, 0, 0, ng, 0, 0, 0, 1, off, d, scale * LOG2E,
            scale, GLOBAL=True, **meta)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _WindowGlobal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, window, global_tokens, dilation, causal, scale):
        out, lse = _forward(q, k, v, window, global_tokens, dilation, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (window, global_tokens, dilation, causal, scale)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _backward(q, k, v, out, lse, dout, dlse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def window_global_attention(q, k, v, *, window: int, global_tokens: int, dilation: int, causal: bool,
                            scale: float):
    """(out [b, hq, nq, d] in q.dtype, lse [b, hq, nq] float32) of every query over its global keys
    [0, G) (causal: <= p) and its (dilated) window keys at positions >= G. Rows that see no key get
    lse = -inf and zeros. Differentiable in q, k, v through out and lse."""
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("window_global_attention needs the head dim contiguous (stride 1)")
    return _WindowGlobal.apply(q, k, v, int(window), int(global_tokens), int(dilation), bool(causal), float(scale))


__all__ = ["window_global_attention"]
