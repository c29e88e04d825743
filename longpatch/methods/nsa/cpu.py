"""NSA's fast CPU path (no gradient): per (batch, KV head) and per window of query rows, spread
over torch's threads as single-threaded workers; the steps and their costs: the package docstring
(``longpatch.methods.nsa``)."""
from __future__ import annotations

import functools
import math
import threading

import torch

from ..blocksparse import row_sparse_attention, workspace_buffer
from ..common import (
    gather_blocks,
    merge_lse,
    run_units,
)
from ..cpu_flash import additive_mask, cache_rows, hide_empty, row_scores, row_sum, softmax_lse
from ..lse_attention import attend
from .blocks import force_and_mask, topk_blocks, visible_cmp

# Bounds of temporaries: score elements per block of rows of the compressed GEMM,
# (row, block) pair elements and (row, selection block) scores per window of rows, rows per window
# chunk.
_CMP_ELEMS = 1 << 19
_PAIR_ELEMS = 1 << 22
_IMP_ELEMS = 1 << 21
_WIN_CHUNK = 128


# --------------------------------------------------------------------------- fast CPU path

def _banded(qh, k1, v1, off: int, C: int, A: int, B: int, hide, scale: float):
    """Attention of one KV group's rows qh [g, nq, d] (absolute positions off..) to a band of keys:
    rows go in chunks of C aligned to absolute multiples of C, and the chunk [p, p + C) reads the
    keys [p + A, p + B) (B <= C) minus those hide(t [R, 1], key [1, L]) -> bool marks for row t.
    ``hide`` must be the same for every chunk when rows and keys shift by C. Runs of full chunks
    are one batched fused call on overlapping strided views of the keys (no copy) with one shared
    mask; chunks cut by the rows' ends or by key 0 run one by one. Rows that see no key get
    out 0 and lse -inf. Returns out [g, nq, d] and lse [g, nq] float32."""
    g, nq, d = qh.shape
    dev = qh.device
    out = torch.empty_like(qh)
    lse = torch.empty((g, nq), dtype=torch.float32, device=dev)
    p, end = off, off + nq
    while p < end:
        c0 = p - p % C
        m = (end - p) // C if p == c0 and p + A >= 0 else 0  # full chunks from p whose keys start at >= 0
        e = p + m * C if m else min(end, c0 + C)
        ks = max(0, c0 + A)
        ke = max(ks, min(c0 + B, e))
        qpos = torch.arange(p, p + C if m else e, device=dev)
        kpos = torch.arange(ks, ke, device=dev)
        seen = ~hide(qpos[:, None], kpos[None, :])
        rows = slice(p - off, e - off)
        if ke <= ks:  # no key at all
            out[:, rows], lse[:, rows] = 0, float("-inf")
        elif m:  # chunk i reads keys [p + i*C + A, p + i*C + B): an unfold view of the cache
            kk = k1[ks: ks + (m - 1) * C + ke - ks].unfold(0, ke - ks, C).transpose(1, 2).unsqueeze(1)
            vv = v1[ks: ks + (m - 1) * C + ke - ks].unfold(0, ke - ks, C).transpose(1, 2).unsqueeze(1)
            qq = qh[:, rows].unflatten(1, (m, C)).transpose(0, 1)  # [m, g, C, d]
            o, l = hide_empty(*attend(qq, kk, vv, scale, mask=additive_mask(seen, qh.dtype)), seen.any(-1))
            out[:, rows] = o.transpose(0, 1).flatten(1, 2)
            lse[:, rows] = l.transpose(0, 1).flatten(1, 2)
        else:
            o, l = attend(qh[None, :, rows], k1[None, None, ks:ke], v1[None, None, ks:ke], scale,
                          mask=additive_mask(seen, qh.dtype))
            out[:, rows], lse[:, rows] = hide_empty(o[0], l[0], seen.any(-1))
        p = e
    return out, lse


def _shares_local(cfg) -> bool:
    """The local blocks lie inside every query's window: their attention is computed once and is
    both the selected branch's local part and part of the window branch."""
    return cfg.local_blocks > 0 and cfg.window >= cfg.sb * cfg.local_blocks


def _local_start(t: torch.Tensor, cfg) -> torch.Tensor:
    """First key of the local blocks of queries at positions t: block t // sb - local_blocks + 1."""
    return (torch.div(t, cfg.sb, rounding_mode="floor") - cfg.local_blocks + 1) * cfg.sb


