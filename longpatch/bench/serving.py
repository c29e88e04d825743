"""``longpatch bench vllm``: vLLM's own engine with its own CPU backend, with longpatch's backend in exact mode
(every layer exact: the cost of owning the cache) and with a config's selections, in one run: time to first
token and decode speed at each prompt length, for one request and for several at once.

Each backend runs in a vLLM engine of its own, in a subprocess (``LONGPATCH_CONFIG`` is read per process:
``python -m longpatch.bench.serving SPEC``); every engine gets the same random-token prompts, greedy, without
prefix caching, after an untimed generation at each length. A cell is one ``generate`` of its requests, timed
by vLLM's request stats: time to first token (from arrival, the mean over the requests: with several, the
later ones wait for the earlier prefills), decode ms per step (first to last token), and the whole call's
tokens/s (all requests' tokens over its wall time: the throughput).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import LongpatchError
from ..outdir import check_out, claim_out, write_json
from .common import figure, fmt, machine_meta, save_figure, show_table, wide_console

COMMAND = "bench vllm"
RESULTS_FILE = "results.json"
PLOT_FILE = "vllm.png"
BASELINE = "vllm"  # vLLM's own CPU backend: every speedup is against it, at the same length and request count


def _run_cells(spec: dict) -> list[dict]:
    """In the engine's process: every (context, requests) cell of ``spec``, timed by vLLM's own request stats."""
    import torch
    from vllm import LLM, SamplingParams

    contexts, counts, new = spec["contexts"], spec["requests"], spec["new_tokens"]
    llm = LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=True, block_size=spec["block_size"],
              max_model_len=max(contexts) + new + spec["block_size"], max_num_batched_tokens=spec["chunk"],
              max_num_seqs=max(counts), enable_prefix_caching=False, disable_log_stats=False, seed=0)
    vocab = min(int(llm.llm_engine.model_config.get_vocab_size()), 32000)

    def prompts(n: int, count: int) -> list[dict]:
        g = torch.Generator().manual_seed(n)  # the same prompts in every engine
        return [{"prompt_token_ids": torch.randint(5, vocab, (n,), generator=g).tolist()} for _ in range(count)]

    def generate(ps, tokens: int):
        sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        return time.perf_counter() - t0, outs

    for n in contexts:  # the first call at a shape is slow (the CPU kernels' set-up): once each, untimed
        generate(prompts(n, 1), 2)
    rows = []
    for n in contexts:
        for count in counts:
            total, outs = generate(prompts(n, count), 1 + new)
            stats = [o.metrics for o in outs]
            steps = [(m.last_token_ts - m.first_token_ts) / new * 1e3 for m in stats]
            step = sum(steps) / len(steps)
            rows.append(dict(context=n, requests=count, ttft_s=sum(m.first_token_latency for m in stats) / count,
                             last_ttft_s=max(m.first_token_latency for m in stats), decode_ms_per_step=step,
                             decode_tokens_per_s=count * 1e3 / step, total_s=total,
                             tokens_per_s=count * (1 + new) / total,
                             tokens=[list(o.outputs[0].token_ids) for o in outs]))
    return rows


def _backends(config: str, cfg, every_layer: bool, tmp: Path) -> list[tuple[str, str | None]]:
    """(label, LONGPATCH_CONFIG or None) of each engine: vLLM's backend, exact mode, the config ``config``
    (loaded: ``cfg``), and with every layer replaced."""
    import yaml

    exact = tmp / "exact.yaml"
    exact.write_text("method: exact\nlayers: all\n")
    out = [(BASELINE, None), ("exact", str(exact)), (str(config), str(config))]
    if every_layer:
        every = tmp / "every.yaml"
        data = {k: v for k, v in cfg.to_dict().items() if v is not None}
        every.write_text(yaml.safe_dump({**data, "layers": "all"}))
        out.append((f"{config} (every layer)", str(every)))
    return out


def run_serving_bench(model: str, config: str, contexts: tuple[int, ...], requests: tuple[int, ...],
                      new_tokens: int, out, *, every_layer: bool = False, chunk: int = 8192, block_size: int = 32,
                      kv_cache_gib: int = 4, dtype: str = "float32", plots: bool = True) -> dict:
    from ..assets import demo_model_path
    from ..config import check_prefill_chunk, load_config
    from ..serving.plugin import require_vllm
    cfg = load_config(config)  # a bad config or chunk is one line before any engine starts
    check_prefill_chunk(cfg, chunk, "--chunk")
    require_vllm(COMMAND)
    out = check_out(Path(out).expanduser(), COMMAND)
    path = str(demo_model_path()) if model == "demo" else model
    spec = dict(model=path, dtype=dtype, contexts=list(contexts), requests=list(requests), new_tokens=new_tokens,
                chunk=chunk, block_size=block_size)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, variable in _backends(config, cfg, every_layer, Path(tmp)):
            env = {k: v for k, v in os.environ.items() if k != "LONGPATCH_CONFIG"}
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
            if variable is not None:
                env["LONGPATCH_CONFIG"] = variable
            print(f"bench vllm: {label} ...", file=sys.stderr, flush=True)
            r = subprocess.run([sys.executable, "-m", "longpatch.bench.serving", json.dumps(spec)], env=env,
                               capture_output=True, text=True)
            found = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
            if not found:  # vLLM's teardown may abort after the answer is out; before it, the run failed
                tail = " | ".join(r.stderr.strip().splitlines()[-3:])
                raise LongpatchError(f"bench vllm: the engine of {label!r} stopped (exit {r.returncode}): {tail}")
            for row in json.loads(found[0][len("RESULT "):]):
                records.append({"backend": label, **row})
    _compare(records)
    results = {"meta": machine_meta(model=model, config=str(config), new_tokens=new_tokens, chunk=chunk,
                                    block_size=block_size, dtype=dtype, vllm=_vllm_version()),
               "records": records, "files": {"plot": PLOT_FILE if plots else None}}
    claim_out(out, COMMAND)
    write_json(out / RESULTS_FILE, results)
    if plots:
        plot(results, out / PLOT_FILE)
    return results


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    for name in ("vllm-cpu", "vllm"):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return "unknown"


def _compare(records: list[dict]) -> None:
    """Speedups against vLLM's backend in the same cell, and how many greedy tokens equal its."""
    base = {(r["context"], r["requests"]): r for r in records if r["backend"] == BASELINE}
    for r in records:
        b = base.get((r["context"], r["requests"]))
        r["ttft_speedup"] = b["ttft_s"] / r["ttft_s"] if b else None
        r["decode_speedup"] = b["decode_ms_per_step"] / r["decode_ms_per_step"] if b else None
        r["throughput_speedup"] = r["tokens_per_s"] / b["tokens_per_s"] if b else None
        same = sum(x == y for tx, ty in zip(r["tokens"], b["tokens"]) for x, y in zip(tx, ty)) if b else None
        r["same_tokens"] = same
        r["new_tokens_total"] = sum(len(t) for t in r["tokens"])


