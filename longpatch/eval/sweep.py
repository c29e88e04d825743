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
from ..errors import ConfigError
from ..loading import TINY_PREFIX, load_tokenizer
from ..patching import patch_model, unpatch_model
from .records import INTERRUPTED, RecordLog, announce_resume, read_records, records_file

log = logging.getLogger("longpatch")


@dataclass
class RunSpec:
    """Options of every evaluation: which patch, which layer counts, where the records go, how many processes.

    layers: the sweep (parse_layer_sweep). config / method / sets: the patch (YAML or alias / method
    name / 'key=value' overrides). out: output directory; a rerun with the same out resumes.
    tokenizer: None (the model's), a name or path, or an object. num_processes: > 1 spawns that many
    local workers (launch.run_sharded). progress: progress bars (rank 0). plots: write the PNGs.
    run_id: tags this invocation's records (default: a fresh id).
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


def check_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}: got {value!r}; allowed: an int >= {minimum}")


def run_points(model, todo: list[tuple[Point, list]], writer: RecordLog, bar, out,
               one: Callable[[Point, object], dict], start: Callable[[Point, list], None] | None = None,
               label: Callable[[Point], str] = lambda p: p.label) -> None:
    """The loop of every evaluation: patch the model for each point that has pending items, append the
    record one(point, item) of each item as it finishes, unpatch; closes writer and bar. start(point,
    pending) runs after patching (warm-up). Interrupted, it says where the finished work is."""
    try:
        for point, pending in todo:
            if not pending:
                continue
            patch_model(model, point.cfg)
            try:
                bar.set_description(label(point))
                if start is not None:
                    start(point, pending)
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


def run_generations(model, points: list[tuple[str, Point]], work: list, out, dist, progress: bool, desc: str,
                    one: Callable[[str, Point, object], dict]) -> None:
    """The generation evaluations' loop (eval needle, eval longbench): every (labelled point, work item)
    not yet in out's records, one record each; `work` items carry a `digest`; one(label, point, item)."""
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
               lambda p, w: one(labels[p.config_id], p, w), label=lambda p: f"{labels[p.config_id]} {p.label}")


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
    if tokenizer is None or isinstance(tokenizer, str):
        # a loaded model's name is its name_or_path, else its class name, which is nothing to look up
        tokenizer = _load_tokenizer(tokenizer, None if name == type(model).__name__ else name, spec.trust_remote_code)
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


def _load_tokenizer(given: str | None, model_name: str | None, trust_remote_code: bool):
    """The tokenizer named by --tokenizer, else the model's; one line when neither loads (a tiny:* model has
    none, and generation needs a real one to decode: 'bytes' ids are not enough here)."""
    name = given or model_name
    if not name or (given is None and str(name).startswith(TINY_PREFIX)):
        raise ConfigError(f"tokenizer: {model_name or 'the loaded model'} comes without a tokenizer; pass one "
                          "(--tokenizer NAME_OR_PATH, or tokenizer= in Python: a hub id, a saved tokenizer directory "
                          "or a loaded tokenizer)")
    return load_tokenizer(name, trust_remote_code)


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
