"""torch's fused CPU flash-attention kernel (it returns the LSE), shared by the methods that need
(out, lse) of many attention calls on the CPU: exact (return_lse) through ``CpuFlashLSE``;
HyperAttention, MoBA, NSA and sparse through ``flash_lse`` (one entry: mask cast, autograd only when
needed, LSE dtype), mostly by way of ``lse_attention.attend``.

The aten op is private; where a torch build lacks it, FA_CPU is None and callers use plain PyTorch.
Its causal flag aligns top-left: use it for squares (q_len == kv_len) or non-causal calls only.
"""
from __future__ import annotations

import torch

from .common import acc_dtype

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
