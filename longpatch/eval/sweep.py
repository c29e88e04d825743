"""What an evaluation sweeps: the model it loads once, the patch configurations it applies in turn (one
Point per layer count), and the options every evaluation shares (RunSpec)."""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

from ..config import LoadSpec, PatchConfig, select_layers
from ..errors import ConfigError, check_int
from ..families import detect_family
from ..loading import load_model, resolve_tokenizer
from ..options import parse_layer_counts, parse_layers
from ..outdir import check_out
from ..patching import patch_model, patched, unpatch_model
from ..specs import config_items, resolve
from .records import INTERRUPTED, RecordLog, announce_resume, read_records, records_file

log = logging.getLogger("longpatch")


@dataclass
class RunSpec:
    """Options of every evaluation: which patches, which layer counts, where the records go, how many processes.

    layer_counts: the sweep (options.parse_layer_counts: '0,4,8', '0:28:4', 'all'; None: each config's own
    layers, one point). layers: which layers every config replaces (options.parse_layers: N, 'all', layer
    indices); not with layer_counts. config / method / sets: the patches (specs.resolve: a config, a
    comma-separated list or a list, each getting the whole sweep / a method name / --set pairs). out: output
    directory; a rerun with the same out resumes. tokenizer: None (the model's), a name or path, 'bytes'
    (loading.ByteTokenizer), or an object. num_processes: > 1 spawns that many local workers
    (launch.run_sharded). progress: progress bars (rank 0). plots: write the PNGs. run_id: tags this
    invocation's records (default: a fresh id).
    """

    layer_counts: object = None
    layers: object = None
    config: object = None
    method: str | None = None
    sets: list = field(default_factory=list)
    out: str = "runs/eval"
    tokenizer: object = None
    num_processes: int = 1
    trust_remote_code: bool = False
    progress: bool = True
    plots: bool = True
    run_id: str | None = None
    COMMAND = "eval"  # not a field: the command whose output `out` holds (outdir.check_out, claim_out)

    def __post_init__(self):
        self.sets = list(self.sets)
        self.out = str(self.out)
        if isinstance(self.config, tuple):
            self.config = list(self.config)
        check_int("--num-processes", self.num_processes, 1)
        if self.layer_counts is not None and self.layers is not None:
            raise ConfigError(f"--layers {self.layers} and --layer-counts {self.layer_counts}: give one (--layers: "
                              "which layers every run replaces; --layer-counts: a sweep of counts of final layers)")
        if self.layers is not None:
            parse_layers(self.layers)

    def sweep(self) -> list:
        """The layer specs to evaluate, one PatchConfig.layers value each: the counts, or [None] (each
        config's layers, after --layers)."""
        return [None] if self.layer_counts is None else parse_layer_counts(self.layer_counts)

    def configs(self) -> list:
        return config_items(self.config)

    def named_inputs(self) -> bool:
        """Whether a worker process can rebuild everything from names (needed to spawn workers)."""
        return (self.tokenizer is None or isinstance(self.tokenizer, str)) and \
            all(c is None or isinstance(c, str) for c in self.configs())

    def to_kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_options(cls, **options):
        """The spec from keyword options, with a one-line error naming an unknown one."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ConfigError(f"{cls.__name__}: unknown option(s) {', '.join(unknown)}; "
                              f"allowed: {', '.join(sorted(names))}")
        return cls(**options)


def resolve_spec(spec_cls, name: str, spec, layer_counts, options: dict):
    """The spec of an evaluation entry point: `spec=` or `spec_cls`'s options, not both. Its sweep is
    parsed here, so a bad one fails before any process starts or anything is loaded."""
    if spec is None:
        spec = spec_cls.from_options(layer_counts=layer_counts, **options)
    elif options or layer_counts is not None:
        raise ConfigError(f"{name}: pass either spec= or options, not both")
    spec.sweep()
    check_out(spec.out, spec.COMMAND)
    return spec


@dataclass
class Point:
    """One configuration of a sweep."""

    cfg: PatchConfig
    layers: int  # how many layers run the method
    indices: list[int]
    config_id: str
    label: str
    config: str | None = None  # the config it comes from, as given (--config a,b), when the run names one

    def describe(self) -> dict:
        return {"config_id": self.config_id, "label": self.label, "config": self.config, "layers": self.layers,
                "indices": self.indices,
                "method": self.cfg.method if self.indices else None,
                "params": self.cfg.params if self.indices else {},
                **({"layer_params": self.cfg.layer_params} if self.indices and self.cfg.layer_params else {}),
                "min_seq_len": self.cfg.min_seq_len, "backend": self.cfg.backend}


def config_id(identity: dict, indices: list[int], cfg: PatchConfig) -> str:
    key = dict(identity, layers=indices)
    if indices:  # with no patched layer, method and params change nothing: one baseline for all methods
        key.update(method=cfg.method, params=cfg.params, min_seq_len=cfg.min_seq_len, backend=cfg.backend,
                   family=cfg.family)
        if cfg.layer_params:  # only when set: the ids of configs without them stay what they were
            key["layer_params"] = {str(i): v for i, v in cfg.layer_params.items()}
    text = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def make_points(cfg: PatchConfig, sweep: list, num_layers: int, identity: dict) -> list[Point]:
    points = []
    for spec in sweep:
        spec = cfg.layers if spec is None else spec
        indices = select_layers(spec, num_layers)
        if any(p.indices == indices for p in points):
            continue
        # a point replacing fewer layers keeps the per-layer changes of the layers it replaces
        point_cfg = cfg.replace(layers=spec, layer_params={i: v for i, v in cfg.layer_params.items() if i in indices})
        n = len(indices)
        if isinstance(spec, list):
            label = f"{cfg.method}:[{','.join(map(str, indices))}]"
        else:
            label = "exact" if n == 0 else f"{cfg.method}:{n}"  # the baseline's one name in every output
        points.append(Point(point_cfg, n, indices, config_id(identity, indices, point_cfg), label))
    return points


@dataclass
class Prepared:
    """A run's model, resolved once (specs.resolve): the model on its device(s), the tokenizer loaded with it
    (or None), its name for the records, how it was loaded, and the patches [(config label, PatchConfig)]."""

    model: object
    tokenizer: object
    name: str
    load: LoadSpec
    patches: list


def prepare(model, spec: RunSpec, dist, device_map: str | None = None) -> Prepared:
    """Resolve the run's options (one LoadSpec, one patch per config) and load the model when given by name."""
    if isinstance(model, str):
        resolved = resolve(model, spec.config, spec.method, spec.layers, spec.sets,
                           trust_remote_code=spec.trust_remote_code, device_map=device_map)
        loaded, tok = load_model(resolved.load)
        loaded = _dispatch(loaded, device_map) if device_map else loaded.to(dist.device())
        name = resolved.load.model
    else:
        if device_map:
            raise ConfigError("--device-map: only for a model given by name or path; place a loaded model yourself")
        resolved = resolve(None, spec.config, spec.method, spec.layers, spec.sets)
        loaded, tok = model, None
        name = (getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
                or type(model).__name__)
    if getattr(loaded, "longpatch", None) is not None:
        raise ConfigError("model is already patched by longpatch; pass it unpatched (unpatch_model) so each "
                          "configuration of the sweep can be applied")
    return Prepared(loaded.eval(), tok, name, resolved.load, list(resolved.patches))


