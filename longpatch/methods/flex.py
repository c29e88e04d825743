"""The FlexAttention executor: the block-sparse methods' selections run on torch's own block-sparse
attention (``torch.nn.attention.flex_attention``), compiled, the GPU path of ``backend="flex"``.

Why here and not in ``kernels/``: nothing in this module is a hand-written kernel. It turns the
selections the methods already make into a ``BlockMask`` and lets torch's compiler generate the
kernel (Triton on CUDA, C++ on the CPU), so it is an executor beside ``blocksparse.py`` and takes
the same inputs: a block-sparse selection ``blocks`` [b, kv_heads, n_blocks, S] (per KV head and
query block, the listed past blocks, -1 pads; ``blocksparse.py`` defines it) or a band (sparse's
window and global keys, NSA's window).

How a selection becomes a BlockMask (``BlockMask.from_kv_blocks``, built on the device, no host
round-trip): a query block's listed past blocks are *full* blocks (every key visible: no mask is
evaluated there, the kernel's fastest form) and its own block is a *partial* block whose
``mask_mod`` is the causal rule. A band classifies every (query block, key block) pair analytically
as full, partial (the band's edge, the global prefix's edge: evaluated with the band's ``mask_mod``)
or empty. GQA: the g query heads of a KV group share its selection, so q is viewed as
[b * kv_heads, g, n, d] against k/v [b * kv_heads, 1, n, d] with ``enable_gqa=True``: the mask has
one row per KV head, not per query head, and nothing is copied or repeated.

Compilation: FlexAttention is only fast (on the CPU: only correct; eager flex_attention on such a
mask was off by 0.49 on torch 2.13) when compiled. The mask construction and the call are one
function compiled once per process with ``fullgraph=True`` and ``dynamic=True``: the sequence
length is symbolic, so a new prompt length does not recompile (the block size, head counts and
the band's window are specialised: one compile per configuration). ``warm_up`` pays the compile
ahead of the timed calls and returns how long it took, so that a benchmark reports it instead of
hiding it in a user's first call.

Versions: ``flex_attention(..., enable_gqa=, return_lse=)`` and ``BlockMask.from_kv_blocks(...,
seq_lengths=, compute_q_blocks=)`` as in torch 2.11 (GPU, measured) and 2.13 (CPU, tested here);
``common.flex_available`` asks for >= 2.11. On the CPU (torch 2.13) the compiled kernel supports inference
only and no LSE ("torch.compile on CPU only supports inference and `return_lse` is not supported
yet"), and it needs the key-index tables as wide as the number of key blocks; on CUDA they are as
narrow as the selection (``compute_q_blocks=False``: forward only, the transposed tables that only
the backward reads are not built). Callers fall back to their other paths where flex cannot run
(``supports``).
"""
from __future__ import annotations

import contextlib
import functools
import math
import re
import time
import types

import torch

from . import gpu_scores
from .common import flex_available, ordered_int, triton_available, warn_once
from .selection import estimated_blocks


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, need_lse: bool = False) -> bool:
    """Whether a call on these tensors can run here: CUDA (forward, backward, LSE), or the CPU
    without gradients and without an LSE (torch's CPU template). Block sizes are multiples of 16
    (the tiles of the GPU kernel); float64 is not a flex dtype on the GPU."""
    if not flex_available() or block % 16 or q.dtype == torch.float64:
        return False
    if q.is_cuda:
        return True
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return q.device.type == "cpu" and not grad and not need_lse


def fallback_backend(q: torch.Tensor) -> str:
    """What a call that flex cannot run (``supports``) runs instead: what 'auto' runs without flex."""
    return "triton" if q.is_cuda and triton_available() else "torch"


# The methods whose attention is a block selection (moba, nsa: their query-aware selections,
# selection.SCORINGS) or a band (sparse): what flex expresses.
FLEX_METHODS = ("moba", "nsa", "sparse")  # moba: its gate too (``flex_gate``)


def flex_refusal(method: str, params: dict) -> str | None:
    """Why ``backend: flex`` does not fit this method and params (one phrase), or None when it does."""
    from .selection import SCORINGS

    if method not in FLEX_METHODS:
        return (f"method '{method}' has no FlexAttention path (flex runs: moba, nsa with a query-aware selection "
                f"({', '.join(SCORINGS)}), sparse)")
    if method == "nsa" and params.get("selection") not in SCORINGS:
        return (f"{method}'s selection {params.get('selection')!r} picks keys per query row, which flex does not run "
                f"(flex runs selection {', '.join(SCORINGS)})")
    return None


