"""`longpatch eval longbench`: LongBench task scores (the HyperAttention paper's Table 1) of a model
patched per config and layer count, with LongBench's own prompts, generation and metrics.

Protocol (docs/evaluation.md, "LongBench task scores"): each record's prompt is built as LongBench's
pred.py builds it (longbench_tasks.prompt_ids: template, middle truncation to the prompt budget, chat
format except the few-shot and code tasks), the model continues it greedily with `model.generate` for
the task's number of new tokens (samsum: also stopping at a newline, at least one token), and the
decoded continuation is scored with LongBench's metric (longbench_metrics.longbench_score).

Every configuration gets the same prompts. One record per generation goes to records*.jsonl as it
finishes; a rerun with the same --out skips what is there (matched by configuration and prompt digest).
Processes, records and the sweep are those of `eval ppl` and `eval needle` (launch, records, sweep).
Output: one directory per (config, layers) with pred/<task>.jsonl (LongBench's format, so its eval.py
can score it again) and result.json (task -> score, as its eval.py writes), and at the top
results.json, results.csv and scores_vs_layers.png (category score against replaced layers).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import ConfigError, LongpatchError, check_int
from ...options import MAX_TOKENS, split_items
from ...outdir import claim_out, write_csv, write_json
from ...patching import total_seconds
from ..launch import Dist, run_sharded
from ..records import PLAN_FILE, read_plan, read_records, seconds_by_path
from ..sweep import (
    Point,
    RunSpec,
    generation_shapes,
    input_device,
    labelled_points,
    model_dtype,
    num_layers,
    prepare_configs,
    resolve_spec,
    run_generations,
    timed_rows,
)
from . import tasks as T
from .data import CATEGORIES, LongBench, Record, code_completion_tasks, load_longbench, report_problems, source_name
from .metrics import LENGTH_BUCKETS, longbench_score, longbench_score_e

RESULTS_FILE = "results.json"
CSV_FILE = "results.csv"
PLOT_FILE = "scores_vs_layers.png"
# --data demo: small enough for a CPU sweep in a couple of minutes, long enough (> the demo config's
# min_seq_len of 1024) that the patched layers run their method on the prompts
DEMO_TASK = "demo_lcc"
DEMO_MAX_LENGTH = 2048
DEMO_SAMPLES = 4
DEMO_LAYERS = "0,2,4"  # the demo model has 4 layers: none, half, all replaced


@dataclass
class LongBenchSpec(RunSpec):
    """Everything `eval longbench` takes besides the model (RunSpec: patch, sweep, out, processes).

    config: one config, a comma-separated list or a list (each gets the whole sweep). tasks: 'all',
    'en', 'zh', or comma-separated task / category names. e: LongBench-E (its 13 tasks, scores per
    length bucket). max_length: the prompt budget in tokens (default: LongBench's for the model, else
    its positions minus 500; --data demo: 2048). max_samples: at most the first N records of each
    task (--data demo: 4). data: as `eval ppl` (None: the hub's data.zip), or 'demo' (code-completion
    tasks from the demo model's held-out code; layers default to 0,2,4). strict: a malformed record is
    fatal. max_new_tokens: a cap on every task's generation length, for quick checks only (scores made
    with it are not LongBench's protocol; results record it). batch_size: records of a task generated
    together in one left-padded batch (same predictions as 1).
    """

    COMMAND = "eval longbench"
    out: str = "runs/longbench"
    tasks: object = "all"
    e: bool = False
    max_length: int | None = None
    max_samples: int | None = None
    data: str | None = None
    strict: bool = False
    max_new_tokens: int | None = None
    batch_size: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.layers is None and self.layer_counts is None and self.data == "demo":
            self.layer_counts = DEMO_LAYERS
        if self.max_new_tokens is not None:
            check_int("--max-new-tokens", self.max_new_tokens, 1, MAX_TOKENS)
        if self.max_length is not None:
            check_int("--max-length", self.max_length, 16, MAX_TOKENS)
        if self.max_samples is not None:
            check_int("--max-samples", self.max_samples, 1)
        check_int("--batch-size", self.batch_size, 1)
        if self.e and self.data == "demo":
            raise ConfigError("--e: LongBench-E needs LongBench's data; --data demo has no length-balanced set")

    def task_names(self) -> list[str]:
        return T.resolve_tasks(self.tasks, self.e, [DEMO_TASK] if self.data == "demo" else None)


@dataclass
class Item:
    """One record's prompt, the same for every configuration."""

    task: str
    record: Record
    ids: list[int]
    max_new: int
    digest: str


def longbench(model, layer_counts=None, *, spec: LongBenchSpec | None = None, **options) -> dict:
    """LongBench task scores of `model` patched per each config and layer count.

    model: a model name (as `eval ppl` takes) or a loaded unpatched model (then pass `tokenizer`).
    layer_counts: the sweep, as `eval ppl` (RunSpec). options: the fields of LongBenchSpec, or spec=.
    Returns the results dict also written to out/results.json (rank 0; {} elsewhere). Bad options fail
    before anything is loaded or written; a failed run that finished no generation leaves no `out`.
    """
    spec = resolve_spec(LongBenchSpec, "longbench", spec, layer_counts, options)
    spec.task_names()
    return run_sharded(spec, model, "longpatch.eval.longbench.run:longbench",
                       lambda dist, run_id: _evaluate(model, spec, dist, run_id),
                       lambda: summarize(spec.out, plots=spec.plots))


def load_tasks(spec: LongBenchSpec) -> LongBench:
    """The requested tasks' records (--data demo: code-completion tasks built from the demo code)."""
    tasks = spec.task_names()
    if spec.data == "demo":
        lb = load_longbench("demo", strict=spec.strict)
        records = code_completion_tasks([r for rs in lb.records.values() for r in rs], DEMO_TASK)
        lb.records, lb.categories = {DEMO_TASK: records}, {DEMO_TASK: "code"}
    else:
        # as in eval ppl: a task named by itself must be there; of 'all', 'en' or a category, the present ones run
        named = [t for t in split_items("--tasks", spec.tasks, "task names") if t in tasks] \
            if isinstance(spec.tasks, str) else list(tasks)
        lb = load_longbench(spec.data, tasks, strict=spec.strict, e=spec.e, explicit=named)

    limit = spec.max_samples or (DEMO_SAMPLES if spec.data == "demo" else None)
    if limit:
        lb.records = {t: rs[:limit] for t, rs in lb.records.items()}
    return lb


def plan_items(lb: LongBench, tokenizer, max_length: int, model_name: str, progress: bool,
               cap: int | None = None) -> list[Item]:
    from tqdm.auto import tqdm

    items = []
    total = sum(len(rs) for rs in lb.records.values())
    bar = tqdm(total=total, desc="prompts", unit="rec", disable=not progress, leave=False)
    for task, records in lb.records.items():
        max_new = min(T.MAX_NEW_TOKENS[T.protocol(task)], cap or 1 << 30)
        for rec in records:
            ids = T.prompt_ids(tokenizer, task, rec.context, rec.input, max_length, model_name)
            digest = hashlib.sha1(json.dumps([task, ids, max_new]).encode()).hexdigest()[:16]
            items.append(Item(task, rec, ids, max_new, digest))
            bar.update(1)
    bar.close()
    return items


def _evaluate(model, spec: LongBenchSpec, dist: Dist, run_id: str) -> dict:
    out = Path(spec.out)
    lb = load_tasks(spec)
    if dist.main:
        report_problems(lb)
    prep = prepare_configs(model, spec, dist)
    model, tokenizer, name = prep.model, prep.tokenizer, prep.name
    max_length = spec.max_length or (DEMO_MAX_LENGTH if spec.data == "demo" else
                                     T.default_max_length(name, getattr(model, "config", None)))
    items = plan_items(lb, tokenizer, max_length, name, spec.progress and dist.main, spec.max_new_tokens)
    if not items:
        problems = f"; {len(lb.problems)} malformed and skipped (first: {lb.problems[0]})" if lb.problems else ""
        raise LongpatchError(f"eval longbench: nothing to evaluate: no record of {', '.join(lb.records)} in "
                             f"{lb.source}{problems}")
    n_layers = num_layers(model, prep.patches[0][1])
    identity = {"model": name, "task": "longbench", "e": spec.e, "max_length": max_length,
                "tokenizer": str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)}
    points = labelled_points(prep, spec, n_layers, identity)
    if dist.main:
        claim_out(out, spec.COMMAND)
        write_json(out / PLAN_FILE, {
            "model": name, "dtype": model_dtype(model), "data": lb.source, "tasks": list(lb.records), "e": spec.e,
            "max_length": max_length,
            "max_samples": spec.max_samples, "max_new_tokens": spec.max_new_tokens, "num_layers": n_layers,
            "points": [dict(p.describe(), config=label) for label, p in points],
            "items": [{"task": w.task, "doc_id": w.record.doc_id, "digest": w.digest, "prompt_tokens": len(w.ids),
                       "length": w.record.length} for w in items],
            "missing_tasks": lb.missing, "data_problems": [p.to_dict() for p in lb.problems]})
    device = input_device(model)
    stops = {t: T.stop_ids(tokenizer, t) for t in {w.task for w in items}}
    run_generations(model, points, items[dist.rank::dist.world], out, dist, spec.progress and dist.main,
                    "eval longbench", lambda label, p, w: _generate(model, tokenizer, label, p, w, device,
                                                                    stops[w.task], dist.rank, run_id),
                    generation_shapes((len(w.ids), w.max_new) for w in items), batch=spec.batch_size,
                    many=lambda label, p, ws: _generate_batch(model, tokenizer, label, p, ws, device, stops, dist.rank,
                                                              run_id))
    dist.barrier()
    if dist.mode == "spawned" or not dist.main:
        return {}
    return summarize(out, plots=spec.plots)


