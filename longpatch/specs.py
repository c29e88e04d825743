"""From options to specs, once: every command and Python entry point turns its model argument, --config
(a list), --method, --layers and --set into one LoadSpec (what to load and how) and one PatchConfig
per config (how to patch) here, with `resolve`.

Precedence, lowest first: the model argument (a bundled alias or a saved patch directory brings its
YAML: loading keys and a patch; anything else is a hub id or path with exact attention), each config
file (its patch replaces the model's; its loading keys fill in, but never change which model), then
--method (a different method starts from its defaults), --layers, and --set last (loading keys go to
the LoadSpec, every other key to each patch).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .config import (
    CONFIG_FILE,
    LOAD_KEYS,
    ConfigFile,
    LoadSpec,
    PatchConfig,
    bundled_configs,
    check_runnable,
    read_config,
)
from .errors import ConfigError, LongpatchError
from .options import parse_layers, parse_names, parse_set

# the weight files `apply --save` writes beside longpatch.yaml (any one of them)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class Spec:
    """What a command runs: the model to load, and one patch per config (labelled by the config as given;
    None when no --config was given)."""

    load: LoadSpec
    patches: tuple[tuple[str | None, PatchConfig], ...]

    @property
    def patch(self) -> PatchConfig:
        """The patch of a command that applies one (apply, from_pretrained)."""
        if len(self.patches) != 1:
            raise ConfigError(f"--config: got {len(self.patches)} configs ("
                              f"{', '.join(str(n) for n, _ in self.patches)}); this command applies one")
        return self.patches[0][1]


def model_config(name: str) -> ConfigFile:
    """The model argument as every command takes it: a bundled alias (its YAML), a directory saved by
    `apply --save` (its longpatch.yaml, loading the weights beside it), or a hub id / local path / demo /
    tiny:<family> with exact attention."""
    if name in bundled_configs():
        return read_config(name)
    if (Path(name) / CONFIG_FILE).is_file():
        return saved_config(name)
    return ConfigFile({"model": name}, PatchConfig())


def saved_config(path: str | Path) -> ConfigFile:
    """The config of a directory written by `apply --save`, loading the weights saved beside it (the yaml's
    `model` records where they came from, not what to load: weights that are gone are an error, never
    silently the original or random weights)."""
    file = read_config(path)
    if not any((Path(path) / f).is_file() for f in WEIGHT_FILES):
        raise LongpatchError(f"model: {Path(path) / WEIGHT_FILES[0]} is missing (and so are "
                             f"{', '.join(WEIGHT_FILES[1:])}): {path} has a {CONFIG_FILE} but not the weights "
                             f"`apply --save` wrote beside it; save it again, or load the original with "
                             f"--model {file.load.get('model') or '<model>'} --config {Path(path) / CONFIG_FILE}")
    return ConfigFile(dict(file.load, model=str(path)), file.patch)


def split_sets(sets: Sequence) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """--set pairs -> (loading keys, the patch's (key, value) pairs in order). The model is --model's."""
    load, patch = {}, []
    for pair in sets:
        key, value = parse_set(pair) if isinstance(pair, str) else pair
        if key == "model":
            raise ConfigError("--set model: the model is the model argument (--model); allowed here: "
                              f"{', '.join(k for k in LOAD_KEYS if k != 'model')} or a patch key / method param")
        (patch.append((key, value)) if key not in LOAD_KEYS else load.__setitem__(key, value))
    return load, patch


def resolve(model: str | None, config=None, method: str | None = None, layers=None, sets: Sequence = (), *,
            trust_remote_code: bool = False, device_map: str | None = None,
            tokenizer: str | None = None) -> Spec:
    """The one way from options to specs (see the module's docstring for the precedence).

    model: what --model takes, or None for a model the caller loaded itself (only patches are resolved).
    config: None, a config (path, alias or PatchConfig), a comma-separated list 'a,b' or a list of them.
    layers: --layers (options.parse_layers: N, 'all', or layer indices), replacing every config's.
    sets: --set 'key=value' strings (options.parse_set) or (key, value) pairs.
    Settings this machine cannot run are refused here, before anything is loaded.
    """
    base = model_config(model) if model is not None else ConfigFile({}, PatchConfig())
    load_sets, patch_sets = split_sets(sets)
    load = dict(base.load)
    from_files: dict[str, tuple[Any, str]] = {}  # loading key -> (value, the config that set it)
    patches: list[tuple[str | None, PatchConfig]] = []
    for name in config_items(config):
        if name is None or isinstance(name, PatchConfig):
            file = ConfigFile({}, base.patch if name is None else name)
            name = None
        else:
            file = read_config(name)
        for key, value in file.load.items():
            if key == "model":  # the config's model is where it was written for, not what this run loads
                continue
            if key == "trust_remote_code":
                load[key] = bool(load.get(key)) or value
            elif key in from_files and from_files[key][0] != value and key not in load_sets:
                raise ConfigError(f"--config: {name} has {key}: {value!r} but {from_files[key][1]} has "
                                  f"{from_files[key][0]!r}; one run loads the model once: choose with --set {key}=...")
            else:
                load[key] = value
                from_files[key] = (value, name)
        cfg = file.patch
        if method and method != cfg.method:
            cfg = cfg.replace(method=method, params={})  # another method's params mean nothing to this one
        if layers is not None:
            cfg = cfg.replace(layers=parse_layers(layers) if isinstance(layers, str) else layers)
        patches.append((name, cfg.with_overrides(patch_sets) if patch_sets else cfg))
    load.update(load_sets)
    if trust_remote_code:
        load["trust_remote_code"] = True
    if device_map is not None:
        load["device_map"] = device_map
    if tokenizer is not None:
        load["tokenizer"] = tokenizer
    spec = Spec(LoadSpec.from_dict(load), tuple(patches))
    check_runnable(spec.load, [p for _, p in spec.patches])
    return spec


def config_items(config) -> list:
    """--config as a list: [None] (no config), [a PatchConfig], or the names of a comma-separated list."""
    if config is None or isinstance(config, PatchConfig):
        return [config]
    if isinstance(config, (str, Path)):
        return parse_names("--config", str(config), "a config file or bundled alias, or a comma-separated list")
    if isinstance(config, (list, tuple)):
        return [c if isinstance(c, PatchConfig) else str(c) for c in config] or [None]
    raise ConfigError(f"config: got a {type(config).__name__}; allowed: a config file or alias, a comma-separated "
                      "list of them, a list, or a PatchConfig")