def _local_part(qw, k1, v1, p0: int, cfg):
    """Attention of rows qw [g, r, d] (positions p0..) to their local blocks: keys from
    ``_local_start`` up to t; chunks of one selection block of rows."""
    sb = cfg.sb
    return _banded(qw, k1, v1, p0, sb, -sb * (cfg.local_blocks - 1), sb,
                   lambda t, key: (key > t) | (key < _local_start(t, cfg)), cfg.scale)


def _window_part(qw, k1, v1, p0: int, cfg, local):
    """Window branch of rows qw [g, r, d] (positions p0..): keys (t - window, t]. With ``local``
    (the local-block part, when the window contains it) only the window's keys before the local
    blocks are computed here and merged with it."""
    w, sb = cfg.window, cfg.sb
    if local is None:
        return _banded(qw, k1, v1, p0, _WIN_CHUNK, 1 - w, _WIN_CHUNK, lambda t, key: (key > t) | (key <= t - w),
                       cfg.scale)
    o, l = _banded(qw, k1, v1, p0, sb, 1 - w, -sb * (cfg.local_blocks - 1),
                   lambda t, key: (key <= t - w) | (key >= _local_start(t, cfg)), cfg.scale)
    return merge_lse(o, l, *local)


@functools.lru_cache(maxsize=64)
def _overlap_cols(ns: int, nv: int, sb: int, l: int, s: int, device: torch.device):
    """[2 * ns] int64, hi then lo: the prefix-sum columns that bound each selection block's
    overlapping compressed blocks (see ``_overlap_sum``), concatenated so that both are read in one
    index_select; cached, as a decode step asks the same ones each time."""
    j = torch.arange(ns, device=device)
    lo = torch.clamp(torch.div(j * sb - l, s, rounding_mode="floor") + 1, min=0, max=nv)
    hi = torch.clamp(torch.div((j + 1) * sb - 1, s, rounding_mode="floor") + 1, min=0, max=nv)
    return torch.cat([hi, lo])


def _overlap_sum(grp: torch.Tensor, ns: int, cfg) -> torch.Tensor:
    """Importance [r, ns] float32 of each selection block: grp [r, nv] (compressed probabilities
    summed over the group) summed over the compressed blocks overlapping the block. A float64
    prefix sum, read at each block's first and last overlapping compressed block: two columns per
    block instead of a gathered [r, ns, overlap] copy, for any block/stride/select sizes."""
    r, nv = grp.shape
    csum = torch.zeros((r, nv + 1), dtype=torch.float64, device=grp.device)
    torch.cumsum(grp, -1, dtype=torch.float64, out=csum[:, 1:])
    cols = _overlap_cols(ns, nv, cfg.sb, cfg.l, cfg.s, grp.device)  # [hi, lo]: one gather, not two
    hi, lo = csum.index_select(1, cols).view(r, 2, ns).unbind(1)
    return (hi - lo).float()