def _dispatch(model, device_map: str):
    if device_map != "auto":
        raise ConfigError(f"--device-map: got {device_map!r}; allowed: auto")
    from accelerate import dispatch_model, infer_auto_device_map

    no_split = getattr(model, "_no_split_modules", None) or []
    placement = infer_auto_device_map(model, no_split_module_classes=list(no_split))
    return dispatch_model(model, placement)


def num_layers(model, cfg: PatchConfig) -> int:
    """The model's attention layers, as its family counts them."""
    return detect_family(model, cfg.family).num_layers(model)


def run_points(model, todo: list[tuple[Point, list]], writer: RecordLog, bar, out,
               one: Callable[[Point, object], dict], start: Callable[[Point, list], None] | None = None,
               label: Callable[[Point], str] = lambda p: p.label, shapes=(), interleave: bool = False,
               batch: int = 1, many: Callable[[Point, list], list[dict]] | None = None,
               same: Callable[[object], object] | None = None) -> None:
    """The loop of every evaluation: patch the model for each point that has pending items, append the
    record one(point, item) of each item as it finishes, unpatch; closes writer and bar. start(point,
    items) runs after a point's first patching (warm-up). Interrupted, it says where the finished work is.

    shapes: the (q_len, kv_len) of the run's attention calls (say_if_exact; () says nothing).
    interleave: item by item, every point's record of an item before the next item, so the points'
    timings of one item are taken side by side, under the same load (eval ppl's speedups).
    batch, many: with many given and batch > 1, items go `batch` at a time to many(point, items), which
    returns their records in order (the batched generations); same(item), if given: only items with
    equal same() share a batch (eval needle: the prompt length, under a chunked prefill)."""
    say_if_exact(model, [p for p, pending in todo if pending], shapes)
    steps = _interleaved(todo) if interleave else [(p, pending) for p, pending in todo if pending]
    started: set[str] = set()
    try:
        for point, pending in steps:
            patch_model(model, point.cfg, timed=True)  # the records report attention seconds per path
            try:
                bar.set_description(label(point))
                if start is not None and point.config_id not in started:
                    start(point, pending)
                started.add(point.config_id)
                size = batch if many is not None else 1
                for group in _batches(pending, size, same):
                    for record in (many(point, group) if size > 1 else [one(point, group[0])]):
                        writer.append(record)
                    bar.update(len(group))
            finally:
                unpatch_model(model)
    except KeyboardInterrupt:
        log.warning(INTERRUPTED, out)
        raise
    finally:
        bar.close()
        writer.close()


