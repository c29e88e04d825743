"""Where the files shipped inside the package lie (a leaf: imports nothing else of longpatch but errors).

`longpatch/assets/demo/` holds the offline demo model built by scripts/build_demo_model.py: config,
safetensors, tokenizer, model card, and `eval/<EVAL_SUBSET>.jsonl`, held-out documents in LongBench's
record format.
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from .errors import LongpatchError

EVAL_SUBSET = "demo_code"  # held-out stdlib files, LongBench record format, category "code"
EVAL_MIN_TOKENS = 4096  # every document of the evaluation set has at least this many tokens


def demo_model_path() -> Path:
    """Directory of the shipped demo model (config, safetensors, tokenizer, model card)."""
    path = Path(str(resources.files("longpatch") / "assets" / "demo"))
    if not (path / "model.safetensors").is_file():
        raise LongpatchError(f"the demo model is missing from {path}; build it with scripts/build_demo_model.py")
    return path


def demo_eval_path() -> Path:
    """Directory holding the demo evaluation set (<subset>.jsonl in LongBench's record format)."""
    return demo_model_path() / "eval"


def eval_documents(n: int | None = None, path: Path | None = None) -> list[str]:
    """Contexts of the evaluation set (the shipped one, or the one under a build's `path`), in file order."""
    root = demo_eval_path() if path is None else Path(path) / "eval"
    lines = (root / f"{EVAL_SUBSET}.jsonl").read_text().splitlines()
    return [json.loads(line)["context"] for line in lines[:n]]
