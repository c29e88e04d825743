"""Model families. Specific adapters are registered before the generic transformers one."""
from . import (
    chatglm2,  # noqa: F401
    hf,  # noqa: F401
)
from .base import AttentionCall, Family, available_families, detect_family, register_family

__all__ = ["AttentionCall", "Family", "available_families", "detect_family", "register_family"]
