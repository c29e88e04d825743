"""FlashAttention-style Triton kernels (forward + backward) returning the log-sum-exp.

One kernel family serves every attention call longpatch makes on CUDA:

* exact attention: ``flash_attention(q, k, v, causal=..., scale=...)``, any q_len / kv_len (masked
  tails), causal masks aligned bottom-right (the queries are the last q_len positions), GQA by index
  mapping (query head h reads KV head h // (q_heads / kv_heads); K/V are never repeated);
* HyperAttention's blocks: each sorted query block attends to its key block plus the sampled
  columns, gathered as one short key sequence, with an additive per-key ``key_bias`` that masks
  padding and own-block samples (-inf) and weights the other samples (log N_out/m_out).

The LSE is an output with a gradient: the backward uses dS = P * (dP - delta) with
delta = rowsum(dO * O) - dLSE, so partial attentions merged by their LSEs train correctly.

The readable PyTorch twin is ``longpatch.methods.hyper.attention_lse_reference``; tests pair the two
under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .common import LOG2E, mm, prep, row_delta


@triton.jit
def _fwd_kernel(Q, K, V, Bias, O, Lse,
                sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som, sbb, sbh,
                HQ, GROUP, LQ, LK, D, qk_scale,
                CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    d_ok = offs_d < D
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                mask=(offs_m < LQ)[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    shift = LK - LQ  # bottom-right alignment: query i sees keys j <= i + shift
    end_n = LK
    if CAUSAL:
        end_n = tl.minimum(LK, (pid_m + 1) * BLOCK_M + shift)
    for start_n in range(0, end_n, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < LK
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = mm(q, tl.trans(k), PREC) * qk_scale  # log2 domain
        if HAS_BIAS:
            bias = tl.load(Bias + b * sbb + hk * sbh + offs_n, mask=n_ok, other=0.0)
            s = s + bias[None, :] * 1.4426950408889634
        visible = n_ok[None, :] & (offs_m[:, None] >= 0)
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + shift)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, PREC)
        m_i = m_new
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0.0, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    m_ok = offs_m < LQ
    tl.store(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
    tl.store(Lse + pid_bh * LQ + offs_m, lse, mask=m_ok)


@triton.jit
def _bwd_dq_kernel(Q, K, V, Bias, DO, Lse, Delta, DQ,
                   sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm, sbb, sbh, sgb, sgh, sgm,
                   HQ, GROUP, LQ, LK, D, qk_scale, scale,
                   CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    d_ok = offs_d < D
    m_ok = offs_m < LQ
    qd_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=qd_mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :], mask=qd_mask, other=0.0)
    lse = tl.load(Lse + pid_bh * LQ + offs_m, mask=m_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # empty rows: p = 0
    delta = tl.load(Delta + pid_bh * LQ + offs_m, mask=m_ok, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    shift = LK - LQ
    end_n = LK
    if CAUSAL:
        end_n = tl.minimum(LK, (pid_m + 1) * BLOCK_M + shift)
    for start_n in range(0, end_n, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < LK
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = mm(q, tl.trans(k), PREC) * qk_scale
        dp = mm(do, tl.trans(v), PREC)
        if HAS_BIAS:
            bias = tl.load(Bias + b * sbb + hk * sbh + offs_n, mask=n_ok, other=0.0)
            s = s + bias[None, :] * 1.4426950408889634
        visible = n_ok[None, :] & m_ok[:, None]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + shift)
        p = tl.where(visible, tl.math.exp2(s - lse2[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        dq += mm(ds.to(k.dtype), k, PREC)
    dq = dq * scale
    tl.store(DQ + b * sgb + h * sgh + offs_m[:, None] * sgm + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=qd_mask)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, Bias, DO, Lse, Delta, DK, DV,
                     sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm, sbb, sbh, sgb, sgh, sgn,
                     HQ, HK, GROUP, LQ, LK, D, qk_scale, scale,
                     CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per key tile of one KV head: it visits the query tiles of every query head of the
    # group (GQA without repeating K/V) and accumulates dK, dV in registers.
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HK
    hk = pid_bh % HK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_m0 = tl.arange(0, BLOCK_M)
    d_ok = offs_d < D
    n_ok = offs_n < LK
    kd_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :], mask=kd_mask, other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :], mask=kd_mask, other=0.0)
    if HAS_BIAS:
        bias = tl.load(Bias + b * sbb + hk * sbh + offs_n, mask=n_ok, other=0.0) * 1.4426950408889634
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    shift = LK - LQ
    start_m = 0
    if CAUSAL:
        start_m = tl.maximum(0, pid_n * BLOCK_N - shift) // BLOCK_M * BLOCK_M
    for g in range(0, GROUP):
        h = hk * GROUP + g
        row = (b * HQ + h) * LQ
        for s_m in range(start_m, LQ, BLOCK_M):
            offs_m = s_m + offs_m0
            m_ok = offs_m < LQ
            qd_mask = m_ok[:, None] & d_ok[None, :]
            q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=qd_mask, other=0.0)
            do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :], mask=qd_mask, other=0.0)
            lse = tl.load(Lse + row + offs_m, mask=m_ok, other=0.0)
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
            delta = tl.load(Delta + row + offs_m, mask=m_ok, other=0.0)
            s = mm(q, tl.trans(k), PREC) * qk_scale
            dp = mm(do, tl.trans(v), PREC)
            if HAS_BIAS:
                s = s + bias[None, :]
            visible = n_ok[None, :] & m_ok[:, None]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + shift)
            p = tl.where(visible, tl.math.exp2(s - lse2[:, None]), 0.0)
            ds = p * (dp - delta[:, None])
            dv += mm(tl.trans(p.to(do.dtype)), do, PREC)
            dk += mm(tl.trans(ds.to(q.dtype)), q, PREC)
    dk = dk * scale
    # dK and dV are fresh contiguous tensors of the same shape: one set of strides serves both
    g_off = b * sgb + hk * sgh + offs_n[:, None] * sgn + offs_d[None, :]
    tl.store(DK + g_off, dk.to(DK.dtype.element_ty), mask=kd_mask)
    tl.store(DV + g_off, dv.to(DV.dtype.element_ty), mask=kd_mask)


def _blocks(d: int) -> tuple[int, int, int]:
    block_d = max(16, triton.next_power_of_2(d))
    block = 64 if block_d <= 64 else 32  # keep the tiles within shared memory for d = 128/256
    return block, block, block_d


def _prec(q: torch.Tensor) -> int:
    if q.dtype == torch.float32 or q.dtype == torch.float64:
        return 1
    return 2 if os.environ.get("TRITON_INTERPRET") == "1" else 0


def _bias_args(bias, B, HK, LK, device):
    if bias is None:
        return torch.empty(1, device=device, dtype=torch.float32), 0, 0, False
    bias = bias.to(device=device, dtype=torch.float32)
    if bias.dim() != 3:
        raise ValueError(f"key_bias must be [batch, kv_heads or 1, kv_len]; got {tuple(bias.shape)}")
    bias = bias.expand(B, HK, LK)
    if bias.stride(-1) != 1:
        bias = bias.contiguous()
    return bias, bias.stride(0), bias.stride(1), True


def _forward(q, k, v, bias, causal, scale):
    B, HQ, LQ, D = q.shape
    HK, LK = k.shape[1], k.shape[2]
    o = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, HQ, LQ, device=q.device, dtype=torch.float32)
    bias_t, sbb, sbh, has_bias = _bias_args(bias, B, HK, LK, q.device)
    bm, bn, bd = _blocks(D)
    grid = (triton.cdiv(LQ, bm), B * HQ)
    _fwd_kernel[grid](q, k, v, bias_t, o, lse,
                      q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                      v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2), sbb, sbh,
                      HQ, HQ // HK, LQ, LK, D, scale * LOG2E,
                      CAUSAL=causal, HAS_BIAS=has_bias, PREC=_prec(q),
                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd)
    return o, lse


def _backward(q, k, v, bias, o, lse, do, dlse, causal, scale):
    B, HQ, LQ, D = q.shape
    HK, LK = k.shape[1], k.shape[2]
    do = do.contiguous()
    delta = row_delta(do, o, dlse)
    # fresh contiguous gradients: q, k, v may be strided views with gaps (empty_like would not
    # reproduce their strides then)
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    bias_t, sbb, sbh, has_bias = _bias_args(bias, B, HK, LK, q.device)
    bm, bn, bd = _blocks(D)
    common = dict(CAUSAL=causal, HAS_BIAS=has_bias, PREC=_prec(q), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2), sbb, sbh)
    _bwd_dq_kernel[(triton.cdiv(LQ, bm), B * HQ)](q, k, v, bias_t, do, lse, delta, dq, *strides, *dq.stride()[:3],
                                                  HQ, HQ // HK, LQ, LK, D, scale * LOG2E, scale, **common)
    _bwd_dkdv_kernel[(triton.cdiv(LK, bn), B * HK)](q, k, v, bias_t, do, lse, delta, dk, dv, *strides, *dk.stride()[:3],
                                                    HQ, HK, HQ // HK, LQ, LK, D, scale * LOG2E, scale, **common)
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, causal, scale):
        q, k, v = prep(q), prep(k), prep(v)
        o, lse = _forward(q, k, v, bias, causal, scale)
        ctx.save_for_backward(q, k, v, bias, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, bias, o, lse = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = _backward(q, k, v, bias, o, lse, do.to(o.dtype), dlse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None


def flash_attention(q, k, v, *, causal: bool, scale: float | None = None, return_lse: bool = False,
                    key_bias: torch.Tensor | None = None):
    """softmax(q kᵀ · scale + key_bias) v with a FlashAttention-style Triton kernel.

    q [b, q_heads, q_len, d], k/v [b, kv_heads, kv_len, d] (kv_heads divides q_heads; no repeat),
    ``key_bias`` optional float [b, kv_heads or 1, kv_len] (additive, -inf masks a key), causal
    aligned bottom-right. Returns out (q.dtype) and, with ``return_lse``, the float32 LSE
    [b, q_heads, q_len] (-inf, with a zero output, on rows that see no key). Differentiable in q, k,
    v through both outputs.
    """
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"flash_attention: bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"flash_attention: q_heads ({q.shape[1]}) must be a multiple of kv_heads ({k.shape[1]})")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, lse = _FlashAttention.apply(q, k, v, key_bias, bool(causal), scale)
    return (o, lse) if return_lse else o


__all__ = ["flash_attention"]
