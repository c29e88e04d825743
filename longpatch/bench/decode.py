"""Decode benchmark: one generated token (q_len = 1) against a KV cache, method vs exact attention.

For every cache length n and every registered method that has a ``decode``: the method's decode state
is built once from the cache with ``method.bind(params, head_dim).init_state(k, v)`` (for MoBA: the chunk means,
"given" as they would be in a running generation, where each chunk's mean is computed once when the
chunk fills), then the median wall time of ``repeats`` decode calls after one warm-up is compared
with ``exact_attention`` decoding the same token against the same cache, in the same run.

Columns: decode ms, exact ms, speedup, init_state ms (the one-pass cost of building the state from
an existing cache, paid once per sequence, not per token), and the relative error of the decoded
output vs exact (‖o − o_exact‖ / ‖o_exact‖) on the timed random inputs and on the last query of
``longpatch.bench.common.structured_inputs`` (one dominant key n/3 positions back).

On a GPU (``device="cuda"``) the methods run backend auto (FlexAttention for the query-aware
steps, Triton or their gather paths for the rest) and exact attention
is torch SDPA (flash-attn when installed); timings drain the GPU's queue before each clock reading.

Prints a table, writes ``decode_bench.json`` and ``decode_bench.png`` into ``out_dir``.
"""
from __future__ import annotations

import os
import time
from functools import partial

import torch

from ..errors import ConfigError
from ..outdir import claim_out, owns_out, write_json
from .common import (
    annotate_speedups,
    bench_device,
    check_options,
    figure,
    fmt,
    machine_meta,
    rel_err,
    save_figure,
    show_table,
    speedup_axis,
    structured_inputs,
    synchronizer,
    time_calls,
    torch_dtype,
    wide_console,
)

DEFAULT_CACHE_LENS = (8192, 32768, 131072)
COMMAND = "bench decode"  # marks its --out (outdir.claim_out)
# --steps: the method's eager step (its decode on the cache so far), the graph-safe step (methods/paged.py: a
# fixed-size buffer, the length a device tensor) and that step under torch.compile(fullgraph=True; CUDA graphs
# on a GPU: mode reduce-overhead)
STEPS = ("eager", "graph", "compiled")


def _decoder(name: str, params: dict, head_dim: int):
    """(call(q, k, v, state), make_state(k, v), resolved params, the bound method) of a registered method's decode."""
    from ..methods import get_method
    m = get_method(name)
    if m.decode is None:
        raise ConfigError(f"method '{name}' has no decode (it falls back to exact attention when decoding)")
    bound = m.bind(params, head_dim)

    def call(q, k, v, state):
        return bound(q, k, v, causal=True, state=state)

    return call, bound.init_state, bound.params, bound


def graph_step_call(bound, q, k, v, compiled: bool):
    """A zero-argument call of the graph-safe step of ``bound`` for the query q at the last position of the cache
    k, v (its block list from the eager step's first call, as a prefill would leave it), or None where the
    method's params have no such step (or the budget covers the whole cache)."""
    from ..methods.common import default_scale
    from ..methods.paged import PagedState, step

    n = k.shape[2]
    spec = bound.step_spec(n - 1)
    if spec is None:
        return None
    state: dict = {}
    if spec.ranked:
        bound(q, k, v, causal=True, state=state)  # its first step chooses the kept list from the whole cache, once
        if "kept" not in state:  # the budget covers the cache: the step ran exact attention, no list to keep
            return None
    paged = PagedState.for_spec(spec, k, state.get("kept"), n)
    length = torch.full((q.shape[0],), n, dtype=torch.int64, device=k.device)
    fn = step
    if compiled:
        for t in (k, v, length):  # CUDA graphs read them in place, not copied (PagedState marks its own)
            torch._dynamo.mark_static_address(t)
        fn = torch.compile(step, fullgraph=True, dynamic=False, mode="reduce-overhead" if k.is_cuda else None)
    return partial(fn, spec, q, k, v, paged, length, default_scale(None, q.shape[-1]))


def _inputs(batch, heads, kv_heads, n, d, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, d, generator=g)
    k = torch.randn(batch, kv_heads, n, d, generator=g)
    v = torch.randn(batch, kv_heads, n, d, generator=g)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


