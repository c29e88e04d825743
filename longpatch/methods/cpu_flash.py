"""torch's fused CPU flash-attention kernel (it returns the LSE), shared by the methods that need
(out, lse) of many attention calls on the CPU: exact (return_lse) through ``CpuFlashLSE``;
HyperAttention, MoBA, NSA and sparse through ``flash_lse`` (one entry: mask cast, autograd only when
needed, LSE dtype), mostly by way of ``lse_attention.attend``.

The aten op is private; where a torch build lacks it, FA_CPU is None and callers use plain PyTorch.
Its causal flag aligns top-left: use it for squares (q_len == kv_len) or non-causal calls only.

A one-token decode step (MoBA, NSA) reads its rows of the cache in place without this kernel:
``cache_rows`` lists them, ``row_scores`` and ``row_sum`` are one sparse call each for all heads
and blocks (``attend_rows`` composes them), where the kernel would be one call per block and head.
"""
from __future__ import annotations

import functools
import itertools
import warnings
from typing import NamedTuple

import torch

from .common import acc_dtype, exp_below_max_

FA_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FA_CPU_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def fused_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the fused kernel exists and takes these inputs (CPU tensors of one float dtype)."""
    return (FA_CPU is not None and q.device.type == "cpu" and q.dtype in FUSED_DTYPES
            and k.dtype == q.dtype and v.dtype == q.dtype)


def additive_mask(visible: torch.Tensor, dtype) -> torch.Tensor:
    """The additive mask ``flash_lse`` takes: 0 where ``visible`` (bool), -inf elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def hide_empty(out, lse, visible_any):
    """Rows that saw no key (``visible_any`` False, broadcast over out's rows): lse = -inf and a
    zero output, so an LSE merge ignores them (the fused kernel gives them lse = 0)."""
    if bool(visible_any.all()):
        return out, lse
    lse = torch.where(visible_any, lse, torch.full_like(lse, float("-inf")))
    out = torch.where(visible_any.unsqueeze(-1), out, torch.zeros_like(out))
    return out, lse


