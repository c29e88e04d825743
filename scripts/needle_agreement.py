"""Do two runs of `longpatch eval needle` agree prompt by prompt? Issue 41's GPU goal: the configs keep on
the GPU path (flex, Triton) the needles they keep on the CPU (the torch path).

    python scripts/needle_agreement.py --reference docs/img/heldout/grid_passkey/records.jsonl \\
        docs/img/heldout/rerun/seed0_passkey/records.jsonl --other runs/gpu/needle_passkey/records.jsonl \\
        --out runs/gpu/needle_agreement_passkey.json

Prompts are matched by (config, layers, digest): the same prompt under the same configuration. Per config
it counts the prompts both runs have, those answered the same way (found / not found) and with the same
text, and in each run the needles kept of those its own exact attention finds. Prints a table, writes
JSON, and exits 1 when a config keeps fewer of exact's needles in the other run than in the reference
(0 when it keeps as many or more, 2 on bad input). Only reads the records.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def read(path: Path) -> dict:
    """{(config, digest): record} of a records.jsonl (exact's under config 'exact'); later lines win."""
    out = {}
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by an interrupted write
        name = "exact" if not r.get("layers") else r["config"]
        out[(name, r["digest"])] = r
    return out


def kept(run: dict, config: str, digests: set) -> tuple[int, int]:
    """(needles `config` finds among those exact finds, exact's found) on `digests`."""
    found = {d for d in digests if run.get(("exact", d), {}).get("correct")}
    return sum(bool(run.get((config, d), {}).get("correct")) for d in found), len(found)


def compare(ref: dict, other: dict) -> dict:
    common = defaultdict(set)
    for key in ref.keys() & other.keys():
        common[key[0]].add(key[1])
    rows = {}
    both_exact = common.get("exact", set())
    for config, digests in sorted(common.items()):
        same = sum(ref[(config, d)]["correct"] == other[(config, d)]["correct"] for d in digests)
        text = sum(ref[(config, d)].get("predicted") == other[(config, d)].get("predicted") for d in digests)
        row = {"prompts": len(digests), "same_answer": same, "same_text": text}
        if config != "exact":
            scored = digests & both_exact  # exact ran on these prompts in both runs
            row["reference_kept"], row["reference_exact"] = kept(ref, config, scored)
            row["other_kept"], row["other_exact"] = kept(other, config, scored)
        rows[config] = row
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", required=True, nargs="+",
                    help="records.jsonl of the reference run (e.g. the CPU's); several: read in turn, a later "
                         "file's record of the same prompt and config wins (a config re-run beside exact's records)")
    ap.add_argument("--other", required=True, help="records.jsonl of the run to compare (e.g. the GPU's)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)
    for flag, p in [("--reference", r) for r in args.reference] + [("--other", args.other)]:
        if not Path(p).is_file():
            print(f"needle_agreement: {flag}: {p!r} does not exist; allowed: a records.jsonl of eval needle",
                  file=sys.stderr)
            return 2
    reference = {}
    for path in args.reference:
        reference.update(read(Path(path)))
    rows = compare(reference, read(Path(args.other)))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"reference": args.reference, "other": args.other, "configs": rows},
                                         indent=1) + "\n")
    print("| config | prompts in both | same found/not | same text | kept of exact's: reference | other |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    worse = False
    for config, r in rows.items():
        ref_k = f"{r['reference_kept']} of {r['reference_exact']}" if "reference_kept" in r else ""
        oth_k = f"{r['other_kept']} of {r['other_exact']}" if "other_kept" in r else ""
        print(f"| {config} | {r['prompts']} | {r['same_answer']} | {r['same_text']} | {ref_k} | {oth_k} |")
        if "other_kept" in r and r["reference_exact"] and r["other_exact"]:
            worse |= r["other_kept"] / r["other_exact"] < r["reference_kept"] / r["reference_exact"]
    if not rows:
        print("no prompt is in both runs (different lengths, depths or seeds?)")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
