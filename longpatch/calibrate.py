"""``longpatch calibrate``: each patched layer's params chosen on a calibration text.

The model runs exact attention over each calibration document. At every patched layer, that layer's
own queries, keys and values (exact attention upstream, so one layer's choice does not move the
next one's inputs) go to every candidate (the config's params changed by one combination of the
grid), and the candidate's output is compared with exact attention's. Per layer the chosen candidate
is the cheapest (query-key products, as the method counts its own work: its estimate's and the
attended ones) whose relative output error over all calibration tokens, ||o - o_exact|| / ||o_exact||,
is at most ``max_error`` (or, given as "1.2x", at most 1.2 times the error of the config's own params
in that layer); when none is, the most accurate one, said in the log. The result is the
config with ``layer_params``, which apply / eval / patch_model take as any config.

With a held-out text (``--holdout``, best of another kind than the calibration text), every
candidate also runs on its documents, and a candidate qualifies in a layer only when it is within
the limit on both texts (a relative limit: R times the config's own error on each). A budget that
is cheap on focused text (code) but drops what spread-out text (prose) reads is then refused,
which is how one text alone misleads (docs/configs.md).

Exact attention is a choice too (unless ``exact_layers`` is off): a layer where it costs fewer products
than every candidate within the limits, or where no candidate is within them, keeps the model's own
attention (it leaves the config's ``layers``). A layer whose attention spreads over most of the prompt
costs about as much sparse as dense, and loses quality sparse.

Only methods that count their work can be calibrated: MoBA and NSA under a query-aware selection
(estimate, antidiagonal, hybrid). Errors are accumulated per document in records.jsonl, so a rerun
with the same settings resumes where the last one stopped.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from .config import PatchConfig
from .errors import ConfigError, LongpatchError, shown
from .eval.records import interrupt_said
from .eval.sweep import loading_identity
from .methods import get_method
from .methods.common import dense_pairs
from .methods.exact import exact_attention
from .methods.selection import SCORINGS
from .outdir import owns_out
from .yamlio import load_yaml

log = logging.getLogger("longpatch")

MAX_CANDIDATES = 64  # each is one more attention call per layer and document
RECORDS = "records.jsonl"
CONFIG_OUT = "calibrated.yaml"
RESULT = "calibration.json"


def parse_grid(items: list[str], method: str) -> dict[str, list]:
    """--grid KEY=V1,V2 ... (or KEY=[V1, V2] in YAML) -> {param: [values]}, keys checked against the
    method's params. An empty list: no grid (the config's params only)."""
    known = get_method(method).params
    grid: dict[str, list] = {}
    for item in items:
        key, sep, raw = str(item).partition("=")
        key = key.strip()
        if not sep or not key or not raw.strip():
            raise ConfigError(f"--grid {shown(item)}: expected key=v1,v2,..., e.g. --grid topk=8,12,16")
        if key not in known:
            raise ConfigError(f"--grid {key}: not a param of method '{method}'; allowed: {', '.join(sorted(known))}")
        if key in grid:
            raise ConfigError(f"--grid {key}: given twice; allowed: each param once")
        try:  # read as --set reads its value (yamlio: aliases that expand past a config's size are refused)
            listed = raw.lstrip().startswith("[")
            values = (load_yaml(raw, f"--grid {key}") if listed
                      else [load_yaml(v, f"--grid {key}") for v in raw.split(",")])
        except yaml.YAMLError:
            raise ConfigError(f"--grid {shown(item)}: malformed value {shown(raw)}; allowed: v1,v2,... or a YAML "
                              "list") from None
        if not isinstance(values, list) or not values:
            raise ConfigError(f"--grid {shown(item)}: expected a non-empty list of values")
        grid[key] = values
    return grid


def candidates(cfg: PatchConfig, grid: dict[str, list]) -> list[dict]:
    """Every combination of the grid, as changes to cfg's params (the first: the config itself when
    the grid holds its values); each checked as a config of its own."""
    combos = [dict(zip(grid, values)) for values in itertools.product(*grid.values())] or [{}]
    if len(combos) > MAX_CANDIDATES:
        raise ConfigError(f"--grid: {len(combos)} combinations; allowed: at most {MAX_CANDIDATES}")
    out = []
    for c in combos:
        try:
            params = PatchConfig(method=cfg.method, params={**cfg.params, **c}).params
        except ConfigError as e:
            shown = ", ".join(f"{k}={v}" for k, v in c.items())
            raise ConfigError(f"--grid ({shown}): {e}") from None
        if params.get("selection") not in SCORINGS:
            raise ConfigError(f"calibrate: method '{cfg.method}' with selection={params.get('selection')!r} does not "
                              f"count its work; allowed: moba or nsa with selection {', '.join(SCORINGS)}")
        if c not in out:
            out.append(c)
    return out


@dataclass
class Tally:
    """Sums over the calibration tokens of one (layer, candidate)."""

    err2: float = 0.0  # sum of squared output errors
    ref2: float = 0.0  # sum of squared exact outputs
    pairs: int = 0  # query-key products (estimate + attended)

    def add(self, other: "Tally") -> None:
        self.err2 += other.err2
        self.ref2 += other.ref2
        self.pairs += other.pairs

    @property
    def error(self) -> float:
        return (self.err2 / self.ref2) ** 0.5 if self.ref2 > 0 else 0.0


@dataclass
class _Probe:
    """Stands in for a patched layer's bound method during a calibration pass: runs every candidate on
    the layer's inputs, tallies its error against exact attention, and returns exact attention's output."""

    cfg: PatchConfig
    layer: int
    cands: list[dict]
    tallies: list[Tally] = field(default_factory=list)
    on_layer: object = None  # called after each prefill (the progress bar)

    def exact_at(self, q_len: int, kv_len: int) -> bool:
        return False

    def __call__(self, q, k, v, *, causal=True, scale=None, backend="auto", state=None, buffers=None):
        exact = exact_attention(q, k, v, causal=causal, scale=scale, backend=backend)
        if q.shape[2] != k.shape[2]:
            return exact
        ref = exact.float()
        self.tallies = []
        method = get_method(self.cfg.method)
        for c in self.cands:
            bound = method.bind({**self.cfg.params, **c}, q.shape[-1], self.layer)
            st: dict = {}
            out = bound(q, k, v, causal=causal, scale=scale, backend=backend, state=st)
            work = st.get("work")
            # a candidate the method runs exactly at this length (e.g. a topk that covers every chunk)
            # reports no work: it costs dense attention's products, and its error is what it is
            pairs = int(sum(work.values())) if work else dense_pairs(q.shape, k.shape[2], causal)
            self.tallies.append(Tally(float(((out.float() - ref) ** 2).sum()), float((ref ** 2).sum()), pairs))
        if self.on_layer is not None:
            self.on_layer()
        return exact


def run_key(model_name: str, cfg: PatchConfig, cands: list[dict], seq_len: int, loaded: dict) -> str:
    """What a record must match to be resumed: everything that changes a tally. The same model (and its
    tokenizer, in model_name), base config, candidates and length, and how the model was loaded and runs
    (``loaded``: eval.sweep.loading_identity), since a bfloat16 run's errors are not a float32 run's."""
    text = json.dumps([model_name, cfg.method, cfg.params, cfg.layers, cfg.backend, cfg.min_seq_len, cfg.family,
                       cands, seq_len, loaded], sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def calibrate_documents(model, cfg: PatchConfig, docs: list, cands: list[dict], records: Path | None = None,
                        key: str = "", progress: bool = False) -> dict[int, list[Tally]]:
    """{layer: [Tally per candidate]} summed over docs (objects with .ids [n] and .digest); records:
    a JSONL file of per-document tallies, read to resume and appended to after each document."""
    from tqdm.auto import tqdm

    from .eval.ppl.scoring import final_hidden_states
    from .patching import patch_model, unpatch_model

    done: dict[str, dict] = {}
    if records is not None and records.exists():
        for line in records.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by an interrupted write
            if rec.get("key") == key:
                done[rec["digest"]] = rec["layers"]
    base = cfg.replace(layer_params={})
    patch_model(model, base)
    try:
        routes = [r for r in model.longpatch.routes if r.method is not None]
        todo = [d for d in docs if d.digest not in done]
        bar = tqdm(total=len(todo) * len(routes), desc="calibrating", unit="layer", disable=not progress)
        probes = {r.layer_idx: _Probe(base, r.layer_idx, cands, on_layer=lambda: bar.update(1)) for r in routes}
        for r in routes:
            r.bound = probes[r.layer_idx]
        device = next(model.parameters()).device
        for d in todo:
            with torch.no_grad():
                final_hidden_states(model, d.ids.view(1, -1).to(device))
            layers = {}
            for i, p in probes.items():
                if len(p.tallies) != len(cands):
                    raise LongpatchError(f"calibrate: layer {i} was not reached by a {len(d.ids)}-token prefill; "
                                         f"is --seq-len below the config's min_seq_len ({cfg.min_seq_len})?")
                layers[str(i)] = [[t.err2, t.ref2, t.pairs] for t in p.tallies]
                p.tallies = []
            done[d.digest] = layers
            if records is not None:
                with records.open("a") as f:
                    f.write(json.dumps({"key": key, "digest": d.digest, "layers": layers}) + "\n")
        bar.close()
    finally:
        unpatch_model(model)
    totals: dict[int, list[Tally]] = {}
    for d in docs:
        for layer, rows in done[d.digest].items():
            acc = totals.setdefault(int(layer), [Tally() for _ in cands])
            for t, row in zip(acc, rows):
                t.add(Tally(*row))
    return dict(sorted(totals.items()))


def _over(error: float, limit: float) -> float:
    """How far an error is over its limit, as a ratio (<= 1: within)."""
    if limit > 0:
        return error / limit
    return 0.0 if error <= 0 else math.inf


def layer_ppl(model, cfg: PatchConfig, docs: list, cands: list[dict], layers: list[int],
              records: Path | None = None, key: str = "", progress: bool = False) -> dict[int, list[float]]:
    """{layer: [relative perplexity increase per candidate]} over docs (pooled token NLL): each patched
    layer alone replaced by each candidate, every other layer exact, against the model with no layer
    replaced. Per-document NLL sums go to ``records`` (JSONL, key "ppl|<key>") and are resumed."""
    from tqdm.auto import tqdm

    from .eval.ppl.scoring import final_hidden_states, token_nll
    from .patching import patch_model, unpatch_model

    done: dict[str, dict] = {}
    tag = f"ppl|{key}"
    if records is not None and records.exists():
        for line in records.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("key") == tag:
                done[rec["digest"]] = rec
    device = next(model.parameters()).device
    todo = [d for d in docs if d.digest not in done]
    bar = tqdm(total=len(todo) * (1 + len(layers) * len(cands)), desc="perplexity", unit="forward",
               disable=not progress)

    def nll(ids) -> float:
        with torch.no_grad():
            hidden = final_hidden_states(model, ids)
            value = float(token_nll(model, hidden, ids).double().sum())
        bar.update(1)
        return value

    for d in todo:
        ids = d.ids.view(1, -1).to(device)
        rec = {"key": tag, "digest": d.digest, "tokens": int(ids.shape[1] - 1), "base": nll(ids), "layers": {}}
        for layer in layers:
            rec["layers"][str(layer)] = []
            for c in cands:
                patch_model(model, cfg.replace(layers=[layer], params={**cfg.params, **c}, layer_params={}))
                try:
                    rec["layers"][str(layer)].append(nll(ids))
                finally:
                    unpatch_model(model)
        done[d.digest] = rec
        if records is not None:
            with records.open("a") as f:
                f.write(json.dumps(rec) + "\n")
    bar.close()
    tokens = sum(done[d.digest]["tokens"] for d in docs)
    base = sum(done[d.digest]["base"] for d in docs)
    return {layer: [math.exp((sum(done[d.digest]["layers"][str(layer)][i] for d in docs) - base) / tokens) - 1
                    for i in range(len(cands))] for layer in layers}


def ppl_tallies(totals: dict[int, list[Tally]], increases: dict[int, list[float]]) -> dict[int, list[Tally]]:
    """Tallies whose error is a layer's perplexity increase (a decrease counts as 0) at the products of
    ``totals``: what ``choose`` and ``calibrated_config`` judge under --max-ppl-increase."""
    return {layer: [Tally(max(inc, 0.0) ** 2, 1.0, t.pairs) for inc, t in zip(increases[layer], totals[layer])]
            for layer in totals}


def choose(tallies: list[Tally], max_error: float, held: list[Tally] | None = None,
           held_limit: float | None = None) -> tuple[int, bool]:
    """(index of the chosen candidate, whether it meets the limits): the fewest pairs (on the calibration
    text) among those within max_error, and within held_limit on the held-out tallies ``held`` when given
    (ties: the smaller error), else the one least over its limits (on one text: the smallest error)."""
    def over(i: int) -> float:
        worst = _over(tallies[i].error, max_error)
        if held is not None:
            worst = max(worst, _over(held[i].error, max_error if held_limit is None else held_limit))
        return worst
    within = [i for i in range(len(tallies)) if over(i) <= 1]
    if within:
        return min(within, key=lambda i: (tallies[i].pairs, tallies[i].error)), True
    return min(range(len(tallies)), key=lambda i: (over(i), tallies[i].error)), False


def parse_max_error(value) -> tuple[float, bool]:
    """--max-error: a number E > 0 (each layer's relative output error at most E) or 'Rx' (at most R
    times the error of the config's own params in that layer) -> (E or R, relative)."""
    text = str(value).strip()
    relative = text.lower().endswith("x")
    try:
        number = float(text[:-1] if relative else text)
    except ValueError:
        number = math.nan
    if isinstance(value, bool) or not 0 < number < math.inf:
        raise ConfigError(f"--max-error: got {value!r}; allowed: a number > 0 (each layer's relative output error "
                          "||o - o_exact|| / ||o_exact||), or R x (e.g. 1.2x: R times the config's own error)")
    return number, relative


def own_index(cfg: PatchConfig, cands: list[dict]) -> int | None:
    """The candidate that is the config's own params, if the grid holds it."""
    own = [i for i, c in enumerate(cands) if all(cfg.params.get(k) == v for k, v in c.items())]
    return own[0] if own else None


def check_relative(cfg: PatchConfig, cands: list[dict], max_error: float, relative: bool) -> int | None:
    """own_index, refusing a relative --max-error when the grid lacks the config's own values."""
    own = own_index(cfg, cands)
    if relative and own is None:
        raise ConfigError(f"--max-error {max_error:g}x: relative to the config's own error, but --grid does not "
                          "hold the config's own values; allowed: a grid that includes them, or an absolute number")
    return own


EXACT = "exact"  # a layer's choice of keeping exact attention (the layer is not replaced)


def calibrated_config(cfg: PatchConfig, cands: list[dict], totals: dict[int, list[Tally]],
                      max_error: float, relative: bool = False,
                      held: dict[int, list[Tally]] | None = None,
                      exact_pairs: tuple[int, int] | None = None) -> tuple[PatchConfig, list[dict]]:
    """The config with each layer's chosen changes as layer_params (only those that differ from params),
    and one row per layer for the report. relative: each layer's limit is max_error times the error of
    the config's own params there (they must be a candidate). held: the same tallies on a held-out text,
    whose own limit a chosen candidate must meet too (the row's "held_out"). exact_pairs: (on the
    calibration text, on the held-out one) the products of exact attention in one layer; given, exact
    attention is one more choice (error 0 at that cost): a layer where it is the cheapest within the
    limits, or where no candidate is within them, is left out of the config's ``layers``."""
    own = check_relative(cfg, cands, max_error, relative)
    layer_params, rows, kept = {}, [], []
    options = cands + ([EXACT] if exact_pairs else [])
    for layer, tallies in totals.items():
        limit = max_error * tallies[own].error if relative else max_error
        other = None if held is None else held[layer]
        other_limit = None if other is None else (max_error * other[own].error if relative else max_error)
        if exact_pairs:
            tallies = [*tallies, Tally(0.0, 1.0, exact_pairs[0])]
            other = None if other is None else [*other, Tally(0.0, 1.0, exact_pairs[1])]
        i, ok = choose(tallies, limit, other, other_limit)
        if options[i] == EXACT:
            ok = True  # exact attention is within any limit
        else:
            kept.append(layer)
            changes = {k: v for k, v in cands[i].items() if cfg.params.get(k) != v}
            if changes:
                layer_params[layer] = changes
        if not ok:
            texts = "the calibration text" if other is None else "both texts"
            log.warning("longpatch: calibrate: layer %d: no candidate is within the error limit on %s; the one "
                        "least over it (error %.4f) is chosen", layer, texts, tallies[i].error)
        row = {"layer": layer, "chosen": options[i], "limit": limit, "meets_max_error": ok,
               "error": tallies[i].error, "pairs": tallies[i].pairs,
               "own": None if own is None else {"error": tallies[own].error, "pairs": tallies[own].pairs},
               "candidates": [{"params": c, "error": t.error, "pairs": t.pairs} for c, t in zip(cands, tallies)]}
        if other is not None:
            row["held_out"] = {
                "limit": other_limit, "error": other[i].error, "pairs": other[i].pairs,
                "own": None if own is None else {"error": other[own].error, "pairs": other[own].pairs},
                "candidates": [{"params": c, "error": t.error, "pairs": t.pairs} for c, t in zip(cands, other)]}
        rows.append(row)
    changes = {"layer_params": layer_params}
    if len(kept) < len(totals):
        changes["layers"] = kept
        log.warning("longpatch: calibrate: layer(s) %s keep exact attention (not replaced): cheaper than, or the "
                    "only choice within, the error limit", ", ".join(str(r["layer"]) for r in rows
                                                                     if r["chosen"] == EXACT))
    return cfg.replace(**changes), rows


@owns_out("out", "calibrate")  # one run at a time per --out (another refuses in one line)
def run_calibrate(model: str, *, config=None, method=None, layers=None, sets=(), grid=(), max_error=None,
                  max_ppl_increase: float | None = None,
                  data=None, subsets: str = "all", seq_len: int = 32768, max_docs: int = 2,
                  holdout=None, holdout_subsets: str = "all", exact_layers: bool = True,
                  out: str = "runs/calibrate", tokenizer=None, trust_remote_code: bool = False,
                  progress: bool = True) -> dict:
    """`longpatch calibrate`: choose the patched layers' params on a calibration text (the module doc) and
    write ``calibrated.yaml`` (a config) and ``calibration.json`` (every candidate's error and cost per
    layer) to ``out``; returns the calibration.json content. holdout: a second text (read as ``data``,
    its subsets ``holdout_subsets``, the same --max-docs) on which each chosen candidate must hold too.
    exact_layers: a layer may keep exact attention (``calibrated_config``'s exact_pairs).
    max_ppl_increase: instead of ``max_error`` (default 0.1), the most a layer may raise perplexity, in
    percent, when it alone is replaced by the candidate (``layer_ppl``: one more forward pass per layer,
    candidate and document); a candidate's cost is still its query-key products."""
    from .errors import check_int
    from .eval.longbench.data import load_longbench
    from .eval.ppl.plan import nothing_to_evaluate, plan_documents
    from .eval.ppl.scoring import make_encoder, vocab_size
    from .eval.sweep import eval_tokenizer
    from .loading import load_model
    from .options import MAX_TOKENS, MAX_VALUES
    from .outdir import check_out, claim_out, write_json
    from .specs import resolve

    if max_ppl_increase is not None:
        if max_error is not None:
            raise ConfigError("--max-error and --max-ppl-increase: both given; allowed: one of them (the target of "
                              "each layer: its output error, or the perplexity increase it causes alone)")
        if isinstance(max_ppl_increase, bool) or not 0 < float(max_ppl_increase) < math.inf:
            raise ConfigError(f"--max-ppl-increase: got {max_ppl_increase!r}; allowed: a number > 0 (percent: 1 is "
                              "+1% perplexity per layer)")
        limit, relative = float(max_ppl_increase) / 100, False
    else:
        limit, relative = parse_max_error("0.1" if max_error is None else max_error)
    check_int("--seq-len", seq_len, 2, MAX_TOKENS)
    check_int("--max-docs", max_docs, 1, MAX_VALUES)
    out_dir = check_out(out, "calibrate")
    spec = resolve(model, config, method, layers, sets, trust_remote_code=trust_remote_code, tokenizer=tokenizer)
    cfg = spec.patch
    cands = candidates(cfg, parse_grid(list(grid), cfg.method))
    check_relative(cfg, cands, limit, relative)  # before any loading
    if seq_len < cfg.min_seq_len:
        raise ConfigError(f"--seq-len: got {seq_len}, below the config's min_seq_len {cfg.min_seq_len} (the patched "
                          "layers would run exact attention); allowed: at least min_seq_len")
    lb = load_longbench(data, subsets)
    held_lb = None if holdout is None else load_longbench(holdout, holdout_subsets)
    loaded, loaded_tok = load_model(spec.load)
    name = spec.load.model
    vocab = vocab_size(loaded)
    tok = eval_tokenizer(tokenizer or spec.load.tokenizer, loaded_tok, loaded, name, trust_remote_code)
    encode, tok_id = make_encoder(tok, None, vocab, name)
    # per subset, as eval ppl's --max-docs: a directory of several subsets mixes kinds of text
    docs, counts, skipped = plan_documents(lb, encode, seq_len, vocab, max_docs, progress)
    if not docs:
        raise LongpatchError("calibrate: the calibration text is too short: " +
                             nothing_to_evaluate(lb, counts, skipped, seq_len))
    held_docs = []
    if held_lb is not None:
        held_docs, counts, skipped = plan_documents(held_lb, encode, seq_len, vocab, max_docs, progress)
        if not held_docs:
            raise LongpatchError("calibrate: the held-out text (--holdout) is too short: " +
                                 nothing_to_evaluate(held_lb, counts, skipped, seq_len))
        shared = {d.digest for d in docs} & {d.digest for d in held_docs}
        if shared:
            raise ConfigError(f"--holdout: {len(shared)} of its documents are calibration documents too; allowed: "
                              "a text the calibration does not read (best of another kind)")
    claim_out(out_dir, "calibrate")
    key = run_key(f"{name}|{tok_id}", cfg, cands, seq_len, loading_identity(spec.load, loaded))
    with interrupt_said(out_dir):  # the records of finished documents are kept: as the evaluations, say so
        totals = calibrate_documents(loaded, cfg, docs, cands, out_dir / RECORDS, key, progress)
        held = None
        if held_docs:  # records are per document, so both texts share the records file
            held = calibrate_documents(loaded, cfg, held_docs, cands, out_dir / RECORDS, key, progress)
        if max_ppl_increase is not None:  # judged by perplexity; the error tallies give the products
            layers_run = sorted(totals)
            totals = ppl_tallies(totals, layer_ppl(loaded, cfg, docs, cands, layers_run, out_dir / RECORDS, key,
                                                   progress))
            if held is not None:
                held = ppl_tallies(held, layer_ppl(loaded, cfg, held_docs, cands, layers_run, out_dir / RECORDS, key,
                                                   progress))
    dense = _heads(loaded) * seq_len * (seq_len + 1) // 2  # one causal layer, one document
    exact_pairs = len(docs) * dense
    chosen, rows = calibrated_config(cfg, cands, totals, limit, relative, held,
                                     (exact_pairs, len(held_docs) * dense) if exact_layers else None)
    result = {"model": name, "tokenizer": tok_id, "seq_len": seq_len,
              "metric": "error" if max_ppl_increase is None else "ppl_increase",
              "max_error": f"{limit:g}x" if relative else limit,
              "data": lb.source, "docs": [{"subset": d.subset, "doc_id": d.doc_id, "digest": d.digest} for d in docs],
              "config": cfg.to_dict(), "candidates": cands, "exact_pairs_per_layer": exact_pairs,
              "base_pairs": None if rows[0]["own"] is None else sum(r["own"]["pairs"] for r in rows),
              "chosen_pairs": sum(r["pairs"] for r in rows), "layers": rows, "calibrated": chosen.to_dict()}
    if held is not None:
        result["held_out"] = {"data": held_lb.source,
                              "docs": [{"subset": d.subset, "doc_id": d.doc_id, "digest": d.digest} for d in held_docs]}
    write_json(out_dir / RESULT, result)
    _write_config(out_dir / CONFIG_OUT, spec.load, chosen, result)
    return result


def _heads(model) -> int:
    c = getattr(model, "config", None)
    return int(getattr(c, "num_attention_heads", 0) or 0)


def _write_config(path: Path, load, cfg: PatchConfig, result: dict) -> None:
    """The calibrated config as YAML (atomic): the loading keys it was calibrated with and the patch, as
    `apply --save` writes them."""
    import os

    from .loading import saved_keys

    head = (f"# written by `longpatch calibrate`: {result['model']}, {len(result['docs'])} document(s) of "
            f"{result['seq_len']} tokens from {result['data']}, "
            + (f"--max-error {result['max_error']}" if result["metric"] == "error"
               else f"--max-ppl-increase {100 * result['max_error']:g}") + "\n"
            "# each layer's error and query-key products per candidate: calibration.json beside this file\n")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(head + yaml.safe_dump(saved_keys(load, cfg), sort_keys=False))
    os.replace(tmp, path)
