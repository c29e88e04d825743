"""The perplexity plan: which LongBench documents are evaluated (tokenized, cut to seq_len, with the
digest a record must match) and which are skipped and why. Rank 0 writes it to plan.json."""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from ...errors import LongpatchError
from ..longbench.data import LongBench

log = logging.getLogger("longpatch")


@dataclass
class Doc:
    subset: str
    category: str
    doc_id: str
    context_tokens: int
    ids: torch.Tensor = field(repr=False)  # int64 [seq_len]
    digest: str  # of the ids: a record only counts for the same tokens


def digest(ids: torch.Tensor) -> str:
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
            docs.append(Doc(subset, lb.categories[subset], rec.doc_id, len(ids), t, digest(t)))
    bar.close()
    return docs, counts, skipped


def nothing_to_evaluate(lb: LongBench, counts: dict, skipped: list[dict], seq_len: int) -> str:
    parts = [f"{sum(c['records'] for c in counts.values())} records read from {lb.source}"]
    if lb.problems:
        parts.append(f"{len(lb.problems)} malformed and skipped (first: {lb.problems[0]})")
    short = [s["context_tokens"] for s in skipped if s["reason"] == "too_short"]
    if short:
        parts.append(f"{len(short)} shorter than --seq-len {seq_len} tokens (the longest has {max(short)})")
    return "nothing to evaluate: " + "; ".join(parts)
