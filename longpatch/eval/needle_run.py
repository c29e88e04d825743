"""`longpatch eval needle`: the needle grid (configs x layer counts x lengths x depths x trials) run
with greedy generation, resumable, with results.json / results.csv / one heatmap per (config, layers).

Every configuration sees the same prompts (keys and haystacks depend only on the seed, the template,
the length, the depth and the trial). A record is kept per generation in records*.jsonl and a rerun
with the same --out skips what is there (matched by configuration and prompt digest).
"""
from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..errors import ConfigError
from ..patching import patch_model, total_seconds, unpatch_model
from . import needle as N
from .perplexity import (
    Point,
    RecordLog,
    _check_positive,
    _distributed,
    _input_device,
    _num_layers,
    _prepare_model,
    _write_json,
    make_points,
    parse_layer_sweep,
    read_records,
)

log = logging.getLogger("longpatch")

RESULTS_FILE = "results.json"
CSV_FILE = "results.csv"


@dataclass
class Trial:
    length: int
    depth: float
    trial: int
    prompt: N.Prompt
    digest: str


def parse_lengths(spec: "str | Sequence[int]") -> list[int]:
    items = spec if isinstance(spec, (list, tuple)) else str(spec).split(",")
    try:
        values = [int(str(x).strip()) for x in items]
    except ValueError:
        raise ConfigError(f"--lengths: got {spec!r}; allowed: comma-separated token counts >= 64") from None
    if not values or min(values) < 64:
        raise ConfigError(f"--lengths: got {spec!r}; allowed: comma-separated token counts >= 64")
    return sorted(set(values))


def plan_trials(filler: N.Filler, template: N.Template, lengths: list[int], depths: list[float], trials: int,
                seed: int) -> list[Trial]:
    out = []
    for n in lengths:
        for d in depths:
            for t, key in enumerate(N.cell_keys(template, n, d, trials, seed)):
                start_seed = int(hashlib.sha256(f"{seed}|{n}|{d:.6f}|{t}".encode()).hexdigest()[:12], 16)
                p = N.build_prompt(filler, template, key, n, d, start_seed)
                digest = hashlib.sha1(json.dumps([p.ids, p.expected]).encode()).hexdigest()[:16]
                out.append(Trial(n, d, t, p, digest))
    return out


def needle(model, layers=None, *, configs: Sequence[str | None] = (None,), method: str | None = None,
           sets: Sequence[str] = (), template: str = "code", lengths="4096,8192,16384,32768",
           depths: str = "0:1:0.1", trials: int = 4, filler: str = "demo", seed: int = 0,
           out: str = "runs/needle", tokenizer=None, trust_remote_code: bool = False,
           progress: bool = True, plots: bool = True) -> dict:
    """Needle-in-a-haystack accuracy of `model` patched per each config and layer count.

    model: a model name (as `eval ppl` takes) or a loaded unpatched model (then pass `tokenizer`).
    configs: config aliases/YAML paths (None: `method` with `sets`, or the model's bundled config).
    template: 'code', 'passkey' or a YAML template file. filler: see needle.filler_texts.
    Returns the results dict also written to out/results.json (rank 0; {} elsewhere).
    """
    _check_positive("trials", trials, 1)
    _check_positive("seed", seed, 0)
    sweep = parse_layer_sweep(layers)
    tmpl = N.load_template(template)
    length_list = parse_lengths(lengths)
    depth_list = N.parse_depths(depths)
    dist = _distributed()
    main = dist.rank == 0
    out = Path(out)

    prepared = []
    loaded = model
    for config in configs:
        cfg, loaded, tok, name = _prepare_model(loaded, config, method, sets, trust_remote_code, None, dist)
        prepared.append((config, cfg))
        tokenizer = tokenizer or tok
    model = loaded
    if tokenizer is None or isinstance(tokenizer, str):
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(tokenizer or name, trust_remote_code=trust_remote_code)
    fill = N.Filler(N.filler_texts(tmpl.filler or filler), tokenizer)
    work = plan_trials(fill, tmpl, length_list, depth_list, trials, seed)
    num_layers = _num_layers(model, prepared[0][1])
    identity = {"model": name, "template": tmpl.name, "filler": tmpl.filler or filler, "seed": seed, "task": "needle"}
    points: list[tuple[str, Point]] = []
    for config, cfg in prepared:
        label = config or (f"{cfg.method}" if method else "default")
        for p in make_points(cfg, sweep, num_layers, dict(identity, dtype=cfg.dtype,
                                                           attn_implementation=cfg.attn_implementation)):
            # 0 replaced layers is plain exact attention whatever the config: one shared baseline
            if all(p.config_id != q.config_id for _, q in points):
                points.append(("exact" if p.layers == 0 else label, p))
    if main:
        out.mkdir(parents=True, exist_ok=True)
    _run(model, tokenizer, points, work[dist.rank::dist.world], out, dist, progress and main)
    dist.barrier()
    if not main:
        return {}
    results = summarize(out, {"model": name, "template": tmpl.name, "filler": tmpl.filler or filler,
                              "lengths": length_list, "depths": depth_list, "trials": trials, "seed": seed},
                        plots=plots)
    return results


