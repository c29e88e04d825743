"""Does the FlexAttention path (backend flex) give the torch path's outputs on this device? Correctness
before speed: each block-sparse case of scripts/gpu_flex.py at small shapes, fp32 and bf16, ragged
lengths, and the demo model's logits with every layer patched (flex against torch on the same device);
then the query-aware selections' GPU form (longpatch/methods/gpu_scores.py: half-precision products,
fused passes) against the CPU's float32 code on the same bf16 values: the block masses' largest
difference and the share of block-list entries that agree.

    python scripts/gpu_flex_check.py --out runs/gpu/flex_check.json              # on a CUDA machine
    python scripts/gpu_flex_check.py --out /tmp/flex_check.json --device cpu      # the same, on the CPU

Per case: the largest |flex - torch| over the largest |torch| (relative), and whether it is within the
dtype's tolerance (fp32 1e-3, bf16 3e-2). Per demo config: the logits' relative difference and the
share of positions whose top token agrees. Per selection: ok when at least 99% of the entries agree
(the two sum in different orders, which may flip a near-tie). Exits 1 when a case is off, 0 when all agree.
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longpatch.methods.selection import antidiagonal_scores, estimated_blocks, last_queries_vertical  # noqa: E402
from longpatch.ops import moba_attention, nsa_attention, sparse_attention  # noqa: E402

D = 128  # the selection checks' head size
BLOCK = 128  # small enough that a few thousand tokens hold many blocks
CASES = {
    "moba estimate": (moba_attention, dict(selection="estimate", chunk_size=BLOCK, topk=6, mass=0.9,
                                           estimate_queries=64, local_blocks=1)),
    "moba hybrid": (moba_attention, dict(selection="hybrid", chunk_size=BLOCK, topk=6, mass=0.9, estimate_queries=64,
                                         score_stride=16, local_blocks=1)),
    "nsa estimate": (nsa_attention, dict(selection="estimate", compress_block=32, compress_stride=16,
                                         select_block=BLOCK, num_selected=6, window=256, local_blocks=2,
                                         gates=(0.0, 0.9, 0.1), mass=0.9, estimate_queries=64)),
    "nsa hybrid": (nsa_attention, dict(selection="hybrid", compress_block=32, compress_stride=16, select_block=BLOCK,
                                       num_selected=6, window=256, local_blocks=2, gates=(0.0, 0.9, 0.1), mass=0.9,
                                       estimate_queries=64, score_stride=16)),
    "sparse": (sparse_attention, dict(window=512, global_tokens=64)),
    "moba gate": (moba_attention, dict(chunk_size=BLOCK, topk=3)),
}
TOL = {torch.float32: 1e-3, torch.bfloat16: 3e-2}


def rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", default="2000,4100")
    ap.add_argument("--demo-len", type=int, default=4096, help="0: no demo-model check")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    res = {"device": str(dev), "torch": torch.__version__, "cases": [], "selection": [], "demo": []}
    bad = False

    def record(section, row):
        nonlocal bad
        bad |= not row.get("ok", False)
        res[section].append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1))

    dtypes = (torch.float32, torch.bfloat16) if dev.type == "cuda" else (torch.float32,)
    with torch.no_grad():
        # first: the selections' GPU form (its check was cut by a step limit after the cases on an H100)
        for n in (int(x) for x in args.lengths.split(",")):
            g = torch.Generator(device=dev).manual_seed(n + 1)
            dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
            q = torch.randn(1, 8, n, D, device=dev, dtype=dtype, generator=g) * 2
            k = torch.randn(1, 2, n, D, device=dev, dtype=dtype, generator=g) * 2
            for scoring in (("estimate", 64), ("hybrid", 64, 16)):
                row = {"selection": scoring[0], "dtype": str(dtype), "n": n}
                try:
                    both = ((q, k), (q.cpu(), k.cpu()))  # this device's form, the CPU's float32 code
                    sel = [estimated_blocks(x, y, BLOCK, 6, 0.9, scoring, 1, D ** -0.5, final_topk=2) for x, y in both]
                    mass = [last_queries_vertical(x, y, BLOCK, 64, D ** -0.5)[0] for x, y in both]
                    row.update(agree=(sel[0].cpu() == sel[1]).float().mean().item(),
                               mass_err=(mass[0].cpu() - mass[1]).abs().max().item())
                    if scoring[0] == "hybrid":
                        anti = [antidiagonal_scores(x, y, BLOCK, 16, D ** -0.5) for x, y in both]
                        fin = anti[1].isfinite()
                        row["anti_err"] = (anti[0].cpu()[fin] - anti[1][fin]).abs().max().item()
                    row["ok"] = row["agree"] >= 0.99
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                    traceback.print_exc()
                record("selection", row)
        for dtype in dtypes:
            for n in (int(x) for x in args.lengths.split(",")):
                g = torch.Generator(device=dev).manual_seed(n)
                q = torch.randn(1, 4, n, 64, device=dev, dtype=dtype, generator=g)
                k, v = (torch.randn(1, 2, n, 64, device=dev, dtype=dtype, generator=g) for _ in range(2))
                for name, (op, params) in CASES.items():
                    row = {"case": name, "dtype": str(dtype), "n": n}
                    try:
                        err = rel(op(q, k, v, backend="flex", **params), op(q, k, v, backend="torch", **params))
                        row.update(rel_err=err, ok=err <= TOL[dtype])
                    except Exception as e:  # one failing case must not hide the others
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                        traceback.print_exc()
                    record("cases", row)
        if args.demo_len:
            from longpatch.config import load_config
            from longpatch.loading import load_model
            from longpatch.patching import patch_model

            ids = torch.randint(3, 1000, (1, args.demo_len), generator=torch.Generator().manual_seed(0)).to(dev)
            for config in ("demo-moba-32k", "demo-nsa-32k"):
                row = {"config": config, "n": args.demo_len}
                try:
                    logits = {}
                    for backend in ("torch", "flex"):
                        model, _ = load_model("demo")
                        model.to(dev)
                        patch_model(model, load_config(config).with_overrides([("backend", backend)]))
                        logits[backend] = model(ids).logits.float()
                    agree = logits["flex"].argmax(-1) == logits["torch"].argmax(-1)
                    row.update(rel_err=rel(logits["flex"], logits["torch"]), top1_agree=agree.float().mean().item())
                    row["ok"] = row["top1_agree"] >= 0.99
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                    traceback.print_exc()
                record("demo", row)
    print("all agree" if not bad else "SOME CASES DISAGREE OR FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
