"""How close the block-sparse executor runs to its ideal speed.

For one causal prefill (default 32k tokens, 1 head, d = 64) and block lists of several densities
(fixed budgets of the last-queries selection, MoBA's `selection: estimate`), it times exact attention
(SDPA) and the selection + executor, interleaved (repeat by repeat, so both see the same load), and
prints per density: the attended query-key pairs (estimate included), the ideal speedup (exact's
pairs / these), the achieved speedup (median times) and their ratio. Where torch's FlexAttention
compiles on this machine, it runs the same block lists as a block mask in the same run (a yardstick;
on torch 2.13's CPU inductor it may fail at 32k, and the table says so).

    python scripts/executor_speed.py --n 32768 --out runs/executor_speed

Writes results.json and executor_speed.png into --out.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from longpatch.bench.common import figure, machine_meta, save_figure, show_table, speedup_axis
from longpatch.methods.blocksparse import block_sparse_prefill
from longpatch.methods.selection import attended_cost, estimate_cost, estimated_blocks
from longpatch.ops import exact_attention
from longpatch.outdir import write_json

DENSITIES = (1 / 16, 1 / 8, 1 / 4, 1 / 2)


def budget_for(density: float, nb: int) -> int:
    """Past blocks per query block whose average causal density is about ``density``: a query block
    i attends min(i, S) past blocks + half its own, of an average (nb + 1) / 2 visible."""
    best, err = 1, float("inf")
    for S in range(1, nb):
        att = sum(min(i, S) + 0.5 for i in range(nb)) / nb
        e = abs(att / ((nb + 1) / 2) - density)
        if e < err:
            best, err = S, e
    return best


def flex_runner(q, k, v, blocks, block):
    """A compiled FlexAttention call with the executor's mask (own block causal + listed blocks), or
    the first line of why it cannot run here."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        n = q.shape[2]
        nb = blocks.shape[2]
        allowed = torch.zeros(nb, nb, dtype=torch.bool)
        lst = blocks[0, 0]
        rows = torch.arange(nb).view(-1, 1).expand_as(lst)
        allowed[rows[lst >= 0], lst[lst >= 0]] = True

        def mask_mod(b, h, qi, ki):
            qb, kb = qi // block, ki // block
            return ((qb == kb) & (ki <= qi)) | allowed[qb, kb]

        bm = create_block_mask(mask_mod, 1, 1, n, n, device="cpu", BLOCK_SIZE=block)
        fn = torch.compile(flex_attention)
        fn(q, k, v, block_mask=bm)  # compile once, outside the timing
        return lambda: fn(q, k, v, block_mask=bm)
    except Exception as e:  # noqa: BLE001 - a yardstick: any failure is reported, not fatal
        return (str(e).strip().splitlines() or [type(e).__name__])[0][:120]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--queries", type=int, default=64, help="last queries of the estimate")
    ap.add_argument("--flex", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default="runs/executor_speed")
    a = ap.parse_args(argv)
    for name in ("n", "block", "head_dim", "repeats", "queries"):
        if getattr(a, name) < 1:
            print(f"executor_speed: error: --{name.replace('_', '-')}: got {getattr(a, name)}; allowed: an int >= 1",
                  file=sys.stderr)
            return 2
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, a.n, a.head_dim, generator=g) for _ in range(3))
    scale = a.head_dim ** -0.5
    nb = math.ceil(a.n / a.block)
    exact_pairs = a.n * (a.n + 1) // 2
    budgets = sorted({budget_for(d, nb) for d in DENSITIES})

    def method(S):
        def run():
            with torch.no_grad():
                blocks = estimated_blocks(q, k, a.block, S, None, ("estimate", a.queries), 1, scale)
                return block_sparse_prefill(q, k, v, blocks, a.block, scale)
        return run

    calls = {"exact": lambda: exact_attention(q, k, v)}
    calls.update({S: method(S) for S in budgets})
    lists = {S: estimated_blocks(q, k, a.block, S, None, ("estimate", a.queries), 1, scale) for S in budgets}
    flex = {S: flex_runner(q, k, v, lists[S], a.block) for S in budgets} if a.flex else {}
    for fn in list(calls.values()) + [f for f in flex.values() if callable(f)]:
        fn()  # warm-up
    times: dict = {key: [] for key in list(calls) + [("flex", S) for S, f in flex.items() if callable(f)]}
    for _ in range(a.repeats):  # interleaved: every variant once per round
        for key in times:
            fn = flex[key[1]] if isinstance(key, tuple) else calls[key]
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    ms = {key: statistics.median(t) * 1e3 for key, t in times.items()}
    rows = []
    for S in budgets:
        pairs = int(estimate_cost(1, 1, a.n, ("estimate", a.queries)) + attended_cost(lists[S], 1, a.n, a.block))
        ideal = exact_pairs / pairs
        speed = ms["exact"] / ms[S]
        f = flex.get(S)
        rows.append({"past_blocks": S, "density": pairs / exact_pairs, "pairs": pairs, "ms": ms[S],
                     "exact_ms": ms["exact"], "ideal_speedup": ideal, "speedup": speed, "ratio": speed / ideal,
                     "flex_ms": ms.get(("flex", S)),
                     "flex_speedup": ms["exact"] / ms[("flex", S)] if callable(f) else None,
                     "flex_error": None if f is None or callable(f) else f})
    cells = [[str(r["past_blocks"]), f"1/{1 / r['density']:.1f}", f"{r['pairs']:.3g}", f"{r['ms']:.0f}",
              f"{r['exact_ms']:.0f}", f"{r['speedup']:.2f}×", f"{r['ideal_speedup']:.2f}×", f"{r['ratio']:.2f}",
              f"{r['flex_speedup']:.2f}×" if r["flex_speedup"] else ("failed" if r["flex_error"] else "–")]
             for r in rows]
    show_table(f"block-sparse executor, causal n={a.n}, 1 head, d={a.head_dim}, blocks of {a.block}, CPU "
               f"{torch.get_num_threads()} thread(s)",
               ["past blocks", "density", "pairs", "ms", "exact ms", "speedup", "ideal", "ratio", "flex"], cells,
               left=())
    for r in rows:
        if r["flex_error"]:
            print(f"flex at {r['past_blocks']} blocks: {r['flex_error']}")
    out = Path(a.out)
    write_json(out / "results.json", {"meta": machine_meta(repeats=a.repeats, n=a.n, block=a.block), "rows": rows})
    fig, ax = figure(1, 1, (5.5, 4))
    ax = ax[0][0]
    ax.plot([r["density"] for r in rows], [r["ideal_speedup"] for r in rows], "k--", label="ideal")
    ax.plot([r["density"] for r in rows], [r["speedup"] for r in rows], "o-", label="executor (torch path)")
    flexed = [r for r in rows if r["flex_speedup"]]
    if flexed:
        ax.plot([r["density"] for r in flexed], [r["flex_speedup"] for r in flexed], "s-",
                label="FlexAttention (compiled)")
    speedup_axis(ax, "density (attended pairs / exact's)", log_y=True)
    ax.legend(fontsize=8)
    save_figure(fig, out / "executor_speed.png", f"n={a.n}, causal, blocks of {a.block}")
    print(f"wrote {out / 'results.json'} and {out / 'executor_speed.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
