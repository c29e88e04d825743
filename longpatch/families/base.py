"""The families registry: how a method reaches the attention layers of one kind of model."""
from __future__ import annotations

from typing import Protocol

from ..errors import UnsupportedModelError
from ..routing import LayerRoute


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