def _compressed_select(qw, kc, vc, pos, cfg, ws=None):
    """Compressed branch and selection for one window of rows of one KV group: qw [g, r, d] at
    positions pos [r], kc/vc [nc, d]. Returns out [g, r, d], lse [g, r] (None unless cfg.need_lse)
    and idx [r, num_selected]. Rows go in chunks whose [g, rows, nv] scores stay in cache; each
    chunk is one GEMM for the whole group (into the workspace ``ws``) and one fused softmax."""
    g, r, d = qw.shape
    out = torch.zeros_like(qw)
    lse = torch.full((g, r), float("-inf"), dtype=torch.float32, device=qw.device) if cfg.need_lse else None
    ns = int(pos[-1]) // cfg.sb + 1  # blocks that can hold a key <= the last query
    imp = torch.zeros((r, ns), dtype=torch.float32, device=qw.device)
    nvis = visible_cmp(pos, cfg.l, cfg.s)
    step = max(1, _CMP_ELEMS // max(1, g * int(nvis[-1])))
    for a in range(0, r, step):
        e = min(r, a + step)
        nv = int(nvis[e - 1])
        if nv == 0:
            continue
        qs = (qw[:, a:e] * cfg.scale).reshape(-1, d)
        sc = torch.matmul(qs, kc[:nv].transpose(0, 1), out=workspace_buffer(ws, "scores", (qs.shape[0], nv), qs))
        sc = sc.view(g, e - a, nv)  # scaled scores
        lo = int(nvis[a])
        if lo < nv:  # only the columns some row of the chunk cannot see need the causal mask
            hide = torch.arange(lo, nv, device=qw.device)[None, :] >= nvis[a:e, None]
            sc[:, :, lo:].masked_fill_(hide, float("-inf"))
        if lse is not None:
            lse[:, a:e] = torch.logsumexp(sc, -1).float()
        p = torch.softmax(sc, -1)
        if lo == 0:  # rows that see no compressed block: softmax of all -inf is nan; they get p = 0
            p.masked_fill_((nvis[a:e] == 0)[None, :, None], 0.0)
        if cfg.cmp_out:  # a zero compressed gate (training-free default) needs only the probabilities
            out[:, a:e] = torch.matmul(p.view(-1, nv), vc[:nv]).view(g, e - a, d).to(qw.dtype)
        imp[a:e] = _overlap_sum(p.sum(0, dtype=torch.float32), ns, cfg)
    imp = force_and_mask(imp, pos, cfg.sb, cfg.init_blocks, cfg.local_blocks)
    return out, lse, topk_blocks(imp, cfg.num_selected)


def fast_forward(q, k, v, k_cmp, v_cmp, cfg, gates):
    """The no-grad CPU path. Returns the gated output and the branch LSEs [b, hq, nq, 3] (None
    unless cfg.need_lse)."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    g = hq // hk
    off = nk - nq
    out = torch.empty_like(q)
    lse = torch.empty((b, hq, nq, 3), dtype=torch.float32, device=q.device) if cfg.need_lse else None
    kc_all, vc_all = k_cmp.to(q.dtype), v_cmp.to(q.dtype)
    # rows per window: the window's gathered (row, block) pairs hold rows * num_selected * g * d
    # elements; kept small so temporaries are reused from the heap rather than freshly mapped.
    # Windows end at absolute multiples of rows (a multiple of the chunk sizes of ``_banded``).
    # Also the window's [rows, selection blocks] importance and top-k keys are bounded (_IMP_ELEMS).
    align = math.lcm(cfg.sb, _WIN_CHUNK)
    rows = min(_PAIR_ELEMS // (cfg.num_selected * g * d), _IMP_ELEMS // -(-nk // cfg.sb))
    rows = max(align, rows // align * align)
    cuts = [0, *range(rows - off % rows, nq, rows), nq] if off % rows else [*range(0, nq, rows), nq]
    per_thread = threading.local()  # each worker's gather workspace, dropped with this call

    def window(unit):  # one window of rows of one (batch, KV head); writes its slice of out / lse
        bi, hi, a, e = unit
        heads = slice(hi * g, (hi + 1) * g)
        k1, v1 = k[bi, hi], v[bi, hi]
        pos = torch.arange(off + a, off + e, device=q.device)
        qw = q[bi, heads, a:e]
        if not hasattr(per_thread, "ws"):
            per_thread.ws = {}
        o_c, l_c, idx = _compressed_select(qw, kc_all[bi, hi], vc_all[bi, hi], pos, cfg, per_thread.ws)
        local = _local_part(qw, k1, v1, off + a, cfg) if _shares_local(cfg) else None
        if local is not None:  # blocks after (own - local_blocks) are in the local part
            own_blk = torch.div(pos, cfg.sb, rounding_mode="floor")
            idx = idx.masked_fill(idx > (own_blk - cfg.local_blocks)[:, None], -1)
        o_s, l_s = row_sparse_attention(qw, k1, v1, idx.unsqueeze(0), pos, cfg.sb, cfg.scale, local, per_thread.ws)
        o_w, l_w = _window_part(qw, k1, v1, off + a, cfg, local)
        out[bi, heads, a:e] = gated_sum((o_c, o_s, o_w), _gate_slice(gates, bi, heads, a, e)).to(q.dtype)
        if lse is not None:
            lse[bi, heads, a:e] = torch.stack([l_c, l_s, l_w], -1)

    # the costliest windows (last rows: most compressed and selectable blocks) first, so the
    # workers of run_units finish together
    run_units(window, [(bi, hi, a, e) for a, e in reversed(list(zip(cuts[:-1], cuts[1:])))
                       for bi in range(b) for hi in range(hk)])
    return out, lse


@functools.lru_cache(maxsize=8)
def _decode_consts(nk: int, sb: int, window: int, init_blocks: int, local_blocks: int, device: torch.device):
    """The index tensors of a decode step at cache length nk, made once per length and shared by the
    model's layers (each arange/tensor call is ~5-10 us of fixed cost, about what the step's
    arithmetic costs): block ids [ns], the forced blocks' ids (the first init_blocks and the
    local_blocks ending with the own one), the row offsets [sb] within a block, the window's key
    positions."""
    own = (nk - 1) // sb
    ids = torch.arange(own + 1, device=device)
    forced = torch.cat([ids[:init_blocks], ids[max(0, own - local_blocks + 1):]])
    return ids, forced, torch.arange(sb, device=device), torch.arange(max(0, nk - window), nk, device=device)


def _best_blocks(imp: torch.Tensor, num_selected: int, ids: torch.Tensor) -> torch.Tensor | None:
    """``topk_blocks`` of imp [r, ns] when every row has num_selected blocks scored above -inf (a
    decode step's usual case): ascending ids [r, num_selected] by its rule (one int64 key per block:
    NaN as -inf, ties to the later block); None otherwise (``topk_blocks`` pads with -1). ids:
    arange(ns).

    imp must hold only +0, positive numbers, +inf and NaN (``decode_one``'s: sums of probabilities,
    differences of a monotone prefix sum, forced blocks): for these the float32 bits read as int32
    already sort like the floats, and NaN -> -inf has negative bits, below all of them, so the key
    is ``ordered_int``'s order in 2 ops (not 8): bits * 2^32 + id, one add with alpha."""
    ns = imp.shape[-1]
    if ns < num_selected:
        return None
    bits = torch.nan_to_num(imp, nan=float("-inf")).view(torch.int32)
    key = torch.add(ids, bits, alpha=1 << 32)  # int64: (bits << 32) | id, as 0 <= id < 2^32
    top, pick = torch.topk(key, num_selected, dim=-1)
    if int(top.min()) < 0:  # a picked block scored -inf (or NaN): topk_blocks' -1 padding applies
        return None
    return pick.sort(-1).values


