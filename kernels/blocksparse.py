"""The block-sparse executor in Triton: forward with LSE and backward, the twin of
``longpatch.methods.blocksparse.block_sparse_prefill``.

What it computes: causal prefill (q_len == kv_len = n) where query row t of query block i
(positions [i*block, (i+1)*block)) attends to every key of the past key blocks listed for it in
``blocks`` [b, kv_heads, n_blocks, S] (int64; -1 pads; entries j < i, no duplicates) and to the keys
of its own block i at positions <= t. The query heads of a KV group (GQA: query head h uses KV head
h // (hq // hk)) share their group's list. Returns out [b, hq, n, d] (q's dtype) and the natural
log-sum-exp of the scaled scores, lse [b, hq, n] float32.

* grid: (n_blocks * tiles_per_block, b * hq). A program owns one tile of up to BLOCK_M query rows
  of one query block of one (batch, query head) (a block no larger than the tile is one tile; a
  larger one is split into several). It runs an online softmax (base 2, fp32 accumulators) over its
  listed key blocks, in tiles of BLOCK_N keys, then over its own block up to the tile's last row
  with the causal mask, and writes out and lse. The wrapper sorts each list descending, so a list's
  c real entries sit in its first c slots and the kernel loops over exactly those (padding costs
  nothing; an empty list means only the diagonal block).
* backward: one kernel on the same grid revisits the same key tiles. With p = exp(s - lse),
  dP = dO Vᵀ and D = rowsum(dO * O) - dLSE, dS = P * (dP - D) (so a gradient into lse flows too).
  dQ accumulates in registers and is stored once; dK += dSᵀ Q · scale and dV += Pᵀ dO are added
  with ``tl.atomic_add`` into float32 buffers [b, hk, n, d] (a key block is read by many query
  blocks and by every query head of its group), cast to k/v's dtype at the end.

Limits: no decode path (``block_sparse_decode`` stays in torch); q_len must equal kv_len; the lists
are trusted (entries must be j < i and distinct: the kernel does not check them); head dims up to
256 (any size: loads pad to a power of two >= 16 with masks); the atomics make dK/dV
non-deterministic in the order of their fp32 additions on a GPU. Under ``TRITON_INTERPRET=1`` (CPU
tensors) dots are computed in fp32 (the interpreter's half-precision dots are not trustworthy), as
they are for fp32 inputs on a GPU (no tf32).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import LOG2E, dot, interpreted, prep, row_delta, softmax_step

_MAX_TILE = 64  # rows/keys per tile; a block larger than this is split into several tiles
_MAX_D = 256


@triton.jit
def _tile(pid_bh, HQ, GROUP, N, BLK, TPB, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    # the program's tile, shared by the forward and backward kernels: query block i, the tile's first
    # row t0 inside it, batch b, query head h and its KV head hk, the tile's rows and their masks
    pid = tl.program_id(0)
    i = pid // TPB
    t0 = (pid % TPB) * BLOCK_M
    b = pid_bh // HQ
    h = pid_bh % HQ
    loc_m = t0 + tl.arange(0, BLOCK_M)
    offs_m = i * BLK + loc_m
    offs_d = tl.arange(0, BLOCK_D)
    return i, t0, b, h, h // GROUP, loc_m, offs_m, (loc_m < BLK) & (offs_m < N), offs_d, offs_d < D


@triton.jit
def _fwd_kernel(Q, K, V, Blocks, Counts, O, Lse,
                sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
                HQ, HK, GROUP, N, NB, S, BLK, TPB, D, qk_scale,
                UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_bh = tl.program_id(1)
    i, t0, b, h, hk, loc_m, offs_m, m_ok, offs_d, d_ok = _tile(pid_bh, HQ, GROUP, N, BLK, TPB, D, BLOCK_M, BLOCK_D)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    list_base = (b * HK + hk) * NB + i
    cnt = tl.load(Counts + list_base)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    loc_n0 = tl.arange(0, BLOCK_N)
    # listed past blocks: every key visible
    for s in range(0, cnt):
        j = tl.load(Blocks + list_base * S + s)
        for off in range(0, BLK, BLOCK_N):
            loc_n = off + loc_n0
            offs_n = j * BLK + loc_n
            n_ok = (loc_n < BLK) & (offs_n < N)
            kmask = n_ok[:, None] & d_ok[None, :]
            m_i, l_i, acc = softmax_step(q, k_base + offs_n[:, None] * skn + offs_d[None, :],
                                         v_base + offs_n[:, None] * svn + offs_d[None, :], kmask,
                                         m_ok[:, None] & n_ok[None, :], m_i, l_i, acc, qk_scale, UPCAST)
    # own block, causal: keys up to this tile's last row
    end = tl.minimum(BLK, t0 + BLOCK_M)
    for off in range(0, end, BLOCK_N):
        loc_n = off + loc_n0
        offs_n = i * BLK + loc_n
        n_ok = (loc_n < BLK) & (offs_n < N)
        kmask = n_ok[:, None] & d_ok[None, :]
        visible = m_ok[:, None] & n_ok[None, :] & (loc_n[None, :] <= loc_m[:, None])
        m_i, l_i, acc = softmax_step(q, k_base + offs_n[:, None] * skn + offs_d[None, :],
                                     v_base + offs_n[:, None] * svn + offs_d[None, :], kmask,
                                     visible, m_i, l_i, acc, qk_scale, UPCAST)
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
    tl.store(Lse + pid_bh * N + offs_m, lse, mask=m_ok)


@triton.jit
def _bwd_tile(q, do, lse2, delta, dq, k_base, v_base, dk_base, dv_base, offs_n, n_ok, d_ok, offs_d, visible,
              skn, svn, sgn, qk_scale, scale, UPCAST: tl.constexpr):
    # one key tile of the backward: returns the updated dQ, adds this tile's dK/dV atomically
    kmask = n_ok[:, None] & d_ok[None, :]
    kt = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=kmask, other=0.0)
    vt = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=kmask, other=0.0)
    s = dot(q, tl.trans(kt), UPCAST) * qk_scale
    p = tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)
    dp = dot(do, tl.trans(vt), UPCAST)
    ds = p * (dp - delta[:, None])
    dq += dot(ds.to(kt.dtype), kt, UPCAST)
    dk = dot(tl.trans(ds).to(q.dtype), q, UPCAST) * scale
    dv = dot(tl.trans(p).to(do.dtype), do, UPCAST)
    g_off = offs_n[:, None] * sgn + offs_d[None, :]
    tl.atomic_add(dk_base + g_off, dk, mask=kmask)
    tl.atomic_add(dv_base + g_off, dv, mask=kmask)
    return dq


@triton.jit
def _bwd_kernel(Q, K, V, Blocks, Counts, DO, Lse, Delta, DQ, DK, DV,
                sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm, sqgb, sqgh, sqgm, sgb, sgh, sgn,
                HQ, HK, GROUP, N, NB, S, BLK, TPB, D, qk_scale, scale,
                UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # DQ, DK, DV: float32 [b, h, n, d] buffers with a unit last stride (DQ with hq heads, DK/DV with
    # hk heads); (sqgb, sqgh, sqgm) are DQ's strides, (sgb, sgh, sgn) DK's and DV's
    pid_bh = tl.program_id(1)
    i, t0, b, h, hk, loc_m, offs_m, m_ok, offs_d, d_ok = _tile(pid_bh, HQ, GROUP, N, BLK, TPB, D, BLOCK_M, BLOCK_D)
    qd_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=qd_mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :], mask=qd_mask, other=0.0)
    lse = tl.load(Lse + pid_bh * N + offs_m, mask=m_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # empty rows: p = 0
    delta = tl.load(Delta + pid_bh * N + offs_m, mask=m_ok, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    dk_base = DK + b * sgb + hk * sgh
    dv_base = DV + b * sgb + hk * sgh
    list_base = (b * HK + hk) * NB + i
    cnt = tl.load(Counts + list_base)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    loc_n0 = tl.arange(0, BLOCK_N)
    for s in range(0, cnt):
        j = tl.load(Blocks + list_base * S + s)
        for off in range(0, BLK, BLOCK_N):
            loc_n = off + loc_n0
            offs_n = j * BLK + loc_n
            n_ok = (loc_n < BLK) & (offs_n < N)
            dq = _bwd_tile(q, do, lse2, delta, dq, k_base, v_base, dk_base, dv_base, offs_n, n_ok, d_ok, offs_d,
                           m_ok[:, None] & n_ok[None, :], skn, svn, sgn, qk_scale, scale, UPCAST)
    end = tl.minimum(BLK, t0 + BLOCK_M)
    for off in range(0, end, BLOCK_N):
        loc_n = off + loc_n0
        offs_n = i * BLK + loc_n
        n_ok = (loc_n < BLK) & (offs_n < N)
        visible = m_ok[:, None] & n_ok[None, :] & (loc_n[None, :] <= loc_m[:, None])
        dq = _bwd_tile(q, do, lse2, delta, dq, k_base, v_base, dk_base, dv_base, offs_n, n_ok, d_ok, offs_d,
                       visible, skn, svn, sgn, qk_scale, scale, UPCAST)
    tl.store(DQ + b * sqgb + h * sqgh + offs_m[:, None] * sqgm + offs_d[None, :], dq * scale, mask=qd_mask)


def _tiles(block: int, d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, tiles per query block)."""
    tile = min(_MAX_TILE, max(16, triton.next_power_of_2(block)))
    block_d = max(16, triton.next_power_of_2(d))
    if block_d > 64 and tile > 32:
        tile = 32  # d = 128/256: keep the tiles within registers / shared memory
    return tile, tile, block_d, math.ceil(block / tile)


