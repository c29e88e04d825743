"""The process's memory allocator: keep freed memory for reuse instead of returning it to the system.

glibc's malloc serves every allocation above its mmap threshold (at most 32 MB) with fresh pages from
the kernel and unmaps them again on free. A transformers forward at long contexts allocates tensors
of that size several times a layer (the MLP's [tokens, intermediate] activations are 96 MB at 32k on
the demo model), so every forward touches hundreds of MB of new pages: about a million page faults
per 32k forward here, measured with ``resource.getrusage``. The cost is the same for exact attention
and for a patched model, so it is a larger share of the patched model's time: on this project's
2-core machine, `bench generate` at 32k gave exact 15.29 s / MoBA 5.32 s (2.87x) with glibc's
defaults and exact 14.40 s / MoBA 4.25 s (3.39x) with freed memory kept (docs/benchmarks.md).

``keep_freed_memory`` tells glibc to serve large allocations from its heap and never to trim it (the
``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...`` environment variables, set from inside the process):
freed tensors' pages are reused without faults, and the process keeps its peak memory until it
exits. The command line calls it once per command (`LONGPATCH_KEEP_FREED_MEMORY=0` turns that off);
a Python program may call it itself. jemalloc or tcmalloc (``LD_PRELOAD``), as PyTorch's CPU tuning
guide recommends, serve the same purpose. Elsewhere than Linux with glibc it does nothing.
"""
from __future__ import annotations

import ctypes
import os
import sys

ENV = "LONGPATCH_KEEP_FREED_MEMORY"  # "0": leave the allocator as the process has it

# mallopt's parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_KEEP = 2**31 - 1  # the largest trim threshold mallopt takes (an int): the heap is never trimmed

KEPT = "glibc, freed memory kept (longpatch.memory)"  # ``allocator()`` once the setting is in effect

_state: dict = {}


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse (no mmap per large allocation, no trim).
    Returns whether that is in effect; idempotent. False where the C library is not glibc, or
    ``LONGPATCH_KEEP_FREED_MEMORY=0``."""
    if "applied" in _state:
        return _state["applied"]
    applied = False
    if os.environ.get(ENV, "1").strip() != "0" and sys.platform.startswith("linux"):
        try:
            mallopt = ctypes.CDLL(None).mallopt  # the process's own C library; musl has none
        except (OSError, AttributeError):
            mallopt = None
        # mallopt returns 1 on success
        applied = mallopt is not None and mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _KEEP) == 1
    _state["applied"] = applied
    return applied


def allocator() -> str:
    """How this process's allocator was set, for benchmark records."""
    return KEPT if _state.get("applied") else "as the process started"
