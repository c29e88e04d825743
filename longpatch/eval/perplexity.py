"""LongBench perplexity of patched models: the protocol of the HyperAttention paper (Han et al. 2023,
Sec. 4.1, Figure 3), with layer sweeps, timing, resumable output and several processes.

Protocol. For each LongBench document the context is tokenized (with the tokenizer's special
tokens, as `tokenizer(context)` gives them); documents with fewer than seq_len tokens are skipped
(and listed), the rest are truncated to exactly their first seq_len tokens and run one at a time
(batch 1). Every position but the last predicts the next token, so a document scores seq_len - 1
tokens. Losses are natural-log negative log-likelihoods computed in float32 from the final hidden
states, `loss_chunk` positions at a time through the LM head: [seq_len, vocab] logits never exist
at once.

Two numbers per group of documents, named so they cannot be confused:
  ppl           exp(sum of token NLLs / number of scored tokens): perplexity of the pooled tokens.
                Every document has the same length, so this is exp of the mean per-document NLL.
  ppl_doc_mean  mean over documents of exp(document's mean token NLL): the mean of per-document
                perplexities (the paper's released code also averages per-document values).
The reference code took 2 ** (natural-log NLL); we do not. For side-by-side reading of the paper's
figure only, results also carry `refcode_metric` = mean over documents of 2 ** (mean NLL in nats),
which is not a perplexity (see docs/evaluation.md).

Speed. Per document: forward wall time (to the final hidden states), the loss time, and from
`model.longpatch.stats()` the wall time spent inside attention, per path, for patched and for
unpatched layers. attention_speedup of a configuration = attention seconds of the 0-layer
configuration / attention seconds of this one, summed over the documents both have finished
(forward_speedup likewise with forward seconds).

Output, in `out`: plan.json (documents kept and skipped, configurations), records*.jsonl (one line
per finished document and configuration; re-running skips what is there), results.json,
results.csv and PNG plots (see summarize()).
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ..config import PatchConfig, load_config, parse_layer_items, select_layers
from ..errors import ConfigError, LongpatchError, UnsupportedModelError
from ..patching import patch_model, total_seconds, unpatch_model
from .longbench import CATEGORIES, LongBench, load_longbench, resolve_subsets

log = logging.getLogger("longpatch")

PLAN_FILE = "plan.json"
RESULTS_FILE = "results.json"
CSV_FILE = "results.csv"
PLOTS = {"ppl": "ppl_vs_layers.png", "speedup": "speedup_vs_layers.png", "categories": "ppl_by_category.png"}
WORKER_ENV = "LONGPATCH_EVAL_WORKER"  # set in the processes --num-processes spawns
_LAUNCHER_TIMEOUT = timedelta(days=7)  # ranks wait for the slowest one at the end; a 32k sweep takes hours


# ---- layer sweeps ----------------------------------------------------------------------------------

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
        raise ConfigError(f"--layers: got {spec!r}; allowed: N >= 0, 'all', a list N1,N2,... or start:end[:step] (end included)")
    return n


def _dedupe(items: list) -> list:
    out = []
    for x in items:
        if x not in out:
            out.append(x)
    return out


# ---- tokenizers ------------------------------------------------------------------------------------

class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255). Only for models with a vocabulary of at least 256 whose ids
    mean nothing in particular, such as the tiny:* test models; chosen with tokenizer='bytes'."""

    name_or_path = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def make_encoder(tokenizer, loaded, vocab: int, model_name: str, trust_remote_code: bool = False):
    """-> (encode(text) -> list[int], tokenizer id for the records)."""
    if isinstance(tokenizer, str) and tokenizer == "bytes":
        if vocab < 256:
            raise ConfigError(f"tokenizer: 'bytes' needs a vocabulary of at least 256 ids; {model_name} has {vocab}")
        return ByteTokenizer().encode, "bytes"
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise LongpatchError(f"tokenizer: cannot load {tokenizer!r}: {str(e).strip().splitlines()[0]}") from None
    elif tokenizer is not None:
        tok = tokenizer
    elif loaded is not None:
        tok = loaded
    else:
        raise ConfigError(f"tokenizer: {model_name} comes without a tokenizer; pass tokenizer=NAME_OR_PATH "
                          "(--tokenizer), or tokenizer='bytes' (UTF-8 bytes as ids; only for models with a "
                          "vocabulary of at least 256, such as the tiny:* test models)")
    if isinstance(tok, ByteTokenizer):
        return make_encoder("bytes", None, vocab, model_name)

    def encode(text: str) -> list[int]:
        try:  # verbose=False: no "sequence longer than the model maximum" warning per document
            return list(tok(text, add_special_tokens=True, verbose=False)["input_ids"])
        except TypeError:  # tokenizers that are not transformers tokenizers
            return list(tok.encode(text))

    return encode, str(getattr(tok, "name_or_path", "") or type(tok).__name__)


# ---- from the model to token losses ----------------------------------------------------------------

def _chatglm_layout(model) -> bool:
    t = getattr(model, "transformer", None)
    return t is not None and hasattr(t, "output_layer") and hasattr(t, "encoder")


