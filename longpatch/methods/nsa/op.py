"""NSA, Native Sparse Attention (DeepSeek, arXiv 2502.11089), training-free and trainable.

Each query attends through three branches and sums them with gates (g_cmp, g_slc, g_win):

* compressed: keys/values pooled in blocks of ``compress_block`` (l) positions with stride
  ``compress_stride`` (s); block i covers keys [i*s, i*s + l) and a query at position t sees it only
  when it lies wholly at or before t (i*s + l - 1 <= t). Pooling is the mean (training-free) or a
  learned MLP (``NSAAttention``, trainable);
* selected: keys cut into selection blocks of ``select_block`` (l') positions. The importance of
  block j for a query is the compressed attention probability mass of the compressed blocks that
  overlap j, summed over the query heads of the GQA group, so the group shares one selection. The
  ``num_selected`` best blocks are attended to, always including the first ``init_blocks`` blocks
  and the ``local_blocks`` blocks ending with the query's own block (causal inside it);
* window: the last ``window`` keys (t - window, t].

Only causal attention is defined (a query's compressed and selected blocks are chosen among the
past); ``causal=False`` is an error. Positions are bottom-right: query row i of nq sits at
nk - nq + i, so the same op serves prefill, chunked prefill and decoding.

Readable PyTorch twins of the four primitives (``compressed_attention_reference``,
``selection_scores_reference``, ``selected_attention_reference``, ``window_attention_reference``)
plus the shared ``topk_blocks`` define the method; the Triton kernels in ``longpatch.kernels.nsa``
are tested against them, and composed they are the differentiable path (gradients flow through
every branch, the selection itself is discrete as in the paper).

Fast CPU path (no gradient): per (batch, KV head) and per window of query rows, so every
temporary is bounded by the window; the windows are independent units spread over torch's threads
as single-threaded workers (``run_units``), each with its own warm workspace for gathers and GEMMs:

1. compressed: one GEMM [g*rows, d] x [d, visible blocks] for the whole GQA group and one fused
   softmax; the probabilities give the branch output (a second GEMM) and the importance (group sum,
   then a prefix sum read at each selection block's first and last overlapping compressed block),
   then top-k;
2. local blocks: the keys from the start of block (own - local_blocks + 1) up to the query, per
   block of rows as one batched fused call. When the window contains them (window >= select_block
   * local_blocks) this one result is both the selected branch's local part and part of the window;
3. selected, group-centric "varlen" grouping: the other (position, block) pairs are sorted by
   block; the rows of one block are cut into items of T * 2^j rows, and all items of one size are
   one batched fused call over all g heads of their rows, so a block is read once per item
   whatever the group size; parts merge by LSE;
4. window: the keys of the window before the local blocks (or the whole window when it does not
   contain them), per chunk of rows as one batched fused call with a shared band mask (strided
   views of the cache, no copy), merged with the local part.

Decoding: ``compressed=(k_cmp, v_cmp)`` (``nsa_compress``) are reused instead of pooling the cache;
the registered method keeps them in the layer state and appends the newly completed blocks, so a
step costs O(compressed + selected + window), not O(cache).
"""
from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import torch

from ..errors import ConfigError
from .base import Method, Param, nonneg_int, positive_int, register_method
from .common import (
    acc_dtype,
    check_gates,
    check_qkv,
    default_scale,
    gather_rows,
    group_queries,
    isolate_nonfinite,
    merge_lse,
    nonfinite_rows,
    ordered_int,
    probe_positions,
    resolve_backend,
    run_units,
)
from .cpu_flash import additive_mask, flash_lse, fused_ok, hide_empty

DEFAULTS = dict(compress_block=32, compress_stride=16, select_block=64, num_selected=16, window=512,
                init_blocks=1, local_blocks=2)
DEFAULT_GATES = (1 / 3, 1 / 3, 1 / 3)  # the op's neutral default (issue #7's API)
# Training-free patching of a pretrained model: the mean-pooled compressed branch only ranks the
# selection blocks; mixing its blurred output in costs perplexity (docs/nsa.md, measured).
TRAINING_FREE_GATES = (0.0, 0.75, 0.25)

# Bounds of temporaries: score elements per block of rows (references and the compressed GEMM),
# (row, block) pair elements and (row, selection block) scores per window of rows, rows per window
# chunk, query rows per tile.
_REF_ELEMS = 1 << 22
_CMP_ELEMS = 1 << 19
_PAIR_ELEMS = 1 << 22
_IMP_ELEMS = 1 << 21
_WIN_CHUNK = 128
_TILE_ROWS = 64


# --------------------------------------------------------------------------- parameters

