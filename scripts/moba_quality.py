#!/usr/bin/env python
"""How MoBA's quality moves with chunk_size and topk (the tables of docs/moba.md).

Two measurements, each printed as a table and written as JSON + PNG into --out:

* ``synthetic`` (always available): relative error ‖o − o_exact‖_F / ‖o_exact‖_F of one causal
  attention layer on "topic" inputs. The sequence is cut into topics of random lengths (mean
  --topic-len tokens); a key is its topic's unit vector plus noise; half of the queries look for their
  own topic (local context), the other half for a random earlier topic (retrieval); values are random.
  Attention is sharp (score gap --sharpness between matching and other keys). This is the structure
  MoBA's gate is built for: a chunk of one topic has a mean key that points at the topic.
* ``demo`` (needs the trained demo model, longpatch/assets/demo): perplexity of the demo model at
  --ctx tokens on its held-out eval set (``eval/demo_code.jsonl``, field "context"), every layer
  patched with MoBA, for each (chunk_size, topk), next to the unpatched model.

Examples:
    python scripts/moba_quality.py synthetic --n 8192 --out runs/moba_quality
    python scripts/moba_quality.py demo --ctx 4096 --out runs/moba_quality
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


def topic_inputs(n: int, d: int = 64, heads: int = 1, topic_len: int = 512, sharpness: float = 8.0,
                 noise: float = 0.3, retrieval: float = 0.5, seed: int = 0):
    """q, k, v [1, heads, n, d] with topic structure (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    bounds = [0]
    while bounds[-1] < n:
        bounds.append(bounds[-1] + max(16, int(torch.empty(1).exponential_(1.0 / topic_len, generator=g))))
    bounds[-1] = n
    topic = torch.zeros(n, dtype=torch.long)
    for t, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        topic[a:b] = t
    nt = len(bounds) - 1
    centers = torch.nn.functional.normalize(torch.randn(heads, nt, d, generator=g), dim=-1)
    k = centers[:, topic] + noise * torch.randn(heads, n, d, generator=g) / math.sqrt(d)
    target = topic.clone()
    far = torch.rand(n, generator=g) < retrieval
    earlier = (torch.rand(n, generator=g) * topic.float()).long()  # a random earlier topic (own if first)
    target[far] = earlier[far]
    q = sharpness * math.sqrt(d) * centers[:, target]
    v = torch.randn(heads, n, d, generator=g)
    return q[None], k[None], v[None]


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def synthetic(a) -> dict:
    from longpatch.ops import exact_attention, moba_attention
    q, k, v = topic_inputs(a.n, a.head_dim, a.heads, a.topic_len, a.sharpness)
    with torch.no_grad():
        ref = exact_attention(q, k, v, causal=True)
        rows = []
        for c in a.chunks:
            for t in a.topks:
                if t >= math.ceil(a.n / c):
                    continue  # topk covers every chunk: exact causal attention
                t0 = time.perf_counter()
                out = moba_attention(q, k, v, chunk_size=c, topk=t)
                rows.append(dict(chunk_size=c, topk=t, rel_err=_rel(out, ref), seconds=time.perf_counter() - t0,
                                 density=_density(a.n, c, t)))
                print(f"chunk {c:5d} topk {t:3d}: rel err {rows[-1]['rel_err']:.4f}", flush=True)
    return dict(kind="synthetic", n=a.n, heads=a.heads, head_dim=a.head_dim, topic_len=a.topic_len,
                sharpness=a.sharpness, rows=rows)


def _density(n: int, c: int, t: int) -> float:
    """Fraction of the causal (query, key) pairs MoBA scores: sum over queries of visible keys."""
    total = seen = 0
    for p in range(0, n, max(1, n // 4096)):
        own = p // c
        past = min(t - 1, own)
        seen += past * c + (p - own * c + 1)
        total += p + 1
    return seen / total


def demo(a) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from longpatch import patch_model, unpatch_model
    from longpatch.assets import demo_model_path

    path = Path(a.model_dir) if a.model_dir else demo_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    docs = []
    with open(path / "eval" / "demo_code.jsonl") as f:
        for line in f:
            ids = tok(json.loads(line)["context"])["input_ids"]
            if len(ids) >= a.ctx:
                docs.append(torch.tensor(ids[: a.ctx])[None])
            if len(docs) == a.max_docs:
                break

    def ppl() -> float:
        nll, count = 0.0, 0
        with torch.no_grad():
            for ids in docs:
                logits = model(ids).logits[0, :-1].float()
                nll += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
                count += ids.shape[1] - 1
        return math.exp(nll / count)

    base = ppl()
    print(f"unpatched: ppl {base:.3f} on {len(docs)} docs x {a.ctx} tokens", flush=True)
    rows = []
    for c in a.chunks:
        for t in a.topks:
            if t >= math.ceil(a.ctx / c):
                continue  # topk covers every chunk: exact causal attention
            patch_model(model, {"method": "moba", "layers": a.layers, "params": {"chunk_size": c, "topk": t}})
            try:
                rows.append(dict(chunk_size=c, topk=t, ppl=ppl(), density=_density(a.ctx, c, t)))
                assert model.longpatch.stats()["patched"]["method"]["calls"] > 0  # MoBA really ran
            finally:
                unpatch_model(model)
            print(f"chunk {c:5d} topk {t:3d}: ppl {rows[-1]['ppl']:.3f}", flush=True)
    return dict(kind="demo", ctx=a.ctx, docs=len(docs), layers=a.layers, ppl_exact=base, rows=rows)


def report(res: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from rich.console import Console
    from rich.table import Table

    key = "rel_err" if res["kind"] == "synthetic" else "ppl"
    chunks = sorted({r["chunk_size"] for r in res["rows"]})
    topks = sorted({r["topk"] for r in res["rows"]})
    val = {(r["chunk_size"], r["topk"]): r[key] for r in res["rows"]}
    title = ("relative error vs exact, topic inputs" if key == "rel_err"
             else f"demo model perplexity at {res['ctx']} tokens (exact: {res['ppl_exact']:.3f})")
    t = Table(title=title)
    t.add_column("chunk \\ topk")
    for k in topks:
        t.add_column(str(k), justify="right")
    for c in chunks:
        t.add_row(str(c), *[f"{val[c, k]:.4f}" if (c, k) in val else "exact" for k in topks])
    Console(width=120).print(t)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"moba_{res['kind']}.json").write_text(json.dumps(res, indent=1))
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in chunks:
        pts = sorted((k, val[c, k]) for k in topks if (c, k) in val)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"chunk {c}")
    if key == "ppl":
        ax.axhline(res["ppl_exact"], color="gray", ls="--", lw=0.8, label="exact")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("topk (chunks per query, own included)")
    ax.set_ylabel(key)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"moba_{res['kind']}.png", dpi=120)
    print(f"wrote {out / ('moba_' + res['kind'] + '.json')} and .png")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=("synthetic", "demo"))
    p.add_argument("--chunks", type=_ints, default=None, help="chunk sizes")
    p.add_argument("--topks", type=_ints, default=None, help="topk values")
    p.add_argument("--n", type=int, default=8192, help="synthetic: sequence length")
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--topic-len", type=int, default=512, help="synthetic: mean topic length")
    p.add_argument("--sharpness", type=float, default=8.0, help="synthetic: score gap of matching keys")
    p.add_argument("--ctx", type=int, default=4096, help="demo: tokens per document")
    p.add_argument("--max-docs", type=int, default=8, help="demo: documents")
    p.add_argument("--layers", default="all", help="demo: layers to patch (a count or 'all')")
    p.add_argument("--model-dir", default=None, help="demo: model directory (default: the shipped demo model)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="runs/moba_quality")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.layers != "all":
        a.layers = int(a.layers)
    if a.kind == "synthetic":
        a.chunks = a.chunks or (128, 256, 512, 1024, 2048)
        a.topks = a.topks or (1, 2, 4, 8, 16)
        res = synthetic(a)
    else:
        a.chunks = a.chunks or (64, 128, 256, 512)
        a.topks = a.topks or (1, 2, 4, 8)
        res = demo(a)
    report(res, Path(a.out))


if __name__ == "__main__":
    main()
