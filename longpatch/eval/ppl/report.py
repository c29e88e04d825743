"""The perplexity report: records merged in plan order into results.json, results.csv and the plots
(ppl and speedup against replaced layers, ppl per category), and the table the CLI prints."""
from __future__ import annotations

import math
import statistics
from pathlib import Path

from ...outdir import write_csv, write_json
from ...patching import total_seconds
from ..longbench.data import CATEGORIES, source_name
from ..records import read_plan, read_records, seconds_by_path

RESULTS_FILE = "results.json"
CSV_FILE = "results.csv"
PLOTS = {"ppl": "ppl_vs_layers.png", "speedup": "speedup_vs_layers.png", "categories": "ppl_by_category.png"}


def summarize(out: "str | Path", plots: bool = True) -> dict:
    """Merge plan.json and every records*.jsonl in `out` into results.json, results.csv and plots.

    Sums are exact (math.fsum) and taken in plan order, so the numbers do not depend on how many
    processes evaluated the documents or in which order they finished.
    """
    out = Path(out)
    plan = read_plan(out)
    index = record_index(read_records(out))
    docs = plan["docs"]

    def recs_for(config_id):
        return {(d["subset"], d["doc_id"]): index[k] for d in docs
                if (k := (config_id, d["subset"], d["doc_id"], d["digest"])) in index}

    baseline = recs_for(plan["baseline_id"])
    scopes = {"all": [(d["subset"], d["doc_id"]) for d in docs]}
    for c in CATEGORIES:
        scopes[f"category:{c}"] = [(d["subset"], d["doc_id"]) for d in docs if d["category"] == c]
    for s in plan["subsets"]:
        scopes[f"subset:{s}"] = [(d["subset"], d["doc_id"]) for d in docs if d["subset"] == s]
    configs = []
    for point in plan["points"]:
        mine = recs_for(point["config_id"])
        groups = {scope: _group_stats([mine[k] for k in keys if k in mine], len(keys),
                                      {k: baseline[k] for k in keys if k in baseline})
                  for scope, keys in scopes.items() if keys or scope == "all"}
        configs.append({**point, "all": groups.pop("all"),
                        "categories": {k.split(":", 1)[1]: v for k, v in groups.items() if k.startswith("category:")},
                        "subsets": {k.split(":", 1)[1]: v for k, v in groups.items() if k.startswith("subset:")}})
    skipped_reasons: dict[str, int] = {}
    for s in plan["skipped"]:
        skipped_reasons[s["reason"]] = skipped_reasons.get(s["reason"], 0) + 1
    results = {
        "model": plan["model"], "dtype": plan.get("dtype"), "tokenizer": plan["tokenizer"], "seq_len": plan["seq_len"],
        "prefill_chunk": plan.get("prefill_chunk"), "cache": plan.get("cache"),
        "decode_tokens": plan.get("decode_tokens"), "data": plan["data"],
        "num_layers": plan["num_layers"], "max_docs": plan["max_docs"],
        "definitions": {
            "ppl": "exp(sum of token NLLs / scored tokens), natural log, pooled over the group's documents",
            "ppl_doc_mean": "mean over documents of exp(document mean token NLL): mean of per-document perplexities",
            "refcode_metric": "mean over documents of 2**(document mean NLL in nats): what the HyperAttention "
                              "reference code printed; NOT a perplexity, only for comparison with the paper",
            "scored_tokens": "seq_len - 1 per document (every position but the last predicts the next token); "
                             "decode_tokens per document with decode_tokens",
            "prefill_chunk": "null: each document in one forward; N: fed through the KV cache N tokens at a time, "
                             "every position scored as in one forward",
            "cache": "null: full precision; int8/fp8: every attention call read the keys and values from an 8-bit "
                     "KV cache (one scale per row)",
            "decode_tokens": "null: every position scored from the prefill; N: the first seq_len - N tokens "
                             "prefilled, the last N fed one at a time through the KV cache (decode steps) and "
                             "only those N scored (teacher-forced decode perplexity), every configuration alike",
            "attention_seconds": "wall time inside attention calls of all layers (model.longpatch.stats())",
            "attention_speedup": "median over the documents both finished in the same run of the 0-layer "
                                 "configuration's attention_seconds / this configuration's, the two timed side by "
                                 "side (the run interleaves configurations per document); forward_speedup: same "
                                 "with forward_seconds",
            "attended_share": "the query-key products the patched layers attended (a query-aware selection's "
                              "executor) over exact attention's, all layers and per layer, summed over documents",
            "attention_seconds_by_path": "{side: {phase: {path: seconds}}}; side patched/unpatched layers, phase "
                                         "prefill/decode, path method / method_exact (the method's code, exact at "
                                         "that length) / exact (fallback) / original (the model's own attention)",
        },
        "documents": {"kept": len(docs), "skipped": skipped_reasons, "malformed": len(plan["data_problems"]),
                      "per_subset": plan["per_subset"],
                      "missing_subsets": plan["missing_subsets"], "skipped_list": plan["skipped"]},
        "data_problems": plan["data_problems"],
        "configs": configs,
        "files": {"results": RESULTS_FILE, "csv": CSV_FILE},
    }
    if plots:
        results["files"]["plots"] = _plots(results, out)
    write_csv(out / CSV_FILE, list(_CSV_COLUMNS), _csv_rows(results))
    write_json(out / RESULTS_FILE, results)
    return results