def lm_head(model) -> torch.nn.Module:
    """The module that turns final hidden states into logits."""
    if _chatglm_layout(model):
        return model.transformer.output_layer
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise UnsupportedModelError(f"{type(model).__name__}: no LM head found (get_output_embeddings() is None); "
                                    "perplexity needs a causal LM")
    return head


def vocab_size(model) -> int:
    head = lm_head(model)
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


class _ReachedHead(Exception):
    pass


def final_hidden_states(model, input_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq, hidden]: what the model's LM head receives for input_ids [batch, seq].

    Works for transformers causal LMs and for the ChatGLM2 layout (remote code or the tiny stand-in,
    whose hidden states are [seq, batch, hidden] and are transposed here). The model runs its own
    forward (so patched attention, accelerate hooks and remote code all behave as usual); a pre-hook
    on the LM head records the head's input and stops the forward there, so no logits are computed.
    """
    head = lm_head(model)
    box: dict[str, torch.Tensor] = {}

    def grab(_module, args):
        box["hidden"] = args[0]
        raise _ReachedHead

    handle = head.register_forward_pre_hook(grab)
    try:
        model(input_ids=input_ids, use_cache=False)
    except _ReachedHead:
        pass
    finally:
        handle.remove()
    if "hidden" not in box:
        raise UnsupportedModelError(f"{type(model).__name__}: the forward pass never reached the LM head")
    hidden = box["hidden"]
    if _chatglm_layout(model):
        hidden = hidden.transpose(0, 1)
    if tuple(hidden.shape[:2]) != tuple(input_ids.shape):
        raise UnsupportedModelError(f"{type(model).__name__}: the LM head got hidden states of shape "
                                    f"{tuple(hidden.shape)} for input {tuple(input_ids.shape)}; expected one per token")
    return hidden


def _softcap(model) -> float | None:
    config = getattr(model, "config", None)
    return getattr(config, "final_logit_softcapping", None) or None


def _head_logits(model, head, hidden: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    cap = _softcap(model)
    return torch.tanh(logits / cap) * cap if cap else logits


def token_nll(model, hidden: torch.Tensor, input_ids: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """float32 natural-log NLL of tokens 1..s-1 of input_ids [1, s] given hidden [1, s, h], computed
    `chunk` positions at a time so at most [chunk, vocab] logits exist."""
    head = lm_head(model)
    positions = hidden.shape[1] - 1
    parts = []
    for i in range(0, positions, chunk):
        j = min(i + chunk, positions)
        logits = _head_logits(model, head, hidden[:, i:j])
        targets = input_ids[:, i + 1:j + 1].to(logits.device)
        parts.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"))
    return torch.cat([p.to(parts[0].device) for p in parts])


def model_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Full [b, s, vocab] logits from the model's own forward (HF output or ChatGLM2 tuple)."""
    out = model(input_ids=input_ids, use_cache=False)
    return (out.logits if hasattr(out, "logits") else out[0]).float()


