"""`longpatch eval ruler`: the RULER benchmark (NVIDIA/RULER's 13 synthetic tasks) on a model patched
per config and layer count, offline.

Protocol (docs/evaluation.md, "RULER"): for every task and target length, `samples` prompts built as
RULER builds them (tasks.py: templates, needles, haystacks grown to fit the length in the model's
tokens with the task's generation budget, the model's chat template), the same for every
configuration; the model continues each greedily (`model.generate`, so a patched model runs its
prefill and decode paths) for the task's tokens_to_generate, stopping at its end-of-sequence token;
the decoded continuation is scored with RULER's metric (metrics.py).

One record per generation goes to records*.jsonl as it finishes; a rerun with the same --out skips
what is there (matched by configuration and prompt digest). Processes, records and the sweep are
those of the other evaluations (launch, records, sweep). Output: results.json, results.csv, one
heatmap per (config, layers), the prompts as RULER's data files (data/<length>/<task>.jsonl) and the
predictions as RULER's prediction files (pred/<config>_<layers>/<length>/<task>.jsonl), which RULER's
scripts/eval/evaluate.py scores again.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import ConfigError, check_int
from ...options import MAX_TOKENS, MAX_VALUES, parse_ints
from ...outdir import claim_out, write_csv, write_json
from ...patching import total_seconds
from ..launch import WORKER_ENV, Dist, run_sharded
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
from . import data as D
from . import metrics as M
from . import tasks as T

RESULTS_FILE = "results.json"
CSV_FILE = "results.csv"
MIN_LENGTH = 256
DEFAULT_LENGTHS = "4096,8192,16384,32768,65536,131072"  # RULER's run.sh


@dataclass
class RulerSpec(RunSpec):
    """Everything `eval ruler` takes besides the model (RunSpec: patch, sweep, out, processes).

    tasks: 'all', 'niah', 'qa' or comma-separated task names (RULER's: niah_single_1..3,
    niah_multikey_1..3, niah_multivalue, niah_multiquery, vt, cwe, fwe, qa_1, qa_2). lengths: target
    lengths in tokens (prompt plus generation budget). samples: prompts per (task, length). essays:
    the essay haystack (data.load_essays: a .json/.txt file, a directory of .txt, or 'demo', a
    stand-in); None: the essay tasks are skipped. qa: a directory with squad.json / hotpotqa.json, or
    'hub'; None: qa_1 and qa_2 are skipped. seed: of every prompt (RULER's default 42). batch_size:
    prompts generated together in one left-padded batch (same records as 1).
    """

    COMMAND = "eval ruler"
    out: str = "runs/ruler"
    tasks: object = "all"
    lengths: object = DEFAULT_LENGTHS
    samples: int = 20
    essays: str | None = None
    qa: str | None = None
    seed: int = T.DEFAULT_SEED
    batch_size: int = 1

    def __post_init__(self):
        super().__post_init__()
        check_int("--samples", self.samples, 1, MAX_VALUES)  # prompts are built up front: bounded
        check_int("--seed", self.seed, 0)
        check_int("--batch-size", self.batch_size, 1)
        if isinstance(self.lengths, (list, tuple)):
            self.lengths = list(self.lengths)
        T.resolve_tasks(self.tasks)
        parse_lengths(self.lengths)


def parse_lengths(spec) -> list[int]:
    return sorted(parse_ints("--lengths", spec, MIN_LENGTH, high=MAX_TOKENS,
                             allowed=f"comma-separated token counts in [{MIN_LENGTH}, {MAX_TOKENS}]"))


@dataclass
class Sources:
    """The run's outside data, what it is called in the outputs, and the tasks it leaves out (with why)."""
    data: T.Data
    essays: str | None
    qa: str | None
    tasks: list[str]
    skipped: dict


def load_sources(spec: RulerSpec) -> Sources:
    """The essays and QA sets the requested tasks need. Under --tasks all a task whose data is not given (or
    not available: a dataset --qa lacks, the hub offline) is skipped, and said; a task --tasks names (by name
    or group) that cannot run is an error, as is a --qa path that is not a directory: before any work."""
    tasks = T.resolve_tasks(spec.tasks)
    data, skipped, essays_label, qa_label = T.Data(), {}, None, None
    if any(T.needs(t) == "essays" for t in tasks):
        if spec.essays is None:
            skipped.update({t: "no --essays (Paul Graham essays)" for t in tasks if T.needs(t) == "essays"})
        else:
            texts, essays_label = D.load_essays(spec.essays)
            data.essays = T.essay_words(texts)
    wanted = [n for n in ("squad", "hotpotqa") if any(T.needs(t) == n for t in tasks)]
    if wanted:
        if spec.qa is None:
            skipped.update({t: f"no --qa ({T.needs(t)})" for t in tasks if T.needs(t) in wanted})
        else:
            D.check_qa(spec.qa)  # a path that names no directory is a typo, whatever the tasks (as --essays)
            data.qa, qa_label, problems = D.load_qa(spec.qa, wanted)
            for t in tasks:
                if T.needs(t) in wanted and T.needs(t) not in data.qa:
                    skipped[t] = next(p for p in problems if T.needs(t) in p)
    named = T.named_tasks(spec.tasks)
    cannot = {t: why for t, why in skipped.items() if t in named}
    if cannot:  # the user asked for these by name: a run without them is not the run asked for
        raise ConfigError(f"--tasks: {', '.join(cannot)} cannot run ({_reasons(cannot)}); allowed: give their data "
                          "(--essays / --qa), or leave them out of --tasks (--tasks all skips what has no data)")
    kept = [t for t in tasks if t not in skipped]
    if not kept:
        raise ConfigError(f"eval ruler: nothing to evaluate: every task asked for is skipped ({_reasons(skipped)}); "
                          "give --essays / --qa or ask for other tasks")
    return Sources(data, essays_label, qa_label, kept, skipped)


def _reasons(skipped: dict) -> str:
    by: dict[str, list[str]] = {}
    for t, why in skipped.items():
        by.setdefault(why, []).append(t)
    return "; ".join(f"{', '.join(ts)}: {why}" for why, ts in by.items())


def ruler(model, layer_counts=None, *, spec: RulerSpec | None = None, **options) -> dict:
    """RULER scores of `model` patched per each config and layer count.

    model: a model name (as `eval ppl` takes) or a loaded unpatched model (then pass `tokenizer`).
    layer_counts: the sweep, as `eval ppl` (RunSpec). options: the fields of RulerSpec, or spec=.
    Returns the results dict also written to out/results.json (rank 0; {} elsewhere). Bad options fail
    before anything is loaded or written; a failed run that finished no generation leaves no `out`.
    """
    spec = resolve_spec(RulerSpec, "ruler", spec, layer_counts, options)
    sources = load_sources(spec)
    if sources.skipped and not os.environ.get(WORKER_ENV):
        print(f"longpatch: eval ruler: skipping {_reasons(sources.skipped)}", file=sys.stderr)
    return run_sharded(spec, model, "longpatch.eval.ruler.run:ruler",
                       lambda dist, run_id: _evaluate(model, spec, sources, dist, run_id),
                       lambda: summarize(spec.out, plots=spec.plots))


def _evaluate(model, spec: RulerSpec, sources: Sources, dist: Dist, run_id: str) -> dict:
    from tqdm.auto import tqdm

    out = Path(spec.out)
    lengths = parse_lengths(spec.lengths)
    prep = prepare_configs(model, spec, dist)
    model, tokenizer, name = prep.model, prep.tokenizer, prep.name
    wrapper = T.model_wrapper(tokenizer)
    builder = T.Builder(tokenizer, wrapper, sources.data, spec.seed)
    bar = tqdm(total=len(lengths) * len(sources.tasks), desc="prompts", unit="task", leave=False,
               disable=not (spec.progress and dist.main))
    samples = T.build_samples(builder, sources.tasks, lengths, spec.samples, lambda *_: bar.update(1))
    bar.close()
    n_layers = num_layers(model, prep.patches[0][1])
    tok_name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
    identity = {"model": name, "task": "ruler", "seed": spec.seed, "essays": sources.essays, "qa": sources.qa,
                "tokenizer": tok_name}
    points = labelled_points(prep, spec, n_layers, identity)
    if dist.main:
        claim_out(out, spec.COMMAND)
        _write_data(out, samples, sources)
        write_json(out / PLAN_FILE, {
            "model": name, "dtype": model_dtype(model), "tokenizer": tok_name, "chat_template": wrapper.chat,
            "tasks": sources.tasks,
            "skipped": sources.skipped, "lengths": lengths, "samples": spec.samples, "seed": spec.seed,
            "essays": sources.essays, "qa": sources.qa, "num_layers": n_layers,
            "points": [dict(p.describe(), config=label) for label, p in points],
            "items": [{"task": s.task, "length": s.length, "index": s.index, "digest": s.digest,
                       "prompt_tokens": len(s.ids), "tokens_to_generate": s.tokens_to_generate} for s in samples]})
    device = input_device(model)
    run_generations(model, points, samples[dist.rank::dist.world], out, dist, spec.progress and dist.main,
                    "eval ruler", lambda label, p, s: _generate(model, tokenizer, label, p, s, device, dist.rank,
                                                                run_id),
                    generation_shapes((len(s.ids), s.tokens_to_generate) for s in samples), batch=spec.batch_size,
                    many=lambda label, p, ss: _generate_batch(model, tokenizer, label, p, ss, device, dist.rank,
                                                              run_id))
    dist.barrier()
    if dist.mode == "spawned" or not dist.main:
        return {}
    return summarize(out, plots=spec.plots)


def _generate(model, tokenizer, label: str, point: Point, s: T.Sample, device, rank: int, run_id: str) -> dict:
    """One greedy generation of the task's budget (RULER's temperature 0) and its record."""
    model.longpatch.reset_stats()
    ids = torch.tensor([s.ids], device=device)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    t0 = time.perf_counter()
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                             max_new_tokens=s.tokens_to_generate, pad_token_id=pad if pad is not None else 0)
    seconds = time.perf_counter() - t0
    new = gen[0, ids.shape[1]:].tolist()
    predicted = tokenizer.decode(new, skip_special_tokens=True)
    stats = model.longpatch.breakdown()
    return {"config": label, "method": point.cfg.method if point.layers else "exact", "layers": point.layers,
            "config_id": point.config_id, "label": point.label, "digest": s.digest, "task": s.task,
            "length": s.length, "index": s.index, "outputs": s.outputs, "predicted": predicted,
            "score": M.sample_score(s.task, predicted, s.outputs), "prompt_tokens": len(s.ids),
            "new_tokens": len(new), "seconds": seconds, "attention": stats, "attention_seconds": total_seconds(stats),
            "rank": rank, "run_id": run_id}


