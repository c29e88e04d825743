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

import logging
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
from .errors import ConfigError, LongpatchError, shown
from .options import parse_layers, parse_names, parse_set

log = logging.getLogger("longpatch")

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


def remote_code_consent(file_load: dict[str, Any], source: str | None, consent: bool) -> dict[str, Any]:
    """A config's loading keys with ``trust_remote_code`` as the person running longpatch decided it.

    A model's own Python files (``auto_map`` in its config.json) run only with that person's consent
    (``--trust-remote-code``, ``trust_remote_code=True`` in Python), as transformers itself asks its
    caller: a config file or a saved directory that says ``trust_remote_code: true`` only says that its
    model needs it, and is refused without consent, since a downloaded folder or a config copied from a
    page would otherwise run code nobody chose to run. A bundled alias keeps its own setting (we ship
    it and name the repository), and says so in the log."""
    load = {k: v for k, v in file_load.items() if k != "trust_remote_code"}
    if consent:
        load["trust_remote_code"] = True
    elif file_load.get("trust_remote_code") is True:
        if source in bundled_configs():
            log.warning("longpatch: the bundled alias %s runs the model repository's own code (%s, "
                        "trust_remote_code: true in the alias)", source, file_load.get("model") or source)
            load["trust_remote_code"] = True
        else:
            raise LongpatchError(f"trust_remote_code: {source} says its model runs its own Python code; longpatch "
                                 "runs it only when you ask: pass --trust-remote-code (trust_remote_code=True in "
                                 "Python) if you trust that model's files")
    return load


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
    # --set trust_remote_code=true is the person at the command line saying so: consent too
    consent = trust_remote_code or load_sets.get("trust_remote_code") is True
    load = remote_code_consent(base.load, model, consent)
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
                if value and not load.get(key):
                    load.update(remote_code_consent({key: value}, name, consent))
            elif key in from_files and from_files[key][0] != value and key not in load_sets:
                raise ConfigError(f"--config: {name} has {key}: {shown(value)} but {from_files[key][1]} has "
                                  f"{shown(from_files[key][0])}; one run loads the model once: choose with "
                                  f"--set {key}=...")
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