def _batches(items: list, size: int, same: Callable[[object], object] | None) -> list[list]:
    """items `size` at a time, in order; with same given, each batch of items with one same() value (the
    values in first-seen order)."""
    runs: dict = {}
    for x in items:
        runs.setdefault(None if same is None else same(x), []).append(x)
    return [run[i:i + size] for run in runs.values() for i in range(0, len(run), size)]


def _interleaved(todo: list[tuple[Point, list]]) -> list[tuple[Point, list]]:
    """[(point, [item])] item by item (in first-seen order), each item's points in todo's order."""
    pending = [{id(x) for x in items} for _, items in todo]
    items = list({id(x): x for _, xs in todo for x in xs}.values())
    return [(p, [x]) for x in items for (p, _), ids in zip(todo, pending) if id(x) in ids]


def generation_shapes(prompts) -> set[tuple[int, int]]:
    """The (q_len, kv_len) of the attention calls that generating new_tokens after each prompt of
    prompt_len tokens makes: [(prompt_len, new_tokens)] -> a prefill each, then one-token decode steps."""
    shapes = set()
    for n, new in prompts:
        shapes.add((n, n))
        shapes.update((1, kv) for kv in range(n + 1, n + new + 1))
    return shapes


def say_if_exact(model, points: list[Point], shapes) -> None:
    """One line for each configuration of the run whose patched layers compute exact attention at every
    (q_len, kv_len) call in `shapes` (the run's own): each call either takes an exact path (below
    min_seq_len, decode without the method's own) or is one the bound method computes exactly
    (BoundMethod.exact_at; e.g. MoBA whose top-k covers every chunk). Its numbers are exact attention's."""
    shapes, told = sorted(set(shapes), key=lambda s: (-s[1], s[0])), set()  # the longest (least exact) first
    for p in points:
        key = json.dumps([p.cfg.method, p.cfg.params, p.cfg.min_seq_len], sort_keys=True, default=str)
        if not shapes or not p.indices or p.cfg.method == "exact" or key in told:
            continue
        told.add(key)
        with patched(model, p.cfg):
            routes = [r for r in model.longpatch.routes if r.method is not None]
            exact = bool(routes) and all(r.bound is not None for r in routes) and all(
                r.choose(q, kv) != "method" or r.bound.exact_at(q, kv) for r in routes for q, kv in shapes)
            params = ", ".join(f"{k}={v}" for k, v in routes[0].bound.params.items()) if exact else ""
        if exact:
            log.warning("longpatch: %s%s is exact attention at every length of this run (up to %d tokens): its "
                        "results and times are exact attention's, not an approximation's", p.cfg.method,
                        f" ({params})" if params else "", max(kv for _, kv in shapes))


