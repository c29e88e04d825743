"""The query-aware selections' score passes in their GPU form (CUDA, bf16/fp16 inputs).

On an H100 the selections were a third (``selection: estimate``) to nine tenths (``hybrid``) of a
FlexAttention call (docs/gpu.md): their score rows were products of float32 copies of q and k (no
tensor cores; the antidiagonal's alone ~40 ms at 131k) followed by about ten elementwise passes over
[rows, keys] float32 temporaries (mask, max, exp, mask, sums, division), each a full read and write
of up to 1 GB. The GPU form:

- ``products``: the half-precision inputs multiplied as they are, with float32 results
  (``torch.bmm(out_dtype=float32)``): every product of two bf16/fp16 numbers is exact in float32 and
  the sums accumulate in float32, so the scores equal the float32 copies' up to summation order;
  the scale is applied after the product (q * scale would not be exact in half precision);
- ``block_mass`` and ``antidiagonal_tile_mass``: the softmax over keys and its pooling into key
  blocks, written as one pure function each, which ``torch.compile`` fuses into two reads of the
  scores (the row maxima; then exp, mask and block sums). Each row is normalised after pooling
  (its total is the sum of its block sums).

The CPU keeps the eager float32 code in ``selection.py`` unchanged (its figures are this project's
measurements); this form is its GPU twin, tested against it on the CPU (tests/test_gpu_scores.py).
Where torch lacks ``bmm(out_dtype=)`` or the compile fails, the same functions run uncompiled on
float32 copies, logged once.
"""
from __future__ import annotations

import torch

from .common import EXP_FLOOR, warn_once

_BMM_OUT_DTYPE = [True]  # False once this torch has shown it has no bmm(out_dtype=) on this device


def applies(q: torch.Tensor) -> bool:
    """Whether the selections' scores take this module's form: CUDA tensors in bf16 or fp16."""
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)


def products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., r, e] @ [..., e, c] -> float32 [..., r, c], the half-precision inputs multiplied as they are."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and _BMM_OUT_DTYPE[0]:
        lead = a.shape[:-2]
        try:
            out = torch.bmm(a.flatten(0, -3), b.flatten(0, -3), out_dtype=torch.float32)
            return out.view(*lead, *out.shape[-2:])
        except (TypeError, NotImplementedError, RuntimeError) as e:  # an older torch: no such overload
            if isinstance(e, torch.OutOfMemoryError):
                raise
            _BMM_OUT_DTYPE[0] = False
            warn_once("bmm-out-dtype", "longpatch: torch.bmm(out_dtype=float32) is unavailable here "
                                       f"({type(e).__name__}); the selection's scores multiply float32 copies (slower)")
    return torch.matmul(a.float(), b.float())


def block_mass(s: torch.Tensor, qcol: torch.Tensor, scale: float, nb: int, block: int) -> torch.Tensor:
    """s [b, hk, r, n] unscaled q·k products of r query rows at positions qcol [r, 1] against every key
    -> [b, hk, r, nb]: each row's causal softmax (scale applied here) summed per key block of ``block``."""
    n = s.shape[-1]
    future = torch.arange(n, device=s.device).view(1, -1) > qcol
    s = (s * scale).masked_fill(future, float("-inf"))
    # each row's own key is unmasked, so its maximum is finite; differences floored as on the CPU
    p = torch.exp((s - s.amax(-1, keepdim=True)).clamp(min=EXP_FLOOR)).masked_fill(future, 0.0)
    if n < nb * block:
        p = torch.nn.functional.pad(p, (0, nb * block - n))
    pooled = p.view(*p.shape[:-1], nb, block).sum(-1)
    return pooled / pooled.sum(-1, keepdim=True)


def antidiagonal_tile_mass(s: torch.Tensor, tiles: torch.Tensor, scale: float, per: int) -> torch.Tensor:
    """s [b, hk, g, A, T] unscaled products of the query tiles ``tiles`` [A] (A a multiple of ``per``,
    whole query blocks) with key tiles 0..T-1 -> [b, hk, A / per, T / per]: each query tile's softmax
    over its past tiles (c < a), summed per key block, normalised per tile, summed over the KV
    group's query heads and the tiles of each query block (``selection.antidiagonal_scores``)."""
    b, hk, g, A, T = s.shape
    later = torch.arange(T, device=s.device).view(1, -1) >= tiles.view(-1, 1)
    s = (s * scale).masked_fill(later, float("-inf"))
    top = s.amax(-1, keepdim=True).clamp(min=-1e30)  # tile 0 sees no past tile: its row stays 0
    p = torch.exp((s - top).clamp(min=EXP_FLOOR)).masked_fill(later, 0.0)
    pooled = p.view(b, hk, g, A, T // per, per).sum(-1)
    pooled = pooled / pooled.sum(-1, keepdim=True).clamp(min=1e-30)
    return pooled.sum(2).view(b, hk, A // per, per, T // per).sum(3)


_FUSED: dict[str, object] = {}


def fused(fn):
    """``fn`` as ``torch.compile`` fuses it (dynamic shapes: one compile for every length), or ``fn`` itself
    where the compile fails (logged once) or inside a caller's own compiled region (which traces it)."""
    def call(*args):
        if torch.compiler.is_compiling():
            return fn(*args)
        compiled = _FUSED.get(fn.__name__)
        if compiled is None:
            compiled = _FUSED[fn.__name__] = torch.compile(fn, dynamic=True)
        if compiled is not False:
            from torch.fx.experimental import _config as fx_config
            try:
                # no duck sizing: the antidiagonal's first step has as many key tiles as query tiles, and
                # with it the second step recompiled (seen on an H100)
                with fx_config.patch(use_duck_shape=False):
                    return compiled(*args)
            except Exception as e:  # a compile failure; a real error raises again below, uncompiled
                if isinstance(e, torch.OutOfMemoryError):
                    raise
                _FUSED[fn.__name__] = False
                warn_once(f"fused-{fn.__name__}", f"longpatch: the selection's {fn.__name__} did not compile here "
                                                  f"({type(e).__name__}); it runs uncompiled (slower)")
        return fn(*args)
    return call
