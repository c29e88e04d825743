"""Query-aware, training-free block selection: which past key blocks each query block attends to.

``last_queries_estimate`` scores blocks from real q·k products, as MInference's vertical-slash
estimate does: the last ``m`` queries of the input attend exactly (causally) to every key, and their
attention mass, summed over the rows of each KV group, is pooled per key block (*vertical*: where
the prompt's end looks, e.g. a needle, sinks); ``m`` queries spread over the sequence give the mass
per block offset (*slash*: how far back attention looks, e.g. the local diagonal). Query block i
scores past block j as vertical[j] + slash[i - j].

``select_blocks`` turns scores into block lists for the executor (``blocksparse.py``): per KV head
and query block, the forced blocks (the first block: attention sinks; the ``local_blocks`` blocks
before the own block), then the best-scoring past blocks, either a fixed number (``mass`` None) or
the fewest whose estimated mass, with the own block's, reaches ``mass`` of the visible total (at
most ``max_blocks`` past blocks either way).

The estimate reads the whole prompt's last queries, so the *pattern* of an early query block depends
on the prompt's end (as in MInference: selection is a prefill-time decision); no query ever reads a
key after its own position. Its cost is 2 m x n products per query head.
"""
from __future__ import annotations

import math

import torch

from .base import Between, Param, positive_int
from .common import acc_dtype, check_int


def estimate_params(unit: str, budget: str) -> dict[str, Param]:
    """The config params of a method's estimated selection (``unit``: what its blocks are called,
    ``budget``: the param that caps them)."""
    return {
        "mass": Param(None, (float, type(None)), f"estimate only: the fewest {unit}s whose estimated attention "
                      f"mass reaches this share (null: always {budget})", Between(1e-9, 1.0, optional=True),
                      "a number in (0, 1] or null"),
        "estimate_queries": positive_int(f"estimate only: how many last queries score the {unit}s", 64),
    }


def check_estimate_args(op: str, mass, queries) -> None:
    """The ops' checks of the estimate's arguments (as strict as the config's)."""
    if mass is not None and not (isinstance(mass, (int, float)) and not isinstance(mass, bool) and 0 < mass <= 1):
        raise ValueError(f"{op}: mass must be a number in (0, 1] or None; got {mass!r}")
    check_int(op, "estimate_queries", queries, 1)


def _mass(q, k, qpos: torch.Tensor, scale: float) -> torch.Tensor:
    """[b, hk, g * m, n]: exact causal attention probabilities of the query rows at positions qpos
    (each query head's rows of a KV group stacked)."""
    b, hq, n, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    acc = acc_dtype(q.dtype)
    rows = q.index_select(2, qpos).reshape(b, hk, g * len(qpos), d)
    s = torch.matmul(rows.to(acc), k.to(acc).transpose(-1, -2)) * scale
    future = torch.arange(n, device=q.device).view(1, -1) > qpos.repeat(g).view(-1, 1)
    return torch.softmax(s.masked_fill(future, float("-inf")), -1)


def _pooled(p: torch.Tensor, nb: int, block: int) -> torch.Tensor:
    """[..., n] -> [..., nb]: sums over key blocks."""
    n = p.shape[-1]
    return torch.nn.functional.pad(p, (0, nb * block - n)).view(*p.shape[:-1], nb, block).sum(-1)