def check_loss_path(model, n: int = 16) -> None:
    """Fail early when hidden states -> LM head does not reproduce the model's own logits (a model
    that post-processes logits in a way this module does not know would get wrong losses)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size(model), (1, n), generator=gen).to(_input_device(model))
    with torch.inference_mode():
        want = model_logits(model, ids)
        got = _head_logits(model, lm_head(model), final_hidden_states(model, ids)).to(want.device)
    tol = 1e-3 * max(1.0, float(want.abs().max()))
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-3, atol=tol):
        raise UnsupportedModelError(f"{type(model).__name__}: its logits are not LM-head(final hidden states); "
                                    "the chunked loss cannot reproduce them")


def _input_device(model) -> torch.device:
    return next(model.parameters()).device


def _sync() -> None:
    if torch.cuda.is_available():
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)


def evaluate_document(model, input_ids: torch.Tensor, chunk: int = 1024) -> dict:
    """One document [1, s] on the model as it is: NLL sum/mean over s-1 tokens and wall times."""
    with torch.inference_mode():
        _sync()
        t0 = time.perf_counter()
        hidden = final_hidden_states(model, input_ids)
        _sync()
        t1 = time.perf_counter()
        nll = token_nll(model, hidden, input_ids, chunk)
        total = float(nll.double().sum())
        _sync()
        t2 = time.perf_counter()
    n = int(nll.numel())
    return {"scored_tokens": n, "nll_sum": total, "nll_mean": total / n,
            "forward_seconds": t1 - t0, "loss_seconds": t2 - t1}


# ---- the plan: which documents, which configurations -----------------------------------------------

@dataclass
class Doc:
    subset: str
    category: str
    doc_id: str
    context_tokens: int
    ids: torch.Tensor = field(repr=False)  # int64 [seq_len]
    digest: str  # of the ids: a record only counts for the same tokens


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


def _digest(ids: torch.Tensor) -> str:
    return hashlib.sha1(ids.to(torch.int64).numpy().tobytes()).hexdigest()[:16]


def plan_documents(lb: LongBench, encode: Callable[[str], list[int]], seq_len: int, vocab: int,
                   max_docs: int | None = None, progress: bool = False):
    """-> (docs to evaluate, per-subset counts, skipped documents with reasons), deterministic."""
    from tqdm.auto import tqdm

    docs: list[Doc] = []
    counts: dict[str, dict] = {}
    skipped: list[dict] = []
    total = sum(len(v) for v in lb.records.values())
    bar = tqdm(total=total, desc="tokenizing", unit="doc", disable=not progress, leave=False)
    for subset, records in lb.records.items():
        c = counts[subset] = {"records": len(records), "kept": 0, "too_short": 0, "not_examined": 0}
        for rec in records:
            bar.update(1)
            if max_docs is not None and c["kept"] >= max_docs:
                c["not_examined"] += 1
                skipped.append({"subset": subset, "doc_id": rec.doc_id, "where": rec.where, "context_tokens": None,
                                "reason": "not_examined", "detail": f"max_docs={max_docs} documents already kept"})
                continue
            ids = encode(rec.context)
            if len(ids) < seq_len:
                c["too_short"] += 1
                skipped.append({"subset": subset, "doc_id": rec.doc_id, "where": rec.where, "context_tokens": len(ids),
                                "reason": "too_short", "detail": f"context has {len(ids)} tokens < seq_len {seq_len}"})
                continue
            t = torch.tensor(ids[:seq_len], dtype=torch.int64)
            top = int(t.max())
            if top >= vocab or int(t.min()) < 0:
                raise LongpatchError(f"{rec.where}: the tokenizer produced id {top}, outside the model's vocabulary "
                                     f"of {vocab}; tokenizer and model do not match")
            c["kept"] += 1
            docs.append(Doc(subset, lb.categories[subset], rec.doc_id, len(ids), t, _digest(t)))
    bar.close()
    return docs, counts, skipped


def _config_id(identity: dict, indices: list[int], cfg: PatchConfig) -> str:
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
        points.append(Point(point_cfg, n, indices, _config_id(identity, indices, cfg), label))
    return points


# ---- records ---------------------------------------------------------------------------------------

class RecordLog:
    """Append-only JSONL of finished documents; each line is flushed and fsync'ed when written."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a+b")
        self._f.seek(0)
        data = self._f.read()
        if data and not data.endswith(b"\n"):  # killed mid-write: drop the incomplete last line
            keep = data.rfind(b"\n") + 1
            self._f.truncate(keep)
            log.warning("longpatch: %s: dropped an incomplete last line (an interrupted write); that document "
                        "is evaluated again", path)

    def append(self, record: dict) -> None:
        self._f.write((json.dumps(record, sort_keys=True) + "\n").encode())
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def read_records(out: "str | Path") -> list[dict]:
    """Every record in out/records*.jsonl; unreadable lines (an interrupted write) are reported and ignored."""
    records = []
    for path in sorted(Path(out).glob("records*.jsonl")):
        bad = []
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    if not isinstance(rec, dict):
                        raise ValueError
                except ValueError:
                    bad.append(n)
                    continue
                records.append(rec)
        if bad:
            log.warning("longpatch: %s: ignored %d unreadable line(s) (%s), probably an interrupted write; "
                        "those documents are evaluated again", path, len(bad), ", ".join(map(str, bad[:5])))
    return records


def _record_index(records: list[dict]) -> dict[tuple, dict]:
    index: dict[tuple, dict] = {}
    for r in records:
        try:
            key = (r["config_id"], r["subset"], r["doc_id"], r["digest"])
        except KeyError:
            continue
        index.setdefault(key, r)
    return index


# ---- processes -------------------------------------------------------------------------------------

@dataclass
class _Dist:
    rank: int = 0
    world: int = 1
    mode: str = "single"  # single | spawned (by --num-processes) | launcher (accelerate launch / torchrun)
    state: Any = None

    def device(self) -> torch.device:
        if self.state is not None:
            return torch.device("cpu") if self.state.device.type == "cpu" else self.state.device
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", self.rank) or 0)
            return torch.device("cuda", local % torch.cuda.device_count())
        return torch.device("cpu")

    def barrier(self) -> None:
        if self.state is not None:
            self.state.wait_for_everyone()


def _distributed() -> _Dist:
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return _Dist()
    rank = int(os.environ.get("RANK", "0") or 0)
    if os.environ.get(WORKER_ENV):
        return _Dist(rank, world, "spawned")
    from accelerate import PartialState
    state = PartialState(cpu=not torch.cuda.is_available(), timeout=_LAUNCHER_TIMEOUT)
    return _Dist(state.process_index, state.num_processes, "launcher", state)


