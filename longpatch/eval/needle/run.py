"""`longpatch eval needle`: the needle grid (configs x layer counts x lengths x depths x trials) run
with greedy generation, resumable, with results.json / results.csv / one heatmap per (config, layers).

Every configuration sees the same prompts (keys and haystacks depend only on the seed, the template,
the length, the depth and the trial). A record is kept per generation in records*.jsonl and a rerun
with the same --out skips what is there (matched by configuration and prompt digest). Processes,
records and the sweep are the ones `eval ppl` uses (launch, records, sweep).

With prefill_chunk (--prefill-chunk N) each prompt's prefill runs in chunks of N tokens against the KV
cache (generate()'s prefill_chunk_size); the chunk size is in plan.json, results.json and every record,
and it is part of the config ids, so a rerun with another chunk size (or none) does not reuse records.
With both --batch-size and --prefill-chunk, only prompts of one token length share a batch: a shorter
prompt's left padding would move its chunk boundaries, and a block-sparse method's output with them.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ...cache import cache_argument
from ...config import check_prefill_chunk
from ...errors import ConfigError, check_int
from ...options import MAX_TOKENS, MAX_VALUES, parse_ints
from ...outdir import claim_out, write_csv, write_json
from ...patching import total_seconds
from ...quantized import QuantizedCache, check_format
from ..launch import Dist, run_sharded
from ..ppl.scoring import check_configs_chunk, prefill_shapes
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
from . import prompts as N

RESULTS_FILE = "results.json"
CSV_FILE = "results.csv"


@dataclass
class NeedleSpec(RunSpec):
    """Everything `eval needle` takes besides the model (RunSpec: patch, sweep, out, processes).

    config: one config, a comma-separated list or a list (each gets the whole sweep; None: `method`
    with `sets`, or the model's bundled config). template: 'passkey' (default, as in `longpatch demo`),
    'code' or a YAML template file.
    lengths: prompt lengths in tokens ('4096,8192' or a list). depths: '0:1:0.1' (end included) or
    'd1,d2'. trials: prompts per (length, depth). filler: see needle.filler_texts. seed: of keys and
    haystacks. batch_size: prompts generated together in one left-padded batch (same results as 1; with
    prefill_chunk, only prompts of one length share a batch).
    prefill_chunk: each prompt prefilled this many tokens at a time (None: one forward); a multiple of every
    config's method block (config.check_prefill_chunk).
    cache: "int8" or "fp8": each generation keeps its KV cache in 8 bits (quantized.QuantizedCache); None: the
    model's own full-precision cache.
    """

    COMMAND = "eval needle"
    out: str = "runs/needle"
    template: str = N.DEFAULT_TEMPLATE
    lengths: object = "4096,8192,16384,32768"
    depths: object = "0:1:0.1"
    trials: int = 4
    filler: str = "demo"
    seed: int = 0
    batch_size: int = 1
    prefill_chunk: int | None = None
    cache: str | None = None

    def __post_init__(self):
        super().__post_init__()
        check_int("--trials", self.trials, 1, MAX_VALUES)  # a grid of prompts, not a loop of a billion
        check_int("--seed", self.seed, 0)
        check_int("--batch-size", self.batch_size, 1)
        check_prefill_chunk(None, self.prefill_chunk)  # an int >= 1; each config's multiple: needle()
        if self.cache is not None:
            check_format(self.cache)
        if isinstance(self.lengths, (list, tuple)):
            self.lengths = list(self.lengths)


@dataclass
class Trial:
    length: int
    depth: float
    trial: int
    prompt: N.Prompt
    digest: str


MIN_LENGTH = 64  # tokens: room for the needle, the question and some haystack


def parse_lengths(spec: "str | Sequence[int]", flag: str = "--lengths") -> list[int]:
    """'4096,8192' (or a list; ranges as options.parse_ints) -> sorted distinct prompt lengths >= MIN_LENGTH."""
    return sorted(parse_ints(flag, spec, MIN_LENGTH, high=MAX_TOKENS,
                             allowed=f"comma-separated token counts in [{MIN_LENGTH}, {MAX_TOKENS}]"))


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


def needle(model, layer_counts=None, *, spec: NeedleSpec | None = None, **options) -> dict:
    """Needle-in-a-haystack accuracy of `model` patched per each config and layer count.

    model: a model name (as `eval ppl` takes) or a loaded unpatched model (then pass `tokenizer`).
    layer_counts: the sweep, as `eval ppl` (RunSpec). options: the fields of NeedleSpec, or spec=.
    Returns the results dict also written to out/results.json (rank 0; {} elsewhere). Bad options fail
    before anything is loaded or written; a failed run that finished no generation leaves no `out`.
    """
    spec = resolve_spec(NeedleSpec, "needle", spec, layer_counts, options)
    check_configs_chunk(spec, model)
    template = N.load_template(spec.template)
    lengths = parse_lengths(spec.lengths)
    depths = N.parse_depths(spec.depths)
    return run_sharded(spec, model, "longpatch.eval.needle.run:needle",
                       lambda dist, run_id: _evaluate(model, spec, template, lengths, depths, dist, run_id),
                       lambda: summarize(spec.out, plots=spec.plots))


def _evaluate(model, spec: NeedleSpec, tmpl: N.Template, lengths: list[int], depths: list[float], dist: Dist,
              run_id: str) -> dict:
    out = Path(spec.out)
    prep = prepare_configs(model, spec, dist)
    model, tokenizer, name = prep.model, prep.tokenizer, prep.name
    filler = tmpl.filler or spec.filler
    work = plan_trials(N.Filler(N.filler_texts(filler), tokenizer), tmpl, lengths, depths, spec.trials, spec.seed)
    n_layers = num_layers(model, prep.patches[0][1])
    identity = {"model": name, "template": tmpl.name, "filler": filler, "seed": spec.seed, "task": "needle"}
    if spec.prefill_chunk is not None:  # chunked runs get their own config ids (one-shot ids stay what they were)
        identity["prefill_chunk"] = spec.prefill_chunk
    if spec.cache is not None:  # likewise runs with an 8-bit cache
        identity["cache"] = spec.cache
    points = labelled_points(prep, spec, n_layers, identity)
    if dist.main:
        claim_out(out, spec.COMMAND)
        write_json(out / PLAN_FILE, {"model": name, "dtype": model_dtype(model), "template": tmpl.name,
                                     "filler": filler, "lengths": lengths,
                                     "depths": depths, "trials": spec.trials, "seed": spec.seed,
                                     "prefill_chunk": spec.prefill_chunk, "cache": spec.cache,
                                     "points": [dict(p.describe(), config=label) for label, p in points]})
    device, eos = input_device(model), tokenizer.eos_token_id
    shapes = generation_shapes((len(w.prompt.ids), N.answer_tokens(tokenizer, w.prompt.expected)) for w in work)
    if spec.prefill_chunk is not None:  # each prompt's prefill is its chunks' calls, not one of (n, n)
        shapes = {s for s in shapes if s[0] == 1} | set().union(
            *(prefill_shapes(len(w.prompt.ids), spec.prefill_chunk) for w in work))
    chunk = spec.prefill_chunk
    if spec.cache is not None:
        check_format(spec.cache, device)
    run_generations(model, points, work[dist.rank::dist.world], out, dist, spec.progress and dist.main, "eval needle",
                    lambda label, p, w: _generate(model, tokenizer, label, p, w, device, eos, dist.rank, run_id,
                                                  chunk, spec.cache),
                    shapes, batch=spec.batch_size,
                    many=lambda label, p, ws: _generate_batch(model, tokenizer, label, p, ws, device, eos, dist.rank,
                                                              run_id, chunk, spec.cache),
                    # chunked: a row's chunks must start where they start alone, so no left padding in a batch
                    same=None if chunk is None else (lambda w: len(w.prompt.ids)))
    dist.barrier()
    if dist.mode == "spawned" or not dist.main:
        return {}
    return summarize(out, plots=spec.plots)


def _generate_kwargs(model, prefill_chunk: int | None, cache: str | None) -> dict:
    """generate()'s kwargs for a chunked prefill and an 8-bit KV cache (a new one per generation); none without
    either: generate() as it always ran."""
    kwargs = {} if prefill_chunk is None else {"prefill_chunk_size": prefill_chunk}
    if cache is not None:
        kwargs[cache_argument(model)] = QuantizedCache(config=model.config, fmt=cache)
    return kwargs


def _generate(model, tokenizer, label: str, point: Point, w: Trial, device, eos, rank: int, run_id: str,
              prefill_chunk: int | None = None, cache: str | None = None) -> dict:
    """One greedy generation and its record (generate() runs both the prefill, chunked with prefill_chunk, and
    the decode path)."""
    model.longpatch.reset_stats()
    ids = torch.tensor([w.prompt.ids], device=device)
    t0 = time.perf_counter()
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=N.answer_tokens(tokenizer, w.prompt.expected),
                             pad_token_id=eos if eos is not None else 0,
                             **_generate_kwargs(model, prefill_chunk, cache))
    seconds = time.perf_counter() - t0
    predicted = tokenizer.decode(gen[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    stats = model.longpatch.breakdown()
    return {"config": label, "method": point.cfg.method if point.layers else "exact", "layers": point.layers,
            "length": len(w.prompt.ids), "depth": w.depth, "trial": w.trial, "expected": w.prompt.expected,
            "predicted": predicted, "correct": N.judge(predicted, w.prompt.expected), "config_id": point.config_id,
            "label": point.label, "digest": w.digest, "needle_token": w.prompt.needle_token, "seconds": seconds,
            "attention": stats, "attention_seconds": total_seconds(stats), "rank": rank, "run_id": run_id,
            "prefill_chunk": prefill_chunk, "cache": cache}


def _generate_batch(model, tokenizer, label: str, point: Point, ws: list[Trial], device, eos, rank: int,
                    run_id: str, prefill_chunk: int | None = None, cache: str | None = None) -> list[dict]:
    """Greedy generations of several prompts in one left-padded batch, one record each; each row's tokens
    are those of its prompt alone (generate_rows); seconds and attention stats are the batch's, shared
    evenly between its records."""
    rows, seconds, stats = timed_rows(model, [w.prompt.ids for w in ws],
                                      [N.answer_tokens(tokenizer, w.prompt.expected) for w in ws], device, eos,
                                      **_generate_kwargs(model, prefill_chunk, cache))
    out = []
    for w, new in zip(ws, rows):
        predicted = tokenizer.decode(new, skip_special_tokens=True)
        out.append({"config": label, "method": point.cfg.method if point.layers else "exact", "layers": point.layers,
                    "length": len(w.prompt.ids), "depth": w.depth, "trial": w.trial, "expected": w.prompt.expected,
                    "predicted": predicted, "correct": N.judge(predicted, w.prompt.expected),
                    "config_id": point.config_id, "label": point.label, "digest": w.digest,
                    "needle_token": w.prompt.needle_token, "seconds": seconds, "batch": len(ws), "attention": stats,
                    "attention_seconds": total_seconds(stats), "rank": rank, "run_id": run_id,
                    "prefill_chunk": prefill_chunk, "cache": cache})
    return out


def summarize(out: "str | Path", plots: bool = True) -> dict:
    """Merge plan.json and the records into results.json ({"records", "summary", ...}), results.csv and
    heatmaps; records are sorted, so the result does not depend on how many processes wrote them."""
    out = Path(out)
    meta = read_plan(out)
    configs = {p["config_id"] for p in meta["points"]}
    wanted = {(n, round(d, 6)) for n in meta["lengths"] for d in meta["depths"]}
    # only this plan's cells: a run in the same out with other lengths, depths or more trials left its records;
    # each generation once (its first record), by (config id, prompt digest) as the other evaluations report
    index: dict[tuple, dict] = {}
    for r in read_records(out):
        if r.get("config_id") in configs and (r["length"], round(r["depth"], 6)) in wanted \
                and r["trial"] < meta["trials"]:
            index.setdefault((r["config_id"], r.get("digest")), r)
    records = sorted(index.values(), key=lambda r: (r["config"], r["layers"], r["length"], r["depth"], r["trial"]))
    if not records:
        raise ConfigError(f"eval needle: no generation finished in {out}; nothing to report")
    summary = N.summarize_records(records)
    cells: dict[tuple, list[dict]] = {}
    for r in records:
        cells.setdefault((r["config"], r["layers"], r["length"]), []).append(r)
    for s in summary:  # attention time of the cell's generations, per path (the layer stats)
        rs = cells[(s["config"], s["layers"], s["length"])]
        s["attention_seconds"] = sum(r["attention_seconds"] for r in rs)
        s["seconds"] = sum(r["seconds"] for r in rs)
        s["attention_seconds_by_path"] = seconds_by_path(rs)
    files = {"csv": CSV_FILE, "heatmaps": []}
    if plots:
        for config, layers in dict.fromkeys((r["config"], r["layers"]) for r in records):
            name = f"heatmap_{_safe(config)}_{layers}.png"
            N.heatmap(records, config, layers, out / name, title=f"{meta['model']}: {config}, {layers} layers "
                      f"replaced ({meta['template']})")
            files["heatmaps"].append(name)
    keep = ("config", "method", "layers", "length", "depth", "trial", "expected", "predicted", "correct",
            "needle_token", "seconds", "attention_seconds", "attention")
    info = {k: meta.get(k) for k in ("model", "dtype", "template", "filler", "lengths", "depths", "trials", "seed",
                                     "prefill_chunk")}
    results = {**info, "records": [{k: r[k] for k in keep} for r in records], "summary": summary, "files": files}
    write_json(out / RESULTS_FILE, results)
    write_csv(out / CSV_FILE, list(summary[0]), summary)
    return results


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(str(text)).stem or str(text))


def print_results(results: dict) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    lengths = results["lengths"]
    chunked = f", prefill in chunks of {results['prefill_chunk']}" if results.get("prefill_chunk") else ""
    t = Table(title=f"{results['model']}: needle accuracy ({results['template']}, {len(results['depths'])} depths x "
                    f"{results['trials']} trials{chunked})", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ["config", "layers", *[N.length_label(n) for n in lengths], "attn s"]:
        t.add_column(col, justify="left" if col == "config" else "right")
    rows: dict[tuple, dict] = {}
    for s in results["summary"]:
        rows.setdefault((s["config"], s["layers"]), {})[s["length"]] = s
    for (config, layers), cells in rows.items():
        t.add_row(config, str(layers), *[f"{cells[n]['accuracy']:.2f}" if n in cells else "-" for n in lengths],
                  f"{sum(c['attention_seconds'] for c in cells.values()):.2f}")
    Console(emoji=False, highlight=False).print(t, markup=False)

