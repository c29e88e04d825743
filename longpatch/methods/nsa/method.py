"""NSA's registration: the decode state (the compressed K/V, extended as blocks complete) and the
Method with its parameter checks."""
from __future__ import annotations

import math

import torch

from ...errors import ConfigError, shown
from ..base import Method, Param, nonneg_int, one_of, positive_int, register_method
from ..common import default_scale, window_summaries
from ..paged import StepSpec
from ..selection import (
    check_applicable,
    check_stride_config,
    estimate_params,
    estimated_pairs,
    final_count,
    off_grid_rows,
    page_size,
    scoring_of,
)
from .blocks import DEFAULTS, TRAINING_FREE_GATES, check_params, fit_params, nsa_compress, visible_cmp
from .op import SELECTIONS, nsa_attention

# --------------------------------------------------------------------------- decode state and method

def _state_compressed(state: dict, k, v, l: int, s: int):
    """Compressed K/V of every complete block of the cache, kept in ``state`` and extended as blocks
    complete (``common.window_summaries``: each block is pooled once, rebuilt for another cache)."""
    return window_summaries(state, ("k_cmp", "v_cmp"), k, v, l, s,
                            lambda kk, vv: nsa_compress(kk, vv, compress_block=l, compress_stride=s))


def init_state(k, v, *, compress_block: int = 32, compress_stride: int = 16, **_) -> dict:
    """Decode state of a layer from an existing KV cache in one pass (its compressed K/V)."""
    state: dict = {}
    _state_compressed(state, k.detach(), v.detach(), compress_block, compress_stride)
    return state


def _run(q, k, v, *, causal=True, scale=None, backend="auto", buffers=None, state=None, gates=TRAINING_FREE_GATES,
         selection="compressed", mass=None, estimate_queries=64, score_stride=16, decode_topk=8, decode_page=None,
         max_share=None, final_topk=None, decode_prefill=True, **params):
    if selection != "compressed":  # its decode state is the prefill's block list, not compressed K/V
        return nsa_attention(q, k, v, causal=causal, scale=scale, gates=tuple(gates), backend=backend,
                             selection=selection, mass=mass, estimate_queries=estimate_queries,
                             score_stride=score_stride, decode_topk=decode_topk, decode_page=decode_page,
                             max_share=max_share, final_topk=final_topk, decode_prefill=decode_prefill,
                             state=state, **params)
    compressed = None
    if state is not None and causal:
        l, s = params["compress_block"], params["compress_stride"]
        compressed = _state_compressed(state, k.detach(), v.detach(), l, s)
    return nsa_attention(q, k, v, causal=causal, scale=scale, gates=tuple(gates), compressed=compressed,
                         backend=backend, **params)


_SIZES = ("compress_block", "compress_stride", "select_block", "num_selected", "window", "init_blocks", "local_blocks")


def _graph_step(params: dict, n: int) -> StepSpec | None:
    """The query-aware selections' one-token step as a graph-safe step (paged.py): the selected blocks and
    the window, gated. None for the compressed selection, and after a prefill too short for the params'
    sizes (``fit_params`` shrinks them there, and an eager step would grow them again as the cache grows)."""
    if params["selection"] == "compressed":
        return None
    asked = tuple(params[name] for name in _SIZES)
    if fit_params(n, *asked) != asked:
        return None
    sb, gates = params["select_block"], params["gates"]
    return StepSpec(block=sb, page=page_size(params["decode_page"], sb), decode_topk=params["decode_topk"],
                    local_blocks=max(0, params["local_blocks"] - 1), window=params["window"] if gates[2] else 0,
                    gates=(float(gates[1]), float(gates[2])))


def _chunk_block(params: dict) -> int | None:
    """The query-aware selections choose per query block: a prefill chunk starts on a select block (the
    compressed selection, per query, takes any chunk)."""
    return None if params["selection"] == "compressed" else params["select_block"]


def _reads_quantized(params: dict) -> bool:
    """Whether these params' one-token step reads an 8-bit cache in place: the query-aware selections'."""
    return _chunk_block(params) is not None


def _exact_when(q_len: int, kv_len: int, params: dict) -> bool:
    """Where nsa_attention runs exact attention: with a query-aware selection, a call of a few queries against
    a longer cache none of which reaches a select block start."""
    if params["selection"] == "compressed":
        return False
    sb = fit_params(kv_len, *(params[name] for name in _SIZES))[2]
    return 1 < q_len == off_grid_rows(q_len, kv_len, sb)


def _gates_ok(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) == 3 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in x)


def _pint(name, doc):
    return positive_int(doc, DEFAULTS[name])


def _nonneg(name, doc):
    return nonneg_int(doc, DEFAULTS[name])


