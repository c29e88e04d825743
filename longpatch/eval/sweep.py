"""What an evaluation sweeps: the model it loads once, the patch configurations it applies in turn (one
Point per layer count), and the options every evaluation shares (RunSpec)."""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

from ..config import PatchConfig, load_config, parse_layer_items, select_layers
from ..errors import ConfigError, check_int
from ..loading import resolve_tokenizer
from ..outdir import check_out
from ..patching import patch_model, patched, unpatch_model
from .records import INTERRUPTED, RecordLog, announce_resume, read_records, records_file

log = logging.getLogger("longpatch")


@dataclass
class RunSpec:
    """Options of every evaluation: which patch, which layer counts, where the records go, how many processes.

    layers: the sweep (parse_layer_sweep). config / method / sets: the patch (YAML or alias / method
    name / 'key=value' overrides). out: output directory; a rerun with the same out resumes.
    tokenizer: None (the model's), a name or path, 'bytes' (loading.ByteTokenizer), or an object.
    num_processes: > 1 spawns that many local workers (launch.run_sharded). progress: progress bars
    (rank 0). plots: write the PNGs. run_id: tags this invocation's records (default: a fresh id).
    """

    layers: object = None
    config: "str | PatchConfig | None" = None
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
        check_int("num_processes", self.num_processes, 1)

    def named_inputs(self) -> bool:
        """Whether a worker process can rebuild everything from names (needed to spawn workers)."""
        return (self.tokenizer is None or isinstance(self.tokenizer, str)) and not isinstance(self.config, PatchConfig)

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


def resolve_spec(spec_cls, name: str, spec, layers, options: dict):
    """The spec of an evaluation entry point: `spec=` or `spec_cls`'s options, not both. Its layer sweep is
    parsed here, so a bad one fails before any process starts or anything is loaded."""
    if spec is None:
        spec = spec_cls.from_options(layers=layers, **options)
    elif options or layers is not None:
        raise ConfigError(f"{name}: pass either spec= or options, not both")
    parse_layer_sweep(spec.layers)
    check_out(spec.out, spec.COMMAND)
    return spec


def parse_layer_sweep(spec) -> list:
    """The --layers of `eval ppl` -> the layer specs to evaluate, one PatchConfig.layers value each.

    '20' -> [20] (the last 20 layers); '0,4,8' -> [0, 4, 8]; '0:28:4' -> [0, 4, ..., 28]: start:end:step
    with the END INCLUDED (so 0:28:4 is the paper's Figure 3 axis); '0:4' -> [0, 1, 2, 3, 4];
    'all' (also inside a list) -> every layer; None -> [None], the config's own layers (which may be
    a list of layer indices). The syntax is `apply`'s (config.parse_layer_items), but here every int is a
    count of final layers, one sweep point each, where `apply` reads a list or range as layer indices.
    """
    if spec is None:
        return [None]
    if isinstance(spec, int) and not isinstance(spec, bool):
        return [_count(spec, spec)]
    if isinstance(spec, (list, tuple)):
        return _dedupe([p for item in spec for p in parse_layer_sweep(item)])
    return _dedupe(parse_layer_items(spec))


def _count(text, spec) -> int:
    try:
        n = int(text)
    except (TypeError, ValueError):
        n = -1
    if n < 0:
        raise ConfigError(f"--layers: got {spec!r}; allowed: N >= 0, 'all', a list N1,N2,... or start:end[:step] "
                          "(end included)")
    return n


def _dedupe(items: list) -> list:
    out = []
    for x in items:
        if x not in out:
            out.append(x)
    return out


@dataclass
class Point:
    """One configuration of a sweep."""

    cfg: PatchConfig
    layers: int  # how many layers run the method
    indices: list[int]
    config_id: str
    label: str

    def describe(self) -> dict:
        return {"config_id": self.config_id, "label": self.label, "layers": self.layers, "indices": self.indices,
                "method": self.cfg.method if self.indices else None,
                "params": self.cfg.params if self.indices else {},
                "min_seq_len": self.cfg.min_seq_len, "backend": self.cfg.backend}


def config_id(identity: dict, indices: list[int], cfg: PatchConfig) -> str:
    key = dict(identity, layers=indices)
    if indices:  # with no patched layer, method and params change nothing: one baseline for all methods
        key.update(method=cfg.method, params=cfg.params, min_seq_len=cfg.min_seq_len, backend=cfg.backend,
                   family=cfg.family)
    text = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def make_points(cfg: PatchConfig, sweep: list, num_layers: int, identity: dict) -> list[Point]:
    points = []
    for spec in sweep:
        spec = cfg.layers if spec is None else spec
        indices = select_layers(spec, num_layers)
        if any(p.indices == indices for p in points):
            continue
        point_cfg = cfg.replace(layers=spec)
        n = len(indices)
        if isinstance(spec, list):
            label = f"{cfg.method}:[{','.join(map(str, indices))}]"
        else:
            label = "baseline:0" if n == 0 else f"{cfg.method}:{n}"
        points.append(Point(point_cfg, n, indices, config_id(identity, indices, cfg), label))
    return points


