"""Per-layer routing: decide, call by call, whether a layer runs its method, exact attention or the
model's own implementation, and keep counts and timings of what ran.

Every attention layer of a patched model gets a LayerRoute (unpatched layers too, with
method=None) so that time spent in patched and in untouched layers is measured the same way.
Counting is free and always on; timing is opt-in (``longpatch.timing(model)``, which the evaluations
and benchmarks use): a timed call synchronises a GPU before and after it, which a model being served
must not pay (two host syncs per layer per token rule out overlap and CUDA graphs).

Calls are counted per (phase, path): phase "prefill" (q_len == kv_len, or a prefill chunk: several queries
against a longer cache) or "decode" (one query); path "method"
(the method's approximation), "method_exact" (the method's code, but exact at this length, e.g.
hyper at or below its min_seq_len), "exact" (longpatch's exact fallback: below the config's
min_seq_len, or decode for a method without one) or "original" (the model's own attention).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from .methods import BoundMethod, Method
from .methods.common import dense_pairs, warn_once
from .methods.exact import exact_attention

log = logging.getLogger("longpatch")
BUFFER_PREFIX = "longpatch_"  # method buffers are named with this prefix ...
HOLDER_ATTR = "longpatch_buffers"  # ... on a child of the patched module (MethodBuffers) under this name
PHASES = ("prefill", "decode")
PATHS = ("method", "method_exact", "exact", "original")


@dataclass
class LayerRoute:
    layer_idx: int
    method: Method | None = None  # None: the model's own attention, untouched
    params: dict[str, Any] = field(default_factory=dict)
    min_seq_len: int = 0
    backend: str = "auto"
    owner: torch.nn.Module | None = None  # the patched module; its child HOLDER_ATTR holds the method buffers
    bound: BoundMethod | None = None  # the method bound to params and head_dim (attach_buffers)
    buffer_names: tuple[str, ...] = ()
    state: dict = field(default_factory=dict)  # a stateful method's decode summaries
    # the same for each sequence of a padded or packed batch: (row, first key column) -> its state
    row_states: dict = field(default_factory=dict)
    calls: Counter = field(default_factory=Counter)  # (phase, path) -> number of calls
    seconds: Counter = field(default_factory=Counter)  # (phase, path) -> wall time, while timed
    timed: bool = False  # time each call (synchronising a GPU around it); see longpatch.timing
    # (phase, path, kind) -> query-key products, for methods that report their work (selection.py: the
    # estimate's and the attended ones, "estimate_pairs" / "attended_pairs")
    work: Counter = field(default_factory=Counter)
    # (StepSpec, PagedState) of the graph-safe step after a prefill into a static cache's buffer, or None
    paged: tuple | None = None

    def state_bytes(self, exclude: set | None = None) -> int:
        """Bytes of the tensors this layer keeps beside the KV cache to choose what a step reads: its decode
        state, each padded row's, the graph-safe step's (bounds, fingerprint rows, lists, means, compressed
        keys), each storage once and whole (spare capacity included: it is memory held). ``exclude``: the
        storages (device, data pointer) of the KV cache, which a state may view but does not own."""
        seen = set(exclude or ())
        total = 0
        for t in tensors_in((self.state, self.row_states, self.paged)):
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        return total

    def choose(self, q_len: int, kv_len: int, unsupported: str | None = None, causal: bool = True) -> str:
        """Which path serves this call: 'method', 'exact' or 'original'.

        unsupported: why the call is not plain causal attention (a padding mask, a sliding window,
        dropout...), or None. Such calls keep the model's own attention, with a one-time warning.
        Prefill (q_len == kv_len) of at least min_seq_len tokens runs the method; decode runs the
        method's decode when it has one and exact attention otherwise.
        """
        if self.method is None:
            return "original"
        if unsupported is None and not causal and self.method.causal_only:
            unsupported = "a non-causal call"
        if unsupported is not None:
            warn_once(f"{unsupported}:{self.method.name}", f"longpatch: a patched layer got {unsupported}, which "
                      f"'{self.method.name}' does not handle; those calls use the model's own attention")
            return "original"
        if q_len == kv_len:
            return "method" if q_len >= self.min_seq_len else "exact"
        if q_len > 1 and self.method.takes_chunks:  # a prefill chunk, which the method's prefill runs
            return "method"
        return "method" if self.method.decode is not None else "exact"

    def run(self, path: str, q, k, v, *, causal: bool, scale: float | None, original=None, state: dict | None = None):
        """Run `path` on the shared layout, count it, and time it when ``timed``; `original` is a
        zero-argument callable; `state`: one sequence's decode state (run_ragged), else the route's."""
        prefill = q.shape[2] == k.shape[2]
        if state is None:
            state = self.state
            if prefill:
                self.row_states.clear()
        if prefill:
            state.clear()  # a prefill starts a new sequence: decode summaries of the old cache are void
            self.paged = None
        sync = self.timed and q.is_cuda
        if sync:
            torch.cuda.synchronize(q.device)
        t0 = time.perf_counter() if self.timed else 0.0
        out = self._call(path, q, k, v, causal, scale, original, state)
        if sync:
            torch.cuda.synchronize(q.device)
        key = ("prefill" if q.shape[2] > 1 or prefill else "decode", self._recorded(path, q.shape[2], k.shape[2]))
        if 1 < q.shape[2] < k.shape[2] and self.method is not None and key[1] in ("exact", "method_exact"):
            self._warn_chunk(q.shape[2], k.shape[2], key[1])
        self.calls[key] += 1
        work = state.pop("work", {})
        for kind, n in work.items():
            self.work[(*key, kind)] += n
        if key[0] == "prefill" and "attended_pairs" in work and causal:  # what exact attention would have computed
            self.work[(*key, "dense_pairs")] += dense_pairs(q.shape, k.shape[2], True)
        if self.timed:
            self.seconds[key] += time.perf_counter() - t0
        return out

    def _warn_chunk(self, q_len: int, kv_len: int, path: str) -> None:
        """Once per method: a call of several queries against a longer cache (a prefill chunk, a multi-token
        step) ran exact attention because the method has no such call, or none of its queries reaches a block
        start (not where its own settings make it exact, e.g. top-k covering every chunk)."""
        from .methods.selection import off_grid_rows
        block = self.bound.chunk_block() if self.bound is not None else None
        if path == "exact":
            why = "which it does not run"
        elif block and off_grid_rows(q_len, kv_len, block) == q_len:
            why = f"none of whose queries reaches the start of one of its blocks of {block} keys"
        else:
            return
        warn_once(f"chunk:{self.method.name}", f"longpatch: '{self.method.name}' runs exact attention on calls of "
                  f"several queries against a longer cache {why} (a chunked prefill, e.g. generate(prefill_chunk_size"
                  "=...), or a multi-token step): those calls get no speed-up")

    def run_ragged(self, segments, q, k, v, *, causal: bool, scale: float | None):
        """A padded or packed batch (ragged.Segment list): each sequence runs alone, on its own query rows
        and keys, with its own path (its own length against min_seq_len) and its own decode state, so a
        row's result is what that sequence gives by itself. Query rows outside every segment get zeros."""
        if q.shape[2] == k.shape[2]:
            self.row_states.clear()  # a prefill starts new sequences
        out = q.new_zeros(*q.shape[:3], v.shape[-1])
        for s in segments:
            path = self.choose(s.q1 - s.q0, s.k1 - s.k0, causal=causal)
            state = self.row_states.setdefault((s.row, s.k0), {})
            out[s.row:s.row + 1, :, s.q0:s.q1] = self.run(
                path, q[s.row:s.row + 1, :, s.q0:s.q1], k[s.row:s.row + 1, :, s.k0:s.k1],
                v[s.row:s.row + 1, :, s.k0:s.k1], causal=causal, scale=scale, state=state)
        return out

    def prepare_step(self, key: torch.Tensor, n: int, rows: int) -> None:
        """After a prefill of ``n`` tokens in each of the ``rows`` batch rows of a static cache's buffer
        ``key`` [rows, hk, capacity, d] (run row by row, ``run_ragged``): the graph-safe step's state, from
        the rows' prefill lists and the bounds of their keys (paged.py). Nothing where the method has no
        such step for its params, or the prefill kept no list (it ran exact attention)."""
        self.paged = None
        if self.method is None or self.bound is None:
            return
        spec = self.bound.step_spec(n)
        if spec is None:
            return
        from .methods.paged import PagedState
        kept = None
        if spec.ranked:
            lists = [self.row_states.get((row, 0), {}).get("kept") for row in range(rows)]
            if any(x is None for x in lists):
                return
            width = max(x.shape[-1] for x in lists)
            kept = torch.cat([torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=-1) for x in lists])
        self.paged = (spec, PagedState.for_spec(spec, key, kept, n))

    def run_step(self, q, k, v, length: torch.Tensor, start: torch.Tensor | None, scale: float | None):
        """The graph-safe one-token step (``prepare_step``) on the shared layout; counted as a decode call of
        the method, except under torch.compile (the counters are host state)."""
        from .methods.common import default_scale
        from .methods.paged import step
        spec, state = self.paged
        out = step(spec, q, k, v, state, length, default_scale(scale, q.shape[-1]), start)
        if not torch.compiler.is_compiling():
            self.calls[("decode", "method")] += 1
        return out

    def _call(self, path: str, q, k, v, causal: bool, scale: float | None, original, state: dict):
        if path == "original":
            return original()
        if path == "exact":
            return exact_attention(q, k, v, causal=causal, scale=scale, backend=self.backend)
        if self.bound is None:  # a route used without a module (tests): bind on first use
            self.bound = self.method.bind(self.params, q.shape[-1], self.layer_idx)
        # read through the owner so .to(device) and load_state_dict are always seen
        bufs = {n: getattr(_holder(self), BUFFER_PREFIX + n) for n in self.buffer_names} \
            if self.owner is not None else None
        return self.bound(q, k, v, causal=causal, scale=scale, backend=self.backend, state=state, buffers=bufs)

    def _recorded(self, path: str, q_len: int, kv_len: int) -> str:
        if path != "method":
            return path
        return "method_exact" if self.bound.exact_at(q_len, kv_len) else path


