"""Position-based sparse attention (Longformer / BigBird style), training-free.

A query at absolute position p (queries are the last q_len positions, bottom-right) attends to the
UNION of these key sets, with one exact softmax over the union (a key in two sets counts once):

* global keys: positions j < G (``global_tokens``), seen by every query ("attention sinks").
  Non-causal: the G global *queries* (positions 0..G-1) also see every key. Causal: a global
  query's whole past is already global keys, so nothing is added.
* window: j = p - t*r for t = 0 .. window-1 (causal; r = ``dilation``, r = 1 is the plain sliding
  window of the last ``window`` keys including the query itself); non-causal: j = p + t*r with
  |t| <= window // 2 (a symmetric band of 2*(window//2) + 1 keys).
* random blocks (BigBird): keys are cut into blocks of ``block`` positions; the query block
  p // block gets ``random_blocks`` distinct key blocks, drawn uniformly from its strictly past
  blocks (causal) or from all other blocks (non-causal), and all their keys join the union (causal:
  all of them are in the past). The draw is a fixed function of (seed, query block): decode equals
  prefill and no state is kept.

Every query also obeys the causal mask (j <= p) when ``causal``.

Computation (the ``torch`` backend). The union is split into DISJOINT parts, each attention part
gives (out, lse) and the parts are merged by their LSEs (exact softmax over the union):

1. global: keys [0, G) (causal: <= p); one fused attention call for all query rows;
2. window: keys of the window that are >= G. A dilated window is a plain band inside one residue
   class: queries and keys with position = c (mod r) form strided subsequences in which the
   dilated window is the contiguous band [s - lo, s + hi] (lo = window-1, hi = 0 causal; lo = hi =
   window//2 non-causal). The band is computed in tiles of query rows against their key span
   (tile + lo + hi keys) with one additive [tile, span] bias for the band edges, shared by every
   tile: the regular tiles are batched calls (tiles in the batch dim) of torch's fused CPU
   flash-attention kernel on strided views of K/V (``unfold``: no copy by us), the few tiles
   clipped at the sequence ends or at G are separate calls with a slice of the same bias;
3. random: on the block-sparse executor's row form (``blocksparse.row_sparse_attention``), every
   row listing its query block's random blocks, with keys < G and keys already in the window
   hidden (causal: the blocks are strictly past, so no key is in the future); only the pairs whose
   block reaches the global keys or the row's window are masked, key by key, the others (most)
   are attended whole;
4. non-causal only: the rows of the global queries are replaced by exact attention over all keys.

No n x n mask or score matrix exists anywhere: temporaries are bounded by tile / group sizes and
total work is O(n * (window + G + random_blocks * block) * d).

Decoding (q_len = 1, the usual KV-cache step): the key indices of the union for p = kv_len - 1 are
built directly (O(window + G + random_blocks * block)) and read from the cache as views of their
contiguous runs (or gathered once): cost independent of the cache length. Any other q_len < kv_len
goes through the prefill path with bottom-right positions, so chunked prefill works too.

The Triton backend (``longpatch.kernels.sparse``) runs parts 1 and 2 in one flash-style kernel
(forward with LSE and backward) that visits only the key tiles of the global prefix and of the
band; parts 3 and 4 run in PyTorch and are merged by LSE.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..errors import check_int
from .base import Method, nonneg_int, optional_int, positive_int, register_method
from .blocksparse import row_sparse_attention
from .common import (
    acc_dtype,
    check_qkv,
    default_scale,
    guards_nonfinite,
    layer_seed_of,
    merge_lse,
    resolve_backend,
)
from .cpu_flash import additive_mask, hide_empty
from .lse_attention import attend

DEFAULT_WINDOW = 1024
DEFAULT_GLOBAL_TOKENS = 64
DEFAULT_DILATION = 1
DEFAULT_RANDOM_BLOCKS = 0
DEFAULT_BLOCK = 64

# Bound of temporaries (elements): gathered/strided K rows per batched band call.
_BAND_KEY_ELEMS = 1 << 24
# One-token decode attends to views of the cache when the union has at most this many contiguous
# runs of keys; beyond (dilated windows, random blocks) it gathers the union's rows once.
_VIEW_RUNS = 8
_MASK31 = (1 << 31) - 1
_MASK32 = (1 << 32) - 1


@dataclass(frozen=True)
class SparsePattern:
    """The key set of every query position; see the module docstring."""

    window: int = DEFAULT_WINDOW
    global_tokens: int = DEFAULT_GLOBAL_TOKENS
    dilation: int = DEFAULT_DILATION
    random_blocks: int = DEFAULT_RANDOM_BLOCKS
    block: int = DEFAULT_BLOCK
    seed: int = 0
    causal: bool = True

    def __post_init__(self):
        for name, low in (("window", 1), ("global_tokens", 0), ("dilation", 1), ("random_blocks", 0),
                          ("block", 1), ("seed", 0)):
            check_int(f"sparse_attention: {name}", getattr(self, name), low)

    def fitted(self, nq: int, nk: int) -> "SparsePattern":
        """The same key sets for nq queries on nk keys, with every size at most what the input can use,
        so that the cost is bounded by the input whatever a param says (window=10**9 is a valid wish
        for every key). No key is span = nq + nk or more positions from a query: window steps past it
        change nothing, and a window left with only the query itself needs no dilation; a block of nk
        keys is one block, as is any larger one; with at least as many draws as key blocks every
        candidate block is taken."""
        span, n = max(nq + nk, 1), max(nk, 1)
        r = min(self.dilation, span)
        reach = (span - 1) // r  # window steps that can still land on a key
        if self.causal:
            window = min(self.window, reach + 1)
            alone = window == 1
        else:
            window = self.window if self.window // 2 <= reach else 2 * reach + 1
            alone = window // 2 == 0
        block = min(self.block, n)
        return dataclasses.replace(self, window=window, dilation=1 if alone else r,
                                   global_tokens=min(self.global_tokens, n), block=block,
                                   random_blocks=min(self.random_blocks, -(-n // block)))

    @property
    def band(self) -> tuple[int, int]:
        """(lo, hi): the window of subsequence index s is [s - lo, s + hi] in its residue class."""
        if self.causal:
            return self.window - 1, 0
        half = self.window // 2
        return half, half

    def in_window(self, p: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Bool: key position j is in the window of query position p (broadcasting)."""
        lo, hi = self.band
        dist = p - j
        r = self.dilation
        return (dist % r == 0) & (dist <= lo * r) & (dist >= -hi * r)


