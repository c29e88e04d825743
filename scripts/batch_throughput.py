"""Throughput of `eval needle` at several batch sizes on the demo model: 8 passkey prompts of --length
tokens per (config, batch size), on the GPU when one is visible (as `eval needle` runs), the batch
sizes taking turns in each round so that a machine's drift reaches them alike. One untimed warm-up
generation per config first (on a GPU: the Triton kernels compile there).

Prints prompts/s per (config, batch) and the gain over batch 1, from two clocks:
  * ``gen``: the records' own seconds (the generations: prefill and decode, loading excluded);
  * ``wall``: the whole `eval needle` call (loading the model, tokenising, writing records).
Writes the rows and a summary to --out (JSON).

    python scripts/batch_throughput.py --batch-sizes 1,4,8 --rounds 2 --out runs/tp.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longpatch.eval.needle.run import needle  # noqa: E402
from longpatch.outdir import write_json  # noqa: E402

DEPTHS = "0.1:0.9:0.1143"  # 8 depths, one prompt each


def _run(config, layers, length, batch, out, depths=DEPTHS):
    t0 = time.perf_counter()
    r = needle("demo", layers, config=config, lengths=str(length), depths=depths, trials=1, batch_size=batch,
               out=out, progress=False, plots=False)
    wall = time.perf_counter() - t0
    recs = r["records"]
    return dict(wall_s=wall, gen_s=sum(x["seconds"] for x in recs), prompts=len(recs),
                accuracy=sum(x["correct"] for x in recs) / len(recs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="demo:0,demo-moba:4,demo-nsa:4", help="CONFIG:LAYERS,...")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="runs/batch_throughput.json")
    args = ap.parse_args(argv)
    configs = [tuple(c.split(":")) for c in args.configs.split(",")]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for config, layers in configs:  # warm-up: kernels compile, caches fill
            _run(config, layers, min(args.length, 1024), max(sizes), f"{tmp}/warm-{config}", "0.5:0.6:0.1")
        for rnd in range(args.rounds):
            for config, layers in configs:
                for b in sizes:
                    row = dict(config=config, layers=int(layers), batch=b, round=rnd,
                               **_run(config, layers, args.length, b, f"{tmp}/{config}-{b}-{rnd}"))
                    rows.append(row)
                    print(f"{config}:{layers} batch {b} round {rnd}: {row['prompts']} prompts, generation "
                          f"{row['gen_s']:.2f} s ({row['prompts'] / row['gen_s']:.3f} prompts/s), wall "
                          f"{row['wall_s']:.2f} s, accuracy {row['accuracy']:.2f}", flush=True)
    summary = []
    for config, layers in configs:
        base = None
        for b in sizes:
            mine = [r for r in rows if r["config"] == config and r["batch"] == b]
            gen = statistics.median(r["prompts"] / r["gen_s"] for r in mine)
            wall = statistics.median(r["prompts"] / r["wall_s"] for r in mine)
            base = base or (gen, wall)
            summary.append(dict(config=config, layers=int(layers), batch=b, gen_prompts_per_s=gen,
                                wall_prompts_per_s=wall, gen_gain=gen / base[0], wall_gain=wall / base[1]))
            print(f"{config}:{layers} batch {b}: {gen:.3f} prompts/s ({gen / base[0]:.2f}x batch 1), "
                  f"wall {wall:.3f} ({wall / base[1]:.2f}x)")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"  # where eval needle runs
    write_json(args.out, {"meta": {"device": device, "threads": torch.get_num_threads(), "length": args.length,
                                   "rounds": args.rounds},
                          "rows": rows, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
