"""The quality–speed frontier of the demo model: needles kept against whole-model
prefill speedup, one point per config.

Reads the records of an `eval needle` run (every config at one layer count beside exact attention,
layers 0, on the same prompts) and the `results.json` of a `bench generate` run (the same configs and
the unpatched model in one run), and writes a table, results.json and frontier.png:

    python scripts/frontier_report.py --needles runs/grid_passkey --generate runs/ttft --context 32768 \\
        --out docs/img/frontier

"kept" = the prompts both exact attention and the config answer / the prompts exact attention answers;
"prefill speedup" = the unpatched model's time to first token / the config's (same run, same prompt).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from longpatch.bench.common import figure, save_figure, show_table
from longpatch.eval.records import read_records
from longpatch.outdir import write_json
from longpatch.plotting import method_color


def needle_table(records: list[dict], layers: int, length: int) -> dict[tuple, dict]:
    """(config, config_id) -> {"found", "kept", "exact_found", "prompts"} on the prompts exact attention
    was run on."""
    key = ("length", "depth", "trial")
    exact = {tuple(r[k] for k in key): r["correct"] for r in records if r["layers"] == 0 and r["length"] == length}
    out: dict[str, dict] = {}
    for pos, r in enumerate(records):
        p = tuple(r[k] for k in key)
        if r["layers"] != layers or r["length"] != length or p not in exact:
            continue
        # one entry per config id: a config file changed between runs keeps its own row
        c = out.setdefault((r["config"], r.get("config_id")), {"method": r.get("method"), "found": 0, "kept": 0,
                                                               "prompts": 0, "exact_found": 0})
        c["last_record"] = pos  # the latest run of a name keeps the plain name (main)
        c["prompts"] += 1
        c["exact_found"] += bool(exact[p])
        c["found"] += bool(r["correct"])
        c["kept"] += bool(r["correct"]) and bool(exact[p])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--needles", required=True, help="an eval needle --out (records*.jsonl)")
    ap.add_argument("--generate", required=True, help="a bench generate --out (results.json)")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default="runs/frontier")
    a = ap.parse_args(argv)
    gen_file = Path(a.generate) / "results.json"
    if not gen_file.is_file():
        print(f"frontier_report: error: --generate: no results.json in {a.generate}", file=sys.stderr)
        return 2
    records = read_records(Path(a.needles))
    if not records:
        print(f"frontier_report: error: --needles: no records in {a.needles}", file=sys.stderr)
        return 2
    needles = needle_table(records, a.layers, a.context)
    gen = [r for r in json.loads(gen_file.read_text())["records"] if r["context"] == a.context]
    base = [r["ttft_s"] for r in gen if r["layers"] == 0]
    ttft = {r["config"]: r["ttft_s"] for r in gen if r["layers"] == a.layers}
    rows = []
    latest = {}
    for (name, cid), c in needles.items():
        if name not in latest or c["last_record"] > needles[(name, latest[name])]["last_record"]:
            latest[name] = cid
    for (name, cid), c in sorted(needles.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        label = Path(name).stem if name.endswith(".yaml") else name
        if cid != latest[name]:  # an earlier run of the same name with other params: the id tells it apart
            label = f"{label} [{cid}]"
        t = ttft.get(label)
        counts = {k: c[k] for k in ("found", "kept", "exact_found", "prompts")}
        rows.append({"config": label, "config_id": cid, "method": c["method"], **counts,
                     "kept_share": c["kept"] / c["exact_found"] if c["exact_found"] else None,
                     "ttft_s": t, "unpatched_ttft_s": base[0] if base else None,
                     "prefill_speedup": base[0] / t if base and t else None})
    show_table(f"needles kept and prefill speedup at {a.context} tokens, {a.layers} layers replaced",
               ["config", "found", "kept of exact's", "TTFT s", "prefill speedup"],
               [[r["config"], f"{r['found']}/{r['prompts']}", f"{r['kept']}/{r['exact_found']}"
                 + (f" ({r['kept_share']:.0%})" if r["kept_share"] is not None else ""),
                 f"{r['ttft_s']:.2f}" if r["ttft_s"] else "–",
                 f"{r['prefill_speedup']:.2f}×" if r["prefill_speedup"] else "–"] for r in rows], left=("config",))
    out = Path(a.out)
    write_json(out / "results.json", {"meta": {"needles": a.needles, "generate": a.generate, "context": a.context,
                                               "layers": a.layers}, "rows": rows})
    fig, ax = figure(1, 1, (6, 4.2))
    ax = ax[0][0]
    shown = [r for r in rows if r["prefill_speedup"] is not None and r["kept_share"] is not None]
    level: dict = {}  # labels of points at one height alternate above and below, so neighbours do not overlap
    for r in sorted(shown, key=lambda r: r["prefill_speedup"]):
        i = level[round(r["kept_share"], 1)] = level.get(round(r["kept_share"], 1), -1) + 1
        ax.scatter(r["prefill_speedup"], 100 * r["kept_share"], color=method_color(r["method"] or r["config"]),
                   s=40, zorder=3)
        ax.annotate(r["config"], (r["prefill_speedup"], 100 * r["kept_share"]), textcoords="offset points",
                    xytext=(-20, 7 if i % 2 else -12), fontsize=7)
    ax.axhline(95, color="grey", lw=0.8, ls="--")
    ax.axvline(3, color="grey", lw=0.8, ls="--")
    ax.axvline(1, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("whole-model prefill speedup over exact (TTFT)")
    ax.set_ylabel("needles kept, % of exact's")
    ax.set_ylim(-5, 105)
    ax.grid(alpha=0.3, which="both")
    save_figure(fig, out / "frontier.png", f"{a.context} tokens, {a.layers} layers replaced (goal: upper right)")
    print(f"wrote {out / 'results.json'} and {out / 'frontier.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
