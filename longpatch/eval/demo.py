"""The offline demo job (`longpatch demo`): every method on the shipped demo model, a small-scale
Figure 3 of the HyperAttention paper, and the check that the demo model uses its long context."""
from __future__ import annotations

from pathlib import Path

from ..assets import EVAL_MIN_TOKENS, demo_model_path
from ..errors import ConfigError, LongpatchError, check_int
from ..options import MAX_TOKENS
from ..outdir import check_out, claim_out, owns_out, write_json
from .headline import NEEDLE_DEPTHS as HEADLINE_DEPTHS
from .headline import NEEDLE_TEMPLATE as HEADLINE_NEEDLES
from .headline import PPL_LENGTH, PREFILL_LENGTH, plot_frontier, run_headline
from .needle.prompts import DEFAULT_TEMPLATE as NEEDLE_TEMPLATE


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
    """Aliases of the bundled demo configs of the layer sweep at 4096 tokens: one per method with its
    paper's selection, `demo` (hyper) and `demo-<method>`. Not the 32k configs (`demo-moba-32k`,
    `demo-nsa-32k`, `demo-hyper-32k`): at 4096 tokens their budgets cover every block, exact attention;
    the demo's first table (headline.py) runs the query-aware ones at 32k."""
    from ..config import bundled_configs, read_config

    out = []
    for alias in bundled_configs():
        try:
            file = read_config(alias)
            if file.load.get("model") == "demo" and alias in ("demo", f"demo-{file.patch.method}"):
                out.append(alias)
        except LongpatchError:
            continue  # a config naming a method that is not available in this build
    return out


# Retrieval in the layer sweep: the passkey at 8192 tokens, 5 depths, one trial each, so that the whole demo
# (the 32k table first, about 4.5 minutes) stays within about 10 minutes on 2 CPU cores (docs/demo.md).
NEEDLE_LENGTH = 8192
NEEDLE_DEPTHS = "0.1:0.9:0.2"
NEEDLE_TRIALS = 1
COMMAND = "demo"  # marks its --out (outdir.claim_out); its eval directories inside are marked by their evals


