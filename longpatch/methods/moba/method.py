"""MoBA's registration: the decode state (chunk means kept beside the KV cache) and the Method."""
from __future__ import annotations

import math

import torch

from ..base import Method, Param, positive_int, register_method
from .cpu import DEFAULT_CHUNK_SIZE, DEFAULT_TOPK, moba_chunk_means
from .op import moba_attention

# --------------------------------------------------------------------------- decode state

def _state_means(state: dict, k: torch.Tensor, C: int) -> torch.Tensor:
    """Means of every full chunk of the cache ``k``, kept in ``state`` and extended when a chunk
    fills: each chunk mean is computed once. The key row closing each cached chunk is kept as a
    fingerprint; if the cache no longer holds those rows (a new sequence, beam reordering, a
    cropped cache) the means are rebuilt from the keys."""
    nf = k.shape[2] // C
    means, probe = state.get("means"), state.get("probe")
    ok = (means is not None and state.get("chunk_size") == C and means.shape[:2] == k.shape[:2]
          and means.shape[-1] == k.shape[-1] and means.device == k.device)
    if ok:
        m = min(means.shape[2], nf)
        ok = m == 0 or torch.equal(probe[:, :, :m], k[:, :, C - 1: m * C: C])
        means, probe = means[:, :, :m], probe[:, :, :m]
    if not ok:
        means, probe = moba_chunk_means(k[:, :, :0], C), k[:, :, :0]
    m = means.shape[2]
    if m < nf:
        means = torch.cat([means, moba_chunk_means(k[:, :, m * C: nf * C], C)], dim=2)
        probe = torch.cat([probe, k[:, :, m * C + C - 1: nf * C: C]], dim=2)
    state.update(means=means, probe=probe, chunk_size=C)
    return means


def init_state(k, v, *, chunk_size: int = DEFAULT_CHUNK_SIZE, **_) -> dict:
    """Decode state of a layer from an existing KV cache in one pass (the chunk means)."""
    state: dict = {}
    _state_means(state, k, chunk_size)
    return state


def _run(q, k, v, *, causal=True, scale=None, backend="auto", buffers=None, state=None,
         chunk_size=DEFAULT_CHUNK_SIZE, topk=DEFAULT_TOPK, shared_selection=False, **_):
    means = None
    if state is not None and causal:
        means = _state_means(state, k.detach(), chunk_size)
    return moba_attention(q, k, v, causal=causal, scale=scale, chunk_size=chunk_size, topk=topk,
                          shared_selection=shared_selection, chunk_means=means, backend=backend)


def _exact_when(q_len: int, kv_len: int, params: dict) -> bool:
    """Where moba_attention short-cuts to exact attention: top-k covers every chunk."""
    return params["topk"] >= math.ceil(kv_len / params["chunk_size"])


def _exact_params(n: int, params: dict) -> dict:
    return {"topk": max(params["topk"], math.ceil(n / params["chunk_size"]))}


MOBA = register_method(Method(
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
    },
    stateful=True,
    init_state=init_state,
    exact_when=_exact_when,
    exact_params=_exact_params,
))
