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
    lc = facts["long_context"]
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
- It uses its long context (`longpatch.demo.long_context_report` on the {lc['docs']} evaluation documents,
  mean nats/token): positions 1–255 {lc['early']:.3f}; positions 2048–4095 {lc['late']:.3f}; the same
  late tokens scored with at most 256 tokens of context {lc['late_short_context']:.3f}.

| step | context | tokens seen | loss (EMA) |
| --- | --- | --- | --- |
{curve}
""")


def eval_documents(n: int | None = None, path: Path | None = None) -> list[str]:
    """Contexts of the evaluation set (the shipped one, or the one under a build's `path`), in file order."""
    root = demo_eval_path() if path is None else Path(path) / "eval"
    lines = (root / f"{EVAL_SUBSET}.jsonl").read_text().splitlines()
    return [json.loads(line)["context"] for line in lines[:n]]


def long_context_report(model, tokenizer, docs: list[str], seq_len: int = 4096, short: int = 256,
                        late_from: int = 2048) -> dict:
    """Does the model use its context? Mean token loss (nats) on held-out documents of >= seq_len tokens:

    - `early`: positions 1..short-1 of the full-context pass (little context to use),
    - `late`: positions late_from..seq_len-1 of the full-context pass (long context available),
    - `late_short_context`: the same late tokens scored in independent `short`-token windows, so each
      sees at most `short` tokens of context.
    A model that uses long context has late < early and late < late_short_context.
    """
    import torch
    import torch.nn.functional as F

    early, late, late_short = [], [], []
    with torch.no_grad():
        for text in docs:
            ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :seq_len]
            if ids.shape[1] < seq_len:
                continue
            nll = F.cross_entropy(model(ids).logits[0, :-1].float(), ids[0, 1:], reduction="none")
            early.append(nll[: short - 1])
            # targets late_from..seq_len-1, minus each short window's first token (which the
            # windowed pass cannot predict), so both passes score exactly the same tokens
            late.append(nll[late_from - 1:].view(-1, short)[:, 1:].flatten())
            windows = ids[0, late_from:].view(-1, short)  # the late tokens, cut into short windows
            wl = model(windows).logits[:, :-1].float()
            late_short.append(F.cross_entropy(wl.flatten(0, 1), windows[:, 1:].flatten(), reduction="none"))
    if not early:
        raise LongpatchError(f"long_context_report: no document has {seq_len} tokens")
    return {"docs": len(early), "early": torch.cat(early).mean().item(), "late": torch.cat(late).mean().item(),
            "late_short_context": torch.cat(late_short).mean().item()}


def demo_configs() -> list[str]:
    """Aliases of the bundled configs that target the demo model (one per method: demo, demo-moba, ...)."""
    from .config import bundled_configs, load_config

    out = []
    for alias in bundled_configs():
        try:
            if load_config(alias).model == "demo":
                out.append(alias)
        except LongpatchError:
            continue  # a config naming a method that is not available in this build
    return out


def run_demo(layers: str = "0:4:1", max_docs: int = 6, out: str = "runs/demo", progress: bool = True) -> dict:
    """The main offline job: a small-scale Figure 3 of the HyperAttention paper on the demo model.

    For every bundled demo config (one per method), sweep the number of replaced final layers and
    measure held-out perplexity at 4096 tokens and the attention time against the unpatched model
    (layers 0) in the same run. Writes one eval directory per config, demo.json and figure3.png.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .eval import perplexity

    path = demo_model_path()
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    rows = []
    for alias in demo_configs():
        res = perplexity(model, layers, config=alias, data="demo", seq_len=EVAL_MIN_TOKENS, max_docs=max_docs,
                         out=str(Path(out) / alias), tokenizer=tok, progress=progress)
        for c in res["configs"]:
            a = c["all"]
            rows.append({"config": alias, "method": c["method"] if c["layers"] else "exact", "layers": c["layers"],
                         "ppl": a["ppl"], "attention_seconds": a["attention_seconds"],
                         "attention_speedup": a["attention_speedup"], "docs": a["docs"]})
    summary = {"model": str(path), "seq_len": EVAL_MIN_TOKENS, "max_docs": max_docs, "rows": rows}
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "demo.json").write_text(json.dumps(summary, indent=1))
    _plot_demo(rows, Path(out) / "figure3.png")
    return summary


def _plot_demo(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for cfg in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == cfg]
        label = next((r["method"] for r in rs if r["layers"]), cfg)
        a1.plot([r["layers"] for r in rs], [r["ppl"] for r in rs], "o-", label=label)
        a2.plot([r["layers"] for r in rs], [r["attention_speedup"] or 0 for r in rs], "o-", label=label)
    a1.set(xlabel="replaced final layers", ylabel="perplexity (held-out stdlib, 4096 tokens)", title="quality")
    a2.set(xlabel="replaced final layers", ylabel="attention speedup vs exact", title="speed")
    a1.legend(), a2.legend()
    fig.suptitle("longpatch demo model: a small-scale Figure 3")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
