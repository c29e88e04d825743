"""A KV cache that grows without copying itself every token.

transformers' ``DynamicCache`` appends each token's keys and values with ``torch.cat``, so every
decode step copies the whole cache of every layer. At 32k tokens that copy costs more than a sparse
method's attention (docs/benchmarks.md, "End-to-end generation"), and it caps what any decode-time
method can gain. ``GrowingCache`` keeps each layer's keys and values in a buffer with spare
capacity and hands out views of its filled part: a step writes its own rows only, and the buffer is
reallocated (one copy) when it fills, by a quarter of its length at least, so the copying per token
is O(1) amortised. The views are non-contiguous when there is more than one batch row or head,
which every longpatch method and torch's SDPA accept.

Use it wherever a ``DynamicCache`` goes::

    model.generate(ids, cache=GrowingCache(reserve=max_new_tokens))  # past_key_values= in older transformers

It extends transformers' per-layer cache classes (``DynamicLayer``, transformers >= 4.56); models
that keep their own tuple cache (ChatGLM2's remote code) do not use it.
"""
from __future__ import annotations

import functools
import inspect

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .errors import check_int
from .options import MAX_TOKENS

# The smallest growth step, in tokens: short prompts do not reallocate on every few tokens.
MIN_GROWTH = 256


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys``/``values`` are views of a buffer with spare capacity.

    transformers' own layer operations (crop, beam reordering, batch selection, offloading)
    replace ``keys``/``values`` with new tensors or shorter views; ``update`` notices that
    and adopts what it finds, so none of them needs overriding."""

    def __init__(self, reserve: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.reserve = reserve
        self._k = self._v = None

    def lazy_initialization(self, key_states, value_states=None) -> None:
        try:  # transformers >= 5: (keys, values); 4.56-4.57: (keys)
            super().lazy_initialization(key_states, value_states)
        except TypeError:
            super().lazy_initialization(key_states)
        self._k = self._v = None

    def _filled(self, key_states, value_states) -> int | None:
        """Rows of the buffer that ``keys`` shows, if the new rows can be appended to it; None if
        ``keys`` is no longer a prefix view of the buffer (replaced by a crop copy, a reorder, an
        offload, ...) or the new rows do not match it (batch, heads, head dim, dtype, device)."""
        k, v, buf = self.keys, self.values, self._k
        if buf is None or k is None or k.dim() != 4 or k.shape[:2] != buf.shape[:2]:
            return None
        if k.data_ptr() != buf.data_ptr() or k.stride() != buf.stride() or k.shape[-1] != buf.shape[-1]:
            return None
        if v.data_ptr() != self._v.data_ptr() or v.shape != k.shape:
            return None
        if (buf.dtype != key_states.dtype or buf.device != key_states.device
                or buf.shape[:2] != key_states.shape[:2] or self._v.shape[-1] != value_states.shape[-1]):
            return None
        return k.shape[-2]

    def update(self, key_states, value_states, *args, **kwargs):
        if self.keys is None or not getattr(self, "is_initialized", True):  # first call, or after reset()
            self.lazy_initialization(key_states, value_states)
        n = self._filled(key_states, value_states)
        if n is None:  # first call, or keys replaced from outside: adopt them as the filled part
            n = self.keys.shape[-2] if self.keys is not None and self.keys.numel() else 0
            old_k = self.keys if n else None
            old_v = self.values if n else None
            self._k = self._v = None
        else:
            old_k, old_v = self._k[:, :, :n], self._v[:, :, :n]
        need = n + key_states.shape[-2]
        if self._k is None or need > self._k.shape[-2]:
            cap = need + max(MIN_GROWTH, need // 4, self.reserve if self._k is None else 0)
            self._k = self._grow(old_k, key_states, cap, n)
            self._v = self._grow(old_v, value_states, cap, n)
        self._k[:, :, n:need].copy_(key_states)
        self._v[:, :, n:need].copy_(value_states)
        self.keys, self.values = self._k[:, :, :need], self._v[:, :, :need]
        return self.keys, self.values

    @staticmethod
    def _grow(old, new, cap: int, n: int) -> torch.Tensor:
        b, h, _, d = new.shape
        buf = torch.empty(b, h, cap, d, dtype=new.dtype, device=new.device)
        if n:
            buf[:, :, :n].copy_(old)
        return buf


class GrowingCache(DynamicCache):
    """``DynamicCache`` with ``GrowingLayer`` for its full-attention layers (sliding-window and
    other special layers stay as transformers makes them). ``reserve``: tokens of spare capacity
    allocated with the prompt (e.g. ``max_new_tokens``), so generation never reallocates; by keyword
    (the first positional argument is the model's config, as DynamicCache's). Copies (copy.deepcopy: the
    prompt-reuse recipe) and pickles as DynamicCache does."""

    def __init__(self, config=None, *, reserve: int = 0, **kwargs):
        # checked here, not at the first allocation deep inside generate()
        check_config("GrowingCache", config, "reserve=64")
        check_int("GrowingCache: reserve", reserve, 0, MAX_TOKENS)
        super().__init__(config=config, **kwargs)
        if self.layer_class_to_replicate is DynamicLayer:  # a partial, not a lambda: the cache pickles
            self.layer_class_to_replicate = functools.partial(GrowingLayer, reserve=reserve)
        self.layers = [self._growing(layer, reserve) if type(layer) is DynamicLayer else layer
                       for layer in self.layers]

    @staticmethod
    def _growing(layer, reserve: int) -> GrowingLayer:
        new = GrowingLayer(reserve=reserve)
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            new.update(layer.keys, layer.values)  # data given to the constructor
        return new


def check_config(cls: str, config, example: str) -> None:
    """A cache's first positional argument is the model's config (transformers' DynamicCache takes
    config= and reads config.get_text_config()); anything else there, e.g. GrowingCache(64) or
    QuantizedCache("fp8"), is a TypeError naming the keyword it was meant for, not an AttributeError
    from inside transformers."""
    if config is not None and not hasattr(config, "get_text_config"):
        raise TypeError(f"{cls}: got {config!r} as its first positional argument, which is the model's config "
                        f"(config=model.config); pass the cache's own options by keyword: {cls}({example})")


def forward_params(model) -> dict:
    try:
        return dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return {}


def cache_argument(model) -> str:
    """The name of the forward's KV-cache argument: `cache` in transformers >= 5.x, `past_key_values`
    before (and in remote-code models)."""
    return "cache" if "cache" in forward_params(model) else "past_key_values"


def takes_cache_objects(model) -> bool:
    """Whether the model keeps its KV cache in transformers' Cache classes: the library's own model
    classes do; remote-code models (ChatGLM2) keep their own tuples."""
    return type(model).__module__.startswith("transformers.models.")
