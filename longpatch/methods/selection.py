"""Query-aware, training-free block selection: which past key blocks each query block attends to.

Two scorings of real q·k products give a block-score matrix [b, kv_heads, query block, key block]:

- ``last_queries_estimate`` (selection "estimate"), as MInference's vertical-slash estimate: the
  last ``m`` queries of the input attend exactly (causally) to every key, and their attention mass
  is pooled per key block over the rows of each KV group (*vertical*: where the prompt's end looks,
  e.g. a needle, sinks); ``m`` queries spread over the sequence give the mass per block offset
  (*slash*: how far back attention looks, e.g. the local diagonal). Query block i scores past
  block j as vertical[j] + slash[i - j], and ranks it with the vertical's mean averaged with its
  peak (the most one row puts there). It reads the whole prompt's last queries, so the *pattern*
  of an early query block depends on the prompt's end (selection is a prefill-time decision).
  Cost: 2 m x n products per query head.
- ``antidiagonal_scores`` (selection "antidiagonal"), as XAttention: every (query tile, past key
  tile) of ``stride`` rows is scored by one product per query row and key row (its antidiagonal;
  in odd query tiles, the antidiagonal with the query rows rolled by one, so that between them the
  tiles of a query block sample every query-key distance: XAttention's antidiagonal alone samples
  only odd ones for an even stride, and missed text copying from an even distance back), a softmax
  per query tile gives each query block its own estimated mass per key block. Cost: about
  n² / (2 stride) products per head.
- ``hybrid_blocks`` (selection "hybrid"): both at once, because neither alone serves both kinds of
  text. The antidiagonal scores give every query block what *it* reads (text whose every position
  copies from far back: source code with repeated blocks, long documents; with the last-queries
  estimate alone, +33% perplexity on unseen code), the last queries' vertical gives the blocks the
  prompt's *end* looks for (a needle that only the question reads sharply: the antidiagonal alone,
  which samples 1/stride of the products, keeps 17% of the needles). Per query block: the forced
  blocks, then the union of the fewest antidiagonal blocks reaching ``mass`` of its own estimated
  mass and, of the fewest blocks reaching ``mass`` of the end's vertical mass, those before it, taken in
  turn (1st of each, 2nd of each, ...) up to ``max_blocks``. Cost: the antidiagonal's plus m x n
  products (the last queries only, no spread rows: the antidiagonal already sees the offsets).

A prefill chunk (q_len < kv_len: the queries are the last q_len positions of the keys, starting on a block)
is scored the same way, for its own query blocks only: the antidiagonal scores of a query block depend on
its own rows and the keys before it, so a chunk's equal the one-shot prefill's rows; the last-queries
estimate takes the chunk's last queries (for the prompt's last chunk, the prompt's). Score matrices and
lists then hold the chunk's query blocks, [b, hk, chunk blocks, nb], the first one block ``q0`` of the keys.

``select_blocks`` turns scores into block lists for the executor (``blocksparse.py``): per KV head
and query block, the forced blocks (the first block: attention sinks; the ``local_blocks`` blocks
before the own block), then the best-scoring past blocks, either a fixed number (``mass`` None) or
the fewest whose estimated mass, with the own block's, reaches ``mass`` of the visible total (at
most ``max_blocks`` past blocks either way). No query ever reads a key after its own position.
"""
from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import torch

from ..errors import ConfigError, check_int, shown
from . import gpu_scores
from .base import Between, Param, nonneg_int, positive_int
from .common import ATTEND, RANK, acc_dtype, exp_below_max_, one_thread, step_phase, window_summaries

SCORINGS = ("estimate", "antidiagonal", "hybrid")  # the query-aware selections; a method's `selection` names one
STRIDED = ("antidiagonal", "hybrid")  # the selections that score antidiagonals of score_stride tiles


QUEST_PAGE = 16  # keys per page of the one-token step's ranking by default (Quest's page size)


def estimate_params(unit: str, budget: str) -> dict[str, Param]:
    """The config params of a method's query-aware selections (``unit``: what its blocks are called,
    ``budget``: the param that caps them)."""
    return {
        "mass": Param(None, (float, type(None)), f"estimate/antidiagonal/hybrid only: the fewest {unit}s whose "
                      f"estimated attention mass reaches this share (hybrid: of each of its two estimates; null: "
                      f"always {budget})",
                      Between(1e-9, 1.0, optional=True), "a number in (0, 1] or null"),
        "max_share": Param(None, (float, type(None)), f"with mass only: the ceiling on a query {unit}'s past {unit}s "
                           f"becomes the larger of {budget} (less the own {unit}) and this share of the past {unit}s "
                           f"it can see, so that where the estimated mass spreads the mass takes more {unit}s and "
                           f"where it is sharp fewer; null: {budget} caps",
                           Between(1e-9, 1.0, optional=True), "a number in (0, 1] or null"),
        "estimate_queries": positive_int(f"estimate/hybrid only: how many last queries score the {unit}s", 64),
        "decode_topk": nonneg_int(f"estimate/antidiagonal/hybrid only: per one-token step, this many more {unit}s "
                                  f"beside the prefill's, ranked by the step's own query (Quest's bound from the key "
                                  f"min/max of each {unit}'s pages, decode_page); 0: the prefill's only", 8),
        "decode_prefill": Param(
            True, (bool,), f"estimate/antidiagonal/hybrid only: a one-token step also attends the {unit}s the "
            f"prompt's last query {unit} attended (the prefill's list); false: only its first {unit}, its own and "
            f"local {unit}s and the decode_topk ranked ones (Quest's step: a fixed budget of the cache, whatever the "
            f"prefill chose)"),
        "final_topk": Param(
            None, (int, type(None)), f"estimate/antidiagonal/hybrid only: the {unit}s the prompt's last query's exact "
            f"row reads most, added to its {unit}'s list (what the first new token attends); null: decode_topk",
            Between(0, optional=True), "an int >= 0 or null"),
        "decode_page": Param(None, (int, type(None)), f"estimate/antidiagonal/hybrid only: keys per page of the "
                             f"one-token step's ranking (a {unit} ranks by its best page's bound; divides the {unit} "
                             f"size); null: Quest's {QUEST_PAGE}, or its largest common divisor with the {unit} size",
                             Between(1, optional=True), "an int >= 1 or null"),
        "score_stride": positive_int(f"antidiagonal/hybrid only: the side of the score tiles whose antidiagonals score "
                                     f"the {unit}s (divides the {unit} size)", 16),
    }


# The selections each query-aware param takes effect under (estimate_params' "... only")
APPLIES = {"mass": SCORINGS, "max_share": SCORINGS, "estimate_queries": ("estimate", "hybrid"), "decode_topk": SCORINGS,
           "decode_page": SCORINGS, "decode_prefill": SCORINGS, "final_topk": SCORINGS, "score_stride": STRIDED}


def final_count(params: dict) -> int:
    """How many blocks the prompt's last query's exact row adds to its block's list: final_topk, else decode_topk."""
    return params["decode_topk"] if params.get("final_topk") is None else params["final_topk"]


def check_applicable(method, params: dict, applies: dict | None = None) -> None:
    """A param set away from its default under a selection it has no effect in (mass=0.5 with MoBA's
    'gate') is an error, as an unknown key is: the user asked for something the run would not do.
    ``applies``: the method's own such params beside APPLIES, {name: selections}."""
    selection = params["selection"]
    for name, selections in {**APPLIES, **(applies or {})}.items():
        if selection not in selections and params[name] != method.params[name].default:
            raise ConfigError(f"params.{name} of method '{method.name}': got {shown(params[name])}, which has no "
                              f"effect with selection '{selection}'; allowed: the default "
                              f"({method.params[name].default!r}), or selection {' / '.join(selections)}")


def check_stride_config(method: str, params: dict, block_param: str) -> None:
    """The config-time checks that the antidiagonal scoring's tiles and the decode step's pages fit the
    method's blocks, and that a ceiling (max_share) comes with the mass it bounds."""
    if params["selection"] in SCORINGS and params.get("max_share") is not None and params["mass"] is None:
        raise ConfigError(f"params.max_share of method '{method}': got {params['max_share']}, which needs mass (the "
                          "fewest blocks reaching it, under the ceiling); allowed: null, or set mass too")
    for name, selections in (("score_stride", STRIDED), ("decode_page", SCORINGS)):
        if params["selection"] in selections and params[name] is not None and params[block_param] % params[name]:
            raise ConfigError(f"params.{name} of method '{method}': got {params[name]}; allowed: a "
                              f"divisor of {block_param} ({params[block_param]})")


