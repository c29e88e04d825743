"""PatchConfig: what to patch, with what, and how to load the model; validated on construction."""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import yaml

from .errors import ConfigError, check_int, shown
from .methods import available_methods, get_method
from .yamlio import load_yaml

DTYPES = ("auto", "float32", "float16", "bfloat16")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
BACKENDS = ("auto", "torch", "triton", "flex")
CONFIG_FILE = "longpatch.yaml"  # written beside a saved model by `longpatch apply --save`


PATCH_DOC = "method, params, layers, min_seq_len, backend, family, layer_params"


@dataclass
class PatchConfig:
    """The patch spec: which method, with which params, in which layers.

    layers: an int N (the last N layers; 0 = none), a list of 0-based layer indices, or "all".
    min_seq_len: prefill calls shorter than this use exact attention in patched layers.
    layer_params: per-layer changes to params, {0-based layer index: {param: value}} (what
    ``longpatch calibrate`` writes); patch_model refuses an index past the model's layers and warns of
    entries for layers the patch does not replace.
    backend: auto, torch, triton or flex (FlexAttention: the block-sparse methods). family: force a model
    family (default: detected from the model).
    How the model is loaded (model, dtype, ...) is a LoadSpec; a YAML config file may hold both halves
    (read_config splits them).
    """

    method: str = "exact"
    params: dict[str, Any] = field(default_factory=dict)
    layers: int | list[int] | str = "all"
    min_seq_len: int = 0
    backend: str = "auto"
    family: str | None = None
    layer_params: dict[int, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self):
        _check_type("method", self.method, str, "a method name")
        self.params = dict(get_method(self.method).resolve_params(_mapping("params", self.params)))
        self.layer_params = _check_layer_params(self.method, self.params, self.layer_params)
        self.layers = _check_layers(self.layers)
        _check_type("min_seq_len", self.min_seq_len, int, "an int >= 0")
        if self.min_seq_len < 0:
            raise ConfigError(f"min_seq_len: got {self.min_seq_len}; allowed: an int >= 0")
        _check_choice("backend", self.backend, BACKENDS)
        if self.backend == "flex":
            from .methods.flex import flex_refusal
            for layer in (None, *self.layer_params):
                why = flex_refusal(self.method, self.params_of(layer))
                if why:
                    where = "" if layer is None else f" in layer {layer} (layer_params)"
                    raise ConfigError(f"backend: got 'flex', but {why}{where}; allowed: auto, torch, triton")
        if self.family is not None:
            from .families import available_families  # lazy: the families import transformers
            _check_type("family", self.family, str, "a family name (see `longpatch list`)")
            _check_choice("family", self.family, tuple(available_families()))

    def params_of(self, layer: int | None) -> dict[str, Any]:
        """The params layer ``layer`` runs with: params, changed by its layer_params entry (None: params)."""
        return {**self.params, **self.layer_params.get(layer, {})}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PatchConfig":
        data = _mapping("config", data)
        _check_keys(data, {f.name for f in dataclasses.fields(cls)})
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "PatchConfig":
        return PatchConfig.from_dict({**self.to_dict(), **changes})

    def with_overrides(self, pairs: "list[str] | list[tuple[str, Any]]") -> "PatchConfig":
        """Apply --set overrides (`key=value` strings, or (key, value) pairs): a patch key, or a method param
        named bare or as params.NAME. Loading keys belong to LoadSpec (specs.resolve routes them)."""
        from .options import parse_set

        data = self.to_dict()
        method_keys = set(get_method(data["method"]).params)
        for pair in pairs:
            key, value = parse_set(pair) if isinstance(pair, str) else pair
            if key.startswith("params."):
                data["params"][key[len("params."):]] = value
            elif key in data:
                data[key] = value
            elif key in method_keys:
                data["params"][key] = value
            else:
                allowed = ", ".join(sorted(set(data) | method_keys | set(LOAD_KEYS)))
                raise ConfigError(f"--set {key}: unknown key; allowed: {allowed}")
        return PatchConfig.from_dict(data)


def prefill_chunk_multiple(cfg: PatchConfig) -> int:
    """What a chunked prefill's chunk size must be a multiple of for every patched layer of ``cfg`` to run
    its method on the chunks (the least common multiple of the methods' ``chunk_block``; 1: any size)."""
    method = get_method(cfg.method)
    multiple = 1
    for layer in (None, *cfg.layer_params):
        params = method.resolve_params(cfg.params_of(layer))
        block = None if method.chunk_block is None else method.chunk_block(params)
        multiple = math.lcm(multiple, block or 1)
    return multiple


def check_prefill_chunk(cfg: "PatchConfig | None", chunk: int | None, name: str = "--prefill-chunk") -> None:
    """One line for a chunk size the patch cannot run chunked: not an int >= 1, or not a multiple of the
    methods' block (``prefill_chunk_multiple``). None (no chunking) passes."""
    if chunk is None:
        return
    check_int(name, chunk, 1)
    multiple = 1 if cfg is None else prefill_chunk_multiple(cfg)
    if chunk % multiple:
        raise ConfigError(f"{name}: got {chunk}; allowed: a multiple of {multiple} (method '{cfg.method}' selects "
                          f"blocks of {multiple} keys, and each chunk must start on one)")


