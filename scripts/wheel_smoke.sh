#!/usr/bin/env bash
# Wheel smoke test (CI): build the wheel, install it non-editable in a fresh venv, and run the CLI
# from outside the repo, so every import can only come from the wheel. An editable install hides a package
# the wheel lacks (longpatch.parallel once was missing); this does not.
#
#   bash scripts/wheel_smoke.sh      # with the CI venv active (its python and pip build the wheel)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/longpatch-wheel-smoke.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
unset PYTHONPATH  # nothing but the fresh venv's site-packages may supply longpatch

fail() { echo "wheel smoke: FAILED: $*" >&2; exit 1; }

# 1. Build from a clean copy of the source (tracked and untracked-but-not-ignored files): setuptools reuses an
#    existing build/lib, so building in the checkout could ship stale files that the source no longer has.
mkdir -p "$tmp/src" "$tmp/wheel" "$tmp/run"
if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$repo" && git ls-files -z -co --exclude-standard \
        | while IFS= read -r -d '' f; do [[ -e $f ]] && printf '%s\0' "$f"; done \
        | tar --null -T - -cf -) | tar -xf - -C "$tmp/src"
else
    tar -C "$repo" --exclude=./.venv --exclude=./build --exclude=./dist --exclude=./runs --exclude='*.egg-info' \
        -cf - . | tar -xf - -C "$tmp/src"
fi
python -m pip wheel -q --no-deps -w "$tmp/wheel" "$tmp/src"
shopt -s nullglob
wheels=("$tmp"/wheel/longpatch-*.whl)
[[ ${#wheels[@]} -eq 1 ]] || fail "expected one longpatch wheel, got ${#wheels[@]}"
whl="${wheels[0]}"
nfiles="$(python -c 'import sys, zipfile; print(len(zipfile.ZipFile(sys.argv[1]).namelist()))' "$whl")"

# 2. A fresh venv: torch pinned first (the CPU wheel on this disk; an open range pulls a multi-GB CUDA
#    build), then the wheel itself, non-editable, its other dependencies from the package index.
python -m venv "$tmp/venv"
vpy="$tmp/venv/bin/python"
"$vpy" -m pip install -q torch==2.13.0
"$vpy" -m pip install -q "$whl"

# 3. Outside the repo, longpatch and its subpackages import from the venv's site-packages.
cd "$tmp/run"
site="$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$vpy" - "$site" <<'EOF' || fail "longpatch does not import from the installed wheel"
import os, sys
import longpatch, longpatch.parallel, longpatch.kernels, longpatch.configs  # noqa: E401
site = os.path.realpath(sys.argv[1])
for m in (longpatch, longpatch.parallel, longpatch.kernels, longpatch.configs):
    where = os.path.realpath(m.__file__)
    if not where.startswith(site + os.sep):
        sys.exit(f"{m.__name__} imports from {where}, not from {site}")
print(longpatch.__file__)
EOF

# 4. The CLI: the registry, then one sequence-parallel perplexity run (2 processes) on a tiny model.
lp="$tmp/venv/bin/longpatch"
"$lp" list
"$lp" eval ppl --model tiny:llama --tokenizer bytes --data demo --seq-len 64 --layer-counts 0,2 --method moba \
    --set params.chunk_size=16 --set params.topk=2 --set min_seq_len=0 --max-docs 1 --warmup 0 --no-progress \
    --sequence-parallel 2 --out "$tmp/ppl"
[[ -s "$tmp/ppl/results.json" ]] || fail "eval ppl --sequence-parallel 2 wrote no results.json"
"$vpy" -c 'import json, sys; r = json.load(open(sys.argv[1])); assert r["configs"], "no configs"' \
    "$tmp/ppl/results.json" || fail "results.json has no configs"

echo "wheel smoke: ok ($nfiles files in the wheel)"
