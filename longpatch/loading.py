"""Loading models for patching: bundled aliases, hub ids or paths, tiny offline models, saved patches."""
from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch

from .config import CONFIG_FILE, LoadSpec, PatchConfig, bundled_configs, check_runnable
from .errors import ConfigError, LongpatchError, UnsupportedModelError
from .patching import REPORT_ATTR, patch_model, unpatch_model
from .specs import model_config, remote_code_consent, resolve

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TINY_PREFIX = "tiny:"
DEMO = "demo"  # the shipped offline demo model (longpatch.assets.demo_model_path())


def load_model(model: "str | LoadSpec | dict", **overrides):
    """Load a model, unpatched: `model, tokenizer = longpatch.load_model("tiny:llama")`.

    model: what `--model` takes (a bundled alias, a hub id, a local model directory, a directory saved
        by `longpatch apply --save`, "demo", or tiny:<family>), or a LoadSpec / dict of its keys.
    overrides: LoadSpec fields to change first, e.g. dtype="bfloat16", trust_remote_code=True.
    Returns (model in eval mode, its tokenizer or None: tiny models have none, and some remote-code
    tokenizers fail on current transformers). Patch it with patch_model(model, cfg) afterwards.
    """
    if isinstance(model, str):  # a file's trust_remote_code is not consent: only the caller's is
        load = LoadSpec.from_dict(remote_code_consent(model_config(model).load, model,
                                                      overrides.get("trust_remote_code") is True))
    elif isinstance(model, dict):
        load = LoadSpec.from_dict(model)
    elif isinstance(model, LoadSpec):
        load = model
    else:
        raise ConfigError(f"model: got a {type(model).__name__}; allowed: a model name or path, a LoadSpec or a dict")
    if overrides:
        load = load.replace(**overrides)
    check_runnable(load)
    if not load.model:
        raise ConfigError("model: no model given; allowed: a bundled alias, a hub id, a local path or tiny:<family>")
    if load.model == DEMO:
        from .assets import demo_model_path
        load = load.replace(model=str(demo_model_path()))
    if load.model in shipped_architectures() and not Path(load.model).exists():
        raise ConfigError(f"model: {load.model} is a shipped architecture without weights; allowed: "
                          f"--random-weights (bench generate), or the real model's hub id or directory")
    if load.model.startswith(TINY_PREFIX):
        from .testing.tiny import tiny_model
        dtype = _DTYPES.get(load.dtype, torch.float32)
        model = tiny_model(load.model[len(TINY_PREFIX):], attn_implementation=load.attn_implementation or "sdpa",
                           dtype=dtype)
        return model, None
    return _load_hf(load)


ARCH_OVERRIDES = "LONGPATCH_ARCH_OVERRIDES"  # test-only: JSON of config keys that shrink a shipped architecture


def shipped_architectures() -> dict[str, Path]:
    """name -> directory of the config.json shipped in longpatch/assets/architectures (no weights)."""
    from importlib import resources

    root = Path(str(resources.files("longpatch") / "assets" / "architectures"))
    return {p.name: p for p in sorted(root.iterdir()) if (p / "config.json").is_file()} if root.is_dir() else {}


