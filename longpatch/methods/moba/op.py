"""``moba_attention``, the op: argument checks, the exact short-cut, and the choice between the
CPU path (``cpu.py``), its one-token decode and the Triton kernel (``longpatch.kernels.moba``) fed
with every (query row, selected chunk) pair."""
from __future__ import annotations

import math

import torch

from ...errors import check_int
from ..blocksparse import block_sparse_decode, block_sparse_prefill
from ..common import check_qkv, default_scale, guards_nonfinite, resolve_backend
from ..exact import exact_attention
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
from .cpu import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_TOPK,
    MobaTorch,
    Plan,
    decode_one,
    prefix_means,
    select_chunks,
    torch_forward,
)

# --------------------------------------------------------------------------- the triton path

def selection_pairs(q, k, plan: Plan, groups=None):
    """Every (query row, selected chunk) pair, own chunk included, sorted by (batch, KV head, chunk):
    the work list of the block-sparse kernel, for the (batch row, KV head) ``groups`` (default: all).
    Returns a dict of int64 tensors: row [P] (flat index into q viewed [b*hq*nq]), slot [P] (0 = own,
    1.. past), pos [P] (absolute query position), seg_start/seg_end [S] (pair ranges), seg_kv [S]
    (flat b*hk index), seg_k0/seg_k1 [S] (key range of the chunk)."""
    g, C, nq = plan.g, plan.C, plan.nq
    rows, slots, chunks, kvs = [], [], [], []
    for bi, hi in groups or [(bi, hi) for bi in range(plan.b) for hi in range(plan.hk)]:
        means = plan.means(k, bi, hi)
        for a, e in plan.windows:
            m = e - a
            qw = q[bi, hi * g:(hi + 1) * g, a:e]
            pos = torch.arange(a + plan.off, e + plan.off, device=q.device)
            own, other = select_chunks(qw, means, pos, C, plan.topk, plan.scale, plan.causal, plan.shared)
            sel = torch.cat([own.view(1, m, 1).expand(g, m, 1), other.expand(g, m, other.shape[-1])], dim=-1)
            ns = sel.shape[-1]
            flat = sel.reshape(-1)
            ent = torch.nonzero(flat >= 0).squeeze(1)
            hrow = torch.div(ent, ns, rounding_mode="floor")  # h * m + i
            h = torch.div(hrow, m, rounding_mode="floor")
            i = hrow % m
            rows.append(((bi * plan.hq + hi * g + h) * nq) + a + i)
            slots.append(ent % ns)
            chunks.append(flat[ent])
            kvs.append(torch.full_like(ent, bi * plan.hk + hi))
    row, slot, chunk, kv = (torch.cat(x) for x in (rows, slots, chunks, kvs))
    return _segments(row, slot, chunk, kv, C, plan.nk, nq, plan.off)


def _segments(row, slot, chunk, kv, C: int, nk: int, nq: int, off: int):
    """Pairs sorted by (KV head, chunk), with the segment arrays of the kernel's work list."""
    nchunks = math.ceil(nk / C)
    key = kv * nchunks + chunk
    key, order = torch.sort(key, stable=True)
    row, slot = row[order], slot[order]
    uniq, counts = torch.unique_consecutive(key, return_counts=True)
    seg_end = torch.cumsum(counts, 0)
    seg_start = seg_end - counts
    seg_chunk = uniq % nchunks
    seg_kv = torch.div(uniq, nchunks, rounding_mode="floor")
    pos = row % nq + off
    return {"row": row, "slot": slot, "pos": pos, "seg_start": seg_start, "seg_end": seg_end, "seg_kv": seg_kv,
            "seg_k0": seg_chunk * C, "seg_k1": torch.clamp(seg_chunk * C + C, max=nk)}