# --------------------------------------------------------------------------- random blocks

def _hash(seed: int, qblock: torch.Tensor, t: int) -> torch.Tensor:
    """A 32-bit integer hash of (seed, query block, draw index) in int64 arithmetic that never
    overflows (every product < 2^63), so CPU and CUDA agree bit for bit."""
    x = (qblock + (1 << 30)) & _MASK31  # query blocks can be negative (non-causal q_len > kv_len)
    x = (x * 0x165667B1 + (seed & _MASK31) * 0x27D4EB2D + t * 0x1B873593 + 0x5BD1E995) & _MASK32
    for mult in (0x7FEB352D, 0x446CA68B):
        x = x ^ (x >> 16)
        x = (x * mult) & _MASK32
    return x ^ (x >> 15)


def random_key_blocks(qblocks: torch.Tensor, n_key_blocks: int, count: int, seed: int, causal: bool) -> torch.Tensor:
    """The random key blocks of each query block: int64 [len(qblocks), count], -1 = empty slot.

    Candidates: causal, blocks 0 .. qb-1 (strictly past); non-causal, every block of
    [0, n_key_blocks) except qb. ``count`` distinct candidates are drawn with Floyd's algorithm
    (exactly ``count`` hash draws, no rejection loop), so the set is a pure function of
    (seed, qb, count, number of candidates); with fewer candidates than ``count`` all are taken.
    """
    qb = qblocks.to(torch.int64)
    if causal:
        n_cand = torch.clamp(torch.minimum(qb, torch.full_like(qb, n_key_blocks)), min=0)
    else:
        own_in = (qb >= 0) & (qb < n_key_blocks)
        n_cand = n_key_blocks - own_in.to(torch.int64)
    picks: list[torch.Tensor] = []
    for t in range(count):
        j = n_cand - count + t  # Floyd: draw from [0, j]; a repeat is replaced by j itself
        r = _hash(seed, qb, t) % torch.clamp(j + 1, min=1)
        dup = torch.zeros_like(r, dtype=torch.bool)
        for prev in picks:
            dup |= prev == r
        pick = torch.where(dup, j, r)
        picks.append(torch.where(j >= 0, pick, torch.full_like(pick, -1)))
    if not picks:
        return qb.new_zeros((qb.numel(), 0))
    sel = torch.stack(picks, dim=-1)
    if not causal:  # candidate u -> block u, skipping the own block
        sel = torch.where((sel >= qb[:, None]) & own_in[:, None], sel + 1, sel)
    return sel