LOAD_KEYS = ("model", "dtype", "trust_remote_code", "attn_implementation", "device_map", "tokenizer")


@dataclass(frozen=True)
class LoadSpec:
    """The load spec: which model and how to load it.

    model: a hub id, a local path, 'demo' or tiny:<family> (what a bundled alias names). dtype: auto,
    float32, float16 or bfloat16. trust_remote_code: run the model repository's code.
    attn_implementation: sdpa, eager or flash_attention_2 (None: transformers' choice). device_map:
    'auto' spreads the model over this machine's GPUs. tokenizer: a name or path, or 'bytes'
    (None: the model's own).
    """

    model: str | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    device_map: str | None = None
    tokenizer: str | None = None

    def __post_init__(self):
        if self.model is not None:
            _check_type("model", self.model, str, "a hub id, a local path or a bundled alias")
        _check_choice("dtype", self.dtype, DTYPES)
        _check_type("trust_remote_code", self.trust_remote_code, bool, "true or false")
        if self.attn_implementation is not None:
            _check_choice("attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)
        if self.device_map is not None:
            _check_choice("device_map", self.device_map, ("auto",))
        if self.tokenizer is not None:
            _check_type("tokenizer", self.tokenizer, str, "a tokenizer name or path, or 'bytes'")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LoadSpec":
        data = _mapping("config", data)
        _check_keys(data, set(LOAD_KEYS))
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "LoadSpec":
        return LoadSpec.from_dict({**self.to_dict(), **changes})


@dataclass(frozen=True)
class ConfigFile:
    """A YAML config as written: its loading half (only the keys it names) and its patch."""

    load: dict[str, Any]
    patch: PatchConfig


def split_config(data: dict[str, Any]) -> ConfigFile:
    """A config mapping (YAML file, saved longpatch.yaml) -> its loading keys (checked) and its PatchConfig."""
    data = _mapping("config", data)
    _check_keys(data, set(LOAD_KEYS) | {f.name for f in dataclasses.fields(PatchConfig)})
    load = {k: v for k, v in data.items() if k in LOAD_KEYS}
    LoadSpec.from_dict(load)  # checked now, with the file's own values
    return ConfigFile(load, PatchConfig.from_dict({k: v for k, v in data.items() if k not in LOAD_KEYS}))


def _check_keys(data: dict, known: set[str]) -> None:
    unknown = sorted(set(data) - known)
    if not unknown:
        return
    key = unknown[0]
    if key in LOAD_KEYS:
        raise ConfigError(f"{key}: a loading key (LoadSpec: {', '.join(LOAD_KEYS)}), not a patch key ({PATCH_DOC}); "
                          "give it to load_model, or put both halves in a YAML config")
    raise ConfigError(f"{key}: unknown config key; allowed: {', '.join(sorted(known))}")


def as_config(cfg: "PatchConfig | dict | str | Path") -> PatchConfig:
    """Accept a PatchConfig, a plain dict, or a YAML path / bundled alias."""
    if isinstance(cfg, PatchConfig):
        return cfg
    if isinstance(cfg, dict):  # a patch: a loading key here would be dropped silently, so it is refused
        return PatchConfig.from_dict(cfg)
    if isinstance(cfg, (str, Path)):
        return load_config(cfg)
    raise ConfigError(f"config: got a {type(cfg).__name__}; allowed: PatchConfig, dict, or a YAML path/alias")


def load_config(path_or_alias: str | Path) -> PatchConfig:
    """The patch of a YAML file, a directory saved by `longpatch apply --save`, or a bundled alias (its
    loading keys are checked and left out: read_config has both halves)."""
    return read_config(path_or_alias).patch


def read_config(path_or_alias: str | Path) -> ConfigFile:
    """Read a YAML file, a directory saved by `longpatch apply --save`, or a bundled alias."""
    path = Path(path_or_alias)
    alias = bundled_configs().get(str(path_or_alias))
    if alias is not None and _bare_name(path_or_alias):
        # a bare alias means the alias, whatever the working directory holds (`longpatch demo --out demo`
        # writes a folder "demo"); a path written as one (./demo) means the path
        if path.exists():
            logging.getLogger("longpatch").warning(
                "longpatch: %s is the bundled alias here; for the %s of that name write ./%s",
                path_or_alias, "folder" if path.is_dir() else "file", path_or_alias)
        path = alias
    elif path.is_dir():
        path = path / CONFIG_FILE
        if not path.is_file():
            raise ConfigError(f"config: {path_or_alias} has no {CONFIG_FILE}; was it saved with "
                              "`longpatch apply --save`?")
    elif not path.is_file():
        if alias is None:
            raise ConfigError(f"config: {str(path_or_alias)!r} is neither a file nor a bundled alias; "
                              f"aliases: {', '.join(bundled_configs())}")
        path = alias
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config: {path} is not UTF-8 text (byte {e.start}); allowed: a UTF-8 YAML file") from None
    except OSError as e:
        raise ConfigError(f"config: cannot read {path}: {e.strerror or e}") from None
    try:
        # measured before anything is built from it: a few hundred bytes of nested aliases can stand for
        # billions of values, which the checks and the error messages below would walk
        data = load_yaml(text, f"config: {path}")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config: malformed YAML in {path}{where}: {getattr(e, 'problem', e)}") from None
    if data is None:
        raise ConfigError(f"config: {path} is empty; allowed: a mapping with at least `method:` (see `longpatch list`)")
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a mapping of keys, got {type(data).__name__}")
    if "method" not in data:
        # PatchConfig's default method is exact: a file that forgot it would silently patch nothing useful
        raise ConfigError(f"config: {path} has no 'method' key; allowed methods: {', '.join(available_methods())}")
    return split_config(data)


def _bare_name(name: str | Path) -> bool:
    """Whether a name is written as a bare word (``demo``), not as a path (``./demo``, ``dir/demo``)."""
    text = str(name)
    return isinstance(name, str) and not text.startswith(".") and "/" not in text and os.sep not in text


def check_runnable(load: "LoadSpec | None", patches: "Sequence[PatchConfig]" = ()) -> None:
    """Refuse, before any model is loaded, settings this machine cannot run (they would otherwise fail
    deep inside a forward pass, after minutes of loading)."""
    if load is not None and load.attn_implementation == "flash_attention_2":
        from transformers.utils import is_flash_attn_2_available
        if not is_flash_attn_2_available():
            raise ConfigError("attn_implementation: got 'flash_attention_2', but the flash-attn package or a CUDA "
                              "GPU is missing here; allowed here: sdpa, eager")
    if any(p.backend == "triton" for p in patches):
        from .methods.common import triton_available
        if not triton_available():
            raise ConfigError("backend: got 'triton', but the triton package is not installed; allowed here: auto, "
                              "torch (or pip install 'longpatch[triton]')")
        import torch
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("backend: got 'triton', but there is no CUDA GPU and TRITON_INTERPRET=1 is not set "
                              "(Triton's CPU interpreter); allowed here: auto, torch")


def bundled_configs() -> dict[str, Path]:
    """alias -> path of the YAML files shipped in longpatch.configs."""
    root = resources.files("longpatch.configs")
    return {Path(p.name).stem: Path(str(p)) for p in sorted(root.iterdir(), key=lambda p: p.name)
            if p.name.endswith(".yaml")}


def _mapping(key, value):
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: got {shown(value)}; allowed: a mapping")
    return value


def _check_type(key, value, typ, allowed):
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: got {shown(value)}; allowed: {allowed}")


def _check_choice(key, value, choices):
    if value not in choices:
        raise ConfigError(f"{key}: got {shown(value)}; allowed: {', '.join(choices)}")


_LAYERS_ALLOWED = "an int N >= 0 (the last N layers), a list of 0-based layer indices, or 'all'"


def _check_layer_params(method: str, params: dict, layer_params) -> dict[int, dict[str, Any]]:
    """{layer: {param: value}} with each layer's whole set of params valid for ``method`` (only the
    changes are kept, so a config written back stays as short as it was)."""
    out = {}
    for layer, changes in _mapping("layer_params", layer_params).items():
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ConfigError(f"layer_params: got the key {shown(layer)}; allowed: 0-based layer indices (ints >= 0)")
        changes = _mapping(f"layer_params.{layer}", changes)
        try:
            get_method(method).resolve_params({**params, **changes})
        except ConfigError as e:  # "params.topk: ..." -> "layer_params.3.topk: ..."
            msg = str(e)
            msg = msg[len("params."):] if msg.startswith("params.") else msg
            raise ConfigError(f"layer_params.{layer}.{msg}") from None
        out[layer] = dict(changes)
    return dict(sorted(out.items()))


def _check_layers(layers):
    if layers == "all":
        return layers
    if isinstance(layers, int) and not isinstance(layers, bool) and layers >= 0:
        return layers
    if isinstance(layers, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                 for i in layers):
        if len(set(layers)) != len(layers):
            raise ConfigError(f"layers: got {shown(list(layers))} with repeated indices; allowed: {_LAYERS_ALLOWED}")
        return sorted(layers)
    raise ConfigError(f"layers: got {shown(layers)}; allowed: {_LAYERS_ALLOWED}")


def select_layers(layers, num_layers: int) -> list[int]:
    """Resolve a layers spec against a model with `num_layers` layers (error, never a silent clamp)."""
    if layers == "all":
        return list(range(num_layers))
    if isinstance(layers, int):
        if layers > num_layers:
            raise ConfigError(f"layers: got {layers}, but the model has {num_layers} layers; allowed: "
                              f"0..{num_layers}, a list of indices, or 'all'")
        return list(range(num_layers - layers, num_layers))
    bad = [i for i in layers if i >= num_layers]
    if bad:
        raise ConfigError(f"layers: index {bad[0]} is out of range; the model has {num_layers} layers "
                          f"(0..{num_layers - 1})")
    return list(layers)
