#!/usr/bin/env bash
# CI (issue 29): the contract, patching (families), cache, bench generate and README tests against the lowest supported transformers release
# (.ci/transformers-floor.txt), in a venv of their own; the main venv tests the newest release pip resolves.
#
#   bash scripts/transformers_floor.sh      # ~3 min: an install, then ~200 tests
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${FLOOR_VENV:-$repo/.venv-floor}"
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install -q torch==2.13.0  # the CPU wheel on this disk (an open range pulls a CUDA build)
pip install -q -e "$repo[dev]" -c "$repo/.ci/transformers-floor.txt"
python -c "import transformers; print('transformers floor:', transformers.__version__)"
cd "$repo"
python -m pytest -q tests/test_contract.py tests/test_patching.py tests/test_cache.py tests/test_bench_generate.py \
    tests/test_readme.py