def _spawn(num_processes: int, kwargs: dict) -> dict:
    """Run the evaluation in num_processes local worker processes, then merge their records."""
    out = Path(kwargs["out"])
    out.mkdir(parents=True, exist_ok=True)
    threads = None if torch.cuda.is_available() else str(max(1, (os.cpu_count() or 1) // num_processes))
    procs = []
    for rank in range(num_processes):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(num_processes), LOCAL_RANK=str(rank), **{WORKER_ENV: "1"})
        if threads and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = threads
        cmd = [sys.executable, "-c", "from longpatch.eval.perplexity import _worker_main; _worker_main()", json.dumps(kwargs)]
        procs.append(subprocess.Popen(cmd, env=env))
    failed = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None or None not in codes:
                break
            time.sleep(0.2)
    finally:
        for p in procs:  # on a failure or Ctrl-C the others stop too; finished documents are kept
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait()
    if failed is not None:
        raise LongpatchError(f"eval worker {failed} of {num_processes} exited with code {procs[failed].returncode}; "
                             f"finished documents are kept in {out}; run the same command again to resume")
    return summarize(out)


def _worker_main() -> None:
    kwargs = json.loads(sys.argv[1])
    try:
        perplexity(**kwargs)
    except LongpatchError as e:
        print(f"longpatch: error (worker {os.environ.get('RANK')}): {e}", file=sys.stderr)
        sys.exit(2)


# ---- the evaluation --------------------------------------------------------------------------------

def perplexity(model, layers=None, *, config: "str | PatchConfig | None" = None, method: str | None = None,
               sets: Sequence[str] = (), subsets: "str | Sequence[str]" = "all", seq_len: int = 32768,
               max_docs: int | None = None, data: str | None = None, out: str = "runs/eval", tokenizer=None,
               device_map: str | None = None, num_processes: int = 1, strict: bool = False,
               trust_remote_code: bool = False, warmup: int = 1, loss_chunk: int = 1024,
               progress: bool = True, plots: bool = True, run_id: str | None = None) -> dict:
    """LongBench perplexity and attention time of `model` for each layer count of a sweep.

    model: a bundled alias, hub id, local path, saved patch dir or tiny:<family>, or an already
        loaded (unpatched) model object (then pass tokenizer; it is left unpatched afterwards).
    layers: see parse_layer_sweep ('20', '0,4,8', '0:28:4' with the end included, 'all'); None uses
        the config's layers. The model is loaded once and re-patched for each point.
    config / method / sets: the patch (YAML or alias / method name / 'key=value' overrides).
    subsets: 'all' or comma-separated subset or category names. max_docs: at most this many
        documents per subset (the first ones in file order that are long enough).
    data: None (hub data.zip), a path to data.zip, a directory of <subset>.jsonl, or parquet.
    tokenizer: None (the model's), a name or path, a tokenizer object, or 'bytes' (see ByteTokenizer).
    device_map: 'auto' spreads the model over this machine's GPUs with accelerate (one process).
    num_processes: > 1 spawns that many local workers that share the documents; under
        `accelerate launch` (or torchrun) the launched processes share them instead.
    strict: a malformed LongBench record is fatal instead of reported and skipped.
    warmup: untimed forward passes before the first timed document of each configuration.
    loss_chunk: positions per LM-head call. progress: a progress bar (rank 0). plots: write the PNGs.
    run_id: tags this invocation's records (default: a fresh id); speedups only pair records of one run.
    Returns the results dict also written to out/results.json ({} on ranks other than 0).
    Raises LongpatchError when no document can be evaluated; a failed call that finished no document
    removes the `out` directory it created.
    """
    out = Path(out)
    with _removed_on_failure(out, keep_if_existed=out.exists()):
        return _perplexity(model, layers, config=config, method=method, sets=sets, subsets=subsets, seq_len=seq_len,
                           max_docs=max_docs, data=data, out=out, tokenizer=tokenizer, device_map=device_map,
                           num_processes=num_processes, strict=strict, trust_remote_code=trust_remote_code,
                           warmup=warmup, loss_chunk=loss_chunk, progress=progress, plots=plots, run_id=run_id)


@contextlib.contextmanager
def _removed_on_failure(out: Path, keep_if_existed: bool):
    """A failed evaluation leaves no empty directory behind: remove `out` if this call created it and no
    document was finished into it (finished documents are kept: a re-run resumes from them)."""
    try:
        yield
    except BaseException:
        if not keep_if_existed and out.is_dir() and not any(f.stat().st_size for f in out.glob("records*.jsonl")):
            shutil.rmtree(out, ignore_errors=True)
        raise


def _perplexity(model, layers, *, config, method, sets, subsets, seq_len, max_docs, data, out: Path, tokenizer,
                device_map, num_processes, strict, trust_remote_code, warmup, loss_chunk, progress, plots,
                run_id) -> dict:
    _check_positive("seq_len", seq_len, 2)
    _check_positive("loss_chunk", loss_chunk, 1)
    _check_positive("num_processes", num_processes, 1)
    _check_positive("warmup", warmup, 0)
    if max_docs is not None:
        _check_positive("max_docs", max_docs, 1)
    sweep = parse_layer_sweep(layers)
    wanted = resolve_subsets(subsets, data)
    dist = _distributed()
    run_id = _shared_run_id(dist, run_id)
    if num_processes > 1:
        if dist.world > 1:
            raise ConfigError("num_processes: already running under a launcher with "
                              f"{dist.world} processes; pass num_processes=1 (the launcher's processes share the work)")
        if not isinstance(model, str) or not (tokenizer is None or isinstance(tokenizer, str)) or isinstance(config, PatchConfig):
            raise ConfigError("num_processes > 1 needs the model, tokenizer and config given by name or path "
                              "(each worker loads its own copy)")
        if device_map:
            raise ConfigError("device_map: spreads one process over all GPUs; with num_processes > 1 each worker takes one GPU")
        kwargs = dict(model=model, layers=layers, config=config, method=method, sets=list(sets), subsets=subsets,
                      seq_len=seq_len, max_docs=max_docs, data=data, out=str(out), tokenizer=tokenizer,
                      strict=strict, trust_remote_code=trust_remote_code, warmup=warmup, loss_chunk=loss_chunk,
                      progress=progress, plots=plots, run_id=run_id)
        return _spawn(num_processes, kwargs)
    if device_map and dist.world > 1:
        raise ConfigError("device_map: spreads one process over all GPUs; under a launcher each process takes one GPU")
    main = dist.rank == 0

    lb = load_longbench(data, subsets, strict=strict)
    if main:
        _report_problems(lb)
    cfg, model, loaded_tok, model_name = _prepare_model(model, config, method, sets, trust_remote_code,
                                                        device_map, dist)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None) or \
        getattr(getattr(model, "config", None), "seq_length", None)
    if main and isinstance(limit, int) and seq_len > limit:
        log.warning("longpatch: seq_len %d exceeds the %d positions %s was trained for", seq_len, limit, model_name)
    vocab = vocab_size(model)
    encode, tok_id = make_encoder(tokenizer, loaded_tok, vocab, model_name, trust_remote_code)
    check_loss_path(model)
    num_layers = _num_layers(model, cfg)
    identity = {"model": model_name, "dtype": cfg.dtype, "attn_implementation": cfg.attn_implementation,
                "seq_len": seq_len, "tokenizer": tok_id}
    points = make_points(cfg, sweep, num_layers, identity)
    baseline_id = _config_id(identity, [], cfg)
    docs, counts, skipped = plan_documents(lb, encode, seq_len, vocab, max_docs, progress and main)
    if not docs:
        raise LongpatchError(_nothing_to_evaluate(lb, counts, skipped, seq_len))
    if main:
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / PLAN_FILE, {
            "model": model_name, "tokenizer": tok_id, "seq_len": seq_len, "data": lb.source, "subsets": wanted,
            "max_docs": max_docs, "num_layers": num_layers, "baseline_id": baseline_id,
            "points": [p.describe() for p in points],
            "docs": [{"subset": d.subset, "category": d.category, "doc_id": d.doc_id, "digest": d.digest,
                      "context_tokens": d.context_tokens} for d in docs],
            "per_subset": counts, "skipped": skipped, "missing_subsets": lb.missing,
            "data_problems": [p.to_dict() for p in lb.problems]})
        if len(points) > 1 and not any(p.layers == 0 for p in points):
            log.warning("longpatch: the sweep has no 0-layer point; attention speedups need one (add 0 to --layers)")
    _run(model, points, docs[dist.rank::dist.world], out, dist, warmup, loss_chunk, progress and main, run_id)
    dist.barrier()
    if dist.mode == "spawned" or not main:
        return {}
    return summarize(out, plots=plots)


