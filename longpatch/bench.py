"""Single-layer attention benchmark: every registered method against exact attention, same run.

For each sequence length and mask mode: median (and min, in the JSON) wall time of ``repeats`` calls
after one warm-up call (forward under ``torch.no_grad``; with ``backward`` also forward+backward of ``out.sum()``),
speedup over exact attention (torch SDPA on CPU), relative error ‖o − o_exact‖_F / ‖o_exact‖_F on
two inputs, and peak memory. Prints a table, writes ``attention_bench.json`` and
``attention_bench.png`` (speedup vs length; causal and non-causal panels, forward and
forward+backward rows: the layout of Figure 4 of the HyperAttention paper) into ``out_dir``.

Error inputs:
  * ``err_random``: the timed inputs, q, k, v ~ N(0, 1). Attention is then nearly uniform, the exact
    output is tiny (≈ |v|/√n per row) and any sampling noise is large relative to it: a worst case.
  * ``err_structured``: every query has one dominant key (a noisy copy of its direction, score
    ln(n) + 3, n/3 positions earlier), the rest diffuse; error over the rows that can see their
    dominant key (rows ≥ n/3, under both masks). The regime the method is designed for.

Peak memory (``mem_mb``): the increase of the peak resident set size (VmHWM, reset through
/proc/self/clear_refs) during one forward call, measured in a fresh subprocess so that earlier
allocations do not hide it. Linux only; ``None`` elsewhere.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

DEFAULT_SEQ_LENS = (4096, 8192, 16384, 32768, 65536, 131072)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A call slower than this is timed once (plus its warm-up): SDPA at 131k causal takes ~20 s a call.
_SLOW_CALL_S = 10.0


def _inputs(batch, heads, n, d, dtype, seed=0, kv_heads=None):
    """q [batch, heads, n, d] and k, v [batch, kv_heads (default heads), n, d], all N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    kv_heads = heads if kv_heads is None else kv_heads
    return tuple(torch.randn(batch, h, n, d, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))


