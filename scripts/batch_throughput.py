"""Throughput of `eval needle` at batch sizes 1 and 8 on the demo model (8 prompts of 8192 tokens per
configuration, two interleaved rounds): prints prompts/s per (config, batch) and writes
docs/img/batch_needle_8k.json-style JSON to the path given (default /tmp/tp/summary.json)."""
import json
import sys
import time

from longpatch.eval.needle.run import needle


def main(out_json: str = "/tmp/tp/summary.json") -> None:
    res = {}
    for rnd in range(2):
        for config, counts in (("demo", "0"), ("demo-moba", "4"), ("demo-nsa", "4")):
            for bs in (1, 8):
                t0 = time.perf_counter()
                r = needle("demo", counts, config=config, lengths="8192", depths="0.1:0.9:0.1143", trials=1,
                           batch_size=bs, out=f"/tmp/tp/{config}_{bs}_{rnd}", progress=False, plots=False)
                dt = time.perf_counter() - t0
                n = len(r["records"])
                acc = sum(x["correct"] for x in r["records"]) / n
                res.setdefault(f"{config}:{counts}", {}).setdefault(bs, []).append((dt, n, acc))
                print(config, counts, "batch", bs, "round", rnd, f"{dt:.1f}s for {n} prompts, {n / dt:.3f} "
                      f"prompts/s, accuracy {acc:.2f}", flush=True)
    with open(out_json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
