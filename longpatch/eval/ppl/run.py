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

Chunked prefill (prefill_chunk, --prefill-chunk N): each document goes through the model N tokens at a
time against the KV cache, each chunk at its own positions, and the final hidden states of all the
chunks are scored together as above: every position's logits are used as one forward's would be (the
last position of a chunk predicts the next chunk's first token), so for exact attention the loss is
the one-shot loss up to float rounding; a patched layer runs its method on each chunk against the cache.
The chunk size is in plan.json, results.json and every record; runs with another chunk size (or none)
have other config ids, so a rerun in the same `out` never mixes their records.

Decode perplexity (decode_tokens, --decode-tokens N): teacher forcing through the decode path. Each
document's first seq_len - N tokens are prefilled (in one forward, or in prefill_chunk chunks), then its
last N tokens are fed one at a time through the KV cache (one-token forwards: the decode step that
patched layers take in generation), and only those N tokens are scored (the prefill's last position
predicts the first, each step the next): a document scores N tokens. Every configuration, the unpatched
one too, runs the same way, so the comparison is like for like; N is in plan.json, results.json, every
record and the config ids, as the chunk size is.

Speed. Per document: forward wall time (to the final hidden states), the loss time, and from
`model.longpatch.stats()` the wall time spent inside attention, per path, for patched and for
unpatched layers. attention_speedup of a configuration = attention seconds of the 0-layer
configuration / attention seconds of this one, summed over the documents both have finished
(forward_speedup likewise with forward seconds).

Output, in `out`: plan.json (documents kept and skipped, configurations), records*.jsonl (one line
per finished document and configuration; re-running skips what is there), results.json,
results.csv and PNG plots (see report.summarize()).

This module holds the spec (PerplexitySpec) and the loop; the pieces live beside it: sweep (model,
configurations, layer counts), scoring (token losses), plan (documents), launch (processes),
records (records*.jsonl), report (results and plots).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ...config import check_prefill_chunk
from ...errors import ConfigError, LongpatchError, check_int
from ...options import MAX_TOKENS
from ...outdir import claim_out, write_json
from ...patching import total_seconds
from ...quantized import check_format
from ..launch import Dist, run_sequence_parallel, run_sharded
from ..longbench.data import load_longbench, report_problems, resolve_subsets
from ..records import PLAN_FILE, RecordLog, announce_resume, read_records, records_file
from ..sweep import (
    Point,
    RunSpec,
    config_id,
    eval_tokenizer,
    input_device,
    labelled_points,
    loading_identity,
    model_dtype,
    num_layers,
    prepare,
    resolve_spec,
    run_points,
)
from .plan import Doc, nothing_to_evaluate, plan_documents
from .report import print_results, record_index, summarize
from .scoring import (
    check_configs_chunk,
    check_loss_path,
    evaluate_document,
    make_encoder,
    prefill_shapes,
    vocab_size,
)

__all__ = ["PerplexitySpec", "perplexity", "run_eval_ppl", "summarize"]

log = logging.getLogger("longpatch")


@dataclass
class PerplexitySpec(RunSpec):
    """Everything `eval ppl` takes besides the model (RunSpec: patch, sweep, out, processes).

    subsets: 'all' or comma-separated subset or category names. seq_len: tokens per document.
    max_docs: at most this many documents per subset (the first ones in file order that are long enough).
    data: None (hub data.zip), a path to data.zip, a directory of <subset>.jsonl, parquet, or 'demo'.
    tokenizer: as RunSpec, or 'bytes' (loading.ByteTokenizer). device_map: 'auto' spreads the model over
    this machine's GPUs with accelerate (one process). strict: a malformed LongBench record is fatal
    instead of reported and skipped. warmup: untimed forward passes before the first timed document of
    each configuration. loss_chunk: positions per LM-head call. sequence_parallel: N > 1 splits every
    document over N processes (longpatch.parallel, docs/distributed.md); not with num_processes.
    prefill_chunk: each document fed through the KV cache this many tokens at a time (None: one forward);
    a multiple of every config's method block (config.check_prefill_chunk); not with sequence_parallel.
    cache: "int8" or "fp8": each document goes through an 8-bit KV cache (quantized.QuantizedCache), in one
    chunk without prefill_chunk, so every attention call reads the 8-bit keys and values; not with
    sequence_parallel. None: the full-precision forward (through a full-precision cache when chunked).
    decode_tokens: the last that many tokens of each document fed one at a time through the KV cache after
    a prefill of the others, and only they scored (decode perplexity); in [1, seq_len - 1]; not with
    sequence_parallel. None: every position scored from the prefill.
    """

    COMMAND = "eval ppl"
    subsets: object = "all"
    seq_len: int = 32768
    max_docs: int | None = None
    data: str | None = None
    device_map: str | None = None
    strict: bool = False
    warmup: int = 1
    loss_chunk: int = 1024
    sequence_parallel: int = 1
    prefill_chunk: int | None = None
    cache: str | None = None
    decode_tokens: int | None = None

    def __post_init__(self):
        super().__post_init__()
        check_int("--seq-len", self.seq_len, 2, MAX_TOKENS)
        if self.device_map not in (None, "auto"):  # before loading, named by its flag (LoadSpec says device_map)
            raise ConfigError(f"--device-map: got {self.device_map!r}; allowed: auto")
        check_int("--sequence-parallel", self.sequence_parallel, 1)
        if self.sequence_parallel > 1 and self.num_processes > 1:
            raise ConfigError(f"--sequence-parallel {self.sequence_parallel} cannot be combined with --num-processes "
                              f"{self.num_processes}: both use the processes; use one of them")
        if self.sequence_parallel > 1 and self.device_map:
            raise ConfigError("--device-map: one process over all GPUs; with --sequence-parallel each process takes "
                              "one")
        check_int("--loss-chunk", self.loss_chunk, 1)
        check_prefill_chunk(None, self.prefill_chunk)  # an int >= 1; each config's multiple: perplexity()
        if self.prefill_chunk is not None and self.sequence_parallel > 1:
            raise ConfigError(f"--prefill-chunk {self.prefill_chunk} cannot be combined with --sequence-parallel "
                              f"{self.sequence_parallel}: each process holds a slice of the document, not its "
                              "prefix; use one of them")
        if self.cache is not None:
            check_format(self.cache)
            if self.sequence_parallel > 1:
                raise ConfigError(f"--cache {self.cache} cannot be combined with --sequence-parallel "
                                  f"{self.sequence_parallel}: each process holds a slice of the document, not a cache")
        if self.decode_tokens is not None:
            check_int("--decode-tokens", self.decode_tokens, 1)
            if self.decode_tokens >= self.seq_len:
                raise ConfigError(f"--decode-tokens: got {self.decode_tokens}; allowed: an int in [1, "
                                  f"{self.seq_len - 1}] (below --seq-len {self.seq_len}: at least one token is "
                                  "prefilled)")
            if self.sequence_parallel > 1:
                raise ConfigError(f"--decode-tokens {self.decode_tokens} cannot be combined with --sequence-parallel "
                                  f"{self.sequence_parallel}: each process holds a slice of the document, not the "
                                  "cache a decode step reads; use one of them")
        check_int("--warmup", self.warmup, 0)
        if self.max_docs is not None:
            check_int("--max-docs", self.max_docs, 1)
        if self.device_map and self.num_processes > 1:
            raise ConfigError("--device-map: spreads one process over all GPUs; with --num-processes > 1 each worker "
                              "takes one GPU")


def perplexity(model, layer_counts=None, *, spec: PerplexitySpec | None = None, **options) -> dict:
    """LongBench perplexity and attention time of `model` for each layer count of a sweep.

    model: a bundled alias, hub id, local path, saved patch dir or tiny:<family>, or an already
        loaded (unpatched) model object (then pass tokenizer; it is left unpatched afterwards).
    layer_counts: the sweep of counts of final layers ('20', '0,4,8', '0:28:4' with the end included,
        'all'); None: each config's layers (or layers=, the same for every config). The model is loaded
        once and re-patched for each point.
    options: the fields of PerplexitySpec (layers, config (one or a list, each getting the whole sweep),
        method, sets, subsets, seq_len, max_docs, data, out,
        tokenizer, device_map, num_processes, sequence_parallel, strict, trust_remote_code, warmup, loss_chunk,
        prefill_chunk, cache, decode_tokens, progress, plots, run_id), or spec= one PerplexitySpec.
    Returns the results dict also written to out/results.json ({} on ranks other than 0).
    Raises LongpatchError when no document can be evaluated; a failed call that finished no document
    removes the `out` directory it created.
    """
    spec = resolve_spec(PerplexitySpec, "perplexity", spec, layer_counts, options)
    check_configs_chunk(spec, model)
    run = run_sequence_parallel if spec.sequence_parallel > 1 else run_sharded
    return run(spec, model, "longpatch.eval.ppl.run:perplexity",
               lambda dist, run_id: _evaluate(model, spec, dist, run_id),
               lambda: summarize(spec.out, plots=spec.plots))


def _evaluate(model, spec: PerplexitySpec, dist: Dist, run_id: str) -> dict:
    out = Path(spec.out)
    if spec.device_map and dist.world > 1:
        raise ConfigError("--device-map: spreads one process over all GPUs; under a launcher each process takes one "
                          "GPU")
    wanted = resolve_subsets(spec.subsets, spec.data)
    lb = load_longbench(spec.data, spec.subsets, strict=spec.strict)
    if dist.main:
        report_problems(lb)
    prep = prepare(model, spec, dist, spec.device_map)
    model, loaded_tok, model_name, cfg = prep.model, prep.tokenizer, prep.name, prep.patches[0][1]
    mc = getattr(model, "config", None)
    limit = getattr(mc, "max_position_embeddings", None) or getattr(mc, "seq_length", None)
    if dist.main and isinstance(limit, int) and spec.seq_len > limit:
        log.warning("longpatch: seq_len %d exceeds the %d positions %s was trained for", spec.seq_len, limit,
                    model_name)
    vocab = vocab_size(model)
    tok = eval_tokenizer(spec.tokenizer or prep.load.tokenizer, loaded_tok, model, model_name, spec.trust_remote_code)
    encode, tok_id = make_encoder(tok, None, vocab, model_name)
    check_loss_path(model)
    n_layers = num_layers(model, cfg)
    identity = {"model": model_name, "seq_len": spec.seq_len, "tokenizer": tok_id}
    if spec.prefill_chunk is not None:  # chunked runs get their own config ids (one-shot ids stay what they were)
        identity["prefill_chunk"] = spec.prefill_chunk
    if spec.cache is not None:  # likewise runs through an 8-bit cache
        identity["cache"] = spec.cache
        check_format(spec.cache, input_device(model))
    if spec.decode_tokens is not None:  # likewise decode-perplexity runs (they score other tokens)
        identity["decode_tokens"] = spec.decode_tokens
    labelled = labelled_points(prep, spec, n_layers, identity)
    points = [p for _, p in labelled]
    if len(prep.patches) > 1:  # several configs: the table and plots tell their points apart by config
        for p in points:
            p.label = f"{p.config} {p.label}" if p.layers else p.label
    docs, counts, skipped = plan_documents(lb, encode, spec.seq_len, vocab, spec.max_docs, spec.progress and dist.main)
    if not docs:
        raise LongpatchError(nothing_to_evaluate(lb, counts, skipped, spec.seq_len))
    if dist.main:
        claim_out(out, spec.COMMAND)
        write_json(out / PLAN_FILE, {
            "model": model_name, "dtype": model_dtype(model), "tokenizer": tok_id, "seq_len": spec.seq_len,
            "prefill_chunk": spec.prefill_chunk, "cache": spec.cache, "decode_tokens": spec.decode_tokens,
            "data": lb.source, "subsets": wanted,
            "max_docs": spec.max_docs, "num_layers": n_layers,
            "baseline_id": config_id(dict(identity, **loading_identity(prep.load, prep.model)), [], cfg),
            "points": [p.describe() for p in points],
            "docs": [{"subset": d.subset, "category": d.category, "doc_id": d.doc_id, "digest": d.digest,
                      "context_tokens": d.context_tokens} for d in docs],
            "per_subset": counts, "skipped": skipped, "missing_subsets": lb.missing,
            "data_problems": [p.to_dict() for p in lb.problems]})
        if spec.layer_counts is not None and len(points) > 1 and not any(p.layers == 0 for p in points):
            # (a sweep the user gave; without one each config runs its own layers and no count can be added)
            log.warning("longpatch: the sweep has no 0-layer point; attention speedups need one "
                        "(add 0 to --layer-counts)")
    mine = docs if dist.mode == "sequence" else docs[dist.rank::dist.world]  # sequence: every rank, every doc
    _run(model, points, mine, out, dist, spec.warmup, spec.loss_chunk, spec.progress and dist.main, run_id,
         spec.prefill_chunk, spec.cache, spec.decode_tokens)
    dist.barrier()
    if dist.mode == "spawned" or not dist.main:
        return {}
    return summarize(out, plots=spec.plots)


def _run(model, points: list[Point], docs: list[Doc], out: Path, dist: Dist, warmup: int, chunk: int,
         progress: bool, run_id: str, prefill_chunk: int | None = None, cache: str | None = None,
         decode_tokens: int | None = None) -> None:
    from tqdm.auto import tqdm

    sequence = dist.mode == "sequence"
    if not sequence:
        writer = RecordLog(records_file(out, dist.rank, dist.world))
        done = record_index(read_records(out))
    else:  # one record per document, from rank 0; every rank follows rank 0's view of what is done
        from accelerate.utils import broadcast_object_list
        writer = RecordLog(records_file(out, 0, 1)) if dist.main else _Discard()
        done = broadcast_object_list([record_index(read_records(out)) if dist.main else None], from_process=0)[0]
    if sequence:  # (no prefill_chunk, cache or decode_tokens: the spec refuses them with sequence parallelism)
        evaluate = _evaluate_document_sp
    else:
        def evaluate(model, input_ids, chunk):
            return evaluate_document(model, input_ids, chunk, prefill_chunk=prefill_chunk, cache=cache,
                                     decode_tokens=decode_tokens)
    todo = [(p, [d for d in docs if (p.config_id, d.subset, d.doc_id, d.digest) not in done]) for p in points]
    total = sum(len(ds) for _, ds in todo)
    already = len(points) * len(docs) - total
    if already and progress:
        announce_resume(already, total, "document evaluations", out)
    device = input_device(model)
    bar = tqdm(total=total, desc="eval ppl", unit="doc", disable=not progress, dynamic_ncols=True)

    def warm(point, pending):
        for _ in range(warmup):
            evaluate(model, pending[0].ids[None].to(device), chunk)

    def one(point, doc):
        model.longpatch.reset_stats()
        result = evaluate(model, doc.ids[None].to(device), chunk)
        nll = result["nll_mean"]
        bar.set_postfix(ppl=f"{math.exp(nll):.3f}" if math.isfinite(nll) else "nan")
        return dict(_record(point, doc, result, model.longpatch.breakdown(), dist.rank, run_id,
                            model.longpatch.layer_work()), prefill_chunk=prefill_chunk, cache=cache,
                    decode_tokens=decode_tokens)

    # every document is one prefill of its seq_len tokens (the sequence-parallel ones too, per head group), or
    # its chunks, then its decode steps; interleaved, each document's configurations run side by side, so their
    # speedups share the load
    shapes = set().union(*(prefill_shapes(d.ids.numel(), prefill_chunk, decode_tokens) for d in docs))
    run_points(model, todo, writer, bar, out, one, start=warm, interleave=True, shapes=shapes if dist.main else ())


class _Discard:
    """The records writer of sequence-parallel ranks other than 0 (rank 0 writes each document once)."""

    def append(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _evaluate_document_sp(model, input_ids, chunk: int = 1024) -> dict:
    """evaluate_document with the document split over the sequence-parallel processes: each scores its
    slice's positions; NLL sums and counts are summed over the ranks, wall times are the slowest rank's.
    Attention stats (model.longpatch) stay this rank's: its share of the heads, all-to-alls not included."""
    import torch
    import torch.distributed as tdist

    from ...parallel import sequence_parallel

    n = input_ids.shape[1]
    with sequence_parallel(model) as sp:
        s, e = sp.bounds(n)
        r = evaluate_document(model, input_ids[:, s:e], chunk, input_ids[:, e:e + 1] if e < n else None)
        sums = torch.tensor([r["nll_sum"], r["scored_tokens"]], dtype=torch.float64, device=sp.device)
        secs = torch.tensor([r["forward_seconds"], r["loss_seconds"]], dtype=torch.float64, device=sp.device)
        tdist.all_reduce(sums, group=sp.group)
        tdist.all_reduce(secs, op=tdist.ReduceOp.MAX, group=sp.group)
    total, count = float(sums[0]), int(sums[1])
    return {"scored_tokens": count, "nll_sum": total, "nll_mean": total / count,
            "forward_seconds": float(secs[0]), "loss_seconds": float(secs[1])}


def _record(point: Point, doc: Doc, result: dict, breakdown: dict, rank: int, run_id: str,
            layer_work: dict | None = None) -> dict:
    return {"config_id": point.config_id, "label": point.label, "layers": point.layers,
            "layer_work": {str(i): w for i, w in (layer_work or {}).items()},
            "subset": doc.subset, "category": doc.category, "doc_id": doc.doc_id, "digest": doc.digest,
            "tokens": int(doc.ids.numel()), **result,
            "attention": breakdown, "attention_seconds": total_seconds(breakdown), "run_id": run_id,
            "tokens_per_second": doc.ids.numel() / result["forward_seconds"] if result["forward_seconds"] > 0 else None,
            "rank": rank, "finished": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def run_eval_ppl(model: str, layer_counts: str | None = None, **options) -> dict:
    """`longpatch eval ppl`: run perplexity() and print a table of the results (rank 0 only)."""
    results = perplexity(model, layer_counts, **options)
    if results:
        print_results(results, options.get("out", PerplexitySpec.out))
    return results
