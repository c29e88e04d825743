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


def attend_packed(query: torch.Tensor, query_start_loc: list[int], seq_lens: list[int], output: torch.Tensor,
                  run: Callable[[int, torch.Tensor, int], torch.Tensor]) -> None:
    """For each sequence i of a packed batch: ``run(i, q, n)`` (q [1, heads, q_len, d], the sequence's new
    tokens, the last q_len of its n positions; ``sequence_kv`` or a ``ListedAttention`` reads its keys) into
    its rows of ``output`` [tokens, heads, head_dim]."""
    for i, n in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if end == start:
            continue
        q = query[start:end].transpose(0, 1).unsqueeze(0)
        output[start:end] = run(i, q, n)[0].transpose(0, 1).to(output.dtype)


def runs_of(ids: list[int]) -> list[tuple[int, int]]:
    """(first block, count) of each run of consecutive block ids, in order."""
    runs: list[tuple[int, int]] = []
    for b in ids:
        if runs and b == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


# More runs of consecutive blocks than this and a step gathers the sequence instead (each run costs a few ops)
MAX_RUNS = 64


def exact_step(q, key_cache: torch.Tensor, value_cache: torch.Tensor, row: torch.Tensor, n: int,
               scale: float) -> torch.Tensor | None:
    """Exact attention of one query per head q [1, hq, 1, d] at position n - 1 over the sequence's first n keys,
    read in place: its blocks come in runs of consecutive physical blocks (an engine hands out a prompt's
    blocks together), each run a strided view of the cache multiplied as it is, where ``sequence_kv`` would
    copy the whole sequence first. None where the blocks are too scattered (more than ``MAX_RUNS`` runs)."""
    from ..methods.common import acc_dtype
    bs, hk, d = key_cache.shape[2], key_cache.shape[1], key_cache.shape[3]
    full, tail = divmod(n, bs)
    runs = runs_of(row[:full].tolist())
    if len(runs) > MAX_RUNS:
        return None
    hq = q.shape[1]
    acc = acc_dtype(q.dtype)
    qg = (q.reshape(1, hk, hq // hk, d) * scale).to(acc)
    parts = [(key_cache[b0:b0 + c], value_cache[b0:b0 + c]) for b0, c in runs]  # [c, hk, bs, d] views
    if tail:  # the newest block's written rows only: the rest may hold anything
        last = int(row[full])
        parts.append((key_cache[last:last + 1, :, :tail], value_cache[last:last + 1, :, :tail]))
    scores = [torch.matmul(qg, k.to(acc).transpose(-1, -2)) for k, _ in parts]  # [c, hk, g, rows]
    flat = torch.cat([s.permute(1, 2, 0, 3).reshape(hk, hq // hk, -1) for s in scores], -1)
    p = torch.softmax(flat, -1)
    out, at = 0, 0
    for s, (_, v) in zip(scores, parts):
        c, rows = s.shape[0], s.shape[-1]
        share = p[..., at:at + c * rows].reshape(hk, hq // hk, c, rows).permute(2, 0, 1, 3)
        out = out + torch.matmul(share, v.to(acc)).sum(0)  # [hk, g, d]
        at += c * rows
    return out.reshape(1, hq, 1, d).to(q.dtype)


# --------------------------------------------------------------------------- the decode step's page bounds

def bounds_buffers(kv_cache: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mins, maxs) [blocks * block_size / page, kv_heads, head_dim], zeros in the cache's dtype: the key
    bounds of every page of ``page`` keys of every physical block, indexed by slot // page (Quest's metadata:
    2 / page of the key rows' bytes, 1 / page of the cache's)."""
    blocks, heads, block_size, width = kv_cache.shape
    shape = (blocks * block_size // page, heads, width // 2)
    return kv_cache.new_zeros(shape), kv_cache.new_zeros(shape)


def write_bounds(mins: torch.Tensor, maxs: torch.Tensor, key: torch.Tensor, slot_mapping: torch.Tensor,
                 page: int) -> None:
    """Widen the bounds of the pages the keys [tokens, kv_heads, head_dim] land in (``write_slots``' slots;
    negative ones skipped): a page's first key resets it, so a freed block reused by another sequence needs
    no clearing. A page's keys arrive in order (its first in this call or an earlier one)."""
    slots = slot_mapping.to(torch.int64)
    key = key[: slots.shape[0]]
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key = slots[keep], key[keep]
    key = key.to(mins.dtype)
    where = slots // page
    opens = slots % page == 0
    mins[where[opens]] = key[opens]
    maxs[where[opens]] = key[opens]
    index = where.view(-1, 1, 1).expand_as(key)
    mins.scatter_reduce_(0, index, key, "amin")
    maxs.scatter_reduce_(0, index, key, "amax")


class SequenceBounds:
    """One sequence's page bounds and prefill list in the form ``paged.select_blocks`` reads (mins, maxs
    [1, kv_heads, pages, d] over its whole blocks of ``block`` keys, kept [1, kv_heads, S]), gathered through
    its block-table row ``row`` from ``bounds_buffers``: 2 / page of its key rows, never the keys."""

    def __init__(self, mins: torch.Tensor, maxs: torch.Tensor, row: torch.Tensor, n: int, block_size: int,
                 block: int, page: int, kept: torch.Tensor):
        per_block = block_size // page
        used = min(-(-n // block_size), row.shape[0])
        pages = -(-n // block) * (block // page)
        ids = row[:used].to(torch.int64)

        def gather(buf):
            part = buf.view(-1, per_block, *buf.shape[1:]).index_select(0, ids)  # [used, per_block, hk, d]
            part = part.reshape(used * per_block, *buf.shape[1:]).transpose(0, 1)  # [hk, pages', d]
            return torch.nn.functional.pad(part, (0, 0, 0, pages - part.shape[1])).unsqueeze(0)
        self.mins, self.maxs = gather(mins), gather(maxs)
        self.kept, self.block, self.page = kept, block, page


class ListedAttention:
    """Attention of one sequence's query q [1, hq, 1, d] over listed blocks of ``block`` keys of a paged cache
    (``paged.listed_step``'s executor): block j is the row's physical blocks j * block / block_size onwards;
    only the listed blocks' rows are read, never the whole sequence. A float32 cache is read in place: the
    listed rows of the engine's buffer seen as one [rows, head_dim] matrix, by one sparse score call and one
    weighted sum for all heads (``cpu_flash.row_scores`` / ``row_sum``, what transformers' step does on its
    cache); other dtypes copy the listed blocks (one row copy each per KV head) and attend the copy."""

    def __init__(self, q, kv_cache: torch.Tensor, row: torch.Tensor, block: int, scale: float):
        self.q, self.kv_cache, self.block, self.scale = q, kv_cache, block, scale
        self.row = row.to(torch.int64)
        self.kv_heads = kv_cache.shape[1]

    def __call__(self, blocks: torch.Tensor, length: torch.Tensor, start: torch.Tensor | None):
        b, hk, L = blocks.shape
        bs = self.kv_cache.shape[2]
        per = self.block // bs  # physical blocks per listed block
        listed = blocks.clamp(min=0).to(torch.int64)
        cols = (listed.unsqueeze(-1) * per + torch.arange(per)).clamp(max=self.row.shape[0] - 1)
        phys = self.row[cols].view(b, hk, L * per)
        pos = (listed.unsqueeze(-1) * self.block + torch.arange(self.block)).flatten(-2)  # [b, hk, L * block]
        valid = (blocks >= 0).unsqueeze(-1).expand(b, hk, L, self.block).flatten(-2) & (pos < length.view(-1, 1, 1))
        if start is not None:
            valid = valid & (pos >= start.view(-1, 1, 1))
        if self.q.dtype == torch.float32 and self.kv_cache.dtype == torch.float32 and self.kv_cache.is_contiguous():
            return self._in_place(phys, valid, length)
        return self._copied(phys, valid)

    def _in_place(self, phys: torch.Tensor, valid: torch.Tensor, length: torch.Tensor):
        from ..methods.common import exp_below_max_
        from ..methods.cpu_flash import CacheRows, row_scores, row_sum
        b, hk, R = valid.shape
        blocks_n, _, bs, width = self.kv_cache.shape
        rows2, d, hq = 2 * bs, width // 2, self.q.shape[1]  # a block's bs key rows, then as many value rows
        g = hq // hk
        # the flat row of (physical block p, KV head h, slot r): (p * hk + h) * 2 bs + r; its value bs further on
        first = (phys * hk + torch.arange(hk).view(1, hk, 1)) * rows2  # [b, hk, L * per]
        rows = (first.unsqueeze(-1) + torch.arange(bs)).view(b, hk, R)
        # a row not attended reads the newest key's row instead (always written; an unwritten row may hold
        # anything, and a weight of 0 times NaN is NaN)
        last = int(length.reshape(-1)[0]) - 1
        newest = ((self.row[last // bs] * hk + torch.arange(hk)) * rows2 + last % bs).view(1, hk, 1)
        rows = torch.where(valid, rows, newest)
        k_rows = rows.unsqueeze(2).expand(b, hk, g, R).reshape(-1)  # each query head reads its KV head's rows
        flat = self.kv_cache.view(blocks_n * hk * rows2, d)
        table = CacheRows(flat, flat, k_rows, k_rows + bs, torch.arange(b * hq + 1) * R, (R,), b * hq)
        s = row_scores(self.q, table, self.scale)[0]  # [b * hq, R]
        hide = ~valid.unsqueeze(2).expand(b, hk, g, R).reshape(b * hq, R)
        s.masked_fill_(hide, float("-inf"))
        top = s.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a row with no key: zeros, lse -inf
        p = exp_below_max_(s, top).masked_fill_(hide, 0.0)
        total = p.sum(-1, keepdim=True)
        out = row_sum(table, [p.div_(total.clamp(min=torch.finfo(torch.float32).tiny))])
        return out.view(b, hq, 1, d), (top + total.log()).view(b, hq, 1)

    def _copied(self, phys: torch.Tensor, valid: torch.Tensor):
        from ..methods.paged import rows_attention
        from ..methods.selection import blocks_of
        b, hk, R = valid.shape
        key_cache, value_cache = split_cache(self.kv_cache)
        bs, d = key_cache.shape[2], key_cache.shape[3]

        def rows(cache):  # each head's listed blocks, one row copy each (quest_step's gather)
            per_head = cache.transpose(0, 1).view(1, hk, cache.shape[0], bs * d)  # [1, hk, blocks, bs * d]
            return blocks_of(per_head.expand(b, -1, -1, -1), phys).view(b, hk, R, d)
        # rows past the sequence (its newest block's unwritten ones) are masked: an engine's cache is zeroed when
        # it is made and holds only keys written since, so they are finite and weigh exactly 0
        return rows_attention(self.q, rows(key_cache), rows(value_cache), valid, self.scale)
