"""What the Triton kernels share: the log2(e) factor of the exp2-domain softmax, the dot products
(exact fp32 or native), one online-softmax step, the backward's row term, and the checks for
Triton's CPU interpreter. Kernels import these by public name instead of each other's privates."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e))


# Row reductions' combine functions for tl.reduce: Triton's own, which the CPU interpreter reduces with numpy
# (a @triton.jit helper of our own would be re-patched at every call there); the same code on a GPU
try:
    max_combine = tl.standard._elementwise_max
    sum_combine = tl.standard._sum_combine
except AttributeError:  # pragma: no cover - a Triton that renamed them: same results, slower interpreter
    @triton.jit
    def max_combine(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def sum_combine(a, b):
        return a + b


def interpreted(device) -> bool:
    """Whether kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, or CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1" or device.type == "cpu"


@triton.jit
def mm(a, b, PREC: tl.constexpr):
    # PREC 0: native tensor-core dot (bf16/fp16 in, fp32 accumulate); 1: exact fp32 ("ieee", no
    # tf32) for fp32 inputs; 2: upcast to fp32 first (Triton's CPU interpreter computes bf16/fp16
    # dots wrongly).
    if PREC == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif PREC == 1:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def dot(a, b, UPCAST: tl.constexpr):
    # UPCAST: compute in exact fp32. Used for fp32 inputs (no tf32) and in the CPU interpreter, whose
    # half-precision dots are not trustworthy.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def softmax_step(q, k_ptrs, v_ptrs, kmask, visible, m_i, l_i, acc, qk_scale, UPCAST: tl.constexpr):
    # one key tile of the online softmax (log2 domain); rows with nothing visible yet keep m = -inf
    kt = tl.load(k_ptrs, mask=kmask, other=0.0)
    vt = tl.load(v_ptrs, mask=kmask, other=0.0)
    s = dot(q, tl.trans(kt), UPCAST) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.to(vt.dtype), vt, UPCAST)
    return m_new, l_i, acc


def prep(x: torch.Tensor) -> torch.Tensor:
    """x with a unit last stride (the kernels' loads assume it)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def row_delta(do, o, dlse):
    """The backward's row term rowsum(dO * O) in float32, minus dLSE when the LSE has a gradient
    (d lse / d s = P, so a gradient on the LSE shifts every dS = P * (dP - delta) of the row)."""
    d = (do.float() * o.float()).sum(-1)
    if dlse is not None:
        d = d - dlse.float()
    return d.contiguous()
