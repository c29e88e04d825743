"""Every method's Triton path against its PyTorch twin on the same device: prefill (causal and, where
the method has it, non-causal), the gradients where the kernel has a backward, and one decode step.

On a GPU this is the check that no CPU can make: the kernels compiled for the card (the test suite
runs them under TRITON_INTERPRET=1 only). On the CPU it runs the same comparisons in the interpreter
at small shapes (tests/test_gpu_kernels_script.py), so the script itself stays tested.

    python scripts/gpu_kernels.py --device cuda --out runs/gpu_kernels          # on a GPU
    TRITON_INTERPRET=1 python scripts/gpu_kernels.py --device cpu --n 96 --heads 2 --kv-heads 1 --head-dims 16

Each case: relative error ‖o_triton − o_torch‖ / ‖o_torch‖ (and of dq, dk, dv), against a tolerance
per dtype. Prints a table, writes results.json; exits 1 when a case fails or raises.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longpatch.bench.common import bench_device, show_table, torch_dtype  # noqa: E402
from longpatch.errors import LongpatchError  # noqa: E402
from longpatch.methods import get_method  # noqa: E402
from longpatch.outdir import write_json  # noqa: E402

# relative tolerance of the Triton path against the torch path on the same inputs: bf16 rounds the
# probabilities and partial sums at 8 bits of mantissa, and the two paths add in different orders
TOL = {"float32": 2e-3, "bfloat16": 3e-2, "float16": 1e-2}
# the methods with a Triton path, with params that give several blocks at the shapes below
METHODS = {
    "exact": {},
    "hyper": {"block_size": 64, "sample_size": 64, "min_seq_len": 64, "seed": 0},
    "moba": {"chunk_size": 128, "topk": 3},
    "nsa": {"select_block": 32, "num_selected": 4, "window": 64, "compress_block": 16, "compress_stride": 8},
    "sparse": {"block_size": 32, "window": 64},
    "linear": {},
    "performer": {"seed": 0},
}


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _bind(name: str, n: int, d: int, scale_params: bool):
    params = dict(METHODS[name])
    if scale_params:  # small CPU shapes: blocks a quarter as large, so that several still fit
        params = {k: max(4, v // 4) if isinstance(v, int) and k not in ("seed", "topk", "num_selected") else v
                  for k, v in params.items()}
    method = get_method(name)
    return method, method.bind({k: v for k, v in params.items() if k in method.params}, d)


def _case(name, n, heads, kv_heads, d, dtype, causal, device, grad, scale_params) -> dict:
    method, bound = _bind(name, n, d, scale_params)
    g = torch.Generator().manual_seed(n + d)
    q, k, v = (torch.randn(1, h, n, d, generator=g).to(device=device, dtype=dtype)
               for h in (heads, kv_heads, kv_heads))
    row = dict(method=name, n=n, heads=heads, kv_heads=kv_heads, d=d, dtype=str(dtype).removeprefix("torch."),
               causal=causal)
    outs = {}
    for backend in ("torch", "triton"):
        qq, kk, vv = (t.detach().clone().requires_grad_(grad) for t in (q, k, v))
        o = bound(qq, kk, vv, causal=causal, backend=backend)
        if grad:
            o.float().pow(2).sum().backward()
            outs[backend] = (o.detach(), qq.grad, kk.grad, vv.grad)
        else:
            outs[backend] = (o.detach(),)
    names = ("out", "dq", "dk", "dv")
    for key, a, b in zip(names, outs["triton"], outs["torch"]):
        row[f"err_{key}"] = _rel(a, b)
        row[f"finite_{key}"] = bool(torch.isfinite(a).all())
    if method.decode is not None and causal:
        with torch.no_grad():
            steps = {}
            for backend in ("torch", "triton"):
                state = bound.init_state(k[:, :, :-1], v[:, :, :-1])
                steps[backend] = bound(q[:, :, -1:], k, v, causal=True, backend=backend, state=state)
            row["err_decode"] = _rel(steps["triton"], steps["torch"])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--n", type=int, nargs="+", default=[4096, 5000])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--grad-n", type=int, default=1024,
                    help="gradients at this length, first head dim, float32 (0: none)")
    ap.add_argument("--out", default="runs/gpu_kernels")
    args = ap.parse_args(argv)
    try:
        device = bench_device(args.device)
        dtypes = [torch_dtype(x) for x in args.dtypes.split(",")]
        methods = [m for m in args.methods.split(",") if m]
        for m in methods:
            if m not in METHODS:
                raise LongpatchError(f"--methods: got {m!r}; allowed: {', '.join(METHODS)}")
    except LongpatchError as e:
        print(f"gpu_kernels: error: {e}", file=sys.stderr)
        return 2
    small = device.type == "cpu"
    jobs = [(m, n, d, dt, c, False) for m in methods for n in args.n for d in args.head_dims for dt in dtypes
            for c in (True, False) if c or not get_method(m).causal_only]
    if args.grad_n:
        jobs += [(m, args.grad_n, args.head_dims[0], torch.float32, True, True) for m in methods]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=str(device), gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                torch=torch.__version__, tolerance=TOL)
    rows = []
    for m, n, d, dt, causal, grad in jobs:
        t0 = time.perf_counter()
        try:
            row = _case(m, n, args.heads, args.kv_heads, d, dt, causal, device, grad, small)
        except Exception as e:  # noqa: BLE001 - a kernel that fails to compile or run is a result here
            row = dict(method=m, n=n, d=d, dtype=str(dt).removeprefix("torch."), causal=causal,
                       error=f"{type(e).__name__}: {e}".splitlines()[0][:300], trace=traceback.format_exc()[-2000:])
        row["grad"] = grad
        row["seconds"] = time.perf_counter() - t0
        tol = TOL[row["dtype"]]
        errs = {k: v for k, v in row.items() if k.startswith("err_")}
        row["ok"] = "error" not in row and all(e <= tol for e in errs.values()) and all(
            row[k] for k in row if k.startswith("finite_"))
        rows.append(row)
        # one line per case as it ends: a run cut short still shows what it checked
        print(f"[gpu_kernels] {m} n={n} d={d} {row['dtype']} {'causal' if causal else 'full'}"
              f"{' grad' if grad else ''}: {'ok' if row['ok'] else 'FAIL'} "
              f"{row.get('error') or ' '.join(f'{k[4:]}={v:.1e}' for k, v in errs.items())} "
              f"({row['seconds']:.1f} s)", flush=True)
        write_json(out / "results.json", {"meta": meta, "rows": rows})  # after each case: a cut run keeps them

    def f(r, k):
        return "–" if r.get(k) is None else f"{r[k]:.1e}"

    show_table(f"Triton vs torch on {device}", ["method", "n", "d", "dtype", "mask", "grad", "out", "dq", "dk", "dv",
                                                "decode", "ok"],
               [[r["method"], str(r["n"]), str(r["d"]), r["dtype"], "causal" if r["causal"] else "full",
                 "yes" if r["grad"] else "", f(r, "err_out"), f(r, "err_dq"), f(r, "err_dk"), f(r, "err_dv"),
                 f(r, "err_decode"), "ok" if r["ok"] else ("ERROR" if "error" in r else "FAIL")] for r in rows])
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} cases ok; wrote {out / 'results.json'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
