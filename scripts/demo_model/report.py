"""What a finished build writes beside the model: the held-out evaluation set, the measurements
(held-out loss, long-context report, repeated-segment probe) in training.json, the model card
(README.md), and on request (--report) the needle-in-a-haystack accuracy added to both."""
from __future__ import annotations

import hashlib
import json
import math
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .data import read, token_stream
from .model import save_served

if TYPE_CHECKING:
    from .train import Build


def finish(build: Build, out: Path) -> None:
    """Write the trained model of `build` to `out` as it ships (model.save_served), measure it, and write
    training.json, the held-out evaluation set and the model card there."""
    args, tok, held_files, state, log = build.args, build.tok, build.held_files, build.state, build.log
    # every figure below is of the shipped model
    model = save_served(build.model, tok, out, args.serve_rope_factor, log)
    held_loss = heldout_loss(model, tok, held_files)
    log(f"held-out loss {held_loss:.4f} (4096-token windows of held-out files)")
    from longpatch.assets import eval_documents
    from longpatch.eval.demo import long_context_report
    n_docs = write_eval_set(tok, held_files, build.root, out)
    long_ctx = long_context_report(model, tok, eval_documents(path=out))
    log(f"long context: {long_ctx}")
    repeats = repeat_probe(model, token_stream(tok, held_files))
    log(f"repeated segments: {repeats}")
    facts = {"python": platform.python_version(), "seed": args.seed, "params": build.n_params, "vocab": len(tok),
             "train_files": len(build.train_files), "heldout_files": len(held_files),
             "train_tokens_seen": state["tokens"], "stream_tokens": len(build.stream),
             "train_minutes": round(state["seconds"] / 60, 1),
             "heldout_loss": round(held_loss, 4), "eval_docs": n_docs, "curve": state["curve"],
             "evals": state["evals"], "phases": args.phases, "rope_theta": args.rope_theta, "lr": args.lr,
             "torch": torch.__version__, "cpu_threads": torch.get_num_threads(), "long_context": long_ctx,
             "repeat_probe": repeats, "rope_scaling": args.rope_scaling,
             "served_rope": dict(model.config.rope_parameters), "build_minutes": None}
    facts["build_minutes"] = round((time.time() - build.t_start) / 60, 1)
    (out / "training.json").write_text(json.dumps(facts, indent=1))
    write_model_card(out, facts)
    log(f"done in {(time.time() - build.t_start) / 60:.1f} min; wrote {out}")


def write_model_card(out: Path, facts: dict) -> None:
    """README.md of the model directory: what it is, how it was trained, what was measured."""
    lc = facts["long_context"]
    last = facts["evals"][-1] if facts["evals"] else {}
    evals = ", ".join(f"{k} {v:.2f}" for k, v in last.items() if k != "step") or "none"
    curve = "\n".join(f"| {c['step']} | {c['ctx']} | {c['tokens']:,} | {c['loss']:.3f} | {c['answer_loss']:.3f} |"
                      for c in facts["curve"][::4])
    gain = math.exp(lc["late_short_context"] - lc["late"]) - 1
    repeats = "\n".join(f"| {n} | {r['first']:.3f} | {r['second']:.3f} | {100 * r['ratio']:.1f}% |"
                        for n, r in facts.get("repeat_probe", {}).items())
    needle = facts.get("needle")
    if needle:  # {template: {lengths, depths, trials, accuracy: {length: fraction}, minutes}}
        lengths = sorted({int(n) for r in needle.values() for n in r["accuracy"]})
        rows = "\n".join(
            f"| {t} | {len(r['depths'])} ({r['depths'][0]}...{r['depths'][-1]}) x {r['trials']} | "
            + " | ".join(f"{100 * r['accuracy'][str(n)]:.0f}%" if str(n) in r["accuracy"] else "-" for n in lengths)
            + " |" for t, r in needle.items())
        needle_text = ("exact attention, `longpatch eval needle` (greedy generation, held-out filler):\n\n"
                       "| template | depths x trials | " + " | ".join(str(n) for n in lengths)
                       + " |\n| --- | --- |" + " --- |" * len(lengths) + "\n" + rows)
    else:
        needle_text = "not measured yet (`python scripts/build_demo_model.py --report --out DIR`)"
    sr = facts.get("served_rope")
    served = (f"YaRN factor {sr['factor']:g} and attention factor {sr['attention_factor']:.4f} "
              "(`serve_config` in the script)") if sr and sr.get("factor") else "the same settings"
    (out / "README.md").write_text(f"""# longpatch demo model

A small `LlamaForCausalLM` trained on the CPU by `scripts/build_demo_model.py`, so that longpatch can
show offline what an approximate attention costs. Not a useful language model.

- Architecture: 4 layers, hidden 256, 4 query heads sharing 2 KV heads (GQA), head_dim 64, RoPE
  (theta {facts['rope_theta']:g}; trained with scaling {facts.get('rope_scaling', 'none')}, shipped with
  {served}), measured to 32768 tokens, tied embeddings; {facts['params'] / 1e6:.2f}M parameters;
  byte-level BPE vocab {facts['vocab']}.
- Data: the Python {facts['python']} standard library's `*.py` files, {facts['train_files']} for training
  ({facts['stream_tokens']:,} tokens) and {facts['heldout_files']} held out by a hash of their path, mixed
  with retrieval samples (planted needles, repeated spans, random-token copying; see the script).
  The stdlib is under the Python Software Foundation License; the weights are a derived work.
- Training: seed {facts['seed']}, AdamW lr {facts['lr']}, phases `{facts['phases']}`;
  {facts['train_tokens_seen']:,} tokens in {facts['train_minutes']} min of training on
  {facts['cpu_threads']} CPU threads (torch {facts['torch']}), across resumed runs; the last run
  {facts.get('build_minutes')} min.
- Held-out loss: {facts['heldout_loss']} nats/token (4096-token windows of the held-out stream).
- Long context (`longpatch.eval.demo.long_context_report`, {lc['docs']} documents, nats/token):
  positions 1-255 {lc['early']:.3f}; positions 2048-4095 {lc['late']:.3f}; the same late tokens with
  at most 256 tokens of context {lc['late_short_context']:.3f} (full context {100 * gain:.1f}% better in
  perplexity).

## Retrieval

Repeated held-out code segment (a segment of n tokens followed by itself; nats/token):

| n | first copy | second copy | second / first |
| --- | --- | --- | --- |
{repeats}

Needle in a haystack: {needle_text}

Teacher-forced probe at the last training step: {evals}.

## Training curve

| step | context | tokens seen | LM loss (EMA) | answer loss (EMA) |
| --- | --- | --- | --- | --- |
{curve}
""")