def last_queries_estimate(q, k, block: int, m: int, scale: float):
    """(vertical [b, hk, nb], slash [b, hk, nb]) float32 block scores from exact attention mass,
    summed over the heads of each KV group and averaged over the scoring rows (each sums to 1):

    vertical[j]: the mass the last ``m`` queries put on key block j (where the prompt's end looks);
    slash[o]: the mass that ``m`` queries spread evenly over the sequence put on keys o blocks before
    their own block (how far back attention looks wherever it is). Spreading the slash rows keeps an
    absolute position (a needle) from posing as an offset: it sits at a different offset from each."""
    b, hq, n, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    m = min(m, n)
    nb = math.ceil(n / block)
    dev = q.device
    last = torch.arange(n - m, n, device=dev)
    vertical = _pooled(_mass(q, k, last, scale), nb, block).sum(2)
    spread = torch.unique(torch.linspace(0, n - 1, m, device=dev).round().long())
    pb = _pooled(_mass(q, k, spread, scale), nb, block)  # [b, hk, rows, nb]
    off = (spread // block).repeat(g).view(-1, 1) - torch.arange(nb, device=dev).view(1, -1)
    off = off.clamp(min=0).expand(b, hk, -1, -1)  # a future block (offset < 0) has mass 0
    slash = torch.zeros(b, hk, nb, dtype=pb.dtype, device=dev)
    slash.scatter_add_(2, off.reshape(b, hk, -1), pb.reshape(b, hk, -1))
    return (vertical / (g * m)).float(), (slash / (g * len(spread))).float()


def block_scores(vertical: torch.Tensor, slash: torch.Tensor) -> torch.Tensor:
    """[b, hk, nb (query block), nb (key block)]: vertical[j] + slash[i - j] for j <= i, -inf above."""
    nb = vertical.shape[-1]
    i = torch.arange(nb, device=vertical.device)
    off = i.view(-1, 1) - i.view(1, -1)
    sc = vertical.unsqueeze(-2) + slash[..., off.clamp(min=0)]
    return sc.masked_fill(off < 0, float("-inf"))


def select_blocks(scores: torch.Tensor, max_blocks: int, mass: float | None, local_blocks: int = 1,
                  sink_blocks: int = 1) -> torch.Tensor:
    """Block lists [b, hk, nb, S] (int64, -1 pads, S <= max_blocks) of past blocks j < i per query
    block i, from ``block_scores``: forced blocks first (j < sink_blocks; i - local_blocks <= j < i),
    then by score; ``mass`` None: up to ``max_blocks``; else the fewest blocks (forced ones included)
    whose score, with the own block's, reaches ``mass`` of the row's visible total."""
    b, hk, nb, _ = scores.shape
    S = min(max_blocks, max(nb - 1, 0))
    if S == 0:
        return torch.full((b, hk, nb, 0), -1, dtype=torch.long, device=scores.device)
    i = torch.arange(nb, device=scores.device).view(-1, 1)
    j = torch.arange(nb, device=scores.device).view(1, -1)
    past = j < i
    forced = past & ((j < sink_blocks) | (j >= i - local_blocks))
    sc = scores.clamp(min=0).masked_fill(~past, 0.0)
    own = torch.diagonal(scores.clamp(min=0), dim1=-2, dim2=-1)  # [b, hk, nb]
    total = sc.sum(-1) + own
    # forced blocks rank first, then by score; not-visible blocks last
    key = torch.where(forced, sc + 1e9, torch.where(past, sc, torch.full_like(sc, -1.0)))
    top, idx = torch.topk(key, S, dim=-1)  # [b, hk, nb, S]
    valid = top >= 0
    if mass is not None:
        raw = torch.where(valid, sc.gather(-1, idx), torch.zeros_like(top))
        # keep a block while the mass before it falls short: the fewest blocks that reach the target
        before = own.unsqueeze(-1) + torch.cumsum(raw, -1) - raw
        need = before < mass * total.unsqueeze(-1)
        valid = valid & (need | forced.expand_as(sc).gather(-1, idx))
    return torch.where(valid, idx, torch.full_like(idx, -1))


def estimated_blocks(q, k, block: int, max_blocks: int, mass: float | None, queries: int, local_blocks: int,
                     scale: float, sink_blocks: int = 1) -> torch.Tensor:
    """The block lists of a causal prefill (q_len == kv_len) by the last-queries estimate."""
    vertical, slash = last_queries_estimate(q, k, block, queries, scale)
    return select_blocks(block_scores(vertical, slash), max_blocks, mass, local_blocks, sink_blocks)


def prefill_blocks(state: dict | None, q, k, block: int, max_blocks: int, mass: float | None, queries: int,
                   local_blocks: int, scale: float, sink_blocks: int = 1) -> torch.Tensor:
    """``estimated_blocks`` of a prefill, recording in a layer's ``state`` the last query block's list
    (``state["kept"]``: what its decode steps keep) and the work (``state["work"]``, counted by the
    route)."""
    with torch.no_grad():
        blocks = estimated_blocks(q.detach(), k.detach(), block, max_blocks, mass, queries, local_blocks, scale,
                                  sink_blocks)
    if state is not None:
        b, hq, n, _ = q.shape
        state["kept"] = blocks[:, :, -1]
        state["work"] = {"estimate_pairs": estimate_cost(b, hq, n, queries),
                         "attended_pairs": attended_cost(blocks, hq, n, block)}
    return blocks


def decode_kept(state: dict | None, q, k, block: int, max_blocks: int, local_blocks: int, scale: float,
                sink_blocks: int = 1, kept: torch.Tensor | None = None) -> torch.Tensor:
    """The past blocks [b, hk, S] a one-token step attends to besides its own and local ones: ``kept``
    when given, else the prefill's list in ``state``, else (no prefill, e.g. a cache built elsewhere)
    ``decode_blocks`` once, stored for the next steps."""
    if kept is None and state is not None:
        kept = state.get("kept")
    if kept is None or kept.shape[:2] != k.shape[:2]:
        with torch.no_grad():
            kept = decode_blocks(q.detach(), k.detach(), block, max_blocks, local_blocks, scale, sink_blocks)
        if state is not None:
            state["kept"] = kept
    return kept


def decode_blocks(q, k, block: int, max_blocks: int, local_blocks: int, scale: float,
                  sink_blocks: int = 1) -> torch.Tensor:
    """Past blocks [b, hk, S] for a one-token step that has no prefill's selection to keep (a cache
    built elsewhere): the step's own query is the estimate (this reads every key once, like exact
    decode; later steps keep what it chose)."""
    b, hq, nq, d = q.shape
    hk, n = k.shape[1], k.shape[2]
    acc = acc_dtype(q.dtype)
    s = torch.matmul(q.reshape(b, hk, -1, d).to(acc), k.to(acc).transpose(-1, -2)) * scale
    p = torch.softmax(s, -1).sum(2)
    nb = math.ceil(n / block)
    scores = torch.zeros(b, hk, nb, nb, device=q.device)
    scores[:, :, -1] = _pooled(p, nb, block).float()  # only the last query block (the step's) is used
    return select_blocks(scores, max_blocks, None, local_blocks, sink_blocks)[:, :, -1]


def estimate_cost(b: int, hq: int, n: int, queries: int) -> int:
    """Query-key products of the last-queries estimate of an n-token prefill (its last and spread
    rows, each against its visible keys), per query head summed."""
    m = min(queries, n)
    spread = torch.unique(torch.linspace(0, n - 1, m).round().long())
    return b * hq * (int((torch.arange(n - m, n) + 1).sum()) + int((spread + 1).sum()))


def attended_cost(blocks: torch.Tensor, hq: int, n: int, block: int) -> int:
    """Query-key products the executor computes for ``blocks`` on an n-token prefill: each query
    block's listed blocks in full and its own block's causal half, per query head summed."""
    b, hk, nb, _ = blocks.shape
    g = hq // hk
    sizes = torch.clamp(n - torch.arange(nb, device=blocks.device) * block, max=block)  # rows of each block
    listed = int(((blocks >= 0).sum(-1) * sizes).sum()) * block * g
    return listed + b * hq * int((sizes * (sizes + 1) // 2).sum())


def estimated_pairs(q, k, block: int, max_blocks: int, mass: float | None, queries: int, local_blocks: int,
                    scale: float, sink_blocks: int = 1) -> int:
    """All query-key products of an estimated prefill (``estimate_cost`` + ``attended_cost``)."""
    blocks = estimated_blocks(q, k, block, max_blocks, mass, queries, local_blocks, scale, sink_blocks)
    n = q.shape[2]
    return estimate_cost(q.shape[0], q.shape[1], n, queries) + attended_cost(blocks, q.shape[1], n, block)
