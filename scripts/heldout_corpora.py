"""Held-out corpora for the demo model: text it never saw in training and that no config is tuned on.

The demo model was trained on Python's standard library (scripts/build_demo_model.py); its own
held-out documents (`--data demo`) come from the same source. To see whether a selection still holds
on *other* text, this script builds, deterministically, from files shipped on this machine:

- ``code``: numpy's Python sources from the project's virtual environment (numpy/**/*.py), another
  project's style, names and docstrings (and long files whose blocks repeat: ufunc docs, tests);
- ``prose``: English text, the license texts in /usr/share/common-licenses and the README / NEWS /
  markdown files packages ship in /usr/share/doc (plain text only, no .gz);
- ``copies``: code whose positions copy long passages from far back, the text on which a selection
  that drops one distant block loses most. Libraries installed more than once on this machine (in the
  site-/dist-packages of its Pythons and in the ``_vendor`` folders inside them, such as ``packaging``,
  ``urllib3``, ``idna``, ``rich`` vendored by pip and setuptools, or the same version in two
  environments) give pairs of versions that match or differ slightly. A document is a passage A
  (several thousand tokens of one version's files, file by file, a long file cut at a line boundary),
  then other libraries' files, then the same files of the other version (A', a copy of A at a distance
  drawn per document), then more other files. Only files whose lines are mostly not the stdlib's (at
  most ``STDLIB_SHARE`` of their long lines occur in the stdlib the demo model read: this drops
  vendored backports such as tomli, importlib_metadata or setuptools' distutils) and numpy (the
  ``code`` corpus) are left out.

Per corpus, files are listed (sorted, deduplicated by content), shuffled with ``--seed``, and
concatenated (a one-line header naming each file) into ``--docs`` documents of ``--doc-tokens``
demo-tokenizer tokens each (a file longer than what a document still needs is cut at a line
boundary; the rest of it is not used). For ``copies`` the pairs of versions are taken library by
library in shuffled order, no file's content in two documents; if the machine holds too few pairs the
script says how many documents it could build and stops. Written under ``--out``:

- ``<corpus>/<subset>.jsonl``: the documents in LongBench's record format, which ``longpatch eval
  ppl --data <out>/<corpus>`` reads (subset ``lcc`` for code and copies and ``gov_report`` for prose:
  the reader wants LongBench subset names; the records are this text, not LongBench's);
- ``<corpus>_filler.jsonl``: the corpus's files in the same shuffled order (one record each) up to
  ``--filler-tokens`` tokens, as needle filler (``longpatch eval needle --filler``), so needles sit in
  this text (for ``copies``: its documents, one record each, up to ``--filler-tokens``);
- ``<corpus>_needle.yaml``: a needle template of a form of our own for that corpus (``--template``);
- ``manifest.json``: the seed, the files of every document (in order) and the token counts; for
  ``copies`` also, per document, the library, the two versions' folders, the copied files and the
  token offsets (in ``tokenizer(context)``, no special tokens) where A starts and ends, where A'
  starts and ends, their distance and the longest run of identical tokens A' repeats from A.

Run: ``python scripts/heldout_corpora.py --out runs/heldout`` (about 40 s; ``--corpora copies`` for
one). Tune on ``--data demo`` only; these corpora are for reporting. For more text never measured,
build another seed without the files an earlier build's documents used (``--exclude``, repeatable,
each an earlier ``manifest.json``; for ``copies`` any file with the same content is left out too):
``python scripts/heldout_corpora.py --out runs/heldout_s1 --seed 1 --docs 8 --exclude
docs/img/heldout/manifest.json``.
"""
from __future__ import annotations

import argparse
import bisect
import difflib
import functools
import glob
import hashlib
import json
import os
import random
import site
import sys
import sysconfig
from collections import defaultdict
from pathlib import Path

import numpy
import yaml

CORPORA = ("code", "prose", "copies")
SUBSET = {"code": "lcc", "prose": "gov_report", "copies": "lcc"}  # LongBench subset names the ppl reader accepts
# Needles of forms of our own (not the built-in passkey or `NAME = key` code templates), one per corpus,
# written as `eval needle --template` YAML files.
TEMPLATES = {
    # (an attribute form, `self.buffer_limit = key`, was found by exact attention in 1 of 3 tries: too
    # hard for the demo model to tell configs apart)
    "code": {"name": "heldout-code", "needle": "MAX_BUFFER_SIZE = {key}", "question": "assert MAX_BUFFER_SIZE =="},
    "prose": {"name": "heldout-prose", "needle": "The access code of the archive is {key}.",
              "question": "What is the access code of the archive? The access code of the archive is"},
    "copies": {"name": "heldout-copies", "needle": "MAX_BUFFER_SIZE = {key}", "question": "assert MAX_BUFFER_SIZE =="},
}
# copies: where the Pythons of this machine keep their packages (besides the running interpreter's own)
SITE_GLOBS = ("/usr/lib/python3*/dist-packages", "/usr/local/lib/python3*/dist-packages",
              "/usr/local/lib/python3*/site-packages", "~/.pyenv/versions/*/lib/python*/site-packages",
              "/usr/lib/google-cloud-sdk/platform/bundledpythonunix/lib/python*/site-packages")