def print_table(results: dict, console=None) -> None:
    from rich.markup import escape
    cols = ["backend", "context", "requests", "TTFT s", "TTFT speedup", "decode ms/step", "decode speedup",
            "tokens/s", "throughput speedup", "same tokens"]
    cells = []
    for r in results["records"]:
        x = lambda v: "–" if v is None else f"{v:.2f}x"  # noqa: E731
        cells.append([escape(r["backend"]), str(r["context"]), str(r["requests"]), fmt(r["ttft_s"], ".2f"),
                      x(r["ttft_speedup"]), fmt(r["decode_ms_per_step"], ".1f"), x(r["decode_speedup"]),
                      fmt(r["tokens_per_s"], ".1f"), x(r["throughput_speedup"]),
                      f"{r['same_tokens']}/{r['new_tokens_total']}"])
    meta = results["meta"]
    title = escape(f"{meta['model']} in vLLM ({meta['vllm']}), {meta['new_tokens']} greedy tokens per request: "
                   f"vLLM's CPU backend against longpatch's (speedups against vLLM's at the same cell)")
    show_table(title, cols, cells, console or wide_console(160), left=("backend",))


def plot(results: dict, path) -> None:
    """Prefill and decode speedups against vLLM's backend by prompt length, a line per backend and count."""
    fig, axes = figure(1, 2, (11, 4))
    for ax, key, name in ((axes[0][0], "ttft_speedup", "time to first token"),
                          (axes[0][1], "decode_speedup", "decode step")):
        lines: dict[tuple, list] = {}
        for r in results["records"]:
            if r["backend"] != BASELINE and r[key] is not None:
                lines.setdefault((r["backend"], r["requests"]), []).append((r["context"], r[key]))
        for (backend, count), pts in lines.items():
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, marker="o", label=f"{backend}, {count} request{'s' if count > 1 else ''}")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(f"{name}: speedup over vLLM's backend")
        ax.legend(fontsize=7)
    save_figure(fig, path, f"{results['meta']['model']} in vLLM: longpatch's backend against vLLM's CPU backend")


if __name__ == "__main__":  # one engine's cells, in its own process (run_serving_bench)
    print("RESULT " + json.dumps(_run_cells(json.loads(sys.argv[1]))), flush=True)
