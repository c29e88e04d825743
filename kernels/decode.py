"""The graph-safe decode step's attention over a block list in Triton: one query per head against the
listed blocks of a fixed-size KV cache buffer, split-K, in two launches.

``longpatch.methods.paged.paged_attention_torch`` (its torch twin, what runs on the CPU) gathers all
L x block listed rows of K and V into new tensors, then attends: at decode time that is the whole cost
of the step, and the gather writes and reads back every row once more than attention needs. Here the
keys are read in place, once, by the programs that use them:

1. **split** (grid b x hk, SPLITS): a program takes one KV head and one contiguous share of its list
   (entries [split * per, (split + 1) * per), per = cdiv(L, SPLITS)). Its query tile is the whole GQA
   group (the g heads of that KV head, padded to >= 16 rows for ``tl.dot``), so every listed key tile
   is fetched once per group, not once per query head. It walks its entries with an online softmax
   (base 2, float32), skipping padding (-1) and the key tiles at or past the row's length (the loop's
   trip count is computed from them: no wasted loads, no branch), and writes its normalised partial
   output and log2-sum-exp to float32 buffers;
2. **combine** (grid b x hq): merges a head's SPLITS partials by their LSEs into out (q's dtype) and
   lse (natural log, float32).

Why split-K: one query per head leaves only b x hk programs (8 on a batch of one with 8 KV heads),
far too few to fill a GPU, while each walks a long list; splitting the list gives
b x hk x SPLITS programs, SPLITS chosen for about two per SM. Nothing here reads tensor data on
the host and every shape and grid follows from tensor shapes alone, so the step can be captured in
a CUDA graph; the length is a device tensor read by the kernel.

A row that attends nothing (an all-padding list, or every listed key at or past its length) gets out 0
and lse -inf, as the twin gives. Tests pair the two under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .common import LOG2E, interpreted, mm


@triton.jit
def _split_kernel(Q, K, V, Blocks, Length, Start, OPart, LsePart,
                  sqb, sqh, skb, skh, skn, svb, svh, svn, sbb, sbh, sbl, sln, sst,
                  HK, G, L, PER, SPLITS, CAP, D, qk_scale,
                  BLOCK: tl.constexpr, PREC: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, HAS_START: tl.constexpr):
    # int64 offsets: a long cache overflows int32 element offsets (b * stride_b)
    pid_bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    b = pid_bh // HK
    hk = pid_bh % HK
    r = tl.arange(0, BLOCK_G)
    r_ok = r < G
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + b * sqb + (hk * G + r)[:, None] * sqh + offs_d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    # the capacity bound only keeps an out-of-range length or id from reading past the buffer
    end = tl.minimum(tl.load(Length + b * sln).to(tl.int64), CAP)
    lo = end * 0  # keys before it are not attended
    if HAS_START:
        lo = tl.load(Start + b * sst).to(tl.int64)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    j0 = split * PER
    j1 = tl.minimum(j0 + PER, L)
    for j in range(j0, j1):
        start = tl.load(Blocks + b * sbb + hk * sbh + j * sbl).to(tl.int64) * BLOCK
        # padding (-1), the keys at or past the length and the tiles wholly before the start give no tiles
        n_end = tl.where((start >= 0) & (lo < end), tl.minimum(tl.maximum(end - start, 0), BLOCK), 0)
        n_lo = tl.maximum(lo - start, 0) // BLOCK_N * BLOCK_N
        for n0 in range(n_lo, n_end, BLOCK_N):
            pos = start + n0 + offs_n
            n_ok = (pos < end) & (pos >= lo)
            kv_mask = n_ok[:, None] & d_ok[None, :]
            kt = tl.load(k_base + pos[:, None] * skn + offs_d[None, :], mask=kv_mask, other=0.0)
            vt = tl.load(v_base + pos[:, None] * svn + offs_d[None, :], mask=kv_mask, other=0.0)
            # log2 domain; cast: where torch.compile captures this kernel, the float qk_scale arrives as fp64
            # (inductor types Python floats so), which would change the loop-carried softmax state's type
            s = tl.where(n_ok[None, :], (mm(q, tl.trans(kt), PREC) * qk_scale).to(tl.float32), float("-inf"))
            # every tile holds a key in [lo, end) (n_lo's tile holds lo < end; later ones start past lo, below
            # end): m_new is finite, exp2 gives no NaN
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + mm(p.to(vt.dtype), vt, PREC)
            m_i = m_new
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    row = (pid_bh * G + r) * SPLITS + split  # partials laid out [b * hq, SPLITS, (d)]
    tl.store(OPart + row[:, None] * D + offs_d[None, :], acc / l_safe[:, None], mask=r_ok[:, None] & d_ok[None, :])
    tl.store(LsePart + row, tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf")), mask=r_ok)


@triton.jit
def _combine_kernel(OPart, LsePart, Out, Lse, SPLITS, D,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # one query head; the splits in chunks of BLOCK_S, merged online (SPLITS may be in the hundreds)
    row = tl.program_id(0).to(tl.int64)  # b * hq + h
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    acc = tl.full([BLOCK_D], 0.0, tl.float32)
    for s0 in range(0, SPLITS, BLOCK_S):
        s = s0 + offs_s
        s_ok = s < SPLITS
        lse2 = tl.load(LsePart + row * SPLITS + s, mask=s_ok, other=float("-inf"))
        o = tl.load(OPart + (row * SPLITS + s)[:, None] * D + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                    other=0.0)
        m_new = tl.maximum(m, tl.max(lse2, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing attended so far: weights 0, no NaN
        w = tl.math.exp2(lse2 - m_safe)
        alpha = tl.math.exp2(m - m_safe)
        total = total * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        m = m_new
    seen = total > 0.0
    t_safe = tl.where(seen, total, 1.0)
    tl.store(Out + row * D + offs_d, (acc / t_safe).to(Out.dtype.element_ty), mask=d_ok)
    # ln 2 as a literal: a kernel may read no plain Python global (common.LOG2E) on a GPU
    tl.store(Lse + row, tl.where(seen, (m + tl.math.log2(t_safe)) * 0.6931471805599453, float("-inf")))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_splits(device: torch.device, programs: int, entries: int) -> int:
    """SPLITS for ``programs`` = b x hk (batch row, KV head) pairs over lists of ``entries``: about two programs
    per SM on CUDA (fewer splits leave SMs idle; more only add partials to merge), min(L, 4) in the CPU
    interpreter; never more than L, at least 1. Depends on shapes only (graph capture)."""
    if interpreted(device) or device.type != "cuda":
        want = 4
    else:
        want = triton.cdiv(2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device()),
                           programs)
    splits = max(1, min(entries, want))
    # no empty splits: the list's share per split decides how many are needed
    return triton.cdiv(entries, triton.cdiv(entries, splits)) if entries else 1


def _check(q, k, v, blocks, length, block, splits, what="length"):
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"paged_decode: q must be [b, hq, 1, d]; got {tuple(q.shape)}")
    b, hq, _, d = q.shape
    for name, x in (("k", k), ("v", v)):
        if x.dim() != 4 or x.shape[0] != b or x.shape[3] != d:
            raise ValueError(f"paged_decode: {name} must be [b={b}, hk, capacity, d={d}]; got {tuple(x.shape)}")
        if x.stride(-1) != 1:
            raise ValueError(f"paged_decode: {name} must have a contiguous last dim (stride 1); got strides "
                             f"{x.stride()}")
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"paged_decode: {name} must match q's dtype and device ({q.dtype}, {q.device}); "
                             f"got {x.dtype}, {x.device}")
    if k.shape != v.shape:
        raise ValueError(f"paged_decode: k and v must have one shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"paged_decode: q must be float32, bfloat16 or float16; got {q.dtype}")
    hk = k.shape[1]
    if hk == 0 or hq % hk:
        raise ValueError(f"paged_decode: q's heads ({hq}) must be a multiple of k's heads ({hk})")
    if blocks.dim() != 3 or tuple(blocks.shape[:2]) != (b, hk):
        raise ValueError(f"paged_decode: blocks must be [b={b}, hk={hk}, L]; got {tuple(blocks.shape)}")
    if blocks.dtype not in (torch.int32, torch.int64) or blocks.device != q.device:
        raise ValueError(f"paged_decode: blocks must be int32 (or int64) on {q.device}; got {blocks.dtype} "
                         f"on {blocks.device}")
    if tuple(length.shape) != (b,) or length.dtype not in (torch.int64, torch.int32) or length.device != q.device:
        raise ValueError(f"paged_decode: {what} must be an int64 [b={b}] tensor on {q.device}; got "
                         f"{length.dtype} {tuple(length.shape)} on {length.device}")
    if not isinstance(block, int) or block < 16 or block & (block - 1):
        raise ValueError(f"paged_decode: block must be a power of two >= 16; got {block}")
    if splits is not None and (not isinstance(splits, int) or splits < 1):
        raise ValueError(f"paged_decode: splits must be a positive int; got {splits}")


def paged_decode(q, k, v, blocks, length, block: int, scale: float, splits: int | None = None,
                 start: torch.Tensor | None = None):
    """q [b, hq, 1, d]; k, v [b, hk, capacity, d] (a KV cache buffer, last dim contiguous, any other strides);
    blocks [b, hk, L] int32 block ids (-1 = padding, each id at most once, in any order);
    length [b] int64 device tensor: keys at positions >= length[b] are not attended; ``start`` [b] (optional,
    the same kind): nor those below start[b] (a left-padded row's first key, a sliding window's).
    block: keys per block (a power of two >= 16). Returns (out [b, hq, 1, d] in q.dtype, lse [b, hq, 1] float32),
    equal to paged_attention_torch(q, k, v, blocks, length, block, scale).

    ``splits``: how many shares each list is cut into (default ``default_splits``). Two launches, no host
    read of tensor data. Ids are assumed below capacity / block and lengths at most the capacity (checking
    would read device data): keys past the buffer are never read, where the twin would clamp to its last row."""
    _check(q, k, v, blocks, length, block, splits)
    if start is not None:
        _check(q, k, v, blocks, start, block, splits, "start")
    b, hq, _, d = q.shape
    hk, cap = k.shape[1], k.shape[2]
    g = hq // hk
    n_list = blocks.shape[2]
    if splits is None:
        splits = default_splits(q.device, b * hk, n_list)
    per = triton.cdiv(n_list, splits)
    if q.stride(-1) != 1:
        q = q.contiguous()  # one row per head: a copy costs nothing
    block_d = max(16, triton.next_power_of_2(d))
    # key tiles of at most 64 rows, fewer at large d: Triton stages K and V (and fp32 dots' operands) in shared
    # memory, and an sm_90 build of 64 x 128 fp32 tiles needs 140 KB of it (more than most GPUs have)
    block_n = min(block, 64, max(16, (4096 if q.dtype == torch.float32 else 8192) // block_d))
    # fp32: exact dots (no tf32); half inputs: native on a GPU, upcast in the interpreter (its half dots are wrong)
    prec = 1 if q.dtype == torch.float32 else (2 if interpreted(q.device) else 0)
    o_part = torch.empty(b * hq, splits, d, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(b * hq, splits, device=q.device, dtype=torch.float32)
    _split_kernel[(b * hk, splits)](
        q, k, v, blocks, length, length if start is None else start, o_part, lse_part,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        blocks.stride(0), blocks.stride(1), blocks.stride(2), length.stride(0),
        length.stride(0) if start is None else start.stride(0),
        hk, g, n_list, per, splits, cap, d, scale * LOG2E,
        BLOCK=block, PREC=prec, BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_START=start is not None)
    out = torch.empty(b, hq, 1, d, device=q.device, dtype=q.dtype)
    lse = torch.empty(b, hq, 1, device=q.device, dtype=torch.float32)
    _combine_kernel[(b * hq,)](o_part, lse_part, out, lse, splits, d,
                               BLOCK_S=min(32, triton.next_power_of_2(splits)), BLOCK_D=block_d)
    return out, lse