def random_model(name: str, dtype: str = "auto", device: "str | torch.device" = "cpu", overrides: dict | None = None):
    """A shipped architecture (``shipped_architectures``) with random weights, built offline directly on
    ``device``: the real model's layers, heads, RoPE and vocabulary, so that its costs are the real
    model's (a fixed-budget selection costs the same whatever the weights). dtype "auto": bfloat16 on
    CUDA, float32 on the CPU. ``overrides`` (or the JSON in $LONGPATCH_ARCH_OVERRIDES): config keys to
    change first, for tests and dry runs (e.g. {"num_hidden_layers": 2, "hidden_size": 256}).
    Returns (model in eval mode, None: no tokenizer)."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    archs = shipped_architectures()
    if name not in archs:
        raise ConfigError(f"--random-weights: no shipped architecture {name!r}; allowed: {', '.join(archs)}")
    cfg = AutoConfig.from_pretrained(archs[name])
    extra = overrides if overrides is not None else json.loads(os.environ.get(ARCH_OVERRIDES) or "{}")
    for key, value in extra.items():
        setattr(cfg, key, value)
    device = torch.device(device)
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype: got {dtype!r}; allowed: auto, {', '.join(_DTYPES)}")
    torch.manual_seed(0)  # the same weights every run
    with device:  # parameters created and initialised on the device: no host copy of 16 GB
        model = AutoModelForCausalLM.from_config(cfg, dtype=_DTYPES[dtype], attn_implementation="sdpa")
    return model.eval(), None


def _load_hf(cfg: LoadSpec):
    from huggingface_hub.utils import logging as hub_logging
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    hub_logging.set_verbosity_error()  # its retry chatter would bury our one-line error

    _check_reachable(cfg.model)
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
    except Exception as e:  # a damaged or refused weight file, which transformers lets through as a traceback
        why = _weights_problem(cfg.model, e)
        if why is None:
            raise
        raise LongpatchError(why) from None
    if is_chatglm:
        from .families.chatglm2 import prepare_loaded
        prepare_loaded(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, AttributeError):
        tokenizer = None  # some remote tokenizers break on new transformers; the model still patches
    return model.eval(), tokenizer


def _check_reachable(name: str, what: str = "model", marker: str = "config.json",
                     allowed: str = "a model directory, a hub id or a bundled alias") -> None:
    """Fail in one line, at once, where transformers would retry for half a minute or blame a hub id.
    what: the option named in the error; marker: a file every cached copy of such a repo has."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise LongpatchError(f"{what}: {name} is a file; allowed: {allowed}")
        return
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name:  # hub ids are NAME or OWNER/NAME
        raise LongpatchError(f"{what}: {name}: no such directory")
    from huggingface_hub import try_to_load_from_cache
    try:
        cached = isinstance(try_to_load_from_cache(name, marker), str)
    except Exception:  # an id the hub would reject: let transformers word that error
        return
    reason = None if cached else hub_unreachable()
    if reason:
        raise LongpatchError(f"{what}: cannot load {name!r}: it is not in the local cache and {reason}")


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be asked right now, or None. A two-second connection probe: without
    it an offline machine spends ~25 s in huggingface_hub's retries before failing."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # the proxy, not us, connects: let huggingface_hub try
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=2).close()
    except OSError as e:
        return f"the hub cannot be reached ({constants.ENDPOINT}: {e.strerror or e})"
    return None


BYTES = "bytes"  # --tokenizer bytes: ByteTokenizer


