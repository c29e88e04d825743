"""``nsa_attention``, the op: argument checks, the compressed K/V (given, or pooled), and the choice
between the fast CPU path, the differentiable composition of the references and the Triton kernels."""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from ..blocksparse import block_sparse_decode, block_sparse_prefill
from ..common import (
    ATTEND,
    acc_dtype,
    check_gates,
    check_qkv,
    default_scale,
    guards_nonfinite,
    resolve_backend,
    step_phase,
)
from ..cpu_flash import fused_ok
from ..exact import exact_attention
from ..lse_attention import attend
from ..selection import (
    SCORINGS,
    check_decode_args,
    check_estimate_args,
    decode_kept,
    off_grid_rows,
    prefill_blocks,
    quest_applies,
    quest_step,
    scoring_of,
    split_rows,
)
from .blocks import TRAINING_FREE_GATES, check_params, fit_params, nsa_compress, num_compressed
from .cpu import decode_one, fast_forward, gated_sum
from .naive import REFERENCE, compose

# --------------------------------------------------------------------------- the op

SELECTIONS = ("compressed", *SCORINGS)


def _estimated(q, k, v, scale, sb, num_selected, window, init_blocks, local_blocks, gates, mass, scoring,
               decode_topk, decode_page, state, return_lse, backend, max_share=None, final_topk=None,
               decode_prefill=True):
    """nsa_attention with a query-aware selection: g_slc * (own block + estimated blocks, on the
    block-sparse executor) + g_win * (sliding window)."""
    from ..sparse import band_attention

    if isinstance(gates, torch.Tensor) or gates[0] != 0:
        got = "a tensor" if isinstance(gates, torch.Tensor) else repr(gates)
        raise ValueError(f"nsa_attention: selection={scoring[0]!r} has no compressed branch; gates must be 3 fixed "
                         f"numbers with g_cmp = 0 (e.g. (0, 0.75, 0.25)); got {got}")
    check_estimate_args("nsa_attention", mass, scoring, sb, max_share)
    check_decode_args("nsa_attention", decode_topk, decode_page)
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    head = off_grid_rows(nq, nk, sb)
    if head:  # a prefill chunk off the block grid: its rows before the first block start (< sb) exactly
        def exact(qh, kh, vh):
            out, lse = exact_attention(qh, kh, vh, causal=True, scale=scale, return_lse=True, backend=backend)
            none = torch.full_like(lse, float("-inf"))
            return (out, torch.stack([none, lse, none], -1)) if return_lse else out

        if head == nq:
            return exact(q, k, v)
        return split_rows(q, k, v, head, exact,
                          lambda *x: _estimated(*x, scale, sb, num_selected, window, init_blocks, local_blocks, gates,
                                                mass, scoring, decode_topk, decode_page, state, return_lse, backend,
                                                max_share, final_topk, decode_prefill), return_lse)
    past = max(0, local_blocks - 1)  # NSA's local blocks count the own block
    acc = acc_dtype(q.dtype)
    window_off = gates[2] == 0  # a window gated off is not computed (its keys are the local blocks' anyway)
    kept = None if state is None else state.get("kept")  # the prefill's list (its sinks alone without decode_prefill)
    if nq == 1 and nk > 1 and kept is not None and kept.shape[:2] == k.shape[:2] \
            and quest_applies(k, v, kept, decode_topk, backend):
        with torch.no_grad():
            o_s, l_s = quest_step(state, q, k, v, sb, past, kept, decode_topk, decode_page, scale, return_lse)
    elif nq == 1 and nk > 1:
        kept = decode_kept(state, q, k, sb, num_selected - 1, past, scale, init_blocks, decode_topk=decode_topk,
                           decode_page=decode_page)
        o_s, l_s = block_sparse_decode(q, k, v, kept, sb, past, scale, backend, need_lse=return_lse)
    else:
        blocks = prefill_blocks(state, q, k, sb, num_selected - 1, mass, scoring, past, scale, init_blocks,
                                decode_topk if final_topk is None else final_topk, max_share, keep=decode_prefill)
        o_s, l_s = block_sparse_prefill(q, k, v, blocks, sb, scale, backend, need_lse=return_lse)
    if window_off:
        o_w = torch.zeros_like(o_s)
        l_w = None if l_s is None else torch.full_like(l_s, float("-inf"))
    elif nq == 1 and nk > 1:
        from ...quantized import full_precision
        w0 = max(0, nk - window)
        with step_phase(ATTEND):
            kw, vw = full_precision(k[:, :, w0:], v[:, :, w0:])  # an 8-bit cache's window dequantized once, alone
            o_w, l_w = attend(q.reshape(b, hk, hq // hk, d), kw, vw, scale)
        o_w, l_w = o_w.reshape(b, hq, 1, d), l_w.reshape(b, hq, 1)
    else:
        from ..flex import flex_band, supports
        if backend == "flex" and supports(q, k, v, 128, return_lse):  # the window as a band, on flex too
            o_w, l_w = flex_band(q, k, v, window, 0, scale, return_lse)
        else:  # a prefill chunk's rows start at position nk - nq
            parts = [band_attention(q[bi], k[bi], v[bi], nk - nq, window - 1, 0, 0, scale) for bi in range(b)]
            o_w, l_w = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    out = _gated_sum(gates[1], o_s, gates[2], o_w, acc).to(q.dtype)
    if not return_lse:
        return out
    l_c = torch.full_like(l_s.to(acc), float("-inf"))
    return out, torch.stack([l_c, l_s.to(acc), l_w.to(acc)], -1)


def _gated_sum(g_s: float, o_s: torch.Tensor, g_w: float, o_w: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """g_s * o_s + g_w * o_w summed in ``acc``, in o_s's dtype. For half-precision outputs the float32
    temporaries are made a few heads at a time: whole, they were four float32 copies of the output,
    8 GB of a 131k prefill's 8.2 GB peak on an H100 (32 heads, d 128; docs/gpu.md)."""
    if o_s.dtype == acc:
        return g_s * o_s + g_w * o_w
    out = torch.empty_like(o_s)
    step = max(1, o_s.shape[1] // 8)
    for h in range(0, o_s.shape[1], step):  # the same arithmetic per element as the whole-tensor sum
        out[:, h:h + step] = g_s * o_s[:, h:h + step].to(acc) + g_w * o_w[:, h:h + step].to(acc)
    return out


def _check_gates(gates, q):
    b, hq, nq, _ = q.shape
    if isinstance(gates, torch.Tensor):
        fits = all(s in (1, t) for s, t in zip(gates.shape[:3], (b, hq, nq)))
        if gates.dim() != 4 or gates.shape[-1] != 3 or not fits:
            raise ValueError(f"gates tensor must be [b, q_heads, n, 3] = [{b}, {hq}, {nq}, 3] (or broadcastable); "
                             f"got {tuple(gates.shape)}")
        return gates
    return check_gates("nsa_attention", gates)  # fixed gates are >= 0, as the config requires


def _compressed_for(k, v, compress, compressed, l, s):
    nc = num_compressed(k.shape[2], l, s)
    if compressed is not None:
        kc, vc = compressed
        want = (k.shape[0], k.shape[1])
        if kc.dim() != 4 or kc.shape[:2] != want or vc.shape[:3] != kc.shape[:3] or kc.shape[-1] != k.shape[-1] \
                or vc.shape[-1] != v.shape[-1] or kc.shape[2] < nc:
            raise ValueError(f"compressed must be (k_cmp, v_cmp) [b, kv_heads, >= {nc}, d] for {k.shape[2]} keys with "
                             f"compress_block={l}, compress_stride={s}; got {tuple(kc.shape)}, {tuple(vc.shape)}")
        return kc[:, :, :nc], vc[:, :, :nc]
    if compress == "mean":
        return nsa_compress(k, v, compress_block=l, compress_stride=s)
    if callable(compress):
        kc, vc = compress(k, v, compress_block=l, compress_stride=s)
        if kc.shape[2] != nc:
            raise ValueError(f"compress callable returned {kc.shape[2]} blocks; expected {nc}")
        return kc, vc
    raise ValueError("compress must be 'mean' or a callable (k, v, compress_block, compress_stride) -> (k_cmp, v_cmp); "
                     f"got {compress!r}")


@guards_nonfinite
def nsa_attention(q, k, v, *, causal: bool = True, scale: float | None = None, compress_block: int = 32,
                  compress_stride: int = 16, select_block: int = 64, num_selected: int = 16, window: int = 512,
                  init_blocks: int = 1, local_blocks: int = 2, gates=TRAINING_FREE_GATES, compress="mean",
                  compressed=None, return_lse: bool = False, backend: str = "auto", selection: str = "compressed",
                  mass: float | None = None, estimate_queries: int = 64, score_stride: int = 16,
                  decode_topk: int = 8, decode_page: int | None = None, state: dict | None = None,
                  max_share: float | None = None, final_topk: int | None = None, decode_prefill: bool = True):
    """NSA attention on the shared layout (q [b, hq, nq, d], k/v [b, hk, nk, d]); causal only.

    gates: (g_cmp, g_slc, g_win) floats, or a tensor [b, hq, nq, 3] (e.g. sigmoid of a projection
    of the hidden state). compress: "mean" or a callable (k, v, compress_block=, compress_stride=)
    -> (k_cmp, v_cmp). compressed: precomputed (k_cmp, v_cmp) covering at least the complete
    blocks of k (decoding). return_lse: also return the three branches' LSEs [b, hq, nq, 3]
    (compressed, selected, window; float32, float64 for float64 inputs), -inf where a branch is
    empty. The gated sum itself is not a softmax, so it has no single LSE.

    selection: "compressed" (the paper's: blocks ranked by the compressed branch's attention) or a
    query-aware one (``selection.py``), "estimate" (the last ``estimate_queries`` queries' exact
    attention per select block and per block offset) or "antidiagonal" (antidiagonals of
    ``score_stride`` x ``score_stride`` score tiles, per query block); per KV head and query block,
    the ``init_blocks`` first blocks, the ``local_blocks`` - 1 blocks before the own one, then the
    best, up to num_selected blocks with the own one, or the fewest reaching ``mass`` of the
    estimated total (with ``max_share``, capped at the larger of num_selected - 1 and that share of
    the block's past blocks). A query-aware selection runs the selected branch on the block-sparse executor
    (``blocksparse.py``) and has no compressed branch: fixed gates with g_cmp = 0. A one-token step
    keeps the prefill's blocks (``state``) and adds the ``decode_topk`` full blocks with the largest
    bound of its own q·k (Quest's, from the key min/max of pages of ``decode_page`` keys, None: 16,
    always their largest common divisor with the block size; a block ranks by its best page). The
    prompt's last query is the first such step: its block's list gets the ``final_topk`` (None:
    ``decode_topk``) blocks it reads most (``selection.final_row_blocks``, exact). Without ``decode_prefill``
    a step keeps only the ``init_blocks`` first blocks of the prefill's list (Quest's step).
    """
    if not causal:
        raise ValueError("nsa_attention supports causal attention only (compressed and selected blocks are chosen "
                         "among past keys); use exact or moba for non-causal layers")
    check_qkv(q, k, v, causal)
    check_params(compress_block, compress_stride, select_block, num_selected, window, init_blocks, local_blocks)
    asked_block = select_block
    compress_block, compress_stride, select_block, num_selected, window, init_blocks, local_blocks = fit_params(
        k.shape[2], compress_block, compress_stride, select_block, num_selected, window, init_blocks, local_blocks)
    if select_block != asked_block:  # the input fits one block: the score tiles must still tile it
        score_stride = math.gcd(score_stride, select_block)
    gates = _check_gates(gates, q)
    scale = default_scale(scale, q.shape[-1])
    backend = resolve_backend(backend, q, k, v, flex=selection in SCORINGS)  # flex runs block selections
    if selection not in SELECTIONS:
        raise ValueError(f"nsa_attention: selection must be one of {', '.join(SELECTIONS)}; got {selection!r}")
    if selection != "compressed":
        return _estimated(q, k, v, scale, select_block, num_selected, window, init_blocks, local_blocks, gates,
                          mass, scoring_of(selection, estimate_queries, score_stride), decode_topk, decode_page, state,
                          return_lse, backend, max_share, final_topk, decode_prefill)
    b, hq, nq, d = q.shape
    nk = k.shape[2]
    if nq == 0 or nk == 0:
        out = q.new_zeros(q.shape)
        lse = torch.full((b, hq, nq, 3), float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)
        return (out, lse) if return_lse else out
    k_cmp, v_cmp = _compressed_for(k, v, compress, compressed, compress_block, compress_stride)
    cfg = SimpleNamespace(scale=scale, nk=nk, l=compress_block, s=compress_stride, sb=select_block,
                          num_selected=num_selected, window=window, init_blocks=init_blocks, local_blocks=local_blocks,
                          cmp_out=isinstance(gates, torch.Tensor) or gates[0] != 0, need_lse=return_lse)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, k_cmp, v_cmp)) or \
        (isinstance(gates, torch.Tensor) and gates.requires_grad and torch.is_grad_enabled())
    if backend == "torch" and not needs_grad and fused_ok(q, k, v) and q.dtype != torch.float64:  # float64: references
        one = nq == 1 and k.stride(-1) == 1 and v.stride(-1) == 1  # a decode step (cache rows contiguous)
        out, lse = (decode_one if one else fast_forward)(q, k, v, k_cmp, v_cmp, cfg, gates)
        return (out, lse) if return_lse else out
    if backend == "triton":
        from ...kernels import nsa as tk  # lazily: triton is optional
        prims = SimpleNamespace(compressed_attention=tk.compressed_attention, selection_scores=tk.selection_scores,
                                selected_attention=tk.selected_attention, window_attention=tk.window_attention)
    else:
        prims = REFERENCE
    outs, lses = compose(prims, q, k, v, k_cmp, v_cmp, cfg)
    out = gated_sum(outs, gates).to(q.dtype)
    if not return_lse:
        return out
    return out, torch.stack([l.to(acc_dtype(q.dtype)) for l in lses], -1)
