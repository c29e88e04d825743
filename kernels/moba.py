"""Block-sparse attention for MoBA in Triton: forward with LSE, backward for fine-tuning.

The work list comes from ``longpatch.methods.moba.selection_pairs``: one *pair* per (query row,
selected chunk), own chunk included, sorted so that the pairs of one (batch, KV head, chunk) form a
contiguous *segment*. A segment is a varlen attention problem: a set of gathered query rows (any
query head of the KV group, any position) against one contiguous key range. Per pair the kernels
compute the partial softmax attention over that chunk (out, lse); PyTorch then merges the parts of
each row by their LSEs (exact softmax over the union), which is differentiable.

* forward: one program per tile of BLOCK_M pair rows of one segment; loops over the segment's key
  blocks with an online softmax; causal pairs see keys <= their query position.
* backward: dQ per pair (programs over row tiles, like the forward) and dK/dV per key block
  (programs over (segment, key block), looping over the segment's rows). A key block belongs to
  exactly one segment, so dK/dV need no atomics. The LSE gets a gradient: with
  delta = rowsum(dO * O) - dLSE, dS = P * (dP - delta).

The readable PyTorch twin is ``longpatch.methods.moba.pairs_attention_reference``; tests pair the
two under ``TRITON_INTERPRET=1`` (kernels on CPU tensors).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import LOG2E, dot, interpreted, row_delta, softmax_step


@triton.jit
def _row_addr(row, HQ, NQ, sb, sh, sm):
    # flat query row (b * HQ + h) * NQ + i -> element offset of that row in a strided [b, h, n, d] tensor
    i = row % NQ
    bh = row // NQ
    return (bh // HQ) * sb + (bh % HQ) * sh + i * sm


@triton.jit
def _fwd_kernel(Q, K, V, Row, Pos, TileSeg, TileRow, SegEnd, SegKv, SegK0, SegK1, Out, Lse,
                sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                HQ, HK, NQ, D, qk_scale,
                CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    seg = tl.load(TileSeg + pid)
    r0 = tl.load(TileRow + pid)
    r_end = tl.load(SegEnd + seg)
    kv = tl.load(SegKv + seg)
    k0 = tl.load(SegK0 + seg)
    k1 = tl.load(SegK1 + seg)
    offs_r = r0 + tl.arange(0, BLOCK_M)
    r_ok = offs_r < r_end
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    row = tl.load(Row + offs_r, mask=r_ok, other=0)
    qpos = tl.load(Pos + offs_r, mask=r_ok, other=-1)
    q = tl.load(Q + _row_addr(row, HQ, NQ, sqb, sqh, sqm)[:, None] + offs_d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + (kv // HK) * skb + (kv % HK) * skh
    v_base = V + (kv // HK) * svb + (kv % HK) * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = k1
    if CAUSAL:
        end = tl.minimum(k1, tl.max(qpos, axis=0) + 1)
    for start in range(k0, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < k1
        visible = r_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= qpos[:, None])
        m_i, l_i, acc = softmax_step(q, k_base + offs_n[:, None] * skn + offs_d[None, :],
                                      v_base + offs_n[:, None] * svn + offs_d[None, :], n_ok[:, None] & d_ok[None, :],
                                      visible, m_i, l_i, acc, qk_scale, UPCAST)
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    tl.store(Out + offs_r[:, None] * D + offs_d[None, :], out, mask=r_ok[:, None] & d_ok[None, :])
    tl.store(Lse + offs_r, lse, mask=r_ok)


@triton.jit
def _bwd_dq_kernel(Q, K, V, Row, Pos, TileSeg, TileRow, SegEnd, SegKv, SegK0, SegK1, DO, Lse, Delta, DQ,
                   sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                   HQ, HK, NQ, D, qk_scale, scale,
                   CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    seg = tl.load(TileSeg + pid)
    r0 = tl.load(TileRow + pid)
    r_end = tl.load(SegEnd + seg)
    kv = tl.load(SegKv + seg)
    k0 = tl.load(SegK0 + seg)
    k1 = tl.load(SegK1 + seg)
    offs_r = r0 + tl.arange(0, BLOCK_M)
    r_ok = offs_r < r_end
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    rd_ok = r_ok[:, None] & d_ok[None, :]
    row = tl.load(Row + offs_r, mask=r_ok, other=0)
    qpos = tl.load(Pos + offs_r, mask=r_ok, other=-1)
    q = tl.load(Q + _row_addr(row, HQ, NQ, sqb, sqh, sqm)[:, None] + offs_d[None, :], mask=rd_ok, other=0.0)
    do = tl.load(DO + offs_r[:, None] * D + offs_d[None, :], mask=rd_ok, other=0.0)
    lse2 = tl.load(Lse + offs_r, mask=r_ok, other=0.0) * 1.4426950408889634
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
    delta = tl.load(Delta + offs_r, mask=r_ok, other=0.0)
    k_base = K + (kv // HK) * skb + (kv % HK) * skh
    v_base = V + (kv // HK) * svb + (kv % HK) * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = k1
    if CAUSAL:
        end = tl.minimum(k1, tl.max(qpos, axis=0) + 1)
    for start in range(k0, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < k1
        kt = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        vt = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = dot(q, tl.trans(kt), UPCAST) * qk_scale
        visible = r_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= qpos[:, None])
        p = tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)
        dp = dot(do.to(vt.dtype), tl.trans(vt), UPCAST)
        ds = p * (dp - delta[:, None])
        dq += dot(ds.to(kt.dtype), kt, UPCAST)
    tl.store(DQ + offs_r[:, None] * D + offs_d[None, :], dq * scale, mask=rd_ok)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, Row, Pos, BlkSeg, BlkStart, SegStart, SegEnd, SegKv, SegK1, DO, Lse, Delta, DK, DV,
                     sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdkb, sdkh, sdkn,
                     HQ, HK, NQ, D, qk_scale, scale,
                     CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    seg = tl.load(BlkSeg + pid)
    n0 = tl.load(BlkStart + pid)
    s0 = tl.load(SegStart + seg)
    s1 = tl.load(SegEnd + seg)
    kv = tl.load(SegKv + seg)
    k1 = tl.load(SegK1 + seg)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < k1
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    nd_ok = n_ok[:, None] & d_ok[None, :]
    bk = kv // HK
    hk = kv % HK
    kt = tl.load(K + bk * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :], mask=nd_ok, other=0.0)
    vt = tl.load(V + bk * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :], mask=nd_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for r0 in range(s0, s1, BLOCK_M):
        offs_r = r0 + tl.arange(0, BLOCK_M)
        r_ok = offs_r < s1
        rd_ok = r_ok[:, None] & d_ok[None, :]
        row = tl.load(Row + offs_r, mask=r_ok, other=0)
        qpos = tl.load(Pos + offs_r, mask=r_ok, other=-1)
        q = tl.load(Q + _row_addr(row, HQ, NQ, sqb, sqh, sqm)[:, None] + offs_d[None, :], mask=rd_ok, other=0.0)
        do = tl.load(DO + offs_r[:, None] * D + offs_d[None, :], mask=rd_ok, other=0.0)
        lse2 = tl.load(Lse + offs_r, mask=r_ok, other=0.0) * 1.4426950408889634
        lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
        delta = tl.load(Delta + offs_r, mask=r_ok, other=0.0)
        s = dot(q, tl.trans(kt), UPCAST) * qk_scale  # [M, N]
        visible = r_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= qpos[:, None])
        p = tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)
        dv += dot(tl.trans(p).to(do.dtype), do, UPCAST)
        dp = dot(do.to(vt.dtype), tl.trans(vt), UPCAST)
        ds = p * (dp - delta[:, None])
        dk += dot(tl.trans(ds).to(q.dtype), q, UPCAST)
    out_off = bk * sdkb + hk * sdkh + offs_n[:, None] * sdkn + offs_d[None, :]
    tl.store(DK + out_off, dk * scale, mask=nd_ok)
    tl.store(DV + out_off, dv, mask=nd_ok)


def _blocks(device):
    if interpreted(device):
        return 32, 32  # the interpreter pays per program: few, moderate tiles
    return 64, 64


def _tiles(starts: torch.Tensor, ends: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment id, start) of every block of `block` items of every segment [starts, ends)."""
    counts = torch.div(ends - starts + block - 1, block, rounding_mode="floor")
    seg = torch.repeat_interleave(torch.arange(starts.numel(), device=starts.device), counts)
    first = torch.cumsum(counts, 0) - counts
    local = torch.arange(seg.numel(), device=starts.device) - first[seg]
    return seg.contiguous(), (starts[seg] + local * block).contiguous()