def record_index(records: list[dict]) -> dict[tuple, dict]:
    index: dict[tuple, dict] = {}
    for r in records:
        try:
            key = (r["config_id"], r["subset"], r["doc_id"], r["digest"])
        except KeyError:
            continue
        index.setdefault(key, r)
    return index


def _group_stats(recs: list[dict], planned: int, base: dict) -> dict:
    finite = [r for r in recs if math.isfinite(r["nll_sum"])]
    tokens = sum(r["scored_tokens"] for r in finite)
    nll = math.fsum(r["nll_sum"] for r in finite)
    n = len(finite)
    by_path = seconds_by_path(recs)
    forward = math.fsum(r["forward_seconds"] for r in recs)
    attention = math.fsum(r["attention_seconds"] for r in recs)
    # timings of one run only: a reused --out may hold a baseline measured earlier, under another load
    common = [r for r in recs if (k := (r["subset"], r["doc_id"])) in base
              and r.get("run_id") is not None and base[k].get("run_id") == r["run_id"]]
    return {
        "docs": len(recs), "docs_planned": planned, "complete": len(recs) == planned,
        "nonfinite_docs": len(recs) - n, "scored_tokens": tokens,
        "nll_mean": nll / tokens if tokens else None,
        "ppl": math.exp(nll / tokens) if tokens else None,
        "ppl_doc_mean": math.fsum(math.exp(r["nll_mean"]) for r in finite) / n if n else None,
        "refcode_metric": math.fsum(2.0 ** r["nll_mean"] for r in finite) / n if n else None,
        "forward_seconds": forward, "loss_seconds": math.fsum(r["loss_seconds"] for r in recs),
        "tokens_per_second": sum(r["tokens"] for r in recs) / forward if forward > 0 else None,
        "attention_seconds": attention,
        "attention_seconds_by_path": by_path,
        "attention_speedup": _median_speedup(common, base, "attention_seconds"),
        "attended_share": _attended_share(recs),
        "forward_speedup": _median_speedup(common, base, "forward_seconds"),
        "speedup_docs": len(common),
    }


def _attended_share(recs: list[dict]) -> dict | None:
    """{"all": share, "layers": {layer: share}}: the query-key products the patched layers attended over
    exact attention's, summed over the documents (None where no layer counts its work)."""
    sums: dict[str, list[int]] = {}
    for r in recs:
        for layer, w in (r.get("layer_work") or {}).items():
            s = sums.setdefault(layer, [0, 0])
            s[0] += w.get("attended_pairs", 0)
            s[1] += w.get("dense_pairs", 0)
    sums = {k: v for k, v in sums.items() if v[1]}
    if not sums:
        return None
    layers = {k: a / d for k, (a, d) in sorted(sums.items(), key=lambda kv: int(kv[0]))}
    return {"all": sum(a for a, _ in sums.values()) / sum(d for _, d in sums.values()), "layers": layers}