class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255), chosen with --tokenizer bytes / tokenizer='bytes'. Only for models
    with a vocabulary of at least 256 whose ids mean nothing in particular, such as the tiny:* test models.
    It has what the evaluations call: encode, __call__ (with character offsets), decode and len()."""

    name_or_path = BYTES
    eos_token_id = pad_token_id = None

    def __len__(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def __call__(self, text: str, add_special_tokens: bool = True, return_offsets_mapping: bool = False,
                 **_) -> dict:
        out = {"input_ids": self.encode(text)}
        if return_offsets_mapping:  # every byte of a character maps to that character
            out["offset_mapping"] = [(i, i + 1) for i, ch in enumerate(text) for _ in range(len(ch.encode("utf-8")))]
        return out

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def resolve_tokenizer(given=None, loaded=None, model_name: str | None = None, trust_remote_code: bool = False):
    """The tokenizer of every evaluation: `given` (--tokenizer / tokenizer=: 'bytes', a name or path, or an
    object), else the one loaded with the model, else the model's name looked up (model_name None: nothing
    to look up, e.g. a model object without a name); one line when there is none. 'bytes' for a model that
    came with its own tokenizer is an error: its ids would mean other tokens, and every score would be noise."""
    if given == BYTES and loaded is not None and not isinstance(loaded, ByteTokenizer):
        raise ConfigError(f"--tokenizer bytes: {model_name or 'the model'} comes with its own tokenizer "
                          f"({getattr(loaded, 'name_or_path', '') or type(loaded).__name__}), which its ids mean; "
                          "allowed: that tokenizer (leave --tokenizer out), or 'bytes' only for models without one "
                          "(tiny:*)")
    if isinstance(given, str):
        return load_tokenizer(given, trust_remote_code)
    if given is not None:
        return given
    if loaded is not None:
        return loaded
    if model_name and not str(model_name).startswith(TINY_PREFIX):
        return load_tokenizer(model_name, trust_remote_code)
    raise ConfigError(f"tokenizer: {model_name or 'the loaded model'} comes without a tokenizer; pass one "
                      "(--tokenizer NAME_OR_PATH, or tokenizer= in Python: a hub id, a saved tokenizer directory or "
                      "a loaded tokenizer), or 'bytes' (UTF-8 bytes as ids; only for models with a vocabulary of at "
                      "least 256, such as the tiny:* test models)")


def load_tokenizer(name: str, trust_remote_code: bool = False):
    """AutoTokenizer.from_pretrained(name), failing in one line: a path that is not a directory, a hub id
    that is neither cached nor reachable (at once, as for models), or what transformers says (its first
    line). 'bytes' is the ByteTokenizer."""
    from transformers import AutoTokenizer

    if name == BYTES:
        return ByteTokenizer()
    _check_reachable(name, "tokenizer", "tokenizer_config.json", "a tokenizer directory, a hub id or 'bytes'")
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise LongpatchError(f"tokenizer: cannot load {name!r}: {_first_line(e)}") from None


_DAMAGED = ("allowed: complete weight files (a download or a copy cut short leaves a truncated file: fetch or "
            "save the model again)")


def _weights_problem(model: str, e: Exception) -> str | None:
    """The one-line error of a weight file that cannot be read, from the exception loading it raised: a
    truncated or damaged safetensors file, a PyTorch checkpoint (.bin) cut short, or one holding objects
    torch's safe loader (weights_only=True, which transformers uses) refuses to unpickle. It names the file
    when `model` is a directory (the first of its weight files that fails on its own); None: `e` is not a
    weight file's problem (the caller re-raises it)."""
    import pickle

    from safetensors import SafetensorError

    text = str(e)
    if isinstance(e, SafetensorError):
        kind, what = "*.safetensors", f"a truncated or damaged safetensors file ({_first_line(e)}); {_DAMAGED}"
    elif isinstance(e, pickle.UnpicklingError):
        # torch's message is a page of advice; its one line of substance names the refused object
        detail = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                       if line.strip().startswith("WeightsUnpickler error:")), _first_line(e))
        detail = detail.split(". Please use", 1)[0].rstrip(".")
        kind, what = "*.bin", (f"torch's safe loader (weights_only=True) refuses to unpickle it ({detail}); allowed: "
                               "weights as tensors (safetensors, or torch.save of a state dict of tensors): longpatch "
                               "does not run the code a pickle names")
    elif isinstance(e, EOFError) or (isinstance(e, RuntimeError) and "PytorchStreamReader" in text):
        kind, what = "*.bin", f"a truncated or damaged PyTorch checkpoint ({_first_line(e).split('. ')[0]}); {_DAMAGED}"
    else:
        return None
    return f"model: {_failing_file(model, kind) or repr(model) + ' (its weights)'}: {what}"


