"""MoBA's registration: the decode state (chunk means kept beside the KV cache) and the Method."""
from __future__ import annotations

import math

import torch

from ...errors import ConfigError
from ..base import Method, Param, nonneg_int, one_of, positive_int, register_method
from ..common import default_scale, dense_pairs, window_summaries
from ..paged import StepSpec
from ..selection import (
    SCORINGS,
    check_applicable,
    check_stride_config,
    estimate_params,
    estimated_pairs,
    final_count,
    off_grid_rows,
    page_size,
    scoring_of,
)
from .cpu import DEFAULT_CHUNK_SIZE, DEFAULT_TOPK, moba_chunk_means
from .op import SELECTIONS, moba_attention

# --------------------------------------------------------------------------- decode state

def _state_means(state: dict, k: torch.Tensor, C: int) -> torch.Tensor:
    """Means of every full chunk of the cache ``k``, kept in ``state`` and extended when a chunk
    fills (``common.window_summaries``: each chunk mean is computed once, rebuilt for another cache)."""
    return window_summaries(state, ("means",), k, None, C, C, lambda kk, _: (moba_chunk_means(kk, C),))[0]


def init_state(k, v, *, chunk_size: int = DEFAULT_CHUNK_SIZE, **_) -> dict:
    """Decode state of a layer from an existing KV cache in one pass (the chunk means)."""
    state: dict = {}
    _state_means(state, k, chunk_size)
    return state


def _run(q, k, v, *, causal=True, scale=None, backend="auto", buffers=None, state=None,
         chunk_size=DEFAULT_CHUNK_SIZE, topk=DEFAULT_TOPK, shared_selection=False, selection="gate", mass=None,
         estimate_queries=64, score_stride=16, local_blocks=1, decode_topk=8, decode_page=None, max_share=None,
         final_topk=None, decode_prefill=True, **_):
    if selection != "gate":  # its decode state is the prefill's chunk list, not chunk means
        return moba_attention(q, k, v, causal=causal, scale=scale, chunk_size=chunk_size, topk=topk,
                              selection=selection, mass=mass, estimate_queries=estimate_queries,
                              score_stride=score_stride, local_blocks=local_blocks, decode_topk=decode_topk,
                              decode_page=decode_page, max_share=max_share, final_topk=final_topk,
                              decode_prefill=decode_prefill, state=state, backend=backend)
    means = None
    if state is not None and causal:
        means = _state_means(state, k.detach(), chunk_size)
    return moba_attention(q, k, v, causal=causal, scale=scale, chunk_size=chunk_size, topk=topk,
                          shared_selection=shared_selection, chunk_means=means, backend=backend)


def _exact_when(q_len: int, kv_len: int, params: dict) -> bool:
    """Where moba_attention short-cuts to exact attention: top-k covers every chunk (and, with a query-aware
    selection, a call of a few queries none of which reaches a chunk start)."""
    C = params["chunk_size"]
    off_grid = params.get("selection", "gate") != "gate" and 1 < q_len == off_grid_rows(q_len, kv_len, C)
    return off_grid or params["topk"] >= math.ceil(kv_len / C)


def _exact_params(n: int, params: dict) -> dict:
    return {"topk": max(params["topk"], math.ceil(n / params["chunk_size"]))}


def _pairs(q, k, causal: bool, params: dict) -> int | None:
    """Query-key products of a causal prefill (None otherwise): the gate (one per query and past chunk) and, per query,
    its own chunk up to itself and topk - 1 full past chunks (fewer where fewer exist); or the
    estimated selection's count (``selection.estimated_pairs``)."""
    n, C, topk = q.shape[2], params["chunk_size"], params["topk"]
    heads = q.shape[0] * q.shape[1]
    if not causal or k.shape[2] != n:
        return None
    if topk >= math.ceil(n / C):
        return dense_pairs(q.shape, n, True)
    if params["selection"] != "gate":
        scoring = scoring_of(params["selection"], params["estimate_queries"], params["score_stride"])
        return estimated_pairs(q, k, C, topk - 1, params["mass"], scoring, params["local_blocks"],
                               default_scale(None, q.shape[-1]), final_topk=final_count(params),
                               max_share=params["max_share"])
    t = torch.arange(n)
    past = t // C
    return heads * int((t % C + 1 + past + torch.clamp(past, max=topk - 1) * C).sum())