def _check_params(compress_block, compress_stride, select_block, num_selected, window, init_blocks, local_blocks):
    """One-line ValueErrors for bad block parameters."""
    for name, val, low in (("compress_block", compress_block, 1), ("compress_stride", compress_stride, 1),
                           ("select_block", select_block, 1), ("num_selected", num_selected, 1),
                           ("window", window, 1), ("init_blocks", init_blocks, 0), ("local_blocks", local_blocks, 0)):
        if not isinstance(val, int) or isinstance(val, bool) or val < low:
            raise ValueError(f"{name} must be an int >= {low}; got {val!r}")
    if compress_stride > compress_block:
        raise ValueError(f"compress_stride ({compress_stride}) must be <= compress_block ({compress_block}): "
                         "a larger stride would leave keys out of every compressed block")
    if init_blocks + local_blocks > num_selected:
        raise ValueError(f"num_selected ({num_selected}) must be >= init_blocks + local_blocks "
                         f"({init_blocks} + {local_blocks}): the forced blocks must fit in the selection")


def num_compressed(kv_len: int, compress_block: int, compress_stride: int) -> int:
    """Number of complete compressed blocks of a kv_len-key sequence."""
    return 0 if kv_len < compress_block else (kv_len - compress_block) // compress_stride + 1


def _visible_cmp(pos: torch.Tensor, l: int, s: int) -> torch.Tensor:
    """Compressed blocks visible at absolute positions pos: count of i with i*s + l - 1 <= t."""
    return torch.where(pos >= l - 1, torch.div(pos - (l - 1), s, rounding_mode="floor") + 1, torch.zeros_like(pos))


# --------------------------------------------------------------------------- primitives: references

def nsa_compress(k: torch.Tensor, v: torch.Tensor, *, compress_block: int = 32, compress_stride: int = 16):
    """Mean-pooled compressed keys/values: k/v [b, hk, nk, d] -> [b, hk, nc, d], nc complete blocks
    (block i = keys [i*s, i*s + l)); same dtype as k, summed in float32 (float64 for float64)."""
    if not isinstance(compress_block, int) or compress_block < 1 or not isinstance(compress_stride, int) \
            or not 1 <= compress_stride <= compress_block:
        raise ValueError("need ints 1 <= compress_stride <= compress_block; "
                         f"got {compress_stride!r}, {compress_block!r}")
    if k.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k, v must be [b, kv_heads, n, d] with the same first 3 dims; "
                         f"got {tuple(k.shape)}, {tuple(v.shape)}")
    nc = num_compressed(k.shape[2], compress_block, compress_stride)

    def pool(x):
        if nc == 0:
            return x.new_zeros((*x.shape[:2], 0, x.shape[-1]))
        blocks = x[:, :, : (nc - 1) * compress_stride + compress_block].unfold(2, compress_block, compress_stride)
        return (blocks.sum(-1, dtype=acc_dtype(x.dtype)) / compress_block).to(x.dtype)  # [b, h, nc, d]

    return pool(k), pool(v)


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
        vis = torch.arange(nc, device=q.device)[None, :] < _visible_cmp(pos, compress_block, compress_stride)[:, None]
        p, lse = _softmax_parts(torch.matmul(qg[:, :, :, s:e], kc.transpose(-1, -2)) * scale, vis)
        outs.append(torch.matmul(p, vc))
        lses.append(lse)
    out = torch.cat(outs, 3).reshape(b, hq, nq, d) if outs else q.new_zeros(q.shape, dtype=acc)
    lse = torch.cat(lses, 3).reshape(b, hq, nq) if lses else q.new_zeros((b, hq, nq), dtype=acc)
    return out.to(q.dtype), lse


def _force_and_mask(imp: torch.Tensor, pos: torch.Tensor, sb: int, init_blocks: int, local_blocks: int):
    """imp [..., r, ns] float32: forced blocks (first init_blocks, and the local_blocks ending with
    the own block) -> +inf; blocks starting after the query -> -inf."""
    ns = imp.shape[-1]
    j = torch.arange(ns, device=imp.device)[None, :]
    own = torch.div(pos, sb, rounding_mode="floor")[:, None]
    forced = (j < init_blocks) | ((j <= own) & (j > own - local_blocks))
    imp = imp.masked_fill(forced, float("inf"))
    return imp.masked_fill(j > own, float("-inf"))


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
        vis = torch.arange(nc, device=q.device)[None, :] < _visible_cmp(pos, compress_block, compress_stride)[:, None]
        lse = group_queries(lse_cmp[:, :, s:e].detach().unsqueeze(-1), hk).double()
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        p = torch.exp((torch.matmul(qg[:, :, :, s:e], kc.transpose(-1, -2)) * scale).float().double() - lse)
        p = p.float().double().masked_fill(~vis, 0.0)  # probabilities are float32 values, as in the fast path
        imp = torch.matmul(p.sum(2), overlap).float()
        out[:, :, s:e] = _force_and_mask(imp, pos, select_block, init_blocks, local_blocks)
    return out


