"""MoBA's fast CPU path (the ``torch`` backend): chunk means and the gate, own-chunk squares, the
past chunks each query chose on the executor's row form (``blocksparse.row_sparse_attention``:
grouped by chunk, "varlen", merged by LSE with the own chunk), the recomputing backward and the
one-token decode. The algorithm and its costs: the package docstring (``longpatch.methods.moba``)."""
from __future__ import annotations

import math

import torch

from ..blocksparse import block_runs, pairs_by_block, row_sparse_attention
from ..common import acc_dtype, gather_blocks, ordered_int
from ..cpu_flash import additive_mask, attend_rows, attend_spans, merge_spans, spans_ok
from ..lse_attention import attend

DEFAULT_CHUNK_SIZE = 2048
DEFAULT_TOPK = 4

_INT64_MIN = -(2 ** 63)
# Bounds of temporaries: gathered pair rows per window, score elements per gate block, and score
# elements per block of the backward recomputation.
_PAIR_ROWS = 1 << 19
_GATE_ELEMS = 1 << 22
_BWD_ELEMS = 1 << 23


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


def prefix_means(k: torch.Tensor, C: int, count: int, given: torch.Tensor | None) -> torch.Tensor:
    """Means [b, hk, count, d] of the first ``count`` full chunks: ``given`` as far as it goes, the
    rest computed from the keys."""
    have = 0 if given is None else min(given.shape[2], count)
    if have == count:
        return given[:, :, :count]
    rest = moba_chunk_means(k[:, :, have * C: count * C], C)
    return rest if have == 0 else torch.cat([given[:, :, :have].to(rest.dtype), rest], dim=2)


def select_chunks(qw: torch.Tensor, means: torch.Tensor, pos: torch.Tensor, C: int, topk: int, scale: float,
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


# --------------------------------------------------------------------------- the torch path

class Plan:
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


def torch_forward(q, k, v, plan: Plan):
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
                own, other = select_chunks(qw, means, pos, C, plan.topk, plan.scale, plan.causal, plan.shared)
                o_own, l_own = _own_attention(qw, k1, v1, a + plan.off, C, plan.causal, plan.scale)
                o, l = row_sparse_attention(qw, k1, v1, other, pos, C, plan.scale, extra=(o_own, l_own),
                                            causal=plan.causal)
                out[bi, heads, a:e] = o
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


def _torch_backward(q, k, v, out, lse, dout, dlse, plan: Plan):
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
                _, other = select_chunks(q[bi, heads, a:e], means, pos, C, plan.topk, plan.scale, plan.causal,
                                         plan.shared)
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
                ent, row, ch = pairs_by_block(other, g, e - a)
                if ent.numel() == 0:
                    continue
                qp = qw.reshape(-1, plan.d).index_select(0, row)
                dop = dow.reshape(-1, plan.d).index_select(0, row)
                lp = lw.reshape(-1).index_select(0, row)
                dp = dw.reshape(-1).index_select(0, row)
                dqp = torch.zeros_like(qp)
                for c, s, t in block_runs(ch):
                    ks, ke = c * C, min((c + 1) * C, plan.nk)
                    tile = max(1, _BWD_ELEMS // max(1, ke - ks))
                    for r0 in range(s, t, tile):
                        r1 = min(t, r0 + tile)
                        gq, gk, gv = _block_grads(qp[r0:r1], k1[ks:ke], v1[ks:ke], dop[r0:r1], lp[r0:r1], dp[r0:r1],
                                                  plan.scale)
                        dqp[r0:r1] = gq
                        dk1[ks:ke] += gk
                        dv1[ks:ke] += gv
                # rows index qw [g, m, d] flattened in its logical order; qw may be a strided view (the
                # [b, n, h, d] -> [b, h, n, d] transpose a model hands over), so a fresh tensor of its shape
                dqw += dqp.new_zeros((qw.shape[0] * qw.shape[1], plan.d)).index_add_(0, row, dqp).view(qw.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class MobaTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan):
        out, lse = torch_forward(q, k, v, plan)
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


def decode_one(q, k, v, means, C: int, topk: int, scale: float, shared: bool, need_lse: bool = True):
    """One causal query per head (q_len = 1) against the cache, all heads at once: the gate, then
    attention to the selected chunks and the own (partial) chunk. Reads topk*C keys per head whatever
    the cache length (plus n/C chunk means for the gate). Returns (out, lse); lse may be None
    without ``need_lse``."""
    b, hq, _, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    g = hq // hk
    own = (nk - 1) // C
    sel = _gate_one(q.view(b, hk, g, d), means[:, :, :own], scale, shared, topk)  # all own past chunks are valid
    if sel is None:
        ko, vo = k[:, :, own * C:], v[:, :, own * C:]
        out, lse = attend(q, ko, vo, scale)
        return out, lse
    if spans_ok(q, k, v):
        return _decode_views(q, k, v, sel, own, C, scale, need_lse)
    hs, kk = sel.shape[2], sel.shape[3]
    # per selection group (query head, or KV head if shared): its own chunk first, then its picks
    ids = torch.cat([torch.full_like(sel[..., :1], own), sel], -1).flatten(2)  # [b, hk, hs*(kk+1)]
    ks = gather_blocks(k, ids, C).view(b, hk * hs, (kk + 1) * C, d)
    vs = gather_blocks(v, ids, C).view(b, hk * hs, (kk + 1) * C, d)
    seen = torch.ones((kk + 1) * C, dtype=torch.bool, device=q.device)
    seen[nk - own * C:C] = False  # the own chunk's slot rows past the query
    bias = additive_mask(seen, q.dtype).view(1, 1, 1, -1)
    return attend(q, ks, vs, scale, mask=bias)


def _decode_views(q, k, v, sel, own: int, C: int, scale: float, need_lse: bool):
    """``decode_one``'s attention on the cache in place: per selection group (query head, or KV head
    if shared) the rows of its picks and of its own chunk up to the query, as one softmax
    (``attend_rows``: two sparse calls for all heads). Where the cache's layout does not allow it,
    fused calls on views of the chunks (``attend_spans``), touching chunks joined."""
    b, hk, hs, kk = sel.shape
    nk = k.shape[2]
    picks = sel.sort(-1).values  # ascending rows (the order CSR rows list their entries in)
    pos = torch.cat([(picks.unsqueeze(-1) * C + torch.arange(C, device=q.device)).flatten(-2),
                     torch.arange(own * C, nk, device=q.device).expand(b, hk, hs, -1)], -1)
    res = attend_rows(q, k, v, pos.view(b, hk * hs, -1), scale, need_lse)
    if res is not None:
        return res
    groups = [(bi, hi, merge_spans([(own * C, nk)] + [(c * C, c * C + C) for c in chunks]))
              for bi, per_head in enumerate(sel.tolist())
              for hi, per_group in enumerate(per_head)
              for chunks in per_group]
    return attend_spans(q, k, v, groups, scale)
