"""Ragged batches: the real part of each row of a padded or packed batch, as segments a method runs on
alone.

A segment is one sequence inside one batch row: its query rows [q0, q1) and its key columns [k0, k1),
the queries being the last q1 - q0 of those keys (bottom-right causal alignment, as everywhere in
longpatch). Left padding (generation), right padding (scoring) and packing (several sequences in one
row, from `position_ids` that restart or a block-diagonal mask) all become lists of segments, read
from what the model hands its attention: a visibility mask (True = the query sees the key), a 2D
padding mask, or restarting position ids. A mask that is none of these (a sliding window, a prefix-LM
mask, holes) gives None: the caller falls back to the model's own attention and says so.

Running each segment alone is what makes a row's result equal to the same method on that row by
itself: its own chunk and block boundaries, its own LSH buckets and samples, its own selection and
its own decode state. Query rows outside every segment (padding) get zeros.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Segment:
    row: int
    q0: int
    q1: int
    k0: int
    k1: int


def whole(segments: list[Segment], batch: int, q_len: int, kv_len: int) -> bool:
    """Every row is one sequence covering the whole call: the batch needs no ragged handling."""
    return len(segments) == batch and all(
        s == Segment(b, 0, q_len, 0, kv_len) for b, s in enumerate(sorted(segments, key=lambda s: s.row)))


def static_offset(visible: torch.Tensor) -> int:
    """The key column of the first query row of a causal visibility mask [batch, q_len, kv_len]: kv_len -
    q_len (the queries are the last keys) but for a static cache's preallocated buffer. transformers'
    StaticCache hands every call its whole buffer, the columns after the tokens written so far empty
    and hidden from every query; there the queries end at the last query row's last visible key (the
    same column in every batch row that sees anything, none seeing past it)."""
    b, q_len, kv_len = visible.shape
    last_row = visible[:, -1]
    sees = last_row.any(-1)
    if q_len >= kv_len or not bool(sees.any()):
        return kv_len - q_len
    ends = kv_len - 1 - last_row.flip(-1).view(torch.uint8).argmax(-1)  # each row's last visible key
    end = int(ends[sees].max())
    if end == kv_len - 1 or end < q_len - 1 or bool((ends[sees] != end).any()) or bool(visible[..., end + 1:].any()):
        return kv_len - q_len
    return end - (q_len - 1)


def from_visible(visible: torch.Tensor, causal: bool) -> list[Segment] | None:
    """Segments from a visibility mask [batch, q_len, kv_len] (True = the query sees the key), or None when
    the mask is not a union of contiguous causal (or, non-causal, full) blocks, one per sequence."""
    b, q_len, kv_len = visible.shape
    off = kv_len - q_len if not causal else static_offset(visible)
    out: list[Segment] = []
    own = torch.arange(q_len, device=visible.device) + off  # each query's own key column
    for row in range(b):  # one row at a time
        vis = visible[row]
        flags = vis.view(torch.uint8)  # no copy; int32 sums and uint8 argmax are the fast CPU reductions
        count = flags.sum(-1, dtype=torch.int32)
        seen = count > 0
        first = flags.argmax(-1)  # the first visible key of each query
        if causal:
            real = vis.gather(-1, own[:, None]).squeeze(-1)  # a real query sees itself
            last = own
        else:
            real = seen
            last = kv_len - 1 - flags.flip(-1).argmax(-1)
        if bool((real & (count != last - first + 1)).any()):
            return None  # a real query whose visible keys have a hole (or, causal, reach past itself)
        idx = real.nonzero().squeeze(-1).tolist()
        firsts, lasts = first.tolist(), last.tolist() if not causal else None
        start = None
        for j, i in enumerate(idx):
            if start is None:
                start = i
            nxt = idx[j + 1] if j + 1 < len(idx) else None
            if nxt is None or nxt != i + 1 or firsts[nxt] != firsts[i]:
                k0 = firsts[i]
                k1 = (i + off + 1) if causal else lasts[i] + 1
                if not causal and any(lasts[x] + 1 != k1 for x in range(start, i + 1)):
                    return None
                if causal and k1 - k0 < i + 1 - start:
                    return None  # more queries than keys: not one sequence's rows
                if out and out[-1].row == row and k0 < out[-1].k1:
                    return None  # sequences of one row share keys: a window or another custom mask
                out.append(Segment(row, start, i + 1, k0, k1))
                start = None
    return out


_last: tuple = (None, None, None)  # (weak reference to a mask, its key, its segments)


def memo(mask: torch.Tensor, key: tuple, read: Callable[[], "list[Segment] | None"]):
    """read()'s segments of `mask`, read once for all the layers of a forward: a model hands every layer
    the same mask object, and reading a long prompt's mask costs a pass over it. One entry, keyed by the
    mask's identity and version (an in-place change is a new version) and `key`; held weakly, so it never
    keeps a mask alive."""
    global _last
    if mask.is_inference():  # no version counter (made under torch.inference_mode): read it every time
        return read()
    ref, last_key, segments = _last
    key = (mask._version, *key)
    if ref is not None and ref() is mask and last_key == key:
        return segments
    segments = read()
    _last = (weakref.ref(mask), key, segments)
    return segments


def from_padding(padding: torch.Tensor, q_len: int, causal: bool) -> list[Segment] | None:
    """Segments from a 2D padding mask [batch, kv_len] (nonzero = a real key), the queries being the last
    q_len positions; None when a row's real keys are not contiguous."""
    real = padding.bool()
    b, kv_len = real.shape
    out = []
    for row in range(b):
        keys = real[row].nonzero().squeeze(-1).tolist()
        if not keys:
            continue
        k0, k1 = keys[0], keys[-1] + 1
        if k1 - k0 != len(keys):
            return None
        q0 = max(k0 - (kv_len - q_len), 0)
        q1 = (k1 - (kv_len - q_len)) if causal else q_len
        if q1 <= q0:
            continue
        out.append(Segment(row, q0, q1, k0, k1))
    return out


def from_positions(position_ids: torch.Tensor) -> list[Segment] | None:
    """Segments of a packed prefill from position ids [batch, n] that restart at 0 for each sequence; None
    when they are not runs of 0, 1, 2, ..."""
    out = []
    for row, pos in enumerate(position_ids.tolist()):
        start = 0
        for i in range(1, len(pos) + 1):
            if i == len(pos) or pos[i] == 0:
                if pos[start:i] != list(range(i - start)):
                    return None
                out.append(Segment(row, start, i, start, i))
                start = i
    return out


def restarts(position_ids: torch.Tensor | None, q_len: int, kv_len: int) -> bool:
    """Whether a prefill's position ids pack several sequences in a row (they restart at 0 after the start)."""
    return position_ids is not None and q_len == kv_len and position_ids.shape[-1] == q_len and q_len > 1 \
        and bool((position_ids[:, 1:] == 0).any())
