"""What the attention and decode benchmarks share: dtypes, timing, error vs exact, machine facts, and
the way results leave a run (a rich table, JSON with its meta, a PNG figure)."""
from __future__ import annotations

import math
import os
import statistics
import textwrap
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import ConfigError
from ..memory import allocator
from ..options import MAX_VALUES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A call slower than this is timed once (plus its warm-up): SDPA at 131k causal takes ~20 s a call.
SLOW_CALL_S = 10.0


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"--dtype: got {name!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[name]


def check_options(command: str, out_dir, lens_flag: str, lens, method_params: dict, benchmarked, *,
                  heads, kv_heads, head_dim, batch, repeats) -> int:
    """The checks every bench makes before any work, each error naming the CLI flag: the lengths
    (`lens_flag`), sizes and counts are ints >= 1, kv_heads divides heads, method_params names only
    benchmarked methods, and `out_dir` can be this command's output directory. Returns kv_heads
    (default: heads)."""
    from ..outdir import check_out

    if not lens or not all(_is_count(n) for n in lens):
        raise ConfigError(f"{lens_flag}: got {','.join(map(str, lens))!r}; allowed: comma-separated ints >= 1")
    # sizes and counts past MAX_VALUES are typos (a 10**20 head count would overflow torch's shapes, a
    # billion repeats run for days): one line, like the ranges of options.py
    for flag, value in (("--heads", heads), ("--head-dim", head_dim), ("--batch", batch), ("--repeats", repeats)):
        if not _is_count(value) or value > MAX_VALUES:
            raise ConfigError(f"{flag}: got {value!r}; allowed: an int in [1, {MAX_VALUES}]")
    kv_heads = heads if kv_heads is None else kv_heads
    if not _is_count(kv_heads) or heads % kv_heads:
        raise ConfigError(f"--kv-heads: got {kv_heads!r}; allowed: a divisor of --heads ({heads})")
    stray = [m for m in method_params if m not in benchmarked]
    if stray:
        raise ConfigError(f"method_params: {stray[0]!r} is not a benchmarked method, so its params would be "
                          f"ignored; allowed: {', '.join(benchmarked) or 'none'}")
    check_out(out_dir, command)
    return kv_heads


def method_params_from_sets(methods, sets) -> dict[str, dict]:
    """The benchmarks' --set KEY=VALUE (the grammar of every command, options.parse_set): KEY (or
    params.KEY) is a method parameter, set for each benchmarked method that has it -> {method: {param: value}}.
    A key no benchmarked method has is an error, as is the old METHOD.PARAM spelling."""
    from ..methods import available_methods, get_method
    from ..options import parse_set

    methods = list(dict.fromkeys(methods))  # exact is the baseline whether or not --methods names it too
    out: dict[str, dict] = {}
    params = {m: set(get_method(m).params) for m in methods if m in available_methods()}
    for pair in sets:
        key, value = parse_set(pair)
        head, dot, rest = key.partition(".")
        if dot and head in available_methods():
            raise ConfigError(f"--set {pair!r}: --set takes KEY=VALUE in every command now, e.g. --set {rest}="
                              f"{pair.partition('=')[2]}; it applies to each benchmarked method that has {rest!r}")
        key = rest if head == "params" and dot else key
        owners = [m for m, names in params.items() if key in names]
        if not owners:
            known = ", ".join(sorted(set().union(*params.values()))) or "none"
            raise ConfigError(f"--set {key}: no benchmarked method ({', '.join(methods)}) has this parameter; "
                              f"allowed: {known}")
        for m in owners:
            out.setdefault(m, {})[key] = value
    return out


def bench_device(device: str) -> torch.device:
    """--device: 'cpu', or 'cuda' / 'cuda:N' when that GPU is visible (then the methods run backend
    auto: FlexAttention or their Triton kernels, and exact attention is torch SDPA or flash-attn)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device: got {device!r}; allowed: cpu, cuda, cuda:N")
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"--device: got {device!r}, but no such CUDA device is visible; allowed: cpu")
    return dev


def synchronizer(device: torch.device) -> Callable[[], None]:
    """What a timer calls before reading the clock: kernels on a GPU run after their launch returns."""
    if device.type == "cuda":
        return partial(torch.cuda.synchronize, device)
    return lambda: None


def device_label(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def cuda_peak_mb(fn: Callable[[], Any], device: torch.device) -> float:
    """Peak GPU memory (MiB) that one call allocates beyond what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before) / 2**20


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def time_calls(fn: Callable[[], Any], repeats: int, sync: Callable[[], None] = lambda: None
               ) -> tuple[float, float, Any]:
    """(median ms, min ms, result of the warm-up call) of ``repeats`` calls after one warm-up; the
    warm-up's result is returned so that a reference output costs no extra call. ``sync`` runs
    before each clock reading (``synchronizer``: a GPU's queue drained)."""
    sync()
    t0 = time.perf_counter()
    first = fn()
    sync()
    warm = time.perf_counter() - t0
    n = 1 if warm > SLOW_CALL_S else max(1, repeats)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3, first


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


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖_F / ‖b‖_F in float32 (b is the exact output)."""
    return float((a.float() - b.float()).norm() / b.float().norm())


def fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def cpu_name():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_meta(device: torch.device | None = None, **extra) -> dict:
    """What a timing depends on besides the code: threads, torch, load (other jobs), CPU, GPU."""
    device = device or torch.device("cpu")
    meta = dict(threads=torch.get_num_threads(), torch=torch.__version__, loadavg=loadavg(), cpu=cpu_name(),
                device=str(device), allocator=allocator(), **extra)
    if device.type == "cuda":
        import importlib.util

        meta.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    flash_attn=importlib.util.find_spec("flash_attn") is not None)
        if importlib.util.find_spec("triton") is not None:
            import triton
            meta["triton"] = triton.__version__
    return meta


def wide_console(width: int):
    from rich.console import Console

    # tables wider than a narrow terminal or a log file would wrap every row
    return Console(width=max(Console().width, width))


def show_table(title: str, columns: list[str], rows: list[list[str]], console=None, left=("method",)) -> None:
    from rich.table import Table

    t = Table(title=title)
    for col in columns:
        t.add_column(col, justify="left" if col in left else "right")
    for cells in rows:
        t.add_row(*cells)
    (console or wide_console(140)).print(t)


def figure(nrows: int, ncols: int, figsize):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=figsize, squeeze=False)


def save_figure(fig, path, title: str | None = None) -> None:
    import matplotlib.pyplot as plt

    if title:  # wrapped to the figure's width (about 13 characters an inch at this size)
        fig.suptitle(textwrap.fill(title, max(40, int(fig.get_figwidth() * 13))), fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def speedup_axis(ax, xlabel: str, ylabel: str = "speedup over exact", log_y: bool = False) -> None:
    """A log2 length axis with the 1× line: the common frame of every speedup panel."""
    from ..plotting import speedup_line

    speedup_line(ax)
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, which="both")


def annotate_speedups(ax, pts) -> None:
    for x, y in pts:
        ax.annotate(f"{y:.1f}×", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