def decode_one(q, k, v, k_cmp, v_cmp, cfg, gates):
    """``fast_forward`` for one query per head (q_len = 1, the last position), every batch and KV
    head at once: a handful of batched calls instead of the windowed machinery, so a decode step is
    O(compressed + selected + window) tensor work with a fixed, small number of ops (each op costs
    microseconds, about what the step's arithmetic does, so the count matters). The g query heads
    of a KV group share the selection and K/V.

    The selected and window branches read their rows of the cache in place, both in one sparse
    score call and one weighted sum (``cpu_flash.cache_rows``): two softmaxes over one row list,
    their probabilities times the gates are the weights of one sum, which is the gated output."""
    b, hq, _, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    g, t = hq // hk, nk - 1
    qg = q.view(b, hk, g, d)
    nc = k_cmp.shape[2]
    own = t // cfg.sb
    ns = own + 1
    ids, forced, blk_rows, win = _decode_consts(nk, cfg.sb, cfg.window, cfg.init_blocks, cfg.local_blocks, q.device)
    o_c = l_c = None
    if nc:  # every complete block ends at or before the last position: all are visible
        # one bmm over the (batch, KV head) pairs: what matmul does for these shapes (the same
        # products), without its broadcasting and reshaping steps, a fixed cost per call here
        kc = k_cmp.to(q.dtype).flatten(0, 1).transpose(1, 2)  # [b * hk, d, nc], a view of the cache
        sc = torch.bmm((qg * cfg.scale).view(b * hk, g, d), kc).float()  # [b * hk, g, nc]
        if cfg.need_lse or cfg.cmp_out:
            l_c = torch.logsumexp(sc, -1)
            p = torch.exp(sc - l_c.unsqueeze(-1))
            l_c = l_c.view(b, hk, g)
        else:  # the training-free default: the branch only ranks the blocks
            p = torch.softmax(sc, -1)
        if cfg.cmp_out:
            o_c = torch.matmul(p.view(b, hk, g, nc).to(q.dtype), v_cmp.to(q.dtype))
        imp = _overlap_sum(p.sum(1), ns, cfg)  # [b * hk, ns], a fresh tensor
    else:
        imp = torch.zeros((b * hk, ns), dtype=torch.float32, device=q.device)
    # forced blocks (as force_and_mask for the last position: no block starts after it)
    imp.index_fill_(1, forced, float("inf"))
    picks = _best_blocks(imp, cfg.num_selected, ids)
    w0 = max(0, nk - cfg.window)
    if picks is not None and q.dtype == torch.float32:  # every slot holds a block, the own one last
        # per KV head: the picked blocks, the own one up to t (the same rows: one list), the window
        sel = torch.add(blk_rows, picks.view(b, hk, -1, 1), alpha=cfg.sb).flatten(2)
        rows = cache_rows(k, v, hq, sel[..., :(cfg.num_selected - 1) * cfg.sb + t % cfg.sb + 1], win)
        if rows is not None:
            return _gated_rows(q, rows, o_c, l_c, cfg, gates)
    idx = topk_blocks(imp.view(b, hk, 1, ns), cfg.num_selected)[:, :, 0]  # ascending, -1 pads at the end
    if bool((idx >= 0).all()):
        # every slot holds a block and the last is the own one (forced, the largest): the full
        # past blocks and the own block's rows up to t are exactly the keys, no mask needed
        ks, vs = (torch.cat([gather_blocks(x[:, :, :own * cfg.sb], idx[..., :-1], cfg.sb),
                             x[:, :, own * cfg.sb:]], 2) for x in (k, v))
        o_s, l_s = attend(qg, ks, vs, cfg.scale)
    else:  # fewer blocks than slots (a short cache, or blocks scored -inf): mask the empty slots
        tok = (idx.clamp(min=0).unsqueeze(-1) * cfg.sb + torch.arange(cfg.sb, device=q.device)).flatten(-2)
        seen = (idx.unsqueeze(-1) >= 0).expand(-1, -1, -1, cfg.sb).flatten(-2) & (tok <= t)
        ks, vs = gather_blocks(k, idx, cfg.sb), gather_blocks(v, idx, cfg.sb)  # rows not seen: masked
        o_s, l_s = attend(qg, ks, vs, cfg.scale, mask=additive_mask(seen, q.dtype).unsqueeze(2))
    o_w, l_w = attend(qg, k[:, :, w0:], v[:, :, w0:], cfg.scale)
    if isinstance(gates, torch.Tensor):
        o_c = torch.zeros_like(qg) if o_c is None else o_c
        out = gated_sum((o_c, o_s, o_w), gates.expand(b, hq, 1, 3).reshape(b, hk, g, 3))
    elif o_c is None:  # no compressed output (a zero gate, or no complete block): g_cmp * 0 left out
        out = float(gates[1]) * o_s + float(gates[2]) * o_w
    else:
        out = gated_sum((o_c, o_s, o_w), gates)
    out = out.to(q.dtype).reshape(b, hq, 1, d)
    if not cfg.need_lse:
        return out, None
    if l_c is None:
        l_c = torch.full((b, hk, g), float("-inf"), dtype=torch.float32, device=q.device)
    lse = torch.stack([l_c, l_s, l_w], -1).reshape(b, hq, 1, 3)
    return out, lse


