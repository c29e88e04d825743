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
    inputs; Hk divides Hq, so GQA needs no repeat; strided views are fine; m > 0). ``mask`` is
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
