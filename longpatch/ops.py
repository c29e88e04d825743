"""The public functional attention ops, all on the shared layout (see docs/architecture.md)."""
from .methods.common import merge_lse
from .methods.exact import exact_attention

__all__ = ["exact_attention", "merge_lse"]
