"""MoBA, Mixture of Block Attention (Moonshot AI, arXiv 2502.13189), training-free.

Keys are cut into chunks of ``chunk_size`` positions (chunk c = positions [c*C, (c+1)*C); the last
chunk may be partial). A query q at position p (queries are the last q_len positions, bottom-right)
attends to the union of ``topk`` chunks:

* its own chunk p // C, always, with the causal mask inside it (keys <= p);
* the top (topk - 1) *past* chunks by the gate score ``scale * q . mean(keys of the chunk)``.
  Future chunks are never candidates. Nothing is learned: the gate is a mean-pooled key per chunk.

The output is the exact softmax over that union, computed as one attention per selected chunk and an
LSE merge of the parts. ``topk = 1`` is the own chunk only; ``topk >= number of chunks`` is exact
causal attention. Ties of the gate score are broken towards the more recent chunk (larger index):
the score and the chunk index form one int64 key, so the selected set never depends on how
``torch.topk`` orders equal values. See docs/moba.md for non-causal mode, GQA modes and decoding.

CPU formulation (the ``torch`` backend). Everything runs per (batch, KV head) and per window of
query positions, so temporary memory is bounded by a few window-sized buffers:

1. gate: scores [heads, rows, n_chunks] = q . means^T (n x n/C, never n x n); selection by top-k
   over int64 keys;
2. own chunks: one batched call of torch's fused CPU flash-attention kernel over all aligned chunk
   squares (causal), plus at most two odd pieces (a misaligned first chunk when decoding, a partial
   last chunk);
3. past chunks ("varlen" grouping): every (query head, position, selected chunk) triple is a pair;
   pairs are sorted by chunk, the query rows gathered once, and each chunk gets ONE fused attention
   call over all rows of the KV group (any query head) that selected it, so a K/V chunk is read once
   per window whatever the number of heads or queries routing to it;
4. merge by LSE (one logsumexp over the topk parts of each row).

Gradients: a custom autograd function recomputes the blocks in plain PyTorch with the final LSE
(dS = P * (dP - D + dLSE)), so the output and the returned LSE are both differentiable. The gate
(selection and chunk means) carries no gradient, as in MoBA.

Decoding (q_len < kv_len): queries choose among the full chunks of the cache before their own
chunk; the chunk means live in the patched layer's ``state`` (computed once per chunk, checked
against the cache every step) or come as ``chunk_means``. A single token per head takes
``_decode_one``: cost O(topk * C * d) plus an O(n / C * d) gate, not O(n * d).

The Triton backend (``longpatch.kernels.moba``) runs the same pairs, own chunk included, in one
block-sparse kernel (forward with LSE and backward) and merges in PyTorch.
"""
from __future__ import annotations

import math

import torch

from .base import Method, Param, positive_int, register_method
from .common import (
    acc_dtype,
    check_int,
    check_qkv,
    default_scale,
    gather_rows,
    isolate_nonfinite,
    nonfinite_rows,
    ordered_int,
    resolve_backend,
)
from .cpu_flash import additive_mask
from .exact import exact_attention
from .lse_attention import attend

DEFAULT_CHUNK_SIZE = 2048
DEFAULT_TOPK = 4

_INT64_MIN = -(2 ** 63)
# Bounds of temporaries: gathered pair rows per window, score elements per gate block, and score
# elements per block of the backward recomputation.
_PAIR_ROWS = 1 << 19
_GATE_ELEMS = 1 << 22
_BWD_ELEMS = 1 << 23
# One-token decode attends chunk by chunk on views of the cache when it makes at most this many
# fused-kernel calls; beyond, it gathers the selected rows and makes one call.
_VIEW_CALLS = 32


# --------------------------------------------------------------------------- chunk means and gate