def _median_speedup(recs: list[dict], base: dict, key: str) -> float | None:
    """Median over the documents of baseline seconds / these seconds, each document's pair timed side by side
    (eval ppl interleaves the configurations document by document): a load spike moves one pair, not the
    median, and each document's forward and attention ratios come from the same two passes."""
    ratios = [base[(r["subset"], r["doc_id"])][key] / r[key] for r in recs if r[key] > 0]
    return statistics.median(ratios) if ratios else None


_CSV_COLUMNS = ("config_id", "label", "method", "layers", "scope", "name", "docs", "docs_planned", "scored_tokens",
                "ppl", "ppl_doc_mean", "nll_mean", "forward_seconds", "attention_seconds", "patched_attention_seconds",
                "unpatched_attention_seconds", "tokens_per_second", "attention_speedup", "forward_speedup",
                "nonfinite_docs", "refcode_metric", "attended_share")


def _csv_rows(results: dict):
    for c in results["configs"]:
        scopes = [("all", "all", c["all"])] + [("category", k, v) for k, v in c["categories"].items()] \
            + [("subset", k, v) for k, v in c["subsets"].items()]
        for scope, name, s in scopes:
            by_path = s["attention_seconds_by_path"]
            yield {**s, "config_id": c["config_id"], "label": c["label"], "method": c["method"] or "exact",
                   "layers": c["layers"], "scope": scope, "name": name,
                   "patched_attention_seconds": total_seconds(by_path.get("patched", {})),
                   "unpatched_attention_seconds": total_seconds(by_path.get("unpatched", {})),
                   "attended_share": (s.get("attended_share") or {}).get("all")}