def _upcast(q: torch.Tensor) -> bool:
    return q.dtype == torch.float32 or interpreted(q.device)


def _lists(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sorted int32 lists with their real entries first, int32 counts, S)."""
    S = blocks.shape[-1]
    if S == 0:
        counts = torch.zeros(blocks.shape[:-1], dtype=torch.int32, device=blocks.device)
        return torch.full((1,), -1, dtype=torch.int32, device=blocks.device), counts, 1
    srt = blocks.sort(-1, descending=True).values
    counts = (srt >= 0).sum(-1).to(torch.int32).contiguous()
    return srt.to(torch.int32).contiguous(), counts, S


def _forward(q, k, v, lists, counts, S, block, scale):
    B, HQ, N, D = q.shape
    HK = k.shape[1]
    nb = counts.shape[-1]
    bm, bn, bd, tpb = _tiles(block, D)
    o = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, HQ, N, device=q.device, dtype=torch.float32)
    if o.numel():
        _fwd_kernel[(nb * tpb, B * HQ)](
            q, k, v, lists, counts, o, lse,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
            HQ, HK, HQ // HK, N, nb, S, block, tpb, D, scale * LOG2E,
            UPCAST=_upcast(q), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd)
    return o, lse


def _backward(q, k, v, lists, counts, S, block, scale, o, lse, do, dlse):
    B, HQ, N, D = q.shape
    HK = k.shape[1]
    nb = counts.shape[-1]
    bm, bn, bd, tpb = _tiles(block, D)
    do = prep(do)
    delta = row_delta(do, o, dlse)
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
    dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
    if q.numel():
        _bwd_kernel[(nb * tpb, B * HQ)](
            q, k, v, lists, counts, do, lse, delta, dq, dk, dv,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
            HQ, HK, HQ // HK, N, nb, S, block, tpb, D, scale * LOG2E, scale,
            UPCAST=_upcast(q), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, blocks, block, scale):
        q, k, v = prep(q), prep(k), prep(v)
        lists, counts, S = _lists(blocks)
        o, lse = _forward(q, k, v, lists, counts, S, block, scale)
        ctx.save_for_backward(q, k, v, lists, counts, o, lse)
        ctx.S, ctx.block, ctx.scale = S, block, scale
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, lists, counts, o, lse = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = _backward(q, k, v, lists, counts, ctx.S, ctx.block, ctx.scale, o, lse,
                               do.to(o.dtype), dlse)
        return dq, dk, dv, None, None, None


def block_sparse_attention(q, k, v, blocks: torch.Tensor, block: int, scale: float):
    """(out [b, hq, n, d] in q's dtype, lse [b, hq, n] float32) of the block-sparse executor.

    q [b, hq, n, d], k/v [b, hk, n, d] (hk divides hq), ``blocks`` int [b, hk, ceil(n/block), S]:
    per KV head and query block i, up to S distinct past key blocks j < i, -1 padding. Row t of
    block i attends to its listed blocks and to its own block up to t. float32/bfloat16/float16
    inputs (fp32 accumulation), any strides; differentiable in q, k, v through both outputs. Same
    result as ``longpatch.methods.blocksparse.block_sparse_prefill``."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"block_sparse_attention: bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    b, hq, n, d = q.shape
    if k.shape[0] != b or k.shape[2] != n or k.shape[3] != d:
        raise ValueError(f"block_sparse_attention: k/v {tuple(k.shape)} do not match q {tuple(q.shape)} "
                         "(prefill only: q_len == kv_len)")
    if k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"block_sparse_attention: q_heads ({hq}) must be a multiple of kv_heads ({k.shape[1]})")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"block_sparse_attention: q, k, v must share one of float32/bfloat16/float16; "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if not 1 <= d <= _MAX_D:
        raise ValueError(f"block_sparse_attention: head dim {d} not supported (1..{_MAX_D})")
    block = int(block)
    if block < 1:
        raise ValueError(f"block_sparse_attention: block must be positive; got {block}")
    nb = math.ceil(n / block)
    if blocks.dim() != 4 or tuple(blocks.shape[:3]) != (b, k.shape[1], nb):
        raise ValueError(f"block_sparse_attention: blocks must be [{b}, {k.shape[1]}, {nb}, S]; "
                         f"got {tuple(blocks.shape)}")
    if blocks.dtype.is_floating_point or blocks.dtype == torch.bool:
        raise ValueError(f"block_sparse_attention: blocks must be an integer tensor; got {blocks.dtype}")
    blocks = blocks.to(q.device)
    return _BlockSparseAttention.apply(q, k, v, blocks, block, float(scale))


__all__ = ["block_sparse_attention"]