def moba_chunk_means(k: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Mean key of every FULL chunk: k [b, kv_heads, n, d] -> [b, kv_heads, n // chunk_size, d].

    float32 (float64 for float64 keys). A partial last chunk is left out: its mean changes with
    every new token, so callers that cache means (decoding) extend them when a chunk fills.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    b, h, n, d = k.shape
    nf = n // chunk_size
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    if nf == 0:
        return k.new_zeros((b, h, 0, d), dtype=acc)
    blocks = k[:, :, : nf * chunk_size].unflatten(2, (nf, chunk_size))
    return blocks.sum(3, dtype=acc) / chunk_size


def _means_for(k1: torch.Tensor, C: int, needed: int, given: torch.Tensor | None) -> torch.Tensor:
    """Means [needed, d] of chunks 0..needed-1 of one KV head k1 [n, d]; ``given`` [m, d] covers a
    prefix of the full chunks (computed once by the caller and reused); the rest, including a
    partial last chunk (averaged over its real length), come from the keys."""
    acc = torch.float64 if k1.dtype == torch.float64 else torch.float32
    have = 0 if given is None else min(int(given.shape[0]), needed, k1.shape[0] // C)
    parts = [given[:have].to(acc)] if have else []
    full_end = min(needed, k1.shape[0] // C)
    if full_end > have:
        parts.append(k1[have * C: full_end * C].unflatten(0, (full_end - have, C)).sum(1, dtype=acc) / C)
    if needed > full_end:  # the partial last chunk (non-causal only)
        tail = k1[full_end * C:]
        parts.append(tail.sum(0, dtype=acc, keepdim=True) / tail.shape[0])
    if not parts:
        return k1.new_zeros((0, k1.shape[1]), dtype=acc)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _prefix_means(k: torch.Tensor, C: int, count: int, given: torch.Tensor | None) -> torch.Tensor:
    """Means [b, hk, count, d] of the first ``count`` full chunks: ``given`` as far as it goes, the
    rest computed from the keys."""
    have = 0 if given is None else min(given.shape[2], count)
    if have == count:
        return given[:, :, :count]
    rest = moba_chunk_means(k[:, :, have * C: count * C], C)
    return rest if have == 0 else torch.cat([given[:, :, :have].to(rest.dtype), rest], dim=2)


def _select(qw: torch.Tensor, means: torch.Tensor, pos: torch.Tensor, C: int, topk: int, scale: float,
            causal: bool, shared: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate, for one window of query positions of one or more KV groups.

    qw [..., g, m, d] (the g query heads of a KV group); means [..., nc, d]; pos [m] absolute
    positions. Returns own [m] (the own chunk, -1 when a query has none: non-causal with
    q_len > kv_len) and other [..., hs, m, slots] chunk ids (-1 = empty slot), hs = 1 with shared
    selection (the group votes with the sum of its heads' scores) else g.
    """
    *lead, g, m, _ = qw.shape
    nc = means.shape[-2]
    own = torch.div(pos, C, rounding_mode="floor")
    own = torch.where(pos >= 0, own, torch.full_like(own, -1))
    all_own = bool((pos >= 0).all())
    slots = topk - 1 if all_own else topk
    hs = 1 if shared else g
    kk = min(slots, nc)
    if kk == 0:
        return own, torch.full((*lead, hs, m, slots), -1, dtype=torch.long, device=qw.device)
    chunk = torch.arange(nc, device=qw.device)
    other = torch.empty((*lead, hs, m, kk), dtype=torch.long, device=qw.device)
    rows = max(1, _GATE_ELEMS // max(1, hs * nc * math.prod(lead)))
    # float64 GEMM, rounded to float32: products of float32 values are exact in float64, so chunks
    # with identical means get bitwise-identical scores (a float32 GEMM may round columns
    # differently) and their tie is broken by the rule below, not by rounding noise.
    mt = means.double().transpose(-1, -2).unsqueeze(-3)  # [..., 1, d, nc]
    for s in range(0, m, rows):
        e = min(m, s + rows)
        qb = qw[..., s:e, :].double()
        qb = qb.sum(-3, keepdim=True) if shared else qb
        scores = (torch.matmul(qb, mt) * scale).float()  # [..., hs, r, nc]
        o = own[s:e, None]
        valid = chunk[None, :] < o if causal else chunk[None, :] != o
        key = (ordered_int(scores).to(torch.int64) << 32) | chunk  # the later chunk wins a tie
        key = torch.where(valid, key, torch.full_like(key, _INT64_MIN))
        val, idx = torch.topk(key, kk, dim=-1, sorted=True)
        other[..., s:e, :] = torch.where(val > _INT64_MIN, idx, torch.full_like(idx, -1))
    if kk < slots:
        other = torch.cat([other, other.new_full((*lead, hs, m, slots - kk), -1)], dim=-1)
    if not all_own and slots > 0:  # rows with an own chunk use topk - 1 of the candidates
        last = other[..., -1]
        other[..., -1] = torch.where(own >= 0, torch.full_like(last, -1), last)
    return own, other


# --------------------------------------------------------------------------- own chunks

def _own_pieces(p0: int, p1: int, nk: int, C: int, causal: bool) -> list[tuple]:
    """Split query positions [p0, p1) (p0 >= 0) by own chunk into attention calls.

    Returns (kind, q_start, q_end, k_start, k_end) with positions; kind "square" = f aligned full
    chunks batched (queries and keys [q_start, q_end), f = (q_end - q_start) / C, causal inside each),
    "piece" = one chunk's queries vs its keys (causal bottom-right when causal)."""
    out = []
    p = p0
    while p < p1:
        c = p // C
        cs, ce = c * C, min((c + 1) * C, nk)
        if p == cs and p + C <= p1:  # a run of whole, aligned chunks
            f = (p1 - p) // C
            out.append(("square", p, p + f * C, p, p + f * C))
            p += f * C
            continue
        qe = min(ce, p1)
        out.append(("piece", p, qe, cs, qe if causal else ce))
        p = qe
    return out


def _own_attention(qw, k1, v1, pos0: int, C: int, causal: bool, scale: float):
    """Own-chunk attention of queries qw [g, m, d] at positions pos0.. against one KV head k1/v1 [n, d].
    Returns (out [g, m, d], lse [g, m]), lse = -inf for rows without an own chunk."""
    g, m, d = qw.shape
    nk = k1.shape[0]
    out = qw.new_zeros((g, m, d))
    lse = torch.full((g, m), float("-inf"), dtype=acc_dtype(qw.dtype), device=qw.device)
    start = max(pos0, 0)
    for kind, qs, qe, ks, ke in _own_pieces(start, pos0 + m, nk, C, causal):
        a, b = qs - pos0, qe - pos0
        if kind == "square":
            f = (qe - qs) // C
            qb = qw[:, a:b].unflatten(1, (f, C)).transpose(0, 1)  # [f, g, C, d] (a view)
            kb = k1[ks:ke].unflatten(0, (f, 1, C))  # [f, 1, C, d]
            vb = v1[ks:ke].unflatten(0, (f, 1, C))
            o, l = attend(qb, kb, vb, scale, causal=causal)
            out[:, a:b] = o.transpose(0, 1).flatten(1, 2)
            lse[:, a:b] = l.transpose(0, 1).flatten(1, 2)
        else:
            mask = _piece_mask(qs, qe, ks, ke, causal, qw.device)
            o, l = attend(qw[None, :, a:b], k1[None, None, ks:ke], v1[None, None, ks:ke], scale, mask=mask)
            out[:, a:b] = o[0]
            lse[:, a:b] = l[0]
    return out, lse


def _piece_mask(qs, qe, ks, ke, causal, device):
    """Additive mask of queries [qs, qe) vs keys [ks, ke) hiding keys after each query (causal), or
    None when nothing is hidden."""
    if not causal or ke <= qs + 1:
        return None
    qpos = torch.arange(qs, qe, device=device)[:, None]
    kpos = torch.arange(ks, ke, device=device)[None, :]
    return additive_mask(kpos <= qpos, torch.float32)


def _own_tiles(p0: int, p1: int, nk: int, C: int, causal: bool, heads: int, device):
    """Own-chunk blocks of queries [p0, p1) for the backward: (q_start, q_end, k_start, k_end, mask),
    one chunk at a time and in row tiles, so that a block holds at most ~_BWD_ELEMS scores."""
    for kind, qs, qe, ks, ke in _own_pieces(p0, p1, nk, C, causal):
        step = C if kind == "square" else qe - qs
        for cs in range(qs, qe, step):
            ce = min(cs + step, qe)
            k0, k1 = (cs, ce) if kind == "square" else (ks, ke)
            tile = max(1, _BWD_ELEMS // max(1, heads * (k1 - k0)))
            for t0 in range(cs, ce, tile):
                t1 = min(ce, t0 + tile)
                kend = t1 if causal else k1
                yield t0, t1, k0, kend, _piece_mask(t0, t1, k0, kend, causal, device)


# --------------------------------------------------------------------------- past chunks (varlen)

def _pairs(other: torch.Tensor, g: int, m: int):
    """Sort (head, row, slot) entries by selected chunk. other [hs, m, slots] (hs = 1: shared, the
    group's heads share it). Returns entries [P] (flat index into the [g, m, slots] slot grid),
    row [P] (flat index into [g*m]) and chunk ids [P], sorted by chunk."""
    slots = other.shape[-1]
    other = other.expand(g, m, slots).reshape(-1)
    ent = torch.nonzero(other >= 0).squeeze(1)
    ch = other[ent]
    ch, order = torch.sort(ch, stable=True)
    ent = ent[order]
    return ent, torch.div(ent, slots, rounding_mode="floor"), ch


def _segments(ch: torch.Tensor) -> list[tuple[int, int, int]]:
    """(chunk, start, end) runs of a sorted chunk-id vector."""
    if ch.numel() == 0:
        return []
    uniq, counts = torch.unique_consecutive(ch, return_counts=True)
    ends = torch.cumsum(counts, 0).tolist()
    starts = [0] + ends[:-1]
    return list(zip(uniq.tolist(), starts, ends))


def _past_attention(qw, k1, v1, other, C: int, scale: float):
    """Attention of every (head, row) to each of its selected non-own chunks. Returns the parts on
    the slot grid: out [g, m, slots, d], lse [g, m, slots] (-inf in empty slots)."""
    g, m, d = qw.shape
    slots = other.shape[-1]
    nk = k1.shape[0]
    out = qw.new_zeros((g * m * slots, d))
    lse = torch.full((g * m * slots,), float("-inf"), dtype=acc_dtype(qw.dtype), device=qw.device)
    ent, row, ch = _pairs(other, g, m)
    if ent.numel() == 0:
        return out.view(g, m, slots, d), lse.view(g, m, slots)
    qp = qw.reshape(g * m, d).index_select(0, row)
    op = torch.empty_like(qp)
    lp = torch.empty(qp.shape[0], dtype=lse.dtype, device=qw.device)
    for c, s, e in _segments(ch):
        ks, ke = c * C, min((c + 1) * C, nk)
        o, l = attend(qp[None, None, s:e], k1[None, None, ks:ke], v1[None, None, ks:ke], scale)
        op[s:e] = o[0, 0]
        lp[s:e] = l[0, 0]
    out.index_copy_(0, ent, op)
    lse.index_copy_(0, ent, lp)
    return out.view(g, m, slots, d), lse.view(g, m, slots)


def _merge(o_own, l_own, o_past, l_past):
    """Exact softmax over the union: o_own [g, m, d], l_own [g, m], o_past [g, m, s, d], l_past [g, m, s]."""
    lall = torch.cat([l_own.unsqueeze(-1), l_past], dim=-1)
    lse = torch.logsumexp(lall, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w = torch.exp(lall - safe.unsqueeze(-1))
    out = w[..., 0:1] * o_own.to(w.dtype) + torch.einsum("gms,gmsd->gmd", w[..., 1:], o_past.to(w.dtype))
    return out, lse


# --------------------------------------------------------------------------- the torch path

class _Plan:
    """Windows of query positions and the gate means of every (batch, KV head)."""

    def __init__(self, q, k, C, topk, causal, chunk_means, scale, shared):
        self.b, self.hq, self.nq, self.d = q.shape
        self.hk, self.nk = k.shape[1], k.shape[2]
        self.g = self.hq // self.hk
        self.C, self.topk, self.causal, self.scale, self.shared = C, topk, causal, scale, shared
        self.off = self.nk - self.nq  # position of query 0
        last_pos = self.nk - 1
        # chunks the gate may score: causal, those strictly before the last query's own chunk
        self.nc = (last_pos // C) if causal else math.ceil(self.nk / C)
        self.chunk_means = chunk_means
        w = max(C, (_PAIR_ROWS // max(1, self.g * topk)) // C * C)
        # window boundaries (in positions) on chunk boundaries, so own chunks batch as squares
        bounds = [self.off]
        nxt = (self.off // C) * C + w
        while nxt < self.nk:
            bounds.append(nxt)
            nxt += w
        bounds.append(self.nk)
        self.windows = [(a - self.off, b - self.off) for a, b in zip(bounds[:-1], bounds[1:])]

    def means(self, k, bi, hi):
        given = None if self.chunk_means is None else self.chunk_means[bi, hi]
        return _means_for(k[bi, hi], self.C, self.nc, given)


def _torch_forward(q, k, v, plan: _Plan):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=acc_dtype(q.dtype), device=q.device)
    g, C = plan.g, plan.C
    for bi in range(plan.b):
        for hi in range(plan.hk):
            means = plan.means(k, bi, hi)
            k1, v1 = k[bi, hi], v[bi, hi]
            heads = slice(hi * g, (hi + 1) * g)
            for a, e in plan.windows:
                qw = q[bi, heads, a:e]
                pos = torch.arange(a + plan.off, e + plan.off, device=q.device)
                own, other = _select(qw, means, pos, C, plan.topk, plan.scale, plan.causal, plan.shared)
                o_own, l_own = _own_attention(qw, k1, v1, a + plan.off, C, plan.causal, plan.scale)
                o_past, l_past = _past_attention(qw, k1, v1, other, C, plan.scale)
                o, l = _merge(o_own, l_own, o_past, l_past)
                out[bi, heads, a:e] = o.to(q.dtype)
                lse[bi, heads, a:e] = l
    return out, lse


def _block_grads(qb, kb, vb, dob, lseb, deltab, scale, mask=None):
    """Gradient of one block of the union softmax, recomputed: P = exp(S - LSE_final).
    qb/dob [..., m, d], kb/vb [..., n, d], lseb/deltab [..., m] (delta = rowsum(dO*O) - dLSE)."""
    s = torch.matmul(qb, kb.transpose(-1, -2)) * scale
    if mask is not None:
        s = s + mask
    p = torch.exp(s - lseb.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dob)
    ds = p * (torch.matmul(dob, vb.transpose(-1, -2)) - deltab.unsqueeze(-1))
    dq = torch.matmul(ds, kb) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qb) * scale
    return dq, dk, dv


def _torch_backward(q, k, v, out, lse, dout, dlse, plan: _Plan):
    acc = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    g, C = plan.g, plan.C
    delta_all = (dout.to(acc) * out.to(acc)).sum(-1)
    if dlse is not None:
        delta_all = delta_all - dlse.to(acc)
    for bi in range(plan.b):
        for hi in range(plan.hk):
            means = plan.means(k, bi, hi)
            k1, v1 = k[bi, hi].to(acc), v[bi, hi].to(acc)
            dk1, dv1 = dk[bi, hi], dv[bi, hi]
            heads = slice(hi * g, (hi + 1) * g)
            for a, e in plan.windows:
                qw = q[bi, heads, a:e].to(acc)
                dow = dout[bi, heads, a:e].to(acc)
                lw = lse[bi, heads, a:e].to(acc)
                dw = delta_all[bi, heads, a:e]
                dqw = dq[bi, heads, a:e]
                pos = torch.arange(a + plan.off, e + plan.off, device=q.device)
                _, other = _select(q[bi, heads, a:e], means, pos, C, plan.topk, plan.scale, plan.causal, plan.shared)
                pos0 = a + plan.off
                tiles = _own_tiles(max(pos0, 0), e + plan.off, plan.nk, C, plan.causal, g, q.device)
                for t0, t1, k0, kend, mask in tiles:
                    r0, r1 = t0 - pos0, t1 - pos0
                    gq, gk, gv = _block_grads(qw[:, r0:r1], k1[k0:kend], v1[k0:kend], dow[:, r0:r1], lw[:, r0:r1],
                                              dw[:, r0:r1], plan.scale, mask=None if mask is None else mask.to(acc))
                    dqw[:, r0:r1] += gq
                    dk1[k0:kend] += gk.sum(0)
                    dv1[k0:kend] += gv.sum(0)
                # past chunks, by segment, in row tiles
                ent, row, ch = _pairs(other, g, e - a)
                if ent.numel() == 0:
                    continue
                qp = qw.reshape(-1, plan.d).index_select(0, row)
                dop = dow.reshape(-1, plan.d).index_select(0, row)
                lp = lw.reshape(-1).index_select(0, row)
                dp = dw.reshape(-1).index_select(0, row)
                dqp = torch.zeros_like(qp)
                for c, s, t in _segments(ch):
                    ks, ke = c * C, min((c + 1) * C, plan.nk)
                    tile = max(1, _BWD_ELEMS // max(1, ke - ks))
                    for r0 in range(s, t, tile):
                        r1 = min(t, r0 + tile)
                        gq, gk, gv = _block_grads(qp[r0:r1], k1[ks:ke], v1[ks:ke], dop[r0:r1], lp[r0:r1], dp[r0:r1],
                                                  plan.scale)
                        dqp[r0:r1] = gq
                        dk1[ks:ke] += gk
                        dv1[ks:ke] += gv
                dqw += torch.zeros_like(qw).view(-1, plan.d).index_add_(0, row, dqp).view_as(qw)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _MobaTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan):
        out, lse = _torch_forward(q, k, v, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _torch_backward(q, k, v, out, lse, dout, dlse, ctx.plan)
        return dq, dk, dv, None


def _gate_one(q, means, scale: float, shared: bool, topk: int):
    """Gate of one query per head: q [b, hk, g, d], means [b, hk, nc, d] -> [b, hk, hs, kk] chunk ids
    (-1 = empty). Elementwise float64 products (no BLAS call: a one-row GEMV would wake a thread
    pool), rounded to float32 like the prefill gate, so both rank chunks the same way."""
    nc = means.shape[2]
    kk = min(topk - 1, nc)
    if kk <= 0:
        return None
    qd = q.double()
    qd = qd.sum(2, keepdim=True) if shared else qd
    scores = ((qd.unsqueeze(-2) * means.double().unsqueeze(2)).sum(-1) * scale).float()  # [b, hk, hs, nc]
    chunk = torch.arange(nc, device=q.device)
    key = (ordered_int(scores).to(torch.int64) << 32) | chunk  # the later chunk wins a tie
    return torch.topk(key, kk, dim=-1, sorted=True).indices


def _decode_views(q, k, v, sel, own: int, C: int, scale: float):
    """``_decode_one`` for few (batch, selection group) pairs: one fused attention call per selected
    chunk on views of the cache (no copy; a one-row call runs on the calling thread), merged by LSE."""
    b, hq, _, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    hs = sel.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty((b, hq, 1), dtype=acc_dtype(q.dtype), device=q.device)
    chunks = sel.tolist()
    for bi in range(b):
        for hi in range(hk):
            kb, vb = k[bi:bi + 1, hi:hi + 1], v[bi:bi + 1, hi:hi + 1]
            for si in range(hs):
                heads = slice(hi * g + si, hi * g + si + 1) if hs == g else slice(hi * g, (hi + 1) * g)
                qh = q[bi:bi + 1, heads]
                spans = [(own * C, k.shape[2])] + [(c * C, c * C + C) for c in chunks[bi][hi][si]]
                parts = [attend(qh, kb[:, :, s0:s1], vb[:, :, s0:s1], scale) for s0, s1 in spans]
                ls = torch.stack([pl for _, pl in parts])  # [P, 1, gh, 1]
                # softmax / log_softmax over the parts: exp(lse_part - lse_union) and the union's LSE
                # without exp/log calls (those go through a threaded math library, costly for 3 numbers)
                w = torch.softmax(ls, dim=0)
                outs = torch.stack([po for po, _ in parts]).to(w.dtype)
                out[bi:bi + 1, heads] = (w.unsqueeze(-1) * outs).sum(0).to(q.dtype)
                lse[bi:bi + 1, heads] = ls[0] - torch.log_softmax(ls, dim=0)[0]
    return out, lse


def _decode_one(q, k, v, means, C: int, topk: int, scale: float, shared: bool):
    """One causal query per head (q_len = 1) against the cache, all heads at once: gather the rows of
    the selected chunks and of the own (partial) chunk, then one fused attention call. Reads
    topk*C keys per head whatever the cache length (plus n/C chunk means for the gate)."""
    b, hq, _, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    g = hq // hk
    own = (nk - 1) // C
    own_tok = torch.arange(own * C, nk, device=q.device)
    sel = _gate_one(q.view(b, hk, g, d), means[:, :, :own], scale, shared, topk)  # all own past chunks are valid
    if sel is None:
        ko, vo = k[:, :, own * C:], v[:, :, own * C:]
        out, lse = attend(q, ko, vo, scale)
        return out, lse
    hs = sel.shape[2]
    if b * hk * hs * (sel.shape[-1] + 1) <= _VIEW_CALLS:
        return _decode_views(q, k, v, sel, own, C, scale)
    tok = (sel.unsqueeze(-1) * C + torch.arange(C, device=q.device)).flatten(-2)  # [b, hk, hs, kk*C]
    tok = torch.cat([tok, own_tok.expand(b, hk, hs, own_tok.numel())], dim=-1)
    ks = gather_rows(k, tok).flatten(1, 2)  # [b, hk*hs, L, d]: per query head, or per KV head if shared
    vs = gather_rows(v, tok).flatten(1, 2)
    return attend(q, ks, vs, scale)


# --------------------------------------------------------------------------- the triton path

def selection_pairs(q, k, plan: _Plan):
    """Every (query row, selected chunk) pair, own chunk included, sorted by (batch, KV head, chunk):
    the work list of the block-sparse kernel. Returns a dict of int64 tensors:
    row [P] (flat index into q viewed [b*hq*nq]), slot [P] (0 = own, 1.. past), pos [P] (absolute
    query position), seg_start/seg_end [S] (pair ranges), seg_kv [S] (flat b*hk index),
    seg_k0/seg_k1 [S] (key range of the chunk)."""
    g, C, nq = plan.g, plan.C, plan.nq
    rows, slots, chunks, kvs = [], [], [], []
    for bi in range(plan.b):
        for hi in range(plan.hk):
            means = plan.means(k, bi, hi)
            for a, e in plan.windows:
                m = e - a
                qw = q[bi, hi * g:(hi + 1) * g, a:e]
                pos = torch.arange(a + plan.off, e + plan.off, device=q.device)
                own, other = _select(qw, means, pos, C, plan.topk, plan.scale, plan.causal, plan.shared)
                sel = torch.cat([own.view(1, m, 1).expand(g, m, 1), other.expand(g, m, other.shape[-1])], dim=-1)
                ns = sel.shape[-1]
                flat = sel.reshape(-1)
                ent = torch.nonzero(flat >= 0).squeeze(1)
                hrow = torch.div(ent, ns, rounding_mode="floor")  # h * m + i
                h = torch.div(hrow, m, rounding_mode="floor")
                i = hrow % m
                rows.append(((bi * plan.hq + hi * g + h) * nq) + a + i)
                slots.append(ent % ns)
                chunks.append(flat[ent])
                kvs.append(torch.full_like(ent, bi * plan.hk + hi))
    row, slot, chunk, kv = (torch.cat(x) for x in (rows, slots, chunks, kvs))
    nchunks = math.ceil(plan.nk / C)
    key = kv * nchunks + chunk
    key, order = torch.sort(key, stable=True)
    row, slot = row[order], slot[order]
    uniq, counts = torch.unique_consecutive(key, return_counts=True)
    seg_end = torch.cumsum(counts, 0)
    seg_start = seg_end - counts
    seg_chunk = uniq % nchunks
    seg_kv = torch.div(uniq, nchunks, rounding_mode="floor")
    pos = row % nq + plan.off
    return {"row": row, "slot": slot, "pos": pos, "seg_start": seg_start, "seg_end": seg_end, "seg_kv": seg_kv,
            "seg_k0": seg_chunk * C, "seg_k1": torch.clamp(seg_chunk * C + C, max=plan.nk)}


def pairs_attention_reference(q, k, v, pairs: dict, scale: float, causal: bool):
    """Readable PyTorch twin of the Triton kernel ``longpatch.kernels.moba.pairs_attention``: for
    every pair, softmax attention of its query row to its chunk's keys (causal: keys <= the query's
    position). Returns (out [P, d] float32, lse [P] float32)."""
    d = q.shape[-1]
    qf = q.reshape(-1, d).float()
    kf = k.reshape(-1, k.shape[2], d).float()
    vf = v.reshape(-1, v.shape[2], d).float()
    P = pairs["row"].numel()
    out = torch.zeros(P, d, dtype=torch.float32, device=q.device)
    lse = torch.full((P,), float("-inf"), dtype=torch.float32, device=q.device)
    for s, e, kv, k0, k1 in zip(*(pairs[n].tolist() for n in ("seg_start", "seg_end", "seg_kv", "seg_k0", "seg_k1"))):
        qs = qf[pairs["row"][s:e]]
        sc = qs @ kf[kv, k0:k1].t() * scale
        if causal:
            kpos = torch.arange(k0, k1, device=q.device)
            sc = sc.masked_fill(kpos[None, :] > pairs["pos"][s:e, None], float("-inf"))
        l = torch.logsumexp(sc, -1)
        out[s:e] = torch.exp(sc - l[:, None]) @ vf[kv, k0:k1]
        lse[s:e] = l
    return out, lse


def _triton_path(q, k, v, plan: _Plan):
    from ..kernels.moba import pairs_attention  # lazily: triton is optional
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    with torch.no_grad():
        pairs = selection_pairs(q, k, plan)
    o_p, l_p = pairs_attention(q, k, v, pairs, scale=plan.scale, causal=plan.causal)
    b, hq, nq, d = q.shape
    ns = int(pairs["slot"].max()) + 1  # own + past slots; every row has at least one pair
    flat = pairs["row"] * ns + pairs["slot"]
    o_all = torch.zeros(b * hq * nq * ns, d, dtype=torch.float32, device=q.device).index_copy(0, flat, o_p)
    l_all = torch.full((b * hq * nq * ns,), float("-inf"), dtype=torch.float32, device=q.device)
    l_all = l_all.index_copy(0, flat, l_p).view(-1, ns)
    lse = torch.logsumexp(l_all, -1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w = torch.exp(l_all - safe.unsqueeze(-1))
    out = torch.einsum("rs,rsd->rd", w, o_all.view(-1, ns, d))
    return out.view(b, hq, nq, d).to(q.dtype), lse.view(b, hq, nq)


# --------------------------------------------------------------------------- the op

def moba_attention(q, k, v, *, causal: bool = True, scale: float | None = None,
                   chunk_size: int = DEFAULT_CHUNK_SIZE, topk: int = DEFAULT_TOPK, shared_selection: bool = False,
                   chunk_means: torch.Tensor | None = None, return_lse: bool = False, backend: str = "auto"):
    """MoBA attention on the shared layout (q [b, hq, nq, d], k/v [b, hk, nk, d]).

    chunk_size: keys per chunk. topk: chunks per query, own chunk included (1 = own chunk only).
    shared_selection: the query heads of a KV group select together (sum of their gate scores).
    chunk_means: [b, hk, >= m, d] means of the first m full chunks of ``k`` (``moba_chunk_means``),
    reused instead of recomputed; chunks not covered are computed from ``k``.
    Non-causal: the own chunk (the chunk holding the query's bottom-right position) has no mask and
    the other topk - 1 chunks are chosen among ALL chunks, past and future (a query with no
    position, non-causal q_len > kv_len, chooses topk chunks). Returns out (and float32 LSE).
    """
    check_qkv(q, k, v, causal)
    check_int("moba_attention", "chunk_size", chunk_size, 1)
    check_int("moba_attention", "topk", topk, 1)
    scale = default_scale(scale, q.shape[-1])
    backend = resolve_backend(backend, q, k, v)
    if chunk_means is not None:
        if chunk_means.dim() != 4 or chunk_means.shape[:2] != k.shape[:2] or chunk_means.shape[-1] != k.shape[-1]:
            raise ValueError(f"chunk_means must be [b, kv_heads, n_chunks, d] = [{k.shape[0]}, {k.shape[1]}, *, "
                             f"{k.shape[-1]}]; got {tuple(chunk_means.shape)}")
        full = k.shape[2] // chunk_size
        if chunk_means.shape[2] > full:  # means of chunks these keys do not have: not means of this cache
            raise ValueError(f"moba_attention: chunk_means has {chunk_means.shape[2]} chunks; allowed: at most {full} "
                             f"(the full chunks of {k.shape[2]} keys with chunk_size={chunk_size})")
        chunk_means = chunk_means.detach()
    bad = nonfinite_rows(k, v)
    if bad is not None:
        return isolate_nonfinite(
            lambda q_, k_, v_: moba_attention(q_, k_, v_, causal=causal, scale=scale, chunk_size=chunk_size, topk=topk,
                                              shared_selection=shared_selection, chunk_means=chunk_means,
                                              return_lse=return_lse, backend=backend),
            q, k, v, bad, return_lse)
    b, hq, nq, d = q.shape
    if nq == 0 or k.shape[2] == 0:
        out = q.new_zeros(q.shape)
        lse = torch.full((b, hq, nq), float("-inf"), dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    nk = k.shape[2]
    if topk >= math.ceil(nk / chunk_size):
        # every query's union is every chunk it may see: exact (causal) attention, done densely
        return exact_attention(q, k, v, causal=causal, scale=scale, return_lse=return_lse, backend=backend)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if nq == 1 and causal and backend == "torch" and not needs_grad:
        means = _prefix_means(k, chunk_size, (k.shape[2] - 1) // chunk_size, chunk_means)
        out, lse = _decode_one(q, k, v, means, chunk_size, topk, scale, shared_selection)
        return (out, lse.float()) if return_lse else out
    plan = _Plan(q, k, chunk_size, topk, causal, chunk_means, scale, shared_selection)
    if backend == "triton":
        out, lse = _triton_path(q, k, v, plan)
    elif needs_grad:
        out, lse = _MobaTorch.apply(q, k, v, plan)
    else:
        out, lse = _torch_forward(q, k, v, plan)
    return (out, lse.float()) if return_lse else out


# --------------------------------------------------------------------------- decode state

def _state_means(state: dict, k: torch.Tensor, C: int) -> torch.Tensor:
    """Means of every full chunk of the cache ``k``, kept in ``state`` and extended when a chunk
    fills: each chunk mean is computed once. The key row closing each cached chunk is kept as a
    fingerprint; if the cache no longer holds those rows (a new sequence, beam reordering, a
    cropped cache) the means are rebuilt from the keys."""
    nf = k.shape[2] // C
    means, probe = state.get("means"), state.get("probe")
    ok = (means is not None and state.get("chunk_size") == C and means.shape[:2] == k.shape[:2]
          and means.shape[-1] == k.shape[-1] and means.device == k.device)
    if ok:
        m = min(means.shape[2], nf)
        ok = m == 0 or torch.equal(probe[:, :, :m], k[:, :, C - 1: m * C: C])
        means, probe = means[:, :, :m], probe[:, :, :m]
    if not ok:
        means, probe = moba_chunk_means(k[:, :, :0], C), k[:, :, :0]
    m = means.shape[2]
    if m < nf:
        means = torch.cat([means, moba_chunk_means(k[:, :, m * C: nf * C], C)], dim=2)
        probe = torch.cat([probe, k[:, :, m * C + C - 1: nf * C: C]], dim=2)
    state.update(means=means, probe=probe, chunk_size=C)
    return means


def init_state(k, v, *, chunk_size: int = DEFAULT_CHUNK_SIZE, **_) -> dict:
    """Decode state of a layer from an existing KV cache in one pass (the chunk means)."""
    state: dict = {}
    _state_means(state, k, chunk_size)
    return state


def _run(q, k, v, *, causal=True, scale=None, backend="auto", buffers=None, state=None,
         chunk_size=DEFAULT_CHUNK_SIZE, topk=DEFAULT_TOPK, shared_selection=False, **_):
    means = None
    if state is not None and causal:
        means = _state_means(state, k.detach(), chunk_size)
    return moba_attention(q, k, v, causal=causal, scale=scale, chunk_size=chunk_size, topk=topk,
                          shared_selection=shared_selection, chunk_means=means, backend=backend)


def _exact_when(q_len: int, kv_len: int, params: dict) -> bool:
    """Where moba_attention short-cuts to exact attention: top-k covers every chunk."""
    return params["topk"] >= math.ceil(kv_len / params["chunk_size"])


def _exact_params(n: int, params: dict) -> dict:
    return {"topk": max(params["topk"], math.ceil(n / params["chunk_size"]))}


MOBA = register_method(Method(
    name="moba",
    summary="MoBA: each query attends to its own chunk + the top-k past chunks by q·mean(chunk keys)",
    prefill=_run,
    decode=_run,
    params={
        "chunk_size": positive_int("keys per chunk (the gate scores one mean key per chunk)", DEFAULT_CHUNK_SIZE),
        "topk": positive_int("chunks each query attends to, its own chunk included (1 = own chunk only)",
                             DEFAULT_TOPK),
        "shared_selection": Param(False, (bool,), "query heads of a KV group select chunks together "
                                  "(sum of their gate scores)"),
    },
    stateful=True,
    init_state=init_state,
    exact_when=_exact_when,
    exact_params=_exact_params,
))
