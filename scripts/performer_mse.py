#!/usr/bin/env python
"""Reproduce the Performer paper's Figure 4: MSE of the approximate attention output vs the number
of random features m, positive vs trigonometric features, orthogonal vs i.i.d. directions.

Setup as in the paper: L = 4096 tokens, head dim d = 16, bidirectional (non-causal) attention,
15 random input matrices; for each, Q, K, V have i.i.d. N(0, sigma²) entries and one fresh feature
draw per (variant, m). The error is mean((out − softmax_out)²) over the whole [L, d] output; we
report its mean and standard deviation over the 15 inputs. The paper's inputs are "suitably
normalised" random matrices; the scale matters a lot (the positive estimator's variance grows
like exp(|x + y|²)), so the script runs several ``--sigmas`` (x = q · d^-1/4: |x|² ≈ 4 sigma² at
d = 16), one plot panel each.

    python scripts/performer_mse.py --out docs/img            # writes performer_mse.json / .png
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from longpatch.methods.exact import exact_attention
from longpatch.methods.performer import gaussian_projection, performer_attention

VARIANTS = [  # (label, feature_type, orthogonal)
    ("positive, orthogonal", "positive", True),
    ("positive, iid", "positive", False),
    ("trig, orthogonal", "trig", True),
    ("trig, iid", "trig", False),
]


UNIFORM = "uniform (mean of V)"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def run(length: int, dim: int, features: list[int], samples: int, sigmas: list[float], seed: int) -> dict:
    rows = []
    for sigma in sigmas:
        errs = {(label, m): [] for label, _, _ in VARIANTS for m in features}
        uniform = []  # the trivial baseline: every query gets the mean of V
        for s in range(samples):
            g = torch.Generator().manual_seed(seed * 100_003 + s)
            q, k, v = (torch.randn(1, 1, length, dim, generator=g) for _ in range(3))
            q, k = q * sigma, k * sigma
            exact = exact_attention(q, k, v, causal=False)
            uniform.append(float(((v.mean(2, keepdim=True) - exact) ** 2).mean()))
            for vi, (label, ftype, orth) in enumerate(VARIANTS):
                for m in features:
                    w = gaussian_projection(m, dim, seed=(seed * 7919 + s) * 1009 + m * 4 + vi, orthogonal=orth)
                    out = performer_attention(q, k, v, causal=False, projection=w, feature_type=ftype)
                    errs[(label, m)].append(float(((out - exact) ** 2).mean()))
        for (label, m), e in errs.items():
            t = torch.tensor(e, dtype=torch.float64)
            finite = bool(torch.isfinite(t).all())
            rows.append(dict(sigma=sigma, variant=label, num_features=m,
                             mse_mean=float(t.mean()) if finite else None,
                             mse_std=float(t.std()) if finite else None,
                             mse_median=float(t.median()), samples=len(e)))
        t = torch.tensor(uniform, dtype=torch.float64)
        rows.append(dict(sigma=sigma, variant=UNIFORM, num_features=None, mse_mean=float(t.mean()),
                         mse_std=float(t.std()), mse_median=float(t.median()), samples=len(uniform)))
    return {"length": length, "head_dim": dim, "samples": samples, "seed": seed,
            "inputs": "q, k, v ~ N(0, sigma^2) i.i.d. entries (v: sigma = 1); non-causal; float32",
            "metric": "mean over [L, d] of (performer - softmax)^2; mean/std over samples", "rows": rows}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sigmas = sorted({r["sigma"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(sigmas), figsize=(5.2 * len(sigmas), 4.0), squeeze=False)
    styles = {"positive, orthogonal": ("tab:blue", "-"), "positive, iid": ("tab:blue", "--"),
              "trig, orthogonal": ("tab:red", "-"), "trig, iid": ("tab:red", "--")}
    for ax, sigma in zip(axes[0], sigmas):
        for label, _, _ in VARIANTS:
            pts = [r for r in result["rows"] if r["sigma"] == sigma and r["variant"] == label and r["mse_mean"]]
            if not pts:
                continue
            m = [r["num_features"] for r in pts]
            mean = [r["mse_mean"] for r in pts]
            lo = [max(r["mse_mean"] - r["mse_std"], r["mse_mean"] * 0.05) for r in pts]
            hi = [r["mse_mean"] + r["mse_std"] for r in pts]
            color, ls = styles[label]
            ax.plot(m, mean, ls, color=color, marker="o", ms=3, label=label)
            ax.fill_between(m, lo, hi, color=color, alpha=0.12)
        base = next(r for r in result["rows"] if r["sigma"] == sigma and r["variant"] == UNIFORM)
        ax.axhline(base["mse_mean"], color="gray", ls=":", label=UNIFORM)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("random features m")
        ax.set_ylabel("output MSE vs softmax")
        ax.set_title(f"L={result['length']}, d={result['head_dim']}, entries N(0, {sigma:g}²)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/performer_mse", help="directory for performer_mse.json and .png")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--features", type=_ints, default=[16, 32, 64, 128, 256])
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--sigmas", type=_floats, default=[0.5, 1.0], help="input scales, one panel each")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    result = run(a.length, a.dim, a.features, a.samples, a.sigmas, a.seed)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "performer_mse.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "performer_mse.png")
    for sigma in a.sigmas:
        print(f"sigma = {sigma:g}: output MSE (mean over {a.samples} inputs)")
        print("variant".ljust(22) + "".join(f"m={m}".rjust(11) for m in a.features))
        for label, _, _ in VARIANTS:
            cells = []
            for m in a.features:
                r = next(r for r in result["rows"] if r["sigma"] == sigma and r["variant"] == label
                         and r["num_features"] == m)
                cells.append("inf".rjust(11) if r["mse_mean"] is None else f"{r['mse_mean']:.2e}".rjust(11))
            print(label.ljust(22) + "".join(cells))
        base = next(r for r in result["rows"] if r["sigma"] == sigma and r["variant"] == UNIFORM)
        print(f"{UNIFORM}: {base['mse_mean']:.2e}")
    print(f"wrote {out / 'performer_mse.json'} and {out / 'performer_mse.png'} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
