"""Shared test helpers: a dense attention oracle, logits of a model, a probe method that records its calls,
and scripts/*.py loaded as modules."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from longpatch.methods import Method, register_method
from longpatch.methods.base import Param
from longpatch.methods.exact import exact_attention


def dense_attention(q, k, v, causal=True, scale=None, mask=None):
    """Naive O(n^2) oracle: repeat K/V per query head, bottom-right causal, float64."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double()
    s = q.double() @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    nq, nk = q.shape[2], k.shape[2]
    if causal:
        vis = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        s = s.masked_fill(~vis, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def logits(model, ids, **kw):
    """Logits of a forward pass without grad, whatever the model returns (tuple or ModelOutput)."""
    with torch.no_grad():
        out = model(ids, **kw)
    return out[0] if isinstance(out, tuple) else out.logits


PROBE_CALLS: list[tuple[int, int]] = []


def _probe(q, k, v, *, causal, scale, backend, buffers, **params):
    PROBE_CALLS.append((q.shape[2], k.shape[2]))
    assert buffers["marker"].shape == (q.shape[-1],)
    return exact_attention(q, k, v, causal=causal, scale=scale)


# A prefill-only method (no decode) with a buffer: proves routing, buffers and decode fallback.
PROBE = register_method(Method(
    name="probe", summary="test method: exact attention that records its calls", prefill=_probe,
    params={"level": Param(1, (int,), "a test param", lambda x: x >= 0, "an int >= 0")},
    make_buffers=lambda head_dim, level, **_: {"marker": torch.full((head_dim,), float(level))},
))


def load_script(name: str):
    """scripts/<name>.py as a module (the scripts are not a package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