def _structured(batch, heads, kv_heads, n, d, dtype):
    """``structured_inputs`` for GQA: each KV head's queries are shared by its group of query heads."""
    q, k, v = structured_inputs(batch, kv_heads, n, d, dtype)
    return q.repeat_interleave(heads // kv_heads, 1), k, v


def structured_inputs(batch, heads, n, d, dtype, seed=0, strength=None, noise=0.05):
    """q_i = strength·√d·u_i (u_i random unit vectors), keys k_j = u_{j+n/3} + noise: query i has a
    dominant key at i − n/3 with score ≈ strength (at the default scale d^-1/2); values random.
    strength = ln(n) + 3 by default, so the dominant key keeps most of the row's mass at every n
    (≈ 0.9 at 4k, ≈ 0.8 at 131k for d = 64) while the other n − 1 keys share the rest."""
    strength = math.log(n) + 3.0 if strength is None else strength
    g = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(batch, heads, n, d, generator=g), dim=-1)
    k = torch.roll(u, -(n // 3), dims=2) + noise * torch.randn(batch, heads, n, d, generator=g) / math.sqrt(d)
    v = torch.randn(batch, heads, n, d, generator=g)
    q = strength * math.sqrt(d) * u
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _caller(name: str, params: dict, head_dim: int):
    from .methods import get_method
    m = get_method(name)
    resolved = m.resolve_params(params)
    buffers = m.make_buffers(head_dim=head_dim, **resolved) if m.make_buffers else {}

    def call(q, k, v, causal):
        return m.prefill(q, k, v, causal=causal, scale=None, backend="auto", buffers=buffers, **resolved)

    return call, resolved


def _time(fn, repeats: int) -> tuple[float, float, Any]:
    """(median ms, min ms, result of the warm-up call)."""
    t0 = time.perf_counter()
    first = fn()  # warm-up; its result is kept (reference output for the errors)
    warm = time.perf_counter() - t0
    n = 1 if warm > _SLOW_CALL_S else repeats
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3, first


def _fwd(call, q, k, v, causal):
    with torch.no_grad():
        return call(q, k, v, causal)


def _fwd_bwd(call, q, k, v, causal):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = call(q, k, v, causal)
    out.float().sum().backward()
    return None


def _rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def peak_memory_mb(method: str, params: dict, n: int, causal: bool, heads: int, head_dim: int, batch: int,
                   dtype: str, kv_heads: int | None = None) -> float | None:
    """Peak RSS increase (MiB) of one forward call, in a fresh subprocess."""
    if not Path("/proc/self/clear_refs").exists():
        return None
    job = json.dumps(dict(method=method, params=params, n=n, causal=causal, heads=heads, head_dim=head_dim,
                          batch=batch, dtype=dtype, kv_heads=kv_heads))
    code = "import sys, longpatch.bench as b; b._memory_worker(sys.argv[1])"
    try:
        res = subprocess.run([sys.executable, "-c", code, job], capture_output=True, text=True, timeout=3600)
        return float(json.loads(res.stdout.strip().splitlines()[-1])["mem_mb"])
    except Exception:  # noqa: BLE001 - memory is a best-effort column
        return None


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _memory_worker(job_json: str) -> None:
    job = json.loads(job_json)
    call, _ = _caller(job["method"], job["params"], job["head_dim"])
    q, k, v = _inputs(job["batch"], job["heads"], job["n"], job["head_dim"], _DTYPES[job["dtype"]],
                      kv_heads=job.get("kv_heads"))
    before = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    _fwd(call, q, k, v, job["causal"])
    peak = _status_kb("VmHWM")
    print(json.dumps({"mem_mb": max(0, peak - before) / 1024}))


def run_attention_bench(methods=("exact", "hyper"), seq_lens=DEFAULT_SEQ_LENS, causal_modes=(True, False),
                        heads: int = 1, head_dim: int = 64, batch: int = 1, dtype: str = "float32",
                        backward: bool = False, repeats: int = 3, out_dir: str | os.PathLike = "runs/bench",
                        method_params: dict[str, dict] | None = None, progress: bool = True,
                        max_exact_len: int | None = None, memory: bool = True, errors: bool = True,
                        kv_heads: int | None = None) -> list[dict]:
    """Benchmark ``methods`` (registry names) against exact attention; returns one row per
    (method, length, mask mode) and writes JSON + PNG into ``out_dir``. ``kv_heads`` (default
    ``heads``) < ``heads`` benchmarks GQA: K/V have kv_heads heads, never repeated."""
    from rich.console import Console
    from rich.progress import Progress

    from .methods import get_method

    method_params = dict(method_params or {})
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: got {dtype!r}; allowed: {', '.join(_DTYPES)}")
    tdtype = _DTYPES[dtype]
    kv_heads = heads if kv_heads is None else kv_heads
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"kv_heads: got {kv_heads}; allowed: a divisor of heads ({heads})")
    others = [m for m in methods if m != "exact"]
    callers = {m: _caller(m, method_params.get(m) or {}, head_dim) for m in ["exact", *others]}
    # the calls of each mask mode; causal-only methods get no non-causal rows
    names = {c: ["exact", *[m for m in others if c or not get_method(m).causal_only]] for c in causal_modes}
    rows: list[dict] = []
    steps = len(seq_lens) * sum(len(v) for v in names.values())
    console = Console(width=max(Console().width, 140))
    log_lines = progress and not console.is_terminal  # no live bar in a log file: one line per step
    with Progress(console=console, disable=not progress or log_lines, transient=False) as bar:
        task = bar.add_task("attention bench", total=steps)
        for causal in causal_modes:
            for n in seq_lens:
                q, k, v = _inputs(batch, heads, n, head_dim, tdtype, kv_heads=kv_heads)
                structured = _structured(batch, heads, kv_heads, n, head_dim, tdtype) if errors else None
                mode = "causal" if causal else "non-causal"
                ref = ref_s = None
                exact_row = None
                run_exact = max_exact_len is None or n <= max_exact_len
                for name in names[causal]:
                    bar.update(task, description=f"{name} n={n} {mode}")
                    if name == "exact" and not run_exact:
                        bar.advance(task)
                        continue
                    call, resolved = callers[name]
                    row = dict(method=name, n=n, causal=causal, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                               batch=batch,
                               dtype=dtype, params=resolved)
                    row["fwd_ms"], row["fwd_ms_min"], out = _time(lambda: _fwd(call, q, k, v, causal), repeats)
                    if backward:
                        row["fwd_bwd_ms"], row["fwd_bwd_ms_min"], _ = _time(lambda: _fwd_bwd(call, q, k, v, causal),
                                                                            repeats)
                    if name == "exact":
                        ref = out
                        if errors:
                            ref_s = _fwd(call, *structured, causal)
                        row.update(err_random=0.0, err_structured=0.0, speedup_fwd=1.0)
                        exact_row = row
                    else:
                        row["err_random"] = _rel_err(out, ref) if ref is not None else None
                        if errors and ref_s is not None:
                            o_s = _fwd(call, *structured, causal)
                            cut = n // 3
                            row["err_structured"] = _rel_err(o_s[:, :, cut:], ref_s[:, :, cut:])
                        else:
                            row["err_structured"] = None
                        row["speedup_fwd"] = exact_row["fwd_ms"] / row["fwd_ms"] if exact_row else None
                    if backward:
                        row["speedup_fwd_bwd"] = (exact_row["fwd_bwd_ms"] / row["fwd_bwd_ms"]) if exact_row else None
                    del out
                    row["mem_mb"] = peak_memory_mb(name, method_params.get(name) or {}, n, causal, heads, head_dim,
                                                   batch, dtype, kv_heads) if memory else None
                    rows.append(row)
                    bar.advance(task)
                    if log_lines:
                        print(f"[bench] {name} n={n} {mode}: fwd {row['fwd_ms']:.1f} ms, speedup "
                              f"{_fmt(row.get('speedup_fwd'), '.2f')}, err {_fmt(row.get('err_random'), '.3f')}/"
                              f"{_fmt(row.get('err_structured'), '.3f')}, mem {_fmt(row.get('mem_mb'), '.0f')} MiB",
                              flush=True)
    meta = dict(threads=torch.get_num_threads(), torch=torch.__version__, loadavg=loadavg(),
                cpu=_cpu_name(), device="cpu", repeats=repeats, note="median of repeats after one warm-up; "
                f"one timed call when a call takes > {_SLOW_CALL_S:.0f} s")
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    (out_path / "attention_bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print_table(rows, console)
    title = (f"speedup over exact attention (torch SDPA), {dtype}, batch {batch}, {heads} head(s)"
             f"{'' if kv_heads == heads else f' sharing {kv_heads} KV head(s)'}, d={head_dim}, "
             f"CPU, {meta['threads']} thread(s)")
    plot(rows, out_path / "attention_bench.png", backward=backward, title=title)
    console.print(f"wrote {out_path / 'attention_bench.json'} and {out_path / 'attention_bench.png'}")
    return rows


def loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _cpu_name():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _fmt(x, spec):
    return "–" if x is None else format(x, spec)


def print_table(rows: list[dict], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=max(Console().width, 140))
    backward = any("fwd_bwd_ms" in r for r in rows)
    t = Table(title="attention: time, speedup vs exact (SDPA), error vs exact, peak memory")
    for col in ["method", "mask", "n", "fwd ms", "speedup"] + (["fwd+bwd ms", "speedup fb"] if backward else []) \
            + ["err random", "err structured", "mem MiB"]:
        t.add_column(col, justify="left" if col in ("method", "mask") else "right")
    for r in rows:
        cells = [r["method"], "causal" if r["causal"] else "non-causal", str(r["n"]), _fmt(r["fwd_ms"], ".1f"),
                 _fmt(r.get("speedup_fwd"), ".2f") + "×"]
        if backward:
            cells += [_fmt(r.get("fwd_bwd_ms"), ".1f"), _fmt(r.get("speedup_fwd_bwd"), ".2f") + "×"]
        cells += [_fmt(r.get("err_random"), ".3f"), _fmt(r.get("err_structured"), ".3f"), _fmt(r.get("mem_mb"), ".0f")]
        t.add_row(*cells)
    console.print(t)


def plot(rows: list[dict], path, backward: bool = False, title: str | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [("speedup_fwd", "forward")] + ([("speedup_fwd_bwd", "forward + backward")] if backward else [])
    modes = [c for c in (False, True) if any(r["causal"] == c for r in rows)]  # a panel per mask mode run
    fig, axes = plt.subplots(len(kinds), len(modes), figsize=(5 * len(modes), 3.6 * len(kinds)), squeeze=False)
    methods = sorted({r["method"] for r in rows if r["method"] != "exact"})
    annotate = len(methods) <= 3  # labels on every point only while they stay readable
    for i, (key, label) in enumerate(kinds):
        for j, causal in enumerate(modes):
            ax = axes[i][j]
            drawn = False
            for m in methods:
                pts = sorted((r["n"], r[key]) for r in rows
                             if r["method"] == m and r["causal"] == causal and r.get(key) is not None)
                if pts:
                    drawn = True
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, marker="o", label=m)
                    for x, y in pts if annotate else ():
                        ax.annotate(f"{y:.1f}×", (x, y), textcoords="offset points", xytext=(0, 6),
                                    ha="center", fontsize=8)
            ax.axhline(1.0, color="gray", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")  # speedups span 0.3× .. 100×+: a log axis keeps every method readable
            ax.set_title(f"{'causal' if causal else 'non-causal'}, {label}")
            ax.set_xlabel("sequence length n")
            ax.set_ylabel("speedup over exact (SDPA)")
            ax.grid(alpha=0.3, which="both")
            if drawn:
                ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
