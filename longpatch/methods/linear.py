"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs"), and the feature-space
engine it shares with the Performer (``performer.py``).

With a feature map φ (here elu(x) + 1, positive everywhere) the attention of query i is

    out_i = φ(q_i)ᵀ S / φ(q_i)ᵀ z,   S = Σ_j φ(k_j) v_jᵀ  [m, dv],   z = Σ_j φ(k_j)  [m]

over the keys j the query sees. Non-causal: one S, z per KV head (two GEMMs). Causal: S and z are
prefix sums, computed in chunks of C positions so that nothing is n x n and nothing loops over
positions in Python:

* within a chunk, the C x C block of scores φ(Q_c) φ(K_c)ᵀ with the causal mask (exact, small);
* across chunks, each chunk's summary K_cᵀ V_c [m, dv], the state before each chunk (an exclusive
  prefix sum over chunks), and one GEMM Q_c · S_<c per chunk (all chunks of a segment batched).

That is the readable twin of the Triton kernel ``longpatch.kernels.linear.causal_prefix_attention``; both
return the numerator and the denominator separately (float32), with an optional prefix state
(S0, z0) that every query sees (keys before the square: decoding, or bottom-right causal
attention with q_len < kv_len).

Decoding keeps (S, z) in the patched layer's ``state`` (the RNN form): a step folds the new keys in
and costs O(m·dv) per head, whatever the cache length. A fingerprint of a few cached rows checks
that the cache is still the one the sums were built from (beam reordering, a new sequence or a
cropped cache trigger a rebuild in one pass).

GQA: key features, S and z are per KV head; the query heads of a group read them through views.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .base import Method, no_exact_params, one_of, register_method
from .common import (
    acc_dtype,
    check_qkv,
    default_scale,
    group_queries,
    guards_nonfinite,
    probe_positions,
    resolve_backend,
)

DEFAULT_CHUNK = 64
# Chunk summaries materialised at once (elements of [chunks, m, dv] over batch*heads): bounds the
# memory of the prefix; segments beyond that run one after another, carrying the state.
_SEGMENT_ELEMS = 1 << 23
_SEGMENT_CHUNKS = 16  # the prefix over a segment is a (c x c+1) GEMM: small c keeps it a minor cost
FEATURE_MAPS = ("elu+1", "relu")
_RELU_EPS = 1e-6  # relu features may give a zero denominator; elu+1 never does


# --------------------------------------------------------------------------- feature maps

