"""An 8-bit KV cache whose pages the patched layers read in place.

``QuantizedCache`` stores each full-attention layer's keys and values in 8 bits (int8, or fp8 e4m3 where
the device has it) with one scale per row (KV head and position: absmax / 127 for int8, / 448 for fp8),
in buffers with spare capacity like ``GrowingCache``: a token is quantized once, when it is appended, and
the past is never re-quantized. Each update hands the layer a ``QuantizedKV``, a tensor of the cache's
shape and the model's dtype that holds the 8-bit rows:

- a query-aware MoBA or NSA layer's one-token step keeps it and dequantizes only the rows it reads (the
  listed blocks, its window, the few rows its summaries need; ``Method.reads_quantized``);
- every other call (a prefill, a prefill chunk, an unpatched layer, another method) dequantizes the
  layer's whole cache once for that call: a transient full-precision copy of one layer's K/V, freed after
  the call (at 1M tokens of Llama-3.1-8B: 4 GB in bf16, against the 64 GiB the 8-bit cache holds at rest).

Use it wherever a ``DynamicCache`` goes::

    model.generate(ids, past_key_values=QuantizedCache(reserve=max_new_tokens))   # "cache=" in transformers 5

Rows are quantized as the layer writes them; the prompt's own forward attends its quantized keys too, so
a prefill, a prefill chunk and a decode step see the same values.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_map
from transformers.cache_utils import DynamicCache, DynamicLayer

from .cache import MIN_GROWTH
from .errors import ConfigError, check_int
from .options import MAX_TOKENS

FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
_aten = torch.ops.aten
# ops that keep the 8-bit rows: views along the leading (batch, head, position) dims
_VIEWS = {_aten.slice.Tensor, _aten.select.int, _aten.detach.default, _aten.alias.default}


def check_format(fmt: str, device: torch.device | str | None = None) -> None:
    """One line for a format this module does not know, or fp8 on a CUDA device without fp8 (before
    compute capability 8.9)."""
    if fmt not in FORMATS:
        raise ConfigError(f"cache format: got {fmt!r}; allowed: {', '.join(repr(f) for f in FORMATS)}")
    device = torch.device(device) if device is not None else None
    if fmt == "fp8" and device is not None and device.type == "cuda" and \
            torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError(f"cache format: 'fp8' needs a GPU of compute capability 8.9 or later; "
                          f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}: "
                          "use 'int8'")


def quantize(x: torch.Tensor, fmt: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """(8-bit rows, float32 scales [..., 1]) of x [..., d]: symmetric, one scale per row (its absmax over
    the last dim / the format's largest value; an all-zero row gets scale 1)."""
    dtype, top = FORMATS[fmt]
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / top
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = xf / scale
    if dtype == torch.int8:
        y = y.round_().clamp_(-top, top)
    return y.to(dtype), scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (data.float() * scale).to(dtype)


class QuantizedKV(torch.Tensor):
    """A [b, h, n, d] tensor of dtype ``dtype`` held as 8-bit rows and per-row scales. Slicing and
    indexing along the leading dims stay 8-bit (views of the rows); ``index_select`` along those dims
    dequantizes only the rows it picks, as ``methods.common.gather_blocks`` does the listed blocks; any
    other torch operation sees the dequantized tensor (one full dequantization per operation)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device,
                                                   requires_grad=False)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.q8, self.scale = data, scale

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"QuantizedKV(shape={tuple(self.shape)}, dtype={self.dtype}, stored={self.q8.dtype})"

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.q8, self.scale, self.dtype)

    def index_rows(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """``index_select(dim, index)`` along a leading dim, dequantizing only the picked rows."""
        return dequantize(self.q8.index_select(dim, index), self.scale.index_select(dim, index), self.dtype)

    @property
    def nbytes_stored(self) -> int:
        return self.q8.numel() * self.q8.element_size() + self.scale.numel() * self.scale.element_size()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if func in _VIEWS and isinstance(x, QuantizedKV):
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            if func in (_aten.detach.default, _aten.alias.default):
                return QuantizedKV(x.q8, x.scale, x.dtype)
            if dim % x.dim() != x.dim() - 1:  # a leading dim: the rows and their scales alike
                rest = args[1:]
                return QuantizedKV(func(x.q8, *rest, **kwargs), func(x.scale, *rest, **kwargs), x.dtype)
        if func is _aten.index_select.default and isinstance(x, QuantizedKV) and args[1] % x.dim() != x.dim() - 1:
            return x.index_rows(args[1], args[2])
        return func(*tree_map(_plain, args), **tree_map(_plain, kwargs))


def _plain(t):
    return t.dequantize() if isinstance(t, QuantizedKV) else t


def full_precision(*tensors):
    """The tensors, each ``QuantizedKV`` dequantized (a call that reads the whole cache does it once)."""
    return tuple(_plain(t) for t in tensors)


class QuantizedLayer(DynamicLayer):
    """A ``DynamicLayer`` that keeps its keys and values as 8-bit rows in buffers with spare capacity
    (grown by a quarter at least, as ``GrowingLayer``); ``keys``/``values`` are ``QuantizedKV`` views
    of the filled part. transformers' own layer operations (crop, beam reordering, batch selection)
    replace them; ``update`` notices and re-quantizes what it finds (those rows were 8-bit already:
    quantizing them again changes them by at most one step)."""

    def __init__(self, fmt: str = "int8", reserve: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.fmt, self.reserve = fmt, reserve
        self._bufs = None  # (k8, k_scale, v8, v_scale) with capacity along dim 2
        self._views = None

    def lazy_initialization(self, key_states, value_states=None) -> None:
        try:  # transformers >= 5: (keys, values); 4.56-4.57: (keys)
            super().lazy_initialization(key_states, value_states)
        except TypeError:
            super().lazy_initialization(key_states)
        check_format(self.fmt, key_states.device)
        self._bufs = self._views = None

    def _filled(self, key_states, value_states) -> int | None:
        """Rows the buffers hold, if ``keys``/``values`` are still this layer's views and the new rows fit them."""
        if self._views is None or self.keys is not self._views[0] or self.values is not self._views[1]:
            return None
        k8 = self._bufs[0]
        if (self.keys.dtype != key_states.dtype or k8.device != key_states.device
                or k8.shape[:2] != key_states.shape[:2] or k8.shape[-1] != key_states.shape[-1]
                or self._bufs[2].shape[-1] != value_states.shape[-1]):
            return None
        return self.keys.shape[-2]

    def update(self, key_states, value_states, *args, **kwargs):
        if self.keys is None or not getattr(self, "is_initialized", True):
            self.lazy_initialization(key_states, value_states)
        n = self._filled(key_states, value_states)
        olds = None
        if n is None:  # first call, or keys replaced from outside: adopt them as the filled part
            n = self.keys.shape[-2] if self.keys is not None and self.keys.dim() == 4 and self.keys.numel() else 0
            if n:
                olds = (*quantize(self.keys, self.fmt), *quantize(self.values, self.fmt))
            self._bufs = None
        elif n:
            olds = tuple(t[:, :, :n] for t in self._bufs)
        need = n + key_states.shape[-2]
        if self._bufs is None or need > self._bufs[0].shape[-2]:
            cap = need + max(MIN_GROWTH, need // 4, self.reserve if self._bufs is None else 0)
            self._bufs = self._grown(olds, key_states, value_states, cap, n)
        k8, ks, v8, vs = self._bufs
        for (data, scale), (dbuf, sbuf) in ((quantize(key_states, self.fmt), (k8, ks)),
                                            (quantize(value_states, self.fmt), (v8, vs))):
            dbuf[:, :, n:need].copy_(data)
            sbuf[:, :, n:need].copy_(scale)
        self.keys = QuantizedKV(k8[:, :, :need], ks[:, :, :need], key_states.dtype)
        self.values = QuantizedKV(v8[:, :, :need], vs[:, :, :need], value_states.dtype)
        self._views = (self.keys, self.values)
        return self.keys, self.values

    def _grown(self, olds, key_states, value_states, cap: int, n: int) -> tuple:
        dtype = FORMATS[self.fmt][0]
        bufs = []
        for x in (key_states, value_states):
            b, h, _, d = x.shape
            bufs += [torch.empty(b, h, cap, d, dtype=dtype, device=x.device),
                     torch.ones(b, h, cap, 1, dtype=torch.float32, device=x.device)]
        if olds is not None:
            for buf, old in zip(bufs, olds):
                buf[:, :, :n].copy_(old)
        return tuple(bufs)

    def stored_bytes(self) -> int:
        """Bytes of the rows this layer holds (8-bit rows and their scales; spare capacity not counted)."""
        if self._views is None:
            return 0
        return sum(t.nbytes_stored for t in self._views)


class QuantizedCache(DynamicCache):
    """``DynamicCache`` with ``QuantizedLayer`` for its full-attention layers (sliding-window and other special
    layers stay as transformers makes them). ``fmt``: "int8" or "fp8" (e4m3; on a GPU of compute capability
    8.9 or later). ``reserve``: tokens of spare capacity allocated with the prompt (e.g. ``max_new_tokens``)."""

    def __init__(self, config=None, fmt: str = "int8", reserve: int = 0, **kwargs):
        check_format(fmt)
        check_int("QuantizedCache: reserve", reserve, 0, MAX_TOKENS)
        super().__init__(config=config, **kwargs)
        self.fmt = fmt
        if self.layer_class_to_replicate is DynamicLayer:
            self.layer_class_to_replicate = lambda: QuantizedLayer(fmt, reserve)
        self.layers = [QuantizedLayer(fmt, reserve) if type(layer) is DynamicLayer else layer
                       for layer in self.layers]

    def stored_bytes(self) -> int:
        """Bytes the cache's keys and values take (8-bit rows and scales; full-precision layers at their size)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, QuantizedLayer):
                total += layer.stored_bytes()
            elif getattr(layer, "keys", None) is not None:
                total += layer.keys.nbytes + layer.values.nbytes
        return total