def scoring_of(selection: str, estimate_queries: int, stride: int) -> tuple:
    """The ``scoring`` argument of the functions below for a method's query-aware ``selection``:
    ("estimate", m), ("antidiagonal", stride) or ("hybrid", m, stride)."""
    if selection == "hybrid":
        return (selection, estimate_queries, stride)
    return (selection, estimate_queries if selection == "estimate" else stride)


def check_decode_args(op: str, decode_topk, decode_page) -> None:
    """The ops' checks of the one-token step's ranking arguments."""
    check_int(f"{op}: decode_topk", decode_topk, 0)
    if decode_page is not None:
        check_int(f"{op}: decode_page", decode_page, 1)


def page_size(decode_page: int | None, block: int) -> int:
    """The keys per page of the step's ranking: ``decode_page`` (Quest's 16 when None), or its largest
    common divisor with ``block``, so that pages tile the blocks (NSA's blocks shrink on short inputs)."""
    return math.gcd(decode_page or QUEST_PAGE, block)


def check_estimate_args(op: str, mass, scoring: tuple, block: int, max_share=None) -> None:
    """The ops' checks of a query-aware selection's arguments (as strict as the config's)."""
    for name, value in (("mass", mass), ("max_share", max_share)):
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                      and 0 < value <= 1):
            raise ValueError(f"{op}: {name} must be a number in (0, 1] or None; got {shown(value)}")
    if max_share is not None and mass is None:
        raise ValueError(f"{op}: max_share needs mass (it is the ceiling of the fewest blocks reaching it); got "
                         f"max_share={max_share!r} with mass=None")
    kind = scoring[0]
    if kind not in SCORINGS:
        raise ValueError(f"{op}: selection must be one of {', '.join(SCORINGS)}; got {shown(kind)}")
    if kind in ("estimate", "hybrid"):
        check_int(f"{op}: estimate_queries", scoring[1], 1)
    if kind in STRIDED:
        stride = scoring[-1]
        check_int(f"{op}: score_stride", stride, 1)
        if block % stride:
            raise ValueError(f"{op}: score_stride must divide the block size {block}; got {stride}")


def _block_mass(q, k, qpos: torch.Tensor, first: int, scale: float, nb: int, block: int) -> torch.Tensor:
    """[b, hk, g * len(qpos), nb]: the exact causal attention probabilities of the query rows at positions
    qpos (each query head's rows of a KV group stacked; q holds the last q_len positions of the keys),
    summed per key block; ``first`` is min(qpos) (the caller knows it: no device sync here).

    The score rows are the largest temporaries of a selection (rows x every key), so they are worked
    in place: the future mask touches only keys after ``first``, and the softmax's exponentials are
    pooled before they are normalised (one division per block, not per key)."""
    b, hq, nq, d = q.shape
    hk, n = k.shape[1], k.shape[2]
    g = hq // hk
    rows = q.index_select(2, qpos - (n - nq) if n > nq else qpos)  # positions -> rows of q
    if gpu_scores.applies(q):  # half-precision products, the softmax and pooling fused (gpu_scores.py)
        s = gpu_scores.products(rows.reshape(b, hk, g * len(qpos), d), k.transpose(-1, -2))
        return _FUSED_BLOCK_MASS(s, qpos.repeat(g).view(-1, 1), scale, nb, block)
    acc = acc_dtype(q.dtype)
    rows = rows.reshape(b, hk, g * len(qpos), d).to(acc) * scale
    future = None
    if first + 1 < n:
        future = torch.arange(first + 1, n, device=q.device).view(1, -1) > qpos.repeat(g).view(-1, 1)
    # one KV head at a time: a [b, rows, n] temporary of half the size, which the allocator reuses for
    # the next head (a fresh 32 MB tensor per layer at 32k costs ~10 ms of page faults on a CPU)
    out = []
    for hi in range(hk):
        s = torch.matmul(rows[:, hi], k[:, hi].to(acc).transpose(-1, -2))
        if future is not None:
            s[..., first + 1:].masked_fill_(future, float("-inf"))
        exp_below_max_(s, s.amax(-1, keepdim=True))  # each row's own key (unmasked) keeps the max finite
        if future is not None:
            s[..., first + 1:].masked_fill_(future, 0.0)
        out.append(_pooled(s, nb, block) / s.sum(-1, keepdim=True))
    return torch.stack(out, 1)


_FUSED_BLOCK_MASS = gpu_scores.fused(gpu_scores.block_mass)
_FUSED_TILE_MASS = gpu_scores.fused(gpu_scores.antidiagonal_tile_mass)


def _pooled(p: torch.Tensor, nb: int, block: int) -> torch.Tensor:
    """[..., n] -> [..., nb]: sums over key blocks."""
    n = p.shape[-1]
    if n < nb * block:  # a partial last block: zeros after it (a copy, so only then)
        p = torch.nn.functional.pad(p, (0, nb * block - n))
    return p.view(*p.shape[:-1], nb, block).sum(-1)


