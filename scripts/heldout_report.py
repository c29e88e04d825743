"""One summary of the issue-41 measurements: needles kept of exact's, perplexity against exact, prefill
speedup and RULER per config, from the output directories of `eval needle`, `eval ppl`,
`bench generate` and `eval ruler` (each run with exact in the same run: `--layer-counts 0,all`).

    python scripts/heldout_report.py --needles passkey=runs/h41/grid_passkey code=runs/h41/grid_code \\
        --ppl demo=runs/h41/ppl_demo code=runs/h41/ppl_code --generate runs/h41/bench \\
        --ruler runs/h41/ruler --out docs/img/heldout/summary.json

Writes the JSON (and prints a markdown table per measurement). Only reads what the runs wrote.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def _records(out: Path) -> list[dict]:
    rows = []
    for f in sorted(out.glob("records*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # an interrupted write
    return rows


def needles(out: Path) -> dict:
    """{config: {found, prompts, kept (of exact's), exact_found}} on the prompts every config ran."""
    by = defaultdict(dict)
    for r in _records(out):
        name = "exact" if not r["layers"] else r["config"]
        by[name][r["digest"]] = bool(r["correct"])
    exact = by.get("exact", {})
    common = set(exact)
    for got in by.values():
        common &= set(got)
    found_by_exact = {d for d in common if exact[d]}
    return {name: {"prompts": len(common), "found": sum(got[d] for d in common),
                   "kept": sum(got[d] for d in found_by_exact), "exact_found": len(found_by_exact)}
            for name, got in by.items()}


def perplexity(out: Path) -> dict:
    res = json.loads((out / "results.json").read_text())
    rows = {("exact" if not c["layers"] else c["config"]): c["all"] for c in res["configs"]}
    base = rows["exact"]["ppl"]
    return {name: {"ppl": r["ppl"], "vs_exact": r["ppl"] / base - 1, "docs": r["docs"],
                   "attention_speedup": r.get("attention_speedup")} for name, r in rows.items()}


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


def _pairs(items: list[str]) -> list[tuple[str, Path]]:
    return [(i.split("=", 1)[0], Path(i.split("=", 1)[1])) for i in items]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--needles", nargs="*", default=[], help="name=dir of `eval needle`")
    ap.add_argument("--ppl", nargs="*", default=[], help="name=dir of `eval ppl`")
    ap.add_argument("--generate", help="dir of `bench generate`")
    ap.add_argument("--ruler", help="dir of `eval ruler`")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    summary = {"needles": {n: needles(p) for n, p in _pairs(args.needles) if p.is_dir()},
               "perplexity": {n: perplexity(p) for n, p in _pairs(args.ppl) if (p / "results.json").is_file()}}
    if args.generate and (Path(args.generate) / "results.json").is_file():
        summary["prefill_32k"] = generate(Path(args.generate))
    if args.ruler and Path(args.ruler).is_dir():
        summary["ruler"] = ruler(Path(args.ruler))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    for name, rows in summary["needles"].items():
        print(f"\nneedles {name}")
        for c, r in rows.items():
            print(f"| {c} | {r['found']}/{r['prompts']} | {r['kept']} of {r['exact_found']} |")
    for name, rows in summary["perplexity"].items():
        print(f"\nperplexity {name}")
        for c, r in rows.items():
            print(f"| {c} | {r['ppl']:.2f} | {100 * r['vs_exact']:+.1f}% |")
    if "prefill_32k" in summary:
        print(f"\nprefill at 32k (load {summary['prefill_32k']['loadavg']})")
        for c, r in summary["prefill_32k"]["rows"].items():
            print(f"| {c} | {r['ttft_s']:.2f} s | {r['speedup']:.2f}x |")


if __name__ == "__main__":
    main()
