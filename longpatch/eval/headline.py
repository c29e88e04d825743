"""The demo's first table: the shipped 32k configs as shipped (layer 1 kept exact) and with every layer
replaced, beside exact attention, at the lengths they are for.

On the demo model (4 layers) with `demo-moba-32k` and `demo-nsa-32k`, each config twice: its own layers
(what ``--config demo-moba-32k`` gives), then every layer patched:

- whole-model prefill of one 32k-token prompt (the demo's held-out code), one timed forward per row,
  exact first, and its speedup;
- passkey needles at 32k (``NEEDLE_DEPTHS``, one trial each): found, and kept (found where exact found
  them);
- perplexity at 16k on the demo's held-out documents long enough (the longest reach 19k tokens).

Exact attention runs the same prompts and documents in the same run. Writes needle/, needle-shipped/,
ppl/ and ppl-shipped/ (the evals' own directories) under ``out`` and returns the rows; ``run_demo`` prints
them as its first table.
"""
from __future__ import annotations

import time
from pathlib import Path

HEADLINE_CONFIGS = ("demo-moba-32k", "demo-nsa-32k")
PREFILL_LENGTH = 32768
NEEDLE_TEMPLATE = "passkey"
NEEDLE_DEPTHS = "0.2:0.8:0.3"  # three prompts: a needle early, in the middle and late
PPL_LENGTH = 16384
PPL_DOCS = 4


def _prefill_seconds(model, ids) -> float:
    """One timed forward of the prompt, only its last position's logits (as generate() asks)."""
    import torch

    with torch.no_grad():
        t0 = time.perf_counter()
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
        return time.perf_counter() - t0


def _prompt_ids(tok, length: int):
    """The first ``length`` tokens of the demo's held-out code, end to end."""
    import torch

    from .needle.prompts import filler_texts

    ids: list[int] = []
    for text in filler_texts("demo"):
        ids += tok(text)["input_ids"]
        if len(ids) >= length:
            return torch.tensor([ids[:length]])
    raise ValueError(f"the demo's held-out code holds {len(ids)} tokens, fewer than {length}")


def run_headline(model, tok, out: Path, progress: bool = True, length: int = PREFILL_LENGTH,
                 ppl_length: int = PPL_LENGTH) -> list[dict]:
    """Rows {config, method, layers, prefill_s, prefill_speedup, needles_found, needles_kept, needles, ppl,
    ppl_increase_pct}: exact first (its own needles found; kept and increase None), then per config its
    shipped layers (``layers`` the list) and every layer (``layers`` "all"). ``length``: the prompts' tokens
    (prefill and needles); ``ppl_length``: the documents' (at most PPL_DOCS of them)."""
    from ..config import read_config
    from ..patching import patch_model, unpatch_model
    from .needle.run import needle
    from .ppl.run import perplexity

    n_layers = model.config.num_hidden_layers
    needles = dict(config=list(HEADLINE_CONFIGS), template=NEEDLE_TEMPLATE, lengths=[length], depths=NEEDLE_DEPTHS,
                   trials=1, tokenizer=tok, progress=progress)
    ppls = dict(config=list(HEADLINE_CONFIGS), data="demo", seq_len=ppl_length, max_docs=PPL_DOCS, tokenizer=tok,
                progress=progress)
    sweep = f"0,{n_layers}"  # exact, and every layer replaced; then each config's own layers (None)
    records = needle(model, sweep, out=str(out / "needle"), **needles)["records"] \
        + needle(model, None, out=str(out / "needle-shipped"), **needles)["records"]
    ppl_of: dict = {}
    for layer_counts, name in ((sweep, "ppl"), (None, "ppl-shipped")):
        for c in perplexity(model, layer_counts, out=str(out / name), **ppls)["configs"]:
            which = "exact" if not c["layers"] else "shipped" if layer_counts is None else "all"
            ppl_of[(c["config"] if c["layers"] else "exact", which)] = c["all"]["ppl"]
    ids = _prompt_ids(tok, length)
    exact_s = _prefill_seconds(model, ids)
    exact_hits = {(r["depth"], r["trial"]) for r in records if r["layers"] == 0 and r["correct"]}
    prompts = len({(r["depth"], r["trial"]) for r in records if r["layers"] == 0})
    base = ppl_of.get(("exact", "exact"))
    rows = [{"config": "exact", "method": "exact", "layers": [], "prefill_s": exact_s, "prefill_speedup": 1.0,
             "needles_found": len(exact_hits), "needles_kept": None, "needles": prompts, "ppl": base,
             "ppl_increase_pct": None}]
    for alias in HEADLINE_CONFIGS:
        patch = read_config(alias).patch
        for which in ("shipped", "all"):
            layers = "all" if which == "all" else list(patch.layers)
            patch_model(model, {"method": patch.method, "params": dict(patch.params), "layers": layers})
            try:
                seconds = _prefill_seconds(model, ids)
            finally:
                unpatch_model(model)
            count = n_layers if which == "all" else len(patch.layers)
            hits = {(r["depth"], r["trial"]) for r in records
                    if r["config"] == alias and r["layers"] == count and r["correct"]}
            value = ppl_of.get((alias, which))
            rows.append({"config": alias, "method": patch.method, "layers": layers, "prefill_s": seconds,
                         "prefill_speedup": exact_s / seconds, "needles_found": len(hits),
                         "needles_kept": len(hits & exact_hits), "needles": prompts, "ppl": value,
                         "ppl_increase_pct": None if value is None or not base else 100 * (value / base - 1)})
    return rows


def layers_label(layers) -> str:
    """A row's layers as the tables print them: "0,2,3" (as shipped), "all", "-" for exact."""
    if layers == "all":
        return "all"
    return ",".join(map(str, layers)) if layers else "-"


def plot_frontier(rows: list[dict], path: Path, length: int, ppl_length: int) -> None:
    """Speed against quality: each config's whole-model prefill speedup (x) and perplexity increase over
    exact (y), labelled with the needles it kept; exact at (1, 0)."""
    from ..bench.common import figure, save_figure
    from ..plotting import method_color

    fig, axes = figure(1, 1, (6.4, 4.4))
    ax = axes[0][0]
    ax.scatter([1.0], [0.0], color=method_color("exact"), s=60, zorder=3)
    ax.annotate("exact", (1.0, 0.0), textcoords="offset points", xytext=(6, 6))
    configs = list(dict.fromkeys(r["config"] for r in rows[1:]))
    for r in rows[1:]:
        if r["ppl_increase_pct"] is None:
            continue
        ax.scatter([r["prefill_speedup"]], [r["ppl_increase_pct"]], color=method_color(r["method"]), s=60, zorder=3)
        # each config's labels a line higher than the one before: the configs' shipped points sit close together
        ax.annotate(f"{r['config']}, layers {layers_label(r['layers'])}: {r['needles_kept']}/"
                    f"{rows[0]['needles_found']} needles", (r["prefill_speedup"], r["ppl_increase_pct"]),
                    textcoords="offset points", xytext=(6, 6 + 12 * configs.index(r["config"])), fontsize=8)
    ax.set_xlim(left=0.5, right=max([r["prefill_speedup"] for r in rows] + [1.0]) * 1.7)
    ax.margins(y=0.15)  # room above the highest point for its labels
    ax.axhline(0.0, color="grey", lw=0.6)
    ax.set_xlabel(f"whole-model prefill speedup over exact, {length} tokens")
    ax.set_ylabel(f"perplexity increase over exact, % ({ppl_length} tokens)")
    ax.grid(alpha=0.3)
    save_figure(fig, path, "demo model, the 32k configs as shipped and every layer: speed against quality")
