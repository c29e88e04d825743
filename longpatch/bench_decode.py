"""Decode benchmark: one generated token (q_len = 1) against a KV cache, method vs exact attention.

For every cache length n and every registered method that has a ``decode``: the method's decode state
is built once from the cache with ``method.init_state(k, v, **params)`` (for MoBA: the chunk means,
"given" as they would be in a running generation, where each chunk's mean is computed once when the
chunk fills), then the median wall time of ``repeats`` decode calls after one warm-up is compared
with ``exact_attention`` decoding the same token against the same cache, in the same run.

Columns: decode ms, exact ms, speedup, init_state ms (the one-pass cost of building the state from
an existing cache, paid once per sequence, not per token), and the relative error of the decoded
output vs exact (‖o − o_exact‖ / ‖o_exact‖) on the timed random inputs and on the last query of
``longpatch.bench.structured_inputs`` (one dominant key n/3 positions back).

Prints a table, writes ``decode_bench.json`` and ``decode_bench.png`` into ``out_dir``.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from .bench import loadavg

DEFAULT_CACHE_LENS = (8192, 32768, 131072)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _decoder(name: str, params: dict, head_dim: int):
    """(call(q, k, v, state), make_state(k, v), resolved params) of a registered method's decode."""
    from .methods import get_method
    m = get_method(name)
    if m.decode is None:
        raise ValueError(f"method '{name}' has no decode (it falls back to exact attention when decoding)")
    resolved = m.resolve_params(params)
    buffers = m.make_buffers(head_dim=head_dim, **resolved) if m.make_buffers else {}

    def call(q, k, v, state):
        extra = {"state": state} if m.stateful else {}
        return m.decode(q, k, v, causal=True, scale=None, backend="auto", buffers=buffers, **extra, **resolved)

    def make_state(k, v):
        if not m.stateful:
            return None
        return m.init_state(k, v, **resolved) if m.init_state is not None else {}

    return call, make_state, resolved


def _inputs(batch, heads, kv_heads, n, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, d, generator=g)
    k = torch.randn(batch, kv_heads, n, d, generator=g)
    v = torch.randn(batch, kv_heads, n, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def run_decode_bench(methods=("moba",), cache_lens=DEFAULT_CACHE_LENS, heads: int = 1, head_dim: int = 64,
                     repeats: int = 20, out_dir: str | os.PathLike = "runs/bench_decode",
                     method_params: dict[str, dict] | None = None, kv_heads: int | None = None, batch: int = 1,
                     dtype: str = "float32", errors: bool = True, progress: bool = True) -> list[dict]:
    """Time one decode step of each method against caches of ``cache_lens`` tokens, vs exact
    attention in the same run; returns one row per (method, cache length), writes JSON + PNG."""
    from rich.console import Console

    from .methods.exact import exact_attention

    if dtype not in _DTYPES:
        raise ValueError(f"dtype: got {dtype!r}; allowed: {', '.join(_DTYPES)}")
    tdtype = _DTYPES[dtype]
    kv_heads = heads if kv_heads is None else kv_heads
    method_params = dict(method_params or {})
    names = [m for m in methods if m != "exact"]
    decoders = {m: _decoder(m, method_params.get(m) or {}, head_dim) for m in names}
    console = Console(width=max(Console().width, 120))
    rows: list[dict] = []
    with torch.no_grad():
        for n in cache_lens:
            q, k, v = _inputs(batch, heads, kv_heads, n, head_dim, tdtype)
            exact_ms = _median_ms(lambda: exact_attention(q, k, v, causal=True), repeats)
            ref = exact_attention(q, k, v, causal=True)
            if errors:
                from .bench import structured_inputs
                qs, ks, vs = structured_inputs(batch, kv_heads, n, head_dim, tdtype)
                qs = qs[:, :, -1:].repeat_interleave(heads // kv_heads, 1)
                ref_s = exact_attention(qs, ks, vs, causal=True)
            for name in names:
                call, make_state, resolved = decoders[name]
                t0 = time.perf_counter()
                state = make_state(k, v)
                init_ms = (time.perf_counter() - t0) * 1e3
                ms = _median_ms(lambda: call(q, k, v, state), repeats)
                row = dict(method=name, cache_len=n, heads=heads, kv_heads=kv_heads, head_dim=head_dim, batch=batch,
                           dtype=dtype, params=resolved, decode_ms=ms, exact_ms=exact_ms, speedup=exact_ms / ms,
                           init_state_ms=init_ms if state is not None else None,
                           err_random=_rel_err(call(q, k, v, state), ref))
                if errors:
                    row["err_structured"] = _rel_err(call(qs, ks, vs, make_state(ks, vs)), ref_s)
                rows.append(row)
                if progress:
                    console.print(f"[bench decode] {name} cache={n}: {ms:.3f} ms vs exact {exact_ms:.3f} ms "
                                  f"({exact_ms / ms:.1f}×)")
    meta = dict(threads=torch.get_num_threads(), torch=torch.__version__, loadavg=loadavg(), device="cpu",
                repeats=repeats, note="median of repeats after one warm-up; state built once per cache "
                "by init_state (not timed in decode_ms)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print_table(rows, console)
    plot(rows, out / "decode_bench.png")
    console.print(f"wrote {out / 'decode_bench.json'} and {out / 'decode_bench.png'}")
    return rows


def _fmt(x, spec):
    return "–" if x is None else format(x, spec)


def print_table(rows: list[dict], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=max(Console().width, 120))
    t = Table(title="decode: one token (q_len = 1) against a KV cache, vs exact attention")
    for col in ("method", "cache", "decode ms", "exact ms", "speedup", "init_state ms", "err random",
                "err structured"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        t.add_row(r["method"], str(r["cache_len"]), _fmt(r["decode_ms"], ".3f"), _fmt(r["exact_ms"], ".3f"),
                  _fmt(r["speedup"], ".1f") + "×", _fmt(r.get("init_state_ms"), ".1f"),
                  _fmt(r.get("err_random"), ".3f"),
                  _fmt(r.get("err_structured"), ".3f"))
    console.print(t)


def plot(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(10, 3.8))
    exact = sorted({(r["cache_len"], r["exact_ms"]) for r in rows})
    if exact:
        xs, ys = zip(*exact)
        ax_t.plot(xs, ys, marker="o", color="gray", label="exact")
    for m in sorted({r["method"] for r in rows}):
        pts = sorted((r["cache_len"], r["decode_ms"], r["speedup"]) for r in rows if r["method"] == m)
        xs, ts, ss = zip(*pts)
        ax_t.plot(xs, ts, marker="o", label=m)
        ax_s.plot(xs, ss, marker="o", label=m)
        for x, s in zip(xs, ss):
            ax_s.annotate(f"{s:.1f}×", (x, s), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax_t.set_ylabel("ms per decoded token")
    ax_t.set_yscale("log")
    ax_s.set_ylabel("speedup over exact")
    ax_s.axhline(1.0, color="gray", lw=0.8, ls="--")
    for ax in (ax_t, ax_s):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cache length")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("one decode step vs KV-cache length")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
