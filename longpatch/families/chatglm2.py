"""Adapter for ChatGLM2 (THUDM/chatglm2-6b, chatglm2-6b-32k; remote code, trust_remote_code=True).

The remote code has no transformers class, so the adapter replaces the forward of each layer's
`self_attention.core_attention` (instance attribute; the class is untouched). That module takes
q, k, v as [seq, batch, heads, head_dim] with k/v already expanded from the multi-query groups to
all heads, and a bool mask with True = masked (None when there is no padding and no cache). The
adapter hands methods the shared layout with the groups un-expanded (a strided view), so GQA
methods see the real 2 K/V heads of chatglm2-6b-32k. wrap_attention (sequence parallelism) sets
another forward the same way, which hands every call to its `attend` in that layout.
"""
from __future__ import annotations

import logging

from .. import ragged
from ..errors import UnsupportedModelError
from ..routing import LayerRoute, attach_buffers, detach_buffers
from .base import AttentionCall, register_family

log = logging.getLogger("longpatch")
SUPPORTED_TRANSFORMERS = "4.48 to 5.x (forward; the remote code's own generate() breaks on >= 4.50)"


ROUTE_ATTR = "_longpatch_route"  # the LayerRoute on a patched core attention
UNWRAPPED_ATTR = "_longpatch_unwrapped"  # a wrapped core attention's forward before wrap_attention


def _core_attentions(model):
    layers = model.transformer.encoder.layers
    return [layer.self_attention.core_attention for layer in layers]


def _groups(config) -> int:
    heads = config.num_attention_heads
    return config.multi_query_group_num if getattr(config, "multi_query_attention", False) else heads


def _shared_layout(query_layer, key_layer, value_layer, rep: int):
    """The core attention's [seq, b, heads, d] (k/v expanded to all heads) as the shared layout
    [b, heads, seq, d] with the groups un-expanded: k/v were expanded head by head, so every rep-th
    head is one group (strided views, no copy)."""
    q = query_layer.permute(1, 2, 0, 3)
    k = key_layer[:, :, ::rep].permute(1, 2, 0, 3)
    v = value_layer[:, :, ::rep].permute(1, 2, 0, 3)
    return q, k, v


def _model_layout(out, sq: int):
    """A shared-layout output [b, heads, seq, d] as the core attention returns it: [seq, b, heads * d]."""
    b, h, _, d = out.shape
    return out.permute(2, 0, 1, 3).reshape(sq, b, h * d)


def _unsupported(attention_mask) -> str | None:
    return None if attention_mask is None else "a padding or chunked-prefill mask"


class _RoutedForward:
    """The forward set on a patched core attention: an instance of a module-level class, not a
    closure, so that a patched model survives torch.save and deepcopy."""

    def __init__(self, core, route: LayerRoute, rep: int):
        self.core, self.route, self.rep = core, route, rep

    def __call__(self, query_layer, key_layer, value_layer, attention_mask):
        route = self.route
        sq, skv = query_layer.shape[0], key_layer.shape[0]
        why = _unsupported(attention_mask)
        if why is not None and route.method is not None and attention_mask.dim() == 4:
            # padding (True = masked): each sequence of the batch alone, in the shared layout
            b = query_layer.shape[1]
            segments = ragged.memo(attention_mask, (b, sq, skv), lambda: ragged.from_visible(
                ~attention_mask[:, 0].expand(b, sq, skv), causal=True))
            if segments is None:
                why = "an attention mask that is neither padding nor packing"
            elif ragged.whole(segments, b, sq, skv):
                why = None  # plain causal attention: the path below
            else:
                q, k, v = _shared_layout(query_layer, key_layer, value_layer, self.rep)
                return _model_layout(route.run_ragged(segments, q, k, v, causal=True, scale=None), sq)
        path = route.choose(sq, skv, why)
        if path == "original":
            original = type(self.core).forward  # the class's own forward
            return route.run(path, query_layer, key_layer, value_layer, causal=True, scale=None,
                             original=lambda: original(self.core, query_layer, key_layer, value_layer, attention_mask))
        q, k, v = _shared_layout(query_layer, key_layer, value_layer, self.rep)
        out = route.run(path, q, k, v, causal=True, scale=None)  # chatglm2 uses the default 1/sqrt(d)
        return _model_layout(out, sq)


