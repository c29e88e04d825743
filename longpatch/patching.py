"""patch_model / unpatch_model: route chosen layers of a model to an attention method, and undo it."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import PatchConfig, as_config, check_runnable, select_layers
from .errors import ConfigError
from .families import Family, detect_family
from .methods import get_method
from .routing import LayerRoute, redraw_route, reset_stats

log = logging.getLogger("longpatch")

REPORT_ATTR = "longpatch"


@dataclass
class PatchReport:
    """What patch_model did; kept on the model as `model.longpatch`."""

    config: PatchConfig
    family: Family
    num_layers: int
    layers: list[int]
    routes: list[LayerRoute] = field(repr=False, default_factory=list)

    @property
    def method(self) -> str:
        return self.config.method

    def breakdown(self) -> dict:
        """Calls and seconds per side, phase and path: {side: {phase: {path: {"calls", "seconds"}}}}.

        Seconds are measured only inside ``with longpatch.timing(model):`` (0 otherwise).
        side: "patched" / "unpatched" layers; phase: "prefill" / "decode"; path: "method" (the
        approximation ran), "method_exact" (the method's code, exact at that length), "exact" (longpatch's
        exact fallback) or "original" (the model's own attention). Only what ran is listed. Methods that
        report their work add query-key products: "estimate_pairs" (a query-aware selection's estimate)
        and "attended_pairs" (what the executor attended), summed over query heads.
        """
        out: dict = {"patched": {}, "unpatched": {}}
        for r in self.routes:
            side = out["patched" if r.method is not None else "unpatched"]
            for (phase, path), n in r.calls.items():
                s = side.setdefault(phase, {}).setdefault(path, {"calls": 0, "seconds": 0.0})
                s["calls"] += n
                s["seconds"] += r.seconds[(phase, path)]
            for (phase, path, kind), n in r.work.items():
                s = side[phase][path]
                s[kind] = s.get(kind, 0) + int(n)  # a selection counts on the device (no sync per call)
        return out

    def stats(self) -> dict:
        """Totals per side and path over both phases: {side: {path: {"calls", "seconds"}}}.

        Here "method" counts every call the method's code served, also where it was exact at that
        length; breakdown() tells those apart and splits prefill from decode.
        """
        out: dict = {"patched": {}, "unpatched": {}}
        for side, phases in self.breakdown().items():
            for paths in phases.values():
                for path, s in paths.items():
                    key = "method" if path == "method_exact" else path
                    total = out[side].setdefault(key, {"calls": 0, "seconds": 0.0})
                    total["calls"] += s["calls"]
                    total["seconds"] += s["seconds"]
        return out

    def reset_stats(self) -> None:
        reset_stats(self.routes)

    def layer_work(self) -> dict[int, dict[str, int]]:
        """Per patched layer whose method counts its work, summed over its causal prefills:
        {layer: {"attended_pairs", "estimate_pairs", "dense_pairs"}} (query-key products summed over
        query heads; dense: what exact attention computes). ``attended_share`` divides them."""
        out: dict[int, dict[str, int]] = {}
        for r in self.routes:
            if r.method is None:
                continue
            sums: dict[str, int] = {}
            for (phase, _path, kind), n in r.work.items():
                if phase == "prefill":
                    sums[kind] = sums.get(kind, 0) + int(n)
            if sums.get("dense_pairs"):
                out[r.layer_idx] = sums
        return out

    def attended_share(self) -> dict[int, float]:
        """{layer: attended query-key products / exact attention's} over the prefills since the last
        reset, for the layers whose method counts its work (a query-aware selection's cost follows
        the text: where attention spreads the mass takes more blocks)."""
        return {i: w.get("attended_pairs", 0) / w["dense_pairs"] for i, w in self.layer_work().items()}

    def read_share(self) -> dict[int, float]:
        """{layer: keys its one-token steps listed / the keys of the cache they read from} over the decode steps
        since the last reset, for the layers whose method counts them (the query-aware selections' eager step:
        what it reads of the cache, beside its page bounds, 1 / decode_page of the cache's bytes)."""
        out = {}
        for r in self.routes:
            sums = {kind: int(n) for (phase, _path, kind), n in r.work.items() if phase == "decode"}
            if r.method is not None and sums.get("dense_keys"):
                out[r.layer_idx] = sums.get("step_keys", 0) / sums["dense_keys"]
        return out

    def rows(self) -> list[dict]:
        return [{"layer": r.layer_idx, "method": r.method.name, "params": dict(r.params)}
                for r in self.routes if r.method is not None]


def patch_model(model, cfg: "PatchConfig | dict | str | Path", *, timed: bool = False):
    """Patch `model` in place per `cfg` (PatchConfig, dict, YAML path or alias); returns the model.

    timed: time every attention call from the start (as ``timing(model)`` does for a block); the
    evaluations and benchmarks set it, a served model should not (each timed call syncs a GPU).

    Patching a model whose patch replaces some layers is an error: call unpatch_model first. A patch
    that replaces no layers (layers=0, the sweeps' baseline) is replaced by the new one.
    """
    cfg = as_config(cfg)
    check_runnable(None, [cfg])
    current = getattr(model, REPORT_ATTR, None)
    if current is not None and current.layers:
        raise ConfigError(f"model is already patched by longpatch ({len(current.layers)} layers run "
                          f"'{current.config.method}', see model.longpatch); call unpatch_model(model) first")
    if current is not None:  # a patch of no layers replaced nothing: the new patch takes its place
        unpatch_model(model)
    family = detect_family(model, cfg.family)
    n = family.num_layers(model)
    chosen = set(select_layers(cfg.layers, n))
    beyond = sorted(i for i in cfg.layer_params if i >= n)
    if beyond:
        raise ConfigError(f"layer_params: layer {beyond[0]} does not exist; allowed: 0-based indices below the "
                          f"model's {n} layers")
    unused = sorted(set(cfg.layer_params) - chosen)
    if unused:  # a config calibrated for all layers, run with fewer (--layers): said, not silently dropped
        log.warning("longpatch: layer_params of layers %s are not used: this patch does not replace them "
                    "(layers: %s)", ", ".join(map(str, unused)), cfg.layers)
    routes = build_routes(cfg, n, chosen, timed=timed)
    family.install(model, routes)
    setattr(model, REPORT_ATTR, PatchReport(cfg, family, n, sorted(chosen), routes))
    return model


def build_routes(cfg: PatchConfig, n: int, chosen: set[int] | None = None, *, timed: bool = False) -> list[LayerRoute]:
    """A LayerRoute per layer of a model of ``n`` layers: the config's method (and its per-layer params) in
    the ``chosen`` layers (default: the config's ``layers``), the model's own attention elsewhere. The
    same routes serve transformers' modules (``patch_model``) and vLLM's attention backend (serving/)."""
    chosen = set(select_layers(cfg.layers, n)) if chosen is None else chosen
    method = get_method(cfg.method)
    return [LayerRoute(layer_idx=i, method=method if i in chosen else None,
                       params=cfg.params_of(i) if i in chosen else {},
                       min_seq_len=cfg.min_seq_len, backend=cfg.backend, timed=timed) for i in range(n)]


def unpatch_model(model):
    """Restore the model's original attention exactly; a no-op on an unpatched model."""
    report: PatchReport | None = getattr(model, REPORT_ATTR, None)
    if report is None:
        return model
    report.family.uninstall(model, report.routes)
    delattr(model, REPORT_ATTR)
    return model


def redraw_buffers(model, seed: int | None = None) -> int:
    """Draw new random buffers in every patched layer whose method has seeded ones (HyperAttention's
    LSH directions, Performer's random features, the sparse method's random-block seed); returns how
    many layers were redrawn. In place: the buffers keep their device.

    seed None: a fresh draw from torch's global generator (reproducible under torch.manual_seed);
    an int: deterministic, each layer mixing in its index as at patch time. Decode states are
    cleared (they were built with the old buffers). Performer's paper redraws periodically in training.
    """
    report: PatchReport | None = getattr(model, REPORT_ATTR, None)
    if report is None:
        raise ValueError("redraw_buffers: the model is not patched by longpatch")
    base = int(torch.randint(0, 2 ** 62, (1,)).item()) if seed is None else int(seed)
    return sum(redraw_route(r, base) for r in report.routes)


def patched_layers(model) -> list[int]:
    """Sorted 0-based indices of the layers that run a longpatch method ([] when unpatched)."""
    report = getattr(model, REPORT_ATTR, None)
    return [] if report is None else list(report.layers)


@contextlib.contextmanager
def timing(model, on: bool = True):
    """``with timing(model): ...`` times every attention call of a patched model inside the block
    (``model.longpatch.breakdown()`` / ``stats()`` then report seconds per path), and restores the
    previous setting after it. Off by default: a timed call synchronises a GPU before and after it.
    Calls are counted either way."""
    report: PatchReport | None = getattr(model, REPORT_ATTR, None)
    if report is None:
        raise ValueError("timing: the model is not patched by longpatch")
    before = [r.timed for r in report.routes]
    for r in report.routes:
        r.timed = on
    try:
        yield report
    finally:
        for r, t in zip(report.routes, before):
            r.timed = t


@contextlib.contextmanager
def patched(model, cfg):
    """`with patched(model, cfg): ...` patches for the block and always restores afterwards."""
    patch_model(model, cfg)
    try:
        yield model
    finally:
        unpatch_model(model)


def total_seconds(tree) -> float:
    """Attention seconds in a stats() or breakdown() dict, or any part of one ({..: {"calls", "seconds"}}
    entries, or plain per-path seconds)."""
    if isinstance(tree, (int, float)):
        return float(tree)
    if "seconds" in tree and "calls" in tree:
        return float(tree["seconds"])
    return sum(total_seconds(v) for v in tree.values())
