"""vLLM's CPU attention backend with longpatch's routes: registered in ``CPU_ATTN``'s place by the plugin
(plugin.py) when ``LONGPATCH_CONFIG`` names a config. Imported by vLLM only (it imports vllm).

In a replaced layer the backend owns the cache writes (``do_kv_cache_update``: our layout, pages.py), because
it reads the cache itself: the CPU backend's own layout is private to its kernels (each layer has a cache of its
own, so layers of both kinds live side by side). Every call is split into its
sequences; each runs its layer's route as a lone sequence in transformers would:

- a layer the config does not replace is vLLM's own (its cache writes, layout and kernels);
- a replaced layer's prefill and prefill chunks run the config's method on the sequence's queries and its
  whole cache so far (the same ``LayerRoute`` that ``patch_model`` installs: the same selection on the same
  q/k); its calls the method does not take attend exactly;
- a replaced layer's one-token steps run the method's step (``paged.listed_step``, what transformers' step
  chooses): the page bounds of every physical block are kept beside the cache and widened where the backend
  writes it, a sequence's blocks rank from its block-table row's bounds, and only the listed blocks' rows are
  read. The prefill's list travels with the sequence's newest block (``_lists``): vLLM's metadata names no
  request, but the block a sequence writes its next token to is its own.
"""
from __future__ import annotations

import re

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from ..methods.common import warn_once
from ..methods.paged import StepSpec, listed_step
from ..routing import LayerRoute
from . import pages
from .plugin import routes_for

_LAYER = re.compile(r"layers\.(\d+)\.")


class LongpatchCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type["LongpatchCPUImpl"]:
        return LongpatchCPUImpl


class LongpatchCPUImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        model = get_current_vllm_config().model_config
        self.num_layers = int(model.hf_text_config.num_hidden_layers)
        self.max_len = int(model.max_model_len)
        self.route: LayerRoute | None = None
        self.spec: StepSpec | None = None  # the replaced layer's one-token step, where the cache's blocks fit it
        self.bounds: tuple[torch.Tensor, torch.Tensor] | None = None  # pages.bounds_buffers, on the first write
        # physical block holding a sequence's newest token -> (its prefill's list, that token's position,
        # its first block): the step's list moves with the sequence from block to block
        self._lists: dict[int, tuple[torch.Tensor, int, int]] = {}
        unsupported = None
        if self.sliding_window != -1:
            unsupported = "a sliding window"
        elif self.alibi_slopes is not None or self.logits_soft_cap or self.sinks is not None:
            unsupported = "ALiBi, a soft cap or attention sinks"
        elif self.is_fp8_kv_cache:
            unsupported = "an fp8 KV cache"
        if unsupported is not None:
            raise NotImplementedError(f"longpatch's vLLM backend does not run layers with {unsupported}")

    def _route(self, layer, block_size: int) -> LayerRoute:
        if self.route is None:
            name = getattr(layer, "layer_name", "")
            found = _LAYER.search(name)
            if found is None:
                raise RuntimeError(f"longpatch: cannot tell the layer index of vLLM's attention layer {name!r}")
            route = routes_for(self.num_layers)[int(found.group(1))]
            if route.method is not None:
                if route.bound is None:
                    route.bound = route.method.bind(route.params, self.head_size, route.layer_idx)
                spec = route.bound.step_spec(self.max_len)
                if spec is not None and spec.block % block_size == 0 and block_size % spec.page == 0:
                    self.spec = spec
                elif route.method.decode is not None:
                    why = (f"its step's blocks of {spec.block} keys and pages of {spec.page} do not fit cache blocks "
                           f"of {block_size}") if spec else "its method's params have no paged step"
                    warn_once("vllm-step", f"longpatch: in vLLM, one-token steps of the replaced layers attend "
                              f"exactly: {why}")
            self.route = route
        return self.route

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self._route(layer, kv_cache.shape[2]).method is None:  # a layer the config leaves: vLLM's own
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        key_cache, value_cache = pages.split_cache(kv_cache)
        pages.write_slots(key_cache, value_cache, key, value, slot_mapping)
        if self.spec is not None and self.spec.ranked:
            if self.bounds is None or self.bounds[0].shape[0] * self.spec.page != kv_cache.shape[0] * kv_cache.shape[2]:
                self.bounds = pages.bounds_buffers(kv_cache, self.spec.page)
            pages.write_bounds(*self.bounds, key, slot_mapping, self.spec.page)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("longpatch's vLLM backend does not fuse output quantization")
        if attn_metadata is None:  # vLLM's warm-up
            return output
        if not attn_metadata.causal:
            raise NotImplementedError("longpatch's vLLM backend runs causal decoder attention only")
        route = self._route(layer, kv_cache.shape[2])
        if route.method is None:  # a layer the config leaves: vLLM's own kernels on vLLM's own layout
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        key_cache, value_cache = pages.split_cache(kv_cache)
        t = attn_metadata.num_actual_tokens
        out = output[:t].view(t, self.num_heads, self.head_size)
        table = attn_metadata.block_table

        def run(i, q, n):
            row = table[i]
            q_len = q.shape[2]
            path = route.choose(q_len, n)
            if path == "original":
                path = "exact"
            if q_len == 1 < n:  # a one-token step: the method's over the listed pages, or exact read in place
                got = self._step(route, q, kv_cache, row, n) if path == "method" else None
                if got is None:
                    got = pages.exact_step(q, key_cache, value_cache, row, n, self.scale)
                    path = "exact"
                if got is not None:
                    route.calls[("decode", path)] += 1
                    return got
            k, v = pages.sequence_kv(key_cache, value_cache, row, n)
            state = {}
            got = route.run(path, q, k, v, causal=True, scale=self.scale, state=state)
            if self.spec is not None and self.spec.ranked and (q_len > 1 or q_len == n):  # a prefill or chunk
                self._keep(row, n, key_cache.shape[2], state.get("kept") if path == "method" else None)
            block = route.bound.chunk_block() if path == "method" else None
            if block and 1 < q_len < n and (n - q_len) % block:
                warn_once("vllm-off-grid", f"longpatch: in vLLM, a prefill chunk of a replaced layer started at key "
                          f"{n - q_len}, off the method's blocks of {block} keys (a prefix-cache hit or the "
                          "scheduler's chunk boundary): its first, partial query block chooses from fewer queries, "
                          "so its tokens can differ from a lone request's")
            return got

        pages.attend_packed(query[:t], attn_metadata.query_start_loc.tolist(), attn_metadata.seq_lens.tolist(),
                            out, run)
        return output

    def _step(self, route: LayerRoute, q, kv_cache, row: torch.Tensor, n: int):
        """The method's one-token step at position n - 1 over the listed pages, or None (exact attention):
        no paged step for these params or this cache, or no prefill list for this sequence (its prefill ran
        exact attention, or came from the prefix cache whole)."""
        spec = route.bound.step_spec(n) if self.spec is not None else None
        if spec is None:
            return None
        state = None
        if spec.ranked:
            kept = self._moved(row, n, kv_cache.shape[2])
            if kept is None:
                warn_once("vllm-no-list", "longpatch: in vLLM, a sequence whose prompt kept no block list (its "
                          "prefill ran exact attention, or came from the prefix cache whole) decodes exactly in "
                          "the replaced layers")
                return None
            state = pages.SequenceBounds(*self.bounds, row, n, kv_cache.shape[2], spec.block, spec.page, kept)
        attend = pages.ListedAttention(q, kv_cache, row, spec.block, self.scale)
        return listed_step(spec, q, state, torch.tensor([n]), attend)

    def _keep(self, row: torch.Tensor, n: int, block_size: int, kept: torch.Tensor | None) -> None:
        """After a prefill call ending at position n - 1: its list (or none) on the block that position is in."""
        head = int(row[(n - 1) // block_size])
        if kept is None:
            self._lists.pop(head, None)
        else:
            self._lists[head] = (kept, n - 1, int(row[0]))

    def _moved(self, row: torch.Tensor, n: int, block_size: int) -> torch.Tensor | None:
        """The list a step at position n - 1 keeps: the one left by the sequence's call at n - 2, moved to
        the block of n - 1 when that opens a block; None where no call of this sequence left one there (an
        entry of a freed block's old owner fails the position or first-block check)."""
        head = int(row[(n - 1) // block_size])
        before = int(row[(n - 2) // block_size])
        entry = self._lists.pop(before, None) if before != head else self._lists.get(head)
        if entry is None or entry[1] != n - 2 or entry[2] != int(row[0]):
            self._lists.pop(head, None)
            return None
        self._lists[head] = (entry[0], n - 1, entry[2])
        return entry[0]
