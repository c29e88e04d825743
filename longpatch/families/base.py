"""The families registry: how a method reaches the attention layers of one kind of model.

A family is the only code that knows where a model keeps its attention layers and in which layout
they call attention. Everything else reaches a model through the `Family` methods below: patching
(`install` / `uninstall`) and sequence parallelism (`attention_heads`, `wrap_attention` /
`unwrap_attention`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from ..errors import UnsupportedModelError
from ..routing import LayerRoute


@dataclass
class AttentionCall:
    """What a wrapped attention layer tells its `attend` about one call (see Family.wrap_attention)."""

    layer: int  # 0-based layer index
    route: LayerRoute | None  # the layer's route when the model is patched, else None
    causal: bool
    scale: float | None  # None: the default 1/sqrt(head_dim)
    # unsupported(kv_len) -> why this call is not plain causal or full attention over kv_len keys (a
    # padding mask, dropout, a sliding window shorter than kv_len, ...), or None; the family's own check,
    # the one its patched layers use to fall back to the model's attention
    unsupported: Callable[[int], str | None]


class Family(Protocol):
    name: str
    summary: str

    def matches(self, model) -> bool:
        """True when this adapter knows how to patch `model`."""

    def num_layers(self, model) -> int:
        """Number of attention layers (the range 0-based layer indices are checked against)."""

    def install(self, model, routes: list[LayerRoute]) -> None:
        """Route every attention layer through `routes` (one per layer, index = layer)."""

    def uninstall(self, model, routes: list[LayerRoute]) -> None:
        """Restore the model's own attention exactly."""

    def attention_heads(self, model) -> tuple[int, int]:
        """(query heads, KV heads) of every attention layer."""

    def wrap_attention(self, model, attend: Callable) -> None:
        """Send every attention call of every layer, patched or not, to ``attend(q, k, v, call)`` until
        `unwrap_attention`: q [b, q_heads, n, d], k/v [b, kv_heads, n, d] (the shared layout, K/V not
        repeated), `call` an AttentionCall; its output [b, q_heads, n, dv] goes back in the model's layout."""

    def unwrap_attention(self, model) -> None:
        """Undo `wrap_attention` exactly (patched layers get their routes back)."""


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add an adapter; families are tried in registration order, the generic one last."""
    _FAMILIES[family.name] = family
    return family


def available_families() -> dict[str, Family]:
    return dict(_FAMILIES)


def detect_family(model, name: str | None = None) -> Family:
    if name is not None:
        if name not in _FAMILIES:
            raise UnsupportedModelError(f"family: got {name!r}; allowed: {', '.join(_FAMILIES)}")
        if not _FAMILIES[name].matches(model):  # else it fails later on attributes the model lacks
            fits = [f.name for f in _FAMILIES.values() if f.matches(model)]
            raise UnsupportedModelError(f"family: got {name!r}, which cannot patch {type(model).__name__}; allowed "
                                        f"for this model: {', '.join(fits) or 'none'} (or leave family unset)")
        return _FAMILIES[name]
    for fam in _FAMILIES.values():
        if fam.matches(model):
            return fam
    raise UnsupportedModelError(
        f"no longpatch family can patch {type(model).__name__}; supported: {', '.join(_FAMILIES)} "
        "(any transformers model whose attention dispatches through AttentionInterface, and ChatGLM2); "
        "to add one see docs/families.md")