def _generate_batch(model, tokenizer, label: str, point: Point, ss: list[T.Sample], device, rank: int,
                    run_id: str) -> list[dict]:
    """Several prompts in one left-padded batch (generate_rows: each row's tokens as alone), one record each;
    seconds and attention stats are the batch's, shared evenly between its records."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows, seconds, stats = timed_rows(model, [s.ids for s in ss], [s.tokens_to_generate for s in ss], device,
                                      tokenizer.eos_token_id, pad, num_beams=1)
    out = []
    for s, new in zip(ss, rows):
        predicted = tokenizer.decode(new, skip_special_tokens=True)
        out.append({"config": label, "method": point.cfg.method if point.layers else "exact", "layers": point.layers,
                    "config_id": point.config_id, "label": point.label, "digest": s.digest, "task": s.task,
                    "length": s.length, "index": s.index, "outputs": s.outputs, "predicted": predicted,
                    "score": M.sample_score(s.task, predicted, s.outputs), "prompt_tokens": len(s.ids),
                    "new_tokens": len(new), "seconds": seconds, "batch": len(ss), "attention": stats,
                    "attention_seconds": total_seconds(stats), "rank": rank, "run_id": run_id})
    return out


# ---- report ----------------------------------------------------------------------------------------

def _haystack(task: str, plan: dict) -> str:
    kind = T.haystack_of(task)
    if kind == "essay" and plan.get("essays") == D.DEMO_LABEL:
        return "essay (demo stand-in)"
    return kind


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    """A RULER manifest file (one JSON object a line), replaced atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def _write_data(out: Path, samples: list[T.Sample], sources: Sources) -> None:
    """The prompts as RULER's data files (<task>/validation.jsonl of its prepare.py), per length:
    data/<length>/<task>.jsonl with index, input (the prompt without its answer prefix), outputs, length
    (prompt tokens plus the generation budget) and answer_prefix."""
    groups: dict[tuple, list[T.Sample]] = {}
    for s in samples:
        groups.setdefault((s.length, s.task), []).append(s)
    for (length, task), ss in groups.items():
        _write_jsonl(out / "data" / str(length) / f"{task}.jsonl", [
            {"index": s.index, "input": s.text[:len(s.text) - len(s.answer_prefix)], "outputs": s.outputs,
             "length": len(s.ids) + s.tokens_to_generate, "answer_prefix": s.answer_prefix} for s in ss])


