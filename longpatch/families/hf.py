"""Generic adapter for every transformers model whose attention dispatches through AttentionInterface
(Llama, Phi, Mistral, Qwen2/3, GLM-4, Gemma, ...).

transformers looks the attention function up by one key per model (config._attn_implementation),
so longpatch registers one function per base implementation ("longpatch_sdpa", ...) that routes on
`module.layer_idx`: patched layers run their method, every other call goes to the base function
unchanged. The matching mask function is registered too, else the mask would arrive as None.
"""
from __future__ import annotations

import sys

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..errors import UnsupportedModelError
from ..methods.common import causal_mask
from ..routing import LayerRoute, attach_buffers, detach_buffers
from .base import register_family

PREFIX = "longpatch_"
ROUTE_ATTR = "_longpatch_route"


def _attention_modules(model) -> list[torch.nn.Module]:
    mods = []
    for m in model.modules():
        if not (hasattr(m, "layer_idx") and hasattr(m, "config") and type(m).__name__.endswith("Attention")):
            continue
        source = sys.modules.get(type(m).__module__)
        if source is not None and hasattr(source, "ALL_ATTENTION_FUNCTIONS"):
            mods.append(m)
    return mods


def _base_function(base: str, module):
    if base == "eager":
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise UnsupportedModelError(f"{type(module).__name__}: no eager_attention_forward to fall back to; "
                                        "load the model with attn_implementation='sdpa'")
        return fn
    return ALL_ATTENTION_FUNCTIONS[base]


def _eager_mask(mask, query, key, causal: bool):
    """Our eager key gets sdpa-style masks (None or bool, True = visible); eager wants additive floats."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if mask is None:
        if not causal or q_len == 1:
            return None
        mask = causal_mask(q_len, kv_len, query.device)[None, None]
    zeros = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
    return zeros.masked_fill(~mask, torch.finfo(query.dtype).min)


def _make_attention(base: str):
    def longpatch_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        is_causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)

        def original():
            mask = _eager_mask(attention_mask, query, key, causal) if base == "eager" else attention_mask
            fn = _base_function(base, module)
            return fn(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)

        route: LayerRoute | None = getattr(module, ROUTE_ATTR, None)
        if route is None:
            return original()
        path = route.choose(query.shape[2], key.shape[2], _unsupported(module, attention_mask, dropout, key, kwargs),
                            causal=causal)
        if path == "original":
            return route.run(path, query, key, value, causal=causal, scale=scaling, original=original)
        out = route.run(path, query, key, value, causal=causal, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    longpatch_attention.__name__ = f"{PREFIX}{base}"
    return longpatch_attention


def _unsupported(module, attention_mask, dropout, key, kwargs) -> str | None:
    if attention_mask is not None:
        return "a padding or custom attention mask"
    if dropout and module.training:
        return "attention dropout (training mode)"
    if kwargs.get("softcap") is not None:
        return "logit soft-capping"
    window = kwargs.get("sliding_window")
    if window is not None and key.shape[2] > window:
        return "a sliding-window mask"
    if kwargs.get("output_attentions"):
        return "output_attentions=True"
    return None


def _register(base: str) -> str:
    key = f"{PREFIX}{base}"
    if key not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(key, _make_attention(base))
        # eager is fed sdpa-style masks (None for plain causal) and converts them in `original`
        mask_fn = sdpa_mask if base == "eager" else ALL_MASK_ATTENTION_FUNCTIONS[base]
        AttentionMaskInterface.register(key, mask_fn)
    return key


class HFAttentionInterfaceFamily:
    name = "hf"
    summary = ("transformers models dispatching through AttentionInterface "
               "(Llama, Phi, Mistral, Qwen2/3, GLM-4, Gemma, ...)")

    def matches(self, model) -> bool:
        return isinstance(model, PreTrainedModel) and bool(_attention_modules(model))

    def num_layers(self, model) -> int:
        return len({m.layer_idx for m in _attention_modules(model)})

    def install(self, model, routes: list[LayerRoute]) -> None:
        base = model.config._attn_implementation or "eager"
        if base.startswith(PREFIX):
            raise UnsupportedModelError("model is already patched by longpatch; call unpatch_model first")
        if base not in ("sdpa", "eager") and base not in ALL_ATTENTION_FUNCTIONS:
            raise UnsupportedModelError(f"attn_implementation {base!r} cannot be wrapped; "
                                        "use sdpa, eager or flash_attention_2")
        key = _register(base)
        model.set_attn_implementation(key)
        if model.config._attn_implementation != key:
            raise UnsupportedModelError(f"{type(model).__name__} does not let its attention implementation "
                                        "be switched at runtime")
        model._longpatch_base_impl = base
        for m in _attention_modules(model):
            route = routes[m.layer_idx]
            head_dim = getattr(m, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
            param = next(m.parameters())
            attach_buffers(route, m, head_dim, param.device)
            setattr(m, ROUTE_ATTR, route)

    def uninstall(self, model, routes: list[LayerRoute]) -> None:
        for m in _attention_modules(model):
            route = getattr(m, ROUTE_ATTR, None)
            if route is not None:
                detach_buffers(route)
                delattr(m, ROUTE_ATTR)
        model.set_attn_implementation(model._longpatch_base_impl)
        del model._longpatch_base_impl


HF = register_family(HFAttentionInterfaceFamily())
