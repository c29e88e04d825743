"""Where a one-token decode step's time goes on a GPU: wall time against the GPU's own kernel time,
kernels launched and host synchronisations per step, for SDPA, MoBA's and NSA's query-aware steps at
the shipped 32k configs' params (eager; graph-safe; graph-safe under torch.compile with CUDA graphs) and
sparse's, against one cache; and the split-K decode kernel alone: its ms and the bytes it reads per
second against the measured copy bandwidth.

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

from longpatch.bench.decode import graph_step_call  # noqa: E402
from longpatch.bench.generate import copy_bandwidth  # noqa: E402
from longpatch.methods import get_method  # noqa: E402
from longpatch.ops import moba_attention, nsa_attention, sparse_attention  # noqa: E402

MOBA = dict(selection="hybrid", chunk_size=256, topk=16, mass=0.9, estimate_queries=64, score_stride=16,
            local_blocks=1, decode_page=4, decode_topk=16)  # configs/demo-moba-32k.yaml
NSA = dict(selection="hybrid", compress_block=32, compress_stride=16, select_block=256, num_selected=16,
           window=256, init_blocks=1, local_blocks=2, gates=(0.0, 0.9, 0.1), mass=0.9, estimate_queries=64,
           score_stride=16, decode_page=4, decode_topk=16)  # configs/demo-nsa-32k.yaml
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
    for name, params in (("moba", MOBA), ("nsa", NSA)):
        bound = get_method(name).bind({**params, "gates": list(params["gates"])} if name == "nsa" else params, d)
        for kind, compiled in (("graph-safe", False), ("compiled", True)):
            call = graph_step_call(bound, q, k, v, compiled)
            if call is not None:  # None: the budget covers the cache (exact attention)
                cases[f"{name} {kind}"] = lambda st, call=call: call()
    res = {"meta": {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                    "dtype": str(dtype), "heads": heads, "kv_heads": kv_heads, "head_dim": d, "cache_len": n,
                    "steps": args.steps}, "cases": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        res["kernel"] = kernel_bandwidth(q, k, v, sync, cuda)  # first: the figure the other cases rest on
        print(json.dumps(res["kernel"]), flush=True)
        out.write_text(json.dumps(res, indent=1))
        for name, step in cases.items():
            try:
                res["cases"].append(profile_case(name, step, args.steps, cuda, sync))
            except Exception as e:  # one case failing (a compile, say) leaves the others' figures
                res["cases"].append({"case": name, "error": f"{type(e).__name__}: {e}"[:500]})
            print(json.dumps(res["cases"][-1]), flush=True)
            out.write_text(json.dumps(res, indent=1))
    print(f"written to {out}")
    return 0


def profile_case(name, step, steps: int, cuda: bool, sync) -> dict:
    """One case's row over ``steps`` profiled steps after two unprofiled ones (the state built, any compile):
    wall ms per step (median), and on CUDA kernel ms, kernels, syncs and D2H copies per step."""
    state: dict = {}
    for _ in range(2):
        step(state)
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    walls = []
    with profile(activities=acts) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            step(state)
            sync()
            walls.append(time.perf_counter() - t0)
    events = prof.events()
    device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in device if not e.name.startswith(("Memcpy", "Memset"))]
    top = [e for e in events if e.name.startswith("aten::")
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    row = {"case": name, "wall_ms": 1e3 * sorted(walls)[len(walls) // 2], "aten_ops_per_step": len(top) / steps}
    if cuda:
        row.update(kernel_ms=sum(e.device_time_total for e in kernels) / 1e3 / steps,
                   kernels_per_step=len(kernels) / steps,
                   syncs_per_step=sum(e.name in SYNCS for e in events) / steps - 1,  # ours: 1
                   d2h_copies_per_step=sum("DtoH" in e.name for e in device) / steps)
    return row


def kernel_bandwidth(q, k, v, sync, cuda: bool) -> dict:
    """The split-K kernel alone (the torch twin in the dry run) on a list of 34 blocks of 256 keys per KV head
    (the shipped MoBA step's: 16 kept, 16 ranked, own and local): median ms, the K/V bytes it reads, and
    those bytes per second against the measured device copy bandwidth."""
    from longpatch.methods.paged import paged_attention, paged_attention_torch

    b, hk, n, d = k.shape
    nb = n // 256
    listed = min(34, nb)
    g = torch.Generator().manual_seed(1)
    blocks = torch.stack([torch.randperm(nb, generator=g)[:listed] for _ in range(b * hk)]).view(b, hk, listed)
    blocks = blocks.to(device=k.device, dtype=torch.int32)
    length = torch.full((b,), n, device=k.device, dtype=torch.int64)
    call = lambda: paged_attention(q, k, v, blocks, length, 256, d ** -0.5)  # noqa: E731
    for _ in range(3):
        call()
    sync()
    run, per = call, 1
    if cuda:  # replayed from a CUDA graph of 20 calls: the kernels' time, not the host's launches
        graph, per = torch.cuda.CUDAGraph(), 20
        with torch.cuda.graph(graph):
            for _ in range(per):
                call()
        run = graph.replay
        run()
    times = []
    for _ in range(20 if cuda else 5):
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        times.append((time.perf_counter() - t0) / per)
    ms = 1e3 * sorted(times)[len(times) // 2]
    err = (call()[0].float() - paged_attention_torch(q, k, v, blocks, length, 256, d ** -0.5)[0].float()).abs().max()
    read = 2 * b * hk * listed * 256 * d * k.element_size()
    bandwidth = copy_bandwidth(k.device)
    return {"case": "paged_decode kernel (CUDA graph replay)" if cuda else "paged twin (cpu)", "blocks": listed,
            "ms": ms,
            "bytes_read": read, "gb_per_s": read / ms / 1e6, "copy_gb_per_s": bandwidth / 1e9,
            "of_copy_bandwidth": read / (ms / 1e3) / bandwidth, "max_abs_err_vs_twin": float(err)}


if __name__ == "__main__":
    sys.exit(main())