def point_dir(config: str, layers: int) -> str:
    return f"{''.join(c if c.isalnum() or c in '-_.' else '_' for c in Path(str(config)).stem or str(config))}" \
           f"_{layers}"


def summarize(out: "str | Path", plots: bool = True) -> dict:
    """Merge plan.json and the records into results.json (records and summary), results.csv, the heatmaps
    and RULER's prediction files. Records are taken in plan order, so the result does not depend on how
    many processes wrote them."""
    out = Path(out)
    plan = read_plan(out)
    index: dict[tuple, dict] = {}
    for r in read_records(out):
        index.setdefault((r.get("config_id"), r.get("digest")), r)
    records, summary, files = [], [], {"csv": CSV_FILE, "heatmaps": [], "predictions": []}
    for point in sorted(plan["points"], key=lambda p: (p["config"] != "exact", p["config"], p["layers"])):
        cells: dict[tuple, list[dict]] = {}
        for it in plan["items"]:
            r = index.get((point["config_id"], it["digest"]))
            if r is not None:
                cells.setdefault((it["length"], it["task"]), []).append(r)
        if not cells:
            continue
        name = point_dir(point["config"], point["layers"])
        for (length, task), rs in cells.items():
            prompts = _read_inputs(out, length, task)  # one file at a time: at 128k they are large
            _write_jsonl(out / "pred" / name / str(length) / f"{task}.jsonl", [
                {"index": r["index"], "pred": r["predicted"], "input": prompts.get(r["index"], ""),
                 "outputs": r["outputs"], "others": {"haystack": _haystack(task, plan)}, "truncation": -1,
                 "length": r["prompt_tokens"] + T.tokens_to_generate(task)} for r in rs])
            records.extend({"task": task, "config": point["config"], "layers": point["layers"], "length": length,
                            "index": r["index"], "outputs": r["outputs"], "predicted": r["predicted"],
                            "score": r["score"], "method": r["method"], "prompt_tokens": r["prompt_tokens"],
                            "new_tokens": r["new_tokens"], "seconds": r["seconds"],
                            "attention_seconds": r["attention_seconds"], "attention": r["attention"]} for r in rs)
        files["predictions"].append(f"pred/{name}")
        base = {"config": point["config"], "layers": point["layers"], "method": point["method"] or "exact"}
        for length in plan["lengths"]:
            rows = []
            for task in plan["tasks"]:
                rs = cells.get((length, task))
                if not rs:
                    continue
                rows.append({**base, "task": task, "length": length,
                             "score": M.task_score(task, [r["predicted"] for r in rs], [r["outputs"] for r in rs]),
                             "samples": len(rs), "metric": M.metric_name(task), "haystack": _haystack(task, plan),
                             "nulls": sum(not M.postprocess(r["predicted"]) for r in rs),
                             "attention_seconds": math.fsum(r["attention_seconds"] for r in rs),
                             "seconds": math.fsum(r["seconds"] for r in rs)})
            if not rows:
                continue
            rs_all = [r for t in plan["tasks"] for r in cells.get((length, t), [])]
            complete = len(rows) == len(plan["tasks"]) and all(x["samples"] == plan["samples"] for x in rows)
            summary.extend(rows)
            summary.append({**base, "task": "average", "length": length,
                            "score": round(sum(x["score"] for x in rows) / len(rows), 2),
                            "samples": len(rs_all), "metric": "mean of the task scores", "haystack": "",
                            "nulls": sum(x["nulls"] for x in rows), "complete": complete,
                            "attention_seconds": math.fsum(x["attention_seconds"] for x in rows),
                            "seconds": math.fsum(x["seconds"] for x in rows),
                            "attention_seconds_by_path": seconds_by_path(rs_all)})
    if not records:
        raise ConfigError(f"eval ruler: no generation finished in {out}; nothing to report")
    info = {k: plan.get(k) for k in ("model", "dtype", "tokenizer", "chat_template", "tasks", "skipped", "lengths",
                                     "samples", "seed", "essays", "qa")}
    if plots:
        for config, layers in dict.fromkeys((s["config"], s["layers"]) for s in summary):
            fname = f"heatmap_{point_dir(config, layers)}.png"
            heatmap(summary, config, layers, out / fname, plan)
            files["heatmaps"].append(fname)
    results = {**info, "definitions": {
        "score": "RULER's: string_match_all (niah, vt, cwe, fwe: share of the expected strings found in the "
                 "prediction) or string_match_part (qa: any of them found), case-insensitive, mean over samples "
                 "x 100, rounded to 2 decimals",
        "average": "mean of the task scores at that length, rounded to 2 decimals",
        "attention_seconds": "wall time inside attention calls (prefill and decode) of all layers, summed over "
                             "the generations"},
        "records": records, "summary": summary, "files": files}
    write_json(out / RESULTS_FILE, results)
    columns = ("config", "layers", "method", "task", "length", "score", "samples", "metric", "haystack", "nulls",
               "attention_seconds", "seconds")
    write_csv(out / CSV_FILE, list(columns), [{k: s.get(k) for k in columns} for s in summary])
    return results


