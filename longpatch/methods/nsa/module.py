"""Trainable NSA: the learnable compression and gates around ``nsa_attention``.

``NSAAttention`` holds what the paper learns and the training-free mode fixes:

* ``compress_k`` / ``compress_v``: phi(block) = mean(block) + MLP(block + intra-block position
  embedding, flattened). The MLP's output layer starts at zero, so phi starts as mean pooling;
* ``gate_proj``: Linear(hidden_size, num_heads * 3); gates = sigmoid(gate_proj(h)) per query head
  and position, (g_cmp, g_slc, g_win). Zero weights and bias = logit(gates) make it start at the
  fixed training-free gates.

At initialisation the module therefore computes exactly the training-free op. Selection indices
are discrete (no gradient, as in the paper); the compressed, selected and window outputs, the
compression MLP, the position embeddings and the gates all carry gradient.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ...errors import check_int
from ..common import default_scale
from .blocks import DEFAULT_GATES, DEFAULTS, check_params, num_compressed
from .op import nsa_attention


class BlockCompressor(nn.Module):
    """phi: [b, h, n, d] keys (or values) -> [b, h, nc, d], one vector per block of l positions
    with stride s: mean pooling plus a zero-initialised MLP of the position-encoded block."""

    def __init__(self, head_dim: int, compress_block: int, compress_stride: int, hidden: int):
        super().__init__()
        self.l, self.s = compress_block, compress_stride
        self.pos = nn.Parameter(torch.zeros(compress_block, head_dim))
        self.mlp = nn.Sequential(nn.Linear(compress_block * head_dim, hidden), nn.GELU(), nn.Linear(hidden, head_dim))
        nn.init.zeros_(self.mlp[2].weight)
        nn.init.zeros_(self.mlp[2].bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, n, d = x.shape
        nc = num_compressed(n, self.l, self.s)
        if nc == 0:
            return x.new_zeros((b, h, 0, d))
        blocks = x[:, :, : (nc - 1) * self.s + self.l].unfold(2, self.l, self.s).transpose(-1, -2)  # [b, h, nc, l, d]
        return blocks.mean(-2) + self.mlp((blocks + self.pos).flatten(-2))


class NSAAttention(nn.Module):
    """Trainable NSA attention: ``forward(q, k, v, hidden_states)`` on the shared layout
    (q [b, num_heads, n, d], k/v [b, num_kv_heads, nk, d], hidden_states [b, n, hidden_size] of the
    query positions) returns [b, num_heads, n, d]. Block parameters as in ``nsa_attention``; gates
    are the initial (training-free) gates; mlp_hidden the compression MLP's width (default 2*d)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 compress_block: int = DEFAULTS["compress_block"], compress_stride: int = DEFAULTS["compress_stride"],
                 select_block: int = DEFAULTS["select_block"], num_selected: int = DEFAULTS["num_selected"],
                 window: int = DEFAULTS["window"], init_blocks: int = DEFAULTS["init_blocks"],
                 local_blocks: int = DEFAULTS["local_blocks"], gates=DEFAULT_GATES, mlp_hidden: int | None = None,
                 scale: float | None = None):
        super().__init__()
        check_params(compress_block, compress_stride, select_block, num_selected, window, init_blocks, local_blocks)
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            check_int(f"NSAAttention: {name}", value, 1)
        if scale is not None:
            default_scale(scale, head_dim)  # the ops' one rule, checked at construction
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if len(tuple(gates)) != 3 or not all(0 < float(x) < 1 for x in gates):
            raise ValueError(f"initial gates must be 3 numbers in (0, 1) (they are sigmoid outputs); got {gates!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.blocks = dict(compress_block=compress_block, compress_stride=compress_stride, select_block=select_block,
                           num_selected=num_selected, window=window, init_blocks=init_blocks, local_blocks=local_blocks)
        self.scale = scale
        hidden = mlp_hidden or 2 * head_dim
        self.compress_k = BlockCompressor(head_dim, compress_block, compress_stride, hidden)
        self.compress_v = BlockCompressor(head_dim, compress_block, compress_stride, hidden)
        self.gate_proj = nn.Linear(hidden_size, num_heads * 3)
        nn.init.zeros_(self.gate_proj.weight)
        with torch.no_grad():
            logits = torch.tensor([math.log(float(x) / (1 - float(x))) for x in gates])
            self.gate_proj.bias.copy_(logits.repeat(num_heads))

    def compress(self, k: torch.Tensor, v: torch.Tensor):
        """(k_cmp, v_cmp) of the complete blocks of k/v; a decoder keeps them beside its KV cache."""
        return self.compress_k(k), self.compress_v(v)

    def gates(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[b, n, hidden] -> gates [b, num_heads, n, 3] in (0, 1)."""
        b, n, _ = hidden_states.shape
        return torch.sigmoid(self.gate_proj(hidden_states)).view(b, n, self.num_heads, 3).transpose(1, 2)

    def forward(self, q, k, v, hidden_states, *, compressed=None, backend: str = "auto"):
        if compressed is None:
            compressed = self.compress(k, v)
        return nsa_attention(q, k, v, scale=self.scale, gates=self.gates(hidden_states), compressed=compressed,
                             backend=backend, **self.blocks)
