#!/usr/bin/env python
"""Benchmark one decode step (q_len = 1) of attention methods against a KV cache, vs exact attention.

Example (the run in docs/moba.md):
    python scripts/bench_decode.py --methods moba --cache-lens 8192,32768,131072 \
        --params '{"moba": {"chunk_size": 2048, "topk": 3}}' --out runs/bench_decode
Writes decode_bench.json and decode_bench.png into --out and prints a table.
"""
from __future__ import annotations

import argparse
import json

from longpatch.bench_decode import DEFAULT_CACHE_LENS, run_decode_bench


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="moba", help="comma-separated registry names of methods with a decode")
    p.add_argument("--cache-lens", type=_ints, default=DEFAULT_CACHE_LENS, help="comma-separated cache lengths")
    p.add_argument("--heads", type=int, default=1, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: = heads)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--params", default=None, help='JSON of per-method params, e.g. \'{"moba": {"topk": 3}}\'')
    p.add_argument("--no-errors", action="store_true", help="skip the error columns")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--out", default="runs/bench_decode")
    a = p.parse_args(argv)
    if a.threads:
        import torch
        torch.set_num_threads(a.threads)
    run_decode_bench(methods=tuple(m for m in a.methods.split(",") if m), cache_lens=a.cache_lens, heads=a.heads,
                     kv_heads=a.kv_heads, head_dim=a.head_dim, batch=a.batch, dtype=a.dtype, repeats=a.repeats,
                     method_params=json.loads(a.params) if a.params else None, errors=not a.no_errors,
                     out_dir=a.out)


if __name__ == "__main__":
    main()
