"""MoBA, Mixture of Block Attention (Moonshot AI, arXiv 2502.13189), training-free.

Keys are cut into chunks of ``chunk_size`` positions (chunk c = positions [c*C, (c+1)*C); the last
chunk may be partial). A query q at position p (queries are the last q_len positions, bottom-right)
attends to the union of ``topk`` chunks:

* its own chunk p // C, always, with the causal mask inside it (keys <= p);
* the top (topk - 1) *past* chunks by the gate score ``scale * q . mean(keys of the chunk)``.
  Future chunks are never candidates. Nothing is learned: the gate is a mean-pooled key per chunk.

The output is the exact softmax over that union, computed as one attention per selected chunk and an
LSE merge of the parts. ``topk = 1`` is the own chunk only; ``topk >= number of chunks`` is exact
causal attention. Ties of the gate score are broken towards the more recent chunk (larger index):
the score and the chunk index form one int64 key, so the selected set never depends on how
``torch.topk`` orders equal values. See docs/moba.md for non-causal mode, GQA modes and decoding.

CPU formulation (the ``torch`` backend). Everything runs per (batch, KV head) and per window of
query positions, so temporary memory is bounded by a few window-sized buffers:

1. gate: scores [heads, rows, n_chunks] = q . means^T (n x n/C, never n x n); selection by top-k
   over int64 keys;
2. own chunks: one batched call of torch's fused CPU flash-attention kernel over all aligned chunk
   squares (causal), plus at most two odd pieces (a misaligned first chunk when decoding, a partial
   last chunk);
3. past chunks ("varlen" grouping): every (query head, position, selected chunk) triple is a pair;
   pairs are sorted by chunk, the query rows gathered once, and each chunk gets ONE fused attention
   call over all rows of the KV group (any query head) that selected it, so a K/V chunk is read once
   per window whatever the number of heads or queries routing to it (the block-sparse executor's
   row form, ``blocksparse.row_sparse_attention``);
4. merge by LSE per (row, head), the own chunk's part included.

Gradients: a custom autograd function recomputes the blocks in plain PyTorch with the final LSE
(dS = P * (dP - D + dLSE)), so the output and the returned LSE are both differentiable. The gate
(selection and chunk means) carries no gradient, as in MoBA.

Decoding (q_len < kv_len): queries choose among the full chunks of the cache before their own
chunk; the chunk means live in the patched layer's ``state`` (computed once per chunk, checked
against the cache every step) or come as ``chunk_means``. A single token per head takes
``decode_one``: cost O(topk * C * d) plus an O(n / C * d) gate, not O(n * d); its selected rows
are read in place by two sparse calls for all heads (``cpu_flash.attend_rows``).

The Triton backend (``longpatch.kernels.moba``) runs the same pairs, own chunk included, in one
block-sparse kernel (forward with LSE and backward) and merges in PyTorch.
"""
from .cpu import DEFAULT_CHUNK_SIZE, DEFAULT_TOPK, moba_chunk_means
from .method import MOBA, init_state
from .naive import moba_reference, pairs_attention_reference
from .op import moba_attention, selection_pairs

__all__ = ["DEFAULT_CHUNK_SIZE", "DEFAULT_TOPK", "MOBA", "init_state", "moba_attention", "moba_chunk_means",
           "moba_reference", "pairs_attention_reference", "selection_pairs"]