def topk_blocks(scores: torch.Tensor, num_selected: int) -> torch.Tensor:
    """The num_selected best blocks per row of scores [..., ns]: int64 [..., num_selected], sorted
    ascending by block id, -1 (at the end) for empty slots and for blocks scored -inf. Ties go to
    the later block (score and block id form one int64 key), whatever order torch.topk returns."""
    *lead, ns = scores.shape
    kk = min(num_selected, ns)
    blk = torch.arange(ns, device=scores.device)
    idx = torch.full((*lead, num_selected), -1, dtype=torch.long, device=scores.device)
    if kk == 0:
        return idx
    key = (ordered_int(scores).to(torch.int64) << 32) | blk
    pick = torch.topk(key, kk, dim=-1, sorted=False).indices
    ok = scores.gather(-1, pick) > float("-inf")
    pick = torch.where(ok, pick, torch.full_like(pick, ns)).sort(-1).values
    idx[..., :kk] = torch.where(pick == ns, torch.full_like(pick, -1), pick)
    return idx


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


def _compose(prims, q, k, v, k_cmp, v_cmp, cfg):
    """The method from its four primitives (references or Triton kernels) and topk_blocks. Returns
    the three branch outputs and LSEs."""
    kw = dict(scale=cfg.scale, kv_len=cfg.nk)
    blocks = dict(compress_block=cfg.l, compress_stride=cfg.s)
    o_c, l_c = prims.compressed_attention(q, k_cmp, v_cmp, **blocks, **kw)
    with torch.no_grad():
        scores = prims.selection_scores(q, k_cmp, l_c, **blocks, select_block=cfg.sb, init_blocks=cfg.init_blocks,
                                        local_blocks=cfg.local_blocks, **kw)
        idx = topk_blocks(scores, cfg.num_selected)
    o_s, l_s = prims.selected_attention(q, k, v, idx, select_block=cfg.sb, **kw)
    o_w, l_w = prims.window_attention(q, k, v, window=cfg.window, **kw)
    return (o_c, o_s, o_w), (l_c, l_s, l_w)


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
            o, l = hide_empty(*flash_lse(qq, kk, vv, scale, additive_mask(seen, qh.dtype)), seen.any(-1))
            out[:, rows] = o.transpose(0, 1).flatten(1, 2)
            lse[:, rows] = l.transpose(0, 1).flatten(1, 2)
        else:
            o, l = flash_lse(qh[None, :, rows], k1[None, None, ks:ke], v1[None, None, ks:ke], scale,
                             additive_mask(seen, qh.dtype))
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


