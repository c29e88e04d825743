"""End-to-end generation benchmark: time to first token and per-token decode latency of a whole model,
unpatched and patched, in the same run (`longpatch bench generate`).

For every prompt length ("context") the prompt is the first `context` tokens of one long text (the
demo model's held-out code by default, see needle.filler_texts; repeated if shorter), the same ids for
every configuration. Each row is one greedy generation of `new_tokens` tokens with our own loop:
one forward pass of the prompt (it yields the first token: its wall time is the time to first token,
TTFT), then one forward pass per further token against the growing KV cache, each
timed on its own; the row's decode latency is the median of those steps. On CUDA the timed regions
are bracketed by synchronisations. For each context the unpatched model (no patch at all) runs
first, then the model patched per each (config, layer count), the first time after an untimed short
warm-up generation; with repeats, the rows take turns (one generation each per round), so that the
machine's drift reaches them alike. Speedups are against the unpatched row of the same context.

Chunked prefill (``prefill_chunk``, --prefill-chunk N): the prompt goes through the model N tokens at
a time against the KV cache (the positions continuing), the way a server prefills a long prompt in
pieces to bound its activations; the TTFT is then the time of all the chunks. Every row, unpatched and
patched, prefills the same way, and the records say which (``prefill_chunk``; None: one forward).

Peak memory: the process's peak resident set (VmHWM, reset before each generation through
/proc/self/clear_refs; without it getrusage's ru_maxrss, the peak of the whole process so far), as
peak_rss_mib, and its increase over the resident set at the start of the generation (KV cache and
activations) as rss_increase_mib; on CUDA also torch.cuda.max_memory_allocated (peak_cuda_mib). cache_mib: what
the KV cache holds at the end of the generation (its rows; an 8-bit cache's rows and scales); state_mib: what
the patched layers hold beside it to choose what a step reads (``LayerRoute.state_bytes``).
Where the process keeps freed memory (``memory.keep_freed_memory``, the CLI's default), the resident set
does not shrink after a row, so a row's peak is the high-water mark of every row before it too: the
table says so under it, and ``LONGPATCH_KEEP_FREED_MEMORY=0`` measures each row's own.

Output, written only when every row is done: results.json ({"meta", "records", "files"}), results.csv,
and generate.png (decode latency and TTFT against context, one line per configuration).
"""
from __future__ import annotations

import gc
import inspect
import logging
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Sequence

import torch

from ..cache import cache_argument, forward_params, takes_cache_objects
from ..config import check_prefill_chunk
from ..errors import ConfigError, check_int
from ..eval.needle.prompts import filler_texts
from ..eval.records import removed_on_failure
from ..eval.sweep import (
    Point,
    generation_shapes,
    make_points,
    num_layers,
    say_if_exact,
)
from ..memory import KEPT
from ..options import MAX_TOKENS, MAX_VALUES, parse_layer_counts
from ..outdir import check_out, claim_out, owns_out, write_csv, write_json, written_by
from .common import figure, fmt, machine_meta, save_figure, show_table, synchronizer, wide_console

log = logging.getLogger("longpatch")

RESULTS_FILE = "results.json"
CSV_FILE = "results.csv"
PLOT_FILE = "generate.png"
UNPATCHED = "exact"  # the row of the model without a patch: the baseline's one name in every output
COMMAND = "bench generate"  # marks its --out (outdir.claim_out)
# --cache: longpatch.cache.GrowingCache, transformers' DynamicCache, transformers' StaticCache (the whole
# generation preallocated: the layout a CUDA graph of the step needs), longpatch.quantized.QuantizedCache (8-bit
# rows: int8, or fp8 e4m3 on a GPU that has it)
CACHES = ("growing", "dynamic", "static", "int8", "fp8")
# --compile: the decode step's forward under torch.compile (CUDA graphs on a GPU: mode reduce-overhead), as
# transformers' generate() compiles a static cache's steps; tests swap in backend "eager" (no codegen)
COMPILE_OPTIONS = {"dynamic": False, "fullgraph": False}
CSV_COLUMNS = ["config", "method", "layers", "context", "batch", "new_tokens", "prefill_chunk", "ttft_s",
               "decode_ms_per_token", "decode_tokens_per_s", "tokens_per_s", "total_s", "ttft_speedup",
               "decode_speedup", "peak_rss_mib", "rss_increase_mib", "peak_cuda_mib", "cache_mib", "state_mib",
               "tokens_match_exact",
               "warmup_s",
               "dense_floor_ms", "of_floor"]