def run_generations(model, points: list[tuple[str, Point]], work: list, out, dist, progress: bool, desc: str,
                    one: Callable[[str, Point, object], dict], shapes=(), batch: int = 1,
                    many: Callable[[str, Point, list], list[dict]] | None = None,
                    same: Callable[[object], object] | None = None) -> None:
    """The generation evaluations' loop (eval needle, eval longbench): every (labelled point, work item)
    not yet in out's records, one record each; `work` items carry a `digest`; one(label, point, item),
    or many(label, point, items) `batch` items at a time. shapes: as run_points (on rank 0;
    generation_shapes). same: as run_points (which items may share a batch)."""
    from tqdm.auto import tqdm

    out = Path(out)
    done = {(r.get("config_id"), r.get("digest")) for r in read_records(out)}
    todo = [(label, p, [w for w in work if (p.config_id, w.digest) not in done]) for label, p in points]
    total = sum(len(ws) for _, _, ws in todo)
    already = len(points) * len(work) - total
    if already and progress:
        announce_resume(already, total, "generations", out)
    if not total:
        return
    labels = {p.config_id: label for label, p in points}
    bar = tqdm(total=total, desc=desc, unit="gen", disable=not progress, dynamic_ncols=True)
    run_points(model, [(p, ws) for _, p, ws in todo], RecordLog(records_file(out, dist.rank, dist.world)), bar, out,
               lambda p, w: one(labels[p.config_id], p, w), label=lambda p: f"{labels[p.config_id]} {p.label}",
               shapes=shapes if dist.main else (), batch=batch,
               many=None if many is None else (lambda p, ws: many(labels[p.config_id], p, ws)), same=same)


def prepare_configs(model, spec: RunSpec, dist) -> Prepared:
    """prepare(), with the evaluation's tokenizer (spec's, else the configs', else the one loaded with the
    model, else the model's name looked up), checked against the model's embedding."""
    prep = prepare(model, spec, dist)
    prep.tokenizer = eval_tokenizer(spec.tokenizer or prep.load.tokenizer, prep.tokenizer, prep.model, prep.name,
                                    spec.trust_remote_code)
    _check_vocab(prep.model, prep.tokenizer)
    return prep


def _check_vocab(model, tokenizer) -> None:
    """A tokenizer whose ids the model's embedding cannot hold would fail deep inside generate()."""
    try:
        rows, ids = model.get_input_embeddings().num_embeddings, len(tokenizer)
    except (AttributeError, NotImplementedError, TypeError):  # no accessor or no size: nothing to check against
        return
    if ids > rows:
        raise ConfigError(f"tokenizer: {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__} has "
                          f"{ids} ids, more than the model's {rows} embedding rows; pass the model's "
                          "own tokenizer")


def model_dtype(model) -> str | None:
    """The dtype the model's weights were loaded in ('float32', 'bfloat16', ...), recorded in every output:
    scores and timings depend on it, and `--set dtype=` or a config may have chosen it."""
    try:
        return str(next(model.parameters()).dtype).removeprefix("torch.")
    except (AttributeError, StopIteration, TypeError):
        return None


def eval_tokenizer(given, loaded, model, name: str | None, trust_remote_code: bool):
    """The evaluation's tokenizer (loading.resolve_tokenizer: --tokenizer, else the model's). A loaded model's
    name is its name_or_path, else its class name, which is nothing to look up."""
    return resolve_tokenizer(given, loaded, None if name == type(model).__name__ else name, trust_remote_code)