def last_queries_vertical(q, k, block: int, m: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(vertical, peak) [b, hk, nb] float32 of ``last_queries_estimate`` (its last ``m`` queries only)."""
    n = k.shape[2]
    nb = math.ceil(n / block)
    m = min(m, q.shape[2])
    last = torch.arange(n - m, n, device=q.device)
    per_row = _block_mass(q, k, last, n - m, scale, nb, block)  # [b, hk, g * m, nb], rows sum to 1
    return per_row.mean(2).float(), per_row.amax(2).float()


def last_queries_estimate(q, k, block: int, m: int, scale: float):
    """(vertical, slash, peak), each [b, hk, nb] float32, from exact attention mass over the scoring
    rows of each KV group (every query head's):

    vertical[j]: the mean mass the last ``m`` queries put on key block j (where the prompt's end
    looks; sums to 1); peak[j]: the most any one of them puts on it (a needle that only the final
    queries read: its mean is diluted by the others, its peak is not);
    slash[o]: the mean mass that ``m`` queries spread evenly over the sequence put on keys o blocks
    before their own block (how far back attention looks wherever it is; sums to 1). Spreading the
    slash rows keeps an absolute position (a needle) from posing as an offset: it sits at a different
    offset from each."""
    b, hq, nq, d = q.shape
    hk, n = k.shape[1], k.shape[2]
    g = hq // hk
    m = min(m, nq)
    nb = math.ceil(n / block)
    dev = q.device
    vertical, peak = last_queries_vertical(q, k, block, m, scale)
    spread = spread_rows(nq, m, dev) + (n - nq)  # over the queries given (a chunk's own)
    pb = _block_mass(q, k, spread, n - nq, scale, nb, block)  # [b, hk, rows, nb]; spread starts at q's first
    off = (spread // block).repeat(g).view(-1, 1) - torch.arange(nb, device=dev).view(1, -1)
    off = off.clamp(min=0).expand(b, hk, -1, -1)  # a future block (offset < 0) has mass 0
    slash = torch.zeros(b, hk, nb, dtype=pb.dtype, device=dev)
    slash.scatter_add_(2, off.reshape(b, hk, -1), pb.reshape(b, hk, -1))
    return vertical, (slash / (g * len(spread))).float(), peak


def spread_rows(n: int, m: int, device=None) -> torch.Tensor:
    """The positions of the estimate's m <= n spread rows: i (n - 1) / (m - 1) for i < m, rounded half to
    even, in integers. Points at least 1 apart round to distinct, increasing positions. Integer
    arithmetic is exact at any length: float32's ``linspace`` gave the same rows below 66k tokens for
    m <= 64 and drifted by one position beyond. The ops run on the device and read nothing back."""
    i = torch.arange(m, device=device)
    if m == 1:
        return i
    quo, rem = (i * (n - 1)) // (m - 1), (i * (n - 1)) % (m - 1)
    return quo + ((2 * rem > m - 1) | ((2 * rem == m - 1) & (quo % 2 == 1))).long()


def block_scores(vertical: torch.Tensor, slash: torch.Tensor, q0: int = 0) -> torch.Tensor:
    """[b, hk, nb - q0 (query blocks from q0), nb (key block)]: vertical[j] + slash[i - j] for j <= i, -inf
    above."""
    nb = vertical.shape[-1]
    i = torch.arange(nb, device=vertical.device)
    off = i[q0:].view(-1, 1) - i.view(1, -1)
    sc = vertical.unsqueeze(-2) + slash[..., off.clamp(min=0)]
    return sc.masked_fill(off < 0, float("-inf"))


def ceilings(nb: int, max_blocks: int, max_share: float | None, device=None,
             q0: int = 0) -> tuple[int, torch.Tensor | None]:
    """(S, caps): the width of the block lists of query blocks ``q0`` .. ``nb`` - 1 and, with ``max_share``,
    each one's ceiling [nb - q0]: the larger of ``max_blocks`` and ceil(max_share x i) for query block i
    (which sees i past blocks); None: ``max_blocks`` for every block. A ceiling is a bound for safety,
    not the working budget: the mass decides how many blocks a row takes under it."""
    if max_share is None:
        return min(max_blocks, max(nb - 1, 0)), None
    # in float64 on the host, a hair under the product: 0.3 x 10 is 3 blocks, not 4 (3.0000000000000004)
    caps = [min(i, max(max_blocks, math.ceil(i * max_share - 1e-9))) for i in range(q0, nb)]
    return max(caps, default=0), torch.tensor(caps, device=device)


def select_blocks(scores: torch.Tensor, max_blocks: int, mass: float | None, local_blocks: int = 1,
                  sink_blocks: int = 1, rank: torch.Tensor | None = None,
                  max_share: float | None = None) -> torch.Tensor:
    """Block lists [b, hk, mq, S] (int64, -1 pads) of past blocks j < i per query block i, from
    ``block_scores`` [b, hk, mq, nb] (query blocks nb - mq .. nb - 1: a chunk's): forced blocks first
    (j < sink_blocks; i - local_blocks <= j < i), then by ``rank`` (same shape; default: the scores);
    ``mass`` None: up to ``max_blocks``; else the fewest blocks in that order (forced ones included) whose
    score, with the own block's, reaches ``mass`` of the row's visible total, at most ``max_blocks`` or,
    with ``max_share``, the row's ceiling (``ceilings``)."""
    b, hk, mq, nb = scores.shape
    q0 = nb - mq
    S, caps = ceilings(nb, max_blocks, max_share, scores.device, q0)
    if S == 0:
        return torch.full((b, hk, mq, 0), -1, dtype=torch.long, device=scores.device)
    i = torch.arange(q0, nb, device=scores.device).view(-1, 1)
    j = torch.arange(nb, device=scores.device).view(1, -1)
    past = j < i
    forced = past & ((j < sink_blocks) | (j >= i - local_blocks))
    sc = scores.clamp(min=0).masked_fill(~past, 0.0)
    rk = sc if rank is None else rank.clamp(min=0).masked_fill(~past, 0.0)
    own = scores.clamp(min=0).gather(-1, i.expand(b, hk, mq, 1)).squeeze(-1)  # [b, hk, mq]
    total = sc.sum(-1) + own
    # forced blocks rank first, then by rank; not-visible blocks last
    key = torch.where(forced, rk + 1e9, torch.where(past, rk, torch.full_like(rk, -1.0)))
    top, idx = torch.topk(key, S, dim=-1)  # [b, hk, nb, S]
    valid = top >= 0
    if mass is not None:
        raw = torch.where(valid, sc.gather(-1, idx), torch.zeros_like(top))
        # keep a block while the mass before it falls short: the fewest blocks that reach the target
        before = own.unsqueeze(-1) + torch.cumsum(raw, -1) - raw
        need = before < mass * total.unsqueeze(-1)
        valid = valid & (need | forced.expand_as(sc).gather(-1, idx))
    if caps is not None:  # forced blocks come first, so a ceiling of at least max_blocks keeps them
        valid = valid & (torch.arange(S, device=scores.device) < caps.view(-1, 1))
    return torch.where(valid, idx, torch.full_like(idx, -1))


# Score elements per step of ``antidiagonal_scores`` (query tiles x key tiles x query heads). The CPU
# works best on temporaries that stay near its caches (8 MB); a GPU on few large steps: at 131k its steps
# were 16 query tiles each, 512 steps of ~10 small kernels, and the hybrid selection took 224 ms of a
# 247 ms call on an H100 (docs/gpu.md). 1 << 26 float32 scores is 256 MB per step there.
_ANTI_ELEMS = {"cpu": 1 << 21, "gpu": 1 << 26}


def antidiagonal_scores(q, k, block: int, stride: int, scale: float) -> torch.Tensor:
    """[b, hk, nb (query block), nb (key block)] float32: the estimated attention mass of each query
    block on each key block from antidiagonals of the score matrix (as XAttention scores blocks).

    Cut queries and keys into tiles of ``stride`` rows. Tile a's score on tile c is the mean of
    ``stride`` products, one per query row and key row of the tiles: q[a s + i] · k[c s + s - 1 - i]
    (the antidiagonal) in even query tiles a, q[a s + (i + 1) mod s] · k[c s + s - 1 - i] (the query
    rows rolled by one) in odd ones. A query that attends to some key of tile c moves the score, at
    1/stride of the dense cost. Why two samplings: the distance query - key along the antidiagonal is
    (a - c) s + 2 i - (s - 1), always odd for an even s, so text whose every query reads the key a
    fixed even distance back (a copy) never reached the scores; with the roll, odd tiles sample the
    even distances ((a - c) s + 2 i + 2 - s, and (a - c) s). (No one pairing of a tile's rows samples
    every distance mod an even s: the differences of a permutation sum to 0 mod s, every residue once
    sums to s / 2.) A query block of two tiles or more thus samples every distance; with one tile per
    block (block == stride, even) a block samples one parity and the next block the other, so a copy
    at a fixed distance is seen by every other block: keep stride <= block / 2. An odd stride
    samples every distance in either tile. The roll stays causal: a query row of tile a still meets
    keys of tiles c < a only.

    Each query tile's softmax over its past tiles (c < a: the diagonal tile holds keys after some of
    its queries, and the own block is attended anyway) is summed per key block, over the tiles of
    each query block and the query heads of each KV group, and each row is normalised to 1 (rows with
    no past tile stay 0). Above the diagonal: -inf.

    A prefill chunk (q the last q_len positions of k, from a block start q0 x block): the rows of query
    blocks q0 .. nb - 1 only, [b, hk, nb - q0, nb], equal to those rows of the one-shot prefill's scores."""
    b, hq, nq, d = q.shape
    hk, n = k.shape[1], k.shape[2]
    g = hq // hk
    nb = math.ceil(n / block)
    per = block // stride  # tiles per block
    nt = nb * per
    q0 = _first_block(n, nq, block)
    t0 = q0 * per  # the chunk's first query tile
    gpu = gpu_scores.applies(q)  # half-precision tiles, scaled after their products (gpu_scores.py)
    acc = q.dtype if gpu else acc_dtype(q.dtype)
    kt = _key_tiles(k, nt, stride, acc)
    if gpu and fused_scores_available(n):
        return _normalised(_fused_block_scores(q, kt, nt, stride, per, scale, q0))
    out = torch.zeros(b, hk, nb - q0, nb, dtype=torch.float32, device=q.device)
    c = torch.arange(nt, device=q.device)
    budget = _ANTI_ELEMS["cpu" if q.device.type == "cpu" else "gpu"]
    rows = max(per, budget // (b * hq * nt) // per * per)  # query tiles per step: bounded temporaries
    if _int8_applies(q):  # reads q step by step: no float32 copy of all its tiles
        int8 = _Int8Products(q, kt, stride, scale / stride, rows, t0)
    else:
        int8 = None
        # one copy each into zero-padded tiles (a model's q/k are strided views of its projections)
        qt = torch.empty(b, hq, (nt - t0) * stride, d, dtype=acc, device=q.device)
        _query_tiles(qt, q, t0, stride, None if gpu else scale / stride)  # every row written, padding zeroed
        qt = qt.view(b, hq, nt - t0, stride * d)
    for a0 in range(t0, nt, rows):
        a = torch.arange(a0, min(nt, a0 + rows), device=q.device)
        seen = a0 + len(a)  # key tiles these query tiles can see: whole blocks up to their last block
        r0 = (a0 - t0) // per  # the step's first row of ``out``
        if gpu:
            sc = gpu_scores.products(qt[:, :, a0 - t0:seen - t0].reshape(b, hk, g * len(a), -1),
                                     kt[:, :, :seen].transpose(-1, -2)).view(b, hk, g, len(a), seen)
            out[:, :, r0: r0 + len(a) // per, :seen // per] = _FUSED_TILE_MASS(sc, a, scale / stride, per)
            continue
        if int8 is not None:
            sc = int8.products(a0, seen)
        else:
            sc = torch.matmul(qt[:, :, a0 - t0:seen - t0].reshape(b, hk, g * len(a), -1),
                              kt[:, :, :seen].transpose(-1, -2))
        sc = sc.view(b, hk, g, len(a), seen)
        # the softmax in place (these scores are the estimate's largest temporaries); only tiles from a0
        # on can be the row's own or later ones
        later = c[a0:seen].view(1, -1) >= a.view(-1, 1)
        sc[..., a0:].masked_fill_(later, float("-inf"))
        exp_below_max_(sc, sc.amax(-1, keepdim=True).clamp(min=-1e30))
        sc[..., a0:].masked_fill_(later, 0.0)  # tile 0 sees no past tile: all zeros
        p = sc.div_(sc.sum(-1, keepdim=True).clamp(min=1e-30)).sum(2)
        pb = p.view(b, hk, len(a) // per, per, seen // per, per).sum((3, 5))  # [b, hk, query blocks, key blocks]
        out[:, :, r0: r0 + pb.shape[2], :seen // per] = pb.float()
    return _normalised(out)


def off_grid_rows(nq: int, n: int, block: int) -> int:
    """The rows of a prefill chunk (1 < nq < n: the queries the last nq positions of n keys) before its first
    block start, which a query-aware selection cannot list blocks for (the ops run them as exact attention,
    ``split_rows``): 0 for a prefill, a one-token step or a chunk that starts on a block; nq where no row of
    the chunk reaches a block start (a few-token step)."""
    if nq <= 1 or nq == n:
        return 0
    return min(nq, -(n - nq) % block)


def split_rows(q, k, v, head: int, exact, rest, return_lse: bool):
    """A prefill chunk whose first ``head`` rows come before its first block start: those rows by ``exact``
    (q rows, and the keys up to the last of them), the others by ``rest`` (a chunk on the block grid); the
    outputs (and LSEs) joined along the rows."""
    upto = k.shape[2] - q.shape[2] + head
    a = exact(q[:, :, :head], k[:, :, :upto], v[:, :, :upto])
    b = rest(q[:, :, head:], k, v)
    if not return_lse:
        return torch.cat([a, b], 2)
    return torch.cat([a[0], b[0]], 2), torch.cat([a[1], b[1].to(a[1].dtype)], 2)


def _first_block(n: int, nq: int, block: int) -> int:
    """The key block a prefill chunk's queries (the last ``nq`` of ``n`` positions) start on; they must start
    on one (``Method.chunk_block``: the ops run other shapes as exact attention)."""
    if (n - nq) % block:
        raise ValueError(f"a prefill chunk of {nq} queries against {n} keys starts at position {n - nq}, not on a "
                         f"block of {block} keys")
    return (n - nq) // block


def _key_tiles(k: torch.Tensor, nt: int, stride: int, dtype: torch.dtype) -> torch.Tensor:
    """[b, hk, nt, stride * d]: the keys in tiles of ``stride`` rows, each tile's rows reversed (so that a
    row of query tiles times a row of key tiles sums an antidiagonal), zeros past the last key."""
    b, hk, n, d = k.shape
    j = torch.arange(n, device=k.device)
    kt = torch.zeros(b, hk, nt * stride, d, dtype=dtype, device=k.device)
    kt.index_copy_(2, j - j % stride + stride - 1 - j % stride, k.to(dtype))
    return kt.view(b, hk, nt, stride * d)


def _normalised(out: torch.Tensor) -> torch.Tensor:
    """Block scores [b, hk, mq, nb] (query blocks nb - mq .. nb - 1) with each query block's row normalised to
    1 and the future at -inf."""
    mq, nb = out.shape[-2:]
    out = out / out.sum(-1, keepdim=True).clamp(min=1e-30)
    i = torch.arange(nb, device=out.device)
    return out.masked_fill(i.view(1, -1) > i[nb - mq:].view(-1, 1), float("-inf"))


# The antidiagonal scoring of CUDA half-precision inputs: None (auto), the Triton kernel where triton imports and
# the keys are at most FUSED_SCORES_MAX_KEYS, else the torch form (score rows, tiled); True: the kernel at
# every length; False: the torch form. Why the cut: on an H200 (bf16, 32 query heads over 8 KV heads, d 128)
# the kernel took 3.3 / 43.7 / 175 ms at 32k / 131k / 262k keys where the torch form took 3.6 / 34.1 / 124:
# the kernel computes the strided products twice (its row maximum and sum, then the probabilities), the
# torch form once through cuBLAS
FUSED_SCORES: bool | None = None
FUSED_SCORES_MAX_KEYS = 65536


def fused_scores_available(n: int = 0) -> bool:
    """Whether the antidiagonal scoring's Triton kernel (``longpatch.kernels.scores``) runs for ``n`` keys:
    triton importable and ``FUSED_SCORES`` True, or None with n at most ``FUSED_SCORES_MAX_KEYS``. The CUDA
    path takes it; the CPU keeps the torch form above (its twin)."""
    if FUSED_SCORES is False or (FUSED_SCORES is None and n > FUSED_SCORES_MAX_KEYS):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _fused_block_scores(q, kt: torch.Tensor, nt: int, stride: int, per: int, scale: float,
                        q0: int = 0) -> torch.Tensor:
    """The unnormalised block scores of ``antidiagonal_scores`` from its Triton kernel, on the same
    prepared tiles: no [n / stride, n / stride] score rows are written. q: the query blocks from ``q0``."""
    from ..kernels.scores import block_scores  # lazily: triton is optional

    b, hq, n, d = q.shape
    t0 = q0 * per
    qt = torch.empty(b, hq, (nt - t0) * stride, d, dtype=kt.dtype, device=q.device)
    _query_tiles(qt, q, t0, stride)
    return block_scores(qt.view(b, hq, nt - t0, stride * d), kt, per, scale / stride, q0)


def antidiagonal_scores_fused(q, k, block: int, stride: int, scale: float) -> torch.Tensor:
    """``antidiagonal_scores`` from the Triton kernel on any device (the CPU under TRITON_INTERPRET=1:
    the tests' twin check); what CUDA half-precision inputs run."""
    n = k.shape[2]
    per = block // stride
    nt = math.ceil(n / block) * per
    acc = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else acc_dtype(q.dtype)
    return _normalised(_fused_block_scores(q, _key_tiles(k, nt, stride, acc), nt, stride, per, scale,
                                           _first_block(n, q.shape[2], block)))


def _query_tiles(dst: torch.Tensor, src: torch.Tensor, tile0: int, stride: int, mul: float | None = None) -> None:
    """Writes the query rows ``src`` [b, h, m, d] (positions from tile ``tile0`` on) into ``dst`` [b, h, R, d]
    (R >= m, a multiple of ``stride``) as ``antidiagonal_scores`` pairs them with the reversed key tiles:
    even tiles as they are, odd tiles rolled by one row (row i of odd tile a holds q[a s + (i + 1) mod s]),
    times ``mul`` where given; rows that no query fills (a partial last tile, whole tiles past m) are
    zeros. Strided views and at most five copies, each of a part of ``src``: no index tensor, no copy of q."""
    def put(out: torch.Tensor, x: torch.Tensor) -> None:
        if mul is None:
            out.copy_(x)
        elif torch.compiler.is_compiling():  # a compiled region takes no out= view; the same product
            out.copy_(x * mul)
        else:
            torch.mul(x, mul, out=out)

    m, s = src.shape[2], stride
    full = m // s
    if full:
        dt, st = dst[:, :, :full * s].unflatten(2, (full, s)), src[:, :, :full * s].unflatten(2, (full, s))
        ev, od = tile0 % 2, 1 - tile0 % 2  # the first even and odd tile of this part
        put(dt[:, :, ev::2], st[:, :, ev::2])
        put(dt[:, :, od::2, :-1], st[:, :, od::2, 1:])
        put(dt[:, :, od::2, -1], st[:, :, od::2, 0])
    t0 = full * s  # a partial last tile: its rows, the roll's gap and the padding zeroed
    if t0 < m:
        if (tile0 + full) % 2 == 0:
            put(dst[:, :, t0:m], src[:, :, t0:m])
            dst[:, :, m:t0 + s].zero_()
        else:
            put(dst[:, :, t0:m - 1], src[:, :, t0 + 1:m])
            dst[:, :, m - 1:t0 + s - 1].zero_()
            put(dst[:, :, t0 + s - 1], src[:, :, t0])
        t0 += s
    dst[:, :, t0:].zero_()


# The antidiagonal's products on a CPU in int8 (``_Int8Products``): None, as the environment variable
# LONGPATCH_INT8_PRODUCTS says (``int8_products_setting``); True: always; False: float32 products. The two
# paths differ by the int8 rounding, so a test that compares against one of them pins it here, and CI runs
# the suite with the variable at "on" and at "off" whatever its CPU would choose
INT8_PRODUCTS: bool | None = None
INT8_PRODUCTS_ENV = "LONGPATCH_INT8_PRODUCTS"
_INT8_CHOICES = {"auto": None, "on": True, "1": True, "off": False, "0": False}
CPUINFO = Path("/proc/cpuinfo")


@functools.lru_cache(maxsize=None)
def int8_products_setting() -> bool | None:
    """LONGPATCH_INT8_PRODUCTS: "auto" (the default: int8 where ``cpu_int8_fast``), "on"/"1" or "off"/"0"."""
    raw = os.environ.get(INT8_PRODUCTS_ENV, "auto")
    value = raw.strip().lower()
    if value not in _INT8_CHOICES:
        raise ConfigError(f"{INT8_PRODUCTS_ENV}={raw[:40]!r}: allowed values are auto, on, off (or 1, 0)")
    return _INT8_CHOICES[value]


@functools.lru_cache(maxsize=None)
def cpu_int8_fast() -> bool:
    """Whether this CPU has int8 dot-product instructions (VNNI: avx512_vnni or avx_vnni; AMX), with
    which torch's ``_int_mm`` runs about 3x faster than float32 products. Without them it is far slower:
    on a 2-core AVX2-only VM a [2048, 256] x [256, 2048] product took 1.86 s in int8 against 51 ms in
    float32, and the demo model's 32k prefill with `demo-moba-32k` ran slower than exact attention.
    Read from /proc/cpuinfo's flags (False where there is none): the same answer on every run."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags))


def _int8_applies(x: torch.Tensor) -> bool:
    """Whether the antidiagonal products take int8: float32 on a CPU, where this torch has ``_int_mm``
    (and the CPU multiplies int8 fast, unless ``INT8_PRODUCTS`` says otherwise), outside a compiled
    region (its buffers are written through out= views)."""
    if torch.compiler.is_compiling() or x.device.type != "cpu" or x.dtype != torch.float32:
        return False  # (first: a compiled region must not trace the cpuinfo read)
    if not hasattr(torch, "_int_mm"):
        return False
    forced = int8_products_setting() if INT8_PRODUCTS is None else INT8_PRODUCTS
    return cpu_int8_fast() if forced is None else forced


def _int8_rows(x: torch.Tensor, out_f: torch.Tensor, out_i: torch.Tensor) -> torch.Tensor:
    """x [..., r, e] float32 -> each row's scale [..., r, 1], the row rounded to int8 in ``out_i``
    (its largest |value| to 127), through the float32 buffer ``out_f`` (x's shape; may be x)."""
    top = torch.maximum(x.amax(-1, keepdim=True), x.amin(-1, keepdim=True).neg_())
    scale = top.clamp_(min=1e-30).div_(127.0)
    torch.div(x, scale, out=out_f).round_()
    out_i.copy_(out_f)
    return scale


class _Int8Products:
    """``antidiagonal_scores``' tile products on a CPU in int8 (SageAttention's int8 q·k, per row).

    The products are most of the estimate's time at long contexts (0.35 s of its 0.57 s for the demo
    model's 4 layers at 32k, 2 threads) and the CPU multiplies int8 with int32 sums (VNNI's
    ``_int_mm``) about 3x faster than float32. Each flattened tile row of q and of k is rounded to
    int8 with its own scale: a product's error is about 1/127 of |q tile| |k tile| / sqrt(stride d)
    spread over the antidiagonal, far below the gaps between the tile scores that the softmax and the
    block sums turn into choices (tests/test_hybrid_selection.py holds the scores and lists to float32's).
    The query tiles are read from q one step at a time into buffers made once per call (a fresh
    tensor of q's size costs page faults of the order of the copy itself)."""

    def __init__(self, q: torch.Tensor, kt: torch.Tensor, stride: int, scale: float, rows: int, t0: int = 0):
        """q [b, hq, nq, d] as given (the positions from query tile ``t0`` on); kt [b, hk, nt, stride * d] the
        key tiles (consumed: rounded in place); scale multiplies every product; rows: the most query tiles
        of one step."""
        b, hk, nt, e = kt.shape
        self.q, self.stride, self.scale, self.t0 = q, stride, scale, t0
        self.g = q.shape[1] // hk
        ki = torch.empty(kt.shape, dtype=torch.int8)
        self.kscale = _int8_rows(kt, kt, ki).view(b, hk, 1, nt)  # kt is rounded in place: not read again
        self.ki = ki.transpose(-1, -2).contiguous()  # [b, hk, e, nt]: _int_mm's fast layout
        self.qf = torch.empty(b * hk * self.g * rows * e)
        self.qi = torch.empty(b * hk * self.g * rows * e, dtype=torch.int8)
        self.i32 = torch.empty(b * hk * self.g * rows * nt, dtype=torch.int32)
        self.f32 = torch.empty(b * hk * self.g * rows * nt)

    def products(self, a0: int, seen: int) -> torch.Tensor:
        """float32 [b, hk, g * r, seen]: (scale x) query tiles a0..seen-1 (r of them) times key tiles
        0..seen-1."""
        q, g, st = self.q, self.g, self.stride
        b, hq, nq, d = q.shape
        hk, r, e = hq // g, seen - a0, st * d
        qf, qi = (x[:b * hk * g * r * e].view(b, hk, g, r, e) for x in (self.qf, self.qi))
        rows = qf.view(b, hq, r * st, d)
        first = (a0 - self.t0) * st  # the step's first row of q
        m = max(0, min(nq, first + r * st) - first)  # the step's rows of q; past them, zeros
        _query_tiles(rows, q[:, :, first:first + m], a0, st)
        qscale = _int8_rows(qf, qf, qi).view(b, hk, g * r, 1)
        i32 = self.i32[:b * hk * g * r * seen].view(b, hk, g * r, seen)
        for bi in range(b):
            for hi in range(hk):
                torch._int_mm(qi[bi, hi].view(g * r, e), self.ki[bi, hi, :, :seen], out=i32[bi, hi])
        sc = self.f32[:i32.numel()].view(i32.shape).copy_(i32)
        return sc.mul_(qscale * self.scale).mul_(self.kscale[..., :seen])


def hybrid_blocks(q, k, block: int, max_blocks: int, mass: float | None, m: int, stride: int, local_blocks: int,
                  scale: float, sink_blocks: int = 1, max_share: float | None = None) -> torch.Tensor:
    """Block lists [b, hk, nb, S] (as ``select_blocks``) of selection "hybrid": per query block i,
    the forced blocks, then in turn the next block of each of two lists until ``max_blocks``:

    - own: ``select_blocks`` on the antidiagonal scores (the fewest past blocks whose estimated mass,
      with the own block's, reaches ``mass`` of what block i reads; ``max_blocks`` when mass is None);
    - end: of the fewest blocks whose vertical mass (the last ``m`` queries') reaches ``mass`` of
      its total, ranked by (mean + peak) / 2 as the estimate ranks them (a needle that one final query
      reads sharply comes first), those before block i (all of them, in that order, when mass is None).

    Taking the two lists in turn under the cap keeps the head of each: a needle block (first on the
    end list) is not pushed out by the tail of a long own list, nor the reverse."""
    anti = antidiagonal_scores(q, k, block, stride, scale)  # [b, hk, mq, nb], -inf above the diagonal
    own = select_blocks(anti, max_blocks, mass, local_blocks, sink_blocks, max_share=max_share)
    vertical, peak = last_queries_vertical(q, k, block, m, scale)
    b, hk, mq, nb = anti.shape
    q0 = nb - mq  # a prefill chunk's first query block (0: the whole prompt)
    S, caps = ceilings(nb, max_blocks, max_share, q.device, q0)
    if S == 0:
        return own
    # the end's list, one for the whole prompt: the fewest blocks (ranked by (mean + peak) / 2) whose
    # mean mass reaches `mass` of the last queries' total; query block i takes those before it. Counted
    # against the whole total, not what block i sees: the end's mass mostly sits near the end, and a
    # middle block topping up "90% of what it sees" of it would take blocks nobody reads.
    order = torch.argsort((vertical + peak) / 2, dim=-1, descending=True)  # [b, hk, nb]
    got = vertical.gather(-1, order)
    keep = torch.ones_like(got, dtype=torch.bool) if mass is None else (torch.cumsum(got, -1) - got) < mass
    i = torch.arange(q0, nb, device=q.device).view(-1, 1)
    j = torch.arange(nb, device=q.device).view(1, -1)
    rows = order.unsqueeze(-2).expand(b, hk, mq, nb)
    end = torch.where(keep.unsqueeze(-2) & (rows < i), rows, torch.full_like(rows, -1))  # [b, hk, mq, nb]
    forced = ((j < i) & ((j < sink_blocks) | (j >= i - local_blocks))).expand(b, hk, mq, nb)
    # each block's turn: its place among the unforced blocks of its list (the better of the two
    # lists'), forced blocks before all
    never = float(nb + 2)  # the turn of a block on neither list
    turn = torch.full((b, hk, mq, nb + 1), never, device=q.device)  # column nb: the -1 pads
    for lst in (end, own):  # a block on both lists takes its better place
        free = (lst >= 0) & ~forced.gather(-1, lst.clamp(min=0))
        place = (torch.cumsum(free, -1) - 1).to(turn.dtype)
        turn.scatter_reduce_(-1, torch.where(free, lst, nb), place, "amin")
    turn = turn[..., :nb].masked_fill(forced, -1.0)
    # ties between the lists' equal places: the higher own score first
    key = -turn + anti.clamp(min=0).nan_to_num(0.0) * 1e-3
    top, idx = torch.topk(key, S, dim=-1)
    valid = top > 0.5 - never
    if caps is not None:  # each row's own ceiling (S is the widest)
        valid = valid & (torch.arange(S, device=q.device) < caps.view(-1, 1))
    return torch.where(valid, idx, torch.full_like(idx, -1))


def score_blocks(q, k, block: int, scoring: tuple[str, int], scale: float):
    """(scores, rank) [b, hk, nb, nb] of a causal prefill by ``scoring`` (``scoring_of``): the
    estimated mass per (query block, key block), and the order to pick blocks in (None: by mass).
    The last-queries estimate ranks by vertical (mean + peak) / 2 + slash, so a block that one final
    query reads sharply (a needle) comes early, and counts the budget by mean mass, so the peaks,
    which sum to far more than 1, do not inflate how many blocks ``mass`` takes. (The hybrid
    selection is two lists merged, not one score: ``hybrid_blocks``.)"""
    if scoring[0] not in ("estimate", "antidiagonal"):
        raise ValueError(f"score_blocks: scoring {scoring[0]!r} has no single score matrix")
    kind, amount = scoring
    if kind == "antidiagonal":
        return antidiagonal_scores(q, k, block, amount, scale), None
    vertical, slash, peak = last_queries_estimate(q, k, block, amount, scale)
    q0 = _first_block(k.shape[2], q.shape[2], block)
    return block_scores(vertical, slash, q0), block_scores((vertical + peak) / 2, slash, q0)


def estimated_blocks(q, k, block: int, max_blocks: int, mass: float | None, scoring: tuple[str, int],
                     local_blocks: int, scale: float, sink_blocks: int = 1, final_topk: int = 0,
                     max_share: float | None = None) -> torch.Tensor:
    """The block lists of a causal prefill (q_len == kv_len), or of a prefill chunk's query blocks (q the last
    q_len positions of k, from a block start), by a query-aware ``scoring``; with ``final_topk`` > 0, the last
    query block's list joined by ``final_row_blocks`` (the lists get ``final_topk`` more columns, -1 but in
    that row)."""
    if scoring[0] == "hybrid":
        blocks = hybrid_blocks(q, k, block, max_blocks, mass, scoring[1], scoring[2], local_blocks, scale,
                               sink_blocks, max_share)
    else:
        scores, rank = score_blocks(q, k, block, scoring, scale)
        blocks = select_blocks(scores, max_blocks, mass, local_blocks, sink_blocks, rank, max_share)
    nb = math.ceil(k.shape[2] / block)
    if final_topk <= 0 or nb < 2:
        return blocks
    extra = final_row_blocks(q, k, block, final_topk, scale)
    blocks = torch.nn.functional.pad(blocks, (0, extra.shape[-1]), value=-1)
    blocks[:, :, -1] = joined_lists(blocks[:, :, -1, :-extra.shape[-1]], extra)
    if blocks.shape[-1] > nb - 1:  # no list holds more than the nb - 1 past blocks
        blocks = blocks.sort(-1, descending=True).values[..., :nb - 1]
    return blocks


def final_row_blocks(q, k, block: int, count: int, scale: float) -> torch.Tensor:
    """[b, hk, count'] (-1 pads) the past blocks, before the last query block, on which the prompt's
    last query puts the most exact attention mass (the most any query head of the KV group puts).

    That query predicts the first generated token: it is the first decode step, and it ranks blocks
    as the steps after it do (``decode_topk`` of them), with its exact scores (one row against n keys
    per head, where the steps, reading a cache, use Quest's bound). The estimates rank for the whole
    last query block, by mean and peak over its rows: on a code prompt of the demo model the block
    holding the needle, 36% of the last query's mass in one head, ranked 16th there and fell outside
    the block's list (docs/moba.md)."""
    n = k.shape[2]
    nb = math.ceil(n / block)
    last = torch.full((1,), n - 1, dtype=torch.long, device=q.device)
    mass = _block_mass(q, k, last, n - 1, scale, nb, block).amax(2)[..., :nb - 1]  # [b, hk, nb - 1]
    top = torch.topk(mass, min(count, nb - 1), -1)
    return torch.where(top.values > 0, top.indices, torch.full_like(top.indices, -1))


def joined_lists(lists: torch.Tensor, more: torch.Tensor) -> torch.Tensor:
    """Block lists [..., S] joined by [..., S'] (-1 pads): [..., S + S'], sorted, each block once."""
    joined = torch.cat([lists, more], -1).sort(-1).values
    dup = torch.zeros_like(joined, dtype=torch.bool)
    dup[..., 1:] = joined[..., 1:] == joined[..., :-1]
    return joined.masked_fill(dup, -1)


def prefill_blocks(state: dict | None, q, k, block: int, max_blocks: int, mass: float | None,
                   scoring: tuple[str, int], local_blocks: int, scale: float, sink_blocks: int = 1,
                   final_topk: int = 0, max_share: float | None = None, keep: bool = True) -> torch.Tensor:
    """``estimated_blocks`` of a prefill (or a prefill chunk), recording in a layer's ``state`` the last query
    block's list (``state["kept"]``: what its decode steps keep; a later chunk's replaces it; without ``keep``
    only the first ``sink_blocks`` blocks, the attention sinks a step keeps whatever it ranks) and the work
    (``state["work"]``, counted by the route)."""
    with torch.no_grad():
        blocks = estimated_blocks(q.detach(), k.detach(), block, max_blocks, mass, scoring, local_blocks, scale,
                                  sink_blocks, final_topk, max_share)
    if state is not None:
        b, hq, nq, _ = q.shape
        n = k.shape[2]
        state["kept"] = blocks[:, :, -1] if keep else sink_list(blocks.shape[:2], sink_blocks, blocks.device)
        state["work"] = {"estimate_pairs": estimate_cost(b, hq, n, scoring, final_topk > 0, q.device, nq),
                         "attended_pairs": attended_cost(blocks, hq, n, block)}
    return blocks


def sink_list(shape, sink_blocks: int, device=None) -> torch.Tensor:
    """[*shape, sink_blocks] int64: the first ``sink_blocks`` block ids, the list a step keeps without the prefill's."""
    return torch.arange(sink_blocks, device=device).expand(*shape, sink_blocks)


def decode_kept(state: dict | None, q, k, block: int, max_blocks: int, local_blocks: int, scale: float,
                sink_blocks: int = 1, kept: torch.Tensor | None = None, decode_topk: int = 0,
                decode_page: int | None = None) -> torch.Tensor:
    """The past blocks [b, hk, S'] a one-token step attends to besides its own and local ones: ``kept``
    when given, else the prefill's list in ``state``, else (no prefill, e.g. a cache built elsewhere)
    ``decode_blocks`` once, stored for the next steps; with ``decode_topk`` > 0, joined by the step's
    own ``bound_blocks`` over pages of ``page_size(decode_page, block)`` keys (-1 pads, no
    duplicates). Records in ``state["work"]`` the keys the step lists (``step_keys``, its own block and the
    local ones counted as far as they exist) against the cache's (``dense_keys``), per KV head summed."""
    with step_phase(RANK):
        kept = _decode_kept(state, q, k, block, max_blocks, local_blocks, scale, sink_blocks, kept, decode_topk,
                            decode_page)
    if state is not None:
        b, hk, n = k.shape[0], k.shape[1], k.shape[2]
        own = (n - 1) // block
        past = ((kept >= 0) & (kept < own - local_blocks)).sum()  # a device count: no host sync here
        state["work"] = {"step_keys": past * block + b * hk * (n - max(0, own - local_blocks) * block),
                         "dense_keys": b * hk * n}
    return kept


def _decode_kept(state, q, k, block, max_blocks, local_blocks, scale, sink_blocks, kept, decode_topk, decode_page):
    if kept is None and state is not None:
        kept = state.get("kept")
    if kept is None or kept.shape[:2] != k.shape[:2]:
        with torch.no_grad():
            kept = decode_blocks(q.detach(), k.detach(), block, max_blocks, local_blocks, scale, sink_blocks)
        if state is not None:
            state["kept"] = kept
    if decode_topk > 0:
        page = page_size(decode_page, block)
        with torch.no_grad():
            mins, maxs = block_bounds(state if state is not None else {}, k.detach(), page)
            full = k.shape[2] // block * (block // page)  # the pages of full blocks
            best = best_page_bounds(q.detach(), mins[:, :, :full], maxs[:, :, :full], block // page)
            own = (k.shape[2] - 1) // block
            best = unlisted(best, kept, torch.tensor(own - local_blocks, device=best.device))
            top = torch.topk(best, min(decode_topk, best.shape[-1]), -1)
            kept = joined_lists(kept, torch.where(torch.isfinite(top.values), top.indices,
                                                  torch.full_like(top.indices, -1)))
    return kept


def unlisted(best: torch.Tensor, listed: torch.Tensor, first_local: torch.Tensor) -> torch.Tensor:
    """The blocks' bounds ``best`` [b, hk, nb] with -inf where a block is listed anyway: in ``listed``
    [b, hk, S] (the kept list, -1 pads) or at or after ``first_local`` (a tensor broadcasting to [b, hk, 1]:
    the local and own blocks), so that the step's top-k adds decode_topk blocks beside them, each once."""
    nb = best.shape[-1]
    ids = torch.arange(nb, device=best.device)
    hide = torch.zeros(*best.shape[:-1], nb + 1, dtype=torch.bool, device=best.device)  # a last slot for the pads
    hide.scatter_(-1, torch.where(listed >= 0, listed, nb).clamp(max=nb).to(torch.int64), True)
    return best.masked_fill(hide[..., :nb] | (ids >= first_local), float("-inf"))


def block_bounds(state: dict, k: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mins, maxs) [b, hk, np, d]: per full page of ``page`` keys of the cache ``k``, its keys'
    elementwise minimum and maximum, kept in ``state`` and extended when a page fills
    (``common.window_summaries``: each page is read once, rebuilt for another cache), stored feature-major
    (``best_page_bounds`` multiplies them by one query per head). An 8-bit cache's bounds are kept in bfloat16,
    rounded outward (``bf16_below``), so that they still bound every key: in float32 they would be 18% of an int8
    cache's bytes at pages of 16 keys, where they are 5% of a float32 cache's."""
    from ..quantized import QuantizedKV
    if isinstance(k, QuantizedKV) and k.dtype == torch.float32:
        def summarize(kk, _):
            lo, hi = page_minmax(kk, page)
            return bf16_below(lo), -bf16_below(-hi)
    else:
        def summarize(kk, _):
            return page_minmax(kk, page)
    return window_summaries(state, ("mins", "maxs"), k, None, page, page, summarize, feature_major=True)


def bf16_below(x: torch.Tensor) -> torch.Tensor:
    """float32 x rounded to bfloat16 toward -inf (the largest bfloat16 <= x; rounding to nearest could land above a
    minimum and no longer bound it). bfloat16 is float32's top 16 bits: dropping the low 16 rounds toward zero,
    which is down for x >= 0; a negative x with bits dropped steps one unit further from zero."""
    bits = x.contiguous().view(torch.int32)
    top = bits & -65536  # 0xFFFF0000: the low 16 bits cleared
    top = top + ((x < 0) & (bits != top)).to(torch.int32) * 65536
    return top.view(torch.float32).to(torch.bfloat16)


def page_minmax(k: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mins, maxs) [b, hk, n / page, d]: each page's elementwise key minimum and maximum (n a multiple
    of ``page``)."""
    parts = k.reshape(k.shape[0], k.shape[1], -1, page, k.shape[-1])
    return parts.amin(3), parts.amax(3)


def best_page_bounds(q, mins: torch.Tensor, maxs: torch.Tensor, pages: int) -> torch.Tensor:
    """[b, hk, np / pages]: per block of ``pages`` consecutive pages, its best page's upper bound of a
    one-token query's q·k (the maximum over the KV group's query heads; ``bound_blocks``)."""
    b, hq, _, d = q.shape
    hk, npg = mins.shape[1], mins.shape[2]
    # half-precision bounds (a bf16/fp16 cache's) are multiplied as they are, the products accumulated in float32
    # by the matmul itself: a float32 copy of them would be most of a GPU step's memory traffic (the bounds of
    # pages of 4 keys are half the K cache's bytes); the bounds come out rounded to the half type, which only
    # near-ties of the ranking feel
    half = mins.dtype in (torch.float16, torch.bfloat16)
    qg = q.reshape(b, hk, hq // hk, d).to(mins.dtype if half else acc_dtype(q.dtype))
    # max(q_f min_f, q_f max_f) is q_f max_f where q_f >= 0, else q_f min_f: two products, no [.., np, d] temporary
    bound = (qg.clamp(min=0) @ maxs.to(qg.dtype).transpose(-1, -2)).float() \
        + (qg.clamp(max=0) @ mins.to(qg.dtype).transpose(-1, -2)).float()
    return bound.amax(2).view(b, hk, npg // pages, pages).amax(-1)


def bound_blocks(q, mins: torch.Tensor, maxs: torch.Tensor, count: int, pages: int = 1) -> torch.Tensor:
    """[b, hk, count'] the full blocks (of ``pages`` consecutive pages of ``mins``/``maxs``) with the
    largest upper bound of a one-token query's q·k, as Quest ranks KV pages: sum over features of
    max(q_f min_f, q_f max_f) bounds q·k for every key of the page, and a block ranks by its best page.
    Small pages keep the bound tight: one key that matches the query (a needle) lifts its page's
    bound about as much as its own score, where the bound of a whole 256-key block is lifted by every
    key's extreme features and ranks the needle's block among many (on the demo model, blocks of 256
    lost digits of copied needles that pages of 4 keep; docs/moba.md). The query heads of a KV group
    share the list (the maximum of their bounds)."""
    best = best_page_bounds(q, mins, maxs, pages)
    return torch.topk(best, min(count, best.shape[-1]), -1).indices


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


def estimate_cost(b: int, hq: int, n: int, scoring: tuple[str, int], final_row: bool = False, device=None,
                  nq: int | None = None):
    """Query-key products of a selection's estimate on an n-token prefill (or its last ``nq`` queries, a
    prefill chunk), per query head summed:
    the last-queries estimate's last and spread rows, each against its visible keys; the
    antidiagonal scoring's stride products per (query tile, past key tile); the hybrid's
    antidiagonal products and last rows; with ``final_row``, the last query's row of
    ``final_row_blocks`` (n more). An int, or for the estimate (whose spread rows are counted where
    they are made, on ``device``) a 0-d int64 tensor: no host round-trip (``int()`` it where it is read)."""
    nq = n if nq is None else nq
    if final_row:
        return estimate_cost(b, hq, n, scoring, device=device, nq=nq) + b * hq * n
    kind, amount = scoring[0], scoring[-1]
    if kind == "antidiagonal":  # scoring: (kind, stride); query tile a against its a past key tiles
        nt, t0 = -(-n // amount), (n - nq) // amount
        return b * hq * amount * (nt * (nt - 1) - t0 * (t0 - 1)) // 2
    m = min(scoring[1], nq)  # the last-queries rows: estimate (kind, m), hybrid (kind, m, stride)
    last = m * (2 * n - m + 1) // 2  # rows n - m .. n - 1, each against its own position + 1 keys
    if kind == "hybrid":
        return estimate_cost(b, hq, n, ("antidiagonal", amount), nq=nq) + b * hq * last
    return b * hq * (last + (spread_rows(nq, m, device) + n - nq + 1).sum())


def attended_cost(blocks: torch.Tensor, hq: int, n: int, block: int) -> torch.Tensor:
    """Query-key products the executor computes for ``blocks`` on an n-token prefill (or a chunk's query
    blocks, the last of the n): each query block's listed blocks in full and its own block's causal half,
    per query head summed. A 0-d int64 tensor on the blocks' device: counting it needs no host round-trip
    (``int()`` it where it is read)."""
    b, hk, mq, _ = blocks.shape
    g = hq // hk
    q0 = math.ceil(n / block) - mq
    sizes = torch.clamp(n - torch.arange(q0, q0 + mq, device=blocks.device) * block, max=block)  # rows per block
    listed = ((blocks >= 0).sum(-1) * sizes).sum() * (block * g)
    return listed + b * hq * (sizes * (sizes + 1) // 2).sum()


def estimated_pairs(q, k, block: int, max_blocks: int, mass: float | None, scoring: tuple[str, int],
                    local_blocks: int, scale: float, sink_blocks: int = 1, final_topk: int = 0,
                    max_share: float | None = None) -> int:
    """All query-key products of an estimated prefill (``estimate_cost`` + ``attended_cost``)."""
    blocks = estimated_blocks(q, k, block, max_blocks, mass, scoring, local_blocks, scale, sink_blocks, final_topk,
                              max_share)
    n = q.shape[2]
    return int(estimate_cost(q.shape[0], q.shape[1], n, scoring, final_topk > 0)
               + attended_cost(blocks, q.shape[1], n, block))


# --------------------------------------------------------------------------- the lean one-token step

# The most blocks (kept and ranked) ``quest_step`` copies: beyond, the general step's in-place sparse reads win (a 16k
# cache, 2 threads: 11 blocks 1.5 against 2.1 ms; 35 blocks 5.0 against 2.8 ms)
LEAN_BLOCKS = 16


def quest_applies(k, v, kept: torch.Tensor, decode_topk: int, backend: str) -> bool:
    """Whether a one-token step takes ``quest_step``: a step that ranks, with at most ``LEAN_BLOCKS`` kept and
    ranked blocks (the list's width: no host sync), on plain tensors whose rows are whole (a GrowingCache's views,
    DynamicCache's tensors), off FlexAttention (its decode is one call anyway) and off autograd (a training step
    keeps the general path, ``decode_kept`` + ``block_sparse_decode``)."""
    from ..quantized import QuantizedKV
    return (decode_topk > 0 and kept.shape[-1] + decode_topk <= LEAN_BLOCKS and backend != "flex"
            and not isinstance(k, QuantizedKV)
            and not isinstance(v, QuantizedKV) and k.stride(-1) == 1 and k.stride(-2) == k.shape[-1]
            and v.stride(-1) == 1 and v.stride(-2) == v.shape[-1]
            and not (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)))


def quest_step(state: dict, q, k, v, block: int, local_blocks: int, kept: torch.Tensor, decode_topk: int,
               decode_page: int | None, scale: float, need_lse: bool):
    """(out [b, hq, 1, d], lse [b, hq, 1] float32 or None) of one query per head at position t = kv_len - 1 over
    the blocks of ``kept`` [b, hk, S] (the prefill's list, or its sinks alone with ``decode_prefill`` false; -1
    pads), the ``decode_topk`` full blocks of the largest page bound of its q·k among the others before the local
    ones (Quest's ranking, ``best_page_bounds``; the KV group's heads share it), and the keys from the
    ``local_blocks``-th block before its own up to t, read in place. What the general step (``decode_kept`` +
    ``block_sparse_decode``) attends, in a fixed handful of ops: on a CPU every op of a one-token step costs
    ~5-20 us whatever it reads, and the general step's ~150 ops a layer cost more than the keys they save (a 16k
    cache: 2.3 against 3.2 ms for exact attention's layer). On a CPU it runs on one thread: its ops are too small
    to share (a 16k cache, 2 threads against 1: 1.9 against 1.3 ms)."""
    if q.device.type == "cpu" and torch.get_num_threads() > 1:
        with one_thread():
            return _quest_step(state, q, k, v, block, local_blocks, kept, decode_topk, decode_page, scale, need_lse)
    return _quest_step(state, q, k, v, block, local_blocks, kept, decode_topk, decode_page, scale, need_lse)


def _quest_step(state, q, k, v, block, local_blocks, kept, decode_topk, decode_page, scale, need_lse):
    b, hq, _, d = q.shape
    hk, n = k.shape[1], k.shape[2]
    g, t = hq // hk, n - 1
    near = max(0, t // block - local_blocks)  # the first local block: keys [near * block, n) are read in place
    acc = acc_dtype(q.dtype)
    qg = q.reshape(b, hk, g, d).to(acc)
    with step_phase(RANK):
        kept = kept.to(device=q.device, dtype=torch.int64)
        ids, valid = kept.clamp(0, max(near - 1, 0)), (kept >= 0) & (kept < near)  # the local ones come in place
        count = min(decode_topk, near)
        if count > 0:
            page = page_size(decode_page, block)
            mins, maxs = block_bounds(state, k, page)
            pages = near * (block // page)
            best = unlisted(best_page_bounds(q, mins[:, :, :pages], maxs[:, :, :pages], block // page),
                            kept, near)  # [b, hk, near]: the blocks before the local ones, not kept
            top = torch.topk(best, count, -1, sorted=False)
            ids, valid = torch.cat([ids, top.indices], -1), torch.cat([valid, torch.isfinite(top.values)], -1)
    with step_phase(ATTEND):
        L = ids.shape[-1] if near else 0
        kt, vt = k[:, :, near * block:].to(acc), v[:, :, near * block:].to(acc)  # local and own keys, in place
        qs = qg * scale
        s = qs @ kt.transpose(-1, -2)
        if L:
            blocks_k = k[:, :, :near * block].reshape(b, hk, near, block * d)
            blocks_v = v[:, :, :near * block].reshape(b, hk, near, block * d)
            kg = blocks_of(blocks_k, ids).view(b, hk, L * block, d).to(acc)
            vg = blocks_of(blocks_v, ids).view(b, hk, L * block, d).to(acc)
            sg = (qs @ kg.transpose(-1, -2)).view(b, hk, g, L, block)
            sg = sg.masked_fill(~valid.view(b, hk, 1, L, 1), float("-inf"))  # pads, listed-twice, too few ranked
            s = torch.cat([sg.view(b, hk, g, L * block), s], -1)  # [b, hk, g, L * block + local keys]
        top = s.amax(-1, keepdim=True)  # the step's own key is always there: finite
        p = torch.exp(s - top)
        total = p.sum(-1, keepdim=True)
        out = p[..., L * block:] @ vt
        if L:
            out = out + p[..., :L * block] @ vg
        out = (out / total).reshape(b, hq, 1, d).to(q.dtype)
        lse = (top + total.log()).reshape(b, hq, 1).float() if need_lse else None
        read = valid.sum() * block if L else 0  # a device count: no host sync
    state["work"] = {"step_keys": read + b * hk * (n - near * block), "dense_keys": b * hk * n}
    return out, lse


def blocks_of(blocks: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """blocks [b, hk, nb, block * d] (a view of the cache), ids [b, hk, L] -> [b, hk, L, block * d]: each listed
    block one row copy, by an index_select per KV head into one buffer (here ~5x faster than an advanced index
    over [b, hk, blocks], and torch.gather would index every element)."""
    b, hk = ids.shape[:2]
    out = blocks.new_empty(b, hk, ids.shape[-1], blocks.shape[-1])
    for bi in range(b):
        for hi in range(hk):
            torch.index_select(blocks[bi, hi], 0, ids[bi, hi], out=out[bi, hi])
    return out
