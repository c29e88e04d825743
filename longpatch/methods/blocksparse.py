"""The block-sparse executor: causal attention of each query block to its own block and to a given
list of past key blocks, on the shared layout, with LSE, autograd, GQA and one-token decode.

A block-sparse method is two parts: a *selection* (which key blocks each query block attends to;
``selection.py``) and this *executor*. Blocks are ``block`` consecutive positions (block i holds
positions [i*block, (i+1)*block)); queries and keys share the grid (prefill: q_len == kv_len).

``blocks`` [b, kv_heads, n_blocks, S] (int64) lists, per KV head and query block i, up to S past
key blocks j < i (-1 pads; no duplicates). The query heads of a KV group share their group's list
(GQA: the selection is group-shared, so K/V are gathered once per group). Every query also attends
causally to its own block. So query row t (in block i) attends to the keys of its listed blocks and
to the keys of block i at positions <= t: never a future key.

The torch path makes batched calls of torch's fused CPU attention kernel (which returns the LSE):
one for every diagonal block at once (causal), then, for the query blocks that list the same number
of blocks, one per chunk of them against their gathered blocks (no mask: the kernel's fastest form),
merged by their LSEs. Its work is the attended pairs plus one copy of each listed block (whole
blocks, one memcpy each): no n x n matrix, no per-row index lists. On a GPU FlexAttention runs the
lists (``flex.py``); its Triton twin was removed once flex measured 2.0-2.5x faster at the same
lists on an H100 (docs/gpu.md). A one-token decode step attends its blocks in
place, without copying them: on views of the cache (``cpu_flash.attend_spans``), or, scattered, by
one sparse call over their rows (``cpu_flash.cache_rows``).

The row form (``row_sparse_attention``, at the end) takes a list per query row instead of per query
block: the papers' gates (MoBA's, NSA's compressed ranking) run on it.
"""
from __future__ import annotations

import math

import torch

from .common import ATTEND, acc_dtype, exp_below_max_, gather_blocks, merge_lse, step_phase, warn_once
from .cpu_flash import additive_mask, attend_spans, cache_rows, fused_ok, merge_spans, row_scores, row_sum, spans_ok
from .lse_attention import attend

# Elements of gathered keys per call: large enough for few calls, small enough to stay in cache.
_CHUNK_ELEMS = 1 << 22
# A decode step whose blocks lie in more runs than this per KV head reads their rows in one sparse
# call (``_decode_rows``), not a fused call per run (~30 us fixed each): measured at 32k with 32
# blocks per KV head in 1-32 runs, the sparse call wins from 4 runs on (2.2 vs 2.0 ms; 4.0 vs 1.9 ms
# at 32 runs), the fused calls below.
_ROWS_AFTER = 3


def _pad_to(x: torch.Tensor, n: int) -> torch.Tensor:
    if x.shape[2] == n:
        return x
    return torch.nn.functional.pad(x, (0, 0, 0, n - x.shape[2]))


