"""NSA's parameters and block geometry, shared by the reference (``naive.py``), the fast CPU path
(``cpu.py``) and the op: defaults and gates, parameter checks, compressed-block counts and
visibility, mean pooling (``nsa_compress``), forced blocks and the top-k of selection blocks."""
from __future__ import annotations

import torch

from ...errors import shown
from ..common import (
    acc_dtype,
    ordered_int,
)

DEFAULTS = dict(compress_block=32, compress_stride=16, select_block=64, num_selected=16, window=512,
                init_blocks=1, local_blocks=2)
# NSAAttention's initial gates (trainable sigmoid outputs, so none can start at 0): every branch alike
DEFAULT_GATES = (1 / 3, 1 / 3, 1 / 3)
# Training-free patching of a pretrained model: the mean-pooled compressed branch only ranks the
# selection blocks; mixing its blurred output in costs perplexity (docs/nsa.md, measured). The default
# of both the op and the method, so that nsa_attention(q, k, v) is what the patched layer computes.
TRAINING_FREE_GATES = (0.0, 0.75, 0.25)

# --------------------------------------------------------------------------- parameters

def check_params(compress_block, compress_stride, select_block, num_selected, window, init_blocks, local_blocks):
    """One-line ValueErrors for bad block parameters."""
    for name, val, low in (("compress_block", compress_block, 1), ("compress_stride", compress_stride, 1),
                           ("select_block", select_block, 1), ("num_selected", num_selected, 1),
                           ("window", window, 1), ("init_blocks", init_blocks, 0), ("local_blocks", local_blocks, 0)):
        if not isinstance(val, int) or isinstance(val, bool) or val < low:
            raise ValueError(f"{name} must be an int >= {low}; got {shown(val)}")
    if compress_stride > compress_block:
        raise ValueError(f"compress_stride ({compress_stride}) must be <= compress_block ({compress_block}): "
                         "a larger stride would leave keys out of every compressed block")
    if init_blocks + local_blocks > num_selected:
        raise ValueError(f"num_selected ({num_selected}) must be >= init_blocks + local_blocks "
                         f"({init_blocks} + {local_blocks}): the forced blocks must fit in the selection")


def fit_params(nk: int, compress_block, compress_stride, select_block, num_selected, window, init_blocks,
               local_blocks):
    """The same attention on nk keys with every size at most what nk keys can use, so that the cost is
    bounded by the input whatever a param says (and a 10**23 never reaches torch as an int64): a block
    of nk + 1 keys is as incomplete as any larger one, a window of nk keys is every key, and with as
    many picks as select blocks every block is picked."""
    compress_block = min(compress_block, nk + 1)
    select_block = min(select_block, nk + 1)
    blocks = max(-(-nk // select_block), 1)
    init_blocks, local_blocks = min(init_blocks, blocks), min(local_blocks, blocks)
    return (compress_block, min(compress_stride, compress_block), select_block,
            min(num_selected, max(blocks, init_blocks + local_blocks)), min(window, max(nk, 1)), init_blocks,
            local_blocks)


def num_compressed(kv_len: int, compress_block: int, compress_stride: int) -> int:
    """Number of complete compressed blocks of a kv_len-key sequence."""
    return 0 if kv_len < compress_block else (kv_len - compress_block) // compress_stride + 1


def visible_cmp(pos: torch.Tensor, l: int, s: int) -> torch.Tensor:
    """Compressed blocks visible at absolute positions pos: count of i with i*s + l - 1 <= t."""
    return torch.where(pos >= l - 1, torch.div(pos - (l - 1), s, rounding_mode="floor") + 1, torch.zeros_like(pos))



# --------------------------------------------------------------------------- compression and selection

def nsa_compress(k: torch.Tensor, v: torch.Tensor, *, compress_block: int = 32, compress_stride: int = 16):
    """Mean-pooled compressed keys/values: k/v [b, hk, nk, d] -> [b, hk, nc, d], nc complete blocks
    (block i = keys [i*s, i*s + l)); same dtype as k, summed in float32 (float64 for float64)."""
    if not isinstance(compress_block, int) or compress_block < 1 or not isinstance(compress_stride, int) \
            or not 1 <= compress_stride <= compress_block:
        raise ValueError("need ints 1 <= compress_stride <= compress_block; "
                         f"got {compress_stride!r}, {compress_block!r}")
    if k.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k, v must be [b, kv_heads, n, d] with the same first 3 dims; "
                         f"got {tuple(k.shape)}, {tuple(v.shape)}")
    nc = num_compressed(k.shape[2], compress_block, compress_stride)

    def pool(x):
        if nc == 0:
            return x.new_zeros((*x.shape[:2], 0, x.shape[-1]))
        blocks = x[:, :, : (nc - 1) * compress_stride + compress_block].unfold(2, compress_block, compress_stride)
        return (blocks.sum(-1, dtype=acc_dtype(x.dtype)) / compress_block).to(x.dtype)  # [b, h, nc, d]

    return pool(k), pool(v)


def force_and_mask(imp: torch.Tensor, pos: torch.Tensor, sb: int, init_blocks: int, local_blocks: int):
    """imp [..., r, ns] float32: forced blocks (first init_blocks, and the local_blocks ending with
    the own block) -> +inf; blocks starting after the query -> -inf."""
    ns = imp.shape[-1]
    j = torch.arange(ns, device=imp.device)[None, :]
    own = torch.div(pos, sb, rounding_mode="floor")[:, None]
    forced = (j < init_blocks) | ((j <= own) & (j > own - local_blocks))
    imp = imp.masked_fill(forced, float("inf"))
    return imp.masked_fill(j > own, float("-inf"))


def topk_blocks(scores: torch.Tensor, num_selected: int) -> torch.Tensor:
    """The num_selected best blocks per row of scores [..., ns]: int64 [..., num_selected], sorted
    ascending by block id, -1 (at the end) for empty slots and for blocks scored -inf. Ties go to
    the later block (score and block id form one int64 key), whatever order torch.topk returns."""
    *lead, ns = scores.shape
    kk = min(num_selected, ns)
    blk = torch.arange(ns, device=scores.device)
    idx = torch.full((*lead, num_selected), -1, dtype=torch.long, device=scores.device)
    if kk == 0:
        return idx
    key = (ordered_int(scores).to(torch.int64) << 32) | blk
    pick = torch.topk(key, kk, dim=-1, sorted=False).indices
    ok = scores.gather(-1, pick) > float("-inf")
    pick = torch.where(ok, pick, torch.full_like(pick, ns)).sort(-1).values
    idx[..., :kk] = torch.where(pick == ns, torch.full_like(pick, -1), pick)
    return idx