def _run(model, tokenizer, points, work: list[Trial], out: Path, dist, progress: bool) -> None:
    from tqdm.auto import tqdm

    done = {(r.get("config_id"), r.get("digest")) for r in read_records(out)}
    todo = [(label, p, [w for w in work if (p.config_id, w.digest) not in done]) for label, p in points]
    total = sum(len(ws) for _, _, ws in todo)
    already = len(points) * len(work) - total
    if already and progress:
        print(f"longpatch: resuming: {already} of {already + total} generations already in {out}", file=sys.stderr)
    if not total:
        return
    writer = RecordLog(out / ("records.jsonl" if dist.world == 1 else f"records.rank{dist.rank}.jsonl"))
    device = _input_device(model)
    eos = tokenizer.eos_token_id
    bar = tqdm(total=total, desc="eval needle", unit="gen", disable=not progress, dynamic_ncols=True)
    try:
        for label, point, pending in todo:
            if not pending:
                continue
            patch_model(model, point.cfg)
            try:
                bar.set_description(f"{label} {point.label}")
                for w in pending:
                    model.longpatch.reset_stats()
                    ids = torch.tensor([w.prompt.ids], device=device)
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                             max_new_tokens=N.answer_tokens(tokenizer, w.prompt.expected),
                                             pad_token_id=eos if eos is not None else 0)
                    seconds = time.perf_counter() - t0
                    predicted = tokenizer.decode(gen[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
                    stats = model.longpatch.breakdown()  # prefill and decode apart: generate() does both
                    writer.append({
                        "config": label, "method": point.cfg.method if point.layers else "exact",
                        "layers": point.layers, "length": len(w.prompt.ids), "depth": w.depth, "trial": w.trial,
                        "expected": w.prompt.expected, "predicted": predicted,
                        "correct": N.judge(predicted, w.prompt.expected), "config_id": point.config_id,
                        "label": point.label, "digest": w.digest, "needle_token": w.prompt.needle_token,
                        "seconds": seconds, "attention": stats,
                        "attention_seconds": total_seconds(stats),
                    })
                    bar.update(1)
            finally:
                unpatch_model(model)
    finally:
        bar.close()
        writer.close()


def summarize(out: Path, meta: dict, plots: bool = True) -> dict:
    """Merge the records into results.json ({"records", "summary", ...}), results.csv and heatmaps."""
    records = sorted(read_records(out), key=lambda r: (r["config"], r["layers"], r["length"], r["depth"], r["trial"]))
    wanted = {(n, round(d, 6)) for n in meta["lengths"] for d in meta["depths"]}
    records = [r for r in records if (r["length"], round(r["depth"], 6)) in wanted]
    if not records:
        raise ConfigError(f"eval needle: no generation finished in {out}; nothing to report")
    summary = N.summarize_records(records)
    for s in summary:  # attention time of the cell's generations, per path
        rs = [r for r in records if (r["config"], r["layers"], r["length"]) == (s["config"], s["layers"], s["length"])]
        s["attention_seconds"] = sum(r["attention_seconds"] for r in rs)
        s["seconds"] = sum(r["seconds"] for r in rs)
    files = {"csv": CSV_FILE, "heatmaps": []}
    if plots:
        for config, layers in dict.fromkeys((r["config"], r["layers"]) for r in records):
            name = f"heatmap_{_safe(config)}_{layers}.png"
            N.heatmap(records, config, layers, out / name, title=f"{meta['model']}: {config}, {layers} layers "
                      f"replaced ({meta['template']})")
            files["heatmaps"].append(name)
    keep = ("config", "method", "layers", "length", "depth", "trial", "expected", "predicted", "correct",
            "needle_token", "seconds", "attention_seconds", "attention")
    results = {**meta, "records": [{k: r[k] for k in keep} for r in records], "summary": summary, "files": files}
    _write_json(out / RESULTS_FILE, results)
    _write_csv(summary, out / CSV_FILE)
    return results


def _write_csv(summary: list[dict], path: Path) -> None:
    import csv

    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summary[0]))
        w.writeheader()
        w.writerows(summary)
    tmp.replace(path)


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(str(text)).stem or str(text))


def print_results(results: dict) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    lengths = results["lengths"]
    t = Table(title=f"{results['model']}: needle accuracy ({results['template']}, {len(results['depths'])} depths x "
                    f"{results['trials']} trials)", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ["config", "layers", *[N._k(n) for n in lengths], "attn s"]:
        t.add_column(col, justify="left" if col == "config" else "right")
    rows: dict[tuple, dict] = {}
    for s in results["summary"]:
        rows.setdefault((s["config"], s["layers"]), {})[s["length"]] = s
    for (config, layers), cells in rows.items():
        t.add_row(config, str(layers), *[f"{cells[n]['accuracy']:.2f}" if n in cells else "-" for n in lengths],
                  f"{sum(c['attention_seconds'] for c in cells.values()):.2f}")
    Console(emoji=False, highlight=False).print(t, markup=False)

