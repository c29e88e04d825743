"""Build a calibration text for `longpatch calibrate` at lengths the demo's documents do not reach.

The demo's held-out documents (longpatch.assets.eval_documents, 4k to 19k tokens each) are joined in
their shipped order, separated by a blank line, and cut into documents of at least --min-tokens demo
tokens, written as a LongBench-style directory (<subset>.jsonl) that `--data` reads:

    python scripts/calibration_text.py --out runs/calibration-32k --min-tokens 32768
    longpatch calibrate --model demo --config demo-moba-32k --data runs/calibration-32k --seq-len 32768

Only the demo's own held-out documents go in: a calibration never sees the corpora it is reported on.
"""
import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="new directory for narrativeqa.jsonl")
    ap.add_argument("--min-tokens", type=int, default=32768, help="demo tokens per document (>= 1)")
    args = ap.parse_args()
    if args.min_tokens < 1:
        raise SystemExit(f"--min-tokens: got {args.min_tokens}; allowed: an int >= 1")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"--out: {out} is not empty; allowed: a new or empty directory")
    from longpatch.assets import eval_documents
    from longpatch.loading import load_model

    _, tok = load_model("demo")
    docs, parts, count = [], [], 0
    for text in eval_documents():
        parts.append(text)
        count += len(tok(text)["input_ids"])
        if count >= args.min_tokens + 16:  # a margin: the joined text tokenizes a little differently
            docs.append("\n\n".join(parts))
            parts, count = [], 0
    if not docs:
        raise SystemExit(f"--min-tokens: the demo's documents hold fewer than {args.min_tokens} tokens")
    out.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"input": "", "context": d, "answers": [""], "length": len(d.split()),
                         "dataset": "narrativeqa", "language": "en", "all_classes": None, "_id": f"demo-joined-{i}"})
             for i, d in enumerate(docs)]
    (out / "narrativeqa.jsonl").write_text("\n".join(lines) + "\n")
    print(f"{len(docs)} documents of >= {args.min_tokens} tokens written to {out / 'narrativeqa.jsonl'}")


if __name__ == "__main__":
    main()