def needle_report(out: Path, templates: str, lengths: str, depths: str, trials: int, work: Path, log) -> None:
    """Run `longpatch eval needle` (exact attention) on the model in `out` for each template and record
    its accuracy per length in training.json and the model card (one template per call is fine: the
    others' figures are kept; each run resumes in work/<template>)."""
    from longpatch.eval.needle.run import needle

    facts = json.loads((out / "training.json").read_text())
    report = facts.get("needle") or {}
    for template in templates.split(","):
        t0 = time.time()
        res = needle(str(out), layers="0", method="sparse", template=template, lengths=lengths, depths=depths,
                     trials=trials, out=str(work / template), progress=False)
        report[template] = {"lengths": res["lengths"], "depths": res["depths"], "trials": res["trials"],
                            "accuracy": {str(s["length"]): s["accuracy"] for s in res["summary"]},
                            "minutes": round((time.time() - t0) / 60, 1)}
        log(f"needle {template}: {report[template]['accuracy']}")
        facts["needle"] = report
        (out / "training.json").write_text(json.dumps(facts, indent=1))
        write_model_card(out, facts)


EVAL_SUBSET = "demo_code"  # held-out stdlib files, LongBench record format, category "code"
EVAL_MIN_TOKENS = 4096
EVAL_MAX_DOCS = 24


def write_eval_set(tokenizer, files, root: Path, out: Path) -> int:
    """Held-out files of at least EVAL_MIN_TOKENS tokens, in path order, as LongBench records."""
    records = []
    for p in files:
        text = read(p)
        if len(tokenizer(text)["input_ids"]) < EVAL_MIN_TOKENS:
            continue
        rel = str(p.relative_to(root))
        records.append({"input": "", "context": text, "answers": [rel], "length": len(text.split()),
                        "dataset": EVAL_SUBSET, "language": "en", "all_classes": None,
                        "_id": hashlib.sha1(rel.encode()).hexdigest()})
        if len(records) == EVAL_MAX_DOCS:
            break
    d = out / "eval"
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"{EVAL_SUBSET}.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return len(records)


@torch.no_grad()
def repeat_probe(model, stream: torch.Tensor, lengths=(512, 2048, 8192), windows: int = 2) -> dict:
    """A held-out code segment of n tokens followed by itself: mean loss (nats/token) on the first and
    the second copy. A model that reads its context scores the second copy far lower."""
    out = {}
    for n in lengths:
        first, second = [], []
        for w in range(windows):
            seg = stream[w * n:(w + 1) * n]
            ids = torch.cat([seg, seg]).unsqueeze(0)
            nll = F.cross_entropy(model(ids[:, :-1]).logits[0].float(), ids[0, 1:], reduction="none")
            first.append(nll[:n - 1].mean().item())
            second.append(nll[n - 1:].mean().item())
        f, s = sum(first) / windows, sum(second) / windows
        out[str(n)] = {"first": round(f, 4), "second": round(s, 4), "ratio": round(s / f, 4)}
    return out


@torch.no_grad()
def heldout_loss(model, tok, files, ctx: int = 4096, max_windows: int = 8) -> float:
    stream = token_stream(tok, files)
    losses_ = []
    for i in range(min(max_windows, (len(stream) - 1) // ctx)):
        chunk = stream[i * ctx:(i + 1) * ctx + 1].unsqueeze(0)
        logits = model(chunk[:, :-1]).logits
        losses_.append(F.cross_entropy(logits[0].float(), chunk[0, 1:]).item())
    return sum(losses_) / len(losses_)