def prepare_model(model, config, method, sets, trust_remote_code, device_map, dist):
    """-> (PatchConfig, model on its device(s), tokenizer loaded with it or None, name for records)."""
    if isinstance(model, str):
        from ..loading import build_config, load_model
        if isinstance(config, PatchConfig):
            cfg = config.replace(model=model)
        else:
            cfg = build_config(model, config, method, None, list(sets), trust_remote_code)
        loaded, tok = load_model(cfg)
        name = cfg.model
        if device_map:
            loaded = _dispatch(loaded, device_map)
        else:
            loaded = loaded.to(dist.device())
    else:
        if device_map:
            raise ConfigError("device_map: only for a model given by name or path; place a loaded model yourself")
        cfg = config if isinstance(config, PatchConfig) else load_config(config) if config else PatchConfig()
        if method and method != cfg.method:
            cfg = cfg.replace(method=method, params={})
        cfg = cfg.with_overrides(list(sets)) if sets else cfg
        loaded, tok = model, None
        name = (getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
                or type(model).__name__)
    if getattr(loaded, "longpatch", None) is not None:
        raise ConfigError("model is already patched by longpatch; pass it unpatched (unpatch_model) so each "
                          "configuration of the sweep can be applied")
    return cfg, loaded.eval(), tok, name


def _dispatch(model, device_map: str):
    if device_map != "auto":
        raise ConfigError(f"device_map: got {device_map!r}; allowed: auto")
    from accelerate import dispatch_model, infer_auto_device_map

    no_split = getattr(model, "_no_split_modules", None) or []
    placement = infer_auto_device_map(model, no_split_module_classes=list(no_split))
    return dispatch_model(model, placement)


def num_layers(model, cfg: PatchConfig) -> int:
    patch_model(model, cfg.replace(layers=0))
    try:
        return model.longpatch.num_layers
    finally:
        unpatch_model(model)


def run_points(model, todo: list[tuple[Point, list]], writer: RecordLog, bar, out,
               one: Callable[[Point, object], dict], start: Callable[[Point, list], None] | None = None,
               label: Callable[[Point], str] = lambda p: p.label, shapes=(), interleave: bool = False) -> None:
    """The loop of every evaluation: patch the model for each point that has pending items, append the
    record one(point, item) of each item as it finishes, unpatch; closes writer and bar. start(point,
    items) runs after a point's first patching (warm-up). Interrupted, it says where the finished work is.

    shapes: the (q_len, kv_len) of the run's attention calls (say_if_exact; () says nothing).
    interleave: item by item, every point's record of an item before the next item, so the points'
    timings of one item are taken side by side, under the same load (eval ppl's speedups)."""
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
                for item in pending:
                    writer.append(one(point, item))
                    bar.update(1)
            finally:
                unpatch_model(model)
    except KeyboardInterrupt:
        log.warning(INTERRUPTED, out)
        raise
    finally:
        bar.close()
        writer.close()


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
                    one: Callable[[str, Point, object], dict], shapes=()) -> None:
    """The generation evaluations' loop (eval needle, eval longbench): every (labelled point, work item)
    not yet in out's records, one record each; `work` items carry a `digest`; one(label, point, item).
    shapes: as run_points (on rank 0; generation_shapes)."""
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
               shapes=shapes if dist.main else ())


def prepare_configs(model, spec: RunSpec, dist):
    """Load the model (the first config) and resolve every config of spec.configs() on it; with the
    tokenizer (spec's, else the loaded one's, else the model's name) and the model's name.
    Returns (model, tokenizer, name, [(config, PatchConfig)])."""
    prepared, tokenizer, name = [], spec.tokenizer, None
    for config in spec.configs():
        # the model is loaded by the first config and re-patched for the others
        cfg, model, tok, loaded_name = prepare_model(model, config, spec.method, spec.sets, spec.trust_remote_code,
                                                     None, dist)
        name = name or loaded_name
        prepared.append((config, cfg))
        tokenizer = tokenizer or tok
    tokenizer = eval_tokenizer(tokenizer, None, model, name, spec.trust_remote_code)
    _check_vocab(model, tokenizer)
    return model, tokenizer, name, prepared


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


def eval_tokenizer(given, loaded, model, name: str | None, trust_remote_code: bool):
    """The evaluation's tokenizer (loading.resolve_tokenizer: --tokenizer, else the model's). A loaded model's
    name is its name_or_path, else its class name, which is nothing to look up."""
    return resolve_tokenizer(given, loaded, None if name == type(model).__name__ else name, trust_remote_code)


def labelled_points(prepared: list, spec: RunSpec, sweep, n_layers: int, identity: dict) -> list[tuple[str, Point]]:
    """(label, point) per config and layer count; 0 replaced layers is the model's own attention whatever
    the config, so all configs share one baseline, labelled 'exact'."""
    points: list[tuple[str, Point]] = []
    for config, cfg in prepared:
        label = config or (f"{cfg.method}" if spec.method else "default")
        for p in make_points(cfg, sweep, n_layers, dict(identity, dtype=cfg.dtype,
                                                         attn_implementation=cfg.attn_implementation)):
            if all(p.config_id != q.config_id for _, q in points):
                points.append(("exact" if p.layers == 0 else label, p))
    return points
