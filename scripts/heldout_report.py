"""One summary of the 32k configs' held-out measurements: needles kept of exact's, perplexity vs exact, prefill
speedup and RULER per config, from the output directories of `eval needle`, `eval ppl`,
`bench generate` and `eval ruler` (each run with exact in the same run: `--layer-counts 0,all`).

    python scripts/heldout_report.py --needles passkey=runs/h41/grid_passkey code=runs/h41/grid_code \\
        --ppl demo=runs/h41/ppl_demo code=runs/h41/ppl_code,runs/h41/ppl_code_seed1 --generate runs/h41/bench \\
        --ruler runs/h41/ruler --out docs/img/heldout/summary.json

Writes the JSON (and prints a markdown table per measurement). Only reads what the runs wrote.

How far a figure can be trusted, beside the figure (a goal such as "within +3% of exact" or "95% of
exact's needles" is met or missed by less than the sampling noise of a few documents or prompts):
- perplexity: several ``eval ppl`` directories of one corpus (comma-separated) are pooled document by
  document; the 95% interval of the ratio to exact is a paired bootstrap over documents (each draw
  resamples whole documents, the config and exact on the same ones);
- needles: the 95% Wilson score interval of kept / exact's finds.
"""
from __future__ import annotations

import argparse
import json
import math
import random
from collections import defaultdict
from pathlib import Path

BOOTSTRAP_DRAWS = 2000