def _kernel_options(block: int, device: torch.device) -> dict | None:
    """The GPU kernel's tiles must divide the mask's blocks: its default query tile is 128 rows, so a
    smaller block (NSA's 64) asks for tiles of its size (at most 64)."""
    if device.type != "cuda" or block >= 128:
        return None
    tile = min(64, block & -block)  # the largest power of two dividing block, capped at 64
    return {"BLOCK_M": tile, "BLOCK_N": tile}


# --------------------------------------------------------------------------- masks

def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _any_key(b, h, q_idx, kv_idx):
    return kv_idx >= 0


def _chunk_offset(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """A prefill chunk's first query position as a 0-d tensor (None for a prefill): the compiled calls take it
    as an input, so a new offset does not recompile (a size expression captured by a mask does not lower)."""
    return None if q.shape[2] == k.shape[2] else torch.tensor(k.shape[2] - q.shape[2], device=q.device)


def _causal_after(off: torch.Tensor):
    """The causal mask of queries that are the last positions of the keys, from position ``off``."""
    def mod(b, h, q_idx, kv_idx):
        return q_idx + off >= kv_idx
    return mod


def _own_and_listed(blocks: torch.Tensor, nb: int):
    """(partial counts, partial indices, full counts, full indices), int32, of a selection [B, 1, mb, S] of the last mb
    of nb query blocks (mb = nb: a prefill): the own block as the one partial block, the listed ones as full
    blocks (listed first: sorted descending, the -1 pads last and read as block 0, past the count). Both index
    tables are nb wide, on every device: the CPU template reads them so, and on CUDA (torch 2.11, an H100) a
    partial table 1 wide beside a full table S wide gave outputs off by 0.22 (relative) while nb-wide ones
    matched the torch path (scripts/gpu_flex_check.py)."""
    B, mb = blocks.shape[0], blocks.shape[2]
    lst = blocks.sort(-1, descending=True).values
    full_num = (lst >= 0).sum(-1).to(torch.int32)
    full_idx = lst.clamp(min=0).to(torch.int32)
    own = torch.arange(nb - mb, nb, device=blocks.device, dtype=torch.int32).view(1, 1, mb, 1).expand(B, 1, mb, 1)
    part_num = torch.ones(B, 1, mb, dtype=torch.int32, device=blocks.device)
    return part_num, _wide(own, nb), full_num, _wide(full_idx, nb)


def _wide(idx: torch.Tensor, width: int) -> torch.Tensor:
    """An index table padded (with block 0) or cut to ``width`` entries per row, contiguous: the entries
    past a row's count are never read (``_own_and_listed`` says why every table is this wide)."""
    return torch.nn.functional.pad(idx, (0, max(0, width - idx.shape[-1])))[..., :width].contiguous()


def _band_tables(nq: int, nk: int, block: int, window: int, glob: int, device, wide: bool, dilation: int = 1,
                 off: torch.Tensor | None = None):
    """The tables of a causal band: query row r sits at position p = r + off (off = nk - nq unless given, a
    0-d tensor inside a compiled call) and sees key c when
    c <= p and (c < glob, or p - c = i * dilation for some 0 <= i < window). A (query block, key
    block) pair is full when every row sees every key of it (a dilated window is never full), partial
    when some row may see some key; the lists hold the full (and the partial) blocks first, in block
    order. Sizes nqb x nkb: one entry per block pair, shared by every head (the band does not depend
    on the data)."""
    off = nk - nq if off is None else off
    nqb, nkb = -(-nq // block), -(-nk // block)
    i = torch.arange(nqb, device=device).view(-1, 1)
    j = torch.arange(nkb, device=device).view(1, -1)
    plo, phi = off + i * block, off + torch.clamp((i + 1) * block, max=nq) - 1  # positions of the block's rows
    clo, chi = j * block, torch.clamp((j + 1) * block, max=nk) - 1  # keys of the key block
    span = (window - 1) * dilation  # the farthest key of the window
    full = (chi <= plo) & ((chi < glob) | ((clo >= phi - span) & (dilation == 1)))
    some = (clo <= phi) & ((clo < glob) | (chi >= plo - span))
    part = some & ~full

    def lists(sel):  # the selected key blocks of each row first, in block order
        key = torch.where(sel, j, j + nkb)
        idx = key.sort(-1).values
        num = sel.sum(-1).to(torch.int32)
        idx = torch.where(idx >= nkb, idx - nkb, idx).to(torch.int32)
        if not wide:  # as wide as the most blocks a row can list
            width = min(nkb, -(-(span + 1) // block) + -(-glob // block) + 2)
            idx = idx[..., :width]
        return num[None, None], idx[None, None].contiguous()

    return (*lists(part), *lists(full))


def _band_mod(window: int, glob: int, dilation: int = 1, off=0):
    """The band's mask; ``off``: the first query's position (a prefill chunk's; 0 for a prefill)."""
    if dilation == 1:
        def mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx + off) & ((kv_idx < glob) | (kv_idx > q_idx + off - window))
    else:
        def mod(b, h, q_idx, kv_idx):
            dist = q_idx + off - kv_idx
            on_grid = (dist // dilation) * dilation == dist
            return (dist >= 0) & ((kv_idx < glob) | (on_grid & (dist <= (window - 1) * dilation)))
    return mod


# --------------------------------------------------------------------------- the calls (compiled)

def _grad(q, k, v) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _block_sparse_call(q, k, v, blocks, off=None, *, block: int, scale: float, need_lse: bool):
    """q [b, hq, nq, d] (a prefill: nq = n; or a prefill chunk, the last nq positions of the keys from
    ``off``, a block start), k/v [b, hk, n, d], blocks [b, hk, nq's blocks, S]: (out, lse or None)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    b, hq, nq, d = q.shape
    hk, n = k.shape[1], k.shape[2]
    g = hq // hk
    mb = blocks.shape[2]
    grad = _grad(q, k, v)  # the backward reads the transposed tables
    tables = _own_and_listed(blocks.reshape(b * hk, 1, mb, -1), (n + block - 1) // block)
    mask = BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=block, mask_mod=_causal if off is None else _causal_after(off),
                                    seq_lengths=(nq, n), compute_q_blocks=grad)
    # a KV group's g query heads as the heads of one batch row: the mask's rows are per KV head
    res = flex_attention(q.reshape(b * hk, g, nq, d), k.reshape(b * hk, 1, n, d), v.reshape(b * hk, 1, n, d),
                         block_mask=mask, scale=scale, enable_gqa=True, return_lse=need_lse,
                         kernel_options=_kernel_options(block, q.device))
    out, lse = res if need_lse else (res, None)
    return out.reshape(b, hq, nq, d), None if lse is None else lse.reshape(b, hq, nq)


def _band_call(q, k, v, off=None, *, block: int, window: int, glob: int, dilation: int, scale: float,
               need_lse: bool):
    """q [b, hq, nq, d], k/v [b, hk, n, d]: (out, lse or None) of the causal band (``_band_tables``),
    prefill (nq = n: the mask's positions are the rows' indices) or a prefill chunk (the queries are the
    last nq positions, from a block start)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    nq, n = q.shape[2], k.shape[2]
    if off is None:  # a prefill: one size (the rows' indices are the positions)
        n = nq
    grad = _grad(q, k, v)
    tables = _band_tables(nq, n, block, window, glob, q.device, wide=not q.is_cuda or grad, dilation=dilation,
                          off=0 if off is None else off)
    mask = BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=block,
                                    mask_mod=_band_mod(window, glob, dilation, 0 if off is None else off),
                                    seq_lengths=(nq, n), compute_q_blocks=grad)
    res = flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=True, return_lse=need_lse,
                         kernel_options=_kernel_options(block, q.device))
    return res if need_lse else (res, None)


def _decode_call(q, k, v, kept, *, block: int, local_blocks: int, scale: float, need_lse: bool):
    """One query per head at the last position t = kv_len - 1 (q [b, hq, 1, d], k/v [b, hk, n, d]):
    ``blocksparse.block_sparse_decode``'s keys, its own block up to t (a partial block) and the
    ``local_blocks`` blocks before it with the past blocks ``kept`` [b, hk, S] (full blocks, listed
    once). Shapes only, no host round-trip: the step can run inside a CUDA graph."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    b, hq, _, d = q.shape
    hk, n = k.shape[1], k.shape[2]
    g = hq // hk
    nbk = (n + block - 1) // block
    own = (n - 1) // block
    local = own - 1 - torch.arange(local_blocks, device=q.device)  # the blocks before the own one
    local = torch.where(local >= 0, local, -1).view(1, 1, -1).expand(b, hk, -1)
    kept = kept.masked_fill((kept >= own - local_blocks) | (kept > own), -1)  # the local ones are listed once
    lst = torch.cat([local, kept], -1).reshape(b * hk, 1, 1, -1).sort(-1, descending=True).values
    full_num = (lst >= 0).sum(-1).to(torch.int32)
    full_idx = lst.clamp(min=0).to(torch.int32)
    own_idx = torch.full((b * hk, 1, 1, 1), own, dtype=torch.int32, device=q.device)
    part_num = torch.ones(b * hk, 1, 1, dtype=torch.int32, device=q.device)
    grad = _grad(q, k, v)  # the backward reads the transposed tables
    # the own block needs no causal mask: the cache ends at t, and the kernel reads no key past the
    # sequence length (a partial block only because the block may be cut short by it)
    mask = BlockMask.from_kv_blocks(part_num, _wide(own_idx, nbk), full_num, _wide(full_idx, nbk),
                                    BLOCK_SIZE=block, mask_mod=_any_key, seq_lengths=(1, n), compute_q_blocks=grad)
    res = flex_attention(q.reshape(b * hk, g, 1, d), k.reshape(b * hk, 1, n, d), v.reshape(b * hk, 1, n, d),
                         block_mask=mask, scale=scale, enable_gqa=True, return_lse=need_lse,
                         kernel_options=_kernel_options(block, q.device))
    out, lse = res if need_lse else (res, None)
    return out.reshape(b, hq, 1, d), None if lse is None else lse.reshape(b, hq, 1)


def _gate_select_call(q, means, *, chunk: int, topk: int, shared: bool, qblock: int, scale: float):
    """MoBA's gate (causal prefill, q_len == kv_len): each query row attends to its own chunk up to
    itself and to the topk - 1 past chunks with the largest q . mean(chunk keys), chosen as
    ``moba.cpu.select_chunks`` chooses them (float64 products rounded to float32, ties to the later
    chunk), per query head or (``shared``) per KV group. The rows' choices are a table [b, hq, n,
    chunks] the mask reads (own chunk included); a (query block, chunk) pair is full when every row
    of the block chose the chunk, partial when some did (or it is the block's own chunk). means
    [b, hk, nc, d]: the full chunks before the last row's own one. Returns the table and the mask's
    four tables; ``_gate_attend_call`` attends with them (two compiled calls: the CPU template reads
    a mask's tables only from its inputs)."""

    b, hq, n, d = q.shape
    hk = means.shape[1]
    g = hq // hk
    nc = means.shape[2]
    nkb = (n + chunk - 1) // chunk
    nqb = (n + qblock - 1) // qblock
    pos = torch.arange(n, device=q.device)
    own = pos // chunk
    qd = q.double().view(b, hk, g, n, d)
    if shared:
        qd = qd.sum(2, keepdim=True)
    scores = (torch.matmul(qd, means.double().transpose(-1, -2).unsqueeze(2)) * scale).float()  # [b, hk, hs, n, nc]
    cidx = torch.arange(nc, device=q.device)
    key = (ordered_int(scores).to(torch.int64) << 32) | cidx  # the later chunk wins a tie
    key = torch.where(cidx < own.view(-1, 1), key, torch.full_like(key, -(2 ** 63)))
    kk = min(topk - 1, nc)
    val, idx = torch.topk(key, kk, dim=-1)
    idx = torch.where(val > -(2 ** 63), idx, torch.full_like(idx, nkb))  # not chosen: a dump column
    table = torch.zeros(*idx.shape[:-1], nkb + 1, dtype=torch.bool, device=q.device)
    j = torch.arange(nkb, device=q.device)
    table = table.scatter(-1, idx, True)[..., :nkb] | (j == own.view(-1, 1))
    table = table.expand(b, hk, g, n, nkb).reshape(b, hq, n, nkb)  # per query head, its own chunk included
    # per query block: the chunks some rows chose (partial) and those every row chose (full)
    pad = nqb * qblock - n
    rows = torch.nn.functional.pad(table, (0, 0, 0, pad)).view(b, hq, nqb, qblock, nkb)
    real = (torch.arange(nqb * qblock, device=q.device) < n).view(1, 1, nqb, qblock, 1)
    some = (rows & real).any(3)
    every = (rows | ~real).all(3)
    own_blk = (torch.arange(nqb, device=q.device) * qblock // chunk).view(-1, 1) == j  # qblock divides chunk
    part = (some & ~every) | own_blk
    full = every & ~own_blk

    def lists(sel):
        keyj = torch.where(sel, j, j + nkb)
        idx_ = keyj.sort(-1).values
        return sel.sum(-1).to(torch.int32), torch.where(idx_ >= nkb, idx_ - nkb, idx_).to(torch.int32).contiguous()

    return (table, *lists(part), *lists(full))


def _gate_attend_call(q, k, v, table, part_num, part_idx, full_num, full_idx, *, chunk: int, qblock: int,
                      scale: float, need_lse: bool):
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    n = q.shape[2]

    def mod(b_, h_, q_idx, kv_idx):  # no arithmetic on q_idx: torch 2.13's CPU template miscompiles it
        return (kv_idx <= q_idx) & table[b_, h_, q_idx, kv_idx // chunk]

    grad = _grad(q, k, v)
    mask = BlockMask.from_kv_blocks(part_num, part_idx, full_num, full_idx, BLOCK_SIZE=(qblock, chunk), mask_mod=mod,
                                    seq_lengths=(n, n), compute_q_blocks=grad)
    res = flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=True, return_lse=need_lse,
                         kernel_options=_kernel_options(min(qblock, chunk), q.device))
    return res if need_lse else (res, None)


_CALLS = {"block_sparse": _block_sparse_call, "band": _band_call, "decode": _decode_call,
          "gate_select": _gate_select_call, "gate_attend": _gate_attend_call}
_COMPILED: dict[tuple, object] = {}


def compiled(name: str, **consts):
    """The compiled form of ``_block_sparse_call`` ("block_sparse") or ``_band_call`` ("band") for
    these constants (block size, window, scale, ...): made once per process and configuration,
    fullgraph (no graph break: no host round-trip between the selection's tensors and the kernel),
    with dynamic tensor shapes (a new sequence length does not recompile)."""
    if torch.compiler.is_compiling():  # a caller's compiled region traces the call itself, fullgraph
        return functools.partial(_CALLS[name], **consts)
    key = (name, *sorted(consts.items()))
    fn = _COMPILED.get(key)
    if fn is None:
        tag = re.sub(r"\W", "_", "_".join(f"{k}{v}" for k, v in sorted(consts.items())))
        fn = _COMPILED[key] = _Compiled(_own_code(_CALLS[name], tag), consts)
    return fn


def _own_code(fn, tag: str):
    """A copy of ``fn`` with its own code object, named after its configuration. Dynamo keeps its
    compiled entries per code object and recompiles at most a few times per object
    (``recompile_limit``): every configuration gets its own, so that several configurations never
    push one past the limit (into eager flex: slow on a GPU, wrong on this CPU); the name is the same
    in every process, so inductor's on-disk cache finds its compiled kernels again."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}__{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class _Compiled:
    """``fn`` compiled (fullgraph, dynamic shapes) with its keyword constants bound. Duck sizing is off
    while it runs: with it, a dimension that happens to equal another on the first call (a selection
    of 2 slots, 2 KV heads) is compiled as equal to it and the next call recompiles."""

    def __init__(self, fn, consts: dict):
        self.fn = torch.compile(fn, fullgraph=True, dynamic=True)
        self.consts = consts

    def __call__(self, *args):
        from torch.fx.experimental import _config as fx_config

        for t in args:
            # torch 2.11's CUDA lowering of flex_attention tests the GQA ratio hq // hk with a Python `&`
            # (is it a power of two?), which fails on a symbolic ratio ("unsupported operand type(s) for
            # &: 'FloorDiv' and 'Add'", seen on an H100): the head counts are compiled as constants there
            # (a model has one head count; a new one compiles once more). The CPU lowering has no such test.
            if isinstance(t, torch.Tensor) and t.is_cuda and t.is_floating_point() and t.dim() == 4:
                torch._dynamo.mark_static(t, 1)
        # Grad mode is part of dynamo's guards: a warm-up run with grad enabled and a timed call under
        # no_grad compiled twice (an H100 spent 3.6-4.8 s in the first timed call after the warm-up,
        # "GLOBAL_STATE changed: grad_mode"). Grad mode inside is whether a gradient is needed, so every
        # inference call meets the same compiled entry whatever the caller's mode.
        need_grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in args)
        with fx_config.patch(use_duck_shape=False), torch.set_grad_enabled(need_grad):
            return self.fn(*args, **self.consts)


def _cast(out, lse, q):
    return out.to(q.dtype), None if lse is None else lse.float()


def flex_block_sparse(q, k, v, blocks: torch.Tensor, block: int, scale: float, need_lse: bool = True):
    """``blocksparse.block_sparse_prefill`` on FlexAttention: (out [b, hq, n, d], lse [b, hq, n]
    float32, or None on the CPU, whose template gives none). Causal prefill, or a prefill chunk (the queries
    the last positions of the keys, from a block start)."""
    fn = compiled("block_sparse", block=block, scale=float(scale), need_lse=need_lse and q.is_cuda)
    with _cpu_no_grad(q):
        return _cast(*fn(q, k, v, blocks, _chunk_offset(q, k)), q)


def flex_band(q, k, v, window: int, global_tokens: int, scale: float, need_lse: bool = True, block: int = 128,
              dilation: int = 1):
    """Causal band attention on FlexAttention, prefill (or a prefill chunk: the queries are the last q_len
    positions): the query at position p sees keys c <= p with c < global_tokens or p - c = i * dilation
    (0 <= i < window): sparse's global keys and (dilated) window, NSA's window. (out, lse float32 or None on
    the CPU)."""
    fn = compiled("band", block=block, window=window, glob=global_tokens, dilation=dilation, scale=float(scale),
                  need_lse=need_lse and q.is_cuda)
    with _cpu_no_grad(q):
        return _cast(*fn(q, k, v, _chunk_offset(q, k)), q)


def flex_decode(q, k, v, kept: torch.Tensor, block: int, local_blocks: int, scale: float, need_lse: bool = True):
    """``blocksparse.block_sparse_decode`` on FlexAttention: (out [b, hq, 1, d], lse [b, hq, 1] float32
    or None on the CPU). One compile per configuration; the cache length is dynamic."""
    fn = compiled("decode", block=block, local_blocks=local_blocks, scale=float(scale), need_lse=need_lse and q.is_cuda)
    with _cpu_no_grad(q):
        return _cast(*fn(q, k, v, kept), q)


def flex_gate(q, k, v, means: torch.Tensor, chunk: int, topk: int, scale: float, shared: bool = False,
              need_lse: bool = True):
    """MoBA's gate selection and attention on FlexAttention (``_gate_call``): (out [b, hq, n, d], lse
    float32 or None on the CPU). Causal prefill; ``gate_runs`` says where it applies."""
    qblock = gate_qblock(chunk)
    select = compiled("gate_select", chunk=chunk, topk=topk, shared=shared, qblock=qblock, scale=float(scale))
    attend = compiled("gate_attend", chunk=chunk, qblock=qblock, scale=float(scale), need_lse=need_lse and q.is_cuda)
    with torch.no_grad():  # the gate carries no gradient (as MoBA's)
        tables = select(q, means)
    with _cpu_no_grad(q):
        return _cast(*attend(q, k, v, *tables), q)


def gate_qblock(chunk: int) -> int:
    """Query rows per mask block of the gate: 128 (the GPU kernel's tile) or the chunk when smaller;
    it divides the chunk, so that a query block lies inside one chunk."""
    return 128 if chunk % 128 == 0 else chunk


# Gate scores held at once (query heads x rows x chunks): float64 scores and int64 keys of this many
# elements take about 4 GB; beyond (short chunks on long inputs) the gate stays on its Triton path.
_GATE_ELEMS = 1 << 28


def gate_runs(q, k, v, chunk: int, need_lse: bool) -> bool:
    """Whether ``flex_gate`` runs this call: ``supports`` it (chunks of a multiple of 16 keys), the
    gate's scores fit (``_GATE_ELEMS``), and torch compiles its mask here. It does not on CUDA
    (torch 2.11 on an H100: "NameError('XBLOCK is not defined')" compiling the kernel, batch 1) nor
    for a batch of one on the CPU (torch 2.13: a C++ compile error in the CPU template), so those
    calls take ``fallback_backend`` (the Triton gate on CUDA), said once in the log."""
    b, hq, n, _ = q.shape
    if q.is_cuda or b == 1:
        warn_once("flex-gate", "longpatch: MoBA's gate does not compile on FlexAttention here (CUDA, or a batch of "
                               "one on the CPU); it runs on its " + fallback_backend(q) + " path")
        return False
    return b * hq * n * max(1, (n - 1) // chunk) <= _GATE_ELEMS and supports(q, k, v, gate_qblock(chunk), need_lse)


def _cpu_no_grad(q):
    """The CPU template runs inference only (``supports`` refuses a CPU call that needs gradients)."""
    return contextlib.nullcontext() if q.is_cuda else torch.no_grad()


# --------------------------------------------------------------------------- warm-up

def warm_up(device="cuda", dtype=torch.bfloat16, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
            blocks=(64, 128, 256), bands=((512, 0), (1024, 64)), lengths=(1000, 2100), need_lse: bool = False,
            decode_local=(1,), selections=(("estimate", 64), ("hybrid", 64, 16))) -> dict:
    """Compile the flex calls ahead of the timed ones: the block-sparse call for each block size, the
    one-token step for each block size and count of local blocks in ``decode_local`` (MoBA's
    local_blocks, NSA's local_blocks - 1), the query-aware ``selections`` (``scoring_of``'s tuples) with
    the largest block size, whose score passes compile on a GPU (``gpu_scores.fused``; nothing to compile
    on the CPU), and the band for each (window, global_tokens) of ``bands``,
    each at two lengths (a dynamic-shape function may specialise its first call and compile the
    general form on the second). The constants must be the calls' own (head_dim's scale, need_lse: a
    route asks for no LSE).
    Returns {"compile_s": seconds in all, "calls": [[what, seconds], ...]}: what a benchmark
    reports as the compile cost instead of hiding it in its first timed call."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    scale = head_dim ** -0.5
    t_all = time.perf_counter()
    calls = []

    def timed(what, fn, *args):
        t0 = time.perf_counter()
        fn(*args)
        sync()
        calls.append([what, round(time.perf_counter() - t0, 3)])

    for n in lengths:
        q = torch.randn(1, heads, n, head_dim, device=dev, dtype=dtype)
        k, v = (torch.randn(1, kv_heads, n, head_dim, device=dev, dtype=dtype) for _ in range(2))
        for block in blocks:
            if supports(q, k, v, block, need_lse):
                nb = math.ceil(n / block)
                sel = torch.arange(nb, device=dev).view(-1, 1) - 1 - torch.arange(2, device=dev)  # two past blocks
                sel = sel.masked_fill(sel < 0, -1).expand(1, kv_heads, nb, 2).contiguous()
                timed(f"block_sparse block={block} n={n}", flex_block_sparse, q, k, v, sel, block, scale, need_lse)
                for local in decode_local:
                    timed(f"decode block={block} local_blocks={local} n={n}", flex_decode, q[:, :, -1:], k, v,
                          sel[:, :, -1], block, local, scale, need_lse)
        for window, glob in bands:
            if supports(q, k, v, 128, need_lse):
                timed(f"band window={window} global={glob} n={n}", flex_band, q, k, v, window, glob, scale, need_lse)
        for scoring in selections:  # the selections' fused score passes (gpu_scores.py: CUDA, half precision)
            if gpu_scores.applies(q):
                select = functools.partial(estimated_blocks, block=blocks[-1], max_blocks=4, mass=0.9, scoring=scoring,
                                           local_blocks=1, scale=scale, final_topk=1)
                timed(f"selection {scoring[0]} n={n}", select, q, k)
    return {"compile_s": round(time.perf_counter() - t_all, 3), "calls": calls}
