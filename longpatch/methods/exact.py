"""Exact softmax attention: the baseline every approximate method is measured against."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Method, register_method
from .common import (
    causal_mask,
    check_qkv,
    default_scale,
    guards_nonfinite,
    merge_lse,
    resolve_backend,
)
from .cpu_flash import FA_CPU, CpuFlashLSE
from .lse_attention import attention_lse_reference


@guards_nonfinite
def exact_attention(q, k, v, *, causal: bool = True, scale: float | None = None, attn_mask=None,
                    return_lse: bool = False, backend: str = "auto"):
    """softmax(q kᵀ · scale [+ mask]) v on the shared layout.

    attn_mask (optional): bool (True = visible) or additive float, broadcastable to
    [b, q_heads, q_len, kv_len]; combined with the causal mask. With ``return_lse`` also returns
    the float32 (float64 for float64) log-sum-exp of each row's scaled scores ([b, q_heads, q_len]); rows that see no
    key get lse = -inf and a zero output.
    """
    group, nq, nk = check_qkv(q, k, v, causal, value_dim=True)
    scale = default_scale(scale, q.shape[-1])
    _check_mask(attn_mask, (q.shape[0], q.shape[1], nq, nk))
    backend = resolve_backend(backend, q, k, v)
    if backend == "triton" and attn_mask is None:
        from ..kernels import attention as tk  # imported lazily: triton is optional
        return tk.flash_attention(q, k, v, causal=causal, scale=scale, return_lse=return_lse)
    if causal and 1 < nq < nk and attn_mask is None and q.device.type == "cpu" and FA_CPU is not None \
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
        # a chunk after a cache (chunked prefill): the earlier keys unmasked and the chunk's own square causal,
        # merged by their LSE, where SDPA would take an [nq, nk] mask down its unfused path (3-4x slower here)
        past = nk - nq
        o1, l1 = CpuFlashLSE.apply(q, k[:, :, :past], v[:, :, :past], None, False, scale)
        o2, l2 = CpuFlashLSE.apply(q, k[:, :, past:], v[:, :, past:], None, True, scale)
        out, lse = merge_lse(o1, l1, o2, l2)
        return (out, lse) if return_lse else out
    if return_lse:
        if q.device.type == "cpu" and FA_CPU is not None and attn_mask is None and (not causal or nq == nk) \
                and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
            return CpuFlashLSE.apply(q, k, v, None, causal, scale)  # fused, differentiable in out and lse
        return attention_lse_reference(q, k, v, scale, causal=causal, mask=attn_mask)
    if q.is_cuda and attn_mask is None and _flash_attn_usable(q):
        return _flash_attn(q, k, v, causal, scale)
    mask = attn_mask
    is_causal = causal and nq == nk and mask is None
    if causal and not is_causal and nq > 1:  # bottom-right alignment; one query sees every key
        cm = causal_mask(nq, nk, q.device)
        mask = cm if mask is None else _and_masks(mask, cm)
    return _sdpa(q, k, v, mask, is_causal, scale, group)


def _check_mask(mask, shape: tuple) -> None:
    """attn_mask: None, or a bool or float tensor broadcastable to [b, q_heads, q_len, kv_len]."""
    if mask is None:
        return
    ok = isinstance(mask, torch.Tensor) and (mask.dtype == torch.bool or mask.is_floating_point()) \
        and mask.dim() <= 4 and all(m in (1, s) for m, s in zip(mask.shape[::-1], shape[::-1]))
    if not ok:
        got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"attn_mask must be a bool or float tensor broadcastable to [b, q_heads, q_len, kv_len] = "
                         f"{list(shape)}; got {got}")


def _sdpa(q, k, v, mask, is_causal, scale, group):
    if group > 1:
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                                  enable_gqa=True)
        except TypeError:  # torch < 2.5 has no enable_gqa
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)


def _and_masks(mask: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask & visible
    return mask.masked_fill(~visible, float("-inf"))


def _flash_attn_usable(q) -> bool:
    if q.dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _flash_attn(q, k, v, causal, scale):  # pragma: no cover - needs a GPU with flash-attn
    from flash_attn import flash_attn_func
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=causal)
    return out.transpose(1, 2)


def _prefill(q, k, v, *, causal=True, scale=None, backend="auto", **_):
    return exact_attention(q, k, v, causal=causal, scale=scale, backend=backend)


def _always(q_len: int, kv_len: int, params: dict) -> bool:
    return True


def _no_change(n: int, params: dict) -> dict:
    return {}


def _pairs(q, k, causal: bool, params: dict) -> int:
    nq, nk = q.shape[2], k.shape[2]
    per_head = nq * nk - (nq * (nq - 1) // 2 if causal else 0)  # bottom-right causal: row i sees nk - nq + i + 1
    return q.shape[0] * q.shape[1] * per_head


EXACT = register_method(Method(
    name="exact",
    summary="exact softmax attention (torch SDPA on CPU, flash-attn on CUDA when installed)",
    prefill=_prefill,
    decode=_prefill,
    exact_when=_always,
    exact_params=_no_change,
    attended_pairs=_pairs,
))
