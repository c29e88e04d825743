"""longpatch: patch the attention of pretrained transformers models with fast long-context methods."""
from .assets import demo_model_path
from .cache import GrowingCache
from .config import LoadSpec, PatchConfig, load_config, read_config
from .errors import ConfigError, LongpatchError, UnsupportedModelError
from .loading import from_pretrained, load_model
from .patching import PatchReport, patch_model, patched, patched_layers, redraw_buffers, timing, unpatch_model
from .specs import Spec, resolve

__version__ = "0.1.0"
__all__ = [
    "ConfigError", "GrowingCache", "LoadSpec", "LongpatchError", "PatchConfig", "PatchReport", "Spec",
    "UnsupportedModelError", "demo_model_path", "from_pretrained", "load_config", "load_model", "patch_model",
    "patched", "patched_layers", "read_config", "redraw_buffers", "resolve", "timing", "unpatch_model",
]
