"""Attention methods. Importing this package registers every method that exists."""
from . import (
    exact,  # noqa: F401  (registers "exact")
    hyper,  # noqa: F401  (registers "hyper")
    linear,  # noqa: F401  (registers "linear")
    moba,  # noqa: F401  (registers "moba")
    nsa,  # noqa: F401  (registers "nsa")
    performer,  # noqa: F401  (registers "performer")
    sparse,  # noqa: F401  (registers "sparse")
)
from .base import BoundMethod, Method, Param, available_methods, get_method, register_method

__all__ = ["BoundMethod", "Method", "Param", "available_methods", "get_method", "register_method"]
