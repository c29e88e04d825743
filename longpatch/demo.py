"""The offline demo model shipped with longpatch (built by scripts/build_demo_model.py)."""
from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path

from .errors import LongpatchError

EVAL_SUBSET = "demo_code"  # held-out stdlib files, LongBench record format, category "code"
EVAL_MIN_TOKENS = 4096
EVAL_MAX_DOCS = 24


def demo_model_path() -> Path:
    """Directory of the shipped demo model (config, safetensors, tokenizer, model card)."""
    path = Path(str(resources.files("longpatch") / "assets" / "demo"))
    if not (path / "model.safetensors").is_file():
        raise LongpatchError(f"the demo model is missing from {path}; build it with scripts/build_demo_model.py")
    return path


def demo_eval_path() -> Path:
    """Directory holding the demo evaluation set (<subset>.jsonl in LongBench's record format)."""
    return demo_model_path() / "eval"


def write_eval_set(tokenizer, files, root: Path, out: Path) -> int:
    """Held-out files of at least EVAL_MIN_TOKENS tokens, in path order, as LongBench records."""
    records = []
    for p in files:
        text = p.read_text(encoding="utf-8", errors="replace")
        n = len(tokenizer(text)["input_ids"])
        if n < EVAL_MIN_TOKENS:
            continue
        rel = str(p.relative_to(root))
        records.append({"input": "", "context": text, "answers": [rel], "length": len(text.split()),
                        "dataset": EVAL_SUBSET, "language": "en", "all_classes": None,
                        "_id": hashlib.sha1(rel.encode()).hexdigest()})
        if len(records) == EVAL_MAX_DOCS:
            break
    d = out / "eval"
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"{EVAL_SUBSET}.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return len(records)


def write_model_card(out: Path, facts: dict) -> None:
    (out / "training.json").write_text(json.dumps(facts, indent=1))
    curve = "\n".join(f"| {c['step']} | {c['ctx']} | {c['tokens']:,} | {c['loss']:.3f} |" for c in facts["curve"][::4])
    (out / "README.md").write_text(f"""# longpatch demo model

A small `LlamaForCausalLM` trained on the CPU by `scripts/build_demo_model.py` so that longpatch can
show what approximate attention costs in quality offline. Not a useful language model.

- Architecture: 4 layers, hidden 256, 4 query heads sharing 2 KV heads (GQA), head_dim 64, RoPE,
  tied embeddings; {facts['params'] / 1e6:.2f}M parameters; byte-level BPE vocab {facts['vocab']}.
- Data: the Python {facts['python']} standard library's own `*.py` files: {facts['train_files']} files for
  training ({facts['stream_tokens']:,} tokens), {facts['heldout_files']} held out by a hash of their path.
  The stdlib is under the Python Software Foundation License; the weights are a derived work for
  demonstration.
- Training: seed {facts['seed']}, AdamW, 1024-token windows then 4096-token windows;
  {facts['train_tokens_seen']:,} tokens seen in {facts['minutes']} min on {facts['cpu_threads']} CPU threads
  (torch {facts['torch']}).
- Final held-out loss: {facts['heldout_loss']} nats/token (4096-token windows).
- Evaluation set: `eval/{EVAL_SUBSET}.jsonl`, {facts['eval_docs']} held-out files of at least {EVAL_MIN_TOKENS} tokens
  in LongBench's record format (`--data demo`).

| step | context | tokens seen | loss (EMA) |
| --- | --- | --- | --- |
{curve}
""")