def copy_bandwidth(device: torch.device, mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second of a large copy on ``device`` (read + write, the median of ``repeats``): the rate
    a decode step can read its weights and KV cache at, at best."""
    src = torch.empty(mib << 18, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    sync = synchronizer(device)
    times = []
    for _ in range(repeats + 1):  # the first copy touches the pages: not timed
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / statistics.median(times[1:])


def weight_bytes(model) -> int:
    """Bytes of the model's parameters and buffers, each storage once (tied embeddings count once)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def kv_bytes_per_token(model) -> int | None:
    """Bytes of K and V that one cached position holds over every layer (None: a layout not known here)."""
    c = getattr(model, "config", None)
    layers = getattr(c, "num_hidden_layers", None) or getattr(c, "num_layers", None)
    heads = getattr(c, "num_attention_heads", None)
    kv = getattr(c, "num_key_value_heads", None) or getattr(c, "multi_query_group_num", None) or heads
    dim = getattr(c, "head_dim", None) or getattr(c, "kv_channels", None) or (
        getattr(c, "hidden_size", 0) // heads if heads else None)
    if not (layers and kv and dim):
        return None
    return 2 * layers * kv * dim * next(model.parameters()).element_size()


def dense_floor_ms(weights: int, kv_per_token: int | None, context: int, new_tokens: int, batch: int,
                   bandwidth: float) -> float | None:
    """The least time of a dense decode step, in ms: reading every weight once and each row's whole KV
    cache (the prompt and half the new tokens, the steps' mean) at ``bandwidth`` bytes per second. A
    sparse step reads less of the cache, so it can come under this floor."""
    if kv_per_token is None or bandwidth <= 0:
        return None
    kv = kv_per_token * batch * (context + new_tokens / 2)
    return (weights + kv) / bandwidth * 1e3


def parse_contexts(spec: "str | Sequence[int]") -> list[int]:
    """'8192,16384' or a list -> sorted distinct prompt lengths, as eval needle's --lengths (each >= 64)."""
    from ..eval.needle.run import parse_lengths

    return parse_lengths(spec, "--contexts")


# ---- measurement ------------------------------------------------------------------------------------

class PeakMemory:
    """Peak memory of a block: host resident set (MiB) and, on CUDA, the peak allocation."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        gc.collect()
        self.resettable = _reset_rss_peak()
        self.start_kb = status_kb("VmRSS")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc):
        peak_kb = status_kb("VmHWM") if self.resettable else None
        if peak_kb is None:  # ru_maxrss: KiB on Linux, the peak of the whole process so far
            peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.peak_rss_mib = peak_kb / 1024
        self.rss_increase_mib = max(0, peak_kb - self.start_kb) / 1024 if self.start_kb is not None else None
        self.peak_cuda_mib = torch.cuda.max_memory_allocated(self.device) / 2 ** 20 \
            if self.device.type == "cuda" else None
        return False


def _reset_rss_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident set (Linux)
        return True
    except OSError:
        return False


def status_kb(field: str) -> int | None:
    try:
        from .attention import status_kb as read
        return read(field)
    except (OSError, KeyError):
        return None


def _forward_names(model) -> tuple[dict, str]:
    """(prefill kwargs, name of the KV-cache argument). Only the last position's logits from a prefill:
    a [context, vocab] float tensor would dominate memory and time at 32k (generate() asks for the
    same)."""
    params = forward_params(model)
    keep = next(({n: 1} for n in ("logits_to_keep", "num_logits_to_keep") if n in params), {})
    if not keep and "return_last_logit" in params:  # ChatGLM's remote code
        keep = {"return_last_logit": True}
    return keep, cache_argument(model)


def _next_and_cache(out) -> tuple[torch.Tensor, object]:
    """(greedy next token [b, 1], KV cache) of a forward's output: a ModelOutput, or a (logits, cache) tuple."""
    if isinstance(out, tuple):
        logits, cache = out[0], out[1]
    else:
        cache = getattr(out, "cache", None)
        logits, cache = out.logits, cache if cache is not None else out.past_key_values
    return logits[:, -1].argmax(-1, keepdim=True), cache


def prefill(model, ids: torch.Tensor, chunk: int | None, cache_arg: str, kwargs: dict):
    """The prompt's forward: one call (chunk None), or one call per ``chunk`` tokens against the KV cache the
    first one starts, each at its own positions (position_ids given: models that keep their own tuple cache
    would otherwise restart their rotary positions at 0; cache_position where the forward still reads it).
    kwargs: the first call's (logits_to_keep, the cache to fill). -> the last call's output (its last
    logits predict the first new token)."""
    if chunk is None or chunk >= ids.shape[1]:  # one chunk: the one-shot prefill
        return model(input_ids=ids, use_cache=True, **kwargs)
    takes_cache_position = "cache_position" in forward_params(model)  # transformers < 5.2x reads it
    out = None
    for start in range(0, ids.shape[1], chunk):
        piece = ids[:, start:start + chunk]
        pos = torch.arange(start, start + piece.shape[1], device=ids.device)
        where = {"position_ids": pos[None].expand(ids.shape[0], -1)}
        if takes_cache_position:
            where["cache_position"] = pos
        if out is not None:  # later chunks continue the cache the earlier ones filled
            kwargs = {**kwargs, cache_arg: _next_and_cache(out)[1]}
        out = model(input_ids=piece, use_cache=True, **where, **kwargs)
    return out


def greedy_generate(model, ids: torch.Tensor, new_tokens: int, cache: str = "dynamic", step=None,
                    capacity: int | None = None, prefill_chunk: int | None = None, profile: int = 0) -> dict:
    """Greedy decoding with our own loop: one timed prefill of the prompt (TTFT; in chunks of
    ``prefill_chunk`` tokens when given, see ``prefill``), then one timed
    forward per further token with the KV cache. cache: "growing" hands the prefill a
    longpatch GrowingCache (where the model takes transformers' Cache objects), "static" a
    transformers StaticCache of ``capacity`` tokens (default: the prompt and the new tokens), "dynamic"
    leaves the model its default. ``step``: the forward of the decode steps (a compiled one), given the
    positions (a compiled step reads no length on the host). ``profile``: the last that many steps run under
    torch's profiler, their phases in "profile" (``step_profile``; "profiled": how many, the last of "step_s",
    which the row's median leaves out: the profiler slows them). -> {"tokens", "ttft_s", "step_s": [...], ...}."""
    sync = synchronizer(ids.device)
    keep, cache_arg = _forward_names(model)
    if cache == "growing" and takes_cache_objects(model):
        from ..cache import GrowingCache
        keep = {**keep, cache_arg: GrowingCache(reserve=new_tokens)}
    elif cache in ("int8", "fp8") and takes_cache_objects(model):
        from ..quantized import QuantizedCache
        keep = {**keep, cache_arg: QuantizedCache(fmt=cache, reserve=new_tokens)}
    elif cache == "static" and takes_cache_objects(model):
        from transformers.cache_utils import StaticCache
        size = capacity or ids.shape[1] + new_tokens
        keep = {**keep, cache_arg: StaticCache(config=model.config, max_cache_len=size)}
    with torch.no_grad():
        sync()
        t0 = time.perf_counter()
        tok, past = _next_and_cache(prefill(model, ids, prefill_chunk, cache_arg, keep))
        sync()
        ttft = time.perf_counter() - t0
        tokens, steps = [tok], []
        profiled = max(0, min(profile, new_tokens - 1))
        profiler = None
        for i in range(new_tokens - 1):
            if i == new_tokens - 1 - profiled and profiled:
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                profiler.__enter__()
                steps_before = len(steps)
            t0 = time.perf_counter()
            if step is None:
                out = model(input_ids=tok, use_cache=True, **{cache_arg: past})
            else:
                pos = torch.full((ids.shape[0], 1), ids.shape[1] + i, dtype=torch.long, device=ids.device)
                where = {"position_ids": pos}
                if "cache_position" in inspect.signature(model.forward).parameters:  # transformers < 5.2x reads it
                    where["cache_position"] = pos[0]
                out = step(input_ids=tok, use_cache=True, **where, **{cache_arg: past})
            tok, past = _next_and_cache(out)
            tok = tok.clone()  # a CUDA graph's output buffer is overwritten by its next replay
            sync()
            steps.append(time.perf_counter() - t0)
            tokens.append(tok)
        phases = None
        if profiler is not None:
            profiler.__exit__(None, None, None)
            phases = step_profile(profiler.events(), steps[steps_before:])
        held, state = cache_bytes(past), state_bytes(model, past)
        del past
    return {"tokens": torch.cat(tokens, 1)[0].tolist(), "ttft_s": ttft, "step_s": steps, "rows": ids.shape[0],
            "cache_bytes": held, "state_bytes": state, "profile": phases, "profiled": profiled if phases else 0}


# an unpatched layer's attention as the profiler names it (transformers' default "sdpa" attention; a model
# run with eager attention shows its products and softmax under "rest")
_EXACT_OPS = ("aten::scaled_dot_product_attention",)


def step_profile(events, step_s: list[float]) -> dict:
    """Where a decode step's time goes, from the profiler's events of ``len(step_s)`` steps: ms per step
    in the patched layers' ranking (``common.RANK``: bounds upkeep, bound products, top-k, lists) and attention
    (``common.ATTEND``: gathers, scores, weighted sums), in the unpatched layers' attention (``_EXACT_OPS``),
    and the rest (projections, MLP, norms, RoPE, logits, the cache's update, Python). The profiler adds a few
    microseconds to every op: a profiled step is slower than a timed one, and its small ops more so."""
    from ..methods.common import ATTEND, RANK

    n = max(1, len(step_s))
    spans = [e for e in events if e.name in (RANK, ATTEND)]

    def inside(e) -> bool:
        return any(s.time_range.start <= e.time_range.start and e.time_range.end <= s.time_range.end for s in spans)

    ms = {"rank_ms": sum(e.cpu_time_total for e in spans if e.name == RANK) / 1e3 / n,
          "attend_ms": sum(e.cpu_time_total for e in spans if e.name == ATTEND) / 1e3 / n,
          "exact_ms": sum(e.cpu_time_total for e in events if e.name in _EXACT_OPS and not inside(e)) / 1e3 / n}
    ms["step_ms"] = 1e3 * sum(step_s) / n
    ms["rest_ms"] = max(0.0, ms["step_ms"] - ms["rank_ms"] - ms["attend_ms"] - ms["exact_ms"])
    ms["steps"] = len(step_s)
    return ms


def _memory_cell(r: dict) -> str:
    """'64.0' (the cache), '64.0 + 23.0 (36%)' (and the patched layers' selection state, its share of the cache)."""
    state, cache = r.get("state_mib"), r.get("cache_mib")
    if cache is None:
        return "–"
    return f"{cache:.1f}" if state is None else f"{cache:.1f} + {state:.1f} ({100 * state / cache:.0f}%)"


def state_bytes(model, past) -> int | None:
    """Bytes the patched layers keep beside the KV cache ``past`` to choose what a step reads (their selection
    state: bounds, fingerprint rows, lists, means, compressed keys; ``LayerRoute.state_bytes``), or None for a
    model longpatch did not patch."""
    patch = getattr(model, "longpatch", None)
    if patch is None:
        return None
    cache = set()
    for t in _cache_tensors(past):
        cache.add((t.device, t.untyped_storage().data_ptr()))
    return sum(r.state_bytes(cache) for r in patch.routes)


def _cache_tensors(past):
    """The tensors of a KV cache's layers (transformers' Cache objects, longpatch's), for telling its storage
    from a selection state's."""
    from ..routing import tensors_in
    return list(tensors_in([vars(layer) for layer in getattr(past, "layers", None) or []]))


def cache_bytes(past) -> int | None:
    """Bytes of the keys and values a KV cache holds at the end of a generation (its rows, not its spare
    capacity; an 8-bit cache's rows and scales), or None for a cache this cannot read (a model's own tuples)."""
    if hasattr(past, "stored_bytes"):
        return past.stored_bytes()
    layers = getattr(past, "layers", None)
    if layers is None:
        return None
    total = 0
    for layer in layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is not None and values is not None:  # a static cache's: its whole preallocated buffer
            total += keys.nbytes + values.nbytes
    return total


def compiled_step(model):
    """The model's forward for decode steps under torch.compile (mode reduce-overhead, CUDA graphs, on a GPU);
    compile state of earlier rows dropped, so that each row compiles its own step (its warm-up)."""
    torch._dynamo.reset()
    mode = {"mode": "reduce-overhead"} if next(model.parameters()).is_cuda else {}
    return torch.compile(model.forward, **{**mode, **COMPILE_OPTIONS})


def check_compilable(points) -> None:
    """One line where --compile is asked for a configuration whose patched decode step cannot be captured."""
    from ..families.hf import graph_safe
    from ..methods import get_method
    from ..routing import LayerRoute

    for label, point in points:
        if point is None:
            continue
        cfg = point.cfg
        if not graph_safe([LayerRoute(0, get_method(cfg.method), dict(cfg.params))]):
            raise ConfigError(f"--compile: config {label!r} (method {cfg.method!r}) has no graph-safe decode step, "
                              "so its compiled step would break its graph at every patched layer; allowed: MoBA's "
                              "or NSA's query-aware selections (selection: estimate, antidiagonal or hybrid), "
                              "sparse without dilation or random blocks, or run without --compile")


def generate_once(model, ids: torch.Tensor, new_tokens: int, cache: str, step=None,
                  prefill_chunk: int | None = None, profile: int = 0) -> dict:
    """greedy_generate's result with the generation's PeakMemory under "memory"."""
    with PeakMemory(ids.device) as m:
        run = greedy_generate(model, ids, new_tokens, cache, step, prefill_chunk=prefill_chunk, profile=profile)
    return {**run, "memory": m}


def summarize(runs: list[dict]) -> dict:
    """A row's numbers from its generations: medians (TTFT; the decode steps of all of them), the
    peak memory of the generation that peaked highest."""
    mem = max((r["memory"] for r in runs), key=lambda m: m.peak_rss_mib)
    ttft = statistics.median(r["ttft_s"] for r in runs)
    timed = [s for r in runs for s in r["step_s"][:len(r["step_s"]) - r.get("profiled", 0)]]
    step_ms = statistics.median(timed or [s for r in runs for s in r["step_s"]]) * 1e3
    total = statistics.median(r["ttft_s"] + sum(r["step_s"]) for r in runs)
    new_tokens, rows = len(runs[0]["tokens"]), runs[0].get("rows", 1)  # tokens/s: every row of a batch
    return {"ttft_s": ttft, "decode_ms_per_token": step_ms, "decode_tokens_per_s": rows * 1e3 / step_ms,
            "tokens_per_s": rows * new_tokens / total, "batch": rows, "total_s": total,
            "peak_rss_mib": mem.peak_rss_mib,
            "rss_increase_mib": mem.rss_increase_mib, "peak_cuda_mib": mem.peak_cuda_mib,
            "cache_mib": None if runs[0].get("cache_bytes") is None else runs[0]["cache_bytes"] / 2 ** 20,
            "state_mib": None if runs[0].get("state_bytes") is None else runs[0]["state_bytes"] / 2 ** 20,
            "tokens": runs[0]["tokens"]}


# ---- prompts ----------------------------------------------------------------------------------------

def prompt_ids(tokenizer, loaded_tokenizer, model, model_name: str, texts: list[str], length: int,
               trust_remote_code: bool = False) -> list[int]:
    """The first `length` token ids of the filler texts (needle.filler_texts: documents joined by blank
    lines, repeated when shorter), tokenized as eval ppl does (tokenizer 'bytes' for tiny:* models)."""
    from ..eval.ppl.scoring import make_encoder, vocab_size
    from ..loading import resolve_tokenizer

    vocab = vocab_size(model)
    tok = resolve_tokenizer(tokenizer, loaded_tokenizer, model_name, trust_remote_code)
    encode, _ = make_encoder(tok, None, vocab, model_name, trust_remote_code)
    text = "\n\n".join(t.rstrip("\n") for t in texts if t.strip())
    if not text:
        raise ConfigError("--filler: the source has no text")
    ids = encode(text)
    if len(ids) < length:
        ids = encode("\n\n".join([text] * (length // max(1, len(ids)) + 1)))
    ids = ids[:length]
    top = max(ids)
    if top >= vocab or min(ids) < 0:
        raise ConfigError(f"tokenizer: produced id {top}, outside the model's vocabulary of {vocab}; pass the "
                          "model's own tokenizer (--tokenizer)")
    return ids


# ---- the run ----------------------------------------------------------------------------------------

@owns_out("out", COMMAND, expand=True)  # one run at a time per --out (two would skew each other's timings)
def run_generate_bench(model: str, config=None, layer_counts=None, contexts="8192,16384,32768", new_tokens: int = 64,
                       out: "str | os.PathLike" = "runs/bench_generate", *, layers=None, method: str | None = None,
                       sets: Sequence[str] = (), tokenizer=None, filler: str = "demo", repeats: int = 1,
                       warmup: int = 1, trust_remote_code: bool = False, progress: bool = True,
                       plots: bool = True, cache: str | None = None, batch_size: int = 1,
                       random_weights: bool = False, compiled: bool = False,
                       prefill_chunk: int | None = None, unpatched_up_to: int | None = None,
                       profile: int = 0) -> dict:
    """Greedy generation after a prompt of each context length, unpatched and patched per each config
    and layer count, in one run. model: what --model takes; config: one config, 'a,b' or a list;
    layer_counts: a sweep as eval ppl's (None: each config's layers); layers: which layers every config
    replaces, instead of a sweep. Every option is checked before the model is loaded; out is written only
    when every row is done. batch_size: the prompt's copies generated together (tokens/s counts them all;
    TTFT and ms/token are the batch's). random_weights: model names a shipped architecture
    (loading.shipped_architectures), built with random weights on the device and prompted with random ids.
    compiled: the decode steps under torch.compile with a static cache (``compiled_step``), every row alike,
    each row's compile in its warm-up (on the prompt's own length), reported, not timed.
    prefill_chunk: every row's prompt prefilled in chunks of this many tokens (``prefill``; None: one
    forward); a multiple of each config's method block (config.check_prefill_chunk). profile: the last that
    many decode steps of each row's last generation run under torch's profiler (``step_profile``: ms per step
    ranking, attending, in exact attention and the rest; left out of the row's median).
    Returns the dict written to results.json."""
    from ..loading import load_model, random_model
    from ..specs import resolve

    ctx = parse_contexts(contexts)
    check_int("--new-tokens", new_tokens, 2, MAX_TOKENS)
    if unpatched_up_to is not None:
        check_int("--unpatched-up-to", unpatched_up_to, 1, MAX_TOKENS)
    check_int("--repeats", repeats, 1, MAX_VALUES)
    check_int("--warmup", warmup, 0, MAX_VALUES)
    check_int("--batch-size", batch_size, 1, MAX_VALUES)
    check_int("--profile", profile, 0, new_tokens - 2)  # at least one step timed besides the profiled ones
    if compiled and cache not in (None, "static"):
        raise ConfigError(f"--cache {cache} with --compile: a compiled step needs a static cache; allowed: --cache "
                          "static, or no --cache")
    cache = ("static" if compiled else "growing") if cache is None else cache
    if cache not in CACHES:
        raise ConfigError(f"cache: got {cache!r}; allowed: {', '.join(CACHES)}")
    if layers is not None and layer_counts is not None:
        raise ConfigError(f"--layers {layers} and --layer-counts {layer_counts}: give one")
    sweep = [None] if layer_counts is None else parse_layer_counts(layer_counts)
    out = check_out(Path(out).expanduser(), COMMAND)
    spec = resolve(model, config, method, layers, list(sets), trust_remote_code=trust_remote_code)
    cfgs = list(spec.patches)
    check_prefill_chunk(None, prefill_chunk)  # the unpatched rows: any int >= 1
    for _, cfg in cfgs:  # before the model is loaded: a chunk each patch can run its method on
        check_prefill_chunk(cfg, prefill_chunk)
    texts = filler_texts(filler)

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if cache in ("int8", "fp8"):  # a format the device lacks: one line before the model loads
        from ..quantized import check_format
        check_format(cache, device)
    loaded, tok = random_model(str(model), spec.load.dtype, device) if random_weights else load_model(spec.load)
    loaded = loaded.to(device).eval()
    _say_if_beyond_positions(loaded, ctx[-1] + new_tokens)
    if random_weights:  # no tokenizer: random ids (what the tokens say changes no cost)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(loaded.config.vocab_size, (ctx[-1],), generator=gen).tolist()
    else:
        ids = prompt_ids(tokenizer or spec.load.tokenizer, tok, loaded, spec.load.model or str(model), texts,
                         ctx[-1], trust_remote_code)
    n_layers = num_layers(loaded, cfgs[0][1])
    identity = {"model": str(model), "task": "bench_generate"}
    points: list[tuple[str, Point | None]] = [(UNPATCHED, None)]
    for name, cfg in cfgs:
        label = name or (method or cfg.method)
        points += [(label, p) for p in make_points(cfg, sweep, n_layers, identity) if p.layers]
    if compiled:
        check_compilable(points)
    shapes = generation_shapes((n, new_tokens) for n in ctx)
    if prefill_chunk is not None:  # each prompt's prefill is its chunks' calls, not one of (n, n)
        from ..eval.ppl.scoring import prefill_shapes
        shapes = {s for s in shapes if s[0] == 1} | set().union(*(prefill_shapes(n, prefill_chunk) for n in ctx))
    say_if_exact(loaded, [p for _, p in points if p is not None], shapes)
    if cache in ("growing", "static") and not takes_cache_objects(loaded):
        log.warning("longpatch: %s keeps its own KV cache (not transformers' Cache classes): --cache %s "
                    "does not apply, the model's own cache is timed", type(loaded).__name__, cache)
        cache = "model's own"
    if compiled and not takes_cache_objects(loaded):
        raise ConfigError(f"--compile: {type(loaded).__name__} keeps its own KV cache, not transformers' static "
                          "cache; allowed: models of transformers' own classes (Llama, Qwen2, ...)")
    records = _run(loaded, points, ids, ctx, new_tokens, repeats, warmup, device, progress, cache, batch_size,
                   compiled, prefill_chunk, unpatched_up_to, profile)
    bandwidth = copy_bandwidth(device)
    weights, per_token = weight_bytes(loaded), kv_bytes_per_token(loaded)
    for rec in records:  # how close each row's step comes to the dense step's memory floor
        rec["dense_floor_ms"] = dense_floor_ms(weights, per_token, rec["context"], new_tokens, batch_size, bandwidth)
        rec["of_floor"] = None if rec["dense_floor_ms"] is None else rec["dense_floor_ms"] / rec["decode_ms_per_token"]
    meta = machine_meta(model=str(model), filler=None if random_weights else filler, contexts=ctx,
                        new_tokens=new_tokens, repeats=repeats, warmup=warmup, cache=cache, batch_size=batch_size,
                        compiled=compiled, prefill_chunk=prefill_chunk,
                        random_weights=random_weights, dtype=str(next(loaded.parameters()).dtype),
                        copy_bandwidth_gbs=bandwidth / 1e9, weight_bytes=weights, kv_bytes_per_token=per_token,
                        note="greedy, batch_size copies of the prompt in one batch; ttft_s: the prompt's forward pass "
                             "(it yields the first token; with prefill_chunk, its forward passes of that many "
                             "tokens each against the KV cache); "
                             "decode_ms_per_token: median of the per-token forward passes with the KV cache; "
                             "tokens_per_s: new_tokens / (ttft + decode time); cache: the KV cache of the decode steps "
                             "(growing: longpatch.cache.GrowingCache; dynamic: transformers' DynamicCache; "
                             "static: transformers' StaticCache); dense_floor_ms: the least time of a dense decode "
                             "step, reading every weight and the whole KV cache once at the measured copy bandwidth "
                             "(of_floor: dense_floor_ms / decode_ms_per_token; a sparse step can exceed 1); warmup_s: "
                             "the untimed warm-up generations before a row's first timed one (compiles included); "
                             "compiled: the decode steps under torch.compile (CUDA graphs on a GPU), each row "
                             "compiled in its warm-up on the prompt's own length"
                             + ("; random weights and random prompt ids: the costs are the architecture's (a "
                                "fixed-budget selection costs the same whatever the weights), the tokens mean "
                                "nothing" if random_weights else ""))
    meta["device"] = str(device) if device.type == "cpu" else torch.cuda.get_device_name(device)
    # the hold on out (owns_out) made the directory already: a failed write keeps it if it held our output before
    with removed_on_failure(out, keep_if_existed=written_by(out) is not None):
        claim_out(out, COMMAND)
        files = {"csv": CSV_FILE, "plot": PLOT_FILE if plots else None}
        results = {"meta": meta, "records": records, "files": files}
        write_json(out / RESULTS_FILE, results)
        write_csv(out / CSV_FILE, CSV_COLUMNS, records)
        if plots:
            plot(records, out / PLOT_FILE, title=f"{model}: greedy generation, {new_tokens} new tokens, "
                                                 f"{meta['device']}, {meta['threads']} thread(s)")
    return results


def _say_if_beyond_positions(model, longest: int) -> None:
    cfg = getattr(model, "config", None)
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "seq_length", None)
    if isinstance(limit, int) and longest > limit:
        log.warning("longpatch: the longest generation reaches %d positions, beyond the model's %d "
                    "(max_position_embeddings): its timings are taken, its tokens mean little", longest, limit)


def _run(model, points, ids: list[int], contexts: list[int], new_tokens: int, repeats: int, warmup: int,
         device, progress: bool, cache: str, batch_size: int = 1, compiled: bool = False,
         prefill_chunk: int | None = None, unpatched_up_to: int | None = None, profile: int = 0) -> list[dict]:
    """Context by context, the unpatched model then each patched configuration: rows compared with each
    other are measured minutes apart at most, not a whole sweep apart (load drifts on shared machines).
    ``unpatched_up_to``: the unpatched model runs at contexts up to this only (longer rows: no speedups)."""
    from tqdm.auto import tqdm

    from ..patching import patch_model, unpatch_model

    records: list[tuple[tuple[int, int], dict]] = []
    base: dict[int, dict] = {}
    warm_s: dict[tuple[int, int], float] = {}
    # on a GPU the warm-up prompt is long enough for the patched layers to run their method (a short one
    # runs exact attention), so that compiles (FlexAttention, Triton) happen here, not in a timed call
    warm = torch.tensor([ids[:min(contexts[0], 8192 if device.type == "cuda" else 256)]], device=device)
    bar = tqdm(total=len(points) * len(contexts) * repeats, desc="bench generate", unit="generation",
               disable=not progress, dynamic_ncols=True)
    try:
        for n in contexts:
            prompt = torch.tensor([ids[:n]] * batch_size, device=device)  # same-length rows: no padding
            runs: dict[int, list[dict]] = {i: [] for i in range(len(points))}
            # round by round, every row once per round: drift in the machine's speed (shared hosts
            # move by tens of percent over minutes) reaches every row alike instead of one row
            for rep in range(repeats):
                for i, (label, point) in enumerate(points):
                    if point is None and unpatched_up_to is not None and n > unpatched_up_to:
                        bar.update(1)
                        continue
                    bar.set_description(f"{label} {point.label if point else ''} {n}".replace("  ", " "))
                    if point is not None:
                        patch_model(model, point.cfg)
                    try:
                        step = None
                        if compiled:  # compiled per row and shape: its warm-up runs on this prompt's length
                            step = compiled_step(model)
                            t0 = time.perf_counter()
                            for _ in range(max(warmup, 1)):
                                greedy_generate(model, prompt, min(new_tokens, 4), cache, step, n + new_tokens,
                                                prefill_chunk)
                            warm_s[i, n] = warm_s.get((i, n), 0.0) + time.perf_counter() - t0
                        elif rep == 0 and n == contexts[0]:
                            t0 = time.perf_counter()
                            for _ in range(warmup):  # untimed: thread pools, allocator, lazily built buffers
                                greedy_generate(model, warm, 2, cache, prefill_chunk=prefill_chunk)
                            warm_s[i, n] = time.perf_counter() - t0  # compiles included: reported, not timed
                        if point is not None:
                            model.longpatch.reset_stats()
                        run = generate_once(model, prompt, new_tokens, cache, step, prefill_chunk,
                                            profile if rep == repeats - 1 else 0)
                        run["paths"] = _paths(model) if point is not None else None
                        run["attended"] = model.longpatch.attended_share() if point is not None else None
                        run["read"] = model.longpatch.read_share() if point is not None else None
                        runs[i].append(run)
                    finally:
                        if point is not None:
                            unpatch_model(model)
                    bar.update(1)
            for i, (label, point) in enumerate(points):
                if not runs[i]:  # the unpatched model above --unpatched-up-to
                    continue
                records.append(((i, n), _record(label, point, n, new_tokens, summarize(runs[i]), base,
                                                   _summed_paths(runs[i]) if point is not None else None)))
                records[-1][1]["prefill_chunk"] = prefill_chunk
                # the prompt's prefill is the same each repeat: its attended share per layer, from the last
                records[-1][1]["attended_share"] = runs[i][-1]["attended"] or None
                records[-1][1]["read_share"] = runs[i][-1]["read"] or None  # what its decode steps listed
                records[-1][1]["step_profile"] = runs[i][-1]["profile"]
                records[-1][1]["warmup_s"] = warm_s.get((i, n))
    finally:
        bar.close()
    return [rec for _, rec in sorted(records, key=lambda x: x[0])]  # by configuration, then context


def _paths(model) -> dict:
    """What served the patched layers' calls, per phase (calls per path): shows that the method's
    decode really ran."""
    return {phase: {path: s["calls"] for path, s in paths.items()}
            for phase, paths in model.longpatch.breakdown()["patched"].items()}


def _summed_paths(runs: list[dict]) -> dict:
    total: dict = {}
    for run in runs:
        for phase, paths in run["paths"].items():
            for path, calls in paths.items():
                total.setdefault(phase, {}).setdefault(path, 0)
                total[phase][path] += calls
    return total


def _record(label: str, point: Point | None, n: int, new_tokens: int, row: dict, base: dict,
            paths: dict | None) -> dict:
    rec = {"config": label, "method": point.cfg.method if point else None, "layers": point.layers if point else 0,
           "indices": point.indices if point else [], "context": n, "new_tokens": new_tokens, **row}
    if point is None:
        base[n] = rec
        rec.update(paths=None, ttft_speedup=1.0, decode_speedup=1.0, tokens_match_exact=None)
        return rec
    rec["paths"] = paths
    ref = base.get(n)
    if ref is None:  # no unpatched row at this context
        rec.update(ttft_speedup=None, decode_speedup=None, tokens_match_exact=None)
        return rec
    rec["ttft_speedup"] = ref["ttft_s"] / rec["ttft_s"]
    rec["decode_speedup"] = ref["decode_ms_per_token"] / rec["decode_ms_per_token"]
    # how many leading greedy tokens equal the unpatched model's at this context
    rec["tokens_match_exact"] = next((i for i, (a, b) in enumerate(zip(rec["tokens"], ref["tokens"])) if a != b),
                                         min(len(rec["tokens"]), len(ref["tokens"])))
    return rec


# ---- report -----------------------------------------------------------------------------------------

def _series(r: dict) -> str:
    return UNPATCHED if r["method"] is None else f"{r['config']} ({r['layers']} layers)"


def _times(x) -> str:
    return "–" if x is None else f"{x:.2f}×"


def print_table(results: dict, console=None) -> None:
    from rich.console import Console
    from rich.markup import escape

    # the KV cache's size, and beside it what the patched layers keep to choose their blocks
    held = any(r.get("cache_mib") is not None for r in results["records"])
    states = held and any(r.get("state_mib") is not None for r in results["records"])
    cols = ["config", "layers", "context", "TTFT s", "TTFT speedup", "decode ms/token", "decode speedup",
            "tokens/s", "peak RSS MiB"] + (["cache + state MiB" if states else "cache MiB"] if held else []) \
        + ["same tokens"]
    cuda = any(r.get("peak_cuda_mib") is not None for r in results["records"])
    cols += ["peak CUDA MiB"] if cuda else []
    floors = any(r.get("dense_floor_ms") is not None for r in results["records"])
    cols += ["of floor"] if floors else []
    shares = any(r.get("attended_share") for r in results["records"])
    cols += ["attended per layer"] if shares else []
    reads = any(r.get("read_share") for r in results["records"])
    cols += ["step reads per layer"] if reads else []
    cells = []
    for r in results["records"]:
        same = "–" if r["tokens_match_exact"] is None else f"{r['tokens_match_exact']}/{r['new_tokens']}"
        c = [escape(r["config"]), str(r["layers"]), str(r["context"]), fmt(r["ttft_s"], ".3f"),
             _times(r["ttft_speedup"]), fmt(r["decode_ms_per_token"], ".2f"), _times(r["decode_speedup"]),
             fmt(r["tokens_per_s"], ".1f"), fmt(r["peak_rss_mib"], ".0f")] + \
            ([_memory_cell(r)] if held else []) + [same]
        c += [fmt(r.get("peak_cuda_mib"), ".0f")] if cuda else []
        if floors:
            c += ["–" if r.get("of_floor") is None else f"{r['of_floor']:.2f}"]
        c += [" ".join(f"{k}:{v:.2f}" for k, v in (r.get("attended_share") or {}).items()) or "–"] if shares else []
        c += [" ".join(f"{k}:{v:.2f}" for k, v in (r.get("read_share") or {}).items()) or "–"] if reads else []
        cells.append(c)
    meta = results["meta"]
    chunked = f", prefill in chunks of {meta['prefill_chunk']} tokens" if meta.get("prefill_chunk") else ""
    title = escape(f"{meta['model']}: greedy generation of {meta['new_tokens']} tokens{chunked}, exact (no patch) vs "
                   "patched (speedups vs exact at the same context)")
    console = console or Console(width=wide_console(170).width, emoji=False, highlight=False)
    show_table(title, cols, cells, console, left=("config",))
    if states:
        console.print("cache + state MiB: the KV cache, and what the patched layers keep beside it to choose what a "
                      "step reads (bounds, fingerprint rows, lists, means, compressed keys; spare capacity "
                      "included), with its share of the cache", markup=False)
    if shares:
        console.print("attended per layer: the prompt's query-key products each patched layer attended over exact "
                      "attention's (layer:share; a query-aware selection's cost follows the text)", markup=False)
    if reads:
        console.print("step reads per layer: the keys each patched layer's decode steps listed over the cache's "
                      "(layer:share; beside them a query-aware step reads its page bounds, 1 / decode_page of the "
                      "cache's bytes)", markup=False)
    if floors:
        per_context = {r["context"]: r["dense_floor_ms"] for r in results["records"] if r.get("dense_floor_ms")}
        console.print("of floor: the dense floor over the measured ms/token (1: at the limit; a sparse step reads "
                      "less and can pass 1); the dense floor, a decode step reading every weight and the whole KV "
                      f"cache once at the measured copy bandwidth ({meta['copy_bandwidth_gbs']:.1f} GB/s): "
                      + ", ".join(f"{n}: {ms:.2f} ms" for n, ms in per_context.items()), markup=False)
    _print_profiles(results["records"], console)
    if meta.get("allocator") == KEPT:
        console.print("peak RSS: the process's high-water mark so far (freed memory is kept for reuse; "
                      "LONGPATCH_KEEP_FREED_MEMORY=0 measures each row's own)", markup=False)


def _print_profiles(records: list[dict], console) -> None:
    """The profiled decode steps' phases (--profile), one row per configuration and context."""
    rows = [r for r in records if r.get("step_profile")]
    if not rows:
        return
    from rich.markup import escape

    def share(p: dict, key: str) -> str:
        return f"{p[key]:.2f} ({p[key] / p['step_ms']:.0%})"

    cells = [[escape(r["config"]), str(r["layers"]), str(r["context"]), fmt(r["step_profile"]["step_ms"], ".2f")]
             + [share(r["step_profile"], k) for k in ("rank_ms", "attend_ms", "exact_ms", "rest_ms")] for r in rows]
    show_table(f"one decode step, profiled (ms per step over {rows[0]['step_profile']['steps']} steps; the profiler "
               "slows small ops)", ["config", "layers", "context", "step ms", "ranking", "attending",
                                    "exact attention", "rest"], cells, console, left=("config",))
    console.print("ranking: the patched layers' choice of what a step reads (bounds upkeep, bound products, top-k, "
                  "lists); attending: their gathers, scores and weighted sums; exact attention: the unpatched "
                  "layers'; rest: projections, MLP, norms, RoPE, logits, the cache's update, Python", markup=False)


def plot(records: list[dict], path: Path, title: str | None = None) -> None:
    """Decode latency and TTFT against context, one line per configuration; written atomically."""
    from ..plotting import method_color

    fig, axes = figure(1, 2, (11, 4))
    ax_d, ax_t = axes[0]
    seen: dict = {}  # method -> series drawn: one colour per method, a line style per series of it
    for s in dict.fromkeys(_series(r) for r in records):
        rs = [r for r in records if _series(r) == s]
        xs, ds, ts = zip(*sorted((r["context"], r["decode_ms_per_token"], r["ttft_s"]) for r in rs))
        nth = seen.setdefault(rs[0]["method"], []).append(s) or len(seen[rs[0]["method"]]) - 1
        style = dict(color=method_color(rs[0]["method"]),
                     ls="--" if rs[0]["method"] is None else ("-", "-.", ":", (0, (5, 1)))[nth % 4])
        ax_d.plot(xs, ds, marker="o", label=s, **style)
        ax_t.plot(xs, ts, marker="o", label=s, **style)
    for ax, ylabel in ((ax_d, "decode ms per token (median)"), (ax_t, "time to first token, s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (prompt tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    save_figure(fig, tmp, title)
    os.replace(tmp, path)
