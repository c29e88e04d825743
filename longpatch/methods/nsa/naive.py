"""NSA, readable: the definitions the fast path and the Triton kernels are tested against (tests
import them from here). ``nsa_reference`` computes the method from the paper's definitions one
query position at a time; the four ``*_reference`` primitives (plus ``blocks.topk_blocks``) define
it batched, and composed (``compose``) they are the differentiable path."""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from ..common import (
    acc_dtype,
    group_queries,
)
from ..lse_attention import attention_lse_reference
from .blocks import force_and_mask, topk_blocks, visible_cmp

# Score elements per block of query rows of the references.
_REF_ELEMS = 1 << 22


# --------------------------------------------------------------------------- primitives: references

def _row_blocks(nq: int, per_row: int):
    rows = max(1, _REF_ELEMS // max(1, per_row))
    for s in range(0, nq, rows):
        yield s, min(nq, s + rows)


def _softmax_parts(scores: torch.Tensor, vis: torch.Tensor):
    """(p, lse) of masked scores; rows with nothing visible give p = 0 and lse = -inf."""
    scores = scores.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(scores - safe.unsqueeze(-1)).masked_fill(~vis, 0.0)
    return p, lse


def compressed_attention_reference(q, k_cmp, v_cmp, *, scale, compress_block, compress_stride, kv_len):
    """Compressed branch: softmax attention of each query to the compressed blocks wholly at or
    before it. q [b, hq, nq, d], k_cmp/v_cmp [b, hk, nc, d] -> (out [b, hq, nq, d], lse [b, hq, nq])."""
    b, hq, nq, d = q.shape
    hk, nc = k_cmp.shape[1], k_cmp.shape[2]
    acc = acc_dtype(q.dtype)
    qg = group_queries(q, hk).to(acc)
    kc, vc = k_cmp.to(acc).unsqueeze(2), v_cmp.to(acc).unsqueeze(2)  # [b, hk, 1, nc, d]
    outs, lses = [], []
    for s, e in _row_blocks(nq, b * hq * nc):
        pos = torch.arange(kv_len - nq + s, kv_len - nq + e, device=q.device)
        vis = torch.arange(nc, device=q.device)[None, :] < visible_cmp(pos, compress_block, compress_stride)[:, None]
        p, lse = _softmax_parts(torch.matmul(qg[:, :, :, s:e], kc.transpose(-1, -2)) * scale, vis)
        outs.append(torch.matmul(p, vc))
        lses.append(lse)
    out = torch.cat(outs, 3).reshape(b, hq, nq, d) if outs else q.new_zeros(q.shape, dtype=acc)
    lse = torch.cat(lses, 3).reshape(b, hq, nq) if lses else q.new_zeros((b, hq, nq), dtype=acc)
    return out.to(q.dtype), lse


def selection_scores_reference(q, k_cmp, lse_cmp, *, scale, compress_block, compress_stride, select_block, kv_len,
                               init_blocks, local_blocks):
    """Importance [b, hk, nq, ns] float32 of each selection block (ns = ceil(kv_len / select_block))
    for each query: the compressed probabilities exp(scale q.k_cmp_i - lse_cmp) of the visible
    compressed blocks overlapping the block, summed over them and over the group's query heads.
    Forced blocks are +inf, blocks starting after the query -inf. No gradient (selection is discrete)."""
    b, hq, nq, d = q.shape
    hk, nc = k_cmp.shape[1], k_cmp.shape[2]
    ns = math.ceil(kv_len / select_block)
    qg = group_queries(q.detach(), hk).double()
    kc = k_cmp.detach().double().unsqueeze(2)
    # overlap matrix [nc, ns]: column j sums the compressed blocks overlapping selection block j
    i = torch.arange(nc, device=q.device)[:, None]
    j = torch.arange(ns, device=q.device)[None, :]
    start = i * compress_stride
    overlap = ((start < (j + 1) * select_block) & (start + compress_block > j * select_block)).double()
    out = torch.empty((b, hk, nq, ns), dtype=torch.float32, device=q.device)
    for s, e in _row_blocks(nq, b * hq * max(nc, ns)):
        pos = torch.arange(kv_len - nq + s, kv_len - nq + e, device=q.device)
        vis = torch.arange(nc, device=q.device)[None, :] < visible_cmp(pos, compress_block, compress_stride)[:, None]
        lse = group_queries(lse_cmp[:, :, s:e].detach().unsqueeze(-1), hk).double()
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        p = torch.exp((torch.matmul(qg[:, :, :, s:e], kc.transpose(-1, -2)) * scale).float().double() - lse)
        p = p.float().double().masked_fill(~vis, 0.0)  # probabilities are float32 values, as in the fast path
        imp = torch.matmul(p.sum(2), overlap).float()
        out[:, :, s:e] = force_and_mask(imp, pos, select_block, init_blocks, local_blocks)
    return out


def _gather_attention(q, k, v, tok, valid, scale):
    """q [b, hk, g, r, d] attends per (b, hk, row) to the keys tok [b, hk, r, L] (valid [b, hk, r, L]).
    Differentiable (gather). Returns out [b, hk, g, r, d] and lse [b, hk, g, r]."""
    b, hk, n, d = k.shape
    r, L = tok.shape[2], tok.shape[3]
    acc = acc_dtype(q.dtype)
    flat = torch.where(valid, tok, torch.zeros_like(tok)).reshape(b, hk, r * L, 1).expand(b, hk, r * L, d)
    ks = torch.gather(k.to(acc), 2, flat).view(b, hk, 1, r, L, d)
    vs = torch.gather(v.to(acc), 2, flat).view(b, hk, 1, r, L, d)
    scores = torch.einsum("bhgrd,bhgrld->bhgrl", q.to(acc), ks) * scale
    p, lse = _softmax_parts(scores, valid.unsqueeze(2))
    return torch.einsum("bhgrl,bhgrld->bhgrd", p, vs), lse


def selected_attention_reference(q, k, v, idx, *, scale, select_block, kv_len):
    """Selected branch: each query attends to the keys of its group's selected blocks idx
    [b, hk, nq, S] (-1 = empty) at positions <= its own. Returns (out, lse) like the others."""
    b, hq, nq, d = q.shape
    hk = k.shape[1]
    S = idx.shape[-1]
    qg = group_queries(q, hk)
    off = torch.arange(select_block, device=q.device)
    outs, lses = [], []
    for s, e in _row_blocks(nq, b * hq * S * select_block):
        pos = torch.arange(kv_len - nq + s, kv_len - nq + e, device=q.device)
        sel = idx[:, :, s:e]
        tok = (sel.unsqueeze(-1) * select_block + off).flatten(-2)  # [b, hk, r, S*l']
        valid = (sel >= 0).repeat_interleave(select_block, -1) & (tok <= pos[:, None]) & (tok < kv_len)
        o, l = _gather_attention(qg[:, :, :, s:e], k, v, tok, valid, scale)
        outs.append(o)
        lses.append(l)
    return _cat_rows(outs, lses, q)


def window_attention_reference(q, k, v, *, scale, window, kv_len):
    """Window branch: each query at position t attends to the keys (t - window, t]."""
    b, hq, nq, d = q.shape
    hk = k.shape[1]
    qg = group_queries(q, hk)
    off = torch.arange(-window + 1, 1, device=q.device)
    outs, lses = [], []
    for s, e in _row_blocks(nq, b * hq * window):
        pos = torch.arange(kv_len - nq + s, kv_len - nq + e, device=q.device)
        tok = (pos[:, None] + off[None, :]).expand(b, hk, e - s, window)
        o, l = _gather_attention(qg[:, :, :, s:e], k, v, tok, tok >= 0, scale)
        outs.append(o)
        lses.append(l)
    return _cat_rows(outs, lses, q)


def _cat_rows(outs, lses, q):
    b, hq, nq, d = q.shape
    acc = acc_dtype(q.dtype)
    if not outs:
        return q.new_zeros(q.shape), torch.full((b, hq, nq), float("-inf"), dtype=acc, device=q.device)
    return torch.cat(outs, 3).reshape(b, hq, nq, d).to(q.dtype), torch.cat(lses, 3).reshape(b, hq, nq)


REFERENCE = SimpleNamespace(compressed_attention=compressed_attention_reference,
                            selection_scores=selection_scores_reference,
                            selected_attention=selected_attention_reference,
                            window_attention=window_attention_reference)


# Block importances ranked at once, per tile of query rows (b x kv_heads x rows x blocks). Whole, the
# importances [b, hk, n, ns] float32 and their int64 ranking keys were 8.6 GB and 17 GB at 131k with
# blocks of 64: most of the 42 GB peak an H100 measured for the paper's NSA (docs/gpu.md). A tile of
# 1 << 26 is 256 MB of importances.
SCORE_ELEMS = 1 << 26


def compose(prims, q, k, v, k_cmp, v_cmp, cfg):
    """The method from its four primitives (references or Triton kernels) and topk_blocks. Returns
    the three branch outputs and LSEs."""
    kw = dict(scale=cfg.scale, kv_len=cfg.nk)
    blocks = dict(compress_block=cfg.l, compress_stride=cfg.s)
    o_c, l_c = prims.compressed_attention(q, k_cmp, v_cmp, **blocks, **kw)
    b, hq, nq, _ = q.shape
    rows = max(1, SCORE_ELEMS // (b * k_cmp.shape[1] * math.ceil(cfg.nk / cfg.sb)))
    with torch.no_grad():
        idx = []
        for r0 in range(0, nq, rows):  # rows r0.. are the last rows of the first nk - nq + r1 keys
            r1 = min(nq, r0 + rows)
            scores = prims.selection_scores(q[:, :, r0:r1], k_cmp, l_c[:, :, r0:r1], **blocks, select_block=cfg.sb,
                                            init_blocks=cfg.init_blocks, local_blocks=cfg.local_blocks,
                                            scale=cfg.scale, kv_len=cfg.nk - nq + r1)
            idx.append(topk_blocks(scores, cfg.num_selected))
        idx = torch.cat(idx, 2)
    o_s, l_s = prims.selected_attention(q, k, v, idx, select_block=cfg.sb, **kw)
    o_w, l_w = prims.window_attention(q, k, v, window=cfg.window, **kw)
    return (o_c, o_s, o_w), (l_c, l_s, l_w)


# --------------------------------------------------------------------------- per position, from the paper

def _softmax_rows(q1, keys, vals, scale):
    """q1 [h, d] vs keys/vals [m, d] (float64): (out [h, d], lse [h]); no key -> zeros, -inf."""
    out, lse = attention_lse_reference(q1[:, None], keys[None], vals[None], scale)
    return out[:, 0], lse[:, 0]


def nsa_reference(q, k, v, *, compress_block, compress_stride, select_block, num_selected, window, init_blocks,
               local_blocks, gates=(1 / 3, 1 / 3, 1 / 3), scale=None):
    """NSA from the paper's definitions, one query position at a time, float64.

    Returns the gated output, the three branch outputs, their LSEs [b, hq, nq, 3] and the selected
    blocks {(b, kv_head, row): sorted list}. Importance of selection block j = sum over the group's
    heads and over the visible compressed blocks i overlapping j of p_cmp, rounded to float32 like
    the op; ties go to the later block."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    g = hq // hk
    l, s, sb = compress_block, compress_stride, select_block
    scale = d ** -0.5 if scale is None else scale
    q, k, v = q.double(), k.double(), v.double()
    nc = 0 if nk < l else (nk - l) // s + 1
    ns = math.ceil(nk / sb)
    branches = torch.zeros(3, b, hq, nq, d, dtype=torch.float64)
    lse = torch.zeros(b, hq, nq, 3, dtype=torch.float64)
    chosen = {}
    for bi in range(b):
        for hi in range(hk):
            kc = torch.stack([k[bi, hi, i * s:i * s + l].mean(0) for i in range(nc)]) if nc else k.new_zeros(0, d)
            vc = torch.stack([v[bi, hi, i * s:i * s + l].mean(0) for i in range(nc)]) if nc else k.new_zeros(0, d)
            heads = slice(hi * g, (hi + 1) * g)
            for r in range(nq):
                t = nk - nq + r
                q1 = q[bi, heads, r]
                vis = [i for i in range(nc) if i * s + l - 1 <= t]
                o_c, l_c = _softmax_rows(q1, kc[vis], vc[vis], scale)
                p = torch.exp(q1 @ kc[vis].t() * scale - l_c[:, None]).sum(0) if vis else None
                own = t // sb
                imp = []
                for j in range(ns):
                    if j > own:
                        imp.append(float("-inf"))
                    elif j < init_blocks or own - local_blocks < j <= own:
                        imp.append(float("inf"))
                    else:
                        tot = sum(float(p[n]) for n, i in enumerate(vis) if i * s < (j + 1) * sb and i * s + l > j * sb)
                        imp.append(float(torch.tensor(tot, dtype=torch.float32)))
                order = sorted(range(ns), key=lambda j: (imp[j], j), reverse=True)
                sel = sorted(j for j in order[:num_selected] if imp[j] > float("-inf"))
                chosen[(bi, hi, r)] = sel
                toks = [x for j in sel for x in range(j * sb, min((j + 1) * sb, nk)) if x <= t]
                o_s, l_s = _softmax_rows(q1, k[bi, hi, toks], v[bi, hi, toks], scale)
                win = list(range(max(0, t - window + 1), t + 1))
                o_w, l_w = _softmax_rows(q1, k[bi, hi, win], v[bi, hi, win], scale)
                for n, (o, ll) in enumerate(((o_c, l_c), (o_s, l_s), (o_w, l_w))):
                    branches[n, bi, heads, r] = o
                    lse[bi, heads, r, n] = ll
    out = sum(w * o for w, o in zip(gates, branches))
    return out, branches, lse, chosen