SKIP_LIBS = {"numpy"}  # the code corpus
STDLIB_SHARE = 0.2  # a file with this share of its long lines (>= 24 characters, stripped) in the stdlib is left out
SIMILAR = 0.8  # a copied file and its source: at least this line similarity (difflib ratio)
PASSAGE = (0.125, 0.3)  # the copied passage A: a length drawn per document, as shares of --doc-tokens
MIN_RUN = 1000  # a document's A' repeats at least min(MIN_RUN, half of A) tokens of A unchanged


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


# ---- copies: a library's files, other text, then the same files of another version of the library ----

def site_dirs() -> list[Path]:
    """The site-/dist-packages folders of the Pythons on this machine (a stdlib's own files are never in one)."""
    dirs = [sysconfig.get_paths()[k] for k in ("purelib", "platlib")] + list(site.getsitepackages())
    for pattern in SITE_GLOBS:
        dirs += glob.glob(os.path.expanduser(pattern))
    return sorted({Path(d).resolve() for d in dirs if Path(d).is_dir() and Path(d).name.endswith("-packages")})


def library_locations() -> dict[str, list[Path]]:
    """Library name -> where it is installed (the top-level packages and modules of every site folder and of
    the ``_vendor`` folders inside them), for the libraries installed at least twice; sorted."""
    found = defaultdict(list)
    for d in site_dirs():
        for base in [d, *sorted(d.glob("*/_vendor"))]:
            for p in sorted(base.iterdir()):
                if p.name.startswith(("_", ".")) or p.is_symlink() or p.name.removesuffix(".py") in SKIP_LIBS:
                    continue
                if (p.is_dir() and "." not in p.name) or (p.is_file() and p.suffix == ".py"):
                    found[p.name].append(p)
    return {name: locs for name, locs in sorted(found.items()) if len(locs) >= 2}


@functools.lru_cache(maxsize=None)
def lib_files(loc: Path) -> dict[str, Path]:
    """A library's Python files by their path inside it, sorted (its own ``_vendor`` folder holds other libraries)."""
    if loc.is_file():
        return {loc.name: loc}
    return {str(p.relative_to(loc)): p for p in sorted(loc.rglob("*.py"))
            if p.is_file() and not p.is_symlink() and "_vendor" not in p.relative_to(loc).parts}


