"""What one query-key pair costs in torch's fused CPU attention kernel, by query rows per call.

The block-sparse executor (longpatch/methods/blocksparse.py) calls the kernel once per group of query
blocks, each call one block's rows of a KV group's heads against its gathered key blocks, without a
mask: on the demo configs 2 heads x 256 rows = 512 rows against a few thousand keys. Exact attention
calls it once with every row (32k). The kernel tiles queries by the rows it is given (torch 2.13:
tiles of 256 rows from 768 rows on, smaller below), so the same pairs cost more in short calls. This
script times calls of equal work (rows x keys x calls about --pairs) at several row counts and
thread counts: where the executor's time per pair stands against exact attention's (issue 41's
3x prefill goal, docs/demo.md).

    python scripts/sdpa_rows.py --out runs/sdpa_rows

Writes results.json and sdpa_rows.png into --out.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from longpatch.bench.common import figure, machine_meta, save_figure, show_table
from longpatch.outdir import write_json

ROWS = (256, 512, 767, 768, 1024, 2048, 8192)


def per_pair_ns(rows: int, keys: int, pairs: int, d: int, repeats: int) -> float:
    """Best-of-repeats nanoseconds per query-key pair of maskless fused calls: `calls` batch entries of
    [rows, d] queries against [keys, d] keys and values, about `pairs` pairs in all."""
    calls = max(1, pairs // (rows * keys))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(calls, 1, rows, d, generator=g)
    k, v = (torch.randn(calls, 1, keys, d, generator=g) for _ in range(2))
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    op(q, k, v, 0.0, False, scale=d ** -0.5)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        op(q, k, v, 0.0, False, scale=d ** -0.5)
        best = min(best, time.perf_counter() - t0)
    return best / (calls * rows * keys) * 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="query rows per call, comma-separated")
    ap.add_argument("--keys", type=int, default=2560, help="keys per call (the demo configs list ~10 blocks of 256)")
    ap.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    ap.add_argument("--pairs", type=int, default=1 << 26, help="query-key pairs per timing")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="runs/sdpa_rows")
    a = ap.parse_args(argv)
    try:
        rows = [int(x) for x in a.rows.split(",")]
        threads = [int(x) for x in a.threads.split(",")]
    except ValueError:
        print("sdpa_rows: error: --rows/--threads: comma-separated ints", file=sys.stderr)
        return 2
    for name, vals in (("rows", rows), ("threads", threads), ("keys", [a.keys]), ("pairs", [a.pairs]),
                       ("head-dim", [a.head_dim]), ("repeats", [a.repeats])):
        if min(vals) < 1:
            print(f"sdpa_rows: error: --{name}: got {min(vals)}; allowed: ints >= 1", file=sys.stderr)
            return 2
    before = torch.get_num_threads()
    results = []
    try:
        for t in threads:
            torch.set_num_threads(t)
            for r in rows:
                results.append({"threads": t, "rows": r, "keys": a.keys,
                                "ns_per_pair": per_pair_ns(r, a.keys, a.pairs, a.head_dim, a.repeats)})
    finally:
        torch.set_num_threads(before)
    ns = {(x["threads"], x["rows"]): x["ns_per_pair"] for x in results}
    cells = [[str(r)] + [f"{ns[(t, r)]:.2f}" for t in threads] for r in rows]
    show_table(f"fused CPU attention kernel, maskless, {a.keys} keys, d={a.head_dim}: ns per query-key pair",
               ["query rows per call"] + [f"{t} thread(s)" for t in threads], cells, left=("query rows per call",))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", {"meta": machine_meta(keys=a.keys, head_dim=a.head_dim, pairs=a.pairs,
                                                           repeats=a.repeats), "results": results})
    fig, axes = figure(1, 1, (6, 4))
    ax = axes[0][0]
    for t in threads:
        ax.plot(rows, [ns[(t, r)] for r in rows], marker="o", label=f"{t} thread(s)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("query rows per call")
    ax.set_ylabel("ns per query-key pair")
    ax.legend()
    save_figure(fig, out / "sdpa_rows.png", "torch's fused CPU attention: cost per pair by call size")
    print(f"wrote {out / 'results.json'} and {out / 'sdpa_rows.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
