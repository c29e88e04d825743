"""Where a one-token decode step's time goes on a GPU: wall time against the GPU's own kernel time,
kernels launched and host synchronisations per step, for SDPA and the query-aware MoBA/NSA steps
(decode_topk 8) and sparse's, against one cache (issue 40: the steps took 1.3-3.3 ms at 131k where
SDPA took 0.2; are they launch-bound, sync-bound or kernel-bound?).

    python scripts/gpu_decode_profile.py --out runs/gpu/decode_profile.json     # on a CUDA machine
    python scripts/gpu_decode_profile.py --dry-run --out /tmp/decode_profile.json  # tiny, on the CPU

Per case, over ``--steps`` profiled steps after two unprofiled ones (state built): wall ms per step
(the queue drained after each), the device's kernel ms per step, kernels per step, and the host
synchronisations (cudaStreamSynchronize, cudaDeviceSynchronize, device-to-host copies) per step. On the
CPU (dry run) only wall time and the count of top-level aten ops are meaningful.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longpatch.ops import moba_attention, nsa_attention, sparse_attention  # noqa: E402

MOBA = dict(selection="estimate", chunk_size=256, topk=16, mass=0.9, estimate_queries=64, local_blocks=1,
            decode_topk=8)
NSA = dict(selection="estimate", compress_block=32, compress_stride=16, select_block=256, num_selected=16,
           window=256, init_blocks=1, local_blocks=2, gates=(0.0, 0.9, 0.1), mass=0.9, estimate_queries=64,
           decode_topk=8)
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--cache-len", type=int, default=None, help="default 131072 (dry run 8192)")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    dev, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    heads, kv_heads, d = (32, 8, 128) if cuda else (4, 2, 32)
    n = args.cache_len or (131072 if cuda else 8192)  # the dry run: 32 chunks, more than a step keeps
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, heads, 1, d, device=dev, dtype=dtype, generator=g)
    k, v = (torch.randn(1, kv_heads, n, d, device=dev, dtype=dtype, generator=g) for _ in range(2))
    cases = {"sdpa": lambda st: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
             "moba query-aware": lambda st: moba_attention(q, k, v, state=st, **MOBA),
             "nsa query-aware": lambda st: nsa_attention(q, k, v, state=st, **NSA),
             "sparse defaults": lambda st: sparse_attention(q, k, v, window=1024, global_tokens=64)}
    res = {"meta": {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                    "dtype": str(dtype), "heads": heads, "kv_heads": kv_heads, "head_dim": d, "cache_len": n,
                    "steps": args.steps}, "cases": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        for name, step in cases.items():
            state: dict = {}
            for _ in range(2):  # the state (kept blocks, key bounds) and any compile, unprofiled
                step(state)
            sync()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            walls = []
            with profile(activities=acts) as prof:
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    step(state)
                    sync()
                    walls.append(time.perf_counter() - t0)
            events = prof.events()
            device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
            kernels = [e for e in device if not e.name.startswith(("Memcpy", "Memset"))]
            top = [e for e in events if e.name.startswith("aten::")
                   and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
            row = {"case": name, "wall_ms": 1e3 * sorted(walls)[len(walls) // 2],
                   "aten_ops_per_step": len(top) / args.steps}
            if cuda:
                row.update(kernel_ms=sum(e.device_time_total for e in kernels) / 1e3 / args.steps,
                           kernels_per_step=len(kernels) / args.steps,
                           syncs_per_step=sum(e.name in SYNCS for e in events) / args.steps - 1,  # ours: 1
                           d2h_copies_per_step=sum("DtoH" in e.name for e in device) / args.steps)
            res["cases"].append(row)
            print(json.dumps(row), flush=True)
            out.write_text(json.dumps(res, indent=1))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
