"""The antidiagonal scoring of the query-aware selections in one Triton kernel: block scores without a
score matrix.

``longpatch.methods.selection.antidiagonal_scores`` (its readable torch form, what runs on the CPU)
multiplies query tiles by reversed key tiles, takes each query tile's softmax over its past key tiles,
and sums it per key block, over the tiles of each query block and the query heads of each KV group.
On a GPU that form writes [heads, n / stride, n / stride] float32 score rows and reads them back about
ten times: at 131k tokens most of the selection's time is that memory traffic, not the products.

Here one program takes one (batch row, KV head, query block): its rows are the g query heads x the
``per`` query tiles of the block (the whole group in one tile), and it walks the key blocks up to its
own, several blocks of ``per`` key tiles per step (64 columns, a product tile the tensor cores take),
twice:

1. the products and an online row maximum and row sum (the softmax's normaliser, in float32);
2. the products again, each row's probabilities exp(s - max) / sum, summed over the key block's
   tiles and over all rows of the tile: one number per (query block, key block), written once.

So the kernel writes [b, hk, nb, nb] block scores and nothing of size n x n / stride^2; its cost is
the products twice (2 n^2 d / (2 stride) per query head). The caller normalises each row of block
scores and masks the future, as the torch form does. Both take the same prepared tiles
(``selection._query_tiles`` and the reversed key tiles), so the zero padding of a ragged last tile,
the odd tiles' roll and the floor of exp(s - max) at EXP_FLOOR are the same; tests pair the two
under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import LOG2E, interpreted, max_combine, sum_combine

# exp(s - max) is floored at exp(EXP_FLOOR) for visible entries, as ``common.exp_below_max_`` does
_EXP_FLOOR = -80.0


@triton.jit
def _block_scores_kernel(QT, KT, Out, sqb, sqh, sqt, skb, skh, skt, sob, soh, soq,
                         HK, G, PER, NB, QB0, E, qk_scale, floor2,
                         CDT: tl.constexpr, DOT: tl.constexpr, BLOCK_R: tl.constexpr, KB: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr):
    # KB key blocks of PER tiles per step (BLOCK_C = KB * PER columns when KB > 1; KB = 1: one block,
    # BLOCK_C >= PER), so that each product tile is wide enough for the tensor cores
    qb = tl.program_id(0).to(tl.int64) + QB0  # query block (QB0: a prefill chunk's first; its tiles start QT)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // HK
    hk = pid_bh % HK
    r = tl.arange(0, BLOCK_R)
    r_ok = r < G * PER
    h = hk * G + r // PER  # row r: query head h, query tile a
    a = qb * PER + r % PER
    cc = tl.arange(0, BLOCK_C)
    e = tl.arange(0, BLOCK_E)
    q_rows = QT + b * sqb + h[:, None] * sqh + (a - QB0 * PER)[:, None] * sqt
    k_base = KT + b * skb + hk * skh
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_R], 0.0, tl.float32)
    # pass 1: each row's maximum and sum of exp over its past key tiles (c < a)
    for kb0 in range(0, qb + 1, KB):
        c = kb0 * PER + cc
        c_ok = (cc < KB * PER) & (c < NB * PER)
        s = tl.full([BLOCK_R, BLOCK_C], 0.0, tl.float32)
        for e0 in range(0, E, BLOCK_E):
            q = tl.load(q_rows + e0 + e[None, :], mask=r_ok[:, None], other=0.0).to(CDT)
            k = tl.load(k_base + c[:, None] * skt + e0 + e[None, :], mask=c_ok[:, None], other=0.0).to(CDT)
            s += tl.dot(q, tl.trans(k), input_precision=DOT)
        visible = r_ok[:, None] & c_ok[None, :] & (c[None, :] < a[:, None])
        s = tl.where(visible, s * qk_scale, float("-inf"))  # log2 domain
        m_new = tl.maximum(m_i, tl.reduce(s, 1, max_combine))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet: no NaN
        p = tl.where(visible, tl.math.exp2(tl.maximum(s - m_safe[:, None], floor2)), 0.0)
        l_i = l_i * tl.math.exp2(m_i - m_safe) + tl.reduce(p, 1, sum_combine)
        m_i = m_new
    # pass 2: the normalised probabilities, summed per key block over every row of the tile; the products are
    # pass 1's, computed again inline (a @triton.jit helper would be re-patched per call in the interpreter)
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    inv = tl.where(l_i > 0.0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)  # a row with no past tile adds 0
    for kb0 in range(0, qb + 1, KB):
        c = kb0 * PER + cc
        c_ok = (cc < KB * PER) & (c < NB * PER)
        s = tl.full([BLOCK_R, BLOCK_C], 0.0, tl.float32)
        for e0 in range(0, E, BLOCK_E):
            q = tl.load(q_rows + e0 + e[None, :], mask=r_ok[:, None], other=0.0).to(CDT)
            k = tl.load(k_base + c[:, None] * skt + e0 + e[None, :], mask=c_ok[:, None], other=0.0).to(CDT)
            s += tl.dot(q, tl.trans(k), input_precision=DOT)
        visible = r_ok[:, None] & c_ok[None, :] & (c[None, :] < a[:, None])
        p = tl.where(visible, tl.math.exp2(tl.maximum(s * qk_scale - m_safe[:, None], floor2)), 0.0)
        cols = tl.reduce(p * inv[:, None], 0, sum_combine)  # [BLOCK_C]: summed over the rows
        if KB == 1:
            tl.store(Out + b * sob + hk * soh + (qb - QB0) * soq + kb0, tl.reduce(cols, 0, sum_combine))
        else:
            kbs = kb0 + tl.arange(0, KB)
            tl.store(Out + b * sob + hk * soh + (qb - QB0) * soq + kbs,
                     tl.reduce(tl.reshape(cols, [KB, BLOCK_C // KB]), 1, sum_combine), mask=kbs <= qb)


def _pow2(x: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(x))


def block_scores(qt: torch.Tensor, kt: torch.Tensor, per: int, scale: float, q_block0: int = 0) -> torch.Tensor:
    """qt [b, hq, nt - q_block0 x per, E] query tiles (a prefill chunk's: those of query blocks from
    ``q_block0``) and kt [b, hk, nt, E] reversed key tiles (E = stride x d, as
    ``selection.antidiagonal_scores`` prepares them, unscaled), ``per`` tiles per block, ``scale`` the
    factor of the products (the attention scale / stride) -> [b, hk, nb - q_block0, nb] float32: per query
    block and key block at or before it, the sum over the block's query tiles and the KV group's query heads
    of each tile's softmax over its past key tiles, pooled over the key block (zeros above the
    diagonal, unnormalised rows)."""
    b, hq, mt, E = qt.shape
    hk, nt = kt.shape[1], kt.shape[2]
    g = hq // hk
    nb = nt // per
    if nt % per or mt != nt - q_block0 * per or kt.shape[-1] != E or hq % hk:
        raise ValueError(f"block_scores: tiles {tuple(qt.shape)} / {tuple(kt.shape)} do not make blocks of {per} "
                         f"(query blocks from {q_block0})")
    qt, kt = (x if x.stride(-1) == 1 else x.contiguous() for x in (qt, kt))
    exact = qt.dtype in (torch.float32, torch.float64) or interpreted(qt.device)
    cdt = tl.float32 if exact else (tl.float16 if qt.dtype == torch.float16 else tl.bfloat16)
    out = torch.zeros(b, hk, nb - q_block0, nb, dtype=torch.float32, device=qt.device)
    block_e = 64 if E % 64 == 0 else _pow2(E, 16)
    if E % block_e:
        raise ValueError(f"block_scores: stride x head_dim = {E} is not a multiple of {block_e}")
    # several key blocks per step when a block's tiles are a power of two under 64 (64 columns), else one
    kb = max(1, 64 // per) if per == triton.next_power_of_2(per) and per < 64 else 1
    _block_scores_kernel[(nb - q_block0, b * hk)](
        qt, kt, out, qt.stride(0), qt.stride(1), qt.stride(2), kt.stride(0), kt.stride(1), kt.stride(2),
        out.stride(0), out.stride(1), out.stride(2), hk, g, per, nb, q_block0, E, scale * LOG2E, _EXP_FLOOR * LOG2E,
        CDT=cdt, DOT="ieee" if exact else None, BLOCK_R=_pow2(g * per), KB=kb,
        BLOCK_C=kb * per if kb > 1 else _pow2(per), BLOCK_E=block_e)
    return out