@functools.lru_cache(maxsize=None)
def read(path: Path) -> tuple[str, str] | None:
    """(text, sha256 of it) of a UTF-8 file; None if it is not one."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text, hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def stdlib_lines() -> frozenset[str]:
    """The long lines (stripped) of the stdlib the demo model was trained on: its *.py files outside
    site-packages, as scripts/demo_model/data.py lists them."""
    lines = set()
    for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"):
        if "site-packages" not in p.parts:
            try:
                lines.update(s for s in map(str.strip, p.read_text(encoding="utf-8").splitlines()) if len(s) >= 24)
            except (UnicodeDecodeError, OSError):
                continue
    return frozenset(lines)


def stdlib_like(text: str) -> bool:
    """Whether STDLIB_SHARE of the text's long lines are the stdlib's: a copy or backport of a stdlib module."""
    lines = {s for s in map(str.strip, text.splitlines()) if len(s) >= 24}
    return bool(lines) and len(lines & stdlib_lines()) >= STDLIB_SHARE * len(lines)


@functools.lru_cache(maxsize=None)
def usable(path: Path) -> str | None:
    """The content digest of a file a copies document may use (UTF-8, >= 1000 characters, not the stdlib's)."""
    got = read(path)
    return None if got is None or len(got[0]) < 1000 or stdlib_like(got[0]) else got[1]


def version_pairs(libs: dict[str, list[Path]]) -> dict[str, list[tuple[Path, Path]]]:
    """Per library, pairs of its installed copies: any two different versions, and two places of one version."""
    out = {}
    for name, locs in libs.items():
        versions = defaultdict(list)  # digest of (path, bytes) of all files -> places
        for loc in locs:
            h = hashlib.sha256()
            for rel, path in lib_files(loc).items():
                h.update(rel.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
            versions[h.hexdigest()].append(loc)
        heads = [v[0] for v in versions.values()]
        out[name] = [(a, b) for i, a in enumerate(heads) for b in heads[i + 1:]] + \
            [(v[0], v[1]) for v in versions.values() if len(v) > 1]
    return out


@functools.lru_cache(maxsize=None)
def similarity(a: Path, b: Path) -> float:
    """Line similarity (difflib's ratio, 1 for the same text) of two versions of a file."""
    ta, tb = read(a)[0], read(b)[0]
    if ta == tb:
        return 1.0
    sm = difflib.SequenceMatcher(None, ta.splitlines(), tb.splitlines())
    return sm.ratio() if sm.real_quick_ratio() >= SIMILAR and sm.quick_ratio() >= SIMILAR else 0.0


def matching_line(a: list[str], b: list[str], k: int) -> int:
    """The line of b that line k of a corresponds to (where a's first k lines end in b)."""
    j = 0
    for blk in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        if blk.a >= k:
            break
        j = blk.b + min(k - blk.a, blk.size)
    return min(j, len(b))


def ntok(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def cut_at(tok, text: str, need: int) -> str:
    """The text up to the line boundary at (about) its first ``need`` tokens."""
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    if need >= len(offsets):
        return text
    return text[:text.rfind("\n", 0, offsets[max(need, 0)][1]) + 1]


def filler_files(rng: random.Random, libs: dict[str, list[Path]], skip: str):
    """A document's other text: the files of the other libraries in shuffled order, one place each."""
    names = [n for n in libs if n != skip]
    rng.shuffle(names)
    for name in names:
        files = list(lib_files(rng.choice(libs[name])).values())
        rng.shuffle(files)
        yield from files


def copy_document(tok, rng: random.Random, libs: dict[str, list[Path]], name: str, src: Path, dst: Path,
                  doc_tokens: int, used: set[str], used_names: set[str]) -> tuple[dict, set[str]] | None:
    """(document, content digests it uses): [other text][A: files of ``src``][other text][A': the same files
    of ``dst``][other text], A' ending within the first doc_tokens tokens; None if the pair cannot give one."""
    header = "# file: {}\n"
    seen: set[str] = set()

    def fresh(path: Path) -> str | None:
        d = usable(path)
        return None if d is None or d in used or d in seen or str(path) in used_names else d

    fa, fb = lib_files(src), lib_files(dst)
    shared = [rel for rel in fa if rel in fb]
    if not shared:
        return None
    k = rng.randrange(len(shared))
    target = rng.randint(int(PASSAGE[0] * doc_tokens), int(PASSAGE[1] * doc_tokens))
    passage, copy, count = [], [], 0
    for rel in shared[k:] + shared[:k]:
        da, db = fresh(fa[rel]), fresh(fb[rel])
        if da is None or db is None or similarity(fa[rel], fb[rel]) < SIMILAR:
            continue
        ta, tb = read(fa[rel])[0].rstrip("\n") + "\n", read(fb[rel])[0].rstrip("\n") + "\n"
        piece = header.format(fa[rel]) + ta + "\n"
        n = ntok(tok, piece)
        if count + n > target + 256:  # cut A's file at a line boundary, and A''s where its lines end in it
            piece = cut_at(tok, piece, target - count)
            lines = piece.count("\n") - 1  # of the file (not the header)
            if lines < 8:
                break
            ta = "".join(ta.splitlines(keepends=True)[:lines])
            tb = "".join(tb.splitlines(keepends=True)[:matching_line(ta.splitlines(), tb.splitlines(), lines)])
            piece, n = header.format(fa[rel]) + ta + "\n", ntok(tok, header.format(fa[rel]) + ta + "\n")
        passage.append((fa[rel], piece))
        copy.append((fb[rel], header.format(fb[rel]) + tb + "\n"))
        seen.update((da, db))
        count += n
        if count >= target:
            break
    n_copy = sum(ntok(tok, p) for _, p in copy)
    lead = rng.randint(doc_tokens // 32, doc_tokens // 8)  # A not at the very start (where sinks sit)
    room = doc_tokens - 64 - lead - count - n_copy
    if count < PASSAGE[0] * doc_tokens or room < doc_tokens // 32:
        return None
    files = filler_files(rng, libs, name)

    def fill(need: int) -> list[tuple[Path, str]]:
        pieces, got = [], 0
        for path in files:
            d = fresh(path)
            if d is None:
                continue
            piece = header.format(path) + read(path)[0].rstrip("\n") + "\n\n"
            n = ntok(tok, piece)
            if got + n > need + 128:
                piece, n = cut_at(tok, piece, need - got), need - got
                if piece.count("\n") < 4:
                    break
            pieces.append((path, piece))
            seen.add(d)
            got += n
            if got >= need:
                break
        return pieces

    lead_p, middle = fill(lead), fill(rng.randint(doc_tokens // 32, room))
    used_so_far = sum(ntok(tok, p) for _, p in lead_p + passage + middle + copy)
    parts = lead_p + passage + middle + copy + fill(doc_tokens + 256 - used_so_far)
    text = "".join(p for _, p in parts)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, starts = enc["input_ids"], [o[0] for o in enc["offset_mapping"]]
    chars = [0]
    for _, p in parts:
        chars.append(chars[-1] + len(p))
    i0, i1 = len(lead_p), len(lead_p) + len(passage)
    j0, j1 = i1 + len(middle), i1 + len(middle) + len(copy)
    a, a_end, c, c_end = (bisect.bisect_left(starts, chars[i]) for i in (i0, i1, j0, j1))
    if c_end > doc_tokens or len(ids) < doc_tokens:
        return None
    m = difflib.SequenceMatcher(None, ids[a:a_end], ids[c:c_end], autojunk=False).find_longest_match(
        0, a_end - a, 0, c_end - c)
    if m.size < min(MIN_RUN, (a_end - a) // 2):
        return None
    same = sum(read(p)[1] == read(q)[1] for (p, _), (q, _) in zip(passage, copy))
    info = {"library": name, "source": str(src), "copy": str(dst), "copied_files": [str(p.relative_to(src))
            if p != src else p.name for p, _ in passage], "identical_files": same, "start": a, "end": a_end,
            "copy_start": c, "copy_end": c_end, "distance": c - a, "longest_run": m.size,
            "longest_run_at": [a + m.a, c + m.b]}
    return {"files": [str(p) for p, _ in parts], "text": text, "tokens": len(ids), "copy": info}, seen


def build_copies(tok, docs: int, doc_tokens: int, seed: int, filler_tokens: int,
                 used_names: set[str]) -> tuple[list, list]:
    """(documents, filler records) of the copies corpus: the libraries in shuffled order, one pair of versions
    of each per round, until ``docs`` documents; no file content in two of them or in an excluded build's."""
    rng = random.Random(f"{seed}|copies")
    libs = library_locations()
    used = {got[1] for n in sorted(used_names) if (got := read(Path(n))) is not None}
    queues = {name: rng.sample(pairs, len(pairs)) for name, pairs in version_pairs(libs).items() if pairs}
    order = list(queues)
    rng.shuffle(order)
    out = []
    while len(out) < docs and any(queues.values()):
        for name in order:
            if len(out) == docs or not queues[name]:
                continue
            src, dst = queues[name].pop()
            if rng.random() < 0.5:
                src, dst = dst, src
            got = copy_document(tok, rng, libs, name, src, dst, doc_tokens, used, used_names)
            if got is not None:
                out.append(got[0])
                used |= got[1]
    if len(out) < docs:
        sys.exit(f"heldout_corpora: copies: this machine's libraries give only {len(out)} documents of {doc_tokens} "
                 f"tokens with a copied passage (pairs of installed versions, unused files); need {docs}")
    filler, total = [], 0  # the documents themselves: needles among passages and their copies
    for i, d in enumerate(out):
        if total >= filler_tokens:
            break
        filler.append({"context": d["text"], "file": f"heldout-copies-{i}"})
        total += d["tokens"]
    return out, filler


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/heldout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpora", default=",".join(CORPORA), help=f"comma-separated, of {', '.join(CORPORA)}")
    ap.add_argument("--docs", type=int, default=4, help="documents per corpus (perplexity)")
    ap.add_argument("--doc-tokens", type=int, default=16640, help="tokens per document (>= the ppl --seq-len)")
    ap.add_argument("--filler-tokens", type=int, default=160000, help="tokens of needle filler per corpus")
    ap.add_argument("--exclude", action="append", default=[], metavar="MANIFEST",
                    help="an earlier build's manifest.json: the files its documents used are left out (repeatable)")
    args = ap.parse_args(argv)
    corpora = [c for c in args.corpora.split(",") if c]
    if not corpora or set(corpora) - set(CORPORA):
        sys.exit(f"heldout_corpora: --corpora {args.corpora}: name some of {', '.join(CORPORA)}")
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
    for corpus in corpora:
        used = used_files([Path(m) for m in args.exclude], corpus)
        if corpus == "copies":
            docs, filler = build_copies(tok, args.docs, args.doc_tokens, args.seed, args.filler_tokens, used)
        else:
            files = code_files() if corpus == "code" else prose_files()
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
        manifest["corpora"][corpus] = {"subset": subset, "documents": [{k: v for k, v in d.items() if k != "text"}
                                                                       for d in docs],
                                       "filler_files": [r["file"] for r in filler], "filler_tokens": filler_tokens}
        print(f"{corpus}: {len(docs)} documents of {[d['tokens'] for d in docs]} tokens; filler {len(filler)} files, "
              f"{filler_tokens} tokens")
        if corpus == "copies":
            cp = [d["copy"] for d in docs]
            print(f"copies: libraries {[c['library'] for c in cp]}; copy distances {[c['distance'] for c in cp]}; "
                  f"longest copied runs {[c['longest_run'] for c in cp]}")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