def _failing_file(model: str, pattern: str) -> Path | None:
    """The first weight file matching `pattern` in the directory `model` that fails to open on its own (its
    header or pickle read, not its tensors), else the only one there, else None (a hub id: a cached copy)."""
    path = Path(model)
    files = sorted(path.glob(pattern)) if path.is_dir() else []
    for f in files:
        try:
            if f.suffix == ".safetensors":
                from safetensors import safe_open
                with safe_open(str(f), framework="pt"):
                    pass
            else:  # mmap, on the meta device: the pickle is read, the tensors are not
                torch.load(f, map_location="meta", weights_only=True, mmap=True)
        except Exception:
            return f
    return files[0] if len(files) == 1 else None


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def check_save_target(out_dir: str | Path) -> Path:
    """The directory `--save` will create: new or empty, with a parent we can create and write in.
    Checked before the model is loaded, so a bad path costs no loading time."""
    from .outdir import check_creatable

    allowed = "a new or empty directory"
    out = Path(out_dir).expanduser()
    # The last step renames the written directory onto `out` (after removing it if it is an empty directory):
    # a rename replaces neither a symlink (to an empty directory or to nothing) nor a path through a dangling
    # one, and exists() / is_dir() follow links, so the check below alone would pass them. Refused here, as
    # that step would refuse them, before minutes of loading and writing.
    link = next((p for p in (out, *out.parents) if p.is_symlink() and (p == out or not p.exists())), None)
    if link is not None:
        target = os.readlink(link)
        state = "a dangling symbolic link" if not link.exists() else "a symbolic link"
        raise ConfigError(f"--save: {link} is {state} (to {target}); allowed: {allowed} (not a link: the saved "
                          "model is renamed into place), e.g. the link's target itself")
    out = check_creatable(out, "--save", allowed)
    if out.exists():
        if any(out.iterdir()):
            raise ConfigError(f"--save: {out} exists and is not empty; allowed: {allowed}")
        check_creatable(out.parent, "--save", allowed)  # the model is written beside it, then renamed into place
    return out


def save_patch(model, cfg: PatchConfig, out_dir: str | Path, tokenizer=None, load: LoadSpec | None = None) -> Path:
    """Write the model (save_pretrained: config.json + safetensors weights, without the patch's buffers),
    its tokenizer when given, and longpatch.yaml (the patch, and how the model was loaded: `load`) into out_dir.

    Plain `AutoModelForCausalLM.from_pretrained(out_dir)` loads the unpatched model; longpatch's loader
    (from_pretrained, --model out_dir) loads it and re-applies the patch. Everything is written into a
    temporary sibling directory that is renamed at the end, so a failure leaves nothing half-written.
    """
    import shutil
    import tempfile

    import yaml

    out = check_save_target(out_dir)
    if not hasattr(model, "save_pretrained"):
        raise UnsupportedModelError(f"--save: {type(model).__name__} has no save_pretrained; only transformers models "
                             "can be saved")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    except OSError as e:
        raise LongpatchError(f"--save: cannot create {out}: {e.strerror or e}") from None
    try:
        _save_unpatched(model, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / CONFIG_FILE).write_text("# written by `longpatch apply --save`; re-apply with "
                                       "longpatch.from_pretrained(DIR)\n"
                                       "# model: where the weights beside this file came from\n"
                                       + yaml.safe_dump(saved_keys(load, cfg), sort_keys=False))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private (0700); a saved model is an ordinary directory
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise LongpatchError(f"--save: cannot write {out}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _save_unpatched(model, path: Path) -> None:
    # The model's own weights and config only: the patch's buffers and attention key would make plain
    # transformers warn about unexpected weights or fail on an unknown attn_implementation.
    report = getattr(model, REPORT_ATTR, None)
    if report is not None:
        unpatch_model(model)
    try:
        model.save_pretrained(path)
    finally:
        if report is not None:
            patch_model(model, report.config)


def saved_keys(load: LoadSpec | None, cfg: PatchConfig) -> dict:
    # the loading keys a later load needs (device placement and the tokenizer are the loader's choice then)
    keys = {k: v for k, v in (load or LoadSpec()).to_dict().items() if k not in ("device_map", "tokenizer")}
    return {**keys, **cfg.to_dict()}


def from_pretrained(path_or_alias: str | Path, **overrides):
    """Load the model a saved patch (or bundled alias) names, and patch it the same way. overrides: LoadSpec
    or PatchConfig keys, e.g. dtype="bfloat16", layers=4."""
    if str(path_or_alias) not in bundled_configs() and not (Path(path_or_alias) / CONFIG_FILE).is_file():
        raise ConfigError(f"from_pretrained: {path_or_alias} is neither a bundled alias nor a directory saved by "
                          f"`longpatch apply --save` (no {CONFIG_FILE}); load other models with load_model")
    spec = resolve(str(path_or_alias), None, sets=list(overrides.items()))
    model, _ = load_model(spec.load)
    return patch_model(model, spec.patch)
