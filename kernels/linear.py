"""Triton kernel: chunked causal linear attention in feature space (forward and backward).

Serves ``linear`` and ``performer`` (both reduce to it once queries and keys are feature-mapped):
query i gets num_i = Σ_{j<=i} (q'_i·k'_j) v_j + q'_i S0 and den_i = Σ_{j<=i} q'_i·k'_j + q'_i·z0.

One program owns one (batch, query head, block of features, block of value columns) and walks the
sequence in chunks of BLOCK_T rows, keeping its block of the running state S [BLOCK_M, BLOCK_DV]
and z [BLOCK_M] in registers:

    chunk part:  (Q'_c K'_cᵀ ∘ causal mask) V_c        (a BLOCK_T x BLOCK_T tile, exact)
    state part:  Q'_c S                                  (everything before the chunk)
    then         S += K'_cᵀ V_c,  z += Σ K'_c

Both parts are linear in the features, so the feature dimension splits into independent blocks:
each program writes a partial numerator (and denominator) for its feature block, and the host sums
the few partials. That keeps the state tile small enough for registers at m = 256 and gives the
GPU b·hq·(m/BLOCK_M)·(dv/BLOCK_DV) programs. GQA: query head h reads KV head h // group (K/V
features are never repeated in memory; the state is recomputed per query head, which costs the
same as the chunk part).

The readable PyTorch twin is ``longpatch.methods.linear.causal_prefix_reference``; tests pair them
under ``TRITON_INTERPRET=1``. The backward reuses the same kernel three times (``_CausalPrefix``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import mm


@triton.jit
def _causal_prefix_kernel(Qf, Kf, V, S0, Z0, Num, Den,
                          sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
                          ssb, ssh, ssm, szb, szh,
                          snp, snb, snh, snt, sdp, sdb, sdh,
                          H, QDIV, KDIV, T, M, DV,
                          HAS_INIT: tl.constexpr, WRITE_DEN: tl.constexpr, PREC: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_v = tl.program_id(2)
    # program head h (output head) reads query-side head h // QDIV and key/value-side head h // KDIV:
    # (1, group) in the forward; the backward passes swap the roles (see _CausalPrefix)
    b = pid_bh // H
    h = pid_bh % H
    hq = h // QDIV
    hk = h // KDIV
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    offs_t0 = tl.arange(0, BLOCK_T)
    m_ok = offs_m < M
    v_ok = offs_v < DV
    if HAS_INIT:
        S = tl.load(S0 + b * ssb + hk * ssh + offs_m[:, None] * ssm + offs_v[None, :],
                    mask=m_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        z = tl.load(Z0 + b * szb + hk * szh + offs_m, mask=m_ok, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        z = tl.zeros([BLOCK_M], tl.float32)
    q_base = Qf + b * sqb + hq * sqh
    k_base = Kf + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    num_base = Num + pid_m * snp + b * snb + h * snh
    den_base = Den + pid_m * sdp + b * sdb + h * sdh
    for start in range(0, T, BLOCK_T):
        offs_t = start + offs_t0
        t_ok = offs_t < T
        q = tl.load(q_base + offs_t[:, None] * sqt + offs_m[None, :], mask=t_ok[:, None] & m_ok[None, :], other=0.0)
        k = tl.load(k_base + offs_t[:, None] * skt + offs_m[None, :], mask=t_ok[:, None] & m_ok[None, :], other=0.0)
        v = tl.load(v_base + offs_t[:, None] * svt + offs_v[None, :], mask=t_ok[:, None] & v_ok[None, :],
                    other=0.0).to(tl.float32)
        scores = mm(q, tl.trans(k), PREC)
        scores = tl.where(offs_t0[:, None] >= offs_t0[None, :], scores, 0.0)  # padded keys carry zero features
        num = mm(scores, v, PREC) + mm(q, S, PREC)
        tl.store(num_base + offs_t[:, None] * snt + offs_v[None, :], num, mask=t_ok[:, None] & v_ok[None, :])
        if WRITE_DEN and pid_v == 0:  # the denominator does not depend on the value block: one program writes it
            den = tl.sum(scores, 1) + tl.sum(q * z[None, :], 1)
            tl.store(den_base + offs_t, den, mask=t_ok)
        S += mm(tl.trans(k), v, PREC)
        z += tl.sum(k, 0)


def _pow2_at_least_16(x: int, cap: int) -> int:
    return min(cap, max(16, triton.next_power_of_2(x)))


def _launch(qf, kf, v, s0, z0, heads: int, qdiv: int, kdiv: int, want_den: bool):
    """One kernel pass over ``heads`` output heads; returns (num [b, heads, n, dv], den or None)."""
    b, n, m = qf.shape[0], qf.shape[2], qf.shape[3]
    dv = v.shape[-1]
    qf, kf, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (qf, kf, v))
    bt, bm, bv = 64, _pow2_at_least_16(m, 64), _pow2_at_least_16(dv, 64)
    n_mb = triton.cdiv(m, bm)
    num = torch.empty(n_mb, b, heads, n, dv, device=qf.device, dtype=torch.float32)
    den = torch.empty(n_mb, b, heads, n, device=qf.device, dtype=torch.float32) if want_den else \
        torch.empty(1, 1, 1, 1, device=qf.device, dtype=torch.float32)
    has_init = s0 is not None
    if has_init:
        s0 = s0.float().contiguous()
        z0 = (z0 if z0 is not None else s0.new_zeros(s0.shape[:3])).float().contiguous()
        ss, sz = s0.stride()[:3], z0.stride()[:2]
    else:
        s0 = z0 = torch.empty(1, device=qf.device, dtype=torch.float32)
        ss, sz = (0, 0, 0), (0, 0)
    grid = (b * heads, n_mb, triton.cdiv(dv, bv))
    _causal_prefix_kernel[grid](qf, kf, v, s0, z0, num, den,
                                qf.stride(0), qf.stride(1), qf.stride(2), kf.stride(0), kf.stride(1), kf.stride(2),
                                v.stride(0), v.stride(1), v.stride(2), *ss, *sz,
                                *num.stride()[:4], *den.stride()[:3],
                                heads, qdiv, kdiv, n, m, dv,
                                HAS_INIT=has_init, WRITE_DEN=want_den, PREC=1, BLOCK_T=bt, BLOCK_M=bm, BLOCK_DV=bv)
    num = num[0] if n_mb == 1 else num.sum(0)
    if not want_den:
        return num, None
    return num, (den[0] if n_mb == 1 else den.sum(0))


def _group_sum(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, hq, ...] -> [b, kv_heads, ...]: the gradients of a KV head summed over its query heads."""
    b, hq = x.shape[:2]
    return x.view(b, kv_heads, hq // kv_heads, *x.shape[2:]).sum(2)


class _CausalPrefix(torch.autograd.Function):
    """Forward: one kernel pass. Backward: three more passes of the SAME kernel, because every
    gradient is again a causal (or, on the reversed sequence, anti-causal) linear attention. With
    V' = [V, 1] and dO' = [dnum, dden] (the denominator is the ones column):

        dQ'_i = Σ_{j<=i} (dO'_i·V'_j) K'_j + dO'_i S0'ᵀ      causal: queries dO', keys V', values K'
        dK'_j = Σ_{i>=j} (V'_j·dO'_i) Q'_i                     reversed: queries V', keys dO', values Q'
        dV'_j = Σ_{i>=j} (K'_j·Q'_i) dO'_i                     reversed: queries K', keys Q', values dO'
        dS0'  = Σ_i Q'_iᵀ dO'_i

    In the two reversed passes the query side is per KV head and the key side per query head (the
    kernel's QDIV/KDIV head mapping); their per-query-head results are summed over each group.
    """

    @staticmethod
    def forward(ctx, qf, kf, v, s0, z0):
        hq, hk = qf.shape[1], kf.shape[1]
        qf, kf = qf.float(), kf.float()
        num, den = _launch(qf, kf, v, s0, z0, hq, 1, hq // hk, True)
        if s0 is not None:  # the state as the dQ pass needs it: [S0, z0]ᵀ  [b, hk, dv+1, m]
            z = z0 if z0 is not None else s0.new_zeros(s0.shape[:3])
            s0 = torch.cat([s0.float(), z.float().unsqueeze(-1)], -1).transpose(-1, -2)
        ctx.save_for_backward(qf, kf, v, s0)
        ctx.z_given, ctx.v_dtype = z0 is not None, v.dtype
        return num, den

    @staticmethod
    def backward(ctx, dnum, dden):
        qf, kf, v, s0t = ctx.saved_tensors
        hq, hk = qf.shape[1], kf.shape[1]
        g = hq // hk
        dnum = torch.zeros_like(qf[..., :1]).expand(*qf.shape[:3], v.shape[-1]) if dnum is None else dnum
        dden = qf.new_zeros(qf.shape[:3]) if dden is None else dden
        do = torch.cat([dnum.float(), dden.float().unsqueeze(-1)], -1)  # [b, hq, n, dv+1]
        va = torch.cat([v.float(), v.new_ones(*v.shape[:3], 1, dtype=torch.float32)], -1)  # [b, hk, n, dv+1]
        dq, _ = _launch(do, va, kf, s0t, None, hq, 1, g, False)  # the prefix state adds dO' S0'ᵀ
        rev = lambda t: t.flip(2)  # noqa: E731  (anti-causal = causal on the reversed sequence)
        dk, _ = _launch(rev(va), rev(do), rev(qf), None, None, hq, g, 1, False)
        dva, _ = _launch(rev(kf), rev(qf), rev(do), None, None, hq, g, 1, False)
        dk, dva = _group_sum(rev(dk), hk), _group_sum(rev(dva), hk)
        ds0 = dz0 = None
        if s0t is not None:
            # the prefix state is seen by every query: its gradient is Σ_i Q'_iᵀ dO'_i per KV head
            b, n, m = qf.shape[0], qf.shape[2], qf.shape[3]
            qg = qf.view(b, hk, g * n, m) if qf.is_contiguous() else qf.reshape(b, hk, g * n, m)
            ds_all = torch.matmul(qg.transpose(-1, -2), do.reshape(b, hk, g * n, -1))  # [b, hk, m, dv+1]
            ds0, dz0 = ds_all[..., :-1], (ds_all[..., -1] if ctx.z_given else None)
        return dq, dk, dva[..., :-1].to(ctx.v_dtype), ds0, dz0


def causal_prefix_attention(qf, kf, v, s0=None, z0=None):
    """Causal linear attention in feature space with the Triton kernel (differentiable).

    qf [b, hq, n, m], kf [b, hk, n, m] (features, computed in float32), v [b, hk, n, dv] (any
    float dtype), optional prefix state s0 [b, hk, m, dv], z0 [b, hk, m] seen by every query.
    Query i sees keys j <= i of the square. Returns (num [b, hq, n, dv], den [b, hq, n]) float32,
    like ``causal_prefix_reference``.
    """
    b, hq, n, m = qf.shape
    hk = kf.shape[1]
    if kf.shape != (b, hk, n, m) or v.shape[:3] != (b, hk, n) or hq % hk:
        raise ValueError(f"causal_prefix_attention: bad shapes qf {tuple(qf.shape)}, kf {tuple(kf.shape)}, "
                         f"v {tuple(v.shape)}")
    return _CausalPrefix.apply(qf, kf, v, s0, z0)


__all__ = ["causal_prefix_attention"]
