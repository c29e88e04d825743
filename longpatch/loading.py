"""Loading models for patching: bundled aliases, hub ids or paths, tiny offline models, saved patches."""
from __future__ import annotations

from pathlib import Path

import torch

from .config import CONFIG_FILE, PatchConfig, bundled_configs, load_config
from .errors import ConfigError, LongpatchError
from .patching import patch_model

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TINY_PREFIX = "tiny:"
DEMO = "demo"  # the shipped offline demo model (longpatch.demo.demo_model_path())


def resolve_model_config(name: str, trust_remote_code: bool = False) -> PatchConfig:
    """A model argument as the CLI takes it -> PatchConfig with the loading fields filled.

    A bundled alias (see `longpatch list`) brings its YAML (hub id, dtype, trust_remote_code, method);
    a directory saved by `apply --save` brings its longpatch.yaml; anything else is a hub id or path
    with exact attention, and remote code runs only when trust_remote_code is given explicitly.
    """
    if name in bundled_configs():
        return load_config(name)
    if (Path(name) / CONFIG_FILE).is_file():
        return load_config(name)
    return PatchConfig(model=name, trust_remote_code=trust_remote_code)


def build_config(model: str, config: str | None = None, method: str | None = None, layers=None,
                 sets: list[str] = (), trust_remote_code: bool = False) -> PatchConfig:
    """Merge the CLI's --model, --config, --method, --layers and --set into one PatchConfig.

    The model argument brings the loading fields (and, for an alias, its method); --config replaces
    method/params/layers; --method switches method (dropping the old method's params); --layers and
    --set override last.
    """
    cfg = resolve_model_config(model, trust_remote_code)
    if config:
        file_cfg = load_config(config)
        cfg = file_cfg.replace(model=cfg.model, trust_remote_code=cfg.trust_remote_code or file_cfg.trust_remote_code)
    if method and method != cfg.method:
        cfg = cfg.replace(method=method, params={})
    if layers is not None:
        cfg = cfg.replace(layers=layers)
    return cfg.with_overrides(list(sets)) if sets else cfg


def load_model(cfg: PatchConfig):
    """Load cfg.model (not patched yet). Returns (model, tokenizer or None)."""
    if not cfg.model:
        raise ConfigError("model: no model given; allowed: a bundled alias, a hub id, a local path or tiny:<family>")
    if cfg.model == DEMO:
        from .demo import demo_model_path
        cfg = cfg.replace(model=str(demo_model_path()))
    if cfg.model.startswith(TINY_PREFIX):
        from .testing.tiny import tiny_model
        dtype = _DTYPES.get(cfg.dtype, torch.float32)
        return tiny_model(cfg.model[len(TINY_PREFIX):], attn_implementation=cfg.attn_implementation or "sdpa", dtype=dtype), None
    return _load_hf(cfg)


def _load_hf(cfg: PatchConfig):
    from huggingface_hub.utils import logging as hub_logging
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    hub_logging.set_verbosity_error()  # its retry chatter would bury our one-line error

    kwargs = {"trust_remote_code": cfg.trust_remote_code}
    try:
        hf_config = AutoConfig.from_pretrained(cfg.model, **kwargs)
    except (OSError, ValueError) as e:
        raise LongpatchError(f"model: cannot load {cfg.model!r}: {_first_line(e)}") from None
    is_chatglm = getattr(hf_config, "model_type", "") == "chatglm"
    load_kwargs = dict(kwargs)
    if cfg.dtype != "auto":
        load_kwargs["dtype"] = _DTYPES[cfg.dtype]
    else:
        load_kwargs["dtype"] = "auto"
    if cfg.attn_implementation and not is_chatglm:
        load_kwargs["attn_implementation"] = cfg.attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(cfg.model, **load_kwargs)
    except (OSError, ValueError) as e:
        raise LongpatchError(f"model: cannot load {cfg.model!r}: {_first_line(e)}") from None
    if is_chatglm:
        from .families.chatglm2 import prepare_loaded
        prepare_loaded(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, AttributeError):
        tokenizer = None  # some remote tokenizers break on new transformers; the model still patches
    return model.eval(), tokenizer


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def save_patch(model, cfg: PatchConfig, out_dir: str | Path) -> Path:
    """Write the model's config and longpatch.yaml to out_dir (atomically: a temp dir, then rename)."""
    import shutil
    import tempfile

    import yaml

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise LongpatchError(f"--save: {out} exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        if hasattr(model.config, "save_pretrained"):
            model.config.save_pretrained(tmp)
        (tmp / CONFIG_FILE).write_text("# written by `longpatch apply --save`; re-apply with longpatch.from_pretrained(DIR)\n"
                                       + yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def from_pretrained(path_or_alias: str | Path, **overrides):
    """Load the model a saved patch (or bundled alias) names, and patch it the same way."""
    cfg = load_config(path_or_alias)
    if overrides:
        cfg = cfg.replace(**overrides)
    model, _ = load_model(cfg)
    return patch_model(model, cfg)
