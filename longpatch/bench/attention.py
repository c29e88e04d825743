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
allocations do not hide it. Linux only; ``None`` elsewhere. On a GPU (``device="cuda"``): the
peak of torch's CUDA allocator during one call beyond what was allocated before it.

On a GPU the methods run backend auto (FlexAttention for moba, nsa's query-aware selections and
sparse; Triton kernels for the rest) and the exact baseline is torch SDPA
(flash-attn when installed), never longpatch's own Triton flash kernel: the speedups are against
what a user runs without longpatch. Timings drain the GPU's queue before each clock reading.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import torch

from ..errors import check_int
from ..outdir import claim_out, owns_out, write_json
from .common import (
    DTYPES,
    SLOW_CALL_S,
    annotate_speedups,
    bench_device,
    check_options,
    cuda_peak_mb,
    device_label,
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

__all__ = ["DEFAULT_SEQ_LENS", "run_attention_bench", "structured_inputs", "peak_memory_mb", "print_table", "plot"]

DEFAULT_SEQ_LENS = (4096, 8192, 16384, 32768, 65536, 131072)
COMMAND = "bench attention"  # marks its --out (outdir.claim_out)


def _inputs(batch, heads, n, d, dtype, seed=0, kv_heads=None, device="cpu"):
    """q [batch, heads, n, d] and k, v [batch, kv_heads (default heads), n, d], all N(0, 1) (drawn on
    the CPU, so that every device gets the same numbers)."""
    g = torch.Generator().manual_seed(seed)
    kv_heads = heads if kv_heads is None else kv_heads
    return tuple(torch.randn(batch, h, n, d, generator=g).to(device=device, dtype=dtype)
                 for h in (heads, kv_heads, kv_heads))


def _structured(batch, heads, kv_heads, n, d, dtype, device="cpu"):
    """``structured_inputs`` for GQA: each KV head's queries are shared by its group of query heads."""
    q, k, v = (t.to(device) for t in structured_inputs(batch, kv_heads, n, d, dtype))
    return q.repeat_interleave(heads // kv_heads, 1), k, v


def _caller(name: str, params: dict, head_dim: int):
    from ..methods import get_method
    bound = get_method(name).bind(params, head_dim)
    # the baseline is what runs without longpatch: SDPA (flash-attn when installed), not our Triton kernel
    backend = "torch" if name == "exact" else "auto"

    def call(q, k, v, causal):
        return bound(q, k, v, causal=causal, backend=backend)

    return call, bound.params


def _fwd(call, q, k, v, causal):
    with torch.no_grad():
        return call(q, k, v, causal)


def _fwd_bwd(call, q, k, v, causal):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = call(q, k, v, causal)
    out.float().sum().backward()
    return None


def peak_memory_mb(method: str, params: dict, n: int, causal: bool, heads: int, head_dim: int, batch: int,
                   dtype: str, kv_heads: int | None = None) -> float | None:
    """Peak RSS increase (MiB) of one forward call, in a fresh subprocess."""
    if not Path("/proc/self/clear_refs").exists():
        return None
    job = json.dumps(dict(method=method, params=params, n=n, causal=causal, heads=heads, head_dim=head_dim,
                          batch=batch, dtype=dtype, kv_heads=kv_heads))
    code = "import sys, longpatch.bench.attention as b; b._memory_worker(sys.argv[1])"
    try:
        res = subprocess.run([sys.executable, "-c", code, job], capture_output=True, text=True, timeout=3600)
        return float(json.loads(res.stdout.strip().splitlines()[-1])["mem_mb"])
    except Exception:  # noqa: BLE001 - memory is a best-effort column
        return None


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _memory_worker(job_json: str) -> None:
    job = json.loads(job_json)
    call, _ = _caller(job["method"], job["params"], job["head_dim"])
    q, k, v = _inputs(job["batch"], job["heads"], job["n"], job["head_dim"], DTYPES[job["dtype"]],
                      kv_heads=job.get("kv_heads"))
    before = status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    _fwd(call, q, k, v, job["causal"])
    peak = status_kb("VmHWM")
    print(json.dumps({"mem_mb": max(0, peak - before) / 1024}))


@owns_out("out_dir", COMMAND)  # one run at a time per --out (two would skew each other's timings)
def run_attention_bench(methods=("exact", "hyper"), seq_lens=DEFAULT_SEQ_LENS, causal_modes=(True, False),
                        heads: int = 1, head_dim: int = 64, batch: int = 1, dtype: str = "float32",
                        backward: bool = False, repeats: int = 3, out_dir: str | os.PathLike = "runs/bench",
                        method_params: dict[str, dict] | None = None, progress: bool = True,
                        max_exact_len: int | None = None, memory: bool = True, errors: bool = True,
                        kv_heads: int | None = None, device: str = "cpu") -> list[dict]:
    """Benchmark ``methods`` (registry names) against exact attention; returns one row per
    (method, length, mask mode) and writes JSON + PNG into ``out_dir``. ``kv_heads`` (default
    ``heads``) < ``heads`` benchmarks GQA: K/V have kv_heads heads, never repeated. ``device``:
    cpu, or cuda (the Triton kernels against SDPA)."""
    from rich.progress import Progress

    from ..methods import get_method

    dev = bench_device(device)
    sync = synchronizer(dev)
    method_params = dict(method_params or {})
    tdtype = torch_dtype(dtype)
    if max_exact_len is not None:
        check_int("--max-exact-len", max_exact_len, 1)
    others = [m for m in methods if m != "exact"]
    kv_heads = check_options(COMMAND, out_dir, "--seq-lens", seq_lens, method_params, ["exact", *others],
                             heads=heads, kv_heads=kv_heads, head_dim=head_dim, batch=batch, repeats=repeats)
    callers = {m: _caller(m, method_params.get(m) or {}, head_dim) for m in ["exact", *others]}
    bound = {m: get_method(m).bind(method_params.get(m) or {}, head_dim) for m in ["exact", *others]}
    # the calls of each mask mode; causal-only methods get no non-causal rows
    names = {c: ["exact", *[m for m in others if c or not get_method(m).causal_only]] for c in causal_modes}
    rows: list[dict] = []
    steps = len(seq_lens) * sum(len(v) for v in names.values())
    console = wide_console(140)
    log_lines = progress and not console.is_terminal  # no live bar in a log file: one line per step
    with Progress(console=console, disable=not progress or log_lines, transient=False) as bar:
        task = bar.add_task("attention bench", total=steps)
        for causal in causal_modes:
            for n in seq_lens:
                q, k, v = _inputs(batch, heads, n, head_dim, tdtype, kv_heads=kv_heads, device=dev)
                structured = _structured(batch, heads, kv_heads, n, head_dim, tdtype, dev) if errors else None
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
                    row["fwd_ms"], row["fwd_ms_min"], out = time_calls(partial(_fwd, call, q, k, v, causal), repeats,
                                                                       sync)
                    if backward:
                        row["fwd_bwd_ms"], row["fwd_bwd_ms_min"], _ = time_calls(
                            partial(_fwd_bwd, call, q, k, v, causal), repeats, sync)
                    if name == "exact":
                        ref = out
                        if errors:
                            ref_s = _fwd(call, *structured, causal)
                        row.update(err_random=0.0, err_structured=0.0, speedup_fwd=1.0)
                        exact_row = row
                        _ideal(row, bound[name], q, k, causal, exact_row)
                    else:
                        row["err_random"] = rel_err(out, ref) if ref is not None else None
                        if errors and ref_s is not None:
                            o_s = _fwd(call, *structured, causal)
                            cut = n // 3
                            row["err_structured"] = rel_err(o_s[:, :, cut:], ref_s[:, :, cut:])
                        else:
                            row["err_structured"] = None
                        row["speedup_fwd"] = exact_row["fwd_ms"] / row["fwd_ms"] if exact_row else None
                        _ideal(row, bound[name], q, k, causal, exact_row)
                    if backward:
                        row["speedup_fwd_bwd"] = (exact_row["fwd_bwd_ms"] / row["fwd_bwd_ms"]) if exact_row else None
                    del out
                    if not memory:
                        row["mem_mb"] = None
                    elif dev.type == "cuda":
                        row["mem_mb"] = cuda_peak_mb(partial(_fwd, call, q, k, v, causal), dev)
                    else:
                        row["mem_mb"] = peak_memory_mb(name, method_params.get(name) or {}, n, causal, heads,
                                                       head_dim, batch, dtype, kv_heads)
                    rows.append(row)
                    bar.advance(task)
                    if log_lines:
                        print(f"[bench] {name} n={n} {mode}: fwd {row['fwd_ms']:.1f} ms, speedup "
                              f"{fmt(row.get('speedup_fwd'), '.2f')}, err {fmt(row.get('err_random'), '.3f')}/"
                              f"{fmt(row.get('err_structured'), '.3f')}, mem {fmt(row.get('mem_mb'), '.0f')} MiB",
                              flush=True)
    meta = machine_meta(dev, repeats=repeats, note="median of repeats after one warm-up; "
                        f"one timed call when a call takes > {SLOW_CALL_S:.0f} s")
    out_path = claim_out(out_dir, COMMAND)
    write_json(out_path / "attention_bench.json", {"meta": meta, "rows": rows})
    print_table(rows, console)
    title = (f"speedup over exact attention (torch SDPA), {dtype}, batch {batch}, {heads} head(s)"
             f"{'' if kv_heads == heads else f' sharing {kv_heads} KV head(s)'}, d={head_dim}, "
             f"{device_label(dev)}" + (f", {meta['threads']} thread(s)" if dev.type == "cpu" else ""))
    plot(rows, out_path / "attention_bench.png", backward=backward, title=title)
    console.print(f"wrote {out_path / 'attention_bench.json'} and {out_path / 'attention_bench.png'}")
    return rows


def _ideal(row: dict, bound, q, k, causal: bool, exact_row: dict | None) -> None:
    """row["pairs"]: the query-key products the call computes (selection included), where the method
    reports them; row["ideal_speedup"]: exact's pairs / the method's; row["ideal_ratio"]: the achieved
    speedup / the ideal one (1.0: the executor runs as fast per product as exact attention)."""
    with torch.no_grad():
        row["pairs"] = bound.attended_pairs(q, k, causal)
    exact_pairs = exact_row.get("pairs") if exact_row else None
    ok = row["pairs"] and exact_pairs
    row["ideal_speedup"] = exact_pairs / row["pairs"] if ok else None
    speedup = row.get("speedup_fwd")
    row["ideal_ratio"] = speedup / row["ideal_speedup"] if ok and speedup else None


def print_table(rows: list[dict], console=None) -> None:
    backward = any("fwd_bwd_ms" in r for r in rows)
    cols = ["method", "mask", "n", "fwd ms", "speedup"] + (["fwd+bwd ms", "speedup fb"] if backward else []) \
        + ["pairs", "ideal", "ratio", "err random", "err structured", "mem MiB"]
    cells = []
    for r in rows:
        c = [r["method"], "causal" if r["causal"] else "non-causal", str(r["n"]), fmt(r["fwd_ms"], ".1f"),
             fmt(r.get("speedup_fwd"), ".2f") + "×"]
        if backward:
            c += [fmt(r.get("fwd_bwd_ms"), ".1f"), fmt(r.get("speedup_fwd_bwd"), ".2f") + "×"]
        c += [fmt(r.get("pairs"), ".3g"), fmt(r.get("ideal_speedup"), ".2f") + "×", fmt(r.get("ideal_ratio"), ".2f"),
              fmt(r.get("err_random"), ".3f"), fmt(r.get("err_structured"), ".3f"), fmt(r.get("mem_mb"), ".0f")]
        cells.append(c)
    show_table("attention: time, speedup vs exact (SDPA), error vs exact, peak memory", cols, cells, console,
           left=("method", "mask"))


def plot(rows: list[dict], path, backward: bool = False, title: str | None = None) -> None:
    from ..plotting import method_color

    kinds = [("speedup_fwd", "forward")] + ([("speedup_fwd_bwd", "forward + backward")] if backward else [])
    modes = [c for c in (False, True) if any(r["causal"] == c for r in rows)]  # a panel per mask mode run
    fig, axes = figure(len(kinds), len(modes), (5 * len(modes), 3.6 * len(kinds)))
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
                    ax.plot(*zip(*pts), marker="o", label=m, color=method_color(m))
                    if annotate:
                        annotate_speedups(ax, pts)
            # speedups span 0.3× .. 100×+: a log axis keeps every method readable
            speedup_axis(ax, "sequence length n", "speedup over exact (SDPA)", log_y=True)
            ax.set_title(f"{'causal' if causal else 'non-causal'}, {label}")
            if drawn:
                ax.legend(fontsize=8)
    save_figure(fig, path, title)
