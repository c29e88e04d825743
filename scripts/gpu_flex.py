"""Issue 40's attention figures in one run: prefill and one-token decode of the block-sparse methods on
FlexAttention (backend flex) and, where they still have one, on their Triton kernels (backend triton:
sparse, MoBA's gate, NSA's paper form), beside torch SDPA in the same process, with peak memory and
the flex compile times.

    python scripts/gpu_flex.py --out runs/gpu/flex.json             # on a CUDA machine (bf16, 32/8 heads, d 128)
    python scripts/gpu_flex.py --dry-run --out /tmp/flex.json       # the same cases, tiny, on the CPU

Cases (docs/gpu.md's flex table): moba and nsa with the query-aware selection (chunks/blocks of 256, at most
16, mass 0.9, selection estimate, NSA with demo-nsa-32k's params), sparse at its defaults, moba at
the paper's defaults (its gate), NSA at the paper's defaults (memory), at 32k and 131k; decode at a
131k cache (moba/nsa query-aware with decode_topk 8, sparse). Per case: median ms of the timed calls
after an untimed first call (compiles), speedup over SDPA, the ideal speedup (exact's attended pairs
/ the method's, selection included) and achieved / ideal, the selection's own time (query-aware
cases), the CUDA allocator's peak during one call beyond what was allocated before it. Also the hybrid
selection of demo-moba-32k / demo-nsa-32k, on flex only. The JSON is
rewritten after every case, so a run cut short
keeps what it measured; a case that fails records its error and the run goes on.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longpatch.methods import flex  # noqa: E402
from longpatch.methods.base import get_method  # noqa: E402
from longpatch.methods.selection import estimated_blocks  # noqa: E402
from longpatch.ops import moba_attention, nsa_attention, sparse_attention  # noqa: E402

MOBA_QA = dict(selection="estimate", chunk_size=256, topk=16, mass=0.9, estimate_queries=64, local_blocks=1)
NSA_QA = dict(selection="estimate", compress_block=32, compress_stride=16, select_block=256, num_selected=16,
              window=256, init_blocks=1, local_blocks=2, gates=(0.0, 0.9, 0.1), mass=0.9, estimate_queries=64)
# the hybrid selection of the bundled demo-moba-32k / demo-nsa-32k: flex only, to keep the run short
MOBA_HYB = {**MOBA_QA, "selection": "hybrid", "score_stride": 16}
NSA_HYB = {**NSA_QA, "selection": "hybrid", "score_stride": 16}
SPARSE = dict(window=1024, global_tokens=64)
OPS = {"moba": moba_attention, "nsa": nsa_attention, "sparse": sparse_attention}


def timed(fn, repeats: int, sync) -> tuple[float, float, object]:
    """(first call s, median ms of ``repeats`` more, the first call's result)."""
    sync()
    t0 = time.perf_counter()
    res = fn()
    sync()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return first, statistics.median(times), res


def peak_mb(fn, dev) -> float | None:
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 20


def sdpa(q, k, v, causal=True):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def ideal(method: str, params: dict, q, k) -> float | None:
    """Exact's causal pairs over the method's (selection included), as `bench attention` counts them."""
    n = q.shape[2]
    bound = get_method(method).bind({k_: (list(v) if isinstance(v, tuple) else v) for k_, v in params.items()},
                                     q.shape[-1])
    pairs = bound.attended_pairs(q, k, True)
    return None if not pairs else q.shape[0] * q.shape[1] * n * (n + 1) / 2 / pairs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (backends flex and torch)")
    ap.add_argument("--lengths", default=None, help="prefill lengths (default 32768,131072; dry run 1024,2048)")
    ap.add_argument("--decode-len", type=int, default=None, help="decode cache length (default 131072)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    dry = args.dry_run
    dev = torch.device("cpu" if dry or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    heads, kv_heads, d = (4, 2, 32) if dry else (32, 8, 128)
    lengths = [int(x) for x in (args.lengths or ("1024,2048" if dry else "32768,131072")).split(",")]
    decode_len = args.decode_len or (2048 if dry else 131072)
    other = "torch" if dev.type == "cpu" else "triton"
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    scale = d ** -0.5
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = {"meta": {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
                    "dtype": str(dtype), "heads": heads, "kv_heads": kv_heads, "head_dim": d, "batch": 1,
                    "repeats": args.repeats, "dry_run": dry,
                    "note": "ms: median of the timed calls after one untimed call; speedup vs SDPA (torch's) at the "
                            "same shape in this run; ideal: exact's attended pairs / the method's (selection "
                            "included); peak_mb: CUDA allocator peak beyond what was allocated before the call"},
           "warm_up": None, "prefill": [], "decode": []}

    def save():
        out.write_text(json.dumps(res, indent=1))

    def case(section, row, fn):
        try:
            row.update(fn())
        except Exception as e:  # one failing case must not cost the others
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]
            traceback.print_exc()
        res[section].append(row)
        print(json.dumps(row), flush=True)
        save()

    # compiles first, reported: the block sizes and windows the cases below use
    res["warm_up"] = flex.warm_up(dev, dtype, heads, kv_heads, d, blocks=(256,), bands=((256, 0), (1024, 64)),
                                  lengths=(4096, 6144) if not dry else (300, 700), decode_local=(1,))
    save()

    def prefill_at(n):
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, heads, n, d, device=dev, dtype=dtype, generator=g)
        k, v = (torch.randn(1, kv_heads, n, d, device=dev, dtype=dtype, generator=g) for _ in range(2))
        first, base_ms, _ = timed(lambda: sdpa(q, k, v), args.repeats, sync)
        case("prefill", {"method": "sdpa", "n": n},
             lambda: {"ms": base_ms, "peak_mb": peak_mb(lambda: sdpa(q, k, v), dev)})
        # moba with {}: the paper's defaults (the gate: chunks of 2048, top-4), on flex since the gate runs there
        # the query-aware lists: flex only on a GPU (the executor's Triton kernel was removed after the first
        # two leases measured flex 2.0-2.5x faster: docs/gpu.md)
        qa = ("flex",) if dev.type == "cuda" else ("flex", other)
        for name, params, backends in (("moba", MOBA_QA, qa), ("nsa", NSA_QA, qa),
                                       ("moba", MOBA_HYB, ("flex",)), ("nsa", NSA_HYB, ("flex",)),
                                       ("sparse", SPARSE, ("flex", other)), ("moba", {}, ("flex", other))):
            for backend in backends:
                def run(name=name, params=params, backend=backend):
                    op = OPS[name]
                    first, ms, _ = timed(lambda: op(q, k, v, backend=backend, **params), args.repeats, sync)
                    row = {"first_call_s": first, "ms": ms, "speedup": base_ms / ms,
                           "peak_mb": peak_mb(lambda: op(q, k, v, backend=backend, **params), dev)}
                    ide = ideal(name, params, q, k)
                    if ide:
                        row.update(ideal=ide, achieved_over_ideal=row["speedup"] / ide)
                    if "selection" in params:  # the selection alone (the executor gets its lists)
                        blk = params.get("chunk_size", params.get("select_block"))
                        most = params.get("topk", params.get("num_selected")) - 1
                        local = params["local_blocks"] - (name == "nsa")
                        scoring = ("estimate", params["estimate_queries"])
                        if params["selection"] == "hybrid":
                            scoring = ("hybrid", params["estimate_queries"], params["score_stride"])
                        _, sel_ms, _ = timed(lambda: estimated_blocks(q, k, blk, most, params["mass"], scoring,
                                                                      local, scale), args.repeats, sync)
                        row.update(selection_ms=sel_ms, selection_share=sel_ms / ms)
                    return row
                kind = {"estimate": "query-aware", "hybrid": "hybrid"}.get(params.get("selection"), "defaults")
                case("prefill", {"method": name, "params": kind,
                                 "backend": backend, "n": n}, run)
        if n == lengths[-1]:  # NSA at the paper's defaults: the memory figure (42 GB at 131k before)
            case("prefill", {"method": "nsa", "params": "paper defaults", "backend": other, "n": n},
                 lambda: dict(zip(("first_call_s", "ms"), timed(lambda: nsa_attention(q, k, v, backend=other), 1,
                                                               sync)[:2]),
                              peak_mb=peak_mb(lambda: nsa_attention(q, k, v, backend=other), dev)))

    with torch.no_grad():
        for n in lengths:
            prefill_at(n)
        # decode: one query at the last position of a cache of decode_len keys
        n = decode_len
        g = torch.Generator(device=dev).manual_seed(1)
        q = torch.randn(1, heads, 1, d, device=dev, dtype=dtype, generator=g)
        k, v = (torch.randn(1, kv_heads, n, d, device=dev, dtype=dtype, generator=g) for _ in range(2))
        _, base_ms, _ = timed(lambda: sdpa(q, k, v, causal=False), max(20, args.repeats), sync)
        case("decode", {"method": "sdpa", "n": n}, lambda: {"ms": base_ms})
        for name, params in (("moba", {**MOBA_QA, "decode_topk": 8}), ("nsa", {**NSA_QA, "decode_topk": 8}),
                             ("sparse", SPARSE)):
            def step(name=name, params=params):
                state = {} if name != "sparse" else None  # the query-aware state: kept blocks and key bounds
                kw = dict(params, **({"state": state} if state is not None else {}))
                OPS[name](q, k, v, **kw)  # the first step estimates its blocks once (a cache built elsewhere)
                first, ms, _ = timed(lambda: OPS[name](q, k, v, **kw), max(20, args.repeats), sync)
                return {"ms": ms, "speedup": base_ms / ms}
            case("decode", {"method": name, "params": "query-aware" if "selection" in params else "defaults",
                            "backend": "auto (flex for the query-aware steps on CUDA)", "n": n}, step)
    save()
    print(f"written to {out}")


if __name__ == "__main__":
    main()
