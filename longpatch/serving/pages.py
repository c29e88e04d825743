"""A paged KV cache and a packed batch, mapped to longpatch's shared layout: what a serving engine's
attention backend needs to run the same routes (``routing.LayerRoute``) that ``patch_model`` installs.

The cache layout is ours (an engine's own backend may pack its blocks for its kernels, so a backend that
reads the cache writes it too): per physical block and KV head, ``block_size`` key rows, then as many value
rows, i.e. the engine's [blocks, kv_heads, block_size, 2 * head_dim] buffer seen as
[blocks, kv_heads, 2 * block_size, head_dim]. A batch packs the new tokens of every sequence
([tokens, heads, head_dim], split by ``query_start_loc``); each sequence's queries are the last of its
``seq_len`` positions, its keys the first ``seq_len`` rows of the blocks its block-table row lists.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values), each [blocks, kv_heads, block_size, head_dim], views of the engine's
    [blocks, kv_heads, block_size, 2 * head_dim] buffer."""
    blocks, heads, block_size, width = kv_cache.shape
    rows = kv_cache.view(blocks, heads, 2 * block_size, width // 2)
    return rows[:, :, :block_size], rows[:, :, block_size:]


def write_slots(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """Write token t's key/value [tokens, kv_heads, head_dim] at slot ``slot_mapping[t]`` (block
    slot // block_size, row slot % block_size); negative slots (padding) are skipped."""
    n = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[:n][keep], value[:n][keep]
    block_size = key_cache.shape[2]
    blk, row = slots // block_size, slots % block_size
    key_cache[blk, :, row] = key[: slots.shape[0]].to(key_cache.dtype)
    value_cache[blk, :, row] = value[: slots.shape[0]].to(value_cache.dtype)


def sequence_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, blocks: torch.Tensor, n: int):
    """One sequence's first ``n`` keys and values, [1, kv_heads, n, head_dim], gathered from the blocks
    ``blocks`` (its block-table row) lists."""
    block_size = key_cache.shape[2]
    ids = blocks[: -(-n // block_size)].to(torch.int64)

    def rows(cache):
        part = cache.index_select(0, ids)  # [nblk, hk, bs, d]
        return part.transpose(0, 1).reshape(cache.shape[1], -1, cache.shape[3])[:, :n].unsqueeze(0)
    return rows(key_cache), rows(value_cache)


def attend_packed(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  query_start_loc: list[int], seq_lens: list[int], block_table: torch.Tensor,
                  output: torch.Tensor, run: Callable[..., torch.Tensor]) -> None:
    """For each sequence i of a packed batch: ``run(q, k, v)`` on the shared layout (q [1, heads, q_len, d],
    the sequence's new tokens; k, v its whole cache so far, the queries its last q_len positions) into its
    rows of ``output`` [tokens, heads, head_dim]."""
    for i, n in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if end == start:
            continue
        q = query[start:end].transpose(0, 1).unsqueeze(0)
        k, v = sequence_kv(key_cache, value_cache, block_table[i], n)
        output[start:end] = run(q, k, v)[0].transpose(0, 1).to(output.dtype)