def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = elu(x) + 1: positive, so the normaliser φ(q)ᵀz never vanishes (the paper's choice)."""
    return F.elu(x.to(acc_dtype(x.dtype))) + 1.0


def linear_features(x: torch.Tensor, feature_map: str) -> torch.Tensor:
    if feature_map == "elu+1":
        return elu_plus_one(x)
    if feature_map == "relu":
        return F.relu(x.to(acc_dtype(x.dtype))) + _RELU_EPS
    raise ValueError(f"feature_map must be one of {', '.join(FEATURE_MAPS)}; got {feature_map!r}")


# --------------------------------------------------------------------------- the engine: features in, (num, den) out

def prefix_sums(kf: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S = kfᵀ v [b, hk, m, dv] and z = Σ kf [b, hk, m] over all rows (accumulation dtype)."""
    kf = kf.to(acc_dtype(kf.dtype))
    return torch.matmul(kf.transpose(-1, -2), v.to(kf.dtype)), kf.sum(-2)


def readout(qf: torch.Tensor, S: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerator [b, hq, n, dv] and denominator [b, hq, n] of queries that see all of (S, z)."""
    b, hq, n, _ = qf.shape
    qg = group_queries(qf.to(S.dtype), S.shape[1])  # the group's heads share S, z (views, no repeat)
    num = torch.matmul(qg, S.unsqueeze(2))
    den = torch.matmul(qg, z.unsqueeze(2).unsqueeze(-1)).squeeze(-1)
    return num.reshape(b, hq, n, -1), den.reshape(b, hq, n)


def causal_prefix_reference(qf, kf, v, s0=None, z0=None, chunk_size: int | None = None):
    """Causal linear attention in feature space, chunked; the PyTorch twin of the Triton kernel.

    qf [b, hq, n, m] (query features), kf [b, hk, n, m], v [b, hk, n, dv]: query i sees keys
    j <= i of this square, plus the optional prefix state s0 [b, hk, m, dv], z0 [b, hk, m].
    Returns (num [b, hq, n, dv], den [b, hq, n]) in float32 (float64 for float64 inputs).
    """
    b, hq, n, m = qf.shape
    hk, dv = kf.shape[1], v.shape[-1]
    g = hq // hk
    acc = acc_dtype(qf.dtype)
    C = max(1, min(chunk_size or DEFAULT_CHUNK, n))
    nc = -(-n // C)
    pad = nc * C - n
    qf, kf = qf.to(acc), kf.to(acc)
    # a ones column appended to V carries the normaliser z through the same GEMMs as S
    va = torch.cat([v.to(acc), torch.ones(*v.shape[:-1], 1, dtype=acc, device=v.device)], -1)
    if pad:  # zero features of padded keys contribute nothing; padded query rows are cut below
        qf, kf, va = (F.pad(t, (0, 0, 0, pad)) for t in (qf, kf, va))
    qc = qf.view(b, hk, g, nc, C, m)
    kc = kf.view(b, hk, nc, C, m)
    vc = va.view(b, hk, nc, C, dv + 1)
    state = torch.zeros(b, hk, m, dv + 1, dtype=acc, device=qf.device)
    if s0 is not None:
        z0 = torch.zeros(b, hk, m, dtype=acc, device=qf.device) if z0 is None else z0
        state = torch.cat([s0.to(acc), z0.to(acc).unsqueeze(-1)], -1)
    tril = torch.ones(C, C, dtype=torch.bool, device=qf.device).tril()
    per_seg = max(1, min(_SEGMENT_CHUNKS, _SEGMENT_ELEMS // max(1, b * hk * m * (dv + 1))))
    outs = []
    for s in range(0, nc, per_seg):
        e = min(nc, s + per_seg)
        q_s, k_s, v_s = qc[:, :, :, s:e], kc[:, :, s:e], vc[:, :, s:e]
        c = e - s
        kv = torch.matmul(k_s.transpose(-1, -2), v_s)  # [b, hk, c, m, dv+1]: each chunk's summary
        # the state before chunk i is state + Σ_{j<i} kv_j: one GEMM of a c x (c+1) 0/1 matrix with
        # [state, kv_0, ..., kv_{c-1}] (a cumsum over a middle dimension is far slower on CPU)
        stacked = torch.cat([state.unsqueeze(2), kv], 2).flatten(-2)  # [b, hk, c+1, m*(dv+1)]
        steps = torch.ones(c, c + 1, dtype=acc, device=qf.device).tril()
        before = torch.matmul(steps, stacked).view(b, hk, c, m, dv + 1)
        scores = torch.matmul(q_s, k_s.unsqueeze(2).transpose(-1, -2)).masked_fill_(~tril, 0.0)  # [b,hk,g,c,C,C]
        outs.append(torch.matmul(scores, v_s.unsqueeze(2)) + torch.matmul(q_s, before.unsqueeze(2)))
        state = before[:, :, -1] + kv[:, :, -1]
    out = torch.cat(outs, 3).reshape(b, hq, nc * C, dv + 1)[:, :, :n]
    num, den = out[..., :dv], out[..., dv]
    return num, den


def causal_prefix(qf, kf, v, s0=None, z0=None, *, backend: str = "torch", chunk_size: int | None = None):
    """``causal_prefix_reference`` or, with backend 'triton', the kernel (forward and backward;
    float64 stays on the PyTorch path)."""
    if backend == "triton" and qf.dtype != torch.float64:
        from ..kernels.linear import causal_prefix_attention  # lazily: triton is optional
        return causal_prefix_attention(qf, kf, v, s0, z0)
    return causal_prefix_reference(qf, kf, v, s0, z0, chunk_size)


def finish(num: torch.Tensor, den: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """num / den in the caller's dtype. A zero denominator (every feature underflowed, or relu
    features of a query that matches nothing) gives a zero row instead of NaN."""
    den = torch.where(den == 0, torch.ones_like(den), den)
    return (num / den.unsqueeze(-1)).to(dtype)


def feature_attention(qf, kf, v, *, causal: bool, backend: str = "torch"):
    """Attention in feature space on the shared layout (queries are the last nq of nk positions).
    Returns (num, den) float32."""
    nq, nk = qf.shape[2], kf.shape[2]
    if not causal:
        return readout(qf, *prefix_sums(kf, v))
    p = nk - nq  # keys every query sees (bottom-right alignment): a prefix state
    s0, z0 = prefix_sums(kf[:, :, :p], v[:, :, :p]) if p > 0 else (None, None)
    return causal_prefix(qf, kf[:, :, p:], v[:, :, p:], s0, z0, backend=backend)


# --------------------------------------------------------------------------- decode state

KeyFeaturizer = Callable[[torch.Tensor, "torch.Tensor | None"], "tuple[torch.Tensor, torch.Tensor | None]"]


def _fingerprint(k: torch.Tensor, v: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor]:
    pos = probe_positions(n)
    idx = torch.tensor(pos, dtype=torch.long, device=k.device)
    return pos, torch.cat([k.index_select(2, idx), v.index_select(2, idx)], -1)


def _state_usable(state: dict, k: torch.Tensor, v: torch.Tensor, tag) -> bool:
    """Do the sums in ``state`` belong to the first state['length'] rows of this cache?"""
    n = state.get("length")
    if n is None or n > k.shape[2] or not _same_tag(state.get("tag"), tag):
        return False
    S = state["S"]
    if S.shape[:2] != k.shape[:2] or S.device != k.device or state["fp"].dtype != k.dtype:
        return False
    if n == 0:
        return True
    pos, rows = _fingerprint(k, v, n)
    return pos == state["fp_pos"] and torch.equal(rows, state["fp"])


def _same_tag(a, b) -> bool:
    """Tags are tuples that may hold tensors (a Performer projection): compared by value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and a.device == b.device and torch.equal(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_tag(x, y) for x, y in zip(a, b))
    return a == b


def _save(state: dict, S, z, shift, k, v, n: int, tag) -> None:
    pos, rows = _fingerprint(k, v, n) if n else ([], k[:, :, :0])
    state.update(S=S.detach(), z=z.detach(), shift=None if shift is None else shift.detach(), length=n,
                 fp_pos=pos, fp=rows.detach(), tag=tag)


def _rescale(S, z, shift_old, shift_new):
    """Sums stored as true·exp(-shift_old) -> true·exp(-shift_new) (shift_new >= shift_old)."""
    if shift_old is None or shift_new is None:
        return S, z
    f = torch.exp(shift_old - shift_new)  # [b, hk]
    return S * f[..., None, None], z * f[..., None]


def _fold(S, z, shift, featurize: KeyFeaturizer, k, v):
    """Add rows k, v to the sums (S, z) stored relative to ``shift``; returns the new triple."""
    kf, new_shift = featurize(k, shift)
    S, z = _rescale(S, z, shift, new_shift)
    dS, dz = prefix_sums(kf, v)
    return S + dS, z + dz, new_shift


def stateful_attention(qf, k, v, featurize: KeyFeaturizer, *, state: dict, tag=None,
                       backend: str = "torch"):
    """Causal attention in feature space with (S, z) carried across calls in ``state``.

    qf: query features [b, hq, nq, m]; k, v: the whole cache [b, hk, nk, d] (queries are its
    last nq positions). ``featurize(k_rows, floor)`` returns the key features and the stabiliser
    they are relative to (per (batch, KV head), at least ``floor``; None for maps without one).
    ``tag`` identifies what the sums depend on besides the cache (e.g. the projection): a change
    rebuilds them. The state ends up covering all nk keys.
    Returns (num, den) float32.
    """
    nq, nk = qf.shape[2], k.shape[2]
    usable = _state_usable(state, k, v, tag)
    if usable and nq == 1 and state["length"] == nk:  # the sums already include this query's keys
        return readout(qf, state["S"], state["z"])
    p = nk - nq
    b, hk, m, dv = k.shape[0], k.shape[1], qf.shape[-1], v.shape[-1]
    acc = acc_dtype(qf.dtype)
    if usable and state["length"] <= p:
        S, z, shift, start = state["S"], state["z"], state["shift"], state["length"]
    else:
        S = torch.zeros(b, hk, m, dv, dtype=acc, device=k.device)
        z = torch.zeros(b, hk, m, dtype=acc, device=k.device)
        shift, start = None, 0
    if start < p:
        S, z, shift = _fold(S, z, shift, featurize, k[:, :, start:p], v[:, :, start:p])
    if nq == 1:  # one new token (the RNN step): fold its key in, read the query out
        S, z, shift = _fold(S, z, shift, featurize, k[:, :, p:], v[:, :, p:])
        num, den = readout(qf, S, z)
    else:
        kf, new_shift = featurize(k[:, :, p:], shift)
        S, z = _rescale(S, z, shift, new_shift)
        num, den = causal_prefix(qf, kf, v[:, :, p:], S, z, backend=backend)
        dS, dz = prefix_sums(kf.detach(), v[:, :, p:].detach())
        S, z, shift = S + dS, z + dz, new_shift
    _save(state, S, z, shift, k.detach(), v.detach(), nk, tag)
    return num, den


def build_state(k, v, featurize: KeyFeaturizer, tag=None) -> dict:
    """A decode state covering every row of the cache k, v, in one pass."""
    n = k.shape[2]
    kf, shift = featurize(k, None)
    S, z = prefix_sums(kf, v)
    state: dict = {}
    _save(state, S, z, shift, k, v, n, tag)
    return state


# --------------------------------------------------------------------------- the op

def _check_feature_map(feature_map) -> None:
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {', '.join(FEATURE_MAPS)}; got {feature_map!r}")


@guards_nonfinite
def linear_attention(q, k, v, *, causal: bool = True, scale: float | None = None, feature_map: str = "elu+1",
                     return_lse: bool = False, backend: str = "auto"):
    """Linear attention φ(q)ᵀ Σ φ(k_j) v_jᵀ / φ(q)ᵀ Σ φ(k_j) on the shared layout.

    q [b, hq, nq, d], k/v [b, hk, nk, d] (GQA by views), queries the last nq positions (causal:
    bottom-right). ``feature_map``: "elu+1" (the paper's) or "relu". ``scale`` is accepted for the
    common signature and checked by the common rule (a positive finite number or None) but has no
    effect: this kernel has no temperature (it is not a softmax).
    There is no softmax LSE: ``return_lse=True`` is an error. Returns out [b, hq, nq, dv] in q's dtype.
    """
    check_qkv(q, k, v, causal, value_dim=True)
    default_scale(scale, q.shape[-1])  # the one rule of every op, though this kernel has no temperature
    _check_feature_map(feature_map)
    if return_lse:
        raise ValueError("linear_attention has no softmax log-sum-exp (return_lse is not supported)")
    backend = resolve_backend(backend, q, k, v)
    if q.shape[2] == 0 or k.shape[2] == 0:
        return q.new_zeros(q.shape[:3] + (v.shape[-1],))
    num, den = feature_attention(linear_features(q, feature_map), linear_features(k, feature_map), v,
                                 causal=causal, backend=backend)
    return finish(num, den, q.dtype)


# --------------------------------------------------------------------------- registration

def _featurizer(feature_map: str) -> KeyFeaturizer:
    return lambda k, floor: (linear_features(k, feature_map), None)


def _run(q, k, v, *, causal=True, scale=None, backend="auto", buffers=None, state=None, feature_map="elu+1", **_):
    if state is None or not causal:
        return linear_attention(q, k, v, causal=causal, feature_map=feature_map, backend=backend)
    check_qkv(q, k, v, causal, value_dim=True)
    backend = resolve_backend(backend, q, k, v)
    if q.shape[2] == 0 or k.shape[2] == 0:
        return q.new_zeros(q.shape[:3] + (v.shape[-1],))
    num, den = stateful_attention(linear_features(q, feature_map), k, v, _featurizer(feature_map), state=state,
                                  tag=("linear", feature_map), backend=backend)
    return finish(num, den, q.dtype)


def init_state(k, v, *, feature_map: str = "elu+1", **_) -> dict:
    """Decode state (S, z) of a layer from an existing KV cache, in one pass."""
    _check_feature_map(feature_map)
    return build_state(k, v, _featurizer(feature_map), tag=("linear", feature_map))


LINEAR = register_method(Method(
    name="linear",
    summary="linear attention (Katharopoulos et al.): elu(x)+1 features, chunked causal prefix sums, "
            "RNN decode with O(d²) per token",
    prefill=_run,
    decode=_run,
    params={
        "feature_map": one_of("feature map φ applied to queries and keys", "elu+1", FEATURE_MAPS),
    },
    stateful=True,
    init_state=init_state,
    exact_params=no_exact_params,  # no feature map makes it softmax attention
))
