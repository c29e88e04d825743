"""NSA, Native Sparse Attention (DeepSeek, arXiv 2502.11089), training-free and trainable.

Each query attends through three branches and sums them with gates (g_cmp, g_slc, g_win):

* compressed: keys/values pooled in blocks of ``compress_block`` (l) positions with stride
  ``compress_stride`` (s); block i covers keys [i*s, i*s + l) and a query at position t sees it only
  when it lies wholly at or before t (i*s + l - 1 <= t). Pooling is the mean (training-free) or a
  learned MLP (``NSAAttention``, trainable);
* selected: keys cut into selection blocks of ``select_block`` (l') positions. The importance of
  block j for a query is the compressed attention probability mass of the compressed blocks that
  overlap j, summed over the query heads of the GQA group, so the group shares one selection. The
  ``num_selected`` best blocks are attended to, always including the first ``init_blocks`` blocks
  and the ``local_blocks`` blocks ending with the query's own block (causal inside it);
* window: the last ``window`` keys (t - window, t].

Only causal attention is defined (a query's compressed and selected blocks are chosen among the
past); ``causal=False`` is an error. Positions are bottom-right: query row i of nq sits at
nk - nq + i, so the same op serves prefill, chunked prefill and decoding.

Readable PyTorch twins of the four primitives (``compressed_attention_reference``,
``selection_scores_reference``, ``selected_attention_reference``, ``window_attention_reference``)
plus the shared ``topk_blocks`` define the method; the Triton kernels in ``longpatch.kernels.nsa``
are tested against them, and composed they are the differentiable path (gradients flow through
every branch, the selection itself is discrete as in the paper).

Fast CPU path (no gradient): per (batch, KV head) and per window of query rows, so every
temporary is bounded by the window; the windows are independent units spread over torch's threads
as single-threaded workers (``run_units``), each with its own warm workspace for gathers and GEMMs:

1. compressed: one GEMM [g*rows, d] x [d, visible blocks] for the whole GQA group and one fused
   softmax; the probabilities give the branch output (a second GEMM) and the importance (group sum,
   then a prefix sum read at each selection block's first and last overlapping compressed block),
   then top-k;
2. local blocks: the keys from the start of block (own - local_blocks + 1) up to the query, per
   block of rows as one batched fused call. When the window contains them (window >= select_block
   * local_blocks) this one result is both the selected branch's local part and part of the window;
3. selected, group-centric "varlen" grouping: the other (position, block) pairs are sorted by
   block; the rows of one block are cut into items of T * 2^j rows, and all items of one size are
   one batched fused call over all g heads of their rows, so a block is read once per item
   whatever the group size; parts merge by LSE (the block-sparse executor's row form,
   ``blocksparse.row_sparse_attention``);
4. window: the keys of the window before the local blocks (or the whole window when it does not
   contain them), per chunk of rows as one batched fused call with a shared band mask (strided
   views of the cache, no copy), merged with the local part.

Decoding: ``compressed=(k_cmp, v_cmp)`` (``nsa_compress``) are reused instead of pooling the cache;
the registered method keeps them in the layer state and appends the newly completed blocks (in
place, in buffers with spare room), so a step costs O(compressed + selected + window), not
O(cache). A one-token step (``cpu.decode_one``) reads its selected and window rows in place: one
sparse score call and one weighted sum for all heads and both branches (``cpu_flash.cache_rows``).
"""
from .blocks import DEFAULT_GATES, DEFAULTS, TRAINING_FREE_GATES, nsa_compress, num_compressed, topk_blocks
from .method import NSA, init_state
from .module import NSAAttention
from .naive import (
    compressed_attention_reference,
    nsa_reference,
    selected_attention_reference,
    selection_scores_reference,
    window_attention_reference,
)
from .op import nsa_attention

__all__ = ["DEFAULTS", "DEFAULT_GATES", "NSA", "NSAAttention", "TRAINING_FREE_GATES", "compressed_attention_reference",
           "init_state", "nsa_attention", "nsa_compress", "nsa_reference", "num_compressed",
           "selected_attention_reference", "selection_scores_reference", "topk_blocks", "window_attention_reference"]