def _read_inputs(out: Path, length: int, task: str) -> dict:
    """index -> the full prompt text (input and answer prefix) of one (length, task), from data/."""
    prompts = {}
    path = out / "data" / str(length) / f"{task}.jsonl"
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            for line in f:
                d = json.loads(line)
                prompts[d["index"]] = d["input"] + d["answer_prefix"]
    return prompts


def heatmap(summary: list[dict], config: str, layers: int, path: Path, plan: dict) -> None:
    """Task (rows, the average last) by length (columns), RULER score as colour."""
    from ...plotting import annotated_heatmap
    from ..needle.prompts import length_label

    rows = [s for s in summary if s["config"] == config and s["layers"] == layers]
    lengths = sorted({s["length"] for s in rows})
    tasks = [t for t in plan["tasks"] if any(s["task"] == t for s in rows)] + ["average"]
    cell = {(s["task"], s["length"]): s["score"] for s in rows}
    data = [[cell.get((t, n), math.nan) for n in lengths] for t in tasks]
    labels = [f"{t}*" if t != "average" and "stand-in" in _haystack(t, plan) else t for t in tasks]
    title = f"{plan['model']}: RULER, {config}, {layers} layers replaced ({plan['samples']} samples)"
    if any(lb.endswith("*") for lb in labels):
        title += "; * essay haystack: demo stand-in"
    annotated_heatmap(data, [length_label(n) for n in lengths], labels, path, title, vmax=100, colorbar="score",
                      fmt=".1f", xlabel="length (tokens)", width=max(4.5, 2.6 + 0.9 * len(lengths)), row_height=0.32,
                      rule_above_last=True)


def print_results(results: dict) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from ..needle.prompts import length_label

    lengths = results["lengths"]
    t = Table(title=f"{results['model']}: RULER ({len(results['tasks'])} tasks x {results['samples']} samples"
                    f"{'; essays: ' + results['essays'] if results['essays'] else ''})",
              title_justify="left", box=box.SIMPLE_HEAD)
    for col in ["config", "layers", "task", *[length_label(n) for n in lengths]]:
        t.add_column(col, justify="left" if col in ("config", "task") else "right")
    rows: dict[tuple, dict] = {}
    for s in results["summary"]:
        rows.setdefault((s["config"], s["layers"], s["task"]), {})[s["length"]] = s["score"]
    order = sorted(rows, key=lambda k: (k[0] != "exact", k[0], k[1], k[2] != "average",
                                        results["tasks"].index(k[2]) if k[2] in results["tasks"] else 0))
    for key in order:
        cells = rows[key]
        t.add_row(key[0], str(key[1]), key[2], *[f"{cells[n]:.2f}" if n in cells else "-" for n in lengths],
                  end_section=False)
    Console(emoji=False, highlight=False).print(t, markup=False)
