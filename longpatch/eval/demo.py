"""The offline demo job (`longpatch demo`): every method on the shipped demo model, a small-scale
Figure 3 of the HyperAttention paper, and the check that the demo model uses its long context."""
from __future__ import annotations

import json
from pathlib import Path

from ..assets import EVAL_MIN_TOKENS, demo_model_path
from ..errors import LongpatchError


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
    from ..config import bundled_configs, load_config

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

    from .perplexity import perplexity

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
