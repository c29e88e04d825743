"""torch's fused CPU flash-attention kernel (it returns the LSE), shared by the methods that need
(out, lse) of many attention calls on the CPU: exact (return_lse), HyperAttention, MoBA.

The aten op is private; where a torch build lacks it, FA_CPU is None and callers use plain PyTorch.
Its causal flag aligns top-left: use it for squares (q_len == kv_len) or non-causal calls only.
"""
from __future__ import annotations

import torch

FA_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FA_CPU_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class CpuFlashLSE(torch.autograd.Function):
    """torch's fused CPU flash-attention kernel, which returns the LSE, made differentiable in both
    outputs. The kernel's own backward ignores a gradient on the LSE; we feed it one exactly by
    appending a feature column: with v' = [v, 0], out' = [out, -dlse], dout' = [dout, 1] the kernel's
    row term D' = rowsum(dout'·out') = D - dlse, so dS = P·(dP - D + dlse), which is the gradient of
    (out, lse). q and k get a zero column so the scores (with an explicit scale) are unchanged."""

    @staticmethod
    def forward(ctx, q, k, v, bias, causal: bool, scale: float):
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