@owns_out("out", COMMAND)  # one run at a time per --out (another refuses in one line)
def run_demo(layer_counts: str = "0:4:1", max_docs: int = 6, out: str = "runs/demo", progress: bool = True,
             needle_length: int = NEEDLE_LENGTH, needle_template: str = NEEDLE_TEMPLATE,
             needle_depths: str = NEEDLE_DEPTHS, needle_trials: int = NEEDLE_TRIALS,
             headline_length: int = PREFILL_LENGTH, headline_ppl_length: int = PPL_LENGTH) -> dict:
    """The main offline job: first the shipped 32k configs as shipped and with every layer, beside exact at
    ``headline_length`` tokens (``headline.run_headline``: prefill speed, needles, perplexity at
    ``headline_ppl_length``; 0 skips it), then a small-scale Figure 3 of the HyperAttention paper on
    the demo model, with retrieval beside it.

    For every bundled demo config (one per method), sweep the number of replaced final layers and
    measure held-out perplexity at 4096 tokens, the attention time against the unpatched model
    (layers 0) in the same run, and needle-in-a-haystack accuracy (`needle_template` at
    `needle_length` tokens; needle_length 0 skips it). Writes one eval directory per config, needle/,
    headline/ (its needle/ and ppl/), demo.json, frontier.png and figure3.png.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .needle.run import needle
    from .ppl.run import perplexity
    from .sweep import model_dtype

    check_out(out, COMMAND)  # before minutes of work
    check_int("--headline-length", headline_length, 0, MAX_TOKENS)
    path = demo_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    if needle_length:
        _check_needle_options(tok, needle_length, needle_template, needle_depths, needle_trials)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    headline = None
    if headline_length:
        rows = run_headline(model, tok, Path(out) / "headline", progress, headline_length, headline_ppl_length)
        headline = {"length": headline_length, "ppl_length": headline_ppl_length, "needle_template": HEADLINE_NEEDLES,
                    "needle_depths": HEADLINE_DEPTHS, "rows": rows}
    rows = []
    configs = demo_configs()
    for alias in configs:
        res = perplexity(model, layer_counts, config=alias, data="demo", seq_len=EVAL_MIN_TOKENS, max_docs=max_docs,
                         out=str(Path(out) / alias), tokenizer=tok, progress=progress)
        for c in res["configs"]:
            a = c["all"]
            rows.append({"config": alias, "method": c["method"] if c["layers"] else "exact", "layers": c["layers"],
                         "ppl": a["ppl"], "attention_seconds": a["attention_seconds"],
                         "attention_speedup": a["attention_speedup"], "docs": a["docs"]})
    summary = {"model": str(path), "dtype": model_dtype(model), "seq_len": EVAL_MIN_TOKENS, "max_docs": max_docs,
               "headline": headline, "rows": rows}
    if needle_length:
        found = needle(model, layer_counts, config=configs, template=needle_template, lengths=[needle_length],
                       depths=needle_depths, trials=needle_trials, out=str(Path(out) / "needle"), tokenizer=tok,
                       progress=progress)
        # the 0-layer point is one shared exact baseline in the needle run
        acc = {(s["config"], s["layers"]): s["accuracy"] for s in found["summary"]}
        for r in rows:
            r["needle_accuracy"] = acc.get(("exact" if r["layers"] == 0 else r["config"], r["layers"]))
        summary["needle"] = {"template": needle_template, "length": needle_length,
                             "depths": found["depths"], "trials": needle_trials}
    claim_out(out, COMMAND)
    write_json(Path(out) / "demo.json", summary)
    _plot_demo(rows, Path(out) / "figure3.png", summary.get("needle"))
    if headline:
        plot_frontier(headline["rows"], Path(out) / "frontier.png", headline_length, headline_ppl_length)
    return summary


def _check_needle_options(tok, length: int, template: str, depths: str, trials: int) -> None:
    """Plan the needle prompts now, so that a bad --needle-* option fails at once (naming the demo's own
    flag) rather than after the minutes of perplexity that come first."""
    from ..options import MAX_TOKENS, MAX_VALUES
    from .needle import prompts as N
    from .needle.run import MIN_LENGTH, plan_trials

    def check(flag: str, fn):
        try:
            return fn()
        except ConfigError as e:  # the needle command's wording names its own flags
            raise ConfigError(f"{flag}: {str(e).split(': ', 1)[-1]}") from None

    if not MIN_LENGTH <= length <= MAX_TOKENS:
        raise ConfigError(f"--needle-length: got {length}; allowed: 0 (no retrieval) or a token count in "
                          f"[{MIN_LENGTH}, {MAX_TOKENS}]")
    tmpl = check("--needle-template", lambda: N.load_template(template))
    check("--needle-trials", lambda: check_int("--trials", trials, 1, MAX_VALUES))
    check("--needle-length", lambda: plan_trials(N.Filler(N.filler_texts(tmpl.filler or "demo"), tok), tmpl,
                                                 [length], N.parse_depths(depths), trials, 0))


def _plot_demo(rows: list[dict], path: Path, needle: dict | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..plotting import layers_axis, method_color, speedup_line

    fig, axes = plt.subplots(1, 3 if needle else 2, figsize=(15 if needle else 10, 4))
    a1, a2 = axes[0], axes[1]
    for cfg in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == cfg]
        method = next((r["method"] for r in rs if r["layers"]), cfg)
        style = dict(label=method, color=method_color(method), marker="o")
        a1.plot([r["layers"] for r in rs], [r["ppl"] for r in rs], **style)
        a2.plot([r["layers"] for r in rs], [r["attention_speedup"] or 0 for r in rs], **style)
        if needle:
            axes[2].plot([r["layers"] for r in rs], [r.get("needle_accuracy") or 0 for r in rs], **style)
    a1.set(ylabel="perplexity (held-out stdlib, 4096 tokens)", title="quality")
    a2.set(ylabel="attention speedup vs exact", title="speed")
    speedup_line(a2)
    if needle:
        axes[2].set(ylabel="needle accuracy", ylim=(-0.05, 1.05),
                    title=f"retrieval ({needle['template']}, {needle['length']} tokens)")
    for ax in axes:
        layers_axis(ax, "replaced final layers")
        ax.legend()
    fig.suptitle("longpatch demo model: a small-scale Figure 3")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
