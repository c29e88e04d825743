"""MoBA, readable: the definitions the fast paths are tested against (tests import them from here).

``moba_reference`` builds every query's visible keys from the paper's definition with a dense mask;
``pairs_attention_reference`` is the PyTorch twin of the Triton kernel's work list."""
from __future__ import annotations

import math

import torch

from ..lse_attention import attention_lse_reference


def moba_reference(q, k, v, chunk, topk, causal=True, scale=None, shared=False):
    """MoBA from its definition with a dense [nq, nk] visibility mask, float64 attention; (out, lse).

    Gate: score of chunk c for a query = scale * q . mean(keys of c) (a partial chunk averaged over
    its real length), float32 means, products in float64 rounded to float32 like the op. A query
    at position p (bottom-right) always sees its own chunk p // chunk; causal: the top (topk - 1)
    chunks before it, keys <= p; non-causal: the top (topk - 1) other chunks anywhere (topk when it
    has no position). Ties: the later chunk wins.
    shared: the heads of a KV group use the sum of their scores.
    """
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    g = hq // hk
    scale = d ** -0.5 if scale is None else scale
    nc = math.ceil(nk / chunk)
    means = torch.stack([k[:, :, c * chunk:min((c + 1) * chunk, nk)].float().mean(2) for c in range(nc)], 2)
    gate = (q.detach().double() @ means.detach().double().repeat_interleave(g, 1).transpose(-1, -2)) * scale
    if shared:
        gate = gate.view(b, hk, g, nq, nc).sum(2, keepdim=True).expand(b, hk, g, nq, nc).reshape(b, hq, nq, nc)
    gate = gate.float().tolist()
    vis = torch.zeros(b, hq, nq, nk, dtype=torch.bool)
    for bi in range(b):
        for h in range(hq):
            for i in range(nq):
                p = nk - nq + i
                own = p // chunk if p >= 0 else None
                if own is None:
                    cands = list(range(nc))
                else:
                    cands = [c for c in range(nc) if (c < own if causal else c != own)]
                cands.sort(key=lambda c: (gate[bi][h][i][c], c), reverse=True)
                chosen = cands[:topk - (own is not None)] + ([own] if own is not None else [])
                for c in chosen:
                    vis[bi, h, i, c * chunk:(c + 1) * chunk] = True
                if causal:
                    vis[bi, h, i, p + 1:] = False
    return attention_lse_reference(q.double(), k.double(), v.double(), scale, mask=vis)


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