class _WrappedForward:
    """The forward set on a core attention by wrap_attention: every call to `attend` in the shared layout."""

    def __init__(self, core, attend, rep: int):
        self.core, self.attend, self.rep = core, attend, rep

    def __call__(self, query_layer, key_layer, value_layer, attention_mask):
        why = _unsupported(attention_mask)
        call = AttentionCall(layer=self.core.layer_number - 1, route=getattr(self.core, ROUTE_ATTR, None),
                             causal=True, scale=None, unsupported=lambda kv_len: why)
        out = self.attend(*_shared_layout(query_layer, key_layer, value_layer, self.rep), call)
        return _model_layout(out, query_layer.shape[0])


class ChatGLM2Family:
    name = "chatglm2"
    summary = "ChatGLM2 remote code (THUDM/chatglm2-6b, chatglm2-6b-32k): core attention of each GLMBlock"

    def matches(self, model) -> bool:
        try:
            core = _core_attentions(model)
        except AttributeError:
            return False
        return bool(core) and all(hasattr(c, "layer_number") for c in core)

    def num_layers(self, model) -> int:
        return len(model.transformer.encoder.layers)

    def attention_heads(self, model) -> tuple[int, int]:
        return model.config.num_attention_heads, _groups(model.config)

    def install(self, model, routes: list[LayerRoute]) -> None:
        config = model.config
        rep = config.num_attention_heads // _groups(config)
        head_dim = config.kv_channels
        for layer, core in zip(model.transformer.encoder.layers, _core_attentions(model)):
            if "forward" in vars(core):
                raise UnsupportedModelError("model is already patched by longpatch; call unpatch_model first")
            route = routes[core.layer_number - 1]  # layer_number is 1-based
            # the layer's own device: with a device_map, layers live on different GPUs
            attach_buffers(route, core, head_dim, next(layer.parameters()).device)
            core.forward = _RoutedForward(core, route, rep)
            setattr(core, ROUTE_ATTR, route)

    def uninstall(self, model, routes: list[LayerRoute]) -> None:
        for core in _core_attentions(model):
            if "forward" in vars(core):
                del core.forward
                detach_buffers(getattr(core, ROUTE_ATTR))
                delattr(core, ROUTE_ATTR)

    def wrap_attention(self, model, attend) -> None:
        hq, hk = self.attention_heads(model)
        for core in _core_attentions(model):
            if UNWRAPPED_ATTR in vars(core):
                raise UnsupportedModelError("the model's attention is already wrapped; unwrap it first")
            setattr(core, UNWRAPPED_ATTR, vars(core).get("forward"))  # the routed forward when patched
            core.forward = _WrappedForward(core, attend, hq // hk)

    def unwrap_attention(self, model) -> None:
        for core in _core_attentions(model):
            if UNWRAPPED_ATTR not in vars(core):
                continue
            before = vars(core).pop(UNWRAPPED_ATTR)
            if before is None:
                vars(core).pop("forward", None)
            else:
                core.forward = before


def prepare_loaded(model) -> None:
    """Compatibility fixes for the remote code on current transformers (see docs/families.md).

    Its forward reads config.use_cache / return_dict attributes that new PretrainedConfig objects no
    longer carry, which fails with AttributeError on a plain model(ids).
    """
    config = model.config
    for attr, value in (("use_cache", True), ("use_return_dict", True), ("return_dict", True),
                        ("output_hidden_states", False)):
        if not hasattr(config, attr):
            setattr(config, attr, value)
            log.info("longpatch: chatglm2 config had no %s; set to %s", attr, value)


CHATGLM2 = register_family(ChatGLM2Family())