def tensors_in(x):
    """Every tensor inside ``x``: dicts, lists, tuples and objects' attributes (a PagedState), depth first; for a
    wrapper tensor that holds its data in plain ones (an 8-bit cache's ``QuantizedKV``: its packed rows), those."""
    if isinstance(x, torch.Tensor):
        if type(x) is not torch.Tensor and isinstance(getattr(x, "rows", None), torch.Tensor):
            yield x.rows
        else:
            yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from tensors_in(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from tensors_in(v)
    elif hasattr(x, "__dict__") and not isinstance(x, (type, torch.nn.Module)):
        yield from tensors_in(vars(x))


class MethodBuffers(torch.nn.Module):
    """The tensors a method draws for one patched layer (HyperAttention's LSH directions, Performer's
    random features), as non-persistent buffers ``longpatch_<name>`` of this child of the patched module.

    They move with the model (``.to(device)``, ``.cuda()``) and pickle with it, but a module cast
    (``.to(torch.bfloat16)``, ``.half()``, ``.double()``) leaves their dtype as drawn: they are the
    method's random draw, not weights of the model, and a bfloat16 copy of float32 directions is another
    draw (other LSH buckets, other random features), so patching and then casting would not give what
    casting and then patching gives (patching draws float32 whatever the model's dtype). The methods cast
    them to their compute dtype at use. Buffers of a plain module cannot opt out of a cast, hence this
    class: its ``_apply`` takes the device of what ``fn`` gives and keeps the dtype."""

    def _apply(self, fn, recurse=True):
        for name, buf in self._buffers.items():
            if buf is not None:
                moved = fn(buf)
                self._buffers[name] = moved if moved.dtype == buf.dtype else buf.to(moved.device)
        return self


def _holder(route: LayerRoute) -> torch.nn.Module:
    return getattr(route.owner, HOLDER_ATTR)


def attach_buffers(route: LayerRoute, owner: torch.nn.Module, head_dim: int, device) -> None:
    """Create the method's buffers (e.g. LSH directions) on `owner` (in its child ``longpatch_buffers``, a
    ``MethodBuffers``): they move with ``.to()`` but keep their dtype through a cast of the model, pickle
    with the model and are redrawn in place, but are not persistent (not in the state_dict): they are
    drawn from the config (its seed and the layer index), so a plain ``save_pretrained`` of a patched
    model loads cleanly into the unpatched model, and re-patching draws them again."""
    route.owner = owner
    if route.method is None:
        return
    # the layer index: every layer draws its own random buffers (LSH directions, random features) from
    # the configured seed, as independently initialised layers would have
    route.bound = route.method.bind(route.params, head_dim, route.layer_idx)
    if route.bound.buffers:
        holder = MethodBuffers()
        for name, t in route.bound.buffers.items():
            holder.register_buffer(BUFFER_PREFIX + name, t.to(device), persistent=False)
            route.bound.buffers[name] = getattr(holder, BUFFER_PREFIX + name)  # one tensor, not a stale copy
        owner.add_module(HOLDER_ATTR, holder)
    route.buffer_names = tuple(route.bound.buffers)


def redraw_route(route: LayerRoute, seed: int) -> bool:
    """New random buffers for one route (in place: they keep their device);
    its decode state is cleared (it was built with the old ones). False when nothing was redrawn."""
    if route.bound is None or not route.buffer_names:
        return False
    new = route.bound.redrawn(seed)
    if not new:
        return False
    with torch.no_grad():
        for name, t in new.items():
            getattr(_holder(route), BUFFER_PREFIX + name).copy_(t)
    route.state.clear()
    route.row_states.clear()
    return True


def detach_buffers(route: LayerRoute) -> None:
    if route.buffer_names:
        delattr(route.owner, HOLDER_ATTR)
    route.buffer_names = ()


def reset_stats(routes: list[LayerRoute]) -> None:
    for r in routes:
        r.calls.clear()
        r.seconds.clear()
        r.work.clear()
