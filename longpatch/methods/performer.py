"""Performer / FAVOR+ (Choromanski et al. 2020, arXiv 2009.14794): softmax attention approximated
with random features, in linear time.

The softmax kernel exp(scale · q·k) = exp(x·y) with x = q·scale^½, y = k·scale^½ (d^-¼ each at
the default scale) is an expectation over ω ~ N(0, I_d):

* positive (FAVOR+, Lemma 1):  exp(ω·x − |x|²/2) · exp(ω·y − |y|²/2)
* hyperbolic (Lemma 1, lower variance, 2m features):  exp(−|x|²/2)/√2 · [exp(ω·x), exp(−ω·x)]
* trig (classic random Fourier features, 2m features):  exp(|x|²/2) · [sin ω·x, cos ω·x]

With m directions ω_1..ω_m stacked in a projection [m, d], φ(x)ᵀφ(y) / m is an unbiased estimate
of exp(x·y), and attention becomes linear attention in feature space (``linear.py``):
D̂⁻¹(Q'((K')ᵀV)), causal by chunked prefix sums.

Orthogonal features (the "O" of FAVOR+): the directions come in blocks of d that are exactly
orthogonal (QR of a Gaussian block, sign-fixed so the block is Haar-distributed), each row then
rescaled to an independent chi(d)-distributed norm, so every row is still marginally N(0, I_d)
(the estimate stays unbiased) while the rows of a block are dependent in the way that lowers the
variance. m > d stacks independent blocks.

Stabilisation (max subtraction) never changes the result, because a factor common to a query's
numerator and denominator cancels:

* a query row is divided by its own largest feature (trig: its exp(|x|²/2) amplitude is dropped);
* keys are divided by ONE factor exp(shift) per (batch, KV head), the largest key log-feature of
  the call. A per-key factor would not cancel. Across decode steps the sums (S, z) are kept
  relative to their shift; when new keys raise it, the sums are rescaled by exp(old − new), so
  decoding equals prefill.

The projection is a buffer of each patched layer (seeded from the config, not persistent); ``longpatch.redraw_buffers``
draws new ones, as the paper recommends when training.
"""
from __future__ import annotations

import functools
import math

import torch

from ..errors import ConfigError, check_int
from .base import Method, Param, no_exact_params, one_of, optional_int, positive_int, register_method
from .common import (
    acc_dtype,
    check_qkv,
    check_seed,
    default_scale,
    guards_nonfinite,
    layer_seed_of,
    resolve_backend,
)
from .linear import build_state, feature_attention, finish, stateful_attention

DEFAULT_SEED = 0  # seed=None gives these features: deterministic unless asked otherwise
DEFAULT_NUM_FEATURES = 256
# The most features per head dimension. FAVOR+ needs m = Θ(d log d) (≈ 4-7 d at d = 64..128; the default 256
# is 4 d at d = 64): 64 d leaves ample room, while a typo such as 1e6 would draw 1e6/d QRs and a [1e6, d]
# projection per layer (minutes and gigabytes while patching, then [n, 1e6] features per head and call).
MAX_FEATURES_PER_DIM = 64
FEATURE_TYPES = ("positive", "hyperbolic", "trig")


# --------------------------------------------------------------------------- random projections