def _plots(results: dict, out: Path) -> list[str]:
    """ppl and speedup against the number of replaced layers (the paper's Figure 3), and ppl per category."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from ...plotting import layers_axis, method_color, speedup_line

    configs = sorted((c for c in results["configs"] if c["all"]["ppl"] is not None), key=lambda c: c["layers"])
    written = []
    if not configs:
        return written
    title = f"{results['model']}, {source_name(results['data'])}, {results['seq_len']} tokens"
    # one line per config of the run (--config a,b), each starting from the shared 0-layer baseline
    base = [c for c in configs if not c["layers"]]
    groups: dict = {}
    for c in configs:
        if c["layers"]:
            groups.setdefault(c.get("config"), []).append(c)
    series = [(name, sorted(base + group, key=lambda c: c["layers"]), method_color(group[0]["method"]))
              for name, group in groups.items()] or [(None, base, method_color(None))]
    named = len(series) > 1

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    for name, cs, color in series:
        tag = f"{name}: " if named else ""
        ax.plot([c["layers"] for c in cs], [c["all"]["ppl"] for c in cs], "o-", color=color,
                label=f"{tag}ppl (pooled tokens)")
        ax.plot([c["layers"] for c in cs], [c["all"]["ppl_doc_mean"] for c in cs], "s--", color=color,
                label=f"{tag}ppl_doc_mean (mean of per-doc ppl)")
    ax.set(ylabel="perplexity", title=title)
    layers_axis(ax)
    ax.legend(), ax.grid(alpha=0.3)
    _save(fig, FigureCanvasAgg, out / PLOTS["ppl"], written)

    if any(c["all"]["attention_speedup"] is not None for c in configs):
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        for name, cs, color in series:
            speed = [c for c in cs if c["all"]["attention_speedup"] is not None]
            xs, tag = [c["layers"] for c in speed], f"{name}: " if named else ""
            ax.plot(xs, [c["all"]["attention_speedup"] for c in speed], "o-", color=color, label=f"{tag}attention")
            ax.plot(xs, [c["all"]["forward_speedup"] for c in speed], "s--", color=color,
                    label=f"{tag}whole forward")
        speedup_line(ax)
        ax.set(ylabel="speedup vs 0 layers", title=title)
        layers_axis(ax)
        ax.legend(), ax.grid(alpha=0.3)
        _save(fig, FigureCanvasAgg, out / PLOTS["speedup"], written)

    cats = [k for k in CATEGORIES if any(k in c["categories"] and c["categories"][k]["ppl"] for c in configs)]
    if cats:
        fig = Figure(figsize=(max(6, 1.2 * len(cats) * max(1, len(configs)) / 2), 4))
        ax = fig.add_subplot()
        width = 0.8 / len(configs)
        top = 0.0
        for i, c in enumerate(configs):
            vals = [(c["categories"].get(k) or {}).get("ppl") or 0.0 for k in cats]
            top = max(top, *vals)
            # the method's colour, deeper with more replaced layers; the 0-layer bars are exact's grey
            ax.bar([j + i * width for j in range(len(cats))], vals, width, label=c["label"],
                   color=method_color(c["method"] if c["layers"] else None),
                   alpha=0.35 + 0.65 * i / max(1, len(configs) - 1))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=20)
        ax.set(ylabel="perplexity (pooled tokens)", title=title, ylim=(0, top * 1.3))
        ax.legend(fontsize="small", ncols=min(4, len(configs)), loc="upper center")
        _save(fig, FigureCanvasAgg, out / PLOTS["categories"], written)
    return written


def _save(fig, canvas_cls, path: Path, written: list[str]) -> None:
    canvas_cls(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    written.append(path.name)


def print_results(results: dict, out: "str | Path") -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    docs = results["documents"]
    dtype = f" ({results['dtype']})" if results.get("dtype") else ""
    chunked = f" in chunks of {results['prefill_chunk']}" if results.get("prefill_chunk") else ""
    chunked += f", {results['cache']} KV cache" if results.get("cache") else ""
    chunked += f", last {results['decode_tokens']} tokens decoded one at a time" if results.get("decode_tokens") else ""
    t = Table(title=f"{results['model']}{dtype}: {source_name(results['data'])} perplexity at {results['seq_len']} "
                    f"tokens{chunked}, {docs['kept']} document{'' if docs['kept'] == 1 else 's'} "
                    f"({sum(docs['skipped'].values())} skipped)",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    shares = any(c["all"].get("attended_share") for c in results["configs"])
    cols = ("config", "layers", "docs", "ppl", "doc-mean", "fwd s", "attn s", "speedup", "tok/s")
    for col in cols + (("attended per layer",) if shares else ()):
        t.add_column(col, justify="left" if col in ("config", "attended per layer") else "right")
    for c in results["configs"]:
        a = c["all"]
        speedup = "-" if a["attention_speedup"] is None else f"{a['attention_speedup']:.2f}x"
        row = [c["label"], str(c["layers"]), f"{a['docs']}/{a['docs_planned']}", _fmt(a["ppl"]),
               _fmt(a["ppl_doc_mean"]), _fmt(a["forward_seconds"], 2), _fmt(a["attention_seconds"], 2), speedup,
               _fmt(a["tokens_per_second"], 0)]
        if shares:
            row.append(_shares(a.get("attended_share")))
        t.add_row(*row)
    console = Console(emoji=False, highlight=False)
    console.print(t, markup=False)
    if results["data_problems"]:
        console.print(f"{len(results['data_problems'])} malformed LongBench record(s) skipped; see results.json",
                      style="yellow", markup=False)
    if shares:
        console.print("attended per layer: the query-key products each patched layer's executor attended over "
                      "exact attention's (layer: share), summed over the documents", markup=False)
    console.print("ppl = exp(pooled token NLL); doc-mean = mean of per-document perplexities; speedup = "
                  "median over the documents of attention seconds at 0 layers / attention seconds, timed side by "
                  "side. Written to "
                  f"{out}: {', '.join([RESULTS_FILE, CSV_FILE, *results['files'].get('plots', [])])}", markup=False)


def _shares(share: dict | None) -> str:
    if not share:
        return "-"
    return f"{share['all']:.2f} (" + " ".join(f"{k}:{v:.2f}" for k, v in share["layers"].items()) + ")"


def _fmt(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"