def _shared_run_id(dist: _Dist, run_id: str | None) -> str:
    """One id per invocation, the same in every process of it (spawned workers get it passed in)."""
    run_id = run_id or uuid.uuid4().hex[:12]
    if dist.mode == "launcher":
        from accelerate.utils import broadcast_object_list
        run_id = broadcast_object_list([run_id], from_process=0)[0]
    return run_id


def _nothing_to_evaluate(lb: LongBench, counts: dict, skipped: list[dict], seq_len: int) -> str:
    parts = [f"{sum(c['records'] for c in counts.values())} records read from {lb.source}"]
    if lb.problems:
        parts.append(f"{len(lb.problems)} malformed and skipped (first: {lb.problems[0]})")
    short = [s["context_tokens"] for s in skipped if s["reason"] == "too_short"]
    if short:
        parts.append(f"{len(short)} shorter than --seq-len {seq_len} tokens (the longest has {max(short)})")
    return "nothing to evaluate: " + "; ".join(parts)


def _check_positive(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}: got {value!r}; allowed: an int >= {minimum}")


def _report_problems(lb: LongBench) -> None:
    for p in lb.problems[:20]:
        log.warning("longpatch: skipped malformed LongBench record: %s", p)
    if len(lb.problems) > 20:
        log.warning("longpatch: ... and %d more malformed records (all listed in plan.json and results.json)",
                    len(lb.problems) - 20)
    if lb.missing:
        log.warning("longpatch: %s has no data for subset(s) %s", lb.source, ", ".join(lb.missing))


def _prepare_model(model, config, method, sets, trust_remote_code, device_map, dist):
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


def _num_layers(model, cfg: PatchConfig) -> int:
    patch_model(model, cfg.replace(layers=0))
    try:
        return model.longpatch.num_layers
    finally:
        unpatch_model(model)