def _triton_path(q, k, v, plan: Plan):
    """The kernel one KV group (batch row, KV head) at a time: a group's pair list and its partial
    outputs (one float32 row per (query, selected chunk) pair, merged afterwards) then take 1/(b*hk)
    of the memory they would take for the whole call (25 GB at 131k tokens, 32/8 heads, d = 128)."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    outs, lses = [], []
    for bi in range(plan.b):
        for hi in range(plan.hk):
            with torch.no_grad():
                pairs = selection_pairs(q, k, plan, [(bi, hi)])
            base = (bi * plan.hq + hi * plan.g) * plan.nq  # the group's first row in q viewed [b*hq*nq]
            o, lse = _run_pairs(q, k, v, pairs, plan.scale, plan.causal, base, plan.g * plan.nq)
            outs.append(o)
            lses.append(lse)
    b, hq, nq, d = q.shape
    return torch.cat(outs).view(b, hq, nq, d).to(q.dtype), torch.cat(lses).view(b, hq, nq)


def _run_pairs(q, k, v, pairs: dict, scale: float, causal: bool, base: int, count: int):
    """The Triton kernel on a pair list whose rows are ``base .. base + count - 1`` of q viewed
    [b*hq*nq]: their float32 outputs [count, d] and LSEs [count], the partial results merged per
    query row by their LSEs."""
    from ...kernels.moba import pairs_attention  # lazily: triton is optional
    o_p, l_p = pairs_attention(q, k, v, pairs, scale=scale, causal=causal)
    d = q.shape[-1]
    ns = int(pairs["slot"].max()) + 1  # own + past slots; every row has at least one pair
    flat = (pairs["row"] - base) * ns + pairs["slot"]
    o_all = torch.zeros(count * ns, d, dtype=torch.float32, device=q.device).index_copy(0, flat, o_p)
    l_all = torch.full((count * ns,), float("-inf"), dtype=torch.float32, device=q.device)
    l_all = l_all.index_copy(0, flat, l_p).view(-1, ns)
    lse = torch.logsumexp(l_all, -1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w = torch.exp(l_all - safe.unsqueeze(-1))
    return torch.einsum("rs,rsd->rd", w, o_all.view(-1, ns, d)), lse


# --------------------------------------------------------------------------- the op

SELECTIONS = ("gate", *SCORINGS)


def _estimated(q, k, v, causal, scale, C, topk, mass, scoring, local_blocks, kept, decode_topk, decode_page, state,
               return_lse, backend, max_share=None, final_topk=None, decode_prefill=True):
    """moba_attention with a query-aware selection: the block-sparse executor on estimated chunks."""
    if not causal:
        raise ValueError(f"moba_attention: selection={scoring[0]!r} supports causal attention only")
    check_estimate_args("moba_attention", mass, scoring, C, max_share)
    check_int("moba_attention: local_blocks", local_blocks, 0)
    check_decode_args("moba_attention", decode_topk, decode_page)
    b, hq, nq, d = q.shape
    nk = k.shape[2]
    if nq == 0:
        out = q.new_zeros(q.shape)
        lse = torch.full((b, hq, 0), float("-inf"), dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    head = off_grid_rows(nq, nk, C)
    if topk >= math.ceil(nk / C) or head == nq:
        return exact_attention(q, k, v, causal=True, scale=scale, return_lse=return_lse, backend=backend)
    if head:  # a chunk off the chunk grid: its rows before the first chunk start (< C) exactly, then the rest
        return split_rows(q, k, v, head, lambda *x: exact_attention(*x, causal=True, scale=scale, return_lse=return_lse,
                                                                    backend=backend),
                          lambda *x: _estimated(*x, causal, scale, C, topk, mass, scoring, local_blocks, kept,
                                                decode_topk, decode_page, state, return_lse, backend, max_share,
                                                final_topk, decode_prefill),
                          return_lse)
    if kept is None and state is not None:
        kept = state.get("kept")  # the prefill's list (its sinks alone without decode_prefill)
    if nq == 1 and nk > 1 and kept is not None and kept.shape[:2] == k.shape[:2] \
            and quest_applies(k, v, kept, decode_topk, backend):
        with torch.no_grad():
            out, lse = quest_step(state if state is not None else {}, q, k, v, C, local_blocks, kept, decode_topk,
                                  decode_page, scale, return_lse)
    elif nq == 1 and nk > 1:
        kept = decode_kept(state, q, k, C, topk - 1, local_blocks, scale, kept=kept, decode_topk=decode_topk,
                           decode_page=decode_page)
        out, lse = block_sparse_decode(q, k, v, kept, C, local_blocks, scale, backend, need_lse=return_lse)
    else:  # a prefill, or a prefill chunk (its query chunks choose among every past chunk of the cache)
        blocks = prefill_blocks(state, q, k, C, topk - 1, mass, scoring, local_blocks, scale,
                                final_topk=decode_topk if final_topk is None else final_topk, max_share=max_share,
                                keep=decode_prefill)
        out, lse = block_sparse_prefill(q, k, v, blocks, C, scale, backend, need_lse=return_lse)
    return (out, lse.float()) if return_lse else out


@guards_nonfinite
def moba_attention(q, k, v, *, causal: bool = True, scale: float | None = None,
                   chunk_size: int = DEFAULT_CHUNK_SIZE, topk: int = DEFAULT_TOPK, shared_selection: bool = False,
                   chunk_means: torch.Tensor | None = None, return_lse: bool = False, backend: str = "auto",
                   selection: str = "gate", mass: float | None = None, estimate_queries: int = 64,
                   score_stride: int = 16, local_blocks: int = 1, kept: torch.Tensor | None = None,
                   decode_topk: int = 8, decode_page: int | None = None, state: dict | None = None,
                   max_share: float | None = None, final_topk: int | None = None, decode_prefill: bool = True):
    """MoBA attention on the shared layout (q [b, hq, nq, d], k/v [b, hk, nk, d]).

    chunk_size: keys per chunk. topk: chunks per query, own chunk included (1 = own chunk only).
    shared_selection: the query heads of a KV group select together (sum of their gate scores).
    chunk_means: [b, hk, >= m, d] means of the first m full chunks of ``k`` (``moba_chunk_means``),
    reused instead of recomputed; chunks not covered are computed from ``k``.
    Non-causal: the own chunk (the chunk holding the query's bottom-right position) has no mask and
    the other topk - 1 chunks are chosen among ALL chunks, past and future (a query with no
    position, non-causal q_len > kv_len, chooses topk chunks). Returns out (and float32 LSE).

    selection: "gate" (the paper's: q·mean(chunk keys) per query) or a query-aware one
    (``selection.py``), "estimate" (the last ``estimate_queries`` queries' exact attention mass per
    chunk and per chunk offset) or "antidiagonal" (antidiagonals of ``score_stride`` x
    ``score_stride`` score tiles, per query chunk); per KV head and query chunk, the first chunk, the
    ``local_blocks`` chunks before the own one, then the best-scoring past chunks, up to topk - 1 of
    them, or the fewest reaching ``mass`` of the estimated total when mass is set (with ``max_share``,
    capped at the larger of topk - 1 and that share of the chunk's past chunks), run by the
    block-sparse executor (``blocksparse.py``). With a query-aware selection, a one-token step
    attends to ``kept`` [b, kv_heads, S] (the prefill's list for its last chunk; ``state`` carries it
    between calls; without either it estimates from its own query once), the ``decode_topk`` full
    chunks with the largest bound of its own q·k (Quest's, from the key min/max of pages of
    ``decode_page`` keys kept in ``state``, None: 16, always their largest common divisor with the
    chunk size; a chunk ranks by its best page), its own chunk and the ``local_blocks`` before it,
    reading only those rows. The prompt's last query is the first such step: its chunk's list gets
    the ``final_topk`` (None: ``decode_topk``) chunks it reads most (``selection.final_row_blocks``, exact).
    Without ``decode_prefill`` a step keeps only the first chunk of the prefill's list (Quest's step: a fixed
    budget of chunks, whatever the prefill chose). Causal only. A
    prefill chunk (1 < q_len < kv_len: the queries are the last q_len positions) runs the selection for its
    query chunks among every past chunk (``selection.py``); where it does not start on a chunk, its rows
    before the first chunk start (fewer than chunk_size) run exact attention.
    """
    check_qkv(q, k, v, causal)
    check_int("moba_attention: chunk_size", chunk_size, 1)
    check_int("moba_attention: topk", topk, 1)
    scale = default_scale(scale, q.shape[-1])
    backend = resolve_backend(backend, q, k, v, flex=causal)  # flex runs the causal selections
    if selection not in SELECTIONS:
        raise ValueError(f"moba_attention: selection must be one of {', '.join(SELECTIONS)}; got {selection!r}")
    if selection != "gate":
        return _estimated(q, k, v, causal, scale, chunk_size, topk, mass,
                          scoring_of(selection, estimate_queries, score_stride), local_blocks, kept, decode_topk,
                          decode_page, state, return_lse, backend, max_share, final_topk, decode_prefill)
    if chunk_means is not None:
        if chunk_means.dim() != 4 or chunk_means.shape[:2] != k.shape[:2] or chunk_means.shape[-1] != k.shape[-1]:
            raise ValueError(f"chunk_means must be [b, kv_heads, n_chunks, d] = [{k.shape[0]}, {k.shape[1]}, *, "
                             f"{k.shape[-1]}]; got {tuple(chunk_means.shape)}")
        full = k.shape[2] // chunk_size
        if chunk_means.shape[2] > full:  # means of chunks these keys do not have: not means of this cache
            raise ValueError(f"moba_attention: chunk_means has {chunk_means.shape[2]} chunks; allowed: at most {full} "
                             f"(the full chunks of {k.shape[2]} keys with chunk_size={chunk_size})")
        chunk_means = chunk_means.detach()
    b, hq, nq, d = q.shape
    if nq == 0 or k.shape[2] == 0:
        out = q.new_zeros(q.shape)
        lse = torch.full((b, hq, nq), float("-inf"), dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    nk = k.shape[2]
    if topk >= math.ceil(nk / chunk_size):
        # every query's union is every chunk it may see: exact (causal) attention, done densely
        return exact_attention(q, k, v, causal=causal, scale=scale, return_lse=return_lse, backend=backend)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    # a one-token step on every backend: the gate and one attention on the selected rows, a fixed
    # handful of ops; on a GPU the kernel's pair list (a loop per KV head, host syncs) cost 40x exact
    if nq == 1 and causal and not needs_grad:
        means = prefix_means(k, chunk_size, (k.shape[2] - 1) // chunk_size, chunk_means)
        out, lse = decode_one(q, k, v, means, chunk_size, topk, scale, shared_selection, need_lse=return_lse)
        return (out, lse.float()) if return_lse else out
    if backend == "flex":  # the gate on FlexAttention: a causal prefill, where it runs
        from ..flex import fallback_backend, flex_gate, gate_runs
        if causal and nq == nk and not needs_grad and gate_runs(q, k, v, chunk_size, return_lse):
            means = prefix_means(k, chunk_size, (nk - 1) // chunk_size, chunk_means)
            out, lse = flex_gate(q, k, v, means, chunk_size, topk, scale, shared_selection, return_lse)
            return (out, lse) if return_lse else out
        backend = fallback_backend(q)
    plan = Plan(q, k, chunk_size, topk, causal, chunk_means, scale, shared_selection)
    if backend == "triton":
        out, lse = _triton_path(q, k, v, plan)
    elif needs_grad:
        out, lse = MobaTorch.apply(q, k, v, plan)
    else:
        out, lse = torch_forward(q, k, v, plan)
    return (out, lse.float()) if return_lse else out