def _upcast(q) -> bool:
    return q.dtype == torch.float32 or interpreted(q.device)


class _PairsAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pairs, scale, causal):
        d = q.shape[-1]
        P = pairs["row"].numel()
        out = torch.empty(P, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(P, dtype=torch.float32, device=q.device)
        bm, bn = _blocks(q.device)
        tseg, trow = _tiles(pairs["seg_start"], pairs["seg_end"], bm)
        if tseg.numel():
            _fwd_kernel[(tseg.numel(),)](
                q, k, v, pairs["row"], pairs["pos"], tseg, trow, pairs["seg_end"], pairs["seg_kv"],
                pairs["seg_k0"], pairs["seg_k1"], out, lse,
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2),
                q.shape[1], k.shape[1], q.shape[2], d, scale * LOG2E,
                CAUSAL=causal, UPCAST=_upcast(q), BLOCK_M=bm, BLOCK_N=bn,
                BLOCK_D=max(16, triton.next_power_of_2(d)))
        ctx.save_for_backward(q, k, v, out, lse, tseg, trow, *(pairs[n] for n in _PAIR_KEYS))
        ctx.scale, ctx.causal = scale, causal
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, tseg, trow, *rest = ctx.saved_tensors
        pairs = dict(zip(_PAIR_KEYS, rest))
        d = q.shape[-1]
        dout = torch.zeros_like(out) if dout is None else dout.float().contiguous()
        delta = row_delta(dout, out, dlse)  # out is float32 here (the pairs' outputs)
        bm, bn = _blocks(q.device)
        common = dict(CAUSAL=ctx.causal, UPCAST=_upcast(q), BLOCK_M=bm, BLOCK_N=bn,
                      BLOCK_D=max(16, triton.next_power_of_2(d)))
        strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                   v.stride(0), v.stride(1), v.stride(2))
        dq_p = torch.zeros_like(out)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        if tseg.numel():
            _bwd_dq_kernel[(tseg.numel(),)](
                q, k, v, pairs["row"], pairs["pos"], tseg, trow, pairs["seg_end"], pairs["seg_kv"],
                pairs["seg_k0"], pairs["seg_k1"], dout, lse, delta, dq_p, *strides,
                q.shape[1], k.shape[1], q.shape[2], d, ctx.scale * LOG2E, ctx.scale, **common)
            bseg, bstart = _tiles(pairs["seg_k0"], pairs["seg_k1"], bn)
            _bwd_dkdv_kernel[(bseg.numel(),)](
                q, k, v, pairs["row"], pairs["pos"], bseg, bstart, pairs["seg_start"], pairs["seg_end"],
                pairs["seg_kv"], pairs["seg_k1"], dout, lse, delta, dk, dv, *strides,
                dk.stride(0), dk.stride(1), dk.stride(2),
                q.shape[1], k.shape[1], q.shape[2], d, ctx.scale * LOG2E, ctx.scale, **common)
        dq = torch.zeros(q.numel() // d, d, dtype=torch.float32, device=q.device).index_add_(0, pairs["row"], dq_p)
        return dq.view(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


_PAIR_KEYS = ("row", "pos", "seg_start", "seg_end", "seg_kv", "seg_k0", "seg_k1")


def pairs_attention(q, k, v, pairs: dict, *, scale: float, causal: bool):
    """Partial attention of every (query row, chunk) pair: (out [P, d] float32, lse [P] float32).

    q [b, hq, nq, d], k/v [b, hk, nk, d] (last dim contiguous), ``pairs`` from
    ``longpatch.methods.moba.selection_pairs``. Differentiable in q, k, v (out and lse)."""
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("pairs_attention needs the head dim contiguous (stride 1)")
    pairs = {n: pairs[n].contiguous() for n in _PAIR_KEYS}
    return _PairsAttention.apply(q, k, v, pairs, float(scale), bool(causal))