def _run(model, points: list[Point], docs: list[Doc], out: Path, dist: _Dist, warmup: int, chunk: int,
         progress: bool, run_id: str) -> None:
    from tqdm.auto import tqdm

    writer = RecordLog(out / ("records.jsonl" if dist.world == 1 else f"records.rank{dist.rank}.jsonl"))
    done = _record_index(read_records(out))
    todo = [(p, [d for d in docs if (p.config_id, d.subset, d.doc_id, d.digest) not in done]) for p in points]
    total = sum(len(ds) for _, ds in todo)
    already = len(points) * len(docs) - total
    if already and progress:
        print(f"longpatch: resuming: {already} of {already + total} document evaluations already in {out}", file=sys.stderr)
    device = _input_device(model)
    bar = tqdm(total=total, desc="eval ppl", unit="doc", disable=not progress, dynamic_ncols=True)
    try:
        for point, pending in todo:
            if not pending:
                continue
            patch_model(model, point.cfg)
            try:
                bar.set_description(point.label)
                for _ in range(warmup):
                    evaluate_document(model, pending[0].ids[None].to(device), chunk)
                for doc in pending:
                    model.longpatch.reset_stats()
                    result = evaluate_document(model, doc.ids[None].to(device), chunk)
                    writer.append(_record(point, doc, result, model.longpatch.breakdown(), dist.rank, run_id))
                    bar.update(1)
                    bar.set_postfix(ppl=f"{math.exp(result['nll_mean']):.3f}" if math.isfinite(result["nll_mean"]) else "nan")
            finally:
                unpatch_model(model)
    except KeyboardInterrupt:
        log.warning("longpatch: interrupted; finished documents are saved in %s: run the same command again to resume", out)
        raise
    finally:
        bar.close()
        writer.close()


def _record(point: Point, doc: Doc, result: dict, breakdown: dict, rank: int, run_id: str) -> dict:
    return {"config_id": point.config_id, "label": point.label, "layers": point.layers,
            "subset": doc.subset, "category": doc.category, "doc_id": doc.doc_id, "digest": doc.digest,
            "tokens": int(doc.ids.numel()), **result,
            "attention": breakdown, "attention_seconds": total_seconds(breakdown), "run_id": run_id,
            "tokens_per_second": doc.ids.numel() / result["forward_seconds"] if result["forward_seconds"] > 0 else None,
            "rank": rank, "finished": datetime.now(timezone.utc).isoformat(timespec="seconds")}


# ---- results ---------------------------------------------------------------------------------------

def summarize(out: "str | Path", plots: bool = True) -> dict:
    """Merge plan.json and every records*.jsonl in `out` into results.json, results.csv and plots.

    Sums are exact (math.fsum) and taken in plan order, so the numbers do not depend on how many
    processes evaluated the documents or in which order they finished.
    """
    out = Path(out)
    try:
        plan = json.loads((out / PLAN_FILE).read_text())
    except (OSError, ValueError) as e:
        raise LongpatchError(f"{out / PLAN_FILE}: cannot read the evaluation plan ({e}); run the evaluation first") from None
    index = _record_index(read_records(out))
    docs = plan["docs"]

    def recs_for(config_id):
        return {(d["subset"], d["doc_id"]): index[k] for d in docs
                if (k := (config_id, d["subset"], d["doc_id"], d["digest"])) in index}

    baseline = recs_for(plan["baseline_id"])
    scopes = {"all": [(d["subset"], d["doc_id"]) for d in docs]}
    for c in CATEGORIES:
        scopes[f"category:{c}"] = [(d["subset"], d["doc_id"]) for d in docs if d["category"] == c]
    for s in plan["subsets"]:
        scopes[f"subset:{s}"] = [(d["subset"], d["doc_id"]) for d in docs if d["subset"] == s]
    configs = []
    for point in plan["points"]:
        mine = recs_for(point["config_id"])
        groups = {scope: _group_stats([mine[k] for k in keys if k in mine], len(keys),
                                      {k: baseline[k] for k in keys if k in baseline})
                  for scope, keys in scopes.items() if keys or scope == "all"}
        configs.append({**point, "all": groups.pop("all"),
                        "categories": {k.split(":", 1)[1]: v for k, v in groups.items() if k.startswith("category:")},
                        "subsets": {k.split(":", 1)[1]: v for k, v in groups.items() if k.startswith("subset:")}})
    skipped_reasons: dict[str, int] = {}
    for s in plan["skipped"]:
        skipped_reasons[s["reason"]] = skipped_reasons.get(s["reason"], 0) + 1
    results = {
        "model": plan["model"], "tokenizer": plan["tokenizer"], "seq_len": plan["seq_len"], "data": plan["data"],
        "num_layers": plan["num_layers"], "max_docs": plan["max_docs"],
        "definitions": {
            "ppl": "exp(sum of token NLLs / scored tokens), natural log, pooled over the group's documents",
            "ppl_doc_mean": "mean over documents of exp(document mean token NLL): mean of per-document perplexities",
            "refcode_metric": "mean over documents of 2**(document mean NLL in nats): what the HyperAttention "
                              "reference code printed; NOT a perplexity, only for comparison with the paper",
            "scored_tokens": "seq_len - 1 per document (every position but the last predicts the next token)",
            "attention_seconds": "wall time inside attention calls of all layers (model.longpatch.stats())",
            "attention_speedup": "attention_seconds of the 0-layer configuration / this configuration's, over "
                                 "the documents both finished in the same run (forward_speedup: same with "
                                 "forward_seconds)",
            "attention_seconds_by_path": "{side: {phase: {path: seconds}}}; side patched/unpatched layers, phase "
                                         "prefill/decode, path method / method_exact (the method's code, exact at "
                                         "that length) / exact (fallback) / original (the model's own attention)",
        },
        "documents": {"kept": len(docs), "skipped": skipped_reasons, "malformed": len(plan["data_problems"]),
                      "per_subset": plan["per_subset"],
                      "missing_subsets": plan["missing_subsets"], "skipped_list": plan["skipped"]},
        "data_problems": plan["data_problems"],
        "configs": configs,
        "files": {"results": RESULTS_FILE, "csv": CSV_FILE},
    }
    if plots:
        results["files"]["plots"] = _plots(results, out)
    _write_csv(results, out / CSV_FILE)
    _write_json(out / RESULTS_FILE, results)
    return results


