"""Held-out corpora for the demo model: text it never saw in training and that no config is tuned on.

The demo model was trained on Python's standard library (scripts/build_demo_model.py); its own
held-out documents (`--data demo`) come from the same source. To see whether a selection still holds
on *other* text, this script builds, deterministically, from files shipped on this machine:

- ``code``: numpy's Python sources from the project's virtual environment (numpy/**/*.py), another
  project's style, names and docstrings (and long files whose blocks repeat: ufunc docs, tests);
- ``prose``: English text, the license texts in /usr/share/common-licenses and the README / NEWS /
  markdown files packages ship in /usr/share/doc (plain text only, no .gz).

Per corpus, files are listed (sorted, deduplicated by content), shuffled with ``--seed``, and
concatenated (a one-line header naming each file) into ``--docs`` documents of ``--doc-tokens``
demo-tokenizer tokens each (a file longer than what a document still needs is cut at a line
boundary; the rest of it is not used). Written under ``--out``:

- ``<corpus>/<subset>.jsonl``: the documents in LongBench's record format, which ``longpatch eval
  ppl --data <out>/<corpus>`` reads (subset ``lcc`` for code and ``gov_report`` for prose: the
  reader wants LongBench subset names; the records are this text, not LongBench's);
- ``<corpus>_filler.jsonl``: the corpus's files in the same shuffled order (one record each) up to
  ``--filler-tokens`` tokens, as needle filler
  (``longpatch eval needle --filler``), so needles sit in this text;
- ``<corpus>_needle.yaml``: a needle template of a form of our own for that corpus (``--template``);
- ``manifest.json``: the seed, the files of every document (in order) and the token counts.

Run: ``python scripts/heldout_corpora.py --out runs/heldout`` (about 20 s). Tune on ``--data demo``
only; these corpora are for reporting. For more text never measured, build another seed without the
files an earlier build's documents used (``--exclude``, repeatable, each an earlier ``manifest.json``):
``python scripts/heldout_corpora.py --out runs/heldout_s1 --seed 1 --docs 8 --exclude
docs/img/heldout/manifest.json``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path

import numpy
import yaml

SUBSET = {"code": "lcc", "prose": "gov_report"}  # LongBench subset names the ppl reader accepts
# Needles of forms of our own (not the built-in passkey or `NAME = key` code templates), one per corpus,
# written as `eval needle --template` YAML files.
TEMPLATES = {
    # (an attribute form, `self.buffer_limit = key`, was found by exact attention in 1 of 3 tries: too
    # hard for the demo model to tell configs apart)
    "code": {"name": "heldout-code", "needle": "MAX_BUFFER_SIZE = {key}", "question": "assert MAX_BUFFER_SIZE =="},
    "prose": {"name": "heldout-prose", "needle": "The access code of the archive is {key}.",
              "question": "What is the access code of the archive? The access code of the archive is"},
}


def code_files() -> list[Path]:
    root = Path(numpy.__file__).parent
    return sorted(p for p in root.rglob("*.py") if p.stat().st_size >= 2000)


def prose_files() -> list[Path]:
    files = [p for p in Path("/usr/share/common-licenses").iterdir() if p.is_file()]
    for p in Path("/usr/share/doc").rglob("*"):
        name = p.name.lower()
        if p.is_file() and not p.is_symlink() and not name.endswith(".gz") and (
                name.startswith(("readme", "news", "todo", "bugs", "thanks")) or name.endswith(".md")) \
                and "changelog" not in name:  # commit lists, not prose
            files.append(p)
    return sorted(p for p in files if p.stat().st_size >= 1000)


def read_unique(files: list[Path]) -> list[tuple[str, str]]:
    """(name, text) of the UTF-8 files, the first of each distinct content (symlinked licenses)."""
    numpy_root = Path(numpy.__file__).parent
    seen, out = set(), []
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest not in seen and text.strip():
            seen.add(digest)
            # the name without this machine's prefix: numpy/..., /usr/share/...
            out.append((str(p.relative_to(numpy_root.parent)) if p.is_relative_to(numpy_root) else str(p), text))
    return out


def used_files(manifests: list[Path], corpus: str) -> set[str]:
    """The files (as named in a manifest) that earlier builds' documents of ``corpus`` used."""
    used = set()
    for m in manifests:
        for doc in json.loads(m.read_text())["corpora"].get(corpus, {}).get("documents", []):
            used.update(doc["files"])
    return used


