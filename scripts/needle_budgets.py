"""Needle retrieval against attention budget: each sparse method at growing budgets, exact attention in
the same run.

The question, for hyper, moba and nsa: which config keeps the passkey at 32k tokens with every
layer of the demo model replaced while its attention is faster than exact. This script measures the
trade-off instead of guessing it: it writes one config per variant below (a bundled demo config with
some parameters changed, `layers: all`), runs `longpatch eval needle` on them with exact attention
(0 replaced layers) in the same run and on the same prompts, and prints per variant

  keys     how many keys the last query position attends to at --length (the method's budget;
           exact attention: all of them)
  acc      passkey accuracy over the grid
  kept     accuracy on the prompts exact attention gets right (what the method keeps of the model)
  attn s   time inside attention over all generations (layer stats), and its speedup over exact

It writes budgets.json and budgets.png (accuracy against keys per query, one line per method) into
--out, beside the eval needle results; a second run with the same --out resumes. A benchmark, not a
test: about 35 minutes at 32k on 2 CPU cores.

  python scripts/needle_budgets.py --length 32768 --depths 0.1:0.9:0.1 --trials 1 --out runs/needle_budgets
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import yaml

from longpatch.config import load_config, read_config
from longpatch.errors import ConfigError, LongpatchError
from longpatch.eval.needle.run import MIN_LENGTH, needle
from longpatch.eval.records import removed_on_failure
from longpatch.outdir import check_out, claim_out

# name: (bundled demo config, parameter overrides). The first of each method is the bundled config as is
# (tuned for perplexity at 4096 tokens), then budgets that grow toward the whole context.
VARIANTS = {
    "hyper b64": ("demo", {}),
    "hyper b512": ("demo", {"block_size": 512, "sample_size": 512, "min_seq_len": 4096}),
    "hyper b1024": ("demo", {"block_size": 1024, "sample_size": 1024, "min_seq_len": 4096}),
    "hyper b2048": ("demo-hyper-32k", {}),  # the bundled config this sweep chose (blocks = samples = 2048)
    "hyper b4096": ("demo", {"block_size": 4096, "sample_size": 4096, "min_seq_len": 4096}),
    "moba 512x4": ("demo-moba", {}),
    "moba 256x16": ("demo-moba", {"chunk_size": 256, "topk": 16}),
    "moba 256x32": ("demo-moba", {"chunk_size": 256, "topk": 32}),
    "nsa 8x64": ("demo-nsa", {}),
    "nsa 32x64": ("demo-nsa", {"num_selected": 32, "gates": [0.0, 1.0, 0.0]}),
    "nsa 128x64": ("demo-nsa", {"num_selected": 128, "window": 512, "gates": [0.0, 1.0, 0.0]}),
}


def keys_per_query(method: str, p: dict, n: int) -> int:
    """Keys the last query of an n-token causal prefill attends to (distinct positions, approximately)."""
    if method == "moba":  # its own chunk + topk - 1 gated chunks
        return min(n, p["topk"] * p["chunk_size"])
    if method == "nsa":  # selected blocks + sliding window (the compressed tokens only rank the blocks)
        return min(n, p["num_selected"] * p["select_block"] + p["window"])
    if method == "hyper":  # an exact causal leaf, then per halving level: an LSH block + sampled columns
        leaf = min(n, p["min_seq_len"])
        levels = max(0, math.ceil(math.log2(n / leaf))) if leaf < n else 0
        return min(n, leaf + levels * (p["block_size"] + p["sample_size"]))
    return n


def write_configs(out: Path) -> dict[str, Path]:
    """One YAML per variant under out/configs (its file name is the label eval needle records)."""
    folder = out / "configs"
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, (base, changes) in VARIANTS.items():
        file = read_config(base)  # both halves: the demo's loading keys (dtype) stay as they were
        data = {**file.load, **file.patch.to_dict()}
        data["params"] = {**data["params"], **changes}
        data["layers"] = "all"
        path = folder / (name.replace(" ", "-") + ".yaml")
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        paths[name] = path
    return paths


def table(results: dict, paths: dict[str, Path], n: int) -> list[dict]:
    records = results["records"]
    exact = {(r["depth"], r["trial"]): r["correct"] for r in records if r["layers"] == 0}
    base = next(s for s in results["summary"] if s["layers"] == 0)
    rows = [{"variant": "exact", "method": "exact", "params": {}, "keys": n, "accuracy": base["accuracy"],
             "kept": 1.0, "attention_seconds": base["attention_seconds"], "speedup": 1.0}]
    summary = {s["config"]: s for s in results["summary"] if s["layers"] != 0}
    for name, path in paths.items():  # in VARIANTS order
        s = summary.get(str(path))
        if s is None:
            continue
        cfg = load_config(path)
        mine = [r for r in records if r["config"] == s["config"] and r["layers"] == s["layers"]]
        right = [r["correct"] for r in mine if exact.get((r["depth"], r["trial"]))]
        rows.append({"variant": name, "method": cfg.method, "params": cfg.params, "layers": s["layers"],
                     "keys": keys_per_query(cfg.method, cfg.params, n), "accuracy": s["accuracy"],
                     "kept": sum(right) / len(right) if right else None,
                     "attention_seconds": s["attention_seconds"],
                     "speedup": base["attention_seconds"] / max(s["attention_seconds"], 1e-9)})
    return rows


def plot(rows: list[dict], n: int, path: Path) -> None:
    """Two panels: accuracy against the budget (keys per query / n) and against the attention speedup."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "exact"):
        rs = sorted((r for r in rows if r["method"] == method), key=lambda r: r["keys"])
        axes[0].plot([r["keys"] / n for r in rs], [r["accuracy"] for r in rs], "o-", label=method)
        axes[1].plot([r["speedup"] for r in rs], [r["accuracy"] for r in rs], "o-", label=method)
    for ax in axes:
        ax.axhline(rows[0]["accuracy"], color="k", ls="--", label="exact")
        ax.set(ylim=(-0.05, 1.05), ylabel="passkey accuracy")
    axes[0].set(xlim=(0, 1), xlabel=f"keys per query / context ({n} tokens)", title="retrieval vs budget")
    axes[1].axvline(1.0, color="grey", lw=0.8)
    axes[1].set(xlabel="attention speedup over exact (same run)", title="retrieval vs speed")
    axes[1].legend()
    fig.suptitle("every layer of the demo model replaced")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--depths", default="0.1:0.9:0.1")
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--template", default="passkey")
    ap.add_argument("--out", default="runs/needle_budgets")
    args = ap.parse_args()
    out = Path(args.out)
    try:  # bad options fail in one line (eval needle's checks); a run that finished nothing leaves no --out
        if args.length < MIN_LENGTH:  # checked here to name this script's flag (eval needle's is --lengths)
            raise ConfigError(f"--length: got {args.length}; allowed: a token count >= {MIN_LENGTH}")
        check_out(out, "eval needle")  # a user's own non-empty directory is refused, as by eval needle itself
        with removed_on_failure(out, keep_if_existed=out.exists()):
            claim_out(out, "eval needle")  # the configs sit beside eval needle's results, in its directory
            paths = write_configs(out)
            results = needle("demo", "0,all", config=",".join(str(p) for p in paths.values()),
                             template=args.template, lengths=str(args.length), depths=args.depths, trials=args.trials,
                             out=str(out), progress=False)
    except LongpatchError as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    rows = table(results, paths, args.length)
    print(f"{'variant':<14}{'keys':>7}{'acc':>7}{'kept':>7}{'attn s':>9}{'speedup':>9}")
    for r in rows:
        kept = "-" if r["kept"] is None else f"{r['kept']:.0%}"
        print(f"{r['variant']:<14}{r['keys']:>7}{r['accuracy']:>7.0%}{kept:>7}{r['attention_seconds']:>9.1f}"
              f"{r['speedup']:>8.2f}x")
    (out / "budgets.json").write_text(json.dumps({"length": args.length, "depths": args.depths, "trials": args.trials,
                                                  "template": args.template, "rows": rows}, indent=1))
    plot(rows, args.length, out / "budgets.png")
    print(f"written to {out}: budgets.json, budgets.png, and the eval needle results")


if __name__ == "__main__":
    main()