def gaussian_projection(num_features: int, head_dim: int, *, seed: int | None = None, orthogonal: bool = True,
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """[num_features, head_dim] float32 directions ω, every row marginally N(0, I_d).

    orthogonal: rows in blocks of head_dim are exactly orthogonal, with chi(head_dim) norms drawn
    independently (ORF); else i.i.d. Gaussian rows. Drawn on the CPU from ``seed`` (None ->
    DEFAULT_SEED) or ``generator``, so every device gets the same features.
    """
    if num_features < 1 or head_dim < 1:
        raise ValueError(f"num_features and head_dim must be >= 1; got {num_features}, {head_dim}")
    if generator is None:
        generator = torch.Generator(device="cpu").manual_seed(DEFAULT_SEED if seed is None else int(seed))
    if not orthogonal:
        return torch.randn(num_features, head_dim, generator=generator, dtype=torch.float32)
    blocks = []
    for _ in range(-(-num_features // head_dim)):
        g = torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64)
        qm, r = torch.linalg.qr(g)
        # QR is unique only up to column signs; fixing them by sign(diag R) makes qm Haar-distributed,
        # hence every row uniformly oriented (what unbiasedness needs)
        qm = qm * torch.sign(torch.diagonal(r)).unsqueeze(0)
        norms = torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64).norm(dim=1)  # chi(d)
        blocks.append(qm.t() * norms.unsqueeze(1))
    return torch.cat(blocks)[:num_features].float()


# --------------------------------------------------------------------------- feature maps

def _check_feature_type(feature_type) -> None:
    if feature_type not in FEATURE_TYPES:
        raise ValueError(f"feature_type must be one of {', '.join(FEATURE_TYPES)}; got {feature_type!r}")


def _exponents(x: torch.Tensor, projection: torch.Tensor, hyperbolic: bool) -> torch.Tensor:
    """ω·x − |x|²/2 for every direction (and −ω·x − |x|²/2 too when hyperbolic), [.., n, m or 2m],
    as ONE addmm (the norms enter as its beta term): a separate pass subtracting them over [n, m]
    would cost about as much as the GEMM on a CPU."""
    w = projection.to(x.dtype)
    if hyperbolic:
        w = torch.cat([w, -w], 0)
    x2 = x.reshape(-1, x.shape[-1])
    half_sq = 0.5 * (x2 * x2).sum(-1, keepdim=True)
    out = torch.addmm(half_sq.expand(-1, w.shape[0]), x2, w.t(), beta=-1)
    return out.view(*x.shape[:-1], w.shape[0])


def _trig_parts(x: torch.Tensor, projection: torch.Tensor):
    """([sin ω·x, cos ω·x] [.., n, 2m], |x|²/2 [.., n, 1]): φ = parts · exp(|x|²/2)."""
    u = torch.matmul(x, projection.to(x.dtype).t())
    return torch.cat([torch.sin(u), torch.cos(u)], -1), 0.5 * (x * x).sum(-1, keepdim=True)


def _shift(logamp: torch.Tensor, stabilise: str, floor: torch.Tensor | None):
    """The stabiliser subtracted from the log-features: per row ("row"), one per leading index
    ("shared", at least ``floor``) or none. Detached: it cancels in D̂⁻¹(...), so it carries no
    gradient (and the features may then be computed in place)."""
    if stabilise == "none":
        return None, None
    la = logamp.detach()
    if stabilise == "row":
        return la.amax(-1, keepdim=True), None
    if stabilise != "shared":
        raise ValueError(f"stabilise must be 'none', 'row' or 'shared'; got {stabilise!r}")
    if la.shape[-2] == 0:
        shift = torch.zeros(la.shape[:-2], dtype=la.dtype, device=la.device)
    else:
        shift = la.flatten(-2).amax(-1)
    if floor is not None:
        shift = torch.maximum(shift, floor.to(shift.dtype))
    return shift[..., None, None], shift


def performer_features(x: torch.Tensor, projection: torch.Tensor, feature_type: str = "positive", *,
                       stabilise: str = "none", shift_floor: torch.Tensor | None = None):
    """Random features φ(x) with φ(x)ᵀφ(y) ≈ exp(x·y) (x already scaled by scale^½).

    x [..., n, d], projection [m, d]. stabilise: "none" (the plain unbiased features), "row"
    (each row divided by a factor of its own: for queries) or "shared" (one factor per leading
    index, e.g. (batch, head), at least ``shift_floor``: for keys). Returns (features [..., n, F],
    shift [...] or None): features = φ(x) · exp(-shift), F = m (positive) or 2m, float32
    (float64 for float64 x).
    """
    _check_feature_type(feature_type)
    x = x.to(acc_dtype(x.dtype))
    m = projection.shape[0]
    log_norm = -0.5 * math.log(m) - (0.5 * math.log(2.0) if feature_type == "hyperbolic" else 0.0)
    if feature_type == "trig":
        parts, logamp = _trig_parts(x, projection)
    else:
        parts, logamp = None, _exponents(x, projection, feature_type == "hyperbolic")
    offset, shift = _shift(logamp, stabilise, shift_floor)
    offset = -log_norm if offset is None else offset - log_norm
    if parts is None:
        return logamp.sub_(offset).exp_(), shift  # in place: the GEMM output is not needed for backward
    return parts * torch.exp(logamp - offset), shift


def softmax_kernel_estimate(x: torch.Tensor, y: torch.Tensor, projection: torch.Tensor,
                            feature_type: str = "positive") -> torch.Tensor:
    """φ(x)ᵀφ(y) for rows x [..., n, d], y [..., n', d]: the estimate of exp(x yᵀ) [..., n, n']."""
    fx, _ = performer_features(x, projection, feature_type)
    fy, _ = performer_features(y, projection, feature_type)
    return fx @ fy.transpose(-1, -2)


# --------------------------------------------------------------------------- the op

def check_num_features(num_features: int, head_dim: int) -> None:
    """At most MAX_FEATURES_PER_DIM x head_dim features (checked by the op and when a patch draws them)."""
    limit = MAX_FEATURES_PER_DIM * head_dim
    if num_features > limit:
        raise ConfigError(f"params.num_features of method 'performer': got {num_features}; allowed: an int in "
                          f"[1, {limit}] (at most {MAX_FEATURES_PER_DIM} x head_dim {head_dim}; FAVOR+ needs about "
                          "d·log d)")


def _check_args(num_features, feature_type, projection, d):
    check_int("performer_attention: num_features", num_features, 1)
    check_num_features(num_features, d)
    _check_feature_type(feature_type)
    if projection is not None and (projection.dim() != 2 or projection.shape[1] != d):
        raise ValueError(f"performer_attention: projection must be [num_features, head_dim={d}]; "
                         f"got {tuple(projection.shape)}")


@functools.lru_cache(maxsize=16)
def _seeded_projection(num_features: int, head_dim: int, seed: int | None, orthogonal: bool) -> torch.Tensor:
    # an op called without ``projection`` redraws the same seeded directions on every call (QRs
    # cost ~1 ms at m = 256, d = 64: as much as a decode step): keep the last few
    return gaussian_projection(num_features, head_dim, seed=seed, orthogonal=orthogonal)


def _prepare(x, scale, num_features, orthogonal, seed, projection):
    """(projection on x's device, scale^½): what turns q, k into the x, y of exp(x·y)."""
    d = x.shape[-1]
    if projection is None:
        projection = _seeded_projection(num_features, d, None if seed is None else int(seed), bool(orthogonal))
    root = math.sqrt(default_scale(scale, d))
    return projection.to(x.device), root


@guards_nonfinite
def performer_attention(q, k, v, *, causal: bool = True, scale: float | None = None,
                        num_features: int = DEFAULT_NUM_FEATURES, feature_type: str = "positive",
                        orthogonal: bool = True, seed: int | None = None, projection: torch.Tensor | None = None,
                        return_lse: bool = False, backend: str = "auto"):
    """FAVOR+ attention on the shared layout: an unbiased random-feature estimate of softmax
    attention, computed in O(n·m·d).

    q [b, hq, nq, d], k/v [b, hk, nk, d] (GQA by views), queries the last nq positions (causal:
    bottom-right). ``projection`` [m, d] (the patched layer's buffer) or, when None, directions
    from ``gaussian_projection(num_features, d, seed=seed, orthogonal=orthogonal)``; equal seeds
    give identical outputs. feature_type: "positive" (FAVOR+), "hyperbolic" or "trig".
    No softmax LSE exists here: ``return_lse=True`` is an error. Returns out [b, hq, nq, d].
    """
    check_qkv(q, k, v, causal, value_dim=True)
    _check_args(num_features, feature_type, projection, q.shape[-1])
    check_seed("performer_attention", seed)
    if return_lse:
        raise ValueError("performer_attention has no softmax log-sum-exp (return_lse is not supported)")
    backend = resolve_backend(backend, q, k, v)
    if q.shape[2] == 0 or k.shape[2] == 0:
        return q.new_zeros(q.shape[:3] + (v.shape[-1],))
    projection, root = _prepare(q, scale, num_features, orthogonal, seed, projection)
    qf, _ = performer_features(q * root, projection, feature_type, stabilise="row")
    kf, _ = performer_features(k * root, projection, feature_type, stabilise="shared")
    num, den = feature_attention(qf, kf, v, causal=causal, backend=backend)
    return finish(num, den, q.dtype)


# --------------------------------------------------------------------------- decode and registration

def _key_featurizer(projection, feature_type, root):
    def featurize(k, floor):
        return performer_features(k * root, projection, feature_type, stabilise="shared", shift_floor=floor)
    return featurize


def _tag(projection, feature_type, root):
    return ("performer", feature_type, root, projection)


def _run(q, k, v, *, causal=True, scale=None, backend="auto", buffers=None, state=None,
         num_features=DEFAULT_NUM_FEATURES, feature_type="positive", orthogonal=True, seed=None, **_):
    projection = (buffers or {}).get("projection")
    kw = dict(num_features=num_features, feature_type=feature_type, orthogonal=orthogonal, seed=seed)
    if state is None or not causal:
        return performer_attention(q, k, v, causal=causal, scale=scale, projection=projection, backend=backend, **kw)
    check_qkv(q, k, v, causal, value_dim=True)
    _check_args(num_features, feature_type, projection, q.shape[-1])
    backend = resolve_backend(backend, q, k, v)
    if q.shape[2] == 0 or k.shape[2] == 0:
        return q.new_zeros(q.shape[:3] + (v.shape[-1],))
    projection, root = _prepare(q, scale, num_features, orthogonal, seed, projection)
    qf, _ = performer_features(q * root, projection, feature_type, stabilise="row")
    num, den = stateful_attention(qf, k, v, _key_featurizer(projection, feature_type, root), state=state,
                                  tag=_tag(projection, feature_type, root), backend=backend)
    return finish(num, den, q.dtype)


def init_state(k, v, *, num_features=DEFAULT_NUM_FEATURES, feature_type="positive", orthogonal=True, seed=None,
               scale=None, buffers=None, **_) -> dict:
    """Decode state (S, z, key shift) of a layer from an existing KV cache, in one pass. The
    projection is ``buffers['projection']`` or the one ``make_buffers`` draws for these params."""
    _check_feature_type(feature_type)
    projection = (buffers or {}).get("projection")
    projection, root = _prepare(k, scale, num_features, orthogonal, seed, projection)
    return build_state(k, v, _key_featurizer(projection, feature_type, root), tag=_tag(projection, feature_type, root))


def _make_buffers(*, head_dim: int, num_features: int = DEFAULT_NUM_FEATURES, orthogonal: bool = True,
                  seed: int | None = None, layer_seed: int | None = None, **_):
    """{"projection": [num_features, head_dim]} from ``seed`` (None -> 0); an optional
    ``layer_seed`` gives each layer its own features."""
    check_num_features(num_features, head_dim)
    return {"projection": gaussian_projection(num_features, head_dim, seed=layer_seed_of(seed, layer_seed),
                                              orthogonal=orthogonal)}


PERFORMER = register_method(Method(
    name="performer",
    summary="Performer / FAVOR+: positive orthogonal random features approximate softmax in linear time; "
            "O(m·d) per decoded token",
    prefill=_run,
    decode=_run,
    params={
        "num_features": positive_int("random projections m (positive: m features; hyperbolic and trig: 2m)",
                                     DEFAULT_NUM_FEATURES),
        "feature_type": one_of("random feature map: positive (FAVOR+), hyperbolic or trig", "positive",
                               FEATURE_TYPES),
        "orthogonal": Param(True, (bool,), "orthogonal blocks of directions (ORF) instead of i.i.d. Gaussian ones"),
        "seed": optional_int("seed of the random projection (null -> 0)"),
    },
    make_buffers=_make_buffers,
    stateful=True,
    init_state=init_state,
    exact_params=no_exact_params,  # random features estimate softmax: no finite number of them is exact
))
