"""Tiny random-weight models of each supported family: offline stand-ins for tests and demos.

`tiny_model("llama")` etc. build a model from a small config with a fixed seed, so the same name
always gives the same weights. `--model tiny:llama` on the CLI uses these.
"""
from __future__ import annotations

import torch

from ..errors import ConfigError

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, max_position_embeddings=8192)


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**{**_COMMON, "num_key_value_heads": 2, **kw}))


def _phi(**kw):
    from transformers import PhiConfig, PhiForCausalLM
    # partial rotary (0.5) and MHA, as in phi-1.5
    # pad_token_id given: transformers 5.0.0's PhiModel reads it and its PhiConfig does not set it
    return PhiForCausalLM(PhiConfig(**{**_COMMON, "partial_rotary_factor": 0.5, "pad_token_id": None, **kw}))


def _qwen2(**kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(**{**_COMMON, "num_key_value_heads": 1, **kw}))


def _mistral(**kw):
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(**{**_COMMON, "num_key_value_heads": 2, "sliding_window": None, **kw}))


def _chatglm2(**kw):
    from .chatglm2 import ChatGLMConfig, ChatGLMForConditionalGeneration
    return ChatGLMForConditionalGeneration(ChatGLMConfig(**kw))


BUILDERS = {"llama": _llama, "phi": _phi, "qwen2": _qwen2, "mistral": _mistral, "chatglm2": _chatglm2}


def tiny_model(name: str, seed: int = 0, attn_implementation: str = "sdpa", dtype=torch.float32, **overrides):
    """A small random-weight model of family `name` in eval mode."""
    if name not in BUILDERS:
        allowed = ", ".join("tiny:" + n for n in BUILDERS)
        raise ConfigError(f"model: tiny:{name} is not a tiny model; allowed: {allowed}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if name != "chatglm2":
            overrides["attn_implementation"] = attn_implementation
        model = BUILDERS[name](**overrides)
    return model.to(dtype).eval()