def _generate(model, tokenizer, label: str, point: Point, w: Item, device, stop, rank: int, run_id: str) -> dict:
    """One greedy generation (pred.py's settings) and its record."""
    eos, min_new = stop
    model.longpatch.reset_stats()
    ids = torch.tensor([w.ids], device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    extra = {"eos_token_id": eos, "min_new_tokens": min_new} if eos else {}
    t0 = time.perf_counter()
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                             max_new_tokens=w.max_new, pad_token_id=pad if pad is not None else 0, **extra)
    seconds = time.perf_counter() - t0
    new = gen[0, ids.shape[1]:].tolist()
    stats = model.longpatch.breakdown()
    rec = w.record
    return {"config": label, "method": point.cfg.method if point.layers else "exact", "layers": point.layers,
            "config_id": point.config_id, "label": point.label, "task": w.task, "doc_id": rec.doc_id,
            "digest": w.digest, "pred": tokenizer.decode(new, skip_special_tokens=True),
            "answers": list(rec.answers), "all_classes": None if rec.all_classes is None else list(rec.all_classes),
            "length": rec.length, "prompt_tokens": len(w.ids), "new_tokens": len(new), "seconds": seconds,
            "attention": stats, "attention_seconds": total_seconds(stats), "rank": rank, "run_id": run_id}