def _group_stats(recs: list[dict], planned: int, base: dict) -> dict:
    finite = [r for r in recs if math.isfinite(r["nll_sum"])]
    tokens = sum(r["scored_tokens"] for r in finite)
    nll = math.fsum(r["nll_sum"] for r in finite)
    n = len(finite)
    by_path: dict[str, dict[str, dict[str, float]]] = {}
    for r in recs:
        for side, phases in r["attention"].items():
            for phase, paths in phases.items():
                for path, s in paths.items():
                    into = by_path.setdefault(side, {}).setdefault(phase, {})
                    into[path] = into.get(path, 0.0) + s["seconds"]
    forward = math.fsum(r["forward_seconds"] for r in recs)
    attention = math.fsum(r["attention_seconds"] for r in recs)
    # timings of one run only: a reused --out may hold a baseline measured earlier, under another load
    common = [r for r in recs if (k := (r["subset"], r["doc_id"])) in base
              and r.get("run_id") is not None and base[k].get("run_id") == r["run_id"]]
    base_attn = math.fsum(base[(r["subset"], r["doc_id"])]["attention_seconds"] for r in common)
    base_fwd = math.fsum(base[(r["subset"], r["doc_id"])]["forward_seconds"] for r in common)
    this_attn = math.fsum(r["attention_seconds"] for r in common)
    this_fwd = math.fsum(r["forward_seconds"] for r in common)
    return {
        "docs": len(recs), "docs_planned": planned, "complete": len(recs) == planned,
        "nonfinite_docs": len(recs) - n, "scored_tokens": tokens,
        "nll_mean": nll / tokens if tokens else None,
        "ppl": math.exp(nll / tokens) if tokens else None,
        "ppl_doc_mean": math.fsum(math.exp(r["nll_mean"]) for r in finite) / n if n else None,
        "refcode_metric": math.fsum(2.0 ** r["nll_mean"] for r in finite) / n if n else None,
        "forward_seconds": forward, "loss_seconds": math.fsum(r["loss_seconds"] for r in recs),
        "tokens_per_second": sum(r["tokens"] for r in recs) / forward if forward > 0 else None,
        "attention_seconds": attention,
        "attention_seconds_by_path": by_path,
        "attention_speedup": base_attn / this_attn if common and this_attn > 0 else None,
        "forward_speedup": base_fwd / this_fwd if common and this_fwd > 0 else None,
        "speedup_docs": len(common),
    }


_CSV_COLUMNS = ("config_id", "label", "method", "layers", "scope", "name", "docs", "docs_planned", "scored_tokens",
                "ppl", "ppl_doc_mean", "nll_mean", "forward_seconds", "attention_seconds", "patched_attention_seconds",
                "unpatched_attention_seconds", "tokens_per_second", "attention_speedup", "forward_speedup",
                "nonfinite_docs", "refcode_metric")


def _write_csv(results: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(_CSV_COLUMNS)
        for c in results["configs"]:
            rows = [("all", "all", c["all"])] + [("category", k, v) for k, v in c["categories"].items()] \
                + [("subset", k, v) for k, v in c["subsets"].items()]
            for scope, name, s in rows:
                by_path = s["attention_seconds_by_path"]
                row = {**s, "config_id": c["config_id"], "label": c["label"], "method": c["method"] or "",
                       "layers": c["layers"], "scope": scope, "name": name,
                       "patched_attention_seconds": total_seconds(by_path.get("patched", {})),
                       "unpatched_attention_seconds": total_seconds(by_path.get("unpatched", {}))}
                w.writerow(["" if row.get(k) is None else row[k] for k in _CSV_COLUMNS])
    os.replace(tmp, path)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False, allow_nan=False, default=_json_default) + "\n")
    os.replace(tmp, path)