def loading_identity(load, model) -> dict:
    """What every config id holds of how the model was loaded and where it runs, since each changes the
    numbers: the dtype and attention implementation asked for; for a model the caller loaded (no option
    says how), the dtype and attention implementation it has; the device map; the device type of its
    weights when not the CPU (cuda: the same on every rank). A key is added only where it says something,
    so that the ids of runs without it stay what they were (their --out resumes). load: the LoadSpec; model:
    the loaded model. Calibrate's resume key holds it too."""
    key = {"dtype": load.dtype, "attn_implementation": load.attn_implementation}
    if load.model is None:  # a loaded model object: "auto" and None would say nothing about it
        key["loaded_dtype"] = model_dtype(model)
        key["attn_in_use"] = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if load.device_map is not None:
        key["device_map"] = load.device_map
    device = input_device(model).type
    if device != "cpu":
        key["device"] = device
    return key


def labelled_points(prep: Prepared, spec: RunSpec, n_layers: int, identity: dict) -> list[tuple[str, Point]]:
    """(label, point) per config and layer count; 0 replaced layers is the model's own attention whatever
    the config, so all configs share one baseline, labelled 'exact'."""
    points: list[tuple[str, Point]] = []
    identity = dict(identity, **loading_identity(prep.load, prep.model))
    for config, cfg in prep.patches:
        label = config or (f"{cfg.method}" if spec.method else "default")
        for p in make_points(cfg, spec.sweep(), n_layers, identity):
            if all(p.config_id != q.config_id for _, q in points):
                p.config = "exact" if p.layers == 0 else label
                points.append((p.config, p))
    return points


def input_device(model):
    """The device a model takes its input ids on (its first parameter's)."""
    return next(model.parameters()).device


def generate_rows(model, prompts: list[list[int]], max_new: list[int], device, eos, pad: int | None = None,
                  **generate_kwargs) -> list[list[int]]:
    """Greedy generation of several prompts in one left-padded batch (the generation convention; each row
    gets the positions and attention it has alone, see docs/methods.md "Batches"): each row's new tokens,
    cut at its own budget and after its first eos (an id or a list of ids), as generating that prompt
    alone gives them. generate_kwargs go to model.generate (e.g. min_new_tokens)."""
    import torch

    stops = set(eos) if isinstance(eos, (list, tuple)) else {eos} - {None}
    pad = pad if pad is not None else (min(stops) if stops else 0)
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), n, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, n - len(p):] = torch.tensor(p)
        mask[i, n - len(p):] = 1
    with torch.no_grad():
        gen = model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             max_new_tokens=max(max_new), pad_token_id=pad, **generate_kwargs)
    rows = []
    for i, budget in enumerate(max_new):
        new = gen[i, n:n + budget].tolist()
        end = next((j for j, t in enumerate(new) if t in stops), None)
        rows.append(new if end is None else new[:end + 1])
    return rows


def timed_rows(model, prompts: list[list[int]], max_new: list[int], device, eos, pad: int | None = None,
               **generate_kwargs) -> tuple[list[list[int]], float, dict]:
    """``generate_rows`` on a patched model, with what each row's record carries of the batch's cost:
    (rows, seconds per row, attention stats per row): the batch's wall time and attention breakdown
    shared evenly between its rows, so that summing the records gives the batch's totals."""
    model.longpatch.reset_stats()
    t0 = time.perf_counter()
    rows = generate_rows(model, prompts, max_new, device, eos, pad, **generate_kwargs)
    seconds = (time.perf_counter() - t0) / len(prompts)
    return rows, seconds, _shared_stats(model.longpatch.breakdown(), len(prompts))


def _shared_stats(breakdown: dict, rows: int) -> dict:
    """A batch's attention breakdown as each of its `rows` records carries it: calls and seconds divided
    evenly, so that summing the records gives the batch's totals."""
    return {side: {phase: {path: {k: v / rows for k, v in s.items()} for path, s in paths.items()}
                   for phase, paths in phases.items()} for side, phases in breakdown.items()}