def _generate_batch(model, tokenizer, label: str, point: Point, ws: list[Item], device, stops: dict, rank: int,
                    run_id: str) -> list[dict]:
    """Greedy generations of several records in left-padded batches, one per task (tasks stop differently),
    one record each; each row's tokens are those of its record alone (generate_rows); seconds and attention
    stats are each batch's, shared evenly between its records."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = {}
    for task in dict.fromkeys(w.task for w in ws):
        group = [w for w in ws if w.task == task]
        eos, min_new = stops[task]
        rows, seconds, stats = timed_rows(model, [w.ids for w in group], [w.max_new for w in group], device,
                                          eos or tokenizer.eos_token_id, pad, num_beams=1,
                                          **({"eos_token_id": eos, "min_new_tokens": min_new} if eos else {}))
        for w, new in zip(group, rows):
            rec = w.record
            out[id(w)] = {
                "config": label, "method": point.cfg.method if point.layers else "exact", "layers": point.layers,
                "config_id": point.config_id, "label": point.label, "task": w.task, "doc_id": rec.doc_id,
                "digest": w.digest, "pred": tokenizer.decode(new, skip_special_tokens=True),
                "answers": list(rec.answers), "all_classes": None if rec.all_classes is None else list(rec.all_classes),
                "length": rec.length, "prompt_tokens": len(w.ids), "new_tokens": len(new), "seconds": seconds,
                "batch": len(group), "attention": stats, "attention_seconds": total_seconds(stats), "rank": rank,
                "run_id": run_id}
    return [out[id(w)] for w in ws]


# ---- report ----------------------------------------------------------------------------------------

def point_dir(config: str, layers: int) -> str:
    return f"{''.join(c if c.isalnum() or c in '-_.' else '_' for c in Path(str(config)).stem or str(config))}" \
           f"_{layers}"


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    """LongBench's pred file (ensure_ascii=False, one object a line), replaced atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def summarize(out: "str | Path", plots: bool = True) -> dict:
    """Merge plan.json and the records into each (config, layers)'s pred/ and result.json, and the top
    results.json, results.csv and plot. Records are taken in plan order, so the result does not depend
    on how many processes wrote them or in which order."""
    out = Path(out)
    plan = read_plan(out)
    e = plan["e"]
    index: dict[tuple, dict] = {}
    for r in read_records(out):
        index.setdefault((r.get("config_id"), r.get("digest")), r)
    configs = []
    for point in plan["points"]:
        per_task: dict[str, list[dict]] = {}
        planned: dict[str, int] = {}
        for it in plan["items"]:
            planned[it["task"]] = planned.get(it["task"], 0) + 1
            r = index.get((point["config_id"], it["digest"]))
            if r is not None:
                per_task.setdefault(it["task"], []).append(r)
        if not per_task:
            continue
        name = point_dir(point["config"], point["layers"])
        tasks, result = {}, {}
        for task, rs in per_task.items():
            _write_jsonl(out / name / "pred" / f"{task}.jsonl",
                         [{k: r[k] for k in ("pred", "answers", "all_classes", "length")} for r in rs])
            args = (task, [r["pred"] for r in rs], [r["answers"] for r in rs], rs[0]["all_classes"])
            score = longbench_score(*args)
            result[task] = longbench_score_e(*args[:3], [r["length"] for r in rs], args[3]) if e else score
            tasks[task] = {"score": score, "records": len(rs), "planned": planned[task],
                           "complete": len(rs) == planned[task], "metric": T.metric_of(task),
                           **({"by_length": result[task]} if e else {}),
                           "attention_seconds": math.fsum(r["attention_seconds"] for r in rs),
                           "seconds": math.fsum(r["seconds"] for r in rs)}
        write_json(out / name / "result.json", result)
        rs_all = [r for rs in per_task.values() for r in rs]
        configs.append({"config": point["config"], "label": point["label"], "layers": point["layers"],
                        "config_id": point["config_id"], "method": point["method"], "dir": name,
                        "complete": all(t["complete"] for t in tasks.values()) and len(tasks) == len(planned),
                        "tasks": tasks, "categories": category_scores(tasks),
                        "attention_seconds": math.fsum(r["attention_seconds"] for r in rs_all),
                        "seconds": math.fsum(r["seconds"] for r in rs_all),
                        "attention_seconds_by_path": seconds_by_path(rs_all)})
    if not configs:
        raise ConfigError(f"eval longbench: no generation finished in {out}; nothing to report")
    configs.sort(key=lambda c: (c["config"] != "exact", c["config"], c["layers"]))
    files = {"results": RESULTS_FILE, "csv": CSV_FILE, "points": [c["dir"] for c in configs]}
    results = {k: plan.get(k) for k in ("model", "dtype", "data", "tasks", "e", "max_length", "max_samples",
                                        "max_new_tokens", "num_layers")}
    results.update(definitions={
        "score": "LongBench's scorer: 100 x mean over records of the best metric score against any reference "
                 "answer, rounded to 2 decimals (longpatch.eval.longbench_score)",
        "categories": "mean of the task scores of each of the paper's six categories, rounded to 2 decimals",
        "attention_seconds": "wall time inside attention calls (prefill and decode) of all layers, summed over "
                             "the generations"},
        configs=configs, data_problems=plan["data_problems"], files=files)
    if plots:
        files["plot"] = _plot(results, out / PLOT_FILE)
    write_json(out / RESULTS_FILE, results)
    write_csv(out / CSV_FILE, list(_CSV_COLUMNS), _csv_rows(results))
    return results


