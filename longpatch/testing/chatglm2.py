"""A tiny model with ChatGLM2's layout, written from the architecture facts (not from THUDM's code).

What the ChatGLM2 adapter relies on is reproduced: `transformer.encoder.layers[i].self_attention.
core_attention` is a CoreAttention(config, layer_number) with a 1-based layer_number whose forward
takes q, k, v as [seq, batch, heads, head_dim] (k/v already expanded from multi_query_group_num
groups to all heads) and a bool mask with True = masked (None when there is no padding and no
cache); rotary on the first half of each head in interleaved pairs; a legacy tuple KV cache of
[seq, batch, groups, head_dim] tensors. Used by the tests and by `--model tiny:chatglm2`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig


class ChatGLMConfig(PretrainedConfig):
    model_type = "chatglm"

    def __init__(self, num_layers=4, padded_vocab_size=256, hidden_size=64, ffn_hidden_size=128,
                 kv_channels=16, num_attention_heads=4, multi_query_attention=True,
                 multi_query_group_num=2, seq_length=4096, rope_ratio=1.0, layernorm_epsilon=1e-5, **kw):
        self.num_layers, self.padded_vocab_size, self.hidden_size = num_layers, padded_vocab_size, hidden_size
        self.ffn_hidden_size, self.kv_channels = ffn_hidden_size, kv_channels
        self.num_attention_heads = num_attention_heads
        self.multi_query_attention, self.multi_query_group_num = multi_query_attention, multi_query_group_num
        self.seq_length, self.rope_ratio, self.layernorm_epsilon = seq_length, rope_ratio, layernorm_epsilon
        super().__init__(**kw)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotary_table(config: ChatGLMConfig, length: int, device) -> torch.Tensor:
    """[length, rot_dim/2, 2] cos/sin for positions 0..length-1 (scaled by rope_ratio)."""
    rot_dim = config.kv_channels // 2
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, device=device).float() / rot_dim))
    pos = torch.arange(length, device=device).float() / config.rope_ratio
    ang = torch.outer(pos, inv)
    return torch.stack([ang.cos(), ang.sin()], dim=-1)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [seq, b, heads, d]; rotate the first half of d in interleaved (even, odd) pairs."""
    half = table.shape[1] * 2
    rot, rest = x[..., :half], x[..., half:]
    pairs = rot.reshape(*rot.shape[:-1], -1, 2)
    cos, sin = table[:, None, None, :, 0], table[:, None, None, :, 1]
    out = torch.stack([pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 1] * cos + pairs[..., 0] * sin], -1)
    return torch.cat([out.flatten(-2).to(x.dtype), rest], dim=-1)


class CoreAttention(nn.Module):
    def __init__(self, config: ChatGLMConfig, layer_number: int):
        super().__init__()
        self.layer_number = max(1, layer_number)
        self.hidden_size_per_partition = config.kv_channels * config.num_attention_heads

    def forward(self, query_layer, key_layer, value_layer, attention_mask):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query_layer, key_layer, value_layer))
        if attention_mask is None and q.shape[2] == k.shape[2]:
            ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            ctx = F.scaled_dot_product_attention(q, k, v, None if attention_mask is None else ~attention_mask)
        ctx = ctx.permute(2, 0, 1, 3)
        return ctx.reshape(*ctx.shape[:2], self.hidden_size_per_partition)