def _gather(x: torch.Tensor, idx: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    """x.index_select(0, idx), into ``buf`` when given."""
    if buf is None:
        return x.index_select(0, idx)
    return torch.index_select(x, 0, idx, out=buf[:len(idx) * x.shape[1]].view(len(idx), x.shape[1]))


def block_sparse_prefill(q, k, v, blocks: torch.Tensor, block: int, scale: float, backend: str = "torch",
                         need_lse: bool = True):
    """(out [b, hq, nq, d], lse [b, hq, nq] float32/float64) of causal prefill (q_len == kv_len), or of a
    prefill chunk: q the last nq positions of k, starting on a block, ``blocks`` [b, hk, chunk blocks, S]
    the lists of its query blocks (key block numbers of the whole cache). backend "flex": FlexAttention
    (``flex.py``; lse None without ``need_lse``), where it runs (CUDA; the CPU without gradients or LSE),
    else the torch path below; "triton" (its Triton kernel was
    removed, issue 40): flex on CUDA, else the torch path, said once in the log."""
    if backend == "triton":  # the executor's Triton kernel is gone: FlexAttention runs these lists faster
        warn_once("blocksparse-triton", "longpatch: backend 'triton' runs the block-sparse executor on "
                                        + ("FlexAttention" if q.is_cuda else "its torch path")
                                        + " (its Triton kernel was removed: on an H100 flex ran the same block "
                                          "lists 2.0-2.5x faster, docs/gpu.md)")
        backend = "flex" if q.is_cuda else "torch"
    if backend == "flex":
        from .flex import flex_block_sparse, supports
        if supports(q, k, v, block, need_lse):
            return flex_block_sparse(q, k, v, blocks, block, scale, need_lse)
    b, hq, nq, d = q.shape
    hk, n = k.shape[1], k.shape[2]
    g = hq // hk
    nb = math.ceil(n / block)  # key blocks; the queries' are the last mb of them
    mb = blocks.shape[2]
    q0 = nb - mb
    if n - nq != q0 * block:
        raise ValueError(f"block_sparse_prefill: {nq} queries against {n} keys with lists for {mb} query blocks of "
                         f"{block}: the queries must be the last positions, from the start of block {q0}")
    npad = nb * block
    # padded positions sit after every real one: the diagonal's causal mask hides them from real rows
    qp = _pad_to(q, mb * block)
    kp, vp = (_pad_to(x, npad) for x in (k, v))
    acc = acc_dtype(q.dtype)
    # listed blocks first in each row, so that a row with c blocks lists them in its first c slots
    blocks = blocks.sort(-1, descending=True).values
    counts = (blocks >= 0).sum(-1)  # [b, hk, nb]
    # gathers write into two buffers reused across chunks: a fresh large tensor per chunk costs page
    # faults that take longer than the copy itself (measured: 30 ms vs 2 ms for 7 MB); autograd needs
    # fresh tensors, so a call that records gradients allocates per chunk
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    most = int(counts.max()) if counts.numel() else 0
    room = min(_CHUNK_ELEMS, mb * most * block * d) if most else 0
    kbuf = vbuf = None
    if not grad and room:
        kbuf, vbuf = (torch.empty(room + most * block * d, dtype=k.dtype, device=k.device) for _ in range(2))
    # the results are written in place into the returned layout, seen as [b, hk, nb, g, block(, d)]: a
    # copy into it at the end would be one more tensor of q's size (page faults of the order of the copy)
    res, res_lse = (torch.empty(b, hq, mb * block, *x, dtype=acc, device=q.device) for x in ((d,), ()))
    out = res.view(b, hk, g, mb, block, d).transpose(2, 3)
    lse = res_lse.view(b, hk, g, mb, block).transpose(2, 3)
    for bi in range(b):
        for hi in range(hk):
            qh = qp[bi, hi * g:(hi + 1) * g].reshape(g, mb, block, d).transpose(0, 1)  # [mb, g, block, d]
            kh, vh = kp[bi, hi].reshape(nb, block * d), vp[bi, hi].reshape(nb, block * d)
            o_d, l_d = attend(qh, kh[q0:].view(mb, 1, block, d), vh[q0:].view(mb, 1, block, d), scale, causal=True)
            out[bi, hi], lse[bi, hi] = o_d.to(acc), l_d.to(acc)
            # query blocks with the same number c of listed blocks: one maskless call per chunk of them
            for c in counts[bi, hi].unique().tolist():
                if c == 0:
                    continue
                rows = torch.nonzero(counts[bi, hi] == c).squeeze(1)
                step = max(1, _CHUNK_ELEMS // (c * block * d))
                for a in range(0, len(rows), step):
                    r = rows[a:a + step]
                    idx = blocks[bi, hi].index_select(0, r)[:, :c].reshape(-1)
                    kg, vg = _gather(kh, idx, kbuf), _gather(vh, idx, vbuf)  # whole blocks: one copy each
                    kg, vg = kg.view(len(r), 1, c * block, d), vg.view(len(r), 1, c * block, d)
                    # the group's g query heads read the same keys, maskless: one head of g * block
                    # rows to the fused kernel, which works longer queries in larger row tiles (5-6%
                    # less executor time at 32k for g = 2 and 4, measured; the diagonal's causal mask
                    # needs its heads apart)
                    qs = qh.index_select(0, r).reshape(len(r), 1, g * block, d)
                    o_s, l_s = attend(qs, kg, vg, scale)
                    o_s, l_s = o_s.view(len(r), g, block, d), l_s.view(len(r), g, block)
                    o, l_ = merge_lse(out[bi, hi].index_select(0, r), lse[bi, hi].index_select(0, r),
                                      o_s.to(acc), l_s.to(acc))
                    out[bi, hi].index_copy_(0, r, o)
                    lse[bi, hi].index_copy_(0, r, l_)
    return res[:, :, :nq].to(q.dtype), res_lse[:, :, :nq]


def block_sparse_decode(q, k, v, kept: torch.Tensor, block: int, local_blocks: int, scale: float,
                        backend: str = "torch", need_lse: bool = True):
    """(out, lse) of one query per head at the last position t = kv_len - 1: its own (partial) block,
    the ``local_blocks`` blocks before it, and the past blocks ``kept`` [b, kv_heads, S] (-1 pads, no
    duplicates) that are not among those. Reads only those rows of the cache: in place with fused
    calls on views (``attend_spans``, touching blocks joined), or, for float32 blocks scattered in
    more than ``_ROWS_AFTER`` runs a KV head, in one sparse score call and one weighted sum (``_decode_rows``);
    without the fused kernel or under autograd, by gathering them into one masked call. backend
    "flex": one FlexAttention call over the blocks (``flex.flex_decode``: no host round-trip; lse
    None without ``need_lse``), where it runs."""
    with step_phase(ATTEND):
        return _block_sparse_decode(q, k, v, kept, block, local_blocks, scale, backend, need_lse)


def _block_sparse_decode(q, k, v, kept, block, local_blocks, scale, backend, need_lse):
    from ..quantized import QuantizedKV
    quantized = isinstance(k, QuantizedKV) and isinstance(v, QuantizedKV)  # an 8-bit cache (below)
    if backend == "flex" and not quantized:
        from .flex import flex_decode, supports
        if supports(q, k, v, block, need_lse):
            return flex_decode(q, k, v, kept, block, local_blocks, scale, need_lse)
    b, hq, _, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    g, t = hq // hk, nk - 1
    own = t // block
    local = own - torch.arange(local_blocks + 1, device=q.device)  # own block first
    local = local.view(1, 1, -1).expand(b, hk, -1)
    kept = kept.masked_fill((kept >= own - local_blocks) | (kept > own), -1)  # listed once, and causal
    sel = torch.cat([local, kept], -1)  # [b, hk, L]
    if not quantized and spans_ok(q, k, v):
        groups = [(bi, hi, merge_spans([(j * block, min(nk, j * block + block)) for j in ids if j >= 0]))
                  for bi, per_head in enumerate(sel.tolist()) for hi, ids in enumerate(per_head)]
        if q.dtype == torch.float32 and sum(len(spans) for *_, spans in groups) > _ROWS_AFTER * len(groups):
            got = _decode_rows(q, k, v, sel, block, scale, need_lse)
            if got is not None:
                return got
        return attend_spans(q, k, v, groups, scale)
    tok = (sel.clamp(min=0).unsqueeze(-1) * block + torch.arange(block, device=q.device)).flatten(-2)
    valid = ((sel >= 0).unsqueeze(-1).expand(-1, -1, -1, block).flatten(-2)) & (tok <= t)
    if quantized:  # on a CPU, read in place by fbgemm's bags; elsewhere gathered and dequantized below
        got = attend_quantized_rows(q, k, v, tok.clamp(max=t), valid, scale)
        if got is not None:
            return got
    ks, vs = gather_blocks(k, sel, block), gather_blocks(v, sel, block)  # [b, hk, L*block, d]
    bias = torch.zeros(valid.shape, dtype=torch.float32, device=q.device).masked_fill(~valid, float("-inf"))
    out, lse = attend(q.view(b, hk, g, d), ks, vs, scale, mask=bias.unsqueeze(2))
    return out.reshape(b, hq, 1, d).to(q.dtype), lse.reshape(b, hq, 1)


def attend_quantized_rows(q, k, v, tok: torch.Tensor, valid: torch.Tensor, scale: float):
    """(out [b, hq, 1, d] in q's dtype, lse [b, hq, 1] float32) of one query per head over the rows ``tok``
    [b, hk, R] (positions; attended where ``valid``) of an 8-bit cache (``quantized.QuantizedKV`` k and v),
    read in place by fbgemm's 8-bit embedding bags: the keys dequantized as they are gathered (one pass,
    into a float32 [R, d] block per KV head), the values summed with the probabilities as weights straight
    from their 8-bit rows. None where those bags do not apply (``quantized.rowwise_bags``): the caller
    gathers and dequantizes the rows instead."""
    from ..quantized import bag_sums, rowwise_bags
    kt, vt = rowwise_bags(k), rowwise_bags(v)
    if kt is None or vt is None:
        return None
    b, hq, _, d = q.shape
    hk, dv, R = k.shape[1], v.shape[-1], tok.shape[-1]
    g = hq // hk
    acc = acc_dtype(q.dtype)
    keys = bag_sums(kt[0], (tok + kt[1]).flatten(), b * hk * R, None, d).view(b, hk, R, d)
    s = (q.reshape(b, hk, g, d).to(acc) @ keys.to(acc).transpose(-1, -2)) * scale  # [b, hk, g, R]
    s = s.masked_fill(~valid.unsqueeze(2), float("-inf"))
    top = s.amax(-1, keepdim=True).clamp(min=-1e30)  # a row with no valid key: zeros out, lse -inf
    p = torch.exp(s - top)
    total = p.sum(-1, keepdim=True)
    rows = (tok + vt[1]).unsqueeze(2).expand(b, hk, g, R)  # each query head's bag: its KV head's rows
    out = bag_sums(vt[0], rows.flatten(), b * hk * g, p.float().flatten(), dv).view(b, hk, g, dv)
    out = out.to(acc) / total.clamp(min=1e-30)
    lse = (top + total.log()).squeeze(-1)
    return out.reshape(b, hq, 1, dv).to(q.dtype), lse.reshape(b, hq, 1).float()


def _decode_rows(q, k, v, sel: torch.Tensor, block: int, scale: float, need_lse: bool):
    """``block_sparse_decode`` on the CPU in float32: every listed row of the cache read in place by
    one sparse score call and one weighted sum for all heads (``cpu_flash.cache_rows``), where
    ``attend_spans`` makes a fused call per run of touching blocks and KV head, ~30 us of fixed cost
    each: at 32k the demo configs' steps list ~33 blocks per KV head, and for 32 scattered blocks the
    fused calls took 4.0 ms against 1.9 (1 thread). sel [b, hk, L]: the own block first, then past
    blocks (negative: none). None where the cache's strides are not whole rows."""
    b, hq, _, d = q.shape
    hk, t = k.shape[1], k.shape[2] - 1
    past = sel[..., 1:].clamp(min=-1).sort(-1, descending=True).values  # listed blocks first
    past = past[..., :int((past >= 0).sum(-1).max())]
    # slots: the own block's rows up to t, then each listed block whole; empty slots read row t, masked
    own = torch.arange(t - t % block, t + 1, device=q.device).expand(b, hk, -1)
    slots = (past.clamp(min=0).unsqueeze(-1) * block + torch.arange(block, device=q.device)).flatten(-2)
    empty = (past < 0).repeat_interleave(block, -1)
    rows = cache_rows(k, v, hq, torch.cat([own, slots.masked_fill(empty, t)], -1))
    if rows is None:
        return None
    s = row_scores(q, rows, scale)[0]  # [b * hq, L]
    top = s.amax(-1, keepdim=True)  # row t (the step's own key) is in every list: finite
    p = exp_below_max_(s, top)
    if bool(empty.any()):
        hide = torch.nn.functional.pad(empty, (own.shape[-1], 0)).unsqueeze(2).expand(b, hk, hq // hk, -1)
        p.masked_fill_(hide.reshape(b * hq, -1), 0.0)
    total = p.sum(-1, keepdim=True)
    out = row_sum(rows, [p.div_(total)]).view(b, hq, 1, d).to(q.dtype)
    return out, (top + total.log()).view(b, hq, 1) if need_lse else None


def block_mask_reference(blocks: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """Bool [b, kv_heads, n, n] (True = attended) of the executor's definition, written densely from
    it, for tests: row t attends to keys of its listed blocks and to its own block up to t."""
    b, hk, nb, S = blocks.shape
    pos = torch.arange(n)
    qb, kb = pos // block, pos // block
    mask = (qb.view(n, 1) == kb.view(1, n)) & (pos.view(1, n) <= pos.view(n, 1))
    mask = mask.expand(b, hk, n, n).clone()
    for bi in range(b):
        for hi in range(hk):
            for i in range(nb):
                for j in blocks[bi, hi, i].tolist():
                    if j >= 0:
                        rows = slice(i * block, min(n, (i + 1) * block))
                        mask[bi, hi, rows, j * block:min(n, (j + 1) * block)] = True
    return mask


# --------------------------------------------------------------------------- the row form
# The papers' gates choose per query row, not per query block: MoBA's gate (each query its top-k
# chunks) and NSA's compressed-attention ranking (each query its blocks, shared by the KV group).
# The row form takes such lists and runs them key-major: the (row, block) pairs sorted by block,
# so each block's K/V is read once for all the rows that chose it.

# Blocks of at least this many keys are attended on views of the cache, one call per block with
# all the rows that chose it (MoBA's chunks); smaller ones are gathered and batched (NSA's blocks).
_VIEW_BLOCK = 256
# Query rows (times heads) per batched item of the small-block strategy.
_TILE_ROWS = 64


def pairs_by_block(lists: torch.Tensor, g: int, m: int):
    """Sort (head, row, slot) entries by listed block. lists [hs, m, slots] (hs = 1: the g heads
    share a row's list). Returns entries [P] (flat index into the [g, m, slots] slot grid), rows [P]
    (flat index into [g * m]) and block ids [P], sorted by block (stable)."""
    slots = lists.shape[-1]
    flat = lists.expand(g, m, slots).reshape(-1)
    ent = torch.nonzero(flat >= 0).squeeze(1)
    ch, order = torch.sort(flat[ent], stable=True)
    ent = ent[order]
    return ent, torch.div(ent, slots, rounding_mode="floor"), ch


def block_runs(ch: torch.Tensor) -> list[tuple[int, int, int]]:
    """(block, start, end) runs of a sorted block-id vector."""
    if ch.numel() == 0:
        return []
    uniq, counts = torch.unique_consecutive(ch, return_counts=True)
    ends = torch.cumsum(counts, 0).tolist()
    return list(zip(uniq.tolist(), [0] + ends[:-1], ends))


def row_sparse_attention(qw, k1, v1, lists, pos, block: int, scale: float, extra=None, ws=None,
                         causal: bool = True, visible=None, partial=None):
    """Attention of each query row to the keys of its own list of blocks, for one KV group.

    qw [g, m, d]: the g query heads of the group, rows at positions ``pos`` [m]; k1/v1 [n, d]: its
    KV head; lists [hs, m, S]: block ids (block j holds keys [j*block, (j+1)*block)), -1 = empty
    slot, no duplicates in a row; hs = 1: the group's heads share each row's list (NSA), hs = g:
    each head has its own (MoBA). causal: a row lists no block after its own, and a listed block
    holding keys after the row's position (its own block) is attended causally; else every listed
    block is attended whole. ``visible`` (qpos [..., 1], kpos [..., block]) -> bool cuts listed
    blocks further, key by key (static sparse hides its window and global keys, which it attends
    itself), on the pairs ``partial`` (qpos [P], block [P]) -> bool [P] flags; the other pairs are
    attended whole, without a mask (FlexAttention's split of full and partial blocks).
    ``extra`` (out [g, m, d], lse [g, m]): keys the caller attended
    itself, disjoint from the listed ones, joined into the same softmax. ``ws``: a workspace dict
    for reused gather buffers. Returns (out [g, m, d] in qw's dtype, lse [g, m] float32 (float64
    for float64)), lse = -inf where a row saw no key.

    Blocks of ``_VIEW_BLOCK`` keys or more: one call per block on a view of the cache with the rows
    that chose it. Smaller blocks: each (row, block) pair carries its row's heads, pairs are sorted
    by block, the rows of one block are cut into items of T * 2^j rows (T * heads ~ _TILE_ROWS), and
    the items of one size are one batched fused call (a block's K/V read once per item). The
    parts merge by LSE per (row, head)."""
    g, m, d = qw.shape
    hs = lists.shape[0]
    # rows R of G heads each: a shared list serves the g heads of a row; per-head lists make every
    # (head, row) a row of one head
    if hs == 1:
        qt, rows_pos, lst = qw.transpose(0, 1), pos, lists[0]
    else:
        qt, rows_pos, lst = qw.reshape(g * m, 1, d), pos.repeat(g), lists.reshape(g * m, -1)
    ext = None
    if extra is not None:
        eo, el = extra
        ext = (eo.transpose(0, 1), el.t()) if hs == 1 else (eo.reshape(g * m, 1, d), el.reshape(g * m, 1))
    small = block < _VIEW_BLOCK and fused_ok(qw, k1, v1) and qw.dtype != torch.float64
    rule = (causal, visible, partial)
    parts = (_small_block_parts if small else _view_parts)(qt, k1, v1, lst, rows_pos, block, scale, ws, rule)
    out, lse = _merge_parts(parts, ext, qt)
    if hs == 1:
        return out.transpose(0, 1).to(qw.dtype), lse.t()
    return out.reshape(g, m, d).to(qw.dtype), lse.reshape(g, m)


def _row_pairs(lst: torch.Tensor, pos: torch.Tensor, block: int, rule):
    """(row [P], block [P], masked [P], cut [P]) of the listed (row, block) pairs, sorted by block;
    cut: the rule's ``partial`` flags the pair (its keys pass ``visible``); masked: the pair needs a
    key mask (cut, or causal and the block holds keys after the row's position)."""
    causal, _, partial = rule
    ent, row, blk = pairs_by_block(lst.unsqueeze(0), 1, lst.shape[0])
    masked = ((blk + 1) * block - 1 > pos[row]) & causal
    cut = partial(pos[row], blk) if partial is not None else torch.zeros_like(masked)
    return row, blk, masked | cut, cut


def _visible_keys(qpos: torch.Tensor, kpos: torch.Tensor, cut: torch.Tensor, n: int, rule) -> torch.Tensor:
    """Bool [..., keys]: which keys kpos a row at qpos [..., 1] sees of a masked pair (cut [..., 1]:
    the pair's keys pass the rule's ``visible``)."""
    causal, visible, _ = rule
    vis = kpos < n
    if causal:
        vis = vis & (kpos <= qpos)
    if visible is not None:
        vis = vis & (visible(qpos, kpos) | ~cut)
    return vis


def _view_parts(qt, k1, v1, lst, pos, block: int, scale: float, ws, rule):
    """Parts (out [P, G, d], lse [P, G], row [P]) for large blocks: per block, one call on a view of
    its keys for the rows that chose it (a masked one for the rows whose pair is masked)."""
    R, G, d = qt.shape
    n = k1.shape[0]
    row, blk, masked, cut = _row_pairs(lst, pos, block, rule)
    parts = []
    for j, s, e in block_runs(blk):
        ks, ke = j * block, min((j + 1) * block, n)
        for is_masked in (False, True):
            sel = masked[s:e] == is_masked
            r = row[s:e][sel]
            if r.numel() == 0:
                continue
            mask = None
            if is_masked:
                vis = _visible_keys(pos[r][:, None], torch.arange(ks, ke, device=qt.device), cut[s:e][sel][:, None],
                                    n, rule)
                some = vis.any(-1)  # rows that see none of the block's keys skip it (no -inf rows in autograd)
                r, vis = r[some], vis[some]
                if r.numel() == 0:
                    continue
                mask = additive_mask(vis, qt.dtype).unsqueeze(0)
            qp = qt.index_select(0, r).transpose(0, 1).unsqueeze(0)  # [1, G, rows, d]
            o, l = attend(qp, k1[None, None, ks:ke], v1[None, None, ks:ke], scale, mask=mask)
            parts.append((o[0].transpose(0, 1), l[0].t(), r))
    return parts


def _small_block_parts(qt, k1, v1, lst, pos, block: int, scale: float, ws, rule):
    """Parts (out [P, G, d], lse [P, G], row [P]) for small blocks, batched into items (see
    ``row_sparse_attention``)."""
    R, G, d = qt.shape
    dev, n = qt.device, k1.shape[0]
    nf = n // block  # full blocks
    nb = -(-n // block)
    T = max(1, _TILE_ROWS // G)
    row, blk, masked, cut = _row_pairs(lst, pos, block, rule)
    # pairs that need a mask (and those of the partial last block: the slot rows past n - 1) form
    # their own items: sort by (masked, block)
    if nf < nb:
        masked = masked | (blk == nf)
    key, order = torch.sort(blk + masked.long() * nb, stable=True)
    row, cut = row[order], cut[order]
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
    qflat = qt.reshape(R, G * d)
    parts = []
    for gk in torch.unique(group).tolist():
        B, is_masked = T << (gk // 2), gk % 2 == 1
        pick = torch.nonzero(group == gk).squeeze(1)
        segs, item = torch.unique_consecutive(seg[pick], return_inverse=True)  # pairs are sorted by segment
        slot = item * B + within[pick]
        slot_row = torch.zeros(segs.numel() * B, dtype=torch.long, device=dev)
        slot_row[slot] = row[pick]
        real = torch.zeros(segs.numel() * B, dtype=torch.bool, device=dev)
        real[slot] = True
        slot_cut = torch.zeros(segs.numel() * B, dtype=torch.bool, device=dev)
        slot_cut[slot] = cut[pick]
        blocks = seg_key[segs] % nb
        qq = _take(qflat, slot_row, ws, "q").view(segs.numel(), 1, B * G, d)
        # unmasked items list full blocks only: their keys read from the full-block prefix
        kk, vv = (gather_blocks((x if is_masked else x[:nf * block])[None, None], blocks[None, None], block,
                                workspace_buffer(ws, name, (segs.numel(), block * d), x)).view(-1, 1, block, d)
                  for x, name in ((k1, "k"), (v1, "v")))
        lsel_ok = real
        bias = None
        if is_masked:  # padding slots (not real rows) stand at the row of slot 0: dropped below
            kpos = blocks[:, None] * block + torch.arange(block, device=dev)  # [segs, block]
            vis = _visible_keys(pos[slot_row].view(-1, B, 1), kpos[:, None, :], slot_cut.view(-1, B, 1), n,
                                rule)  # [segs, B, block]
            lsel_ok = real & vis.any(-1).reshape(-1)  # a real row may see none of a pair's keys
            bias = additive_mask(vis, qt.dtype)
            bias = bias.unsqueeze(2).expand(-1, B, G, block).reshape(-1, 1, B * G, block)
        o, l = attend(qq, kk, vv, scale, mask=bias)
        parts.append((o.view(-1, G, d), l.view(-1, G).masked_fill(~lsel_ok[:, None], float("-inf")), slot_row))
    return parts


def _merge_parts(parts, extra, qt):
    """Merge the parts (out [P, G, d], lse [P, G], row [P]) and ``extra`` (out [R, G, d], lse [R, G])
    by LSE per (row, head): out [R, G, d] and lse [R, G] (-inf where a row saw no key). Accumulates
    in place without autograd, out of place under it (the inputs of exp must stay as recorded)."""
    R, G, d = qt.shape
    acc = acc_dtype(qt.dtype)
    dev = qt.device
    grad = torch.is_grad_enabled()
    mx = torch.full((R, G), float("-inf"), dtype=acc, device=dev)
    if extra is not None:
        mx = torch.maximum(mx, extra[1].to(acc))
    for _, l, rows in parts:
        mx = mx.scatter_reduce(0, rows[:, None].expand(-1, G), l.to(acc), "amax")
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx)).detach()  # a shift: no gradient
    if extra is not None:
        den = torch.exp(extra[1].to(acc) - mx).contiguous()
        out = (extra[0].to(acc) * den.unsqueeze(-1)).contiguous()  # index_add_ wants it dense
    else:
        den = torch.zeros((R, G), dtype=acc, device=dev)
        out = torch.zeros((R, G, d), dtype=acc, device=dev)
    for o, l, rows in parts:
        w = torch.exp(l.to(acc) - mx.index_select(0, rows))
        if grad:
            den, out = den.index_add(0, rows, w), out.index_add(0, rows, o.to(acc) * w.unsqueeze(-1))
        else:
            den.index_add_(0, rows, w)
            out.index_add_(0, rows, o.to(acc) * w.unsqueeze(-1))
    # rows with no key (den 0): out 0, lse -inf; divided by a safe 1 so that no inf enters autograd
    seen = den > 0
    safe = torch.where(seen, den, torch.ones_like(den))
    lse = torch.where(seen, mx + torch.log(safe), torch.full_like(mx, float("-inf")))
    return out / safe.unsqueeze(-1), lse


def workspace_buffer(ws: dict | None, key: str, shape, like: torch.Tensor) -> torch.Tensor | None:
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
    out = workspace_buffer(ws, key, (index.numel(), *x.shape[1:]), x)
    return x.index_select(0, index) if out is None else torch.index_select(x, 0, index, out=out)
