"""An 8-bit KV cache whose pages the patched layers read in place.

``QuantizedCache`` stores each full-attention layer's keys and values in 8 bits (int8, or fp8 e4m3 where
the device has it) with a float32 scale and offset per row (KV head and position; ``quantize``), in
buffers with spare capacity like ``GrowingCache``: a token is quantized once, when it is appended, and
the past is never re-quantized. Each update hands the layer a ``QuantizedKV``, a tensor of the cache's
shape and the model's dtype that holds the 8-bit rows:

- a query-aware MoBA or NSA layer's one-token step keeps it and dequantizes only the rows it reads (the
  listed blocks, its window, the few rows its summaries need; ``Method.reads_quantized``); on a CPU the
  listed blocks are read in place by fbgemm's 8-bit embedding bags (``rowwise_bags``), which dequantize
  as they sum, so no full-precision copy of them is written;
- every other call (a prefill, a prefill chunk, an unpatched layer, another method) dequantizes the
  layer's whole cache once for that call: a transient full-precision copy of one layer's K/V, freed after
  the call (at 1M tokens of Llama-3.1-8B: 4 GB in bf16, against the 68 GiB the 8-bit cache holds at rest).

Use it wherever a ``DynamicCache`` goes::

    model.generate(ids, past_key_values=QuantizedCache(reserve=max_new_tokens))   # "cache=" in transformers 5

Rows are quantized as the layer writes them; the prompt's own forward attends its quantized keys too, so
a prefill, a prefill chunk and a decode step see the same values.
"""
from __future__ import annotations

import copy
import functools

import torch
from torch.utils._pytree import tree_map
from transformers.cache_utils import DynamicCache, DynamicLayer

from .cache import MIN_GROWTH, check_config
from .errors import ConfigError, check_int
from .options import MAX_TOKENS

FORMATS = {"int8": torch.uint8, "fp8": torch.float8_e4m3fn}
FP8_MAX = 448.0  # e4m3's largest finite value
TAIL = 8  # bytes after each row's codes: its float32 scale, then its float32 offset
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


