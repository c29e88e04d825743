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
blocks, one memcpy each): no n x n matrix, no per-row index lists. ``backend="triton"`` runs the
Triton twin instead (``kernels/blocksparse.py``). A one-token decode step attends its blocks on
views of the cache (``cpu_flash.attend_spans``), without copying them.
"""
from __future__ import annotations

import math

import torch

from .common import acc_dtype, gather_blocks, merge_lse
from .cpu_flash import attend_spans, flash_lse, merge_spans, spans_ok

# Elements of gathered keys per call: large enough for few calls, small enough to stay in cache.
_CHUNK_ELEMS = 1 << 22


def _pad_to(x: torch.Tensor, n: int) -> torch.Tensor:
    if x.shape[2] == n:
        return x
    return torch.nn.functional.pad(x, (0, 0, 0, n - x.shape[2]))


def _gather(x: torch.Tensor, idx: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    """x.index_select(0, idx), into ``buf`` when given."""
    if buf is None:
        return x.index_select(0, idx)
    return torch.index_select(x, 0, idx, out=buf[:len(idx) * x.shape[1]].view(len(idx), x.shape[1]))


def block_sparse_prefill(q, k, v, blocks: torch.Tensor, block: int, scale: float, backend: str = "torch"):
    """(out [b, hq, n, d], lse [b, hq, n] float32/float64) of causal prefill (q_len == kv_len = n).
    backend "triton": the executor's Triton kernel (``kernels/blocksparse.py``, its twin), else the
    torch path below."""
    if backend == "triton":
        from ..kernels.blocksparse import block_sparse_attention  # lazily: triton is optional
        return block_sparse_attention(q, k, v, blocks, block, scale)
    b, hq, n, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    nb = math.ceil(n / block)
    npad = nb * block
    # padded positions sit after every real one: the diagonal's causal mask hides them from real rows
    qp, kp, vp = (_pad_to(x, npad) for x in (q, k, v))
    acc = acc_dtype(q.dtype)
    # listed blocks first in each row, so that a row with c blocks lists them in its first c slots
    blocks = blocks.sort(-1, descending=True).values
    counts = (blocks >= 0).sum(-1)  # [b, hk, nb]
    # gathers write into two buffers reused across chunks: a fresh large tensor per chunk costs page
    # faults that take longer than the copy itself (measured: 30 ms vs 2 ms for 7 MB); autograd needs
    # fresh tensors, so a call that records gradients allocates per chunk
    grad = torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)
    most = int(counts.max()) if counts.numel() else 0
    room = min(_CHUNK_ELEMS, nb * most * block * d) if most else 0
    kbuf = vbuf = None
    if not grad and room:
        kbuf, vbuf = (torch.empty(room + most * block * d, dtype=k.dtype, device=k.device) for _ in range(2))
    out = torch.empty(b, hk, nb, g, block, d, dtype=acc, device=q.device)
    lse = torch.empty(b, hk, nb, g, block, dtype=acc, device=q.device)
    for bi in range(b):
        for hi in range(hk):
            qh = qp[bi, hi * g:(hi + 1) * g].reshape(g, nb, block, d).transpose(0, 1)  # [nb, g, block, d]
            kh, vh = kp[bi, hi].reshape(nb, block * d), vp[bi, hi].reshape(nb, block * d)
            o_d, l_d = flash_lse(qh, kh.view(nb, 1, block, d), vh.view(nb, 1, block, d), scale, causal=True)
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
                    o_s, l_s = flash_lse(qh.index_select(0, r), kg, vg, scale)
                    o, l_ = merge_lse(out[bi, hi].index_select(0, r), lse[bi, hi].index_select(0, r),
                                      o_s.to(acc), l_s.to(acc))
                    out[bi, hi].index_copy_(0, r, o)
                    lse[bi, hi].index_copy_(0, r, l_)
    out = out.permute(0, 1, 3, 2, 4, 5).reshape(b, hq, npad, d)
    lse = lse.permute(0, 1, 3, 2, 4).reshape(b, hq, npad)
    return out[:, :, :n].to(q.dtype), lse[:, :, :n]


def block_sparse_decode(q, k, v, kept: torch.Tensor, block: int, local_blocks: int, scale: float):
    """(out, lse) of one query per head at the last position t = kv_len - 1: its own (partial) block,
    the ``local_blocks`` blocks before it, and the past blocks ``kept`` [b, kv_heads, S] (-1 pads)
    that are not among those. Reads only those rows of the cache: in place with fused calls on views
    (``attend_spans``, touching blocks joined), or, without the fused kernel or under autograd, by
    gathering them into one masked call."""
    b, hq, _, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    g, t = hq // hk, nk - 1
    own = t // block
    local = own - torch.arange(local_blocks + 1, device=q.device)  # own block first
    local = local.view(1, 1, -1).expand(b, hk, -1)
    kept = kept.masked_fill((kept >= own - local_blocks) | (kept > own), -1)  # listed once, and causal
    sel = torch.cat([local, kept], -1)  # [b, hk, L]
    if spans_ok(q, k, v):
        groups = [(bi, hi, merge_spans([(j * block, min(nk, j * block + block)) for j in ids if j >= 0]))
                  for bi, per_head in enumerate(sel.tolist()) for hi, ids in enumerate(per_head)]
        return attend_spans(q, k, v, groups, scale)
    tok = (sel.clamp(min=0).unsqueeze(-1) * block + torch.arange(block, device=q.device)).flatten(-2)
    valid = ((sel >= 0).unsqueeze(-1).expand(-1, -1, -1, block).flatten(-2)) & (tok <= t)
    ks, vs = gather_blocks(k, sel, block), gather_blocks(v, sel, block)  # [b, hk, L*block, d]
    bias = torch.zeros(valid.shape, dtype=torch.float32, device=q.device).masked_fill(~valid, float("-inf"))
    out, lse = flash_lse(q.view(b, hk, g, d), ks, vs, scale, bias.unsqueeze(2))
    return out.reshape(b, hq, 1, d).to(q.dtype), lse.reshape(b, hq, 1)


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