def mask_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an additive mask must have for the fused kernel: the query's for float32/float64;
    float32 (more precise, and accepted) for half types. The kernel rejects most mismatches but reads
    a broadcast float32 mask of a float64 call as float64 memory: garbage, no error."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def flash_lse(q, k, v, scale: float, mask=None, causal: bool = False):
    """(out, lse) of q [B, Hq, m, d] against k/v [B, Hk, n, d] with the fused kernel (``fused_ok``
    inputs: CPU tensors; Hk divides Hq, so GQA needs no repeat; strided views are fine; m > 0). The
    methods call it through ``lse_attention.attend``, which takes any device (the plain reference). ``mask`` is
    additive, broadcastable to [B, Hq, m, n]; causal aligns top-left. lse is float32 (float64 for
    float64). Differentiable in out and lse when an input requires grad. A row whose keys are all
    masked gets out 0 and lse 0 from the kernel: the caller marks such rows (``hide_empty``)."""
    if mask is not None:  # float32 for half inputs: HyperAttention's log-weights are not 0/-inf
        mask = mask.to(mask_dtype(q.dtype))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, lse = CpuFlashLSE.apply(q, k, v, mask, causal, scale)
    else:
        out, lse = FA_CPU(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse.to(acc_dtype(q.dtype))


class CpuFlashLSE(torch.autograd.Function):
    """torch's fused CPU flash-attention kernel, which returns the LSE, made differentiable in both
    outputs. The kernel's own backward ignores a gradient on the LSE; we feed it one exactly by
    appending a feature column: with v' = [v, 0], out' = [out, -dlse], dout' = [dout, 1] the kernel's
    row term D' = rowsum(dout'·out') = D - dlse, so dS = P·(dP - D + dlse), which is the gradient of
    (out, lse). q and k get a zero column so the scores (with an explicit scale) are unchanged."""

    @staticmethod
    def forward(ctx, q, k, v, bias, causal: bool, scale: float):
        if bias is not None:
            bias = bias.to(mask_dtype(q.dtype))
        out, lse = FA_CPU(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, bias, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dout = dout.to(out.dtype)
        if dlse is None:
            dq, dk, dv = FA_CPU_BWD(dout, q, k, v, out, lse, 0.0, ctx.causal, attn_mask=bias, scale=ctx.scale)
        else:
            def col(x, val):
                return torch.cat([x, x.new_full((*x.shape[:-1], 1), val)], dim=-1)
            out2 = torch.cat([out, (-dlse).to(out.dtype).unsqueeze(-1)], dim=-1)
            dq, dk, dv = FA_CPU_BWD(col(dout, 1.0), col(q, 0.0), col(k, 0.0), col(v, 0.0), out2, lse, 0.0,
                                     ctx.causal, attn_mask=bias, scale=ctx.scale)
            dq, dk, dv = dq[..., :-1], dk[..., :-1], dv[..., :-1]
        return dq, dk, dv, None, None, None


def merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, with touching or overlapping [start, end) spans joined: fewer, longer kernel calls."""
    out: list[list[int]] = []
    for s0, s1 in sorted(spans):
        if out and s0 <= out[-1][1]:
            out[-1][1] = max(out[-1][1], s1)
        else:
            out.append([s0, s1])
    return [(s0, s1) for s0, s1 in out]


def spans_ok(q, k, v) -> bool:
    """Whether ``attend_spans`` takes these inputs: ``fused_ok`` ones, outside autograd."""
    return fused_ok(q, k, v) and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))


def attend_spans(q, k, v, groups, scale: float):
    """(out [b, hq, 1, d], lse [b, hq, 1]) of one query per head against row spans of the cache, read
    in place. ``groups`` lists (batch row, KV head, spans) for consecutive equal slices of q's heads,
    in order (batch row by batch row, then head by head; each slice hq / (b * len(groups)) heads
    wide): each span a [start, end) range of that KV head's rows (disjoint, see ``merge_spans``),
    at least one per group. One fused call per (group, span) on views, merged by their LSEs into one
    softmax per head.

    For a one-token decode step, which is memory-bound: the selected rows are read once, where
    gathering them first reads, writes and reads them again (2x slower here with the cache out of
    the CPU caches). Needs ``spans_ok`` inputs."""
    b, hq, _, d = q.shape
    acc = acc_dtype(q.dtype)
    per_row = len(groups) // b
    gh = hq // per_row
    width = max(len(spans) for *_, spans in groups)
    # the kernel's own output shapes ([1, gh, 1, d] and [1, gh, 1]), stacked once: a step makes a
    # dozen calls per layer, so per-call reshapes cost as much as the small calls themselves
    zero = q.new_zeros(1, gh, 1, d)
    empty = torch.full((1, gh, 1), float("-inf"), dtype=torch.float32, device=q.device)
    outs, lses = [], []
    for i, (bi, hi, spans) in enumerate(groups):
        h0 = (i % per_row) * gh
        qh, kb, vb = q[bi:bi + 1, h0:h0 + gh], k[bi:bi + 1, hi:hi + 1], v[bi:bi + 1, hi:hi + 1]
        for s0, s1 in spans:
            o, lse = FA_CPU(qh, kb.narrow(2, s0, s1 - s0), vb.narrow(2, s0, s1 - s0), 0.0, False, scale=scale)[:2]
            outs.append(o)
            lses.append(lse)
        outs += [zero] * (width - len(spans))  # fewer spans than the widest group: weight 0
        lses += [empty] * (width - len(spans))
    parts = torch.stack(outs).view(len(groups), width, gh, d).to(acc)
    lse = torch.stack(lses).view(len(groups), width, gh).to(acc)
    out = (torch.softmax(lse, 1).unsqueeze(-1) * parts).sum(1)  # each part's weight exp(lse_part - lse_all)
    return out.view(b, hq, 1, d).to(q.dtype), torch.logsumexp(lse, 1).view(b, hq, 1)


# --------------------------------------------------------------------------- rows of the cache, read in place

@functools.lru_cache(maxsize=64)
def _key0_rows(b: int, h: int, group: int, s0: int, s1: int, device: torch.device) -> torch.Tensor:
    """[b, h, 1]: the flat row (``_as_rows``) of key 0 of the KV head each of h heads reads (head j:
    KV head j // group); cached, as every decode step of a cache asks the same ones."""
    return torch.tensor([[[bi * s0 + (j // group) * s1] for j in range(h)] for bi in range(b)], device=device)


def _as_rows(x: torch.Tensor):
    """(x2, s0, s1, step): x [b, h, n, d] as a 2-D [rows, d] view of its storage, in which x[bi, hi, t]
    is row bi * s0 + hi * s1 + t * step; None when x's strides are not whole rows. Any batch, head
    and sequence strides that are multiples of d, with rows contiguous, qualify: every KV cache
    layout (GrowingCache's views, transformers' transposed [b, n, h, d], expanded heads)."""
    b, h, n, d = x.shape
    if x.stride(-1) != 1 and d > 1:
        return None
    strides = [0 if size == 1 else s for size, s in zip(x.shape[:3], x.stride()[:3])]  # size 1: never stepped
    if any(s % d for s in strides):
        return None
    s0, s1, step = (s // d for s in strides)
    return x.as_strided(((b - 1) * s0 + (h - 1) * s1 + (n - 1) * step + 1, d), (d, 1)), s0, s1, step


@functools.lru_cache(maxsize=128)
def _row_starts(heads: int, lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``CacheRows.starts`` for lists of these lengths: cached, as the layers of a decode step (and
    the steps a select block apart) ask the same ones, and building it is a fixed cost per call."""
    if len(lengths) == 1:
        return torch.arange(0, heads * lengths[0] + 1, lengths[0], device=device)
    at = itertools.accumulate((heads * L for L in lengths), initial=0)
    return torch.tensor([a + j * L for a, L in zip(at, lengths) for j in range(heads)] + [heads * sum(lengths)],
                        device=device)


class CacheRows(NamedTuple):
    """Lists of cache rows per query head, as ``row_scores`` and ``row_sum`` read them: k2/v2 the
    [rows, d] views, k_rows/v_rows the flat rows of every list, list by list and in each head by
    head, starts [lists * heads + 1] where each (list, head) begins (the CSR row pointers, the bag
    offsets), lengths the lists' lengths L_i."""
    k2: torch.Tensor
    v2: torch.Tensor
    k_rows: torch.Tensor
    v_rows: torch.Tensor
    starts: torch.Tensor
    lengths: tuple[int, ...]
    heads: int


def cache_rows(k: torch.Tensor, v: torch.Tensor, hq: int, *pos: torch.Tensor) -> CacheRows | None:
    """The rows of k/v [b, kv_heads, n, d] at the key positions of one or more lists, for hq query
    heads (head j reads KV head j // (hq / kv_heads)). Each list: [b, hq, L] (per query head),
    [b, kv_heads, L] (shared by a KV head's query heads) or [L] (shared by all heads), positions
    distinct within a list; each list gets its own softmax. None when k's or v's strides are not
    whole rows (``_as_rows``)."""
    b, hk = k.shape[:2]
    tk = _as_rows(k)
    same = v.shape == k.shape and v.stride() == k.stride()  # the usual case: v's rows are k's rows
    tv = tk if same else _as_rows(v)
    if tk is None or tv is None:
        return None

    def rows(table):
        _, s0, s1, step = table
        flat = []
        for p in pos:
            h = p.shape[1] if p.dim() == 3 else hk
            r = _key0_rows(b, h, h // hk, s0, s1, k.device) + (p if step == 1 else p * step)  # [b, h, L]
            if h != hq:  # a KV head's list, for each of its query heads
                r = r.unsqueeze(2).expand(b, hk, hq // hk, -1)
            flat.append(r.reshape(-1))
        return flat[0] if len(flat) == 1 else torch.cat(flat)

    heads, lengths = b * hq, tuple(p.shape[-1] for p in pos)
    starts = _row_starts(heads, lengths, k.device)
    k_rows = rows(tk)
    return CacheRows(tk[0], v.as_strided(tk[0].shape, (k.shape[-1], 1)) if same else tv[0], k_rows,
                     k_rows if same else rows(tv), starts, lengths, heads)


@functools.cache
def _sparse_csr_ready() -> bool:
    """Build one CSR tensor with torch's one-time 'sparse CSR support is in beta' warning silenced:
    the warning is printed once per process and says nothing about these calls."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.sparse_csr_tensor(torch.zeros(2, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0),
                                size=(1, 1), check_invariants=False)
    return True


def row_scores(q: torch.Tensor, rows: CacheRows, scale: float) -> list[torch.Tensor]:
    """Scaled scores of one query per head q [b, hq, 1, d] against its listed rows, [b * hq, L_i]
    float32 per list: one sparse call for all (``sampled_addmm``: q·k at the listed (list and head,
    row) entries of a [lists * heads, rows] score matrix)."""
    _sparse_csr_ready()
    nl = len(rows.lengths)
    # zeros, not garbage: the CPU kernel adds beta * value even with beta=0 (0 * NaN = NaN)
    pattern = torch.sparse_csr_tensor(rows.starts, rows.k_rows, q.new_zeros(rows.k_rows.shape),
                                      size=(nl * rows.heads, rows.k2.shape[0]), check_invariants=False)
    q2 = q.reshape(rows.heads, -1)
    q2 = q2 if nl == 1 else torch.cat([q2] * nl)
    s = torch.sparse.sampled_addmm(pattern, q2, rows.k2.t(), beta=0.0, alpha=scale).values()
    if nl == 1:
        return [s.view(rows.heads, -1)]
    return [part.view(rows.heads, L) for part, L in zip(s.split([rows.heads * L for L in rows.lengths]), rows.lengths)]


def row_sum(rows: CacheRows, weights: list[torch.Tensor]) -> torch.Tensor:
    """sum over the lists i and their rows r of weights[i][h, r] * v[row r of head h] -> [heads, d]
    float32 (weights [heads, L_i] float32): one ``embedding_bag`` call reading only those rows."""
    w = weights[0].reshape(-1) if len(weights) == 1 else torch.cat([x.reshape(-1) for x in weights])
    out = torch.nn.functional.embedding_bag(rows.v_rows, rows.v2, rows.starts, mode="sum", per_sample_weights=w,
                                            include_last_offset=True)
    return out if len(weights) == 1 else out.view(len(weights), rows.heads, -1).sum(0)


def softmax_lse(s: torch.Tensor, need_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(softmax, logsumexp [..., 1] or None) along the last dim of finite scores, in place on s (the
    callers' own score rows). Differences below a row's maximum are floored at ``EXP_FLOOR`` before
    exp (``common.exp_below_max_``): torch's CPU exp is 50-100x slower for float32 inputs below about
    -87, which real score rows reach (torch.softmax took 4x longer on rows spread like a model's);
    a key 80 below the maximum weighs under 2e-35 of it, which moves no float32 sum. An infinite
    score makes the row NaN, as softmax does (the ops' non-finite guard then isolates its row)."""
    top = s.amax(-1, keepdim=True)
    p = exp_below_max_(s, top)
    total = p.sum(-1, keepdim=True)
    return p.div_(total), (top + total.log()) if need_lse else None


def attend_rows(q, k, v, pos: torch.Tensor, scale: float, need_lse: bool = True):
    """(out [b, hq, 1, d], lse [b, hq, 1] or None) of one float32 query per head against the key
    positions pos of its KV head (``cache_rows``: one list, the same length for every head), read
    in place; None for other dtypes or where the cache's strides are not whole rows.

    For a one-token decode step: q·k at the listed rows in one sparse call, one softmax, the
    weighted sum of the listed value rows in one call. A fixed handful of ops whatever the number
    of heads and blocks: a fused attention call per block and head costs ~30 us of fixed overhead
    on the CPU here, more than reading its block."""
    b, hq, _, d = q.shape
    rows = cache_rows(k, v, hq, pos) if q.dtype == torch.float32 else None
    if rows is None:
        return None
    p, lse = softmax_lse(row_scores(q, rows, scale)[0], need_lse)
    return row_sum(rows, [p]).view(b, hq, 1, d), None if lse is None else lse.view(b, hq, 1)