@owns_out("out_dir", COMMAND)  # one run at a time per --out (two would skew each other's timings)
def run_decode_bench(methods=("moba",), cache_lens=DEFAULT_CACHE_LENS, heads: int = 1, head_dim: int = 64,
                     repeats: int = 20, out_dir: str | os.PathLike = "runs/bench_decode",
                     method_params: dict[str, dict] | None = None, kv_heads: int | None = None, batch: int = 1,
                     dtype: str = "float32", errors: bool = True, progress: bool = True,
                     device: str = "cpu", steps: tuple[str, ...] = ("eager",), cache: str | None = None) -> list[dict]:
    """Time one decode step of each method against caches of ``cache_lens`` tokens, vs exact
    attention in the same run; returns one row per (method, step, cache length), writes JSON + PNG.
    ``steps``: which of ``STEPS`` to time (the graph-safe ones only for methods whose params have one).
    ``cache``: "int8" or "fp8": each method's eager step also reads the cache as 8-bit rows
    (``quantized.QuantizedKV``), timed right after its full-precision row; exact attention reads the
    full-precision cache (the baseline a user has without longpatch)."""
    from ..methods.exact import exact_attention

    tdtype = torch_dtype(dtype)
    dev = bench_device(device)
    sync = synchronizer(dev)
    exact = partial(exact_attention, causal=True, backend="torch")  # SDPA / flash-attn, not our kernel
    method_params = dict(method_params or {})
    names = [m for m in methods if m != "exact"]
    kv_heads = check_options(COMMAND, out_dir, "--cache-lens", cache_lens, method_params, names, heads=heads,
                             kv_heads=kv_heads, head_dim=head_dim, batch=batch, repeats=repeats)
    bad = [x for x in steps if x not in STEPS]
    if bad or not steps:
        raise ConfigError(f"--steps: got {','.join(steps) or '(none)'}; allowed: a comma-separated subset of "
                          f"{', '.join(STEPS)}")
    if cache is not None:
        from ..quantized import QuantizedKV, check_format
        check_format(cache, dev)
        if set(steps) != {"eager"}:
            raise ConfigError(f"--cache {cache} with --steps {','.join(steps)}: the graph-safe steps read a static "
                              "cache's full-precision buffer; allowed: --steps eager")
    decoders = {m: _decoder(m, method_params.get(m) or {}, head_dim) for m in names}
    console = wide_console(120)
    rows: list[dict] = []
    with torch.no_grad():
        for n in cache_lens:
            q, k, v = _inputs(batch, heads, kv_heads, n, head_dim, tdtype, device=dev)
            exact_ms, _, ref = time_calls(partial(exact, q, k, v), repeats, sync)
            caches = [(None, k, v)]
            if cache is not None:  # the methods' cache also as 8-bit rows (exact's reference stays full precision)
                caches.append((cache, *(QuantizedKV.of(t, cache) for t in (k, v))))
            if errors:
                qs, ks, vs = (t.to(dev) for t in structured_inputs(batch, kv_heads, n, head_dim, tdtype))
                qs = qs[:, :, -1:].repeat_interleave(heads // kv_heads, 1)
                ref_s = exact(qs, ks, vs)
                structured = {None: (ks, vs)}
                if cache is not None:
                    structured[cache] = tuple(QuantizedKV.of(t, cache) for t in (ks, vs))
            for name in names:
                call, make_state, resolved, bound = decoders[name]
                for held, kc, vc in caches if "eager" in steps else ():  # full precision, then 8-bit
                    sync()
                    t0 = time.perf_counter()
                    state = make_state(kc, vc)
                    sync()
                    init_ms = (time.perf_counter() - t0) * 1e3
                    ms = time_calls(partial(call, q, kc, vc, state), repeats, sync)[0]
                    row = dict(method=name, step="eager", cache=held, cache_len=n, heads=heads, kv_heads=kv_heads,
                               head_dim=head_dim, batch=batch, dtype=dtype, params=resolved, decode_ms=ms,
                               exact_ms=exact_ms, speedup=exact_ms / ms,
                               init_state_ms=init_ms if state is not None else None,
                               err_random=rel_err(call(q, kc, vc, state), ref))
                    if errors:
                        kq, vq = structured[held]
                        row["err_structured"] = rel_err(call(qs, kq, vq, make_state(kq, vq)), ref_s)
                    rows.append(row)
                    _say(progress, console, name, "eager" if held is None else f"eager, {held} cache", n, ms, exact_ms)
                for kind in [x for x in steps if x != "eager"]:
                    fn = graph_step_call(bound, q, k, v, kind == "compiled")
                    if fn is None:
                        if progress:
                            console.print(f"[bench decode] {name}: no graph-safe step for these params; "
                                          f"no {kind} row")
                        continue
                    fn()  # compiled: traced and captured here, not in a timed call
                    ms, _, got = time_calls(fn, repeats, sync)
                    row = dict(method=name, step=kind, cache_len=n, heads=heads, kv_heads=kv_heads,
                               head_dim=head_dim, batch=batch, dtype=dtype, params=resolved, decode_ms=ms,
                               exact_ms=exact_ms, speedup=exact_ms / ms, init_state_ms=None,
                               err_random=rel_err(got.clone(), ref))
                    if errors:
                        row["err_structured"] = rel_err(graph_step_call(bound, qs, ks, vs, False)(), ref_s)
                    rows.append(row)
                    _say(progress, console, name, kind, n, ms, exact_ms)
    meta = machine_meta(dev, repeats=repeats, note="median of repeats after one warm-up; state built once per cache "
                        "by init_state (not timed in decode_ms)")
    out = claim_out(out_dir, COMMAND)
    write_json(out / "decode_bench.json", {"meta": meta, "rows": rows})
    print_table(rows, console)
    plot(rows, out / "decode_bench.png")
    console.print(f"wrote {out / 'decode_bench.json'} and {out / 'decode_bench.png'}")
    return rows


def _say(progress: bool, console, name: str, step: str, n: int, ms: float, exact_ms: float) -> None:
    if progress:
        console.print(f"[bench decode] {name} ({step} step) cache={n}: {ms:.3f} ms vs exact {exact_ms:.3f} ms "
                      f"({exact_ms / ms:.1f}×)")


def _step_label(r: dict) -> str:
    """A row's step as the table and the plot name it: "eager", "graph", "compiled", or "eager, int8 cache"."""
    return r.get("step", "eager") + (f", {r['cache']} cache" if r.get("cache") else "")


def print_table(rows: list[dict], console=None) -> None:
    cols = ["method", "step", "cache", "decode ms", "exact ms", "speedup", "init_state ms", "err random",
            "err structured"]
    cells = [[r["method"], _step_label(r), str(r["cache_len"]), fmt(r["decode_ms"], ".3f"),
              fmt(r["exact_ms"], ".3f"),
              fmt(r["speedup"], ".1f") + "×", fmt(r.get("init_state_ms"), ".1f"), fmt(r.get("err_random"), ".3f"),
              fmt(r.get("err_structured"), ".3f")] for r in rows]
    show_table("decode: one token (q_len = 1) against a KV cache, vs exact attention", cols, cells,
               console or wide_console(120))


def plot(rows: list[dict], path) -> None:
    from ..plotting import method_color

    fig, axes = figure(1, 2, (10, 3.8))
    ax_t, ax_s = axes[0]
    exact = sorted({(r["cache_len"], r["exact_ms"]) for r in rows})
    if exact:
        ax_t.plot(*zip(*exact), marker="o", color=method_color("exact"), label="exact")
    for m, st in sorted({(r["method"], _step_label(r)) for r in rows}):
        pts = sorted((r["cache_len"], r["decode_ms"], r["speedup"]) for r in rows
                     if r["method"] == m and _step_label(r) == st)
        xs, ts, ss = zip(*pts)
        label, style = (m, "-") if st == "eager" else (f"{m} ({st})", "--" if st.startswith("graph") else ":")
        ax_t.plot(xs, ts, marker="o", label=label, color=method_color(m), linestyle=style)
        ax_s.plot(xs, ss, marker="o", label=label, color=method_color(m), linestyle=style)
        annotate_speedups(ax_s, zip(xs, ss))
    ax_t.set_yscale("log")
    ax_t.set_xscale("log", base=2)
    ax_t.set_xlabel("cache length")
    ax_t.set_ylabel("ms per decoded token")
    ax_t.grid(alpha=0.3)
    speedup_axis(ax_s, "cache length")
    for ax in (ax_t, ax_s):
        ax.legend()
    save_figure(fig, path, "one decode step vs KV-cache length")
