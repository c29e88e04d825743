"""Attention methods. Importing this package registers every method that exists."""
from .base import Method, Param, available_methods, get_method, register_method
from . import exact  # noqa: F401  (registers "exact")
from . import hyper  # noqa: F401  (registers "hyper")
from . import moba  # noqa: F401  (registers "moba")
from . import nsa  # noqa: F401  (registers "nsa")
from . import linear  # noqa: F401  (registers "linear")
from . import performer  # noqa: F401  (registers "performer")
from . import sparse  # noqa: F401  (registers "sparse")

__all__ = ["Method", "Param", "available_methods", "get_method", "register_method"]