def _overlap_sum(grp: torch.Tensor, ns: int, cfg) -> torch.Tensor:
    """Importance [r, ns] float32 of each selection block: grp [r, nv] (compressed probabilities
    summed over the group) summed over the compressed blocks overlapping the block. A float64
    prefix sum, read at each block's first and last overlapping compressed block: two columns per
    block instead of a gathered [r, ns, overlap] copy, for any block/stride/select sizes."""
    r, nv = grp.shape
    csum = torch.zeros((r, nv + 1), dtype=torch.float64, device=grp.device)
    torch.cumsum(grp, -1, dtype=torch.float64, out=csum[:, 1:])
    j = torch.arange(ns, device=grp.device)
    lo = torch.clamp(torch.div(j * cfg.sb - cfg.l, cfg.s, rounding_mode="floor") + 1, min=0, max=nv)
    hi = torch.clamp(torch.div((j + 1) * cfg.sb - 1, cfg.s, rounding_mode="floor") + 1, min=0, max=nv)
    return (csum.index_select(1, hi) - csum.index_select(1, lo)).float()


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
    nvis = _visible_cmp(pos, cfg.l, cfg.s)
    step = max(1, _CMP_ELEMS // max(1, g * int(nvis[-1])))
    for a in range(0, r, step):
        e = min(r, a + step)
        nv = int(nvis[e - 1])
        if nv == 0:
            continue
        qs = (qw[:, a:e] * cfg.scale).reshape(-1, d)
        sc = torch.matmul(qs, kc[:nv].transpose(0, 1), out=_buffer(ws, "scores", (qs.shape[0], nv), qs))
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
    imp = _force_and_mask(imp, pos, cfg.sb, cfg.init_blocks, cfg.local_blocks)
    return out, lse, topk_blocks(imp, cfg.num_selected)


def _blocks_of(x1: torch.Tensor, sb: int):
    """x1 [n, d] as selection blocks: (a view [n // sb, sb, d] of the full blocks, the partial last
    block zero-padded to sb rows [0 or 1, sb, d]). No copy of the cache (decoding reads O(selected))."""
    nf = x1.shape[0] // sb
    full = x1[: nf * sb].view(nf, sb, x1.shape[1])
    tail = x1[nf * sb:]
    last = torch.nn.functional.pad(tail, (0, 0, 0, sb - tail.shape[0])).unsqueeze(0) if tail.shape[0] else full[:0]
    return full, last


def _buffer(ws: dict | None, key: str, shape, like: torch.Tensor) -> torch.Tensor | None:
    """A tensor of ``shape`` (dtype/device of ``like``) from the workspace ``ws`` of the calling
    thread, reused from call to call, or None without a workspace. On the CPU, writing a GEMM or a
    gather into a warm buffer is 1.3x (GEMM) to 3-5x (index_select) faster than into a fresh tensor
    (measured for the MB-sized temporaries here). Valid until the next request of the same key."""
    if ws is None:
        return None
    n = math.prod(shape)
    buf = ws.get(key)
    if buf is None or buf.numel() < n or buf.dtype != like.dtype:
        buf = ws[key] = torch.empty(n + n // 4, dtype=like.dtype, device=like.device)
    return buf[:n].view(shape)


def _take(x: torch.Tensor, index: torch.Tensor, ws: dict | None, key: str) -> torch.Tensor:
    """x.index_select(0, index), into the workspace buffer ``key`` when there is a workspace."""
    out = _buffer(ws, key, (index.numel(), *x.shape[1:]), x)
    return x.index_select(0, index) if out is None else torch.index_select(x, 0, index, out=out)


def _gather_blocks(xb, blocks: torch.Tensor, ws: dict | None = None, key: str = "") -> torch.Tensor:
    """[len(blocks), 1, sb, d]: the selection blocks of ``_blocks_of`` (the padded tail is block nf)."""
    full, last = xb
    nf = full.shape[0]
    if last.shape[0] == 0:
        return _take(full, blocks, ws, key).unsqueeze(1)
    if nf:
        out = _take(full, torch.clamp(blocks, max=nf - 1), ws, key)
    else:
        out = last.expand(blocks.numel(), -1, -1).clone()
    is_tail = blocks == nf
    if bool(is_tail.any()):
        out[is_tail] = last[0]
    return out.unsqueeze(1)


def _selected_fast(qw, kb, vb, idx, pos, cfg, shared=None, ws=None):
    """Selected branch for one window of rows of one KV group, group-centric. qw [g, r, d] at
    positions pos [r]; kb/vb the keys/values cut into selection blocks (``_blocks_of``).

    Every (row, selected block) pair carries the g query heads of its row. Pairs are sorted by
    block; the rows of one block form a segment, cut into items of T * 2^j rows (T * g ~
    _TILE_ROWS query rows), and the items of one size are ONE batched fused call: a block's K/V is
    read once per item for all heads and rows in it. Own blocks (the only ones that can reach past a
    query) form their own buckets with a causal mask. With ``shared`` (out, lse of the local blocks,
    see ``_local_part``) the local blocks are left out of the pairs and that part joins the merge
    instead. The parts merge by LSE per (row, head).
    ``ws``: a workspace dict of the calling thread for the gathers (``_take``)."""
    g, r, d = qw.shape
    S = idx.shape[-1]
    sb = cfg.sb
    nb = kb[0].shape[0] + kb[1].shape[0]
    dev = qw.device
    T = max(1, _TILE_ROWS // g)
    flat = idx.reshape(-1)
    keep = flat >= 0
    if shared is not None:  # blocks after (own - local_blocks) are in the local part
        own_blk = torch.div(pos, sb, rounding_mode="floor")
        keep &= (idx <= (own_blk - cfg.local_blocks)[:, None]).reshape(-1)
    ent = torch.nonzero(keep).squeeze(1)  # pair = (row, slot)
    row = torch.div(ent, S, rounding_mode="floor")
    blk = flat[ent]
    own = blk == torch.div(pos[row], sb, rounding_mode="floor")
    key, order = torch.sort(blk + own.long() * nb, stable=True)
    row = row[order]
    seg_key, counts = torch.unique_consecutive(key, return_counts=True)
    seg = torch.repeat_interleave(torch.arange(counts.numel(), device=dev), counts)
    rank = torch.arange(row.numel(), device=dev) - (torch.cumsum(counts, 0) - counts)[seg]
    # a segment of c rows (m = ceil(c / T) units of T rows) is cut into items of T * 2^j rows, one
    # per set bit j of m, largest first: padding only inside the last unit. The item holding unit u
    # is the highest bit in which u and m differ. Items of one size (and own-ness) are one call.
    m = torch.div(counts + T - 1, T, rounding_mode="floor")[seg]
    bit = torch.floor(torch.log2((torch.div(rank, T, rounding_mode="floor") ^ m).double())).long()
    within = rank - ((m >> (bit + 1)) << (bit + 1)) * T  # row offset inside its item
    group = bit * 2 + (seg_key >= nb).long()[seg]
    qt = qw.transpose(0, 1).reshape(r, g * d)
    parts = []
    for gk in torch.unique(group).tolist():
        B, is_own = T << (gk // 2), gk % 2 == 1
        pick = torch.nonzero(group == gk).squeeze(1)
        segs, item = torch.unique_consecutive(seg[pick], return_inverse=True)  # pairs are sorted by segment
        slot = item * B + within[pick]
        slot_row = torch.zeros(segs.numel() * B, dtype=torch.long, device=dev)
        slot_row[slot] = row[pick]
        real = torch.zeros(segs.numel() * B, dtype=torch.bool, device=dev)
        real[slot] = True
        blocks = seg_key[segs] % nb
        qq = _take(qt, slot_row, ws, "q").view(segs.numel(), 1, B * g, d)
        kk, vv = _gather_blocks(kb, blocks, ws, "k"), _gather_blocks(vb, blocks, ws, "v")
        bias = None
        if is_own:  # keys after the row's position are hidden; padding rows see everything
            kpos = blocks[:, None] * sb + torch.arange(sb, device=dev)
            ppos = torch.where(real, pos[slot_row], torch.full_like(slot_row, 1 << 62)).view(-1, B, 1)
            bias = additive_mask(kpos[:, None, :] <= ppos, qw.dtype)  # [segs, B, l']
            bias = bias.unsqueeze(2).expand(-1, B, g, sb).reshape(-1, 1, B * g, sb)
        o, l = flash_lse(qq, kk, vv, cfg.scale, bias)
        parts.append((o.view(-1, g, d), l.view(-1, g).masked_fill_(~real[:, None], float("-inf")), slot_row))
    # merge the parts of each (row, head) by LSE; padding rows weigh 0
    if shared is not None:
        mx = shared[1].t().clone(memory_format=torch.contiguous_format)  # a copy: scatter_reduce_ writes it
    else:
        mx = torch.full((r, g), float("-inf"), dtype=torch.float32, device=dev)
    for _, l, rows_ in parts:
        mx.scatter_reduce_(0, rows_[:, None].expand(-1, g), l, "amax")
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    if shared is not None:
        den = torch.exp(shared[1].t() - mx).contiguous()
        acc = (shared[0].transpose(0, 1) * den.unsqueeze(-1)).contiguous()  # index_add_ wants it dense
    else:
        den = torch.zeros((r, g), dtype=torch.float32, device=dev)
        acc = torch.zeros((r, g, d), dtype=torch.float32, device=dev)
    for o, l, rows_ in parts:
        w = torch.exp(l - mx.index_select(0, rows_))
        den.index_add_(0, rows_, w)
        acc.index_add_(0, rows_, o.mul_(w.unsqueeze(-1).to(o.dtype)).float())
    lse = mx + torch.log(den)  # -inf where a (row, head) has no selected key
    out = acc * torch.where(den > 0, 1.0 / den, torch.zeros_like(den)).unsqueeze(-1)
    return out.transpose(0, 1).to(qw.dtype), lse.t()


def _fast_forward(q, k, v, k_cmp, v_cmp, cfg, gates):
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
    blocks = {}
    per_thread = threading.local()  # each worker's gather workspace, dropped with this call

    def window(unit):  # one window of rows of one (batch, KV head); writes its slice of out / lse
        bi, hi, a, e = unit
        heads = slice(hi * g, (hi + 1) * g)
        k1, v1 = k[bi, hi], v[bi, hi]
        kb, vb = blocks[bi, hi]
        pos = torch.arange(off + a, off + e, device=q.device)
        qw = q[bi, heads, a:e]
        if not hasattr(per_thread, "ws"):
            per_thread.ws = {}
        o_c, l_c, idx = _compressed_select(qw, kc_all[bi, hi], vc_all[bi, hi], pos, cfg, per_thread.ws)
        local = _local_part(qw, k1, v1, off + a, cfg) if _shares_local(cfg) else None
        o_s, l_s = _selected_fast(qw, kb, vb, idx, pos, cfg, local, per_thread.ws)
        o_w, l_w = _window_part(qw, k1, v1, off + a, cfg, local)
        out[bi, heads, a:e] = _gated_sum((o_c, o_s, o_w), _gate_slice(gates, bi, heads, a, e)).to(q.dtype)
        if lse is not None:
            lse[bi, heads, a:e] = torch.stack([l_c, l_s, l_w], -1)

    for bi in range(b):
        for hi in range(hk):
            blocks[bi, hi] = (_blocks_of(k[bi, hi], cfg.sb), _blocks_of(v[bi, hi], cfg.sb))
    # the costliest windows (last rows: most compressed and selectable blocks) first, so the
    # workers of run_units finish together
    run_units(window, [(bi, hi, a, e) for a, e in reversed(list(zip(cuts[:-1], cuts[1:])))
                       for bi in range(b) for hi in range(hk)])
    return out, lse


def _decode_one(q, k, v, k_cmp, v_cmp, cfg, gates):
    """``_fast_forward`` for one query per head (q_len = 1, the last position), every batch and KV
    head at once: a handful of batched calls instead of the windowed machinery, so a decode step is
    O(compressed + selected + window) tensor work with a fixed, small number of ops. The g query
    heads of a KV group are the rows of one attention call (they share the selection and K/V)."""
    b, hq, _, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    g, t = hq // hk, nk - 1
    qg = q.view(b, hk, g, d)
    nc = k_cmp.shape[2]
    ns = t // cfg.sb + 1
    o_c = torch.zeros_like(qg)
    l_c = torch.full((b, hk, g), float("-inf"), dtype=torch.float32, device=q.device)
    imp = torch.zeros((b, hk, 1, ns), dtype=torch.float32, device=q.device)
    if nc:  # every complete block ends at or before the last position: all are visible
        sc = torch.matmul(qg * cfg.scale, k_cmp.to(q.dtype).transpose(-1, -2)).float()  # [b, hk, g, nc]
        l_c = torch.logsumexp(sc, -1)
        p = torch.exp(sc - l_c.unsqueeze(-1))
        if cfg.cmp_out:
            o_c = torch.matmul(p.to(q.dtype), v_cmp.to(q.dtype))
        imp[:, :, 0] = _overlap_sum(p.sum(2).view(b * hk, nc), ns, cfg).view(b, hk, ns)
    pos = torch.full((1,), t, dtype=torch.long, device=q.device)
    idx = topk_blocks(_force_and_mask(imp, pos, cfg.sb, cfg.init_blocks, cfg.local_blocks), cfg.num_selected)[:, :, 0]
    tok = (idx.clamp(min=0).unsqueeze(-1) * cfg.sb + torch.arange(cfg.sb, device=q.device)).flatten(-2)  # [b, hk, S*sb]
    seen = (idx.unsqueeze(-1) >= 0).expand(-1, -1, -1, cfg.sb).flatten(-2) & (tok <= t)
    rows = tok.clamp(max=t)  # hidden rows past the query read a valid row; the bias masks them
    ks, vs = gather_rows(k, rows), gather_rows(v, rows)
    bias = additive_mask(seen, q.dtype).unsqueeze(2)
    o_s, l_s = flash_lse(qg, ks, vs, cfg.scale, bias)
    w0 = max(0, nk - cfg.window)
    o_w, l_w = flash_lse(qg, k[:, :, w0:], v[:, :, w0:], cfg.scale)
    gw = gates if not isinstance(gates, torch.Tensor) else gates.expand(b, hq, 1, 3).reshape(b, hk, g, 3)
    out = _gated_sum((o_c, o_s, o_w), gw).to(q.dtype).reshape(b, hq, 1, d)
    lse = torch.stack([l_c, l_s, l_w], -1).reshape(b, hq, 1, 3)
    return out, lse


def _gate_slice(gates, bi, heads, a, e):
    if isinstance(gates, torch.Tensor):
        return gates[bi if gates.shape[0] > 1 else 0, heads if gates.shape[1] > 1 else slice(None),
                     slice(a, e) if gates.shape[2] > 1 else slice(None)]
    return gates


def _gated_sum(outs, gates):
    """sum_i gate_i * out_i; gates a 3-tuple of floats or a tensor [..., 3] broadcasting over rows."""
    if isinstance(gates, torch.Tensor):
        return sum(gates[..., i:i + 1].to(o.dtype) * o for i, o in enumerate(outs))
    return sum(float(w) * o for w, o in zip(gates, outs))


# --------------------------------------------------------------------------- the op

def _check_gates(gates, q):
    b, hq, nq, _ = q.shape
    if isinstance(gates, torch.Tensor):
        fits = all(s in (1, t) for s, t in zip(gates.shape[:3], (b, hq, nq)))
        if gates.dim() != 4 or gates.shape[-1] != 3 or not fits:
            raise ValueError(f"gates tensor must be [b, q_heads, n, 3] = [{b}, {hq}, {nq}, 3] (or broadcastable); "
                             f"got {tuple(gates.shape)}")
        return gates
    return check_gates("nsa_attention", gates)  # fixed gates are >= 0, as the config requires


def _compressed_for(k, v, compress, compressed, l, s):
    nc = num_compressed(k.shape[2], l, s)
    if compressed is not None:
        kc, vc = compressed
        want = (k.shape[0], k.shape[1])
        if kc.dim() != 4 or kc.shape[:2] != want or vc.shape[:3] != kc.shape[:3] or kc.shape[-1] != k.shape[-1] \
                or vc.shape[-1] != v.shape[-1] or kc.shape[2] < nc:
            raise ValueError(f"compressed must be (k_cmp, v_cmp) [b, kv_heads, >= {nc}, d] for {k.shape[2]} keys with "
                             f"compress_block={l}, compress_stride={s}; got {tuple(kc.shape)}, {tuple(vc.shape)}")
        return kc[:, :, :nc], vc[:, :, :nc]
    if compress == "mean":
        return nsa_compress(k, v, compress_block=l, compress_stride=s)
    if callable(compress):
        kc, vc = compress(k, v, compress_block=l, compress_stride=s)
        if kc.shape[2] != nc:
            raise ValueError(f"compress callable returned {kc.shape[2]} blocks; expected {nc}")
        return kc, vc
    raise ValueError("compress must be 'mean' or a callable (k, v, compress_block, compress_stride) -> (k_cmp, v_cmp); "
                     f"got {compress!r}")


def nsa_attention(q, k, v, *, causal: bool = True, scale: float | None = None, compress_block: int = 32,
                  compress_stride: int = 16, select_block: int = 64, num_selected: int = 16, window: int = 512,
                  init_blocks: int = 1, local_blocks: int = 2, gates=DEFAULT_GATES, compress="mean",
                  compressed=None, return_lse: bool = False, backend: str = "auto"):
    """NSA attention on the shared layout (q [b, hq, nq, d], k/v [b, hk, nk, d]); causal only.

    gates: (g_cmp, g_slc, g_win) floats, or a tensor [b, hq, nq, 3] (e.g. sigmoid of a projection
    of the hidden state). compress: "mean" or a callable (k, v, compress_block=, compress_stride=)
    -> (k_cmp, v_cmp). compressed: precomputed (k_cmp, v_cmp) covering at least the complete
    blocks of k (decoding). return_lse: also return the three branches' LSEs [b, hq, nq, 3]
    (compressed, selected, window; float32, float64 for float64 inputs), -inf where a branch is
    empty. The gated sum itself is not a softmax, so it has no single LSE.
    """
    if not causal:
        raise ValueError("nsa_attention supports causal attention only (compressed and selected blocks are chosen "
                         "among past keys); use exact or moba for non-causal layers")
    check_qkv(q, k, v, causal)
    _check_params(compress_block, compress_stride, select_block, num_selected, window, init_blocks, local_blocks)
    gates = _check_gates(gates, q)
    scale = default_scale(scale, q.shape[-1])
    bad = nonfinite_rows(k, v)
    if bad is not None:
        return isolate_nonfinite(
            lambda q_, k_, v_: nsa_attention(q_, k_, v_, causal=causal, scale=scale, compress_block=compress_block,
                                             compress_stride=compress_stride, select_block=select_block,
                                             num_selected=num_selected, window=window, init_blocks=init_blocks,
                                             local_blocks=local_blocks, gates=gates, compress=compress,
                                             compressed=compressed, return_lse=return_lse, backend=backend),
            q, k, v, bad, return_lse)
    backend = resolve_backend(backend, q, k, v)
    b, hq, nq, d = q.shape
    nk = k.shape[2]
    if nq == 0 or nk == 0:
        out = q.new_zeros(q.shape)
        lse = torch.full((b, hq, nq, 3), float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)
        return (out, lse) if return_lse else out
    k_cmp, v_cmp = _compressed_for(k, v, compress, compressed, compress_block, compress_stride)
    cfg = SimpleNamespace(scale=scale, nk=nk, l=compress_block, s=compress_stride, sb=select_block,
                          num_selected=num_selected, window=window, init_blocks=init_blocks, local_blocks=local_blocks,
                          cmp_out=isinstance(gates, torch.Tensor) or gates[0] != 0, need_lse=return_lse)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, k_cmp, v_cmp)) or \
        (isinstance(gates, torch.Tensor) and gates.requires_grad and torch.is_grad_enabled())
    if backend == "torch" and not needs_grad and fused_ok(q, k, v) and q.dtype != torch.float64:  # float64: references
        one = nq == 1 and k.stride(-1) == 1 and v.stride(-1) == 1  # a decode step (cache rows contiguous)
        out, lse = (_decode_one if one else _fast_forward)(q, k, v, k_cmp, v_cmp, cfg, gates)
        return (out, lse) if return_lse else out
    if backend == "triton":
        from ..kernels import nsa as tk  # lazily: triton is optional
        prims = SimpleNamespace(compressed_attention=tk.compressed_attention, selection_scores=tk.selection_scores,
                                selected_attention=tk.selected_attention, window_attention=tk.window_attention)
    else:
        prims = REFERENCE
    outs, lses = _compose(prims, q, k, v, k_cmp, v_cmp, cfg)
    out = _gated_sum(outs, gates).to(q.dtype)
    if not return_lse:
        return out
    return out, torch.stack([l.to(acc_dtype(q.dtype)) for l in lses], -1)


# --------------------------------------------------------------------------- decode state and method

def _state_compressed(state: dict, k, v, l: int, s: int):
    """Compressed K/V of every complete block of the cache, kept in ``state`` and extended as blocks
    complete: each block is pooled once. The key row closing each block is a fingerprint, checked at
    log2(blocks) + 1 blocks (``probe_positions``: the recent ones densely): if the cache no longer
    holds those rows (new sequence, beam reordering, cropped cache) the state is rebuilt."""
    nc = num_compressed(k.shape[2], l, s)
    kc, vc, probe = state.get("k_cmp"), state.get("v_cmp"), state.get("probe")
    ok = (kc is not None and state.get("blocks") == (l, s) and kc.shape[:2] == k.shape[:2]
          and kc.shape[-1] == k.shape[-1] and kc.device == k.device and kc.dtype == k.dtype)
    if ok:
        m = min(kc.shape[2], nc)
        if m:
            blocks = torch.tensor(probe_positions(m), dtype=torch.long, device=k.device)
            ok = torch.equal(probe.index_select(2, blocks), k.index_select(2, blocks * s + l - 1))
        kc, vc, probe = kc[:, :, :m], vc[:, :, :m], probe[:, :, :m]
    if not ok:
        kc, vc = nsa_compress(k[:, :, :0], v[:, :, :0], compress_block=l, compress_stride=s)
        probe = k[:, :, :0]
    m = kc.shape[2]
    if m < nc:
        nk_, nv_ = nsa_compress(k[:, :, m * s: (nc - 1) * s + l], v[:, :, m * s: (nc - 1) * s + l],
                                compress_block=l, compress_stride=s)
        kc, vc = torch.cat([kc, nk_], 2), torch.cat([vc, nv_], 2)
        probe = torch.cat([probe, k[:, :, m * s + l - 1: (nc - 1) * s + l: s]], 2)
    state.update(k_cmp=kc, v_cmp=vc, probe=probe, blocks=(l, s))
    return kc, vc


def init_state(k, v, *, compress_block: int = 32, compress_stride: int = 16, **_) -> dict:
    """Decode state of a layer from an existing KV cache in one pass (its compressed K/V)."""
    state: dict = {}
    _state_compressed(state, k.detach(), v.detach(), compress_block, compress_stride)
    return state


def _run(q, k, v, *, causal=True, scale=None, backend="auto", buffers=None, state=None, gates=TRAINING_FREE_GATES,
         **params):
    compressed = None
    if state is not None and causal:
        l, s = params["compress_block"], params["compress_stride"]
        compressed = _state_compressed(state, k.detach(), v.detach(), l, s)
    return nsa_attention(q, k, v, causal=causal, scale=scale, gates=tuple(gates), compressed=compressed,
                         backend=backend, **params)


def _gates_ok(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) == 3 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in x)


def _pint(name, doc):
    return positive_int(doc, DEFAULTS[name])


def _nonneg(name, doc):
    return nonneg_int(doc, DEFAULTS[name])


def _exact_params(n: int, params: dict) -> dict:
    """The selected and window branches each see every visible key, and the compressed branch (mean
    keys: never exact) is gated off; the output is then g_slc * exact + g_win * exact = exact."""
    return {"num_selected": max(params["num_selected"], math.ceil(n / params["select_block"])),
            "window": max(params["window"], n), "gates": list(TRAINING_FREE_GATES)}


class _NSAMethod(Method):
    """Checks the relations between parameters (stride <= block, forced blocks fit) at config time."""

    def resolve_params(self, given):
        params = super().resolve_params(given)
        blocks = {n: v for n, v in params.items() if n != "gates"}
        try:
            _check_params(**blocks)
        except ValueError as e:
            raise ConfigError(f"params of method 'nsa': {e}") from None
        return params


NSA = register_method(_NSAMethod(
    name="nsa",
    summary="NSA: gated sum of compressed-block, selected-block (top-k by compressed scores) and window attention",
    prefill=_run,
    decode=_run,
    params={
        "compress_block": _pint("compress_block", "keys per compressed block (mean-pooled)"),
        "compress_stride": _pint("compress_stride", "stride between compressed blocks (<= compress_block)"),
        "select_block": _pint("select_block", "keys per selection block"),
        "num_selected": _pint("num_selected", "selection blocks per query, forced init/local blocks included"),
        "window": _pint("window", "sliding-window length in keys"),
        "init_blocks": _nonneg("init_blocks", "first selection blocks always selected"),
        "local_blocks": _nonneg("local_blocks", "selection blocks ending with the query's own block, always selected"),
        "gates": Param(list(TRAINING_FREE_GATES), (list, tuple),
                       "fixed gates [g_cmp, g_slc, g_win] of the training-free mode (default measured: docs/nsa.md)",
                       _gates_ok, "a list of 3 finite numbers >= 0"),
    },
    causal_only=True,
    stateful=True,
    init_state=init_state,
    exact_params=_exact_params,
))
