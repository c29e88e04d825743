"""Model families. Specific adapters are registered before the generic transformers one."""
from .base import Family, available_families, detect_family, register_family
from . import chatglm2  # noqa: F401
from . import hf  # noqa: F401

__all__ = ["Family", "available_families", "detect_family", "register_family"]