def _gated_rows(q, rows, o_c, l_c, cfg, gates):
    """``decode_one``'s selected and window branches on ``rows`` (``cpu_flash.cache_rows``: the
    selected rows, then the window), gated and summed with the compressed output o_c [b, hk, g, d]
    (None: left out): one softmax per branch, whose probabilities times the gates weigh one sum.
    Returns (out [b, hq, 1, d], branch LSEs [b, hq, 1, 3] or None)."""
    b, hq, _, d = q.shape
    s_sel, s_win = row_scores(q, rows, cfg.scale)
    (p_s, l_s), (p_w, l_w) = softmax_lse(s_sel, cfg.need_lse), softmax_lse(s_win, cfg.need_lse)
    if isinstance(gates, torch.Tensor):  # per-head gates [b * hq, 3]
        gates = gates.expand(b, hq, 1, 3).reshape(b * hq, 3).to(torch.float32)
        g_c, g_s, g_w = gates[:, :1], gates[:, 1:2], gates[:, 2:]
        o_c = torch.zeros_like(q) if o_c is None else o_c
    else:
        g_c, g_s, g_w = (float(x) for x in gates)
    out = row_sum(rows, [p_s.mul_(g_s), p_w.mul_(g_w)])  # g_s * selected + g_w * window
    if o_c is not None:
        out = out + g_c * o_c.reshape(b * hq, d).to(torch.float32)
    out = out.to(q.dtype).view(b, hq, 1, d)
    if not cfg.need_lse:
        return out, None
    if l_c is None:
        l_c = torch.full((b * hq, 1), float("-inf"), dtype=torch.float32, device=q.device)
    return out, torch.cat([l_c.reshape(b * hq, 1), l_s, l_w], 1).view(b, hq, 1, 3)


def _gate_slice(gates, bi, heads, a, e):
    if isinstance(gates, torch.Tensor):
        return gates[bi if gates.shape[0] > 1 else 0, heads if gates.shape[1] > 1 else slice(None),
                     slice(a, e) if gates.shape[2] > 1 else slice(None)]
    return gates


def gated_sum(outs, gates):
    """sum_i gate_i * out_i; gates a 3-tuple of floats or a tensor [..., 3] broadcasting over rows."""
    if isinstance(gates, torch.Tensor):
        return sum(gates[..., i:i + 1].to(o.dtype) * o for i, o in enumerate(outs))
    return sum(float(w) * o for w, o in zip(gates, outs))