def code_width(d: int) -> int:
    """Bytes of a row's codes: d, padded to a multiple of 4 (so that its scale and offset are aligned floats)."""
    return -(-d // 4) * 4


def row_width(d: int) -> int:
    """Bytes a packed row of d features takes: its codes, then a float32 scale and a float32 offset."""
    return code_width(d) + TAIL


def quantize(x: torch.Tensor, fmt: str = "int8") -> torch.Tensor:
    """x [..., d] -> packed rows, uint8 [..., row_width(d)]: each row's 8-bit codes (padded with zeros to a
    multiple of 4 bytes), then its float32 scale and float32 offset; a feature is code * scale + offset.
    int8: unsigned codes over the row's range, scale (max - min) / 255 and offset min (a constant row gets
    scale 1: exact) — the 8-bit rowwise layout of fbgemm, which torch's quantized embedding bags read on
    the CPU (``rowwise_bags``). fp8: e4m3 codes of x / scale, scale absmax / 448, offset 0."""
    d = x.shape[-1]
    xf = x.float()
    if fmt == "int8":
        lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
        scale = torch.where(hi > lo, (hi - lo) / 255.0, torch.ones_like(lo))
        codes = ((xf - lo) / scale).round_().clamp_(0, 255).to(torch.uint8)
        offset = lo
    else:
        scale = xf.abs().amax(-1, keepdim=True) / FP8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = (xf / scale).to(FORMATS[fmt]).view(torch.uint8)
        offset = torch.zeros_like(scale)
    out = torch.zeros(*x.shape[:-1], row_width(d), dtype=torch.uint8, device=x.device)
    out[..., :d] = codes
    cw = code_width(d)
    out[..., cw:].view(torch.float32).copy_(torch.cat([scale, offset], -1))
    return out


def unpack(rows: torch.Tensor, fmt: str, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [..., d] in the format's dtype, scale [..., 1], offset [..., 1] float32): views of packed rows."""
    cw = code_width(d)
    codes = rows[..., :d] if fmt == "int8" else rows[..., :d].view(FORMATS[fmt])
    tail = rows[..., cw:cw + TAIL].view(torch.float32)
    return codes, tail[..., :1], tail[..., 1:]


def dequantize(rows: torch.Tensor, fmt: str, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed rows [..., row_width(d)] -> [..., d] of ``dtype``. int8 rows on a CPU go through fbgemm's
    unpack (5x faster here than the elementwise form on a 32k cache's strided views: 8 against 40 ms)."""
    if fmt == "int8" and rows.device.type == "cpu" and rows.numel() and _rowwise_op() is not None:
        # fbgemm reads whole rows one after another: a view whose rows are strided (a stepped slice) is copied
        flat = torch.ops.quantized.embedding_bag_byte_unpack(rows.reshape(-1, rows.shape[-1]).contiguous())
        return flat[:, :d].reshape(*rows.shape[:-1], d).to(dtype)
    codes, scale, offset = unpack(rows, fmt, d)
    return torch.addcmul(offset, codes.float(), scale).to(dtype)


class QuantizedKV(torch.Tensor):
    """A [b, h, n, d] tensor of dtype ``dtype`` held as packed 8-bit rows (``quantize``). Slicing and
    indexing along the leading dims stay 8-bit (views of the rows); ``index_select`` along those dims
    dequantizes only the rows it picks, as ``methods.common.gather_blocks`` does the listed blocks; any
    other torch operation sees the dequantized tensor (one full dequantization per operation)."""

    @staticmethod
    def __new__(cls, rows: torch.Tensor, fmt: str, d: int, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, (*rows.shape[:-1], d), dtype=dtype, device=rows.device,
                                                   requires_grad=False)

    def __init__(self, rows: torch.Tensor, fmt: str, d: int, dtype: torch.dtype):
        self.rows, self.fmt = rows, fmt

    @classmethod
    def of(cls, x: torch.Tensor, fmt: str = "int8") -> "QuantizedKV":
        """x quantized (its rows packed once)."""
        return cls(quantize(x, fmt), fmt, x.shape[-1], x.dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"QuantizedKV(shape={tuple(self.shape)}, dtype={self.dtype}, format={self.fmt})"

    # torch's default deepcopy and pickling of a wrapper subclass refuse it (they would go through clone()):
    # both rebuild it from its packed rows, so a filled QuantizedCache copies (copy.deepcopy, the prompt-reuse
    # recipe) and pickles. deepcopy's memo keeps rows that view one buffer views of one copied buffer.
    def __deepcopy__(self, memo) -> "QuantizedKV":
        return QuantizedKV(copy.deepcopy(self.rows, memo), self.fmt, self.shape[-1], self.dtype)

    def __reduce_ex__(self, protocol):
        return QuantizedKV, (self.rows, self.fmt, self.shape[-1], self.dtype)

    def _like(self, rows: torch.Tensor) -> "QuantizedKV":
        return QuantizedKV(rows, self.fmt, self.shape[-1], self.dtype)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.rows, self.fmt, self.shape[-1], self.dtype)

    def index_rows(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """``index_select(dim, index)`` along a leading dim, dequantizing only the picked rows."""
        return dequantize(self.rows.index_select(dim, index), self.fmt, self.shape[-1], self.dtype)

    @property
    def nbytes_stored(self) -> int:
        return self.rows.numel()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if func in _VIEWS and isinstance(x, QuantizedKV):
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            if func in (_aten.detach.default, _aten.alias.default):
                return x._like(x.rows)
            if dim % x.dim() != x.dim() - 1:  # a leading dim: the packed rows alike
                return x._like(func(x.rows, *args[1:], **kwargs))
        if func is _aten.index_select.default and isinstance(x, QuantizedKV) and args[1] % x.dim() != x.dim() - 1:
            return x.index_rows(args[1], args[2])
        return func(*tree_map(_plain, args), **tree_map(_plain, kwargs))


def _plain(t):
    return t.dequantize() if isinstance(t, QuantizedKV) else t


def full_precision(*tensors):
    """The tensors, each ``QuantizedKV`` dequantized (a call that reads the whole cache does it once)."""
    return tuple(_plain(t) for t in tensors)


@functools.lru_cache(maxsize=None)
def _rowwise_op():
    """torch's fbgemm bag of 8-bit rowwise rows (CPU builds with fbgemm), or None."""
    try:
        op = torch.ops.quantized.embedding_bag_byte_rowwise_offsets
        rows = quantize(torch.ones(2, 4))
        op(rows, torch.tensor([1]), torch.tensor([0]), False, 0, False, None, None, False)
        return op
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


def rowwise_bags(x: QuantizedKV) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(table [M, width], base [b, h, 1]) for reading x's rows with ``bag_sums``: row p of head (i, j) is
    table row base[i, j] + p, the cache's own bytes (no copy). None where torch has no fbgemm bags, the format
    is not int8, the rows are on a GPU, or their layout is not whole rows."""
    rows = x.rows
    if x.fmt != "int8" or rows.device.type != "cpu" or rows.dim() != 4 or _rowwise_op() is None:
        return None
    b, h, n, w = rows.shape
    s0, s1, s2, s3 = rows.stride()
    if s3 != 1 or s2 != w or s0 % w or s1 % w or n == 0:
        return None
    count = ((b - 1) * s0 + (h - 1) * s1) // w + n
    base = (torch.arange(b).view(b, 1, 1) * (s0 // w) + torch.arange(h).view(1, h, 1) * (s1 // w))
    return rows.as_strided((count, w), (w, 1)), base


def bag_sums(table: torch.Tensor, index: torch.Tensor, bags: int, weights: torch.Tensor | None, d: int):
    """float32 [bags, d]: each of ``bags`` equal runs of the table rows ``index`` (flat) dequantized and summed,
    each row times its ``weights`` entry (flat, float32) if given: fbgemm reads the 8-bit rows in place."""
    per = index.numel() // bags
    offsets = torch.arange(0, index.numel(), per, device=index.device)
    out = _rowwise_op()(table, index, offsets, False, 0, False, weights, None, False)
    return out[:, :d]


class QuantizedLayer(DynamicLayer):
    """A ``DynamicLayer`` that keeps its keys and values as packed 8-bit rows in buffers with spare capacity
    (grown by a quarter at least, as ``GrowingLayer``); ``keys``/``values`` are ``QuantizedKV`` views
    of the filled part. transformers' own layer operations (crop, beam reordering, batch selection)
    replace them; ``update`` notices and takes up what it finds (its packed rows as they are, or a
    full-precision tensor quantized)."""

    def __init__(self, fmt: str = "int8", reserve: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.fmt, self.reserve = fmt, reserve
        self._bufs = None  # (k_rows, v_rows): packed rows with capacity along dim 2
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
        kb, vb = self._bufs
        if (self.keys.dtype != key_states.dtype or kb.device != key_states.device
                or kb.shape[:2] != key_states.shape[:2] or kb.shape[-1] != row_width(key_states.shape[-1])
                or vb.shape[-1] != row_width(value_states.shape[-1])):
            return None
        return self.keys.shape[-2]

    def _packed(self, x) -> torch.Tensor:
        """A tensor found in ``keys``/``values`` as packed rows: a ``QuantizedKV`` of this format as it is."""
        if isinstance(x, QuantizedKV) and x.fmt == self.fmt:
            return x.rows
        return quantize(_plain(x), self.fmt)

    def update(self, key_states, value_states, *args, **kwargs):
        if self.keys is None or not getattr(self, "is_initialized", True):
            self.lazy_initialization(key_states, value_states)
        n = self._filled(key_states, value_states)
        olds = None
        if n is None:  # first call, or keys replaced from outside: adopt them as the filled part
            n = self.keys.shape[-2] if self.keys is not None and self.keys.dim() == 4 and self.keys.numel() else 0
            if n:
                olds = (self._packed(self.keys), self._packed(self.values))
            self._bufs = None
        elif n:
            olds = tuple(t[:, :, :n] for t in self._bufs)
        need = n + key_states.shape[-2]
        if self._bufs is None or need > self._bufs[0].shape[-2]:
            cap = need + max(MIN_GROWTH, need // 4, self.reserve if self._bufs is None else 0)
            self._bufs = self._grown(olds, key_states, value_states, cap, n)
        for buf, x in zip(self._bufs, (key_states, value_states)):
            buf[:, :, n:need].copy_(quantize(x, self.fmt))
        kb, vb = self._bufs
        self.keys = QuantizedKV(kb[:, :, :need], self.fmt, key_states.shape[-1], key_states.dtype)
        self.values = QuantizedKV(vb[:, :, :need], self.fmt, value_states.shape[-1], value_states.dtype)
        self._views = (self.keys, self.values)
        return self.keys, self.values

    def _grown(self, olds, key_states, value_states, cap: int, n: int) -> tuple:
        bufs = []
        for x in (key_states, value_states):
            b, h, _, d = x.shape
            bufs.append(torch.zeros(b, h, cap, row_width(d), dtype=torch.uint8, device=x.device))
        if olds is not None:
            for buf, old in zip(bufs, olds):
                buf[:, :, :n].copy_(old)
        return tuple(bufs)

    def stored_bytes(self) -> int:
        """Bytes of the rows this layer holds (packed rows: codes, scales and offsets; spare capacity not counted)."""
        if self._views is None:
            return 0
        return sum(t.nbytes_stored for t in self._views)


class QuantizedCache(DynamicCache):
    """``DynamicCache`` with ``QuantizedLayer`` for its full-attention layers (sliding-window and other special
    layers stay as transformers makes them). ``fmt``: "int8" or "fp8" (e4m3; on a GPU of compute capability
    8.9 or later). ``reserve``: tokens of spare capacity allocated with the prompt (e.g. ``max_new_tokens``).
    Both by keyword: the first positional argument is the model's config, as DynamicCache's. A filled cache
    copies (copy.deepcopy: prefill a prefix once, copy it per request) and pickles."""

    def __init__(self, config=None, *, fmt: str = "int8", reserve: int = 0, **kwargs):
        check_config("QuantizedCache", config, f"reserve={config}" if isinstance(config, int) else
                     f"fmt={config!r}" if isinstance(config, str) and config in FORMATS else "fmt='int8'")
        check_format(fmt)
        check_int("QuantizedCache: reserve", reserve, 0, MAX_TOKENS)
        super().__init__(config=config, **kwargs)
        self.fmt = fmt
        if self.layer_class_to_replicate is DynamicLayer:  # a partial, not a lambda: the cache pickles
            self.layer_class_to_replicate = functools.partial(QuantizedLayer, fmt, reserve)
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
