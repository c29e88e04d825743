"""Generic adapter for every transformers model whose attention dispatches through AttentionInterface
(Llama, Phi, Mistral, Qwen2/3, GLM-4, Gemma, ...).

transformers looks the attention function up by one key per model (config._attn_implementation),
so longpatch registers one function per base implementation ("longpatch_sdpa", ...) that routes on
`module.layer_idx`: patched layers run their method, every other call goes to the base function
unchanged. The matching mask function is registered too, else the mask would arrive as None.
wrap_attention (sequence parallelism) switches the model to one more key, "longpatch_wrapped", whose
function hands every call to the `attend` set on the module, with the layer's route if it has one.
"""
from __future__ import annotations

import logging
import sys

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .. import ragged
from ..errors import UnsupportedModelError
from ..methods.common import causal_mask, warn_once
from ..quantized import QuantizedKV, full_precision
from ..routing import LayerRoute, attach_buffers, detach_buffers
from .base import AttentionCall, register_family

PREFIX = "longpatch_"
ROUTE_ATTR = "_longpatch_route"  # the LayerRoute on a patched attention module
WRAPPED_KEY = f"{PREFIX}wrapped"  # the attention key of a model under wrap_attention
ATTEND_ATTR = "_longpatch_attend"  # the `attend` of wrap_attention on each attention module
UNWRAPPED_ATTR = "_longpatch_unwrapped_impl"  # the model's attention key before wrap_attention


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


def _causal(module, kwargs) -> bool:
    is_causal = kwargs.get("is_causal")
    return getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)


def _make_attention(base: str):
    def longpatch_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        causal = _causal(module, kwargs)

        def original():
            mask = _eager_mask(attention_mask, query, key, causal) if base == "eager" else attention_mask
            fn = _base_function(base, module)
            return fn(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)

        route: LayerRoute | None = getattr(module, ROUTE_ATTR, None)
        if isinstance(key, QuantizedKV) and not (route is not None and route.bound is not None
                                                 and query.shape[2] == 1 and route.bound.reads_quantized()):
            key, value = full_precision(key, value)  # an 8-bit cache read whole: dequantized once for this call
        if route is None:
            return original()
        why = _unsupported(module, None, dropout, key.shape[2], kwargs)
        if why is None and route.paged is not None and query.shape[2] == 1 and causal and route.paged[1].fits(key) \
                and (query.is_cuda or torch.compiler.is_compiling()):
            # a static cache's step, graph-safe (on the CPU eager, the method's own step reads the listed rows in
            # place, 2x faster than the step's gathers; both choose the same blocks)
            extent = _static_extent(attention_mask, kwargs, query.shape[0])
            if extent is not None:
                out = route.run_step(query, key, value, *extent, scale=scaling)
                return out.transpose(1, 2).contiguous(), None
        if route.method is not None and torch.compiler.is_compiling():
            # every other call of a patched layer reads lengths, masks and block lists on the host and keeps
            # decode state in Python: traced, dynamo would bake one call's values into the graph (wrong tokens
            # on a padded batch) or fail; run outside the graph, it is the eager call, token for token
            _say_compiled()
            return _eager_outside_graph(route, why, original, query, key, value, attention_mask, causal, scaling,
                                        kwargs)
        return _eager(route, why, original, query, key, value, attention_mask, causal, scaling, kwargs)

    longpatch_attention.__name__ = f"{PREFIX}{base}"
    return longpatch_attention


