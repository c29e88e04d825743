"""Softmax attention that also returns the log-sum-exp of each row: the one plain-PyTorch version
(the readable twin of the fused and Triton paths, and the fallback where those cannot run) and
``attend``, which takes torch's fused CPU kernel when it can. Exact attention's LSE path, MoBA's
chunks, the sparse method's pieces and HyperAttention's blocks all go through these two."""
from __future__ import annotations

import math

import torch

from .common import acc_dtype, causal_mask
from .cpu_flash import flash_lse, fused_ok

# Score entries per block of query rows (~128 MB of float32 scores): memory O(rows x kv_len).
_BLOCK_ENTRIES = 1 << 25


def attention_lse_reference(q, k, v, scale: float, *, causal: bool = False, mask=None):
    """(out, lse) of q [..., Hq, m, d] against k/v [..., Hk, n, d] in plain PyTorch, in blocks of rows.

    Leading dims broadcast; Hk divides Hq (query head h reads KV head h // (Hq / Hk); K/V are not
    repeated). causal: the queries are the last m positions (bottom-right). mask: bool (True =
    visible) or additive, broadcastable to [..., Hq, m, n]. Computed in float32 (float64 for float64
    inputs); out in q.dtype, lse in that accumulation dtype. Rows that see no key get lse = -inf and
    a zero output.
    """
    *lead, hq, nq, d = q.shape
    hk, nk = k.shape[-3], k.shape[-2]
    acc = acc_dtype(q.dtype)
    lead = torch.broadcast_shapes(tuple(lead), tuple(k.shape[:-3]))
    if nq == 0:
        return q.new_zeros((*lead, hq, 0, v.shape[-1])), q.new_zeros((*lead, hq, 0), dtype=acc)
    qg = q.unflatten(-3, (hk, hq // hk))  # [..., hk, g, m, d]: the query heads of each KV head
    kf, vf = k.to(acc).unsqueeze(-3), v.to(acc).unsqueeze(-3)  # [..., hk, 1, n, d]
    rows = max(1, _BLOCK_ENTRIES // max(1, math.prod(lead) * hq * nk))
    outs, lses = [], []
    for s in range(0, nq, rows):
        e = min(s + rows, nq)
        scores = torch.matmul(qg[..., s:e, :].to(acc), kf.transpose(-1, -2)) * scale  # [..., hk, g, r, n]
        if causal:
            vis = causal_mask(e - s, nk, q.device, q_offset=nk - nq + s)
            scores = scores.masked_fill(~vis, float("-inf"))
        if mask is not None:
            m = mask[..., s:e, :] if mask.shape[-2] > 1 else mask
            m = m.expand(*lead, hq, e - s, nk).unflatten(-3, (hk, hq // hk))
            scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.to(acc)
        lse = torch.logsumexp(scores, dim=-1)
        safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        outs.append(torch.matmul(torch.exp(scores - safe.unsqueeze(-1)), vf))
        lses.append(lse)
    out = torch.cat(outs, dim=-2).flatten(-4, -3).to(q.dtype)
    return out, torch.cat(lses, dim=-1).flatten(-3, -2)


def attend(q, k, v, scale: float, *, causal: bool = False, mask=None):
    """(out, lse) of q [B, Hq, m, d] vs k/v [B, Hk, n, d] (Hk divides Hq; strided views are fine),
    m > 0 (the fused kernel crashes on empty queries). causal only for squares (m == n): the fused
    kernel aligns it top-left. mask: additive, broadcastable to [B, Hq, m, n].

    torch's fused CPU flash-attention kernel where it takes the inputs (it returns the LSE and
    broadcasts K/V heads for GQA), else ``attention_lse_reference``. A row whose keys are all
    masked gets lse = 0 from the fused kernel: callers that can produce one mark it (``hide_empty``).
    """
    if fused_ok(q, k, v):
        try:
            return flash_lse(q, k, v, scale, mask, causal)
        except RuntimeError:  # a layout the kernel does not take: the plain path takes any
            pass
    return attention_lse_reference(q, k, v, scale, causal=causal, mask=mask)
