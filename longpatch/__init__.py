"""longpatch: patch the attention of pretrained transformers models with fast long-context methods."""
import sys

from . import dependencies

try:  # before anything imports a dependency: an out-of-range one fails deep inside itself otherwise
    dependencies.check()
except dependencies.DependencyError as e:
    if dependencies.cli_invocation():  # the CLI's rule for bad input: one line, exit 2, no traceback
        print(e, file=sys.stderr)
        raise SystemExit(2) from None
    raise

from .assets import demo_model_path
from .cache import GrowingCache
from .config import LoadSpec, PatchConfig, load_config, read_config
from .errors import ConfigError, LongpatchError, UnsupportedModelError
from .loading import from_pretrained, load_model
from .memory import keep_freed_memory
from .patching import PatchReport, patch_model, patched, patched_layers, redraw_buffers, timing, unpatch_model
from .quantized import QuantizedCache
from .specs import Spec, resolve

__version__ = "0.1.0"
__all__ = [
    "ConfigError", "GrowingCache", "LoadSpec", "LongpatchError", "PatchConfig", "PatchReport", "Spec",
    "UnsupportedModelError", "demo_model_path", "from_pretrained", "keep_freed_memory", "load_config", "load_model",
    "patch_model", "patched", "patched_layers", "QuantizedCache",
    "read_config", "redraw_buffers", "resolve", "timing", "unpatch_model",
]