def _records(out: Path) -> list[dict]:
    rows = []
    for f in sorted(out.glob("records*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # an interrupted write
    return rows


def needles(outs: list[Path]) -> dict:
    """{config: {found, prompts, kept (of exact's), exact_found, kept_95}}, each config on the prompts both
    it and exact ran, pooled over the directories ``outs``: prompts are matched by digest, so a config's
    re-run in one directory pairs with exact's records in another, and a later directory's record of a
    config and prompt replaces an earlier one's."""
    by = defaultdict(dict)
    for r in (r for out in outs for r in _records(out)):
        name = "exact" if not r["layers"] else r["config"]
        by[name][r["digest"]] = bool(r["correct"])
    exact = by.get("exact", {})
    out = {}
    for name, got in by.items():
        common = set(got) & set(exact)
        found_by_exact = {d for d in common if exact[d]}
        kept = sum(got[d] for d in found_by_exact)
        out[name] = {"prompts": len(common), "found": sum(got[d] for d in common), "kept": kept,
                     "exact_found": len(found_by_exact), "kept_95": wilson(kept, len(found_by_exact))}
    return out


def wilson(k: int, n: int, z: float = 1.96) -> list[float] | None:
    """The 95% Wilson score interval of a proportion k / n (None for n = 0): unlike k/n +- z*se it stays in
    [0, 1] and is not empty at 0 or n (20 of 20 kept: [0.84, 1])."""
    if n == 0:
        return None
    p, z2 = k / n, z * z
    mid, half = (p + z2 / (2 * n)) / (1 + z2 / n), z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return [max(0.0, mid - half), min(1.0, mid + half)]


def _doc_nll(outs: list[Path]) -> dict:
    """{config: {(dir, document digest): (nll_sum, scored_tokens)}} from the records of every directory."""
    by = defaultdict(dict)
    for out in outs:
        # the records name a config by id; results.json (written with them) maps ids to configs
        configs = {c["config_id"]: ("exact" if not c["layers"] else c["config"])
                   for c in json.loads((out / "results.json").read_text())["configs"]}
        for r in _records(out):
            if "nll_sum" in r and r.get("config_id") in configs:
                by[configs[r["config_id"]]][(str(out), r["digest"])] = (r["nll_sum"], r["scored_tokens"])
    return by


def ppl_ratio_interval(pairs: list[tuple[float, float, float]], draws: int = BOOTSTRAP_DRAWS,
                       seed: int = 0) -> list[float]:
    """95% interval of ppl(config) / ppl(exact) pooled over documents, by a paired bootstrap: ``pairs``
    holds per document (config nll_sum, exact nll_sum, scored tokens); each draw resamples documents."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(draws):
        pick = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        tokens = sum(t for *_, t in pick)
        ratios.append(math.exp((sum(a for a, _, _ in pick) - sum(b for _, b, _ in pick)) / tokens))
    ratios.sort()
    return [ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]]


def perplexity(outs: list[Path]) -> dict:
    """{config: ppl, vs_exact, its 95% interval, docs} pooled over the documents that exact and the
    config both scored in the directories ``outs`` (one corpus, one or several runs)."""
    by = _doc_nll(outs)
    exact = by.get("exact", {})
    result = {}
    for name, docs in by.items():
        common = sorted(set(docs) & set(exact))
        if not common:
            continue
        tokens = sum(docs[d][1] for d in common)
        nll, base = sum(docs[d][0] for d in common), sum(exact[d][0] for d in common)
        pairs = [(docs[d][0], exact[d][0], docs[d][1]) for d in common]
        result[name] = {"ppl": math.exp(nll / tokens), "vs_exact": math.exp((nll - base) / tokens) - 1,
                        "vs_exact_95": [x - 1 for x in ppl_ratio_interval(pairs)], "docs": len(common)}
    return result


def generate(out: Path) -> dict:
    res = json.loads((out / "results.json").read_text())
    rows = {r["config"]: r for r in res["records"]}
    base = next(r for r in res["records"] if not r["layers"])["ttft_s"]
    return {"loadavg": res["meta"].get("loadavg"),
            "rows": {name: {"ttft_s": r["ttft_s"], "speedup": base / r["ttft_s"]} for name, r in rows.items()}}


def ruler(out: Path) -> dict:
    """{config: {task@length: [score, ...]}} from the records (score field, else correct)."""
    by = defaultdict(lambda: defaultdict(list))
    for r in _records(out):
        name = "exact" if not r["layers"] else r["config"]
        score = r.get("score", r.get("correct"))
        by[name][f"{r.get('task')}@{r.get('length', r.get('target_length'))}"].append(score)
    return {k: dict(v) for k, v in by.items()}


def _pairs(items: list[str]) -> list[tuple[str, list[Path]]]:
    return [(i.split("=", 1)[0], [Path(p) for p in i.split("=", 1)[1].split(",")]) for i in items]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--needles", nargs="*", default=[], help="name=dir[,dir...] of `eval needle` (pooled)")
    ap.add_argument("--ppl", nargs="*", default=[], help="name=dir[,dir...] of `eval ppl` (one corpus: pooled)")
    ap.add_argument("--generate", help="dir of `bench generate`")
    ap.add_argument("--ruler", help="dir of `eval ruler`")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    summary = {"needles": {n: needles([d for d in p if d.is_dir()]) for n, p in _pairs(args.needles)
                           if any(d.is_dir() for d in p)},
               "perplexity": {n: perplexity([d for d in p if (d / "results.json").is_file()]) for n, p in
                              _pairs(args.ppl) if any((d / "results.json").is_file() for d in p)}}
    if args.generate and (Path(args.generate) / "results.json").is_file():
        summary["prefill_32k"] = generate(Path(args.generate))
    if args.ruler and Path(args.ruler).is_dir():
        summary["ruler"] = ruler(Path(args.ruler))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    for name, rows in summary["needles"].items():
        print(f"\nneedles {name}")
        for c, r in rows.items():
            ci = r["kept_95"]
            ci = f"[{100 * ci[0]:.0f}%, {100 * ci[1]:.0f}%]" if ci else "-"
            print(f"| {c} | {r['found']}/{r['prompts']} | {r['kept']} of {r['exact_found']} | {ci} |")
    for name, rows in summary["perplexity"].items():
        print(f"\nperplexity {name}")
        for c, r in rows.items():
            lo, hi = r["vs_exact_95"]
            print(f"| {c} | {r['ppl']:.2f} | {100 * r['vs_exact']:+.1f}% [{100 * lo:+.1f}%, {100 * hi:+.1f}%] | "
                  f"{r['docs']} |")
    if "prefill_32k" in summary:
        print(f"\nprefill at 32k (load {summary['prefill_32k']['loadavg']})")
        for c, r in summary["prefill_32k"]["rows"].items():
            print(f"| {c} | {r['ttft_s']:.2f} s | {r['speedup']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