def _eager(route: LayerRoute, why, original, query, key, value, attention_mask, causal: bool, scaling, kwargs):
    """A patched layer's call but for the graph-safe step: each sequence of a padded or packed batch alone,
    else the path the route chooses (the method, exact attention or the model's own)."""
    segments = None
    if why is None and route.method is not None:  # (an unpatched layer keeps the model's attention)
        segments, why = _segments(attention_mask, query, key, causal, kwargs)
    if segments is not None:  # a padded or packed batch: each sequence alone
        out = route.run_ragged(segments, query, key, value, causal=causal, scale=scaling)
        filled = _static_prefill(segments, query, key)
        if filled:
            route.prepare_step(key, filled, query.shape[0])
        return out.transpose(1, 2).contiguous(), None
    path = route.choose(query.shape[2], key.shape[2], why, causal=causal)
    if path == "original":
        return route.run(path, query, key, value, causal=causal, scale=scaling, original=original)
    out = route.run(path, query, key, value, causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


_eager_outside_graph = torch.compiler.disable(_eager)


@torch.compiler.disable
def _say_compiled() -> None:
    # the routing reads lengths, masks and positions on the host and the methods choose blocks from data,
    # so torch.compile breaks its graph at each patched layer: slower than eager, and fullgraph=True fails
    warn_once("torch.compile", "longpatch: torch.compile of a patched model breaks its graph at every patched "
              "attention layer (the methods' block choices are made on the host), so it runs slower than the "
              "patched model uncompiled, and fullgraph=True cannot succeed; run the patched model without "
              "torch.compile")


def _static_prefill(segments, query, key) -> int:
    """The keys every row holds after a prefill, or a prefill chunk, into a longer buffer (a static cache's
    first calls: every row's first n keys, the queries the last q_len of them), or 0 for another call: the
    calls after it can run a method's graph-safe step, on state built from those n keys (a later chunk
    builds it again, with the keys it added and its lists)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if len(segments) != query.shape[0] or not segments:
        return 0
    n = segments[0].k1
    ok = q_len <= n < kv_len and all(s == ragged.Segment(s.row, 0, q_len, 0, n) for s in segments)
    return n if ok else 0


def _static_extent(mask, kwargs, b: int):
    """(length [b], start [b] or None) of a one-token call on a static cache's buffer, as device tensors
    (no host sync): the keys written so far, and where a row's keys begin (left padding). From the mask
    (a row's first and last visible key) or, without one, the query's position. None where neither says."""
    if mask is not None and mask.dim() == 4 and mask.dtype == torch.bool and mask.shape[2] == 1:
        vis = mask[:, 0, 0].expand(b, -1).to(torch.uint8)
        n = vis.shape[-1]
        return n - vis.flip(-1).argmax(-1), vis.argmax(-1)
    pos = kwargs.get("position_ids")
    if mask is None and pos is not None and pos.dim() == 2:
        return pos[:, -1].expand(b) + 1, None
    return None


def _segments(mask, query, key, causal: bool, kwargs) -> tuple[list | None, str | None]:
    """(segments, None) for a padded or packed batch (ragged.py), (None, None) for a plain one, or
    (None, why) for a mask that is neither padding nor packing."""
    b, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None:  # flash-attention's packed layout: one row, sequences at cumulative offsets
        if b != 1 or cu_k is None or not torch.equal(cu_q, cu_k) or q_len != kv_len:
            return None, "packed sequences with different query and key offsets"
        cu = cu_q.tolist()
        segs = [ragged.Segment(0, s, e, s, e) for s, e in zip(cu[:-1], cu[1:]) if e > s]
    elif mask is None and causal and 1 < q_len < kv_len:
        # transformers hands no mask only where SDPA's own causal mask, aligned top-left, is right: a static
        # cache's first call (transformers >= 5.17), its queries the first q_len keys of the buffer
        segs = [ragged.Segment(row, 0, q_len, 0, q_len) for row in range(b)]
    elif mask is None:
        pos = kwargs.get("position_ids")
        if not ragged.restarts(pos, q_len, kv_len):
            return None, None
        segs = ragged.from_positions(pos.expand(b, -1))
    elif mask.dim() == 2:
        segs = ragged.memo(mask, (b, q_len, kv_len, causal), lambda: ragged.from_padding(mask, q_len, causal))
    elif mask.dim() == 4 and mask.dtype == torch.bool:
        segs = ragged.memo(mask, (b, q_len, kv_len, causal),
                           lambda: ragged.from_visible(mask[:, 0].expand(b, q_len, kv_len), causal))
    else:
        segs = None
    if segs is None:
        return None, "an attention mask that is neither padding nor packing"
    return (None, None) if ragged.whole(segs, b, q_len, kv_len) else (segs, None)


def _unsupported(module, attention_mask, dropout, kv_len: int, kwargs) -> str | None:
    """Why a call is not plain causal or full attention over kv_len keys, or None."""
    if attention_mask is not None:
        return "a padding or custom attention mask"
    if dropout and module.training:
        return "attention dropout (training mode)"
    if kwargs.get("softcap") is not None:
        return "logit soft-capping"
    window = kwargs.get("sliding_window")
    if window is not None:
        # a sliding-window layer keeps the model's attention at every call, prefill and decode alike: at
        # decode its cache holds only the window, so "kv_len <= window" would run the method there while
        # the prefill (kv_len > window) ran the model's own: one layer, two different attentions
        return f"a sliding window ({window} tokens)"
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


def _wrapped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The attention function of a model under wrap_attention: the module's `attend` on the shared layout."""
    attend = getattr(module, ATTEND_ATTR, None)
    if attend is None:
        raise UnsupportedModelError(f"{type(module).__name__}: attention key {WRAPPED_KEY!r} on a module "
                                    "wrap_attention did not wrap")
    call = AttentionCall(layer=module.layer_idx, route=getattr(module, ROUTE_ATTR, None),
                         causal=_causal(module, kwargs), scale=scaling,
                         unsupported=lambda kv_len: _unsupported(module, attention_mask, dropout, kv_len, kwargs))
    out = attend(query, key, value, call)
    return out.transpose(1, 2).contiguous(), None


def _register_wrapped() -> None:
    if WRAPPED_KEY not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(WRAPPED_KEY, _wrapped_attention)
        # sdpa-style masks: None for plain causal attention without padding
        AttentionMaskInterface.register(WRAPPED_KEY, sdpa_mask)


class _AutoCompile:
    """generate()'s auto-compile test for a patched model, set on the instance: transformers' own test where
    every patched layer's decode step is graph-safe (``Method.graph_step``: MoBA's and NSA's query-aware
    selections, sparse's plain window), never otherwise (the other methods' steps read the cache on the
    host: a compiled step would break its graph at every patched layer). A class, not a bound function,
    so that the patched model still pickles and deep-copies."""

    def __init__(self, model, routes: list[LayerRoute]):
        self.model, self.graph_safe = model, graph_safe(routes)

    def __call__(self, model_kwargs, generation_config) -> bool:
        # transformers asks the same before compiling a chunked prefill's forward (generate(prefill_chunk_size=
        # ...), from its `_prefill`): the chunks run the methods' selections, which choose blocks on the host,
        # so they stay eager; the decode steps after them compile
        if sys._getframe(1).f_code.co_name == "_prefill":
            return False
        if not self.graph_safe:
            return False
        if _padded(model_kwargs.get("attention_mask")):
            # a padded batch's rows keep their own block lists (each from its own first key): their steps run
            # eager, outside any graph (_eager_outside_graph), so a compile would add a graph break per patched
            # layer and gain nothing
            warn_once("padded compile", "longpatch: generate() does not compile the static-cache steps of a padded "
                      "batch (its patched layers decode each row eagerly); this batch runs uncompiled")
            return False
        return type(self.model)._valid_auto_compile_criteria(self.model, model_kwargs, generation_config)


def _padded(mask) -> bool:
    """Whether a 2D attention mask hides any key (a padded batch); read once per generate() call."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.bool().all())


def graph_safe(routes: list[LayerRoute]) -> bool:
    """Whether every patched layer of ``routes`` has a graph-safe decode step for its params (judged for a
    long prompt: after a short one, where the prefill ran exact attention, the steps run eager)."""
    patched = [r for r in routes if r.method is not None]
    return all(r.method.graph_step is not None and r.method.graph_step(r.method.resolve_params(r.params), 1 << 20)
               is not None for r in patched)


class HFAttentionInterfaceFamily:
    name = "hf"
    summary = ("transformers models dispatching through AttentionInterface "
               "(Llama, Phi, Mistral, Qwen2/3, GLM-4, Gemma, ...)")

    def matches(self, model) -> bool:
        return isinstance(model, PreTrainedModel) and bool(_attention_modules(model))

    def num_layers(self, model) -> int:
        return len({m.layer_idx for m in _attention_modules(model)})

    def attention_heads(self, model) -> tuple[int, int]:
        hq = model.config.num_attention_heads
        return hq, getattr(model.config, "num_key_value_heads", None) or hq

    def install(self, model, routes: list[LayerRoute]) -> None:
        base = model.config._attn_implementation or "eager"
        if base.startswith(PREFIX):
            raise UnsupportedModelError("model is already patched by longpatch; call unpatch_model first")
        if base == "flex_attention":  # its masks are BlockMasks, which the routing (padding, packing) cannot read
            raise UnsupportedModelError("attn_implementation 'flex_attention' cannot be patched; load the model with "
                                        "attn_implementation='sdpa' (the methods run their own FlexAttention "
                                        "kernels on a GPU)")
        if base not in ("sdpa", "eager") and base not in ALL_ATTENTION_FUNCTIONS:
            raise UnsupportedModelError(f"attn_implementation {base!r} cannot be wrapped; "
                                        "use sdpa, eager or flash_attention_2")
        key = _register(base)
        model.set_attn_implementation(key)
        if model.config._attn_implementation != key:
            raise UnsupportedModelError(f"{type(model).__name__} does not let its attention implementation "
                                        "be switched at runtime")
        model._longpatch_base_impl = base
        if hasattr(type(model), "_valid_auto_compile_criteria"):
            # generate() compiles the steps of a static cache on a GPU (mode reduce-overhead: CUDA graphs):
            # allowed where every patched step is graph-safe, else kept eager, said in the log. Decided on
            # the instance, not in generation_config, so that save_pretrained writes the model's own
            # generation config; unpatch_model removes it
            test = model._valid_auto_compile_criteria = _AutoCompile(model, routes)
            if not test.graph_safe:
                logging.getLogger("longpatch").info(
                    "longpatch: generate() will not auto-compile this patched model's static-cache steps (only "
                    "MoBA's and NSA's query-aware selections and sparse's plain window have a graph-safe step; "
                    "docs/gpu.md)")
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
        vars(model).pop("_valid_auto_compile_criteria", None)

    def wrap_attention(self, model, attend) -> None:
        if UNWRAPPED_ATTR in vars(model):
            raise UnsupportedModelError("the model's attention is already wrapped; unwrap it first")
        _register_wrapped()
        before = model.config._attn_implementation
        model.set_attn_implementation(WRAPPED_KEY)
        setattr(model, UNWRAPPED_ATTR, before)
        for m in _attention_modules(model):
            setattr(m, ATTEND_ATTR, attend)

    def unwrap_attention(self, model) -> None:
        if UNWRAPPED_ATTR not in vars(model):
            return
        for m in _attention_modules(model):
            vars(m).pop(ATTEND_ATTR, None)
        model.set_attn_implementation(vars(model).pop(UNWRAPPED_ATTR))


HF = register_family(HFAttentionInterfaceFamily())
