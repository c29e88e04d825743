"""The graph-safe decode step of the query-aware selections (and of sparse's window): one token against a
fixed-size cache buffer, attending a fixed-length list of blocks chosen from per-page key bounds.

The eager decode step (``selection.decode_kept`` + ``blocksparse.block_sparse_decode``) reads the
cache's length on the host, extends its summaries when a page fills, checks a fingerprint of the
cache with ``torch.equal`` and reads its block lists with ``.tolist()``: each a host sync, and shapes
that change with the length. None of that can be captured in a CUDA graph. This step does the same
work with shapes fixed by the cache's capacity and the budget, and the cache's length as a device
tensor:

1. **bounds in place**: the key min/max of every page of ``page`` keys ([b, hk, capacity / page, d],
   Quest's metadata) are kept in buffers; a step writes only the page its new key lands in
   (``write_bounds_``: the page's first key resets the page, later keys widen it);
2. **selection from metadata**: each full block ranks by its best page's upper bound of q·k (sum over
   features of max(q_f min_f, q_f max_f), the group's heads sharing the list); the top ``decode_topk``
   join the prefill's list (``kept``), the own block and the ``local_blocks`` before it (``select_blocks``):
   a [b, hk, L] int32 list of fixed length L, -1 pads, each block once. It reads the bounds (capacity /
   page rows), never the K cache;
3. **attention over the list** (``paged_attention``): the keys of the listed blocks below the length;
   on a GPU the split-K Triton kernel (``longpatch.kernels.decode``, two launches), elsewhere its torch
   twin here. NSA adds its sliding window as a second list (the blocks the window touches, keys from
   length - window on), gated.

Where it runs: a static cache's one-token steps (transformers' StaticCache hands every call its whole
buffer) after a prefill into that buffer, on a GPU and under torch.compile; on the CPU eager the
method's own step runs (it reads the listed rows in place, about 2x faster than this step's gathers).
Padded batches keep the eager step (their rows' block lists start at their own first key): generate()
does not compile their steps, and under a compile of the user's own it runs outside the graph (families/hf.py).

It chooses what the eager step chooses (the same prefill list, the same bounds, the same ranking), so
both give the same tokens; tests check that, and that the step compiles with ``fullgraph=True``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .common import acc_dtype, merge_lse
from .selection import best_page_bounds, joined_lists, page_minmax, unlisted

# --------------------------------------------------------------------------- attention over a block list

def list_rows(blocks: torch.Tensor, length: torch.Tensor, block: int, capacity: int,
              start: torch.Tensor | None = None):
    """(rows [b, hk, L * block] int64, valid [b, hk, L * block] bool): the cache rows of each listed block
    and which of them are attended (a listed block, below the row's ``length`` [b] and, given ``start``
    [b], at or after it); -1 entries read row 0, masked."""
    offs = torch.arange(block, device=blocks.device)
    rows = (blocks.clamp(min=0).to(torch.int64).unsqueeze(-1) * block + offs).flatten(-2)
    valid = (blocks >= 0).unsqueeze(-1).expand(*blocks.shape, block).flatten(-2)
    valid = valid & (rows < length.view(-1, 1, 1).to(rows.dtype))
    if start is not None:
        valid = valid & (rows >= start.view(-1, 1, 1).to(rows.dtype))
    return rows.clamp(max=capacity - 1), valid


def paged_attention_torch(q, k, v, blocks: torch.Tensor, length: torch.Tensor, block: int, scale: float,
                          start: torch.Tensor | None = None):
    """The torch twin of ``kernels.decode.paged_decode`` (and the CPU path): (out [b, hq, 1, d] in q's
    dtype, lse [b, hq, 1] float32) of one query per head over the keys of the blocks in ``blocks``
    [b, hk, L] (block ids, -1 pads, each at most once) below ``length`` [b] (a device tensor: the keys
    written so far) and, given ``start`` [b], at or after it (a left-padded row's first key; a sliding
    window's). Gathers L * block rows per KV head: fixed shapes, no host sync. A row with no attended key
    gets zeros and lse -inf."""
    d = q.shape[-1]
    rows, valid = list_rows(blocks, length, block, k.shape[2], start)
    idx = rows.unsqueeze(-1).expand(-1, -1, -1, d)
    return rows_attention(q, k.gather(2, idx), v.gather(2, idx), valid, scale)


def rows_attention(q, ks: torch.Tensor, vs: torch.Tensor, valid: torch.Tensor, scale: float):
    """(out [b, hq, 1, d] in q's dtype, lse [b, hq, 1] float32) of one query per head over gathered rows
    ks, vs [b, hk, R, d] where ``valid`` [b, hk, R]; a KV group's query heads share their head's rows. A row
    with no valid key gets zeros and lse -inf."""
    b, hq, _, d = q.shape
    hk = ks.shape[1]
    g = hq // hk
    acc = acc_dtype(q.dtype)
    s = torch.matmul(q.reshape(b, hk, g, d).to(acc), ks.to(acc).transpose(-1, -2)) * scale  # [b, hk, g, R]
    s = s.masked_fill(~valid.unsqueeze(2), float("-inf"))
    top = s.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    p = torch.exp(s - top)
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p / total.clamp(min=torch.finfo(acc).tiny), vs.to(acc))
    lse = (top + total.log()).squeeze(-1)
    return out.reshape(b, hq, 1, d).to(q.dtype), lse.reshape(b, hq, 1).float()


def paged_attention(q, k, v, blocks: torch.Tensor, length: torch.Tensor, block: int, scale: float,
                    start: torch.Tensor | None = None):
    """``paged_attention_torch``'s result: on CUDA the fused split-K kernel (two launches), elsewhere
    the torch twin."""
    if q.is_cuda and kernel_available():
        from ..kernels.decode import paged_decode
        return paged_decode(q, k, v, blocks, length, block, scale, start=start)
    return paged_attention_torch(q, k, v, blocks, length, block, scale, start)


def kernel_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - triton is optional
        return False
    return True


# --------------------------------------------------------------------------- the state and the step

class PagedState:
    """What a layer's graph-safe step keeps beside a cache buffer of ``capacity`` keys: the key bounds
    of every page (mins, maxs [b, hk, capacity / page, d], in the cache's dtype) and the prefill's block
    list ``kept`` [b, hk, S] int32. Allocated once; every step writes into it in place."""

    def __init__(self, k_buffer: torch.Tensor, kept: torch.Tensor, block: int, page: int, ranked: bool = True):
        b, hk, capacity, d = k_buffer.shape
        if block % page:
            raise ConfigError(f"decode_page: got {page}; allowed: a divisor of the block size {block}")
        self.block, self.page, self.capacity = block, page, capacity
        # whole blocks: a partial last one is never ranked; a step that ranks nothing (sparse) keeps no bounds
        pages = -(-capacity // block) * (block // page) if ranked else 0
        self.mins = k_buffer.new_zeros(b, hk, pages, d)
        self.maxs = k_buffer.new_zeros(b, hk, pages, d)
        self.kept = kept.to(device=k_buffer.device, dtype=torch.int32).contiguous()
        for t in (self.mins, self.maxs, self.kept):
            # a CUDA graph reads and updates them in place (as transformers marks its StaticCache's buffers);
            # unmarked, each replay would copy them in, and their in-place updates would skip the graph
            torch._dynamo.mark_static_address(t)

    def fits(self, k: torch.Tensor) -> bool:
        """Whether ``k`` is a buffer of the shape this state was made for."""
        return k.shape[2] == self.capacity and tuple(k.shape[:2]) == tuple(self.mins.shape[:2]) \
            and k.shape[-1] == self.mins.shape[-1]

    @classmethod
    def for_spec(cls, spec: "StepSpec", k_buffer: torch.Tensor, kept: torch.Tensor | None, n: int) -> "PagedState":
        """The state of ``spec``'s step after a prefill of n keys into ``k_buffer``: its bounds filled."""
        if kept is None:
            kept = torch.empty(*k_buffer.shape[:2], 0, dtype=torch.int32)
        state = cls(k_buffer, kept, spec.block, spec.page, spec.ranked)
        if spec.ranked:
            state.fill_bounds(k_buffer, n)
        return state

    def fill_bounds(self, k: torch.Tensor, length: int) -> None:
        """The bounds of the pages of the first ``length`` keys of ``k`` (after a prefill, on the host's
        known length: once, not per step); a partial last page covers its written keys only."""
        full = length // self.page
        if full:
            self.mins[:, :, :full], self.maxs[:, :, :full] = page_minmax(k[:, :, :full * self.page], self.page)
        if length % self.page:
            tail = k[:, :, full * self.page:length]
            self.mins[:, :, full] = tail.amin(2)
            self.maxs[:, :, full] = tail.amax(2)


def write_bounds_(state: PagedState, k: torch.Tensor, length: torch.Tensor) -> None:
    """Widen, in place, the bounds of the page holding each row's newest key (position length - 1):
    reset to that key where it opens the page. ``length`` [b] int64 on the cache's device."""
    b, hk, _, d = k.shape
    pos = (length - 1).view(b, 1, 1, 1).expand(b, hk, 1, d)
    new = k.gather(2, pos)  # [b, hk, 1, d]
    page = torch.div(pos, state.page, rounding_mode="floor")
    opens = (pos % state.page) == 0
    lo = torch.where(opens, new, torch.minimum(state.mins.gather(2, page), new))
    hi = torch.where(opens, new, torch.maximum(state.maxs.gather(2, page), new))
    state.mins.scatter_(2, page, lo)
    state.maxs.scatter_(2, page, hi)


def select_blocks(q, state: PagedState, length: torch.Tensor, decode_topk: int, local_blocks: int) -> torch.Tensor:
    """[b, hk, L] int32 (L = kept + decode_topk + local_blocks + 1, -1 pads, each block once): the own
    block of position length - 1, the ``local_blocks`` before it, the prefill's ``kept`` list and the
    ``decode_topk`` full blocks with the largest page bound of q·k (those among the local ones dropped,
    as the eager step drops them). Reads the bounds only: ``state``'s mins, maxs, kept, block and page
    (a PagedState, or a paged cache's bounds gathered for one sequence, serving/backend.py)."""
    b, hk = q.shape[0], state.mins.shape[1]
    nb = state.mins.shape[2] // (state.block // state.page)
    own = torch.div(length - 1, state.block, rounding_mode="floor").view(b, 1, 1)  # [b, 1, 1]
    lists = [torch.clamp(own - torch.arange(local_blocks + 1, device=q.device).view(1, 1, -1), min=-1)
             .expand(b, hk, -1)]
    kept = state.kept.to(own.dtype)
    lists.append(torch.where((kept >= 0) & (kept < own - local_blocks), kept, torch.full_like(kept, -1)))
    if decode_topk > 0:
        best = best_page_bounds(q, state.mins, state.maxs, state.block // state.page)
        # ranked among the full blocks not listed anyway (the kept ones, the local and own ones), as the eager step
        best = unlisted(best, kept, own - local_blocks)
        top = torch.topk(best, min(decode_topk, nb), -1)
        lists.append(torch.where(torch.isfinite(top.values), top.indices, torch.full_like(top.indices, -1)))
    return joined_lists(torch.cat(lists[:-1], -1), lists[-1]).to(torch.int32)


@dataclass(frozen=True)
class StepSpec:
    """What a method's graph-safe step does, from its params (``Method.graph_step``): blocks of ``block``
    keys ranked on pages of ``page``, ``decode_topk`` ranked blocks, ``local_blocks`` before the own one;
    NSA adds a sliding ``window`` of keys as a second branch, summed with ``gates`` (g_slc, g_win).
    ``ranked`` False (sparse): no selection, the window and the first ``global_tokens`` keys (attention
    sinks) as one softmax over their union."""
    block: int
    page: int
    decode_topk: int = 0
    local_blocks: int = 0
    window: int = 0
    gates: tuple[float, float] = (1.0, 0.0)
    global_tokens: int = 0
    ranked: bool = True


def _window(q, spec: StepSpec, length: torch.Tensor, lo: torch.Tensor, attend):
    """(out, lse) of the keys [lo, length) of the last ``spec.window`` positions: the own block and the
    blocks before it that the window touches, keys before ``lo`` hidden."""
    b, hk = q.shape[0], attend.kv_heads
    back = -(-spec.window // spec.block)
    own = torch.div(length - 1, spec.block, rounding_mode="floor").view(b, 1, 1)
    near = torch.clamp(own - torch.arange(back + 1, device=q.device).view(1, 1, -1), min=-1)
    return attend(near.expand(b, hk, -1).to(torch.int32), length, lo)


class BufferAttention:
    """Attention of q over listed blocks of the cache buffers k, v [b, hk, capacity, d] (``paged_attention``):
    the executor of ``listed_step`` on a static cache's buffer."""

    def __init__(self, q, k, v, block: int, scale: float):
        self.q, self.k, self.v, self.block, self.scale = q, k, v, block, scale
        self.kv_heads = k.shape[1]

    def __call__(self, blocks: torch.Tensor, length: torch.Tensor, start: torch.Tensor | None):
        return paged_attention(self.q, self.k, self.v, blocks, length, self.block, self.scale, start)


def step(spec: StepSpec, q, k, v, state: PagedState, length: torch.Tensor, scale: float,
         start: torch.Tensor | None = None) -> torch.Tensor:
    """One graph-safe decode step: out [b, hq, 1, d] for the query at position length - 1 of the cache
    buffers k, v [b, hk, capacity, d], its key already written there; ``length`` [b] (and ``start`` [b],
    a left-padded row's first key) device tensors."""
    b = q.shape[0]
    length = length.to(device=k.device, dtype=torch.int64).reshape(-1).expand(b)
    if spec.ranked:
        write_bounds_(state, k, length)
    return listed_step(spec, q, state, length, BufferAttention(q, k, v, spec.block, scale), start)


def listed_step(spec: StepSpec, q, state, length: torch.Tensor, attend, start: torch.Tensor | None = None):
    """The step once the newest key's bounds are written: out [b, hq, 1, d] of the query at position
    length - 1 (``length`` [b] int64) over the blocks ``select_blocks`` lists from ``state`` (its mins, maxs,
    kept, block, page), attended by ``attend(blocks [b, hk, L], length, start)`` -> (out, lse): the cache
    buffer's (``BufferAttention``) or a paged cache's (serving/pages.py), the same lists either way."""
    w0 = torch.clamp(length - spec.window, min=0)
    if start is not None:
        w0 = torch.maximum(w0, start.to(w0.dtype))
    if not spec.ranked:  # sparse: the sinks [0, G) and the window [max(G, length - window), length), one softmax
        G = spec.global_tokens
        out, lse = _window(q, spec, length, torch.clamp(w0, min=G), attend)
        if G:
            sinks = torch.arange(-(-G // spec.block), device=q.device, dtype=torch.int32)
            o_g, l_g = attend(sinks.expand(q.shape[0], attend.kv_heads, -1), torch.clamp(length, max=G), start)
            out, lse = merge_lse(out, lse, o_g, l_g)
        return out.to(q.dtype)
    blocks = select_blocks(q, state, length, spec.decode_topk, spec.local_blocks)
    out, _ = attend(blocks, length, start)
    if not spec.window or not spec.gates[1]:
        return out if spec.gates[0] == 1.0 else (spec.gates[0] * out.float()).to(q.dtype)
    o_w, _ = _window(q, spec, length, w0, attend)  # NSA's window branch
    return (spec.gates[0] * out.float() + spec.gates[1] * o_w.float()).to(q.dtype)