# --------------------------------------------------------------------------- part 1: global keys

def _global_part(q1, k1, v1, off: int, G: int, causal: bool, scale: float):
    """q1 [Hq, nq, d], k1/v1 [Hk, nk, d] of one batch element vs keys [0, G) (causal: <= p).
    Returns (out [Hq, nq, d], lse [Hq, nq]); rows that see no global key get -inf."""
    hq, nq, d = q1.shape
    gk = min(G, k1.shape[1])
    kg, vg = k1[None, :, :gk], v1[None, :, :gk]
    if not causal:
        o, l = attend(q1[None], kg, vg, scale)
        return o[0], l[0]
    # causal: rows with p >= gk - 1 see the whole prefix (one call); the first few rows see a part
    first_full = max(0, gk - 1 - off)  # row index of the first query that sees all gk keys
    out = q1.new_zeros((hq, nq, d))
    lse = torch.full((hq, nq), float("-inf"), dtype=acc_dtype(q1.dtype), device=q1.device)
    if first_full < nq:
        o, l = attend(q1[None, :, first_full:], kg, vg, scale)
        out[:, first_full:], lse[:, first_full:] = o[0], l[0]
    if first_full > 0:
        rows = min(first_full, nq)
        p = torch.arange(off, off + rows, device=q1.device)[:, None]
        vis = torch.arange(gk, device=q1.device)[None, :] <= p  # p >= 0 always (causal: nq <= nk)
        o, l = attend(q1[None, :, :rows], kg, vg, scale, mask=additive_mask(vis, q1.dtype))
        o, l = hide_empty(o[0], l[0], vis.any(-1))
        out[:, :rows], lse[:, :rows] = o, l
    return out, lse


# --------------------------------------------------------------------------- part 2: the band

