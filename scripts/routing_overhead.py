"""What routing costs: the whole forward of a model at n tokens, unpatched vs patched
with exact attention in every layer (`method: exact`: the same math, through longpatch's route),
interleaved repeat by repeat, medians. Timing is off (the default of a patched model), so this is
the cost a served model pays.

    python scripts/routing_overhead.py --model demo --n 4096 --repeats 15 --out runs/routing_overhead

Prints the table and writes results.json into --out.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from longpatch import load_model, patch_model, unpatch_model
from longpatch.bench.common import machine_meta, show_table
from longpatch.outdir import write_json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="runs/routing_overhead")
    a = ap.parse_args(argv)
    for name in ("n", "repeats"):
        if getattr(a, name) < 1:
            print(f"routing_overhead: error: --{name}: got {getattr(a, name)}; allowed: an int >= 1", file=sys.stderr)
            return 2
    model, _ = load_model(a.model)
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, a.n), generator=torch.Generator().manual_seed(0))
    cfg = {"method": "exact", "layers": "all"}

    def forward():
        with torch.no_grad():
            model(ids)

    times = {"unpatched": [], "patched (exact)": []}
    forward()
    for _ in range(a.repeats):  # interleaved: both see the same load
        for side in times:
            if side != "unpatched":
                patch_model(model, cfg)
            t0 = time.perf_counter()
            forward()
            times[side].append(time.perf_counter() - t0)
            if side != "unpatched":
                unpatch_model(model)
    ms = {side: statistics.median(t) * 1e3 for side, t in times.items()}
    overhead = ms["patched (exact)"] / ms["unpatched"] - 1
    show_table(f"{a.model}: forward at {a.n} tokens, median of {a.repeats} interleaved repeats",
               ["model", "forward ms", "vs unpatched"],
               [[side, f"{v:.1f}", f"{v / ms['unpatched'] - 1:+.1%}"] for side, v in ms.items()], left=("model",))
    rows = [{"side": side, "forward_ms": v, "times_ms": [t * 1e3 for t in times[side]]} for side, v in ms.items()]
    write_json(Path(a.out) / "results.json", {"meta": machine_meta(repeats=a.repeats, model=a.model, n=a.n),
                                              "rows": rows})
    print(f"routing overhead: {overhead:+.2%} (goal: <= +2%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
