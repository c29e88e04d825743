"""The public functional attention ops, all on the shared layout (see docs/architecture.md)."""
from .methods.common import merge_lse
from .methods.exact import exact_attention
from .methods.hyper import hyper_attention
from .methods.linear import linear_attention
from .methods.moba import moba_attention, moba_chunk_means
from .methods.nsa import NSAAttention, nsa_attention, nsa_compress
from .methods.performer import performer_attention
from .methods.sparse import sparse_attention

__all__ = ["NSAAttention", "exact_attention", "hyper_attention", "linear_attention", "merge_lse", "moba_attention",
           "moba_chunk_means", "nsa_attention", "nsa_compress", "performer_attention", "sparse_attention"]