def _json_default(x):
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def _plots(results: dict, out: Path) -> list[str]:
    """ppl and speedup against the number of replaced layers (the paper's Figure 3), and ppl per category."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    configs = sorted((c for c in results["configs"] if c["all"]["ppl"] is not None), key=lambda c: c["layers"])
    written = []
    if not configs:
        return written
    title = f"{results['model']}, LongBench, {results['seq_len']} tokens"
    xs = [c["layers"] for c in configs]

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    ax.plot(xs, [c["all"]["ppl"] for c in configs], "o-", label="ppl (pooled tokens)")
    ax.plot(xs, [c["all"]["ppl_doc_mean"] for c in configs], "s--", label="ppl_doc_mean (mean of per-doc ppl)")
    ax.set(xlabel="number of replaced final layers", ylabel="perplexity", title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(), ax.grid(alpha=0.3)
    _save(fig, FigureCanvasAgg, out / PLOTS["ppl"], written)

    speed = [c for c in configs if c["all"]["attention_speedup"] is not None]
    if speed:
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        ax.plot([c["layers"] for c in speed], [c["all"]["attention_speedup"] for c in speed], "o-", label="attention")
        ax.plot([c["layers"] for c in speed], [c["all"]["forward_speedup"] for c in speed], "s--", label="whole forward")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xlabel="number of replaced final layers", ylabel="speedup vs 0 layers", title=title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(), ax.grid(alpha=0.3)
        _save(fig, FigureCanvasAgg, out / PLOTS["speedup"], written)

    cats = [k for k in CATEGORIES if any(k in c["categories"] and c["categories"][k]["ppl"] for c in configs)]
    if cats:
        fig = Figure(figsize=(max(6, 1.2 * len(cats) * max(1, len(configs)) / 2), 4))
        ax = fig.add_subplot()
        width = 0.8 / len(configs)
        top = 0.0
        for i, c in enumerate(configs):
            vals = [(c["categories"].get(k) or {}).get("ppl") or 0.0 for k in cats]
            top = max(top, *vals)
            ax.bar([j + i * width for j in range(len(cats))], vals, width, label=c["label"])
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=20)
        ax.set(ylabel="perplexity (pooled tokens)", title=title, ylim=(0, top * 1.3))
        ax.legend(fontsize="small", ncols=min(4, len(configs)), loc="upper center")
        _save(fig, FigureCanvasAgg, out / PLOTS["categories"], written)
    return written


def _save(fig, canvas_cls, path: Path, written: list[str]) -> None:
    canvas_cls(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    written.append(path.name)


# ---- the CLI entry point ---------------------------------------------------------------------------

def run_eval_ppl(model: str, config: str | None, method: str | None, layers: str | None, subsets: str = "all",
                 seq_len: int = 32768, max_docs: int | None = None, data: str | None = None,
                 out: str = "runs/eval", sets: Sequence[str] = (), device_map: str | None = None,
                 num_processes: int = 1, strict: bool = False, trust_remote_code: bool = False,
                 tokenizer: str | None = None, warmup: int = 1, loss_chunk: int = 1024,
                 progress: bool = True) -> dict:
    """`longpatch eval ppl`: run perplexity() and print a table of the results (rank 0 only)."""
    results = perplexity(model, layers, config=config, method=method, sets=sets, subsets=subsets, seq_len=seq_len,
                         max_docs=max_docs, data=data, out=out, tokenizer=tokenizer, device_map=device_map,
                         num_processes=num_processes, strict=strict, trust_remote_code=trust_remote_code,
                         warmup=warmup, loss_chunk=loss_chunk, progress=progress)
    if results:
        print_results(results, out)
    return results


def print_results(results: dict, out: "str | Path") -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    docs = results["documents"]
    t = Table(title=f"{results['model']}: LongBench perplexity at {results['seq_len']} tokens, "
                    f"{docs['kept']} documents ({sum(docs['skipped'].values())} skipped)",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("config", "layers", "docs", "ppl", "doc-mean", "fwd s", "attn s", "speedup", "tok/s"):
        t.add_column(col, justify="left" if col == "config" else "right")
    for c in results["configs"]:
        a = c["all"]
        t.add_row(c["label"], str(c["layers"]), f"{a['docs']}/{a['docs_planned']}", _fmt(a["ppl"]), _fmt(a["ppl_doc_mean"]),
                  _fmt(a["forward_seconds"], 2), _fmt(a["attention_seconds"], 2),
                  "-" if a["attention_speedup"] is None else f"{a['attention_speedup']:.2f}x", _fmt(a["tokens_per_second"], 0))
    console = Console(emoji=False, highlight=False)
    console.print(t, markup=False)
    if results["data_problems"]:
        console.print(f"{len(results['data_problems'])} malformed LongBench record(s) skipped; see results.json",
                      style="yellow", markup=False)
    console.print("ppl = exp(pooled token NLL); doc-mean = mean of per-document perplexities; speedup = "
                  "attention seconds at 0 layers / attention seconds. Written to "
                  f"{out}: {', '.join([RESULTS_FILE, CSV_FILE, *results['files'].get('plots', [])])}", markup=False)


def _fmt(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"