def _tile_rows(lo: int, hi: int) -> int:
    """Query rows per band tile: the span is tile + lo + hi keys, of which lo + hi + 1 are used per
    row, so a tile near the band width wastes about half; 64..256 rows keep the fused kernel busy."""
    return int(min(256, max(64, 2 ** round(math.log2(max(1, (lo + hi + 1) // 2))))))


def _band_bias(T: int, lo: int, hi: int, dtype, device) -> torch.Tensor:
    """[T, T + lo + hi] additive bias of a tile: row a sees span columns a .. a + lo + hi."""
    a = torch.arange(T, device=device)[:, None]
    c = torch.arange(T + lo + hi, device=device)[None, :]
    return additive_mask((c >= a) & (c <= a + lo + hi), dtype)


def band_attention(qs, ks, vs, s0: int, lo: int, hi: int, kmin: int, scale: float):
    """Banded attention on subsequences: qs [Hq, m, d] are the rows at subsequence indices
    s0 .. s0+m-1, ks/vs [Hk, n, d]; row s sees keys [max(kmin, s - lo), min(n - 1, s + hi)].
    Returns (out [Hq, m, d], lse [Hq, m]) with -inf on rows that see nothing. Views are fine."""
    hq, m, d = qs.shape
    hk, n = ks.shape[0], ks.shape[1]
    out = qs.new_zeros((hq, m, d))
    lse = torch.full((hq, m), float("-inf"), dtype=acc_dtype(qs.dtype), device=qs.device)
    first = max(s0, kmin - hi)  # first and last subsequence index with a non-empty key range
    last = min(s0 + m - 1, n - 1 + lo)
    if kmin >= n or first > last:
        return out, lse
    T = _tile_rows(lo, hi)
    L = T + lo + hi
    bias = _band_bias(T, lo, hi, qs.dtype, qs.device)
    starts = list(range(first, last + 1, T))

    def regular(t0):
        return t0 - lo >= kmin and t0 + T - 1 + hi <= n - 1 and t0 + T - 1 <= last

    reg = [t0 for t0 in starts if regular(t0)]  # a contiguous run: the conditions are monotone in t0
    for t0 in starts:
        if reg and reg[0] <= t0 <= reg[-1]:
            continue
        t1 = min(t0 + T, last + 1)
        k0, k1 = max(kmin, t0 - lo), min(n, t1 + hi)
        c0 = k0 - (t0 - lo)
        b = bias[: t1 - t0, c0: c0 + (k1 - k0)]
        o, l = attend(qs[None, :, t0 - s0: t1 - s0], ks[None, :, k0:k1], vs[None, :, k0:k1], scale, mask=b)
        out[:, t0 - s0: t1 - s0], lse[:, t0 - s0: t1 - s0] = o[0], l[0]
    if reg:
        per_call = max(1, _BAND_KEY_ELEMS // max(1, hk * L * d))
        for i in range(0, len(reg), per_call):
            tiles = reg[i: i + per_call]
            a, e = tiles[0], tiles[-1] + T
            qt = qs[:, a - s0: e - s0].unflatten(1, (len(tiles), T)).transpose(0, 1)  # [R, Hq, T, d]
            kt = ks[:, a - lo: e + hi].unfold(1, L, T).permute(1, 0, 3, 2)  # [R, Hk, L, d], a view
            vt = vs[:, a - lo: e + hi].unfold(1, L, T).permute(1, 0, 3, 2)
            o, l = attend(qt, kt, vt, scale, mask=bias)
            out[:, a - s0: e - s0] = o.transpose(0, 1).flatten(1, 2)
            lse[:, a - s0: e - s0] = l.transpose(0, 1).flatten(1, 2)
    return out, lse


def _window_part(q1, k1, v1, off: int, pat: SparsePattern, scale: float):
    """Window keys >= G of every query row (q1 [Hq, nq, d], k1/v1 [Hk, nk, d]), residue class by
    residue class of the dilation. Returns (out [Hq, nq, d], lse [Hq, nq])."""
    hq, nq, d = q1.shape
    nk = k1.shape[1]
    r, G = pat.dilation, pat.global_tokens
    lo, hi = pat.band
    if r == 1:
        return band_attention(q1, k1, v1, off, lo, hi, G, scale)
    out = q1.new_zeros((hq, nq, d))
    lse = torch.full((hq, nq), float("-inf"), dtype=acc_dtype(q1.dtype), device=q1.device)
    for c in range(min(r, nk)):
        i0 = (c - off) % r  # first query row whose position is = c (mod r)
        if i0 >= nq:
            continue
        s0 = (off + i0 - c) // r  # its index in the key subsequence of class c
        kmin = max(0, -(-(G - c) // r))  # first subsequence index at position >= G
        o, l = band_attention(q1[:, i0::r], k1[:, c::r], v1[:, c::r], s0, lo, hi, kmin, scale)
        out[:, i0::r], lse[:, i0::r] = o, l
    return out, lse


# --------------------------------------------------------------------------- part 3: random blocks

def _random_part(q1, k1, v1, off: int, pat: SparsePattern, scale: float):
    """Keys of each query block's random blocks that are >= G and outside the window, on the
    executor's row form (``blocksparse.row_sparse_attention``): every row lists its query block's
    random blocks; a pair whose block reaches the global keys or the row's window is cut key by key
    (``visible``), the others (most: random blocks lie far from the window) are attended whole.
    Causal: the blocks are strictly past, so no key is in the future."""
    hq, nq, d = q1.shape
    hk, nk = k1.shape[0], k1.shape[1]
    g, B = hq // hk, pat.block
    lo, hi = pat.band
    pos = torch.arange(off, off + nq, device=q1.device)
    qbs = torch.div(pos, B, rounding_mode="floor")
    lists = random_key_blocks(qbs, -(-nk // B), pat.random_blocks, pat.seed, pat.causal).unsqueeze(0)

    def partial(qpos, blk):  # the block holds global keys, or reaches the row's window
        return (blk * B < pat.global_tokens) | ((blk * B + B - 1 >= qpos - lo * pat.dilation)
                                                & (blk * B <= qpos + hi * pat.dilation))

    def visible(qpos, kpos):
        return (kpos >= pat.global_tokens) & ~pat.in_window(qpos, kpos)

    parts = [row_sparse_attention(q1[h * g:(h + 1) * g], k1[h], v1[h], lists, pos, B, scale, causal=False,
                                  visible=visible, partial=partial) for h in range(hk)]
    return torch.cat([o for o, _ in parts]), torch.cat([l for _, l in parts])


# --------------------------------------------------------------------------- the torch path

def _global_query_rows(off: int, nq: int, pat: SparsePattern) -> tuple[int, int]:
    """Rows [a, e) whose positions are global queries with a full row (non-causal only)."""
    if pat.causal or pat.global_tokens == 0:
        return 0, 0
    a = max(0, -off)
    e = min(nq, pat.global_tokens - off)
    return a, max(a, e)


def _torch_sparse(q, k, v, pat: SparsePattern, scale: float, skip_window: bool = False):
    """The union attention of every query, one batch element at a time (all heads at once; GQA by
    head broadcasting in the fused kernel). ``skip_window``: parts 1-2 are supplied by the caller
    (the Triton path); only parts 3-4 run here and are returned for merging."""
    b, hq, nq, d = q.shape
    nk = k.shape[2]
    off = nk - nq
    outs, lses = [], []
    for bi in range(b):
        q1, k1, v1 = q[bi], k[bi], v[bi]
        o = q1.new_zeros((hq, nq, d))
        l = torch.full((hq, nq), float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)
        if not skip_window:
            if pat.global_tokens:
                o, l = _global_part(q1, k1, v1, off, pat.global_tokens, pat.causal, scale)
            ow, lw = _window_part(q1, k1, v1, off, pat, scale)
            o, l = merge_lse(o, l, ow, lw)
        if pat.random_blocks:
            orand, lrand = _random_part(q1, k1, v1, off, pat, scale)
            o, l = merge_lse(o, l, orand, lrand)
        outs.append(o)
        lses.append(l)
    out, lse = torch.stack(outs), torch.stack(lses)
    a, e = _global_query_rows(off, nq, pat)
    if e > a:  # non-causal global queries see every key: exact rows
        og, lg = attend(q[:, :, a:e], k, v, scale)
        out, lse = _replace_rows(out, lse, a, e, og, lg)
    return out, lse


def _replace_rows(out, lse, a, e, o_rows, l_rows):
    """out/lse with rows [a, e) replaced (out of place: keeps autograd simple)."""
    out = torch.cat([out[:, :, :a], o_rows.to(out.dtype), out[:, :, e:]], dim=2)
    lse = torch.cat([lse[:, :, :a], l_rows.to(lse.dtype), lse[:, :, e:]], dim=2)
    return out, lse


# --------------------------------------------------------------------------- decode: one query

def union_key_positions(p: int, nk: int, pat: SparsePattern, device=None) -> torch.Tensor:
    """Sorted int64 positions of every key the query at position p sees (causal or not), each once.
    Cost O(window + G + random_blocks * block), independent of nk (except a global query of a
    non-causal pattern, which sees all nk keys)."""
    if not pat.causal and 0 <= p < pat.global_tokens:
        return torch.arange(nk, device=device)
    lim = min(nk - 1, p) if pat.causal else nk - 1
    lo, hi = pat.band
    r = pat.dilation
    parts = [torch.arange(min(pat.global_tokens, lim + 1), device=device)]
    t = torch.arange(-hi, lo + 1, device=device)
    win = p - t * r
    parts.append(win[(win >= pat.global_tokens) & (win <= lim) & (win >= 0)])
    if pat.random_blocks:
        B = pat.block
        sel = random_key_blocks(torch.tensor([p // B], device=device), -(-nk // B), pat.random_blocks,
                                pat.seed, pat.causal)[0]
        sel = sel[sel >= 0]
        kpos = (sel[:, None] * B + torch.arange(B, device=device)).reshape(-1)
        keep = (kpos >= pat.global_tokens) & (kpos <= lim) & ~pat.in_window(torch.tensor(p, device=device), kpos)
        parts.append(kpos[keep])
    return torch.sort(torch.cat(parts)).values


def _decode_one(q, k, v, pat: SparsePattern, scale: float):
    """q [b, Hq, 1, d] at position kv_len - 1 against the cache: the union's keys, read as views of
    its contiguous runs (merged by LSE) or, when there are many runs, gathered once."""
    nk = k.shape[2]
    p, G = nk - 1, min(pat.global_tokens, nk)
    if pat.dilation == 1 and pat.random_blocks == 0:  # the common case, runs known without tensors
        w0 = max(G, p - pat.window + 1)
        runs = [(s, e) for s, e in ((0, G), (w0, p + 1)) if e > s]
    else:
        idx = union_key_positions(p, nk, pat, q.device)
        cut = (torch.nonzero(idx[1:] - idx[:-1] != 1).flatten() + 1).tolist()
        bounds = [0] + cut + [idx.numel()]
        if len(bounds) - 1 > _VIEW_RUNS:  # e.g. a dilated window: one gather (a copy of the union only)
            return attend(q, k.index_select(2, idx), v.index_select(2, idx), scale)
        first = idx[bounds[:-1]].tolist()
        runs = [(s, s + e - a) for s, a, e in zip(first, bounds[:-1], bounds[1:])]
    # few contiguous runs (plain window + global prefix): attend to views of the cache, no copy;
    # a one-row fused call runs on the calling thread, a copy may wake the whole thread pool
    parts = [attend(q, k[:, :, s:e], v[:, :, s:e], scale) for s, e in runs]
    out, lse = parts[0]
    for o, l in parts[1:]:
        out, lse = merge_lse(out, lse, o, l)
    return out, lse


# --------------------------------------------------------------------------- the triton path

def _triton_path(q, k, v, pat: SparsePattern, scale: float):
    from ..kernels.sparse import window_global_attention  # lazily: triton is optional
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out, lse = window_global_attention(q, k, v, window=pat.window, global_tokens=pat.global_tokens,
                                       dilation=pat.dilation, causal=pat.causal, scale=scale)
    a, e = _global_query_rows(k.shape[2] - q.shape[2], q.shape[2], pat)
    if pat.random_blocks or e:
        o2, l2 = _torch_sparse(q, k, v, pat, scale, skip_window=True)
        out, lse = merge_lse(out, lse, o2, l2)
        if e > a:  # exact rows came back in o2/l2 merged with -inf parts; take them as they are
            out, lse = _replace_rows(out, lse, a, e, o2[:, :, a:e], l2[:, :, a:e])
    return out, lse


# --------------------------------------------------------------------------- the op

@guards_nonfinite
def sparse_attention(q, k, v, *, causal: bool = True, scale: float | None = None,
                     window: int = DEFAULT_WINDOW, global_tokens: int = DEFAULT_GLOBAL_TOKENS,
                     dilation: int = DEFAULT_DILATION, random_blocks: int = DEFAULT_RANDOM_BLOCKS,
                     block: int = DEFAULT_BLOCK, seed: int | None = None, return_lse: bool = False,
                     backend: str = "auto"):
    """Position-based sparse attention (global + dilated window + random blocks) on the shared
    layout: q [b, hq, nq, d], k/v [b, hk, nk, d], queries at the last nq positions.

    window: keys per query in the (dilated) sliding window, the query itself included (non-causal:
    window // 2 on each side plus itself). global_tokens: the first positions every query sees
    (non-causal: those queries also see everything). dilation: stride of the window (1 = plain).
    random_blocks: random key blocks of ``block`` keys per query block (BigBird); ``seed`` (None ->
    0) fixes the draw. Exact softmax over the union of the key sets; returns out (and the LSE
    [b, hq, nq] with ``return_lse``: float32, float64 for float64 inputs, which are computed in
    float64 throughout). A NaN/inf in a key or value row makes the rows that attend to it NaN and
    leaves the others unchanged. backend: "auto" | "torch" | "triton".
    """
    check_qkv(q, k, v, causal)
    pat = SparsePattern(window=window, global_tokens=global_tokens, dilation=dilation, random_blocks=random_blocks,
                        block=block, seed=0 if seed is None else seed, causal=bool(causal))
    pat = pat.fitted(q.shape[2], k.shape[2])
    scale = default_scale(scale, q.shape[-1])
    backend = resolve_backend(backend, q, k, v, flex=True)
    b, hq, nq, d = q.shape
    if backend == "flex" and not _flex_runs(q, k, v, pat, return_lse):
        from .flex import fallback_backend
        backend = fallback_backend(q)
    if b == 0 or nq == 0 or k.shape[2] == 0:
        out = q.new_zeros(q.shape)
        lse = torch.full((b, hq, nq), float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)
        return (out, lse) if return_lse else out
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if nq == 1 and causal and not needs_grad and backend == "torch":
        out, lse = _decode_one(q, k, v, pat, scale)
    elif backend == "triton":
        out, lse = _triton_path(q, k, v, pat, scale)
    elif backend == "flex":
        from .flex import flex_band
        out, lse = flex_band(q, k, v, pat.window, pat.global_tokens, scale, return_lse, dilation=pat.dilation)
    else:
        out, lse = _torch_sparse(q, k, v, pat, scale)
    out = out.to(q.dtype)
    return (out, lse.to(acc_dtype(q.dtype))) if return_lse else out


def _flex_runs(q, k, v, pat: SparsePattern, return_lse: bool) -> bool:
    """Whether FlexAttention runs this call: a causal prefill of the plain window and global keys
    (random blocks and dilated windows run on the other paths: flex's band has the dilated mask, but
    torch 2.13's CPU template fails to compile it, so it waits for a GPU check), where
    ``flex.supports`` it."""
    from .flex import supports
    plain = pat.causal and pat.dilation == 1 and pat.random_blocks == 0
    return plain and 1 < q.shape[2] == k.shape[2] and supports(q, k, v, 128, return_lse)


def _run(q, k, v, *, causal=True, scale=None, backend="auto", buffers=None, window=DEFAULT_WINDOW,
         global_tokens=DEFAULT_GLOBAL_TOKENS, dilation=DEFAULT_DILATION, random_blocks=DEFAULT_RANDOM_BLOCKS,
         block=DEFAULT_BLOCK, seed=None, **_):
    if random_blocks and buffers and "seed" in buffers:  # a patched layer: its own draw of random blocks
        seed = int(buffers["seed"])
    return sparse_attention(q, k, v, causal=causal, scale=scale, window=window, global_tokens=global_tokens,
                            dilation=dilation, random_blocks=random_blocks, block=block, seed=seed, backend=backend)


# the graph-safe step's blocks: the window and the sinks read as lists of blocks of this many keys
_STEP_BLOCK = 64


def _graph_step(params: dict, n: int):
    """A plain window and sinks as a graph-safe step (paged.py): two short block lists, one softmax. None
    for a dilated window or random blocks (their keys are no few runs of blocks)."""
    from .paged import StepSpec
    if params["dilation"] != 1 or params["random_blocks"]:
        return None
    return StepSpec(block=_STEP_BLOCK, page=_STEP_BLOCK, window=params["window"],
                    global_tokens=params["global_tokens"], ranked=False)


def _make_buffers(*, head_dim: int, seed: int | None = None, layer_seed: int | None = None, **_):
    """{"seed": the layer's seed of the random blocks}, so that layers draw different blocks (as in
    BigBird); re-patching with the same config draws the same."""
    return {"seed": torch.tensor(layer_seed_of(seed, layer_seed), dtype=torch.int64)}


def _exact_params(n: int, params: dict) -> dict:
    """A plain window of n keys is every key a query may see (causal), or every key within n // 2 on
    each side (non-causal: a window of 2n covers the sequence)."""
    return {"window": max(params["window"], 2 * n), "dilation": 1}


def _pairs(q, k, causal: bool, params: dict) -> int | None:
    """Query-key products of a causal prefill (None otherwise), per query head summed: each query's
    union of keys (global, window, random blocks; a key in two sets counts once), as
    ``union_key_positions`` lists them, counted for all queries at once."""
    n = q.shape[2]
    if not causal or k.shape[2] != n:
        return None
    G, W, r, R, B = (params[x] for x in ("global_tokens", "window", "dilation", "random_blocks", "block"))
    t = torch.arange(n)
    total = torch.clamp(t + 1, max=G)  # global keys
    total += torch.where(t >= G, torch.clamp(torch.div(t - G, r, rounding_mode="floor") + 1, max=W), 0)  # window >= G
    if R:
        sel = random_key_blocks(torch.div(t, B, rounding_mode="floor"), -(-n // B), R, params["seed"] or 0, True)
        lo = torch.clamp(sel * B, min=G)  # a random block's keys >= G (all strictly before the query)
        hi = sel * B + B - 1
        # window keys t - i*r (0 <= i < W) inside [lo, hi]: i from ceil((t - hi) / r) to floor((t - lo) / r)
        i0 = torch.clamp(-torch.div(hi - t[:, None], r, rounding_mode="floor"), min=0)
        i1 = torch.clamp(torch.div(t[:, None] - lo, r, rounding_mode="floor"), max=W - 1)
        in_window = torch.clamp(i1 - i0 + 1, min=0)
        keys = torch.clamp(hi - lo + 1, min=0) - in_window
        total += torch.where(sel >= 0, keys, 0).sum(-1)
    return q.shape[0] * q.shape[1] * int(total.sum())


SPARSE = register_method(Method(
    name="sparse",
    summary="position-based sparse attention: global tokens + (dilated) sliding window + BigBird random blocks",
    prefill=_run,
    decode=_run,
    params={
        "window": positive_int("keys per query in the sliding window, the query included (non-causal: "
                               "window // 2 each side)", DEFAULT_WINDOW),
        "global_tokens": nonneg_int("first positions every query attends to (attention sinks); non-causal: "
                                    "they also attend to everything", DEFAULT_GLOBAL_TOKENS),
        "dilation": positive_int("stride between window keys (1 = plain sliding window)", DEFAULT_DILATION),
        "random_blocks": nonneg_int("random past key blocks per query block (BigBird); 0 = none",
                                    DEFAULT_RANDOM_BLOCKS),
        "block": positive_int("block size of the random blocks", DEFAULT_BLOCK),
        "seed": optional_int("seed of the random blocks (null -> 0); each patched layer mixes in its index"),
    },
    make_buffers=_make_buffers,
    exact_params=_exact_params,
    attended_pairs=_pairs,
    graph_step=_graph_step,
))