class SelfAttention(nn.Module):
    def __init__(self, config: ChatGLMConfig, layer_number: int):
        super().__init__()
        self.heads, self.d = config.num_attention_heads, config.kv_channels
        self.groups = config.multi_query_group_num if config.multi_query_attention else self.heads
        self.query_key_value = nn.Linear(config.hidden_size, (self.heads + 2 * self.groups) * self.d, bias=True)
        self.core_attention = CoreAttention(config, layer_number)
        self.dense = nn.Linear(self.heads * self.d, config.hidden_size, bias=False)

    def forward(self, x, mask, rope, kv_cache=None, use_cache=False):
        sq, b, _ = x.shape
        q, k, v = self.query_key_value(x).split([self.heads * self.d, self.groups * self.d, self.groups * self.d], -1)
        q = apply_rotary(q.view(sq, b, self.heads, self.d), rope)
        k = apply_rotary(k.view(sq, b, self.groups, self.d), rope)
        v = v.view(sq, b, self.groups, self.d)
        if kv_cache is not None:
            k, v = torch.cat([kv_cache[0], k], 0), torch.cat([kv_cache[1], v], 0)
        cache = (k, v) if use_cache else None
        rep = self.heads // self.groups
        k_all = k.unsqueeze(-2).expand(-1, -1, -1, rep, -1).contiguous().view(k.shape[0], b, self.heads, self.d)
        v_all = v.unsqueeze(-2).expand(-1, -1, -1, rep, -1).contiguous().view(v.shape[0], b, self.heads, self.d)
        return self.dense(self.core_attention(q, k_all, v_all, mask)), cache


class GLMBlock(nn.Module):
    def __init__(self, config: ChatGLMConfig, layer_number: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        self.self_attention = SelfAttention(config, layer_number)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        self.dense_h_to_4h = nn.Linear(config.hidden_size, 2 * config.ffn_hidden_size, bias=False)
        self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=False)

    def forward(self, x, mask, rope, kv_cache=None, use_cache=False):
        a, cache = self.self_attention(self.input_layernorm(x), mask, rope, kv_cache, use_cache)
        x = x + a
        gate, up = self.dense_h_to_4h(self.post_attention_layernorm(x)).chunk(2, -1)
        return x + self.dense_4h_to_h(F.silu(gate) * up), cache


class GLMTransformer(nn.Module):
    def __init__(self, config: ChatGLMConfig):
        super().__init__()
        self.layers = nn.ModuleList(GLMBlock(config, i + 1) for i in range(config.num_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon)


class ChatGLMModel(nn.Module):
    def __init__(self, config: ChatGLMConfig):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.encoder = GLMTransformer(config)
        self.output_layer = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)


class ChatGLMForConditionalGeneration(nn.Module):
    """forward(input_ids [b, s], attention_mask [b, past+s] of 1/0, past_key_values) -> (logits, cache).

    position_ids [b, s] (optional, as in the remote code; here one row serves the whole batch): the
    rotary positions, past..past+s-1 by default; sequence parallelism passes each rank's slice."""

    def __init__(self, config: ChatGLMConfig):
        super().__init__()
        self.config = config
        self.transformer = ChatGLMModel(config)

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=False, position_ids=None):
        b, s = input_ids.shape
        past = 0 if past_key_values is None else past_key_values[0][0].shape[0]
        full_mask = None
        if (attention_mask is not None and not attention_mask.all()) or (past_key_values is not None and s != 1):
            visible = torch.ones(s, past + s, dtype=torch.bool, device=input_ids.device).tril(past)[None, None]
            if attention_mask is not None:
                visible = visible & attention_mask.bool()[:, None, None, :]
            full_mask = ~visible.expand(b, 1, s, past + s)
        if position_ids is None:
            rope = rotary_table(self.config, past + s, input_ids.device)[past:]
        else:
            pos = position_ids[0].to(input_ids.device)
            rope = rotary_table(self.config, int(pos.max()) + 1, input_ids.device)[pos]
        x = self.transformer.embedding(input_ids).transpose(0, 1)
        caches = []
        for i, layer in enumerate(self.transformer.encoder.layers):
            x, c = layer(x, full_mask, rope, None if past_key_values is None else past_key_values[i], use_cache)
            caches.append(c)
        x = self.transformer.encoder.final_layernorm(x)
        logits = self.transformer.output_layer(x).transpose(0, 1).float()
        return logits, (tuple(caches) if use_cache else None)