def category_scores(tasks: dict[str, dict]) -> dict[str, float]:
    """The paper's six categories (those with at least one task here): mean task score."""
    out = {}
    for cat in CATEGORIES:
        scores = [t["score"] for name, t in tasks.items() if T.category_of(name) == cat]
        if scores:
            out[cat] = round(sum(scores) / len(scores), 2)
    return out


_CSV_COLUMNS = ("config", "layers", "method", "scope", "name", "score", "records", "planned", "complete",
                "metric", "attention_seconds", "seconds", "0-4k", "4-8k", "8k+")


def _csv_rows(results: dict):
    for c in results["configs"]:
        base = {"config": c["config"], "layers": c["layers"], "method": c["method"] or "exact"}
        for cat, score in c["categories"].items():
            yield {**base, "scope": "category", "name": cat, "score": score}
        for task, t in c["tasks"].items():
            buckets = t.get("by_length") or {}
            yield {**base, "scope": "task", "name": task, **{k: t[k] for k in _CSV_COLUMNS if k in t},
                   **{b: buckets.get(b) for b in LENGTH_BUCKETS}}


def _plot(results: dict, path: Path) -> str | None:
    """Category score against the number of replaced layers (one line per category and config): a config's
    lines in its method's colour, one marker and dash per category."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from ...plotting import layers_axis, method_color

    baseline = [c for c in results["configs"] if c["layers"] == 0]
    series: dict[str, list[dict]] = {}
    for c in results["configs"]:
        if c["layers"]:
            series.setdefault(c["config"], []).append(c)
    if not series:
        series = {"exact": baseline}
    else:
        series = {k: sorted(baseline + v, key=lambda c: c["layers"]) for k, v in series.items()}
    fig = Figure(figsize=(6.5, 4))
    ax = fig.add_subplot()
    for config, cs in series.items():
        color = method_color(next((c["method"] for c in cs if c["layers"]), None))
        for i, cat in enumerate(CATEGORIES):
            pts = [(c["layers"], c["categories"][cat]) for c in cs if cat in c["categories"]]
            if pts:
                label = cat if len(series) == 1 else f"{cat} ({config})"
                ax.plot(*zip(*pts), marker="os^Dv<>"[i % 7], ls=("-", "--", ":", "-.")[i % 4], color=color,
                        label=label)
    name = source_name(results["data"])
    ax.set(ylabel=f"{name} score", title=f"{results['model']}: {name} task scores")
    layers_axis(ax)
    ax.legend(fontsize="small"), ax.grid(alpha=0.3)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path.name


def print_results(results: dict) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    cats = [k for k in CATEGORIES if any(k in c["categories"] for c in results["configs"])]
    tasks = results["tasks"] if len(results["tasks"]) <= 4 and len(cats) == 1 else []
    t = Table(title=f"{results['model']}: {source_name(results['data'])} task scores "
                    f"({'LongBench-E, ' if results['e'] else ''}"
                    f"prompts up to {results['max_length']} tokens"
                    f"{', new tokens capped at %d' % results['max_new_tokens'] if results['max_new_tokens'] else ''})",
              title_justify="left", box=box.SIMPLE_HEAD)
    for col in ["config", "layers", *cats, *[x for x in tasks if x not in cats], "records", "attn s"]:
        t.add_column(col, justify="left" if col == "config" else "right")
    for c in results["configs"]:
        n = sum(x["records"] for x in c["tasks"].values())
        planned = sum(x["planned"] for x in c["tasks"].values())
        t.add_row(c["config"], str(c["layers"]), *[f"{c['categories'][k]:.2f}" if k in c["categories"] else "-"
                                                   for k in cats],
                  *[f"{c['tasks'][x]['score']:.2f}" if x in c["tasks"] else "-" for x in tasks if x not in cats],
                  f"{n}/{planned}", f"{c['attention_seconds']:.2f}")
    Console(emoji=False, highlight=False).print(t, markup=False)