def build(corpus: str, files: list[tuple[str, str]], tok, docs: int, doc_tokens: int, seed: int,
          filler_tokens: int) -> tuple[list, list]:
    """(documents, filler records): documents of at least doc_tokens tokens from the shuffled files."""
    order = list(files)
    random.Random(f"{seed}|{corpus}").shuffle(order)
    header = "# file: {}\n" if corpus == "code" else "==== {} ====\n"
    out, cur, parts, count = [], "", [], 0
    for name, text in order:
        if len(out) == docs:
            break
        piece = header.format(name) + text.rstrip("\n") + "\n\n"
        n = len(tok(piece, add_special_tokens=False)["input_ids"])
        if count + n > doc_tokens + 512:  # cut at a line boundary near what the document still needs
            need = doc_tokens + 256 - count
            ids = tok(piece, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
            end = piece.rfind("\n", 0, ids[min(need, len(ids) - 1)][1]) + 1
            piece, n = piece[:end], need
        cur, count = cur + piece, count + n
        parts.append(name)
        if count >= doc_tokens + 64:
            out.append({"files": parts, "text": cur, "tokens": len(tok(cur, add_special_tokens=False)["input_ids"])})
            cur, parts, count = "", [], 0
    if len(out) < docs:
        sys.exit(f"heldout_corpora: {corpus} has only {len(out)} documents of {doc_tokens} tokens; need {docs}")
    filler, total = [], 0  # the shuffled files up to filler_tokens: room for 32k prompts at any seed
    for name, text in order:
        if total >= filler_tokens:
            break
        filler.append({"context": header.format(name) + text, "file": name})
        total += len(tok(filler[-1]["context"], add_special_tokens=False)["input_ids"])
    return out, filler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/heldout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--docs", type=int, default=4, help="documents per corpus (perplexity)")
    ap.add_argument("--doc-tokens", type=int, default=16640, help="tokens per document (>= the ppl --seq-len)")
    ap.add_argument("--filler-tokens", type=int, default=160000, help="tokens of needle filler per corpus")
    ap.add_argument("--exclude", action="append", default=[], metavar="MANIFEST",
                    help="an earlier build's manifest.json: the files its documents used are left out (repeatable)")
    args = ap.parse_args()
    for m in args.exclude:
        try:
            json.loads(Path(m).read_text())["corpora"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            sys.exit(f"heldout_corpora: --exclude {m}: not a manifest.json of this script ({type(e).__name__})")
    from transformers import AutoTokenizer

    from longpatch.assets import demo_model_path

    tok = AutoTokenizer.from_pretrained(demo_model_path())
    out = Path(args.out)
    manifest = {"seed": args.seed, "doc_tokens": args.doc_tokens, "excluded": args.exclude, "corpora": {}}
    for corpus, files in (("code", code_files()), ("prose", prose_files())):
        used = used_files([Path(m) for m in args.exclude], corpus)
        fresh = [f for f in read_unique(files) if f[0] not in used]
        docs, filler = build(corpus, fresh, tok, args.docs, args.doc_tokens, args.seed, args.filler_tokens)
        subset = SUBSET[corpus]
        (out / corpus).mkdir(parents=True, exist_ok=True)
        with open(out / corpus / f"{subset}.jsonl", "w", encoding="utf-8") as f:
            for i, d in enumerate(docs):
                rec = {"input": "", "context": d["text"], "answers": [], "length": d["tokens"], "dataset": subset,
                       "language": "en", "all_classes": None, "_id": f"heldout-{corpus}-{i}"}
                f.write(json.dumps(rec) + "\n")
        with open(out / f"{corpus}_filler.jsonl", "w", encoding="utf-8") as f:
            for rec in filler:
                f.write(json.dumps(rec) + "\n")
        (out / f"{corpus}_needle.yaml").write_text(yaml.safe_dump(TEMPLATES[corpus], sort_keys=False))
        filler_tokens = sum(len(tok(r["context"], add_special_tokens=False)["input_ids"]) for r in filler)
        manifest["corpora"][corpus] = {"subset": subset, "documents": [{"files": d["files"], "tokens": d["tokens"]}
                                                                       for d in docs],
                                       "filler_files": [r["file"] for r in filler], "filler_tokens": filler_tokens}
        print(f"{corpus}: {len(docs)} documents of {[d['tokens'] for d in docs]} tokens; filler {len(filler)} files, "
              f"{filler_tokens} tokens")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
