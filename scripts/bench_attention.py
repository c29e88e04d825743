#!/usr/bin/env python
"""Benchmark attention methods against exact attention (torch SDPA on CPU) on one attention layer.

Example (the run in docs/hyperattention.md):
    python scripts/bench_attention.py --methods exact,hyper --both --out runs/bench
Writes attention_bench.json and attention_bench.png into --out and prints a table.
"""
from __future__ import annotations

import argparse
import json

from longpatch.bench import DEFAULT_SEQ_LENS, run_attention_bench


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="exact,hyper", help="comma-separated registry names (exact is always run)")
    p.add_argument("--seq-lens", type=_ints, default=DEFAULT_SEQ_LENS, help="comma-separated lengths")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--causal", dest="modes", action="store_const", const=(True,), help="causal only")
    mode.add_argument("--non-causal", dest="modes", action="store_const", const=(False,), help="non-causal only")
    mode.add_argument("--both", dest="modes", action="store_const", const=(True, False), help="both (default)")
    p.add_argument("--heads", type=int, default=1, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (GQA; default: = heads)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--backward", action="store_true", help="also time forward+backward")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-exact-len", type=int, default=None, help="skip exact attention above this length")
    p.add_argument("--params", default=None,
                   help='JSON of per-method params, e.g. \'{"hyper": {"block_size": 128}}\'')
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--out", default="runs/bench")
    a = p.parse_args(argv)
    if a.threads:
        import torch
        torch.set_num_threads(a.threads)
    run_attention_bench(
        methods=tuple(m for m in a.methods.split(",") if m), seq_lens=a.seq_lens, causal_modes=a.modes or (True, False),
        heads=a.heads, head_dim=a.head_dim, batch=a.batch, dtype=a.dtype, backward=a.backward, repeats=a.repeats,
        out_dir=a.out, method_params=json.loads(a.params) if a.params else None, max_exact_len=a.max_exact_len,
        memory=not a.no_memory, kv_heads=a.kv_heads,
    )


if __name__ == "__main__":
    main()