def _chunk_block(params: dict) -> int | None:
    """The query-aware selections choose per query chunk: a prefill chunk starts on a chunk (the gate, per query,
    takes any chunk)."""
    return None if params["selection"] == "gate" else params["chunk_size"]


def _reads_quantized(params: dict) -> bool:
    """Whether these params' one-token step reads an 8-bit cache in place: the query-aware selections'."""
    return _chunk_block(params) is not None


def _couples_heads(params: dict) -> bool:
    """The query heads of a KV group select chunks together: shared_selection (the sum of their gate
    scores) and the query-aware selections (estimated per group)."""
    return params["shared_selection"] or params["selection"] != "gate"


def _graph_step(params: dict, n: int) -> StepSpec | None:
    """The query-aware selections' one-token step as a graph-safe step (paged.py); the gate has none."""
    if params["selection"] == "gate":
        return None
    C = params["chunk_size"]
    return StepSpec(block=C, page=page_size(params["decode_page"], C), decode_topk=params["decode_topk"],
                    local_blocks=params["local_blocks"])


class _MoBAMethod(Method):
    """Checks that the antidiagonal scoring's tiles fit the chunks at config time."""

    def resolve_params(self, given):
        params = super().resolve_params(given)
        check_stride_config("moba", params, "chunk_size")
        check_applicable(self, params, {"local_blocks": SCORINGS})
        need = 2 + params["local_blocks"]  # the first chunk, the local ones and the own chunk
        if params["selection"] in SCORINGS and params["topk"] < need:
            raise ConfigError(f"params.topk of method 'moba': got {params['topk']}; with selection "
                              f"'{params['selection']}' every chunk's list holds the first chunk and the "
                              f"{params['local_blocks']} before its own (local_blocks), which with the own chunk need "
                              f"topk >= {need}; allowed: topk >= {need}, or fewer local_blocks")
        return params


MOBA = register_method(_MoBAMethod(
    name="moba",
    summary="MoBA: each query attends to its own chunk + the top-k past chunks by q·mean(chunk keys)",
    prefill=_run,
    decode=_run,
    params={
        "chunk_size": positive_int("keys per chunk (the gate scores one mean key per chunk)", DEFAULT_CHUNK_SIZE),
        "topk": positive_int("chunks each query attends to, its own chunk included (1 = own chunk only)",
                             DEFAULT_TOPK),
        "shared_selection": Param(False, (bool,), "query heads of a KV group select chunks together "
                                  "(sum of their gate scores)"),
        "selection": one_of("'gate': the paper's q·mean(chunk keys) per query; query-aware (group-shared, per "
                            "query chunk): 'estimate', from the last queries' exact attention per chunk, or "
                            "'antidiagonal', from strided antidiagonals of the score matrix, or 'hybrid', both: "
                            "per query chunk its own antidiagonal chunks and the chunks the last queries read",
                            "gate", SELECTIONS),
        **estimate_params("chunk", "topk"),
        "local_blocks": nonneg_int("estimate/antidiagonal/hybrid only: chunks before the own one always attended", 1),
    },
    stateful=True,
    init_state=init_state,
    exact_when=_exact_when,
    exact_params=_exact_params,
    attended_pairs=_pairs,
    couples_heads=_couples_heads,
    graph_step=_graph_step,
    chunk_block=_chunk_block,
    # the query-aware selections' step: bounds, listed blocks and window read from the 8-bit rows
    reads_quantized=_reads_quantized,
))
