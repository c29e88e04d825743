"""vLLM's CPU attention backend with longpatch's routes: registered in ``CPU_ATTN``'s place by the plugin
(plugin.py) when ``LONGPATCH_CONFIG`` names a config. Imported by vLLM only (it imports vllm).

The backend owns its cache writes (``do_kv_cache_update``: our layout, pages.py), because it reads the
cache itself: the CPU backend's own layout is private to its kernels. Every call is split into its
sequences; each runs its layer's route on its own queries and its whole cache so far, as a lone sequence
in transformers would: a replaced layer's prefill and prefill chunks run the config's method (the same
``LayerRoute`` that ``patch_model`` installs: the same selection on the same q/k), other layers and calls
exact attention. One-token steps of replaced layers attend exactly for now (said once at run time): the
decode step that reads only the selected pages is not built into this backend yet.
"""
from __future__ import annotations

import re

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from ..methods.common import warn_once
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
        config = get_current_vllm_config().model_config.hf_text_config
        self.num_layers = int(config.num_hidden_layers)
        self.route: LayerRoute | None = None
        unsupported = None
        if self.sliding_window != -1:
            unsupported = "a sliding window"
        elif self.alibi_slopes is not None or self.logits_soft_cap or self.sinks is not None:
            unsupported = "ALiBi, a soft cap or attention sinks"
        elif self.is_fp8_kv_cache:
            unsupported = "an fp8 KV cache"
        if unsupported is not None:
            raise NotImplementedError(f"longpatch's vLLM backend does not run layers with {unsupported}")

    def _route(self, layer) -> LayerRoute:
        if self.route is None:
            name = getattr(layer, "layer_name", "")
            found = _LAYER.search(name)
            if found is None:
                raise RuntimeError(f"longpatch: cannot tell the layer index of vLLM's attention layer {name!r}")
            self.route = routes_for(self.num_layers)[int(found.group(1))]
        return self.route

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = pages.split_cache(kv_cache)
        pages.write_slots(key_cache, value_cache, key, value, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("longpatch's vLLM backend does not fuse output quantization")
        if attn_metadata is None:  # vLLM's warm-up
            return output
        if not attn_metadata.causal:
            raise NotImplementedError("longpatch's vLLM backend runs causal decoder attention only")
        route = self._route(layer)
        t = attn_metadata.num_actual_tokens
        key_cache, value_cache = pages.split_cache(kv_cache)
        out = output[:t].view(t, self.num_heads, self.head_size)

        def run(q, k, v):
            q_len, kv_len = q.shape[2], k.shape[2]
            path = route.choose(q_len, kv_len)
            if path == "original":
                path = "exact"
            if path == "method" and q_len == 1:
                warn_once("vllm-decode", "longpatch: in vLLM, one-token steps of the replaced layers attend "
                          "exactly (their page-selecting decode step is not built into the vLLM backend yet)")
                path = "exact"
            out = route.run(path, q, k, v, causal=True, scale=self.scale, state={})
            # after the call: a route binds its method on its first one
            block = route.bound.chunk_block() if path == "method" else None
            if block and 1 < q_len < kv_len and (kv_len - q_len) % block:
                warn_once("vllm-off-grid", f"longpatch: in vLLM, a prefill chunk of a replaced layer started at key "
                          f"{kv_len - q_len}, off the method's blocks of {block} keys (a prefix-cache hit or the "
                          "scheduler's chunk boundary): its first, partial query block chooses from fewer queries, "
                          "so its tokens can differ from a lone request's")
            return out

        pages.attend_packed(query[:t], key_cache, value_cache, attn_metadata.query_start_loc.tolist(),
                            attn_metadata.seq_lens.tolist(), attn_metadata.block_table, out, run)
        return output