def _exact_params(n: int, params: dict) -> dict:
    """The selected and window branches each see every visible key, and the compressed branch (mean
    keys: never exact) is gated off; the output is then g_slc * exact + g_win * exact = exact."""
    return {"num_selected": max(params["num_selected"], math.ceil(n / params["select_block"])),
            "window": max(params["window"], n), "gates": list(TRAINING_FREE_GATES)}


def _pairs(q, k, causal: bool, params: dict) -> int | None:
    """Query-key products of a causal prefill (None otherwise), per query head summed. The paper's
    selection: per query t, the compressed blocks it sees (scored to rank the blocks, whatever the
    compressed gate), its selected blocks (num_selected, the own one up to t; all keys up to t when
    fewer blocks exist) and its window; where the window holds the local blocks, their keys are
    computed once for both branches (the fast path's sharing) and counted once. A query-aware
    selection: its estimate and executor pairs (``selection.estimated_pairs``) plus the window."""
    n = q.shape[2]
    if not causal or k.shape[2] != n:
        return None
    heads = q.shape[0] * q.shape[1]
    t = torch.arange(n)
    sb, S, W, lb = params["select_block"], params["num_selected"], params["window"], params["local_blocks"]
    window = torch.clamp(t + 1, max=W)
    if params["selection"] != "compressed":
        scoring = scoring_of(params["selection"], params["estimate_queries"], params["score_stride"])
        return estimated_pairs(q, k, sb, S - 1, params["mass"], scoring, max(0, lb - 1),
                               default_scale(None, q.shape[-1]), params["init_blocks"],
                               final_count(params), params["max_share"]) + heads * int(window.sum())
    cmp = visible_cmp(t, params["compress_block"], params["compress_stride"])
    selected = torch.where(t // sb + 1 <= S, t + 1, (S - 1) * sb + t % sb + 1)
    shared = torch.clamp(t + 1, max=(lb - 1) * sb + t % sb + 1) if lb > 0 and W >= sb * lb else torch.zeros_like(t)
    return heads * int((cmp + selected + window - shared).sum())


class _NSAMethod(Method):
    """Checks the relations between parameters (stride <= block, forced blocks fit) at config time."""

    def resolve_params(self, given):
        params = super().resolve_params(given)
        blocks = {n: params[n] for n in ("compress_block", "compress_stride", "select_block", "num_selected", "window",
                                         "init_blocks", "local_blocks")}
        try:
            check_params(**blocks)
        except ValueError as e:
            raise ConfigError(f"params of method 'nsa': {e}") from None
        if params["selection"] != "compressed" and params["gates"][0] != 0:
            raise ConfigError(f"params.gates of method 'nsa': got {shown(params['gates'])}; selection "
                              f"'{params['selection']}' has no compressed branch: allowed: g_cmp = 0, e.g. "
                              "[0.0, 0.75, 0.25]")
        check_stride_config("nsa", params, "select_block")
        check_applicable(self, params)
        return params


NSA = register_method(_NSAMethod(
    name="nsa",
    summary="NSA: gated sum of compressed-block, selected-block (top-k by compressed scores) and window attention",
    prefill=_run,
    decode=_run,
    params={
        "compress_block": _pint("compress_block", "keys per compressed block (mean-pooled)"),
        "compress_stride": _pint("compress_stride", "stride between compressed blocks (<= compress_block)"),
        "select_block": _pint("select_block", "keys per selection block"),
        "num_selected": _pint("num_selected", "selection blocks per query, forced init/local blocks included"),
        "window": _pint("window", "sliding-window length in keys"),
        "init_blocks": _nonneg("init_blocks", "first selection blocks always selected"),
        "local_blocks": _nonneg("local_blocks", "selection blocks ending with the query's own block, always selected"),
        "gates": Param(list(TRAINING_FREE_GATES), (list, tuple),
                       "fixed gates [g_cmp, g_slc, g_win] of the training-free mode (default measured: docs/nsa.md)",
                       _gates_ok, "a list of 3 finite numbers >= 0"),
        "selection": one_of("'compressed': blocks ranked by the compressed branch's attention (the paper's); "
                            "query-aware (needs g_cmp = 0): 'estimate', from the last queries' exact attention, "
                            "'antidiagonal', from strided antidiagonals of the score matrix, or 'hybrid', both: "
                            "per query block its own antidiagonal blocks and the blocks the last queries read",
                            "compressed", SELECTIONS),
        **estimate_params("block", "num_selected"),
    },
    causal_only=True,
    stateful=True,
    init_state=init_state,
    exact_params=_exact_params,
    exact_when=_exact_when,
    attended_pairs=_pairs,
    couples_heads=True,  # blocks are selected per KV group (the sum of its query heads' scores)
    graph_step=_graph_step,
    chunk_block=_chunk_block,
    # the query-aware selections' step: bounds, listed blocks and window read from the 8-bit rows
    reads_quantized=_reads_quantized,
))
